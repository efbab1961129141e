package models

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/runtime"
)

// This file gives model versions their share of a device: the limiter unit
// each instance runs in, live resizes, the shadow-instance swap when a
// resize cannot happen live, eviction and load on demand, and profiling.

// unit is the limiter's handle on one instance.
type unit struct {
	id      string // limiter unit id, unique per instance start
	threads int    // intra-op threads the instance was started with
}

// deviceOf is the execution device of a model: "cpu" or "cuda:N".
func deviceOf(cfg *configs.Model) string {
	if cfg.Execution.Provider == configs.ProviderCUDA {
		return fmt.Sprintf("cuda:%d", cfg.Execution.DeviceID)
	}
	return "cpu"
}

// initialShare is the share a version starts at: its pinned compute share,
// else its configured maximum (the adjuster moves it within a period), and
// its memory limit.
func initialShare(cfg *configs.Model) limiter.Share {
	s := limiter.Share{Compute: cfg.Resources.MaxComputeShare, Memory: int64(cfg.Resources.MemoryLimit)}
	if cfg.Resources.ComputeShare > 0 {
		s.Compute = cfg.Resources.ComputeShare
	}
	return s
}

// unlimited reports whether a compute share sets no limit.
func unlimited(c float64) bool { return c <= 0 || c >= 1 }

// instanceShare splits a version's share between its n instances: compute
// evenly, memory per instance (memory_limit is per instance).
func instanceShare(s limiter.Share, n int) limiter.Share {
	if !unlimited(s.Compute) && n > 1 {
		s.Compute /= float64(n)
	}
	return s
}

// threadsFor is the intra-op thread count of an instance at a share: the
// configured count when set, else what the limiter says suits the share.
func (v *version) threadsFor(s limiter.Share) int {
	if n := v.cfg.Execution.IntraOpThreads; n > 0 {
		return n
	}
	if v.lim == nil {
		return 0
	}
	return limiter.ThreadsFor(s, v.lim.CPUs())
}

// usefulShare is the largest compute share the version can use: instances ×
// threads of the device's CPUs when the thread count is fixed (one thread
// cannot use more than one core), within max_compute_share.
func (v *version) usefulShare() float64 {
	limit := v.cfg.Resources.MaxComputeShare
	if v.lim == nil || v.device != "cpu" || v.cfg.Execution.IntraOpThreads == 0 {
		return limit
	}
	per := float64(v.cfg.Execution.IntraOpThreads) / float64(max(1, v.lim.CPUs()))
	return min(limit, per*float64(v.cfg.Instances))
}

// startInstance places instance i in a limiter unit at the instance share s
// and starts it there.
func (r *Registry) startInstance(ctx context.Context, v *version, i int, s limiter.Share) (Instance, unit, error) {
	u := unit{id: fmt.Sprintf("%s-%s-%d-%d", v.model, v.label, i, r.unitSeq.Add(1))}
	var pl limiter.Placement
	if v.lim != nil {
		var err error
		if pl, err = v.lim.Place(u.id, s); err != nil {
			return nil, u, fmt.Errorf("placing instance %d at %s: %w", i, formatShare(s), err)
		}
	}
	u.threads = v.threadsFor(s)
	inst, err := r.opts.NewInstance(ctx, InstanceSpec{
		Model: v.model, Version: v.number, Index: i, Path: v.path, Config: v.cfg,
		Placement: pl, IntraOpThreads: u.threads,
		OnRestart: func(string) { v.obs.restarts.Inc() },
		OnExit: func(e runtime.Exit) {
			if e.OOM {
				v.obs.oomKills.Inc()
			}
			v.setFault(i, e.Cause)
		},
		MemoryEvents: r.memoryEvents(v, u),
	})
	if err != nil {
		r.release(v, u)
		return nil, u, err
	}
	// Backends that account by process (MPS) learn the instance's.
	if pt, ok := v.lim.(limiter.ProcessTracker); ok {
		if p, ok := inst.(interface{ Pid() int }); ok && p.Pid() > 0 {
			if err := pt.Track(u.id, p.Pid()); err != nil {
				r.log.Warn("tracking an instance's process", "model", v.model, "unit", u.id, "err", err)
			}
		}
	}
	return inst, u, nil
}

// memoryEvents reads the out-of-memory kills and the memory limit of an
// instance's limiter unit; nil without a limiter.
func (r *Registry) memoryEvents(v *version, u unit) func() (uint64, int64, error) {
	if v.lim == nil {
		return nil
	}
	return func() (uint64, int64, error) {
		st, err := v.lim.Stats(u.id)
		return st.OOMKills, st.MemoryLimit, err
	}
}

// release removes an instance's limiter unit.
func (r *Registry) release(v *version, u unit) {
	if v.lim == nil || u.id == "" {
		return
	}
	if err := v.lim.Release(u.id); err != nil {
		r.log.Warn("releasing a limiter unit", "model", v.model, "version", v.label, "unit", u.id, "err", err)
	}
}

// formatShare renders a share for logs and errors.
func formatShare(s limiter.Share) string {
	c := "unlimited"
	if !unlimited(s.Compute) {
		c = fmt.Sprintf("%.3f", s.Compute)
	}
	m := "unlimited"
	if s.Memory > 0 {
		m = configs.ByteSize(s.Memory).String()
	}
	return "compute " + c + ", memory " + m
}

// versionByKey finds a serving version by its scheduler name "model/N".
func (r *Registry) versionByKey(key string) (*version, error) {
	name, label, ok := strings.Cut(key, "/")
	if !ok {
		return nil, fmt.Errorf("%w: %q is not model/version", ErrModelNotFound, key)
	}
	return r.serving(name, label)
}

// serving finds a serving version of a model ("" = the default one).
func (r *Registry) serving(name, ver string) (*version, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	m, ok := r.models[name]
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrModelNotFound, name)
	}
	return m.resolve(ver)
}

// VersionKey resolves a model and version ("" = the default version) to
// the serving version's scheduler name "model/N" and its device.
func (r *Registry) VersionKey(name, ver string) (key, device string, err error) {
	v, err := r.serving(name, ver)
	if err != nil {
		return "", "", err
	}
	return v.key, v.device, nil
}

// UnitStats are the limiter readings of a serving version's instances,
// summed.
func (r *Registry) UnitStats(key string) limiter.Stats {
	var total limiter.Stats
	v, err := r.versionByKey(key)
	if err != nil || v.lim == nil {
		return total
	}
	v.instMu.RLock()
	defer v.instMu.RUnlock()
	for _, u := range v.units {
		st, err := v.lim.Stats(u.id)
		if err != nil {
			continue
		}
		total.CPUSeconds += st.CPUSeconds
		total.ThrottledSeconds += st.ThrottledSeconds
		total.MemoryBytes += st.MemoryBytes
		total.MemoryLimit += st.MemoryLimit
		total.OOMKills += st.OOMKills
	}
	return total
}

// SetShare gives a serving version ("model/N") a new share of its device:
// each instance's unit is resized live, or, when the limiter cannot resize a
// running instance (MPS) or the instance's thread count should change with
// the share, replaced by a shadow instance started at the new share, warmed
// at every batch size, swapped in and drained: no request fails.
func (r *Registry) SetShare(ctx context.Context, key string, s limiter.Share) error {
	v, err := r.versionByKey(key)
	if err != nil {
		return err
	}
	v.shareMu.Lock()
	defer v.shareMu.Unlock()
	if v.moving.Load() {
		return fmt.Errorf("%w: %s", ErrMoving, key)
	}
	return r.setShareLocked(ctx, v, s, swapAlways)
}

// swapPolicy says when setShareLocked may replace an instance by one
// started at the new share.
type swapPolicy uint8

const (
	// swapNever resizes live only; a share the limiter cannot apply to a
	// running instance is an error (ErrRestartRequired) and not recorded.
	swapNever swapPolicy = iota
	// swapRequired swaps only when the limiter cannot resize a running
	// instance (an MPS client's percentage is fixed at its start);
	// profiling uses it, so that each profiled share really runs, while a
	// CPU instance keeps its thread count across the sweep.
	swapRequired
	// swapAlways also swaps when the share calls for another thread count.
	swapAlways
)

// setShareLocked applies s to every instance, swapping instances as the
// policy allows. The share is recorded only when every instance runs at
// it. The caller holds shareMu.
func (r *Registry) setShareLocked(ctx context.Context, v *version, s limiter.Share, swap swapPolicy) error {
	if v.retired {
		return fmt.Errorf("%w: model %s version %s is being unloaded", ErrNotReady, v.model, v.label)
	}
	v.instMu.RLock()
	n := len(v.instances)
	units := slices.Clone(v.units)
	v.instMu.RUnlock()
	per := instanceShare(s, n)
	var errs []error
	for i, u := range units {
		restart := false
		if v.lim != nil {
			err := v.lim.Resize(u.id, per)
			switch {
			case errors.Is(err, limiter.ErrRestartRequired) && swap == swapNever:
				errs = append(errs, fmt.Errorf("instance %d: %w", i, err))
				continue
			case errors.Is(err, limiter.ErrRestartRequired):
				restart = true
			case err != nil:
				errs = append(errs, fmt.Errorf("instance %d: %w", i, err))
				continue
			}
		}
		if want := v.threadsFor(per); want > 0 && want != u.threads && swap == swapAlways {
			restart = true
		}
		if restart {
			if err := r.swapInstance(ctx, v, i, per); err != nil {
				errs = append(errs, fmt.Errorf("instance %d: %w", i, err))
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("model %s version %s: setting %s: %w", v.model, v.label, formatShare(s), err)
	}
	v.instMu.Lock()
	v.share = s
	v.instMu.Unlock()
	return nil
}

// swapInstance replaces instance i by a new one at the instance share s.
// The old instance serves until the new one is warm; then the new one takes
// the old one's execution slots as they come free, and the old one stops
// once it has none left, after its last request.
func (r *Registry) swapInstance(ctx context.Context, v *version, i int, s limiter.Share) error {
	fresh, u, err := r.startInstance(ctx, v, i, s)
	if err != nil {
		return fmt.Errorf("starting the replacement: %w", err)
	}
	if sample, sizes := warmupRequests(v); sample != nil {
		for _, b := range sizes {
			if _, err := fresh.Infer(ctx, sample(b)); err != nil {
				r.stopInstance(context.WithoutCancel(ctx), v, fresh, u)
				return fmt.Errorf("warming the replacement at batch %d: %w", b, err)
			}
		}
	}
	v.instMu.Lock()
	old, oldUnit := v.instances[i], v.units[i]
	v.instances[i], v.units[i] = fresh, u
	v.instMu.Unlock()

	slots := max(1, v.cfg.Execution.Concurrency)
	for range slots {
		v.idle <- fresh // the pool has room for one swap's slots
	}
	for taken := 0; taken < slots; {
		inst := <-v.idle // the old instance's slots come back as its requests end
		if inst == old {
			taken++
			continue
		}
		v.idle <- inst
		time.Sleep(time.Millisecond) // let a waiting request take it
	}
	r.stopInstance(context.WithoutCancel(ctx), v, old, oldUnit)
	r.log.Info("instance replaced at a new share", "model", v.model, "version", v.label, "instance", i,
		"share", formatShare(s), "threads", u.threads)
	return nil
}

// stopInstance stops one instance and releases its unit.
func (r *Registry) stopInstance(ctx context.Context, v *version, inst Instance, u unit) {
	if err := inst.Stop(ctx); err != nil {
		r.log.Warn("instance stop failed", "model", v.model, "version", v.label, "err", err)
	}
	r.release(v, u)
}

// Share returns a serving version's current share.
func (r *Registry) Share(key string) (limiter.Share, error) {
	v, err := r.versionByKey(key)
	if err != nil {
		return limiter.Share{}, err
	}
	v.instMu.RLock()
	defer v.instMu.RUnlock()
	return v.share, nil
}

// MemoryUsage is the resident memory of a serving version's instances in
// bytes; 0 when unknown.
func (r *Registry) MemoryUsage(key string) int64 {
	v, err := r.versionByKey(key)
	if err != nil {
		return 0
	}
	v.instMu.RLock()
	defer v.instMu.RUnlock()
	var total int64
	for _, inst := range v.instances {
		if u, ok := inst.(Usager); ok {
			if _, rss, err := u.Usage(); err == nil {
				total += rss
			}
		}
	}
	return total
}

// Evict unloads an idle model to free memory. Unlike an unload it leaves the
// model loadable on demand: the next request for it loads it again and
// waits.
func (r *Registry) Evict(ctx context.Context, key string) error {
	name, _, _ := strings.Cut(key, "/")
	m, err := r.lookup(name)
	if err != nil {
		return err
	}
	// Marked first, so that a request arriving while the model drains
	// loads it again instead of failing.
	r.mu.Lock()
	m.evicted = true
	r.mu.Unlock()
	if err := r.unload(ctx, name, "evicted to free memory; loads again on the next request", false); err != nil {
		return err
	}
	r.metrics.evictions.WithLabelValues(name).Inc()
	return nil
}

// revive loads an evicted model for a request that asks for it. Concurrent
// requests share one load.
func (r *Registry) revive(ctx context.Context, name string) error {
	m, err := r.lookup(name)
	if err != nil {
		return err
	}
	m.reviving.Add(1)
	defer m.reviving.Add(-1)
	m.demand.Lock()
	defer m.demand.Unlock()
	r.mu.RLock()
	evicted := m.evicted
	r.mu.RUnlock()
	if !evicted {
		return nil // loaded by the request before this one
	}
	r.log.Info("loading an evicted model on demand", "model", name)
	return r.load(ctx, name)
}

// ProfileRun is one version's profiling sweep, as Options.Profile gets it.
type ProfileRun struct {
	Key     string // "model/N"
	Device  string
	Path    string // the model file
	Config  *configs.Model
	Threads int // intra-op threads of the instances (0: ONNX Runtime's default)
	// MaxShare is the largest compute share the version can use (see
	// usefulShare); profiling shares above it measures nothing new.
	MaxShare   float64
	BatchSizes []int
	// Measure sets the version's compute share and returns the median
	// execution time of runs executions of a batch, after one unmeasured
	// run.
	Measure func(ctx context.Context, batch int, share float64, runs int) (time.Duration, error)
}

// profile runs Options.Profile for a fresh version, before it takes
// traffic, and puts its share back afterwards.
func (r *Registry) profile(ctx context.Context, v *version) {
	if r.opts.Profile == nil {
		return
	}
	sample, sizes := profileRequests(v)
	if sample == nil {
		r.log.Info("not profiled: an input has dynamic dimensions and no profile.shapes entry", "model", v.model, "version", v.label)
		return
	}
	if v.lim == nil || v.lim.Kind() == limiter.KindNone {
		r.log.Info("not profiled: shares are not enforced on this device (limiter none)", "model", v.model, "version", v.label)
		return
	}
	v.shareMu.Lock()
	defer v.shareMu.Unlock()
	initial := v.share
	run := ProfileRun{
		Key: v.key, Device: v.device, Path: v.path, Config: v.cfg,
		Threads: v.units[0].threads, MaxShare: v.usefulShare(), BatchSizes: sizes,
		Measure: func(ctx context.Context, batch int, share float64, runs int) (time.Duration, error) {
			// An instance per share where the limiter cannot resize a
			// running one (MPS): each point is measured at its share.
			if err := r.setShareLocked(ctx, v, limiter.Share{Compute: share, Memory: initial.Memory}, swapRequired); err != nil {
				return 0, err
			}
			req := sample(batch)
			took := make([]time.Duration, 0, runs)
			for i := range runs + 1 {
				start := time.Now()
				if _, _, err := v.run(ctx, req); err != nil {
					return 0, err
				}
				if i > 0 {
					took = append(took, time.Since(start))
				}
			}
			slices.Sort(took)
			return took[len(took)/2], nil
		},
	}
	start := time.Now()
	if err := r.opts.Profile(ctx, run); err != nil {
		r.log.Warn("profiling failed; estimates come from observed executions", "model", v.model, "version", v.label, "err", err)
	} else {
		r.log.Info("profiled", "model", v.model, "version", v.label, "took", time.Since(start).Round(time.Millisecond))
	}
	if err := r.setShareLocked(context.WithoutCancel(ctx), v, initial, swapRequired); err != nil {
		r.log.Warn("restoring the share after profiling", "model", v.model, "version", v.label, "err", err)
	}
}

// profileRequests is warmupRequests with the model's profile.shapes filled
// in for dynamic dimensions and its profile.batch_sizes (default 1,
// max/2, max).
func profileRequests(v *version) (func(batch int) *runtime.InferRequest, []int) {
	sample := samplesFor(v, v.cfg.Profile.Shapes)
	if sample == nil {
		return nil, nil
	}
	sizes := slices.Clone(v.cfg.Profile.BatchSizes)
	if len(sizes) == 0 {
		sizes = []int{1}
		if v.maxBatch > 1 {
			sizes = append(sizes, max(1, v.maxBatch/2), v.maxBatch)
		}
	}
	slices.Sort(sizes)
	return sample, slices.Compact(sizes)
}

// sampleShape is a tensor's shape for a sample request: the config's
// profile shape when given, else the declared one; false when a dynamic
// dimension other than the batch remains.
func sampleShape(in runtime.TensorSpec, given map[string][]int64, batched bool) ([]int64, bool) {
	shape := slices.Clone(in.Shape)
	if g, ok := given[in.Name]; ok && len(g) == len(shape) {
		shape = slices.Clone(g)
	}
	for d, n := range shape {
		if n < 0 && !(d == 0 && batched) {
			return nil, false
		}
	}
	return shape, true
}
