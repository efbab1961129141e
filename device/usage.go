package device

import (
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sloserve/sloserve/limiter"
)

// Where a model's use of its device came from (the source label of
// sloserve_device_use).
const (
	useMeasured  = "measured"  // the limiter measured it: cgroup CPU time, NVML per-process utilisation
	useEstimated = "estimated" // execution time times cap: NVML had no reading for the model
)

// NewUseGauge registers sloserve_device_use, which every device of a
// server writes; nil reg registers nothing.
func NewUseGauge(reg prometheus.Registerer) (*prometheus.GaugeVec, error) {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "sloserve_device_use",
		Help: "Each model's use of its device over the last control period, fraction of the device, as the adjuster reads it (before smoothing); source says whether it was measured or estimated.",
	}, []string{"model", "device", "source"})
	if reg != nil {
		if err := reg.Register(g); err != nil {
			return nil, fmt.Errorf("registering sloserve_device_use: %w", err)
		}
	}
	return g, nil
}

// usageBoard holds each model's recent use of its device, smoothed: the
// telemetry the adjuster reads (AdjusterOptions.Usage).
type usageBoard struct {
	mu sync.Mutex
	m  map[string]float64
}

// usageWeight is the weight of each period's sample in the smoothed use.
const usageWeight = 0.3

func (b *usageBoard) record(seen map[string]float64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	next := make(map[string]float64, len(seen))
	for name, u := range seen {
		if old, ok := b.m[name]; ok {
			u = old + usageWeight*(u-old)
		}
		next[name] = u
	}
	b.m = next
}

func (b *usageBoard) get(model string) (float64, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	u, ok := b.m[model]
	return u, ok
}

// Usage is a model's recent use of the device, smoothed, as the adjuster
// reads it; false before it has been measured.
func (l *Loop) Usage(model string) (float64, bool) { return l.usage.get(model) }

// sample tells the predictor, once a control period, how much of the
// device each model's co-located models used (CPU seconds of their
// limiter units over the period, as a fraction of the device), so that its
// predictions scale when the device is oversubscribed, and records each
// model's use for the adjuster (usageBoard). Where the device is not the
// CPU (limiter.MeterDeviceTime: a GPU under MPS) a model's use is what the
// limiter measured for its runners' processes (limiter.UsageReader:
// per-process SM utilisation, summed over its instances), or, when it has
// no reading for it, its execution time times its cap.
func (l *Loop) sample(done <-chan struct{}) {
	d := l.d
	metering := d.lim.Capabilities().Metering
	if metering == limiter.MeterNone {
		return // no unit to read usage from
	}
	// On a GPU (MPS) no CPU time measures a model's use of the device:
	// its executions do (seconds of them, from the predictor, per second),
	// each holding up to its cap of the SMs while it runs. No model runs
	// in the background there: a best-effort cap does not yield.
	gpu := metering == limiter.MeterDeviceTime
	tick := time.NewTicker(d.opts.Control.Period)
	defer tick.Stop()
	last := map[string]float64{}
	lastAt := time.Now()
	models, pred := l.models, d.opts.Predictor
	for {
		select {
		case <-done:
			return
		case now := <-tick.C:
			dt := now.Sub(lastAt).Seconds()
			lastAt = now
			used := map[string]float64{}
			next := map[string]float64{} // models gone since are forgotten
			// On a GPU, the limiter's per-process reading, read once for
			// the device, measures what each model's runners used.
			var measured map[string]float64
			if gpu {
				measured = l.measuredUsage()
			}
			// Background models yield to the others at once, so they slow
			// only each other.
			background := map[string]bool{}
			source := map[string]string{}
			var total, foreground float64
			for _, ms := range l.adj.Shares() {
				// The adjuster's view is as old as its last pass; a
				// version unloaded since is not fed (that would bring
				// back what the predictor forgot of it).
				if _, err := models.Share(ms.Model); err != nil {
					continue
				}
				var cpu float64
				if gpu {
					cpu = pred.Busy(ms.Model)
				} else {
					cpu = models.UnitStats(ms.Model).CPUSeconds
				}
				if u, ok := models.MeasuredUsage(ms.Model, measured); ok {
					used[ms.Model] = u
					source[ms.Model] = useMeasured
					total += u
					foreground += u
				} else if prev, ok := last[ms.Model]; ok && cpu >= prev && dt > 0 {
					source[ms.Model] = useMeasured
					if gpu {
						// No reading for the model: estimate.
						used[ms.Model] = (cpu - prev) / dt * limiter.LimitedOrWhole(ms.Share.Compute)
						source[ms.Model] = useEstimated
					} else {
						used[ms.Model] = (cpu - prev) / dt / float64(max(1, d.lim.CPUs()))
					}
					total += used[ms.Model]
					if !gpu && ms.Share.Mode == limiter.ModeBackground {
						background[ms.Model] = true
					} else {
						foreground += used[ms.Model]
					}
				}
				next[ms.Model] = cpu
			}
			last = next
			l.usage.record(used)
			if g := d.opts.UseGauge; g != nil {
				g.DeletePartialMatch(prometheus.Labels{"device": d.name})
				for name, u := range used {
					g.WithLabelValues(name, d.name, source[name]).Set(u)
				}
			}
			if gpu {
				// Not on MPS: the predictor's factor reads a share as
				// that much of the device in use and would make a
				// larger cap look slower. MPS caps may add up to more
				// than the device (the adjuster lets them), and what
				// co-running clients cost, the SMs split while they
				// oversubscribe and their memory bandwidth, is in the
				// online correction.
				continue
			}
			for name, u := range used {
				if background[name] {
					pred.SetInterference(name, total-u)
				} else {
					pred.SetInterference(name, foreground-u)
				}
			}
		}
	}
}

// measuredUsage is the device's use by each limiter unit since the last
// call, as the limiter measures it (limiter.UsageReader: NVML's
// per-process utilisation under MPS); nil when it cannot say.
func (l *Loop) measuredUsage() map[string]float64 {
	d := l.d
	r, ok := d.lim.(limiter.UsageReader)
	if !ok {
		return nil
	}
	use, err := r.Usage()
	if err != nil {
		d.log.Debug("per-process GPU utilisation", "err", err)
		return nil
	}
	return use
}
