package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/predictor"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/simgpu"
)

// devices holds what each execution device ("cpu", "cuda:0") has, created
// when the first model on it loads: a QoS scheduler, a limiter and an
// adjuster. One predictor serves every device (model keys are unique). The
// loops run until the server stops.
type devices struct {
	ctx  context.Context
	qos  configs.QoS
	ctl  configs.Control
	reg  prometheus.Registerer
	log  *slog.Logger
	pred *predictor.Predictor
	// gate is the one admission limit on requests in flight, shared by
	// every device's scheduler; a config reload changes its limits.
	gate *qos.Gate

	// registry is the adjusters' actuator; set once it exists, before any
	// model loads.
	registry *models.Registry
	// sim, when set, is the simulated machine cuda devices are on; rec
	// recovers its devices from faults.
	sim *simgpu.Sim
	rec *recovery
	// place, when set, places cuda models across the devices
	// (placement.go).
	place *placement

	// use is each model's use of its device as the adjuster reads it,
	// by where it came from (sloserve_device_use).
	use *prometheus.GaugeVec

	mu    sync.Mutex
	byDev map[string]*device
	loops sync.WaitGroup
}

// Where a model's use of its device came from (the source label of
// sloserve_device_use).
const (
	useMeasured  = "measured"  // the limiter measured it: cgroup CPU time, NVML per-process utilisation
	useEstimated = "estimated" // execution time times cap: NVML had no reading for the model
)

// newUseGauge registers sloserve_device_use; nil reg registers nothing.
func newUseGauge(reg prometheus.Registerer) (*prometheus.GaugeVec, error) {
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

// device is one execution device's control parts.
type device struct {
	name  string
	sched *qos.Scheduler
	lim   limiter.Limiter
	adj   *control.Adjuster
	usage usageBoard // written by sampleInterference, read by adj
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

func newDevices(ctx context.Context, cfg *configs.Server, reg prometheus.Registerer, log *slog.Logger) (*devices, error) {
	pred, err := predictor.New(predictor.Options{Registerer: reg})
	if err != nil {
		return nil, err
	}
	gate := qos.NewGate(cfg.Limits.MaxInflightRequests, int64(cfg.Limits.MaxInflightBytes))
	if reg != nil {
		if err := reg.Register(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "sloserve_requests_refused_unread_total",
			Help: "gRPC inference calls refused at limits.max_inflight_requests before their message (and model) was read; no model's count has them.",
		}, func() float64 { return float64(gate.RefusedUnread()) })); err != nil {
			return nil, fmt.Errorf("registering sloserve_requests_refused_unread_total: %w", err)
		}
	}
	use, err := newUseGauge(reg)
	if err != nil {
		return nil, err
	}
	return &devices{ctx: ctx, qos: cfg.QoS, ctl: cfg.Control, reg: reg, log: log, pred: pred, gate: gate, use: use, byDev: map[string]*device{}}, nil
}

// newLimiter starts a device's limiter as the control config says. The
// shared policy sets no limits, so under auto it gets none.
// On a simulated GPU it reads the simulator's NVML and MPS daemon.
func newLimiter(ctl configs.Control, device string, sim *simgpu.Sim, log *slog.Logger) (limiter.Limiter, error) {
	backend := ctl.Limiter
	if ctl.Policy == control.SharePolicyShared && backend == limiter.BackendAuto {
		backend = limiter.BackendNone
	}
	opts := limiter.Options{Backend: backend, Device: device, Period: ctl.CFSPeriod, Logger: log}
	if simulatedDevice(sim, device) != nil {
		if err := simulatedLimiterOptions(sim, &opts); err != nil {
			return nil, err
		}
	}
	return limiter.New(opts)
}

// backgroundsBestEffort reports whether the device runs best-effort work
// behind latency-critical work: the adaptive policy on a cgroup limiter
// puts best-effort runners in the background (limiter.ModeBackground) where
// the limiter has a background class, so
// the scheduler may give each class slots of its own.
func backgroundsBestEffort(policy string, lim limiter.Limiter) bool {
	return policy == control.SharePolicyAdaptive && lim.Capabilities().Background
}

// scheduler is the registry's Options.Scheduler.
func (ds *devices) scheduler(name string) (*qos.Scheduler, error) {
	d, err := ds.get(name)
	if err != nil {
		return nil, err
	}
	return d.sched, nil
}

// limiter is the registry's Options.Limiter. When the device cannot start,
// nil: the model's instances start unlimited and its scheduling then fails
// with the device's error.
func (ds *devices) limiter(name string) limiter.Limiter {
	d, err := ds.get(name)
	if err != nil {
		return nil
	}
	return d.lim
}

// get returns a device, starting its scheduler, limiter and adjuster on
// first use.
func (ds *devices) get(name string) (*device, error) {
	ds.mu.Lock()
	defer ds.mu.Unlock()
	if d, ok := ds.byDev[name]; ok {
		return d, nil
	}
	log := ds.log.With("device", name)
	floor := ds.qos.BestEffortFloor
	if floor == 0 {
		floor = -1 // configs says 0 means none; qos reads 0 as its default
	}
	beBound := ds.qos.MaxBestEffortExecution
	if beBound == 0 {
		beBound = -1 // the same
	}
	lim, err := newLimiter(ds.ctl, name, ds.sim, log.With("component", "limiter"))
	if err != nil {
		return nil, fmt.Errorf("device %s: limiter: %w", name, err)
	}
	slots := deviceSlots(name, ds.qos.DeviceSlots, lim, ds.sim)
	log.Info("limiter", "kind", lim.Kind(), "detail", lim.Describe())
	sched, err := qos.NewScheduler(qos.Options{
		Policy:                 ds.qos.Policy,
		BestEffortFloor:        floor,
		DeviceSlots:            slots,
		MaxBestEffortExecution: beBound,
		SeparateClasses:        backgroundsBestEffort(ds.ctl.Policy, lim),
		Estimator:              ds.pred,
		Logger:                 log, // qos adds its component
		Registerer:             ds.reg,
		Device:                 name,
		Window:                 ds.qos.Window,
		Gate:                   ds.gate,
	})
	if err != nil {
		lim.Close()
		return nil, err
	}
	d := &device{name: name, sched: sched, lim: lim}
	caps := lim.Capabilities()
	adj, err := control.NewAdjuster(sched, control.AdjusterOptions{
		Policy:         ds.ctl.Policy,
		Period:         ds.ctl.Period,
		Headroom:       ds.ctl.Headroom,
		Quantile:       ds.ctl.Quantile,
		MaxUtilization: ds.ctl.MaxUtilization,
		ScaleDownAfter: ds.ctl.ScaleDownAfter,
		Cooldown:       ds.ctl.Cooldown,
		Step:           ds.ctl.Step,
		MinShare:       ds.ctl.MinShare,
		MemoryBudget:   int64(ds.ctl.MemoryBudget),
		MemoryFloor:    caps.MinMemory, // 0: the adjuster's default
		KeepAlive:      ds.ctl.KeepAlive,
		Predictor:      ds.pred,
		Actuator:       deviceActuator{reg: ds.registry, device: name},
		Usage:          d.usage.get,
		CapsOnly:       caps.CapsOnly,
		Logger:         log.With("component", "adjuster"),
		Registerer:     ds.reg,
		Device:         name,
	})
	if err != nil {
		lim.Close()
		return nil, fmt.Errorf("device %s: adjuster: %w", name, err)
	}
	d.adj = adj
	ds.byDev[name] = d
	ds.loops.Go(func() {
		if err := sched.Run(ds.ctx); err != nil {
			log.Error("scheduler stopped", "err", err)
		}
	})
	ds.loops.Go(func() {
		if err := adj.Run(ds.ctx); err != nil {
			log.Error("adjuster stopped", "err", err)
		}
	})
	ds.loops.Go(func() { ds.sampleInterference(d) })
	log.Info("device started", "policy", ds.qos.Policy, "slots", slots, "share_policy", adj.Policy())
	return d, nil
}

// sampleInterference tells the predictor, once a control period, how much
// of the device each model's co-located models used (CPU seconds of their
// limiter units over the period, as a fraction of the device), so that its
// predictions scale when the device is oversubscribed, and records each
// model's use for the adjuster (usageBoard). On a GPU under MPS a model's
// use is what NVML measured for its runners' processes (per-process SM
// utilisation, summed over its instances), or, when NVML has no reading
// for it, its execution time times its cap.
func (ds *devices) sampleInterference(d *device) {
	metering := d.lim.Capabilities().Metering
	if metering == limiter.MeterNone || ds.registry == nil {
		return // no unit to read usage from
	}
	// On a GPU (MPS) no CPU time measures a model's use of the device:
	// its executions do (seconds of them, from the predictor, per second),
	// each holding up to its cap of the SMs while it runs. No model runs
	// in the background there: a best-effort cap does not yield.
	gpu := metering == limiter.MeterDeviceTime
	tick := time.NewTicker(ds.ctl.Period)
	defer tick.Stop()
	last := map[string]float64{}
	lastAt := time.Now()
	for {
		select {
		case <-ds.ctx.Done():
			return
		case now := <-tick.C:
			dt := now.Sub(lastAt).Seconds()
			lastAt = now
			used := map[string]float64{}
			next := map[string]float64{} // models gone since are forgotten
			// On a GPU, NVML's per-process utilisation, read once for the
			// device, measures what each model's runners used.
			var measured map[string]float64
			if gpu {
				measured = ds.measuredUsage(d)
			}
			// Background models yield to the others at once, so they slow
			// only each other.
			background := map[string]bool{}
			source := map[string]string{}
			var total, foreground float64
			for _, ms := range d.adj.Shares() {
				// The adjuster's view is as old as its last pass; a
				// version unloaded since is not fed (that would bring
				// back what the predictor forgot of it).
				if _, err := ds.registry.Share(ms.Model); err != nil {
					continue
				}
				var cpu float64
				if gpu {
					cpu = ds.pred.Busy(ms.Model)
				} else {
					cpu = ds.registry.UnitStats(ms.Model).CPUSeconds
				}
				if u, ok := ds.registry.MeasuredUsage(ms.Model, measured); ok {
					used[ms.Model] = u
					source[ms.Model] = useMeasured
					total += u
					foreground += u
				} else if prev, ok := last[ms.Model]; ok && cpu >= prev && dt > 0 {
					source[ms.Model] = useMeasured
					if gpu {
						// No reading for the model: estimate.
						used[ms.Model] = (cpu - prev) / dt * limitedOrWhole(ms.Share.Compute)
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
			d.usage.record(used)
			ds.use.DeletePartialMatch(prometheus.Labels{"device": d.name})
			for name, u := range used {
				ds.use.WithLabelValues(name, d.name, source[name]).Set(u)
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
					ds.pred.SetInterference(name, total-u)
				} else {
					ds.pred.SetInterference(name, foreground-u)
				}
			}
		}
	}
}

// measuredUsage is the device's use by each limiter unit since the last
// call, as the limiter measures it (limiter.UsageReader: NVML's
// per-process utilisation under MPS); nil when it cannot say.
func (ds *devices) measuredUsage(d *device) map[string]float64 {
	r, ok := d.lim.(limiter.UsageReader)
	if !ok {
		return nil
	}
	use, err := r.Usage()
	if err != nil {
		ds.log.Debug("per-process GPU utilisation", "device", d.name, "err", err)
		return nil
	}
	return use
}

// lookup returns a device that has started, nil if none has.
func (ds *devices) lookup(name string) *device {
	ds.mu.Lock()
	defer ds.mu.Unlock()
	return ds.byDev[name]
}

// limitedOrWhole is a compute share with no limit counted as the whole
// device.
func limitedOrWhole(c float64) float64 {
	if c <= 0 || c >= 1 {
		return 1
	}
	return c
}

// all returns the devices in name order.
func (ds *devices) all() []*device {
	ds.mu.Lock()
	defer ds.mu.Unlock()
	out := make([]*device, 0, len(ds.byDev))
	for _, d := range ds.byDev {
		out = append(out, d)
	}
	slices.SortFunc(out, func(a, b *device) int { return strings.Compare(a.name, b.name) })
	return out
}

// wait blocks until every loop has returned, then removes the limiters'
// units.
func (ds *devices) wait() {
	ds.loops.Wait()
	for _, d := range ds.all() {
		if err := d.lim.Close(); err != nil {
			ds.log.Warn("closing the limiter", "device", d.name, "err", err)
		}
	}
}

// profileCacheDir is where profiles are kept: the configured folder, else
// the user cache directory, else the temporary directory.
func profileCacheDir(configured string) string {
	if configured != "" {
		return configured
	}
	if dir, err := os.UserCacheDir(); err == nil {
		return filepath.Join(dir, "sloserve", "profiles")
	}
	return filepath.Join(os.TempDir(), "sloserve-profiles")
}

// profiler runs the predictor's sweep for a freshly loaded version, or
// takes the curve from the cache when this model file was profiled on this
// machine with the same settings before.
type profiler struct {
	cfg   configs.Profile
	cache predictor.Cache
	pred  *predictor.Predictor
	lib   string // the ONNX Runtime library, part of the cache key
	log   *slog.Logger
	// report, when set, receives every profile installed (the profile
	// command prints it).
	report func(run models.ProfileRun, p predictor.Profile, cached bool)
	fresh  bool // ignore cached profiles
	// sim, when set, runs cuda models: their profiles are the
	// simulator's, keyed by its spec and the model's curve.
	sim *simgpu.Sim
	// sweeping holds a chan struct{} (capacity 1) per device: one sweep runs on a GPU at
	// a time, since a sweep timed while another model's sweep runs its
	// kernels beside it measures both (models loading together at start
	// profiled each other's interference, and hid where a model stops
	// getting faster with more SMs). CPU sweeps are not serialised: their
	// shares are cgroup quotas on cores the others do not use.
	sweeping sync.Map
}

// lockDevice serialises the sweeps of one GPU: it waits for the device's
// turn (a channel, so that a wait under testing/synctest is durable) and
// returns the release, or ctx's error.
func (p *profiler) lockDevice(ctx context.Context, device string) (func(), error) {
	if !strings.HasPrefix(device, "cuda:") {
		return func() {}, nil
	}
	v, _ := p.sweeping.LoadOrStore(device, make(chan struct{}, 1))
	turn := v.(chan struct{})
	select {
	case turn <- struct{}{}:
		return func() { <-turn }, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// profileShares are the compute shares profiled: on a CPU a quarter, half
// and all of what the model can use; on a GPU eighths up to half, then
// three quarters and all. Under MPS every share is a cap and a model runs
// no faster past its knee, so the adjuster sizes caps at the knees the
// profile shows (predictor.Knee); with quarters only, a knee at 0.3 was
// seen at 0.5 and a knee at 0.6 not at all, and each cap kept a fifth of
// a device idle from the batch jobs (GPU day in simulated time, 5 seeds:
// best-effort throughput 0.38x static's with quarters, 0.54x with eighths;
// latency-critical attainment 95.2% and 95.4%). Each share is an MPS
// client at profiling.
func profileShares(device string, maxShare float64) []float64 {
	if strings.HasPrefix(device, "cuda:") {
		return []float64{maxShare / 8, maxShare / 4, 3 * maxShare / 8, maxShare / 2, 3 * maxShare / 4, maxShare}
	}
	return []float64{maxShare / 4, maxShare / 2, maxShare}
}

// simulated is the part of a profile's cache key that says it was measured
// on the simulator: its spec and the model's curve; "" on real devices.
func (p *profiler) simulated(run models.ProfileRun) string {
	if simulatedDevice(p.sim, run.Device) == nil {
		return ""
	}
	m, _ := run.Config.Execution.Simulated.Model()
	return fmt.Sprintf("simgpu=%+v model=%+v", p.sim.Spec(), m)
}

// run is the registry's Options.Profile.
func (p *profiler) run(ctx context.Context, run models.ProfileRun) error {
	parts := []string{"device=" + run.Device, "threads=" + strconv.Itoa(run.Threads),
		fmt.Sprintf("shares=%v", profileShares(run.Device, run.MaxShare)),
		fmt.Sprintf("batches=%v", run.BatchSizes),
		fmt.Sprintf("shapes=%v", run.Config.Profile.Shapes),
		"onnxruntime=" + filepath.Base(p.lib)}
	if sim := p.simulated(run); sim != "" {
		parts = append(parts, sim)
	}
	key, err := predictor.Key(run.Path, predictor.MachineID(), parts...)
	if err != nil {
		return err
	}
	var (
		prof predictor.Profile
		ok   bool
	)
	if !p.fresh {
		if prof, ok, err = p.cache.Load(key); err != nil {
			p.log.Warn("ignoring an unreadable cached profile", "model", run.Key, "err", err)
			ok = false
		}
	}
	if ok {
		p.pred.SetProfile(run.Key, prof)
		p.log.Info("profile from cache", "model", run.Key, "mape", prof.MAPE, "curve", prof.Curve)
		if p.report != nil {
			p.report(run, prof, true)
		}
		return nil
	}
	unlock, err := p.lockDevice(ctx, run.Device)
	if err != nil {
		return err
	}
	points, err := predictor.Sweep(ctx, predictor.SweepOptions{
		Batches:  run.BatchSizes,
		MaxBatch: max(1, run.Config.MaxBatchSize),
		Shares:   profileShares(run.Device, run.MaxShare),
		Runs:     p.cfg.Runs,
		Budget:   p.cfg.Budget,
		Memory:   run.Memory,
	}, run.Measure)
	unlock()
	if err != nil && !errors.Is(err, predictor.ErrBudget) {
		return err
	}
	if err != nil {
		return fmt.Errorf("%w (raise control.profile.budget, or profile fewer batch sizes)", err)
	}
	prof, err = predictor.NewProfile(key, points, time.Now())
	if err != nil {
		return err
	}
	p.pred.SetProfile(run.Key, prof)
	if err := p.cache.Store(prof); err != nil {
		p.log.Warn("profile not cached", "model", run.Key, "err", err)
	}
	p.log.Info("profiled", "model", run.Key, "points", len(points), "mape", prof.MAPE, "curve", prof.Curve)
	if p.report != nil {
		p.report(run, prof, false)
	}
	return nil
}

// The registry applies the control loop's shares to the models' instances.
var _ control.AsyncActuator = (*models.Registry)(nil)
