package device

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/limiter"
)

// Loop is a device's control loop: its adjuster, the actuator through
// which the adjuster's shares reach the models on the device, and the
// sampling of each model's use of the device.
type Loop struct {
	d      *Device
	models Models
	log    *slog.Logger
	adj    *control.Adjuster
	usage  usageBoard // written by sample, read by adj
}

// NewLoop builds the control loop of d over the models on it; Run runs
// it.
func NewLoop(d *Device, models Models) (*Loop, error) {
	l := &Loop{d: d, models: models, log: d.log}
	ctl, opts := d.opts.Control, d.opts
	adj, err := control.NewAdjuster(d.sched, control.AdjusterOptions{
		Policy:         ctl.Policy,
		Period:         ctl.Period,
		Headroom:       ctl.Headroom,
		Quantile:       ctl.Quantile,
		MaxUtilization: ctl.MaxUtilization,
		ScaleDownAfter: ctl.ScaleDownAfter,
		Cooldown:       ctl.Cooldown,
		Step:           ctl.Step,
		MinShare:       ctl.MinShare,
		MemoryBudget:   int64(ctl.MemoryBudget),
		MemoryFloor:    d.lim.Capabilities().MinMemory, // 0: the adjuster's default
		KeepAlive:      ctl.KeepAlive,
		Predictor:      opts.Predictor,
		Actuator:       actuator{models: models, device: d.name},
		Usage:          l.usage.get,
		CapsOnly:       d.lim.Capabilities().CapsOnly,
		Background:     d.lim.Capabilities().Background,
		Logger:         opts.Logger, // the adjuster adds its component, policy and device
		Registerer:     opts.Registerer,
		Device:         d.name,
	})
	if err != nil {
		return nil, fmt.Errorf("device %s: adjuster: %w", d.name, err)
	}
	l.adj = adj
	return l, nil
}

// Run runs the adjuster and the usage sampling until ctx ends, and
// returns once both have.
func (l *Loop) Run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := l.adj.Run(ctx); err != nil {
			l.log.Error("adjuster stopped", "err", err)
		}
	})
	wg.Go(func() { l.sample(ctx.Done()) })
	wg.Wait()
}

func (l *Loop) Device() *Device             { return l.d }
func (l *Loop) Adjuster() *control.Adjuster { return l.adj }

// Usage is a model's recent use of the device, smoothed, as the adjuster
// reads it; false before it has been measured.
func (l *Loop) Usage(model string) (float64, bool) { return l.usage.get(model) }

// sample tells the predictor, once a control period, how much of the
// device each model's co-located models used (CPU seconds of their
// limiter units over the period, as a fraction of the device), so that its
// predictions scale when the device is oversubscribed (on a GPU, so that
// it learns how much the co-runners slow the model), and records each
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
				// Not the oversubscription factor on MPS: it reads a
				// share as that much of the device in use and would
				// make a larger cap look slower, and MPS caps may add
				// up to more than the device (the adjuster lets them).
				// What co-running clients cost (the SMs split while
				// they oversubscribe, their memory bandwidth) the
				// predictor learns from the others' measured use.
				for name, u := range used {
					pred.SetCoRunning(name, total-u)
				}
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
