package models

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"sync"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/runtime"
)

// This file gives model versions their share of a device: the limiter unit
// each instance runs in, live resizes, the shadow-instance swap when a
// resize cannot happen live, and the readings of those units.

// unit is the limiter's handle on one instance.
type unit struct {
	id      string // limiter unit id, unique per instance start
	threads int    // intra-op threads the instance was started with
	// at is the share the unit serves at, and whether it is lifted for a
	// process loading in it; shared by the copies of the unit.
	at *unitShare
}

// unitShare is the share of one limiter unit: the instance share it
// serves at, and whether the unit runs uncapped for now because its
// process is loading (a start or a restart; startsLifted). A resize while
// the unit is lifted is recorded, not applied: the process takes the
// share last asked for once ready (settle), before it serves. mu orders
// a resize, a lift and a settle, so that the last share asked for is the
// one the unit serves at.
//
// held marks a unit lifted for the server's stop (Registry.LiftCaps): it
// stays lifted, whatever is asked of it, until it is released.
type unitShare struct {
	mu     sync.Mutex
	share  limiter.Share
	lifted bool
	held   bool
}

// resize gives the unit the instance share s: at once, or, while its
// process loads lifted, once it is ready; held for the server's stop,
// never (a cap is recorded, the unit lifted).
func (a *unitShare) resize(lim limiter.Limiter, id string, s limiter.Share) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.lifted {
		a.share = s
		return nil
	}
	if a.held && startsLifted(lim, s) {
		// Held for the stop: a cap asked for now is lifted at once.
		if err := lim.Resize(id, startShare(s)); err != nil {
			return err
		}
		a.share, a.lifted = s, true
		return nil
	}
	if err := lim.Resize(id, s); err != nil {
		return err
	}
	a.share = s
	return nil
}

// lift places the unit uncapped for a process about to load in it, when
// its share is one a start lifts (startsLifted).
func (a *unitShare) lift(lim limiter.Limiter, id string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.liftLocked(lim, id)
}

// liftLocked is lift with mu held.
func (a *unitShare) liftLocked(lim limiter.Limiter, id string) error {
	if a.lifted || !startsLifted(lim, a.share) {
		return nil
	}
	if err := lim.Resize(id, startShare(a.share)); err != nil {
		return err
	}
	a.lifted = true
	return nil
}

// settle gives a lifted unit, whose process is now ready, the share last
// asked for. The unit stays lifted when that fails: its process must not
// serve, and the next start in it loads uncapped as well. A unit held for
// the server's stop stays lifted.
func (a *unitShare) settle(lim limiter.Limiter, id string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.lifted || a.held {
		return nil
	}
	if err := lim.Resize(id, a.share); err != nil {
		return fmt.Errorf("setting the share %s once ready: %w", formatShare(a.share), err)
	}
	a.lifted = false
	return nil
}

// hold lifts the unit for the server's stop, when its share has a cap to
// lift (startsLifted), and keeps it lifted: later resizes are recorded,
// not applied, and a process that gets ready is not settled.
func (a *unitShare) hold(lim limiter.Limiter, id string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.held = true
	return a.liftLocked(lim, id)
}

// isHeld reports whether the unit is held lifted for the server's stop.
func (a *unitShare) isHeld() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.held
}

// startShare is the share a process starts at in place of s where starts
// are lifted: no compute cap, the default weight, out of the idle class,
// with s's memory limit.
func startShare(s limiter.Share) limiter.Share {
	return limiter.Share{Memory: s.Memory, Mode: limiter.ModeCap}
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
// its first memory share (firstMemory), else its memory limit; a
// best-effort version's in the class Options.BestEffortMode names for its
// device. path is the version's model file.
func (r *Registry) initialShare(cfg *configs.Model, path string) limiter.Share {
	s := limiter.Share{Compute: cfg.Resources.MaxComputeShare, Memory: int64(cfg.Resources.MemoryLimit)}
	if cfg.Resources.ComputeShare > 0 {
		s.Compute = cfg.Resources.ComputeShare
	}
	if m := r.firstMemory(path, cfg); m > 0 {
		s.Memory = m
	}
	if cfg.SLO.Class == configs.ClassBestEffort && r.opts.BestEffortMode != nil {
		s.Mode = r.opts.BestEffortMode(deviceOf(cfg))
	}
	return s
}

// firstMemory is the memory share per instance a version of cfg whose
// model file is path starts at when Options.FirstMemory knows one under its
// memory_limit; 0 keeps the memory_limit. At load every instance pins its
// share and placement keeps room for it (and a shadow of the largest) on
// its device, so a share that the control loop will size from the working
// set anyway starts there: the GPU day scaled to 36 models pinned 150 GiB
// of memory_limits at load, more than four 40 GiB devices hold, and about
// 33 GiB a minute later.
//
// A model whose config pins its share (compute_share) keeps its limit:
// the pin is compute_share and memory_limit, and a smaller first share
// would be replaced by the pin at once.
func (r *Registry) firstMemory(path string, cfg *configs.Model) int64 {
	if r.opts.FirstMemory == nil || path == "" || cfg.Resources.ComputeShare > 0 {
		return 0
	}
	m := r.opts.FirstMemory(path, cfg)
	if m <= 0 || (cfg.Resources.MemoryLimit > 0 && m >= int64(cfg.Resources.MemoryLimit)) {
		return 0
	}
	return m
}

// modelFile is the model file of version n in a model's folder.
func modelFile(dir string, n int64) string {
	return filepath.Join(dir, strconv.FormatInt(n, 10), "model.onnx")
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
// and starts it there; the version remembers the unit until stopMember.
func (r *Registry) startInstance(ctx context.Context, v *version, i int, s limiter.Share) (Instance, error) {
	u := unit{id: fmt.Sprintf("%s-%s-%d-%d", v.model, v.label, i, r.unitSeq.Add(1)), at: &unitShare{share: s}}
	// The process starts uncapped and takes its share once ready, where
	// the backend can set a share live: loading a model is a bounded burst
	// of CPU, and under a small cap or in the idle class behind busy
	// processes it took seconds (a best-effort replacement at a 0.025
	// share beside two busy threads was not ready after 30 s). A start
	// share keeps the memory limit and has the default weight, below any
	// latency-critical floor's. A start abandoned (its swap superseded or
	// cancelled, the version or the server stopping) then kills a process
	// that gets the CPU to exit. A restart of the process (after a crash
	// or a kill) does the same (restarting).
	at := s
	if startsLifted(v.lim, s) {
		at, u.at.lifted = startShare(s), true
	}
	var pl limiter.Placement
	if v.lim != nil {
		var err error
		if pl, err = v.lim.Place(u.id, at); err != nil {
			return nil, fmt.Errorf("placing instance %d at %s: %w", i, formatShare(at), err)
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
		Restarting:   r.restarting(v, u),
	})
	if err != nil {
		r.release(v, u)
		return nil, err
	}
	// Its share before it serves: an instance never serves above it.
	if err := u.at.settle(v.lim, u.id); err != nil {
		if serr := inst.Stop(context.WithoutCancel(ctx)); serr != nil {
			r.log.Warn("stopping an instance whose share could not be set", "model", v.model, "unit", u.id, "err", serr)
		}
		r.release(v, u)
		return nil, fmt.Errorf("instance %d, once started: %w", i, err)
	}
	// Backends that account by process (MPS) learn the instance's.
	if pt, ok := v.lim.(limiter.ProcessTracker); ok {
		if p, ok := inst.(interface{ Pid() int }); ok && p.Pid() > 0 {
			if err := pt.Track(u.id, p.Pid()); err != nil {
				r.log.Warn("tracking an instance's process", "model", v.model, "unit", u.id, "err", err)
			}
		}
	}
	v.instMu.Lock()
	v.units[inst] = u
	v.instMu.Unlock()
	// A unit that LiftCaps' pass over the versions may have missed.
	if r.capsLifted.Load() {
		r.holdUnit(v, u)
	}
	return inst, nil
}

// LiftCaps lifts the compute cap of every instance for the server's stop,
// once it no longer takes requests: what is left is finishing the ones it
// admitted, and a cap only makes that slower. A best-effort request
// running in the idle class at its 5% minimum beside busy processes held
// the stop for a second (the runner crashed and restarted just before;
// the control loop had put it back at its minimum as the stop began).
// Each unit with a cap to lift (a capped or background share; a floor has
// none) runs at its start share until it is released: no compute cap, the
// default weight, out of the idle class, its memory limit kept. Shares
// asked for from then on are recorded and not applied, no instance is
// replaced for a new share, and an instance started or restarted from then
// on is not capped once ready; where the backend keeps best-effort units
// under an idle-class parent (limiter.BackgroundLifter), that parent leaves
// the idle class first, so that such an instance also loads at a peer's
// speed. Backends that cannot set shares live (MPS) are left as they are.
// It returns how many units it lifted or held.
func (r *Registry) LiftCaps() int {
	if r.capsLifted.Swap(true) {
		return 0
	}
	r.mu.RLock()
	var versions []*version
	for _, m := range r.models {
		for _, v := range m.serving {
			versions = append(versions, v)
		}
	}
	r.mu.RUnlock()
	n := 0
	lifted := map[limiter.BackgroundLifter]bool{}
	for _, v := range versions {
		// The background parent first: a runner restarted from here on
		// joins its first placement's home under it, and loads there.
		if bl, ok := v.lim.(limiter.BackgroundLifter); ok && !lifted[bl] {
			lifted[bl] = true
			if err := bl.LiftBackground(); err != nil {
				r.log.Warn("lifting the background parent for the stop", "err", err)
			}
		}
		v.instMu.RLock()
		units := make([]unit, 0, len(v.units))
		for _, u := range v.units {
			units = append(units, u)
		}
		v.instMu.RUnlock()
		for _, u := range units {
			if r.holdUnit(v, u) {
				n++
			}
		}
	}
	return n
}

// holdUnit holds u lifted for the stop (unitShare.hold) where its backend
// sets shares live; false when it does not.
func (r *Registry) holdUnit(v *version, u unit) bool {
	if u.at == nil || v.lim == nil {
		return false
	}
	if _, ok := v.lim.(limiter.ComputeLifter); !ok || v.lim.Capabilities().CapsOnly {
		return false
	}
	if err := u.at.hold(v.lim, u.id); err != nil {
		r.log.Warn("lifting an instance's compute cap for the stop", "model", v.model, "version", v.label, "unit", u.id, "err", err)
		return false
	}
	return true
}

// restarting is an instance's hook around each restart of its process
// (runtime.RunnerConfig.Restarting), as startInstance does around its
// start: the unit u is lifted before the new process loads, and given
// the share last asked for once it is ready, before it serves (a share
// that cannot be set then fails that start); a backend that accounts by
// process (MPS) is told the new process's pid, as it is the first's.
// With neither to do: nil.
func (r *Registry) restarting(v *version, u unit) func() func(pid int) error {
	_, lifter := v.lim.(limiter.ComputeLifter)
	live := lifter && !v.lim.Capabilities().CapsOnly
	pt, tracks := v.lim.(limiter.ProcessTracker)
	if !live && !tracks {
		return nil
	}
	return func() func(int) error {
		if live {
			if err := u.at.lift(v.lim, u.id); err != nil {
				// It restarts at its share, as it did before starts were lifted.
				r.log.Warn("lifting a restarting instance's compute cap", "model", v.model, "version", v.label, "unit", u.id, "err", err)
			}
		}
		return func(pid int) error {
			if live {
				if err := u.at.settle(v.lim, u.id); err != nil {
					return err
				}
			}
			if tracks && pid > 0 {
				if err := pt.Track(u.id, pid); err != nil {
					r.log.Warn("tracking an instance's restarted process", "model", v.model, "unit", u.id, "err", err)
				}
			}
			return nil
		}
	}
}

// startsLifted reports whether an instance at share s on lim starts
// uncapped (startInstance): a capped or background share (a floor or an
// unlimited share has no cap to lift) on a backend that lifts caps and
// sets shares live (cgroup, unprivileged; not MPS, whose caps are fixed
// for a client's life).
func startsLifted(lim limiter.Limiter, s limiter.Share) bool {
	if _, ok := lim.(limiter.ComputeLifter); !ok || lim.Capabilities().CapsOnly {
		return false
	}
	return s.Mode == limiter.ModeBackground || s.Mode != limiter.ModeFloor && !unlimited(s.Compute)
}

// unitOf is the limiter unit an instance of the version runs in.
func (v *version) unitOf(m runtime.Member) unit {
	v.instMu.RLock()
	defer v.instMu.RUnlock()
	return v.units[m]
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

// MeasuredUsage sums, over a serving version's ("model/N") instances, the
// use of the device its limiter measured for each instance's unit (byUnit,
// from limiter.UsageReader). ok is false when no instance of the version
// has a reading: the caller then estimates.
func (r *Registry) MeasuredUsage(key string, byUnit map[string]float64) (use float64, ok bool) {
	v, err := r.versionByKey(key)
	if err != nil || len(byUnit) == 0 {
		return 0, false
	}
	v.instMu.RLock()
	defer v.instMu.RUnlock()
	for _, u := range v.units {
		if x, found := byUnit[u.id]; found {
			use += x
			ok = true
		}
	}
	return use, ok
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
	ctx, done := v.swapContext(ctx)
	defer done()
	v.shareMu.Lock()
	defer v.shareMu.Unlock()
	if v.moving.Load() {
		return fmt.Errorf("%w: %s", ErrMoving, key)
	}
	return r.setShareLocked(ctx, v, s, swapAlways)
}

// swapContext is ctx, ended too when the version starts to be stopped, for
// a swap that holds shareMu: the stop waits for shareMu, and must not wait
// for a replacement that is still loading.
func (v *version) swapContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if v.retiring == nil {
		return ctx, func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(v.retiring, cancel)
	return ctx, func() { stop(); cancel() }
}

// stopSwaps ends the swaps in progress that hold shareMu (swapContext).
func (v *version) stopSwaps() {
	if v.retire != nil {
		v.retire()
	}
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
	members := v.pool.Members()
	per := instanceShare(s, len(members))
	var errs []error
	for i, m := range members {
		restart, err := v.resizeLive(m, per, swap)
		if err != nil {
			errs = append(errs, fmt.Errorf("instance %d: %w", i, err))
			continue
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

// resizeLive resizes member m's limiter unit to the instance share per,
// and says whether m must be replaced instead (as the policy allows): the
// limiter cannot resize it running, or its thread count should change.
func (v *version) resizeLive(m runtime.Member, per limiter.Share, swap swapPolicy) (restart bool, err error) {
	u := v.unitOf(m)
	if v.lim != nil {
		var err error
		if u.at != nil {
			err = u.at.resize(v.lim, u.id, per)
		} else {
			err = v.lim.Resize(u.id, per)
		}
		switch {
		case errors.Is(err, limiter.ErrRestartRequired) && swap == swapNever:
			return false, err
		case errors.Is(err, limiter.ErrRestartRequired):
			restart = true
		case err != nil:
			return false, err
		}
	}
	if u.at != nil && u.at.isHeld() {
		return false, nil // the server is stopping: nothing is replaced
	}
	if want := v.threadsFor(per); want > 0 && want != u.threads && swap == swapAlways {
		restart = true
	}
	return restart, nil
}

// swapInstance replaces instance i by a new one at the instance share s,
// warmed (replacementSizes) before it takes requests (see
// runtime.Pool.Replace).
func (r *Registry) swapInstance(ctx context.Context, v *version, i int, s limiter.Share) error {
	if err := v.pool.Replace(ctx, i, r.replacement(v, i, s)); err != nil {
		return err
	}
	r.logReplaced(v, i, s)
	return nil
}

// logReplaced logs that instance i now runs at the instance share s.
func (r *Registry) logReplaced(v *version, i int, s limiter.Share) {
	r.log.Info("instance replaced at a new share", "model", v.model, "version", v.label, "instance", i,
		"share", formatShare(s), "threads", v.unitOf(v.pool.Members()[i]).threads)
}

// replacement returns the start function of a replacement for instance i
// at the instance share s: started in a limiter unit of its own and warmed
// (replacementSizes), so that it takes requests at once.
func (r *Registry) replacement(v *version, i int, s limiter.Share) func(ctx context.Context) (runtime.Member, error) {
	return func(ctx context.Context) (runtime.Member, error) {
		fresh, err := r.startInstance(ctx, v, i, s)
		if err != nil {
			return nil, fmt.Errorf("starting the replacement: %w", err)
		}
		if err := warmMember(ctx, v, fresh); err != nil {
			r.stopMember(context.WithoutCancel(ctx), v, fresh)
			return nil, fmt.Errorf("warming the replacement: %w", err)
		}
		return fresh, nil
	}
}

// warmMember runs a new instance of v once at each batch size
// replacementSizes gives (within its memory), straight, not through the
// pool, so that this instance and no other is warmed. A replacement, and
// each instance of a moved version or of a GPU model at load
// (warmInstances), are warmed so before they take requests.
func warmMember(ctx context.Context, v *version, m runtime.Member) error {
	sample, sizes := warmupRequests(v)
	if sample == nil {
		return nil
	}
	for _, b := range withinMemory(m, replacementSizes(v, sizes)) {
		if _, err := m.Infer(ctx, sample(b)); err != nil {
			return fmt.Errorf("at batch %d: %w", b, err)
		}
	}
	return nil
}

// warmInstances warms each of v's instances at once (warmMember): the
// load's warm-up (qos.Warmup) goes through the pool, which sends its
// sequential runs to one instance and leaves the others cold. A moved
// version and a GPU model at load are warmed so; on the CPU a cold
// instance's first run costs no search, and a load keeps to the pool's
// warm-up.
func warmInstances(ctx context.Context, v *version) error {
	members := v.pool.Members()
	errs := make([]error, len(members))
	var wg sync.WaitGroup
	for i, m := range members {
		wg.Go(func() { errs[i] = warmMember(ctx, v, m) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// replacementSizes is the batch sizes a new instance of a serving version
// (a replacement, or one of a moved version's) is warmed at, from
// the load's warm-up sizes (1 and the maximum that fits). For a
// latency-critical model on a GPU every size from 1 to the largest: a
// CUDA session's first run at a new input shape pays for it (cuDNN's
// algorithm search, the arena's growth), and a replacement is a new
// process, a new MPS client, so a size left cold is paid by the first live
// batch of that size after every resize or move (or on any instance
// but the one the load's warm-up ran on), and the model's queue behind it
// misses. A best-effort model pays it once against a loose target, and a
// swap (a recovery's too) that warmed each of its sizes (batch jobs run up
// to 16 and more) would take seconds longer. On the CPU a new shape costs
// no search. Both keep the load's sizes.
func replacementSizes(v *version, sizes []int) []int {
	if v.cfg.Execution.Provider != configs.ProviderCUDA || v.cfg.SLO.Class != configs.ClassLatencyCritical || len(sizes) == 0 {
		return sizes
	}
	all := make([]int, 0, slices.Max(sizes))
	for b := 1; b <= slices.Max(sizes); b++ {
		all = append(all, b)
	}
	return all
}

// withinMemory is the warm-up batch sizes an instance's memory holds: a
// size over its bound is warmed at the bound instead (a shrunk memory
// share's client would fail it, and the scheduler sends it no larger
// batch), and none when not even one item fits.
func withinMemory(m runtime.Member, sizes []int) []int {
	c, ok := m.(runtime.BatchCapacity)
	if !ok {
		return sizes
	}
	n, bounded := c.MaxBatch()
	if !bounded {
		return sizes
	}
	var out []int
	for _, b := range sizes {
		if b = min(b, n); b >= 1 && !slices.Contains(out, b) {
			out = append(out, b)
		}
	}
	return out
}

// BoundsBatchesByMemory reports whether every instance of a serving
// version ("model/N") bounds its batches by its memory
// (runtime.BatchCapacity: simulated MPS clients), so that the scheduler,
// which forms batches within what they hold, keeps them within a memory
// share sized from load.
func (r *Registry) BoundsBatchesByMemory(key string) bool {
	v, err := r.versionByKey(key)
	if err != nil {
		return false
	}
	for _, m := range v.pool.Members() {
		if _, ok := m.(runtime.BatchCapacity); !ok {
			return false
		}
	}
	return true
}

// stopMember stops one instance of the version and releases its unit. The
// unit's compute cap is lifted first: a best-effort runner capped in the
// idle class cannot get the CPU to exit when many stop at once, and the
// stop would wait for it until the kill.
func (r *Registry) stopMember(ctx context.Context, v *version, m runtime.Member) {
	if l, ok := v.lim.(limiter.ComputeLifter); ok {
		if u := v.unitOf(m); u.id != "" {
			if err := l.LiftCompute(u.id); err != nil {
				r.log.Warn("lifting a stopping instance's compute cap", "model", v.model, "version", v.label, "unit", u.id, "err", err)
			}
		}
	}
	if err := m.Stop(ctx); err != nil {
		r.log.Warn("instance stop failed", "model", v.model, "version", v.label, "err", err)
	}
	v.instMu.Lock()
	u, ok := v.units[m]
	delete(v.units, m)
	v.instMu.Unlock()
	if ok {
		r.release(v, u)
	}
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
	var total int64
	for _, inst := range v.pool.Members() {
		if u, ok := inst.(Usager); ok {
			if _, rss, err := u.Usage(); err == nil {
				total += rss
			}
		}
	}
	return total
}
