package models

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/runtime"
)

// This file loads and unloads model versions: reading a model's config,
// starting a version's instances and checking them against it, swapping a
// reloaded set in, draining and stopping the set it replaces, and eviction
// with its load on demand.

// Load loads or reloads a model on request (explicit mode only).
func (r *Registry) Load(ctx context.Context, name string) error {
	if r.opts.Control != ControlExplicit {
		return fmt.Errorf("%w: load needs model control mode %q, the server runs in %q", ErrModelControl, ControlExplicit, r.opts.Control)
	}
	if err := validName(name); err != nil {
		return err
	}
	return loadFailed(name, r.loadConfig(ctx, name, []byte{}))
}

// LoadWithConfig is Load with a config override, as Triton's model-control
// clients send it: config is a Triton ModelConfig in JSON, which the model
// serves with instead of its folder's config (configs.ParseTritonModelJSON)
// until a load without one. A config that does not check out is
// ErrBadConfig, and the versions serving keep serving.
func (r *Registry) LoadWithConfig(ctx context.Context, name string, config []byte) error {
	if r.opts.Control != ControlExplicit {
		return fmt.Errorf("%w: load needs model control mode %q, the server runs in %q", ErrModelControl, ControlExplicit, r.opts.Control)
	}
	if err := validName(name); err != nil {
		return err
	}
	if len(config) == 0 {
		return fmt.Errorf("%w: the config override is empty", ErrBadConfig)
	}
	return loadFailed(name, r.loadConfig(ctx, name, config))
}

// loadFailed words a failed load by request first as Triton does ("failed
// to load 'X'", which clients and scripts match: Triton core's
// model_repository_manager.cc), then says why; the error keeps what it
// wraps. An unknown model is not a failed load.
func loadFailed(name string, err error) error {
	if err == nil || errors.Is(err, ErrModelNotFound) {
		return err
	}
	return fmt.Errorf("failed to load '%s': %w", tritonName(name), err)
}

// Unload unloads a model on request (explicit mode only).
func (r *Registry) Unload(ctx context.Context, name string) error {
	if r.opts.Control != ControlExplicit {
		return fmt.Errorf("%w: unload needs model control mode %q, the server runs in %q", ErrModelControl, ControlExplicit, r.opts.Control)
	}
	// An unloaded model stays unloaded, even one evicted before: requests
	// no longer bring it back.
	r.mu.Lock()
	if m, ok := r.models[name]; ok {
		m.evicted = false
	}
	r.mu.Unlock()
	return r.unload(ctx, name, "unloaded", true)
}

// load reads a model's config and starts the versions its policy selects.
// The versions already serving keep serving until the new set is ready; if
// the new set fails, the old one stays and the failure is recorded.
func (r *Registry) load(ctx context.Context, name string) error {
	return r.loadConfig(ctx, name, nil)
}

// loadConfig is load with the config to use: override nil keeps the
// model's override, if any; empty (not nil) reads the folder's config;
// otherwise it is a Triton config in JSON. The override is kept once the
// load succeeds.
func (r *Registry) loadConfig(ctx context.Context, name string, override []byte) error {
	m, err := r.lookup(name)
	if err != nil {
		return err
	}
	m.op.Lock()
	defer m.op.Unlock()
	log := r.log.With("model", name)

	if override == nil {
		r.mu.RLock()
		override = m.override
		r.mu.RUnlock()
	}
	fp, ensFP := fingerprint(m.dir)
	cfg, err := readModelConfig(m.dir, override, r.checkOptions())
	if err == nil {
		cfg, err = r.placed(name, m.dir, cfg)
		if err != nil {
			err = fmt.Errorf("%w: %w", ErrBadConfig, err)
		}
	}
	if err != nil {
		r.setEnsembleFailed(m, nil, err, fp)
		return err
	}
	for _, w := range cfg.Warnings {
		log.Warn("model config: " + w)
	}
	if cfg.Ensemble != nil {
		return r.loadEnsemble(ctx, m, cfg, override, ensFP)
	}
	selected, err := selectVersions(cfg, m.dir)
	if err != nil {
		r.setFailed(m, nil, err, fp)
		return err
	}

	// A version that serves stays READY while its replacement loads.
	r.mu.Lock()
	for _, n := range selected {
		if _, ok := m.serving[n]; !ok {
			m.states[n] = IndexEntry{Name: name, Version: strconv.FormatInt(n, 10), State: StateLoading}
		}
	}
	r.mu.Unlock()

	start := time.Now()
	fresh := make(map[int64]*version, len(selected))
	var errs []error
	for _, n := range selected {
		v, err := r.startVersion(ctx, cfg, m.dir, n)
		if err != nil {
			errs = append(errs, fmt.Errorf("version %d: %w", n, err))
			continue
		}
		fresh[n] = v
		r.metrics.loadDuration.WithLabelValues(name, v.label).Observe(time.Since(start).Seconds())
	}
	if len(errs) == 0 {
		for _, v := range fresh {
			r.profile(ctx, v) // first: it measures each batch size's memory
			if v.cfg.Execution.Provider == configs.ProviderCUDA {
				if err := warmInstances(ctx, v); err != nil {
					r.log.Warn("warming the instances failed; a batch size may be cold at its first run", "model", v.model, "version", v.label, "err", err)
				}
			}
			r.warmUp(ctx, v)
			if err := r.schedule(ctx, v); err != nil {
				errs = append(errs, fmt.Errorf("version %d: %w", v.number, err))
			}
		}
	}
	if len(errs) > 0 {
		r.mu.RLock()
		serving := maps.Clone(m.serving)
		r.mu.RUnlock()
		for _, v := range fresh {
			if o, ok := serving[v.number]; ok && v.sched != nil {
				// A reload that took the old version's place in the
				// scheduler: give it back before stopping the new one.
				if err := r.schedule(ctx, o); err != nil {
					r.log.Error("restoring the serving version in the scheduler", "model", o.model, "version", o.label, "err", err)
				}
			} else {
				r.unschedule(ctx, v, nil)
			}
			r.stopVersion(ctx, v)
		}
		for _, n := range selected {
			if _, ok := serving[n]; !ok {
				r.metrics.forget(name, strconv.FormatInt(n, 10))
			}
		}
		err := errors.Join(errs...)
		r.setFailed(m, selected, err, fp)
		return err
	}

	r.mu.Lock()
	old := m.serveLocked(fresh, nil, cfg, override, fp)
	for n, v := range fresh {
		m.states[n] = IndexEntry{Name: name, Version: v.label, State: StateReady}
	}
	r.mu.Unlock()
	r.metrics.loads.WithLabelValues(name).Inc()
	r.metrics.loadFailures.WithLabelValues(name) // exported as 0 until a load fails
	log.Info("model ready", "versions", selected, "instances", cfg.Instances, "took", time.Since(start).Round(time.Millisecond))

	for _, v := range old {
		r.drainAndStop(ctx, v, fresh)
		if _, replaced := fresh[v.number]; !replaced {
			r.forget(v)
		}
	}
	return nil
}

// forget tells Options.Forget that a version is gone for good.
func (r *Registry) forget(v *version) {
	if r.opts.Forget != nil {
		r.opts.Forget(v.key)
	}
}

// setFailed records why a load failed, in the log, the metrics and the
// index, and remembers the fingerprint of the files it read so that the
// watcher does not try the same files again. Versions still serving stay
// READY.
func (r *Registry) setFailed(m *model, versions []int64, err error, fp string) {
	r.metrics.loadFailures.WithLabelValues(m.name).Inc()
	r.metrics.loads.WithLabelValues(m.name) // exported as 0 until a load succeeds
	r.mu.Lock()
	defer r.mu.Unlock()
	m.fingerprint = fp
	m.loadFailed = true
	if len(m.serving) > 0 {
		m.reason = "reload failed, previous version serving: " + err.Error()
		r.log.Error("model reload failed; the previous version keeps serving", "model", m.name, "err", err)
	} else {
		m.reason = err.Error()
		r.log.Error("model load failed", "model", m.name, "err", err)
	}
	for n, v := range m.serving {
		m.states[n] = IndexEntry{Name: m.name, Version: v.label, State: StateReady, Reason: m.reason}
	}
	for _, n := range versions {
		if _, ok := m.serving[n]; !ok {
			m.states[n] = IndexEntry{Name: m.name, Version: strconv.FormatInt(n, 10), State: StateUnavailable, Reason: err.Error()}
		}
	}
}

// startVersion starts every instance of one version and checks the model
// file's inputs and outputs against the config.
func (r *Registry) startVersion(ctx context.Context, cfg *configs.Model, dir string, n int64) (*version, error) {
	return r.startVersionAt(ctx, cfg, dir, n, r.initialShare(cfg, modelFile(dir, n)))
}

// startVersionAt is startVersion at a given share (a move keeps the
// version's share).
func (r *Registry) startVersionAt(ctx context.Context, cfg *configs.Model, dir string, n int64, share limiter.Share) (*version, error) {
	label := strconv.FormatInt(n, 10)
	slots := max(1, cfg.Execution.Concurrency)
	v := &version{
		model:       cfg.Name,
		number:      n,
		label:       label,
		key:         cfg.Name + "/" + label,
		cfg:         cfg,
		path:        modelFile(dir, n),
		device:      deviceOf(cfg),
		maxBatch:    cfg.MaxBatchSize,
		maxElements: r.opts.MaxTensorElements,
		units:       map[runtime.Member]unit{},
		obs:         r.metrics.forVersion(cfg.Name, label),
		share:       share,
	}
	v.retiring, v.retire = context.WithCancel(context.Background())
	if r.opts.Limiter != nil {
		v.lim = r.opts.Limiter(v.device)
	}
	insts := make([]Instance, cfg.Instances)
	errs := make([]error, cfg.Instances)
	per := instanceShare(v.share, cfg.Instances)
	var wg sync.WaitGroup
	for i := range cfg.Instances {
		wg.Go(func() { insts[i], errs[i] = r.startInstance(ctx, v, i, per) })
	}
	wg.Wait()
	members := make([]runtime.Member, 0, len(insts))
	for _, inst := range insts {
		if inst != nil {
			members = append(members, inst)
		}
	}
	stopAll := func() {
		for _, m := range members {
			r.stopMember(context.WithoutCancel(ctx), v, m)
		}
	}
	if err := errors.Join(errs...); err != nil {
		stopAll()
		return nil, err
	}
	if err := v.checkModelFile(insts[0]); err != nil {
		stopAll()
		return nil, err
	}
	pool, err := runtime.NewPool(members, runtime.PoolOptions{
		Slots:       slots,
		CallTimeout: r.opts.CallTimeout,
		Stop:        func(ctx context.Context, m runtime.Member) { r.stopMember(ctx, v, m) },
		OnRetry:     v.obs.retries.Inc,
	})
	if err != nil {
		stopAll()
		return nil, err
	}
	v.pool = pool
	return v, nil
}

// checkModelFile checks the inputs and outputs of the model file, as the
// version's first instance reports them, against its config, and records
// them.
func (v *version) checkModelFile(first Instance) error {
	var err error
	v.inputs, v.outputs, err = checkSignature(v.cfg, first.Inputs(), first.Outputs())
	if err != nil {
		return err
	}
	v.wireInputs, v.wireOutputs = wireSpecs(v.inputs, v.cfg.Inputs), wireSpecs(v.outputs, v.cfg.Outputs)
	return nil
}

// checkSignature checks a model file's inputs and outputs against its
// config and returns them as the config declares them (in the file's
// shapes).
func checkSignature(cfg *configs.Model, ins, outs []runtime.TensorSpec) (inputs, outputs []runtime.TensorSpec, err error) {
	if inputs, err = checkDeclared("input", toSpecs(cfg.Inputs), ins); err != nil {
		return nil, nil, fmt.Errorf("%w: %s: %w", ErrBadConfig, cfg.File, err)
	}
	if outputs, err = checkDeclared("output", toSpecs(cfg.Outputs), outs); err != nil {
		return nil, nil, fmt.Errorf("%w: %s: %w", ErrBadConfig, cfg.File, err)
	}
	if cfg.MaxBatchSize > 0 {
		for _, s := range slices.Concat(ins, outs) {
			if len(s.Shape) == 0 || s.Shape[0] >= 0 {
				return nil, nil, fmt.Errorf("%w: %s: max_batch_size is %d but %q has no dynamic first dimension in the model file (shape %v)", ErrBadConfig, cfg.File, cfg.MaxBatchSize, s.Name, s.Shape)
			}
		}
	}
	return inputs, outputs, nil
}

// toSpecs are the tensors a config declares, in the model file's shapes.
func toSpecs(ts []configs.TensorConfig) []runtime.TensorSpec {
	out := make([]runtime.TensorSpec, len(ts))
	for i, t := range ts {
		out[i] = runtime.TensorSpec{Name: t.Name, DataType: runtime.DataType(t.DataType), Shape: t.ModelShape()}
	}
	return out
}

// wire are the version's inputs and outputs as clients see them.
func (v *version) wire() (inputs, outputs []runtime.TensorSpec) {
	inputs, outputs = v.wireInputs, v.wireOutputs
	if inputs == nil {
		inputs = v.inputs
	}
	if outputs == nil {
		outputs = v.outputs
	}
	return inputs, outputs
}

// wireSpecs are the model's tensors as clients see them: a reshaped
// one's shape is the config's. Without reshapes, specs itself.
func wireSpecs(specs []runtime.TensorSpec, ts []configs.TensorConfig) []runtime.TensorSpec {
	if !slices.ContainsFunc(ts, func(t configs.TensorConfig) bool { return t.Reshape != nil }) {
		return specs
	}
	out := slices.Clone(specs)
	for i := range out {
		if j := slices.IndexFunc(ts, func(t configs.TensorConfig) bool { return t.Name == out[i].Name }); j >= 0 && ts[j].Reshape != nil {
			out[i].Shape = ts[j].Shape
		}
	}
	return out
}

// stopVersion stops the instances of a version no request can reach.
func (r *Registry) stopVersion(ctx context.Context, v *version) {
	v.stopSwaps()
	v.pool.Stop(ctx)
}

// drainAndStop waits for a version's in-flight requests (up to the drain
// timeout), takes it out of its scheduler unless a version in next replaced
// it there, then stops its instances.
func (r *Registry) drainAndStop(ctx context.Context, v *version, next map[int64]*version) {
	// No request reaches the version any more: a swap still starting its
	// replacement gives up now.
	v.stopSwaps()
	// Requests already past the lookup: no new one can find the version.
	requests, start := v.requests.Load(), time.Now()
	done := make(chan struct{})
	go func() { v.inflight.Wait(); close(done) }()
	timeout := time.Duration(r.drainTimeout.Load())
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-done:
		r.log.Info("version drained", "model", v.model, "version", v.label, "requests", requests, "waited", time.Since(start))
	case <-t.C:
		r.log.Warn("unload: in-flight requests did not finish in time", "model", v.model, "version", v.label, "timeout", timeout, "requests", requests)
	case <-ctx.Done():
	}
	// A share swap in progress finishes first; later ones see the version
	// retired, so none starts an instance that would outlive it.
	lockShare(v)
	v.retired = true
	v.shareMu.Unlock()
	r.unschedule(context.WithoutCancel(ctx), v, next)
	r.stopVersion(context.WithoutCancel(ctx), v)
	if _, replaced := next[v.number]; !replaced {
		r.metrics.forget(v.model, v.label)
	}
}

// unload takes every version of a model out of service and stops it once
// its requests have finished; forget says whether the versions are gone
// for good (see Options.Forget).
func (r *Registry) unload(ctx context.Context, name, reason string, forget bool) error {
	m, err := r.lookup(name)
	if err != nil {
		return err
	}
	m.op.Lock()
	defer m.op.Unlock()
	r.mu.Lock()
	old := m.serving
	m.serving = map[int64]*version{}
	for n, v := range old {
		m.states[n] = IndexEntry{Name: name, Version: v.label, State: StateUnloading}
	}
	if e := m.ens; e != nil {
		// An ensemble holds no instances: its steps' models drain
		// their own requests.
		m.ens = nil
		m.states[e.number] = IndexEntry{Name: name, Version: e.label, State: StateUnavailable, Reason: reason}
		m.reason, m.loadFailed = reason, false
		r.log.Info("ensemble unloaded", "model", name, "reason", reason)
	}
	r.mu.Unlock()
	for _, v := range old {
		r.drainAndStop(ctx, v, nil)
		if forget {
			r.forget(v)
		}
	}
	r.mu.Lock()
	for n, e := range m.states {
		if e.State == StateUnloading {
			m.states[n] = IndexEntry{Name: name, Version: e.Version, State: StateUnavailable, Reason: reason}
		}
	}
	if len(old) > 0 {
		m.reason = reason
		m.loadFailed = false
	}
	r.mu.Unlock()
	if len(old) > 0 {
		r.log.Info("model unloaded", "model", name, "reason", reason)
	}
	return nil
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

// serveLocked makes serving (or, for an ensemble, ens) what m serves, as
// loaded from cfg with override and the files of fingerprint fp, with no
// version state known yet; it returns the versions served before.
func (m *model) serveLocked(serving map[int64]*version, ens *ensemble, cfg *configs.Model, override []byte, fp string) map[int64]*version {
	old := m.serving
	m.serving, m.ens, m.cfg = serving, ens, cfg
	m.override = nil
	if len(override) > 0 {
		m.override = override
	}
	m.reason, m.evicted, m.loadFailed = "", false, false
	m.fingerprint = fp
	m.states = map[int64]IndexEntry{}
	return old
}
