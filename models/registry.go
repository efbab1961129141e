// Package models is the model repository and registry: it finds models in
// repository folders, loads the versions a model's policy selects as sets of
// instances, answers which versions are ready, routes each request to an idle
// instance, and unloads or reloads models without dropping requests.
//
// It also validates each request against its model's metadata, applies the
// shares the adjuster chooses to every instance (it is the qos Actuator),
// evicts idle models and loads them again on demand, moves a version to
// another GPU by a warm shadow when placement asks (place.go), and counts
// per-version statistics. It must not decide shares, placements (control
// does) or the order requests run in (qos does) and must not speak a wire
// protocol (api does).
package models

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// Model control modes, as in Triton.
const (
	ControlNone     = "none"
	ControlExplicit = "explicit"
	ControlPoll     = "poll"
)

// Instance is one loaded copy of a model version, as the registry needs it.
// The server adapts runtime runners to it; tests use fakes.
type Instance interface {
	runtime.Instance
	Inputs() []runtime.TensorSpec
	Outputs() []runtime.TensorSpec
	// Status tells whether the instance can serve now, and if not, why.
	Status() (ready bool, reason string)
	Stop(ctx context.Context) error
}

// InstanceSpec says which instance to start.
type InstanceSpec struct {
	Model   string
	Version int64
	Index   int
	Path    string // the model.onnx file
	Config  *configs.Model
	// Placement is how the instance must start to run under its share
	// (limiter unit, environment, GPU memory).
	Placement limiter.Placement
	// IntraOpThreads is the instance's thread count: the config's, or one
	// that suits its share when the config leaves it to the server.
	IntraOpThreads int
	// OnRestart is called whenever the instance's process is restarted.
	OnRestart func(reason string)
	// OnExit is called whenever the instance's process ends unexpectedly.
	OnExit func(runtime.Exit)
	// MemoryEvents reads the out-of-memory kill count and the memory limit
	// of the instance's limiter unit; nil without a limiter.
	MemoryEvents func() (oomKills uint64, limit int64, err error)
}

// Suspecter is implemented by instances that can be told that a call on
// them got no answer in time, so that they check themselves at once (see
// runtime.Runner.Suspect).
type Suspecter interface {
	Suspect(why string)
}

// Options configure a Registry.
type Options struct {
	Repositories      []string
	Control           string // ControlNone, ControlExplicit or ControlPoll
	PollInterval      time.Duration
	StartupModels     []string // explicit mode; "*" loads all
	MaxTensorElements int64
	MaxBatchSize      int // largest max_batch_size a model may have; 0 = no limit
	MaxInflight       int // requests in flight across all models; 0 = no limit
	// MaxInflightBytes bounds the input bytes of the requests in flight
	// across all models (0 = no limit). A request that would pass it is
	// refused with ErrOverloaded, unless nothing else is in flight: one
	// request within the request size limit always gets through.
	MaxInflightBytes int64
	DrainTimeout     time.Duration // how long unload waits for in-flight requests
	// CallTimeout bounds one call to an instance (default 30s). A call
	// without an answer by then is abandoned: the request is retried once
	// on another instance or fails with runtime.ErrUnavailable, and the
	// instance checks its health at once.
	CallTimeout time.Duration
	// NewInstance starts one instance; it returns once the instance is ready
	// or has failed to start.
	NewInstance func(ctx context.Context, spec InstanceSpec) (Instance, error)
	Logger      *slog.Logger
	Registerer  prometheus.Registerer
	// Scheduler returns the QoS scheduler of an execution device ("cpu",
	// "cuda:0", ...). Every request then goes through it: admission,
	// queueing, batching, deadlines. Nil sends requests straight to an idle
	// instance.
	Scheduler func(device string) (*qos.Scheduler, error)
	// Estimator receives the warm-up runs at load; it should be the one
	// the schedulers predict with. Nil skips the warm-up.
	Estimator qos.Estimator
	// Limiter returns the share enforcer of an execution device; nil (or a
	// nil Limiter) enforces nothing.
	Limiter func(device string) limiter.Limiter
	// Profile, when set, runs the predictor's sweep for each freshly
	// loaded version before it takes traffic (see ProfileRun).
	Profile func(ctx context.Context, run ProfileRun) error
	// Place, when set, chooses the cuda device (its index) of a model
	// whose config names none (see place.go); nil loads it on device 0.
	// It is called for the cuda models that name one too, and must
	// return that one.
	Place func(model string, cfg *configs.Model) (int, error)
	// Forget, when set, is called with a version's scheduler name
	// ("model/N") once the version is gone for good: replaced by other
	// versions, unloaded through the API, or its model removed from the
	// repositories (not when evicted: it comes back on demand).
	Forget func(key string)
}

// DefaultCallTimeout is Options.CallTimeout's default.
const DefaultCallTimeout = 30 * time.Second

// ErrOverloaded means the server has as many requests in flight as allowed.
var ErrOverloaded = errors.New("too many requests in flight")

// Registry holds every model the repositories contain and the versions of
// them that are loaded.
type Registry struct {
	opts    Options
	log     *slog.Logger
	metrics *metrics

	inflight atomic.Int64

	// Settings a config reload changes while the registry runs; they start
	// as Options says.
	maxInflight atomic.Int64 // 0 = no limit
	// inflightBytes sums the input bytes of the requests in flight;
	// maxInflightBytes bounds it (0 = no limit).
	inflightBytes, maxInflightBytes atomic.Int64
	drainTimeout                    atomic.Int64 // a time.Duration
	pollInterval                    atomic.Int64 // a time.Duration

	mu     sync.RWMutex
	models map[string]*model
	repos  []string // the repositories; guarded by mu

	// rescan asks the watcher for a pass over the repositories now.
	rescan    chan struct{}
	watchDone chan struct{} // closed when the watcher has returned
	started   atomic.Bool
	unitSeq   atomic.Uint64 // makes limiter unit ids unique
}

// model is one folder of a repository and what is loaded from it.
type model struct {
	name string
	dir  string

	op sync.Mutex // serialises load, reload and unload of this model

	// Guarded by Registry.mu.
	cfg         *configs.Model
	serving     map[int64]*version
	states      map[int64]IndexEntry // last known state of each version
	reason      string               // why the model as a whole is not serving
	fingerprint string               // of the files that the last load read
	evicted     bool                 // unloaded for memory: the next request loads it
	loadFailed  bool                 // the last load or reload failed; reason says why
	removed     bool                 // its folder is gone: requests find no model

	demand sync.Mutex // one load on demand at a time
	// reviving counts the requests in revive, so that a request that finds
	// the model not ready while another loads it on demand waits for that
	// load instead of failing.
	reviving atomic.Int32
}

// version is one loaded model version: its instances and their idle pool.
type version struct {
	model    string
	number   int64
	label    string
	key      string         // model/version, the scheduler's name for it
	sched    *qos.Scheduler // nil: no QoS scheduling
	cfg      *configs.Model
	path     string // the model.onnx file
	device   string // "cpu" or "cuda:N"
	lim      limiter.Limiter
	inputs   []runtime.TensorSpec
	outputs  []runtime.TensorSpec
	maxBatch int
	idle     chan Instance // an instance per free execution slot
	// callTimeout bounds one call to an instance (Options.CallTimeout).
	callTimeout time.Duration
	// stopped is closed when the version's instances are stopped; parked
	// execution slots (see pick) are then dropped.
	stopped  chan struct{}
	stopOnce sync.Once

	shareMu sync.Mutex  // serialises share changes and swaps
	retired bool        // guarded by shareMu: being stopped, no more swaps
	moving  atomic.Bool // moving to another device (place.go): no more swaps

	instMu    sync.RWMutex // guards the fields below; swaps replace instances
	instances []Instance
	units     []unit        // the limiter unit of each instance
	share     limiter.Share // the version's share of its device
	inflight  sync.WaitGroup
	// fault is the last unexpected end of one of the version's instance
	// processes, kept for the index once the instance serves again.
	fault atomic.Pointer[string]
	stats versionStats
	obs   *versionMetrics
}

// New creates a Registry. Call Start to load models.
func New(opts Options) (*Registry, error) {
	if opts.NewInstance == nil {
		return nil, errors.New("models: Options.NewInstance is required")
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Registerer == nil {
		opts.Registerer = prometheus.NewRegistry()
	}
	if opts.PollInterval <= 0 {
		opts.PollInterval = 5 * time.Second
	}
	switch opts.Control {
	case "":
		opts.Control = ControlNone
	case ControlNone, ControlExplicit, ControlPoll:
	default:
		return nil, fmt.Errorf("models: unknown model control mode %q", opts.Control)
	}
	r := &Registry{
		opts:   opts,
		log:    opts.Logger,
		models: make(map[string]*model),
		repos:  slices.Clone(opts.Repositories),
		rescan: make(chan struct{}, 1),
	}
	r.maxInflight.Store(int64(opts.MaxInflight))
	r.maxInflightBytes.Store(max(opts.MaxInflightBytes, 0))
	r.drainTimeout.Store(int64(cmp.Or(opts.DrainTimeout, 30*time.Second)))
	r.pollInterval.Store(int64(opts.PollInterval))
	if opts.CallTimeout <= 0 {
		r.opts.CallTimeout = DefaultCallTimeout
	}
	m, err := newMetrics(opts.Registerer, r)
	if err != nil {
		return nil, err
	}
	r.metrics = m
	return r, nil
}

// Start scans the repositories and loads what the control mode says: every
// model in none and poll modes, the startup models in explicit mode. A model
// that fails to load is reported in the index; it does not fail Start. In
// poll and none modes a goroutine then watches the repositories until ctx
// ends: every poll interval in poll mode, only when Rescan asks in none mode.
func (r *Registry) Start(ctx context.Context) error {
	if err := checkRepositories(r.repositories()); err != nil {
		return err
	}
	found := r.scan()
	var names []string
	switch r.opts.Control {
	case ControlNone, ControlPoll:
		names = found
	case ControlExplicit:
		if slices.Contains(r.opts.StartupModels, "*") {
			names = found
		} else {
			names = r.opts.StartupModels
		}
	}
	var wg sync.WaitGroup
	for _, name := range names {
		wg.Go(func() {
			if err := r.load(ctx, name); err != nil {
				r.log.Error("model failed to load", "model", name, "err", err)
			}
		})
	}
	wg.Wait()
	r.started.Store(true)
	if r.opts.Control != ControlExplicit {
		r.watchDone = make(chan struct{})
		go r.watch(ctx)
	}
	return nil
}

// Started reports whether Start has finished its initial loads.
func (r *Registry) Started() bool { return r.started.Load() }

// Stop unloads every model, draining in-flight requests first. In poll and
// none modes it expects Start's ctx to be cancelled already and waits for
// the watcher.
func (r *Registry) Stop(ctx context.Context) {
	if r.watchDone != nil {
		select {
		case <-r.watchDone:
		case <-ctx.Done():
		}
	}
	r.mu.RLock()
	names := make([]string, 0, len(r.models))
	for n := range r.models {
		names = append(names, n)
	}
	r.mu.RUnlock()
	var wg sync.WaitGroup
	for _, n := range names {
		wg.Go(func() { _ = r.unload(ctx, n, "server stopping", false) })
	}
	wg.Wait()
}

// validName rejects model names that could escape a repository folder.
func validName(name string) error {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\\\x00") {
		return fmt.Errorf("%w: invalid model name %q", ErrInvalidInput, name)
	}
	return nil
}

// scan finds the model folders in the repositories and records new ones.
// It returns the names found, sorted.
func (r *Registry) scan() []string {
	found := map[string]string{}
	for _, repo := range r.repositories() {
		entries, err := os.ReadDir(repo)
		if err != nil {
			r.log.Warn("cannot read model repository", "repository", repo, "err", err)
			continue
		}
		for _, e := range entries {
			if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
				continue
			}
			if prev, dup := found[e.Name()]; dup {
				r.log.Warn("model found in two repositories; using the first", "model", e.Name(), "used", prev, "ignored", repo)
				continue
			}
			found[e.Name()] = filepath.Join(repo, e.Name())
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for name, dir := range found {
		if m, ok := r.models[name]; ok {
			m.dir = dir
			continue
		}
		r.models[name] = &model{name: name, dir: dir, serving: map[int64]*version{}, states: map[int64]IndexEntry{}}
	}
	names := make([]string, 0, len(found))
	for n := range found {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// lookup returns the model named name, scanning the repositories again if it
// is not known yet.
func (r *Registry) lookup(name string) (*model, error) {
	if err := validName(name); err != nil {
		return nil, err
	}
	r.mu.RLock()
	m, ok := r.models[name]
	r.mu.RUnlock()
	if ok {
		return m, nil
	}
	r.scan()
	r.mu.RLock()
	m, ok = r.models[name]
	r.mu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrModelNotFound, name)
	}
	return m, nil
}

// Load loads or reloads a model on request (explicit mode only).
func (r *Registry) Load(ctx context.Context, name string) error {
	if r.opts.Control != ControlExplicit {
		return fmt.Errorf("%w: load needs model control mode %q, the server runs in %q", ErrModelControl, ControlExplicit, r.opts.Control)
	}
	if err := validName(name); err != nil {
		return err
	}
	return r.load(ctx, name)
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
	m, err := r.lookup(name)
	if err != nil {
		return err
	}
	m.op.Lock()
	defer m.op.Unlock()
	log := r.log.With("model", name)

	fp := fingerprint(m.dir)
	cfg, err := configs.LoadModel(m.dir)
	if err == nil {
		err = checkBatchLimit(cfg, r.opts.MaxBatchSize)
	}
	if err == nil {
		cfg, err = r.placed(name, cfg)
	}
	if err != nil {
		err = fmt.Errorf("%w: %w", ErrBadConfig, err)
		r.setFailed(m, nil, err, fp)
		return err
	}
	for _, w := range cfg.Warnings {
		log.Warn("model config: " + w)
	}
	available, err := configs.ListVersions(m.dir)
	if err != nil {
		err = fmt.Errorf("%w: %w", ErrBadConfig, err)
		r.setFailed(m, nil, err, fp)
		return err
	}
	selected := cfg.SelectVersions(available)
	if len(selected) == 0 {
		err := fmt.Errorf("%w: %s: no version folder with a model.onnx matches the version policy (found %v)", ErrBadConfig, m.dir, available)
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
			r.warmUp(ctx, v)
			r.profile(ctx, v)
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
	old := m.serving
	m.serving = fresh
	m.cfg = cfg
	m.reason = ""
	m.evicted = false
	m.loadFailed = false
	m.fingerprint = fp
	m.states = map[int64]IndexEntry{}
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

// warmUp seeds the latency estimates of a started version, when its input
// shapes are known, before it takes traffic.
func (r *Registry) warmUp(ctx context.Context, v *version) {
	if r.opts.Scheduler == nil || r.opts.Estimator == nil {
		return
	}
	sample, sizes := warmupRequests(v)
	if sample == nil {
		return
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	// Warm-up runs go straight to the instances: they are not clients'
	// executions, so the statistics do not count them.
	warm := qos.ExecutorFunc(func(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
		resp, _, err := v.run(ctx, req)
		return resp, err
	})
	if err := qos.Warmup(wctx, v.key, warm, r.opts.Estimator, sizes, 3, sample); err != nil {
		r.log.Warn("warm-up failed; latency estimates start empty", "model", v.model, "version", v.label, "err", err)
	}
}

// executor runs batches on the version's instances, for the scheduler,
// and counts each execution by its batch size.
func (v *version) executor() qos.Executor {
	return qos.ExecutorFunc(func(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
		resp, _, err := v.run(ctx, req)
		if err == nil {
			v.stats.recordExecution(v.batchOf(req), resp.Timing)
		}
		return resp, err
	})
}

// batchOf is the batch size of a request the version executes: the first
// dimension of its inputs when the model batches, else 1.
func (v *version) batchOf(req *runtime.InferRequest) int {
	if v.maxBatch > 0 && len(req.Inputs) > 0 && len(req.Inputs[0].Shape) > 0 {
		return int(max(req.Inputs[0].Shape[0], 1))
	}
	return 1
}

// schedule hands a started version to its device's QoS scheduler, or, when
// the same version is already scheduled (a reload), gives the scheduler the
// new instances: queued requests stay and run on them.
func (r *Registry) schedule(ctx context.Context, v *version) error {
	if r.opts.Scheduler == nil {
		return nil
	}
	sched, err := r.opts.Scheduler(v.device)
	if err != nil {
		return err
	}
	spec := qos.ModelSpec{
		Name:                v.key,
		Class:               qos.Class(v.cfg.SLO.Class),
		Priority:            v.cfg.SLO.Priority,
		SLO:                 v.cfg.LatencyTarget(),
		MaxBatchSize:        v.cfg.MaxBatchSize,
		MaxQueueDelay:       v.cfg.DynamicBatching.MaxQueueDelay,
		PreferredBatchSizes: v.cfg.DynamicBatching.PreferredBatchSizes,
		QueueCapacity:       v.cfg.MaxQueueSize,
		Slots:               len(v.instances) * max(1, v.cfg.Execution.Concurrency),
		Executor:            v.executor(),
		MinShare:            min(v.cfg.Resources.MinComputeShare, v.usefulShare()),
		MaxShare:            v.usefulShare(),
		Memory:              int64(v.cfg.Resources.MemoryLimit),
	}
	if c := v.cfg.Resources.ComputeShare; c > 0 {
		spec.Pin = &limiter.Share{Compute: c, Memory: spec.Memory}
	}
	if sched.HasModel(v.key) {
		err = sched.UpdateModel(spec)
	} else {
		err = sched.AddModel(spec)
	}
	if err != nil {
		return err
	}
	v.sched = sched
	return nil
}

// unschedule removes a version from its scheduler once no request can reach
// it, unless a version in next (a reload of the same version) took over its
// place there.
func (r *Registry) unschedule(ctx context.Context, v *version, next map[int64]*version) {
	if v.sched == nil {
		return
	}
	if n, ok := next[v.number]; ok && n.sched == v.sched {
		return
	}
	if err := v.sched.RemoveModel(ctx, v.key); err != nil && !errors.Is(err, qos.ErrUnknownModel) {
		r.log.Warn("removing from the scheduler", "model", v.model, "version", v.label, "err", err)
	}
}

// warmupRequests returns requests of zeros for the warm-up at batch sizes 1
// and the maximum, or nil when an input has BYTES data or a dynamic
// dimension other than the batch that profile.shapes does not fill.
func warmupRequests(v *version) (func(batch int) *runtime.InferRequest, []int) {
	sample := samplesFor(v, v.cfg.Profile.Shapes)
	if sample == nil {
		return nil, nil
	}
	sizes := []int{1}
	if v.maxBatch > 1 {
		sizes = append(sizes, v.maxBatch)
	}
	return sample, sizes
}

// samplesFor returns a function building a request of zeros at a batch
// size, with the given shapes for dynamic dimensions; nil when that is not
// possible.
func samplesFor(v *version, given map[string][]int64) func(batch int) *runtime.InferRequest {
	shapes := make([][]int64, len(v.inputs))
	for i, in := range v.inputs {
		shape, ok := sampleShape(in, given, v.maxBatch > 0)
		if !ok || in.DataType == runtime.Bytes {
			return nil
		}
		shapes[i] = shape
	}
	return func(batch int) *runtime.InferRequest {
		req := &runtime.InferRequest{Inputs: make([]runtime.Tensor, len(v.inputs))}
		for i, in := range v.inputs {
			shape := slices.Clone(shapes[i])
			if v.maxBatch > 0 {
				shape[0] = int64(batch)
			}
			n, _ := runtime.ElementCount(shape, 0)
			req.Inputs[i] = runtime.Tensor{Name: in.Name, DataType: in.DataType, Shape: shape, Data: make([]byte, n*int64(in.DataType.Size()))}
		}
		return req
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
	return r.startVersionAt(ctx, cfg, dir, n, initialShare(cfg))
}

// startVersionAt is startVersion at a given share (a move keeps the
// version's share).
func (r *Registry) startVersionAt(ctx context.Context, cfg *configs.Model, dir string, n int64, share limiter.Share) (*version, error) {
	label := strconv.FormatInt(n, 10)
	slots := max(1, cfg.Execution.Concurrency)
	v := &version{
		model:    cfg.Name,
		number:   n,
		label:    label,
		key:      cfg.Name + "/" + label,
		cfg:      cfg,
		path:     filepath.Join(dir, label, "model.onnx"),
		device:   deviceOf(cfg),
		maxBatch: cfg.MaxBatchSize,
		// Room for every instance's slots, and one more instance's for
		// the replacement during a swap.
		idle:        make(chan Instance, (cfg.Instances+1)*slots),
		obs:         r.metrics.forVersion(cfg.Name, label),
		share:       share,
		callTimeout: r.opts.CallTimeout,
		stopped:     make(chan struct{}),
	}
	if r.opts.Limiter != nil {
		v.lim = r.opts.Limiter(v.device)
	}
	type started struct {
		inst Instance
		unit unit
		err  error
	}
	results := make([]started, cfg.Instances)
	per := instanceShare(v.share, cfg.Instances)
	var wg sync.WaitGroup
	for i := range cfg.Instances {
		wg.Go(func() {
			inst, u, err := r.startInstance(ctx, v, i, per)
			results[i] = started{inst, u, err}
		})
	}
	wg.Wait()
	var errs []error
	for _, s := range results {
		if s.err != nil {
			errs = append(errs, s.err)
			continue
		}
		v.instances = append(v.instances, s.inst)
		v.units = append(v.units, s.unit)
	}
	if len(errs) > 0 {
		r.stopVersion(ctx, v)
		return nil, errors.Join(errs...)
	}
	first := v.instances[0]
	var err error
	if v.inputs, err = checkDeclared("input", toSpecs(cfg.Inputs), first.Inputs()); err != nil {
		r.stopVersion(ctx, v)
		return nil, fmt.Errorf("%w: %s: %w", ErrBadConfig, cfg.File, err)
	}
	if v.outputs, err = checkDeclared("output", toSpecs(cfg.Outputs), first.Outputs()); err != nil {
		r.stopVersion(ctx, v)
		return nil, fmt.Errorf("%w: %s: %w", ErrBadConfig, cfg.File, err)
	}
	if v.maxBatch > 0 {
		for _, s := range slices.Concat(first.Inputs(), first.Outputs()) {
			if len(s.Shape) == 0 || s.Shape[0] >= 0 {
				r.stopVersion(ctx, v)
				return nil, fmt.Errorf("%w: %s: max_batch_size is %d but %q has no dynamic first dimension in the model file (shape %v)", ErrBadConfig, cfg.File, v.maxBatch, s.Name, s.Shape)
			}
		}
	}
	// One token per request an instance may run at once.
	for range slots {
		for _, inst := range v.instances {
			v.idle <- inst
		}
	}
	return v, nil
}

func toSpecs(ts []configs.TensorConfig) []runtime.TensorSpec {
	out := make([]runtime.TensorSpec, len(ts))
	for i, t := range ts {
		out[i] = runtime.TensorSpec{Name: t.Name, DataType: runtime.DataType(t.DataType), Shape: t.Shape}
	}
	return out
}

// stopVersion stops the instances of a version no request can reach.
func (r *Registry) stopVersion(ctx context.Context, v *version) {
	v.stopOnce.Do(func() { close(v.stopped) })
	v.instMu.RLock()
	defer v.instMu.RUnlock()
	for i, inst := range v.instances {
		r.stopInstance(ctx, v, inst, v.units[i])
	}
}

// drainAndStop waits for a version's in-flight requests (up to the drain
// timeout), takes it out of its scheduler unless a version in next replaced
// it there, then stops its instances.
func (r *Registry) drainAndStop(ctx context.Context, v *version, next map[int64]*version) {
	done := make(chan struct{})
	go func() { v.inflight.Wait(); close(done) }()
	timeout := time.Duration(r.drainTimeout.Load())
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		r.log.Warn("unload: in-flight requests did not finish in time", "model", v.model, "version", v.label, "timeout", timeout)
	case <-ctx.Done():
	}
	// A share swap in progress finishes first; later ones see the version
	// retired, so none starts an instance that would outlive it.
	v.shareMu.Lock()
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

// evictedError is the not-ready error of a model that was evicted and not
// loaded since, or that a request is loading on demand: a request that
// gets it loads the model itself, or waits for the load under way. It is
// decided under the same lock as the version lookup, so a load finishing
// in between cannot make a request fail.
type evictedError struct{ error }

func (e evictedError) Unwrap() error { return e.error }

// resolve finds the serving version a request names ("" = the highest).
// The caller holds r.mu.
func (m *model) resolve(ver string) (*version, error) {
	if m.removed {
		return nil, fmt.Errorf("%w: %q (removed from the repository)", ErrModelNotFound, m.name)
	}
	if ver == "" {
		var best *version
		for _, v := range m.serving {
			if best == nil || v.number > best.number {
				best = v
			}
		}
		if best == nil {
			return nil, m.notReady()
		}
		return best, nil
	}
	// Versions are written as their folders are: "01" and "+1" name no
	// version.
	n, err := strconv.ParseInt(ver, 10, 64)
	if err != nil || n < 1 || strconv.FormatInt(n, 10) != ver {
		return nil, fmt.Errorf("%w: %q version %q", ErrVersionNotFound, m.name, ver)
	}
	if v, ok := m.serving[n]; ok {
		return v, nil
	}
	if _, ok := m.states[n]; ok {
		return nil, m.notReady()
	}
	return nil, fmt.Errorf("%w: %q version %q", ErrVersionNotFound, m.name, ver)
}

func (m *model) notReady() error {
	err := fmt.Errorf("%w: %q is not loaded", ErrNotReady, m.name)
	if m.reason != "" {
		err = fmt.Errorf("%w: %q: %s", ErrNotReady, m.name, m.reason)
	}
	if m.evicted || m.reviving.Load() > 0 {
		return evictedError{err}
	}
	return err
}

// acquire finds a serving version and counts a request in flight on it, so
// that an unload waits for the request.
func (r *Registry) acquire(name, ver string) (*version, error) {
	if err := validName(name); err != nil {
		return nil, fmt.Errorf("%w: %q", ErrModelNotFound, name)
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	m, ok := r.models[name]
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrModelNotFound, name)
	}
	v, err := m.resolve(ver)
	if err != nil {
		return nil, err
	}
	v.inflight.Add(1)
	return v, nil
}

// Preadmit tells, before a request's body is read, whether a request for
// the model version would be refused now: the server has as many requests
// in flight as allowed (ErrOverloaded), or the model's scheduler would
// refuse even one row (qos.ErrQueueFull, qos.ErrRejected; counted as the
// request's outcome, as Infer counts it). nil promises nothing: Infer
// decides on the request itself, and reports unknown models and the like.
func (r *Registry) Preadmit(ctx context.Context, name, ver string, deadline time.Time) error {
	start := time.Now()
	if limit := r.maxInflight.Load(); limit > 0 && r.inflight.Load() >= limit {
		return fmt.Errorf("%w: limit %d", ErrOverloaded, limit)
	}
	v, err := r.acquire(name, ver)
	if err != nil {
		return nil
	}
	defer v.inflight.Done()
	if v.sched == nil {
		return nil
	}
	err = v.sched.Preadmit(ctx, v.key, qos.RequestOptions{Deadline: deadline})
	if errors.Is(err, qos.ErrRejected) || errors.Is(err, qos.ErrQueueFull) {
		v.finish(outcomeRejected, 1, start, 0, nil)
		return err
	}
	return nil
}

// Infer runs one request on a version of a model ("" = the highest ready
// version) and returns the version that served it.
func (r *Registry) Infer(ctx context.Context, name, ver string, req *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	start := time.Now()
	if limit := r.maxInflight.Load(); limit > 0 {
		if n := r.inflight.Add(1); n > limit {
			r.inflight.Add(-1)
			return nil, "", fmt.Errorf("%w: limit %d", ErrOverloaded, limit)
		}
		defer r.inflight.Add(-1)
	}
	if limit := r.maxInflightBytes.Load(); limit > 0 {
		var size int64
		for _, t := range req.Inputs {
			size += int64(len(t.Data))
		}
		if n := r.inflightBytes.Add(size); n > limit && n != size {
			r.inflightBytes.Add(-size)
			return nil, "", fmt.Errorf("%w: the requests in flight hold %s of inputs, over limits.max_inflight_bytes (%s)",
				ErrOverloaded, configs.ByteSize(n-size), configs.ByteSize(limit))
		}
		defer r.inflightBytes.Add(-size)
	}
	v, err := r.acquire(name, ver)
	if errors.As(err, new(evictedError)) {
		if err := r.revive(ctx, name); err != nil {
			return nil, "", fmt.Errorf("%w: %q: loading the evicted model on demand: %w", ErrNotReady, name, err)
		}
		v, err = r.acquire(name, ver)
	}
	if err != nil {
		return nil, "", err
	}
	defer v.inflight.Done()
	v.obs.inflight.Inc()
	defer v.obs.inflight.Dec()

	batch, err := v.validate(req, r.opts.MaxTensorElements)
	if err != nil {
		v.finish(outcomeInvalid, 1, start, 0, nil)
		return nil, v.label, err
	}
	if lv := v.cfg.DynamicBatching.PriorityLevels; lv > 0 && req.Priority > lv {
		req.Priority = 0 // beyond the model's levels: its default, as Triton does
	}
	if d := v.cfg.DynamicBatching.DefaultTimeout; d > 0 {
		if dl := start.Add(d); req.Deadline.IsZero() || dl.Before(req.Deadline) {
			req.Deadline = dl
		}
	}
	var (
		resp  *runtime.InferResponse
		queue time.Duration
	)
	if v.sched != nil {
		resp, err = v.sched.Submit(ctx, v.key, req, qos.RequestOptions{Deadline: req.Deadline, Priority: req.Priority})
		if err == nil {
			// The scheduler's queue plus the transport to the runner.
			queue = max(0, time.Since(start)-resp.Timing.Input-resp.Timing.Infer-resp.Timing.Output)
		}
	} else {
		resp, queue, err = v.run(ctx, req)
		if err == nil {
			v.stats.recordExecution(batch, resp.Timing)
		}
	}
	if err != nil {
		o := outcomeFailed
		switch {
		case errors.Is(err, qos.ErrRejected), errors.Is(err, qos.ErrQueueFull):
			o = outcomeRejected
		case errors.Is(err, qos.ErrDropped):
			o = outcomeDropped
		case errors.Is(err, runtime.ErrUnavailable):
			o = outcomeUnavailable
		case ctx.Err() != nil:
			o = outcomeCanceled
		case errors.Is(err, runtime.ErrInvalidTensor), errors.Is(err, qos.ErrInvalidRequest):
			o = outcomeInvalid
		}
		v.finish(o, batch, start, queue, nil)
		return nil, v.label, fmt.Errorf("model %s version %s: %w", v.model, v.label, err)
	}
	v.finish(outcomeSuccess, batch, start, queue, &resp.Timing)
	return resp, v.label, nil
}

// run waits for an idle instance and executes the request on it. If the
// instance turns out to be down (it died during the call, or gave no
// answer within the call timeout) and the version has others, the request
// is tried once more on another: inference is idempotent. A runner killed
// for exceeding its memory limit is not retried: the request that did it
// would most likely do it again.
func (v *version) run(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, time.Duration, error) {
	if !req.Deadline.IsZero() {
		// The request's own deadline (a merged batch's latest) ends its
		// execution as a gRPC deadline does: a runner that hangs holds no
		// request past it.
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, req.Deadline)
		defer cancel()
	}
	var queue time.Duration
	attempts := min(2, v.cfg.Instances) // swaps replace instances, never change their number
	var (
		err  error
		last Instance
	)
	for attempt := range attempts {
		if attempt > 0 {
			v.obs.retries.Inc()
		}
		q := time.Now()
		inst, perr := v.pick(ctx, last)
		queue += time.Since(q)
		if perr != nil {
			return nil, queue, perr
		}
		var resp *runtime.InferResponse
		resp, err = v.call(ctx, inst, req)
		v.putBack(inst)
		if err == nil {
			return resp, queue, nil
		}
		if !errors.Is(err, runtime.ErrUnavailable) || errors.Is(err, runtime.ErrOutOfMemory) || ctx.Err() != nil {
			break
		}
		last = inst
	}
	return nil, queue, err
}

// suspectAfter is how long a call must have gone unanswered before its
// abandonment (by the caller's deadline or cancellation) makes the instance
// check its health; the call timeout always does.
const suspectAfter = time.Second

// call runs one request on one instance under the call timeout. A call
// that gets no answer in time makes the instance check its health at once,
// so that a hung runner is found without waiting for the periodic checks.
func (v *version) call(ctx context.Context, inst Instance, req *runtime.InferRequest) (*runtime.InferResponse, error) {
	start := time.Now()
	cctx, cancel := context.WithTimeout(ctx, v.callTimeout)
	defer cancel()
	resp, err := inst.Infer(cctx, req)
	if err == nil || cctx.Err() == nil {
		return resp, err
	}
	took := time.Since(start)
	timedOut := ctx.Err() == nil
	if s, ok := inst.(Suspecter); ok && (timedOut || took >= min(suspectAfter, v.callTimeout)) {
		why := fmt.Sprintf("a call was abandoned unanswered after %s (%v)", took.Round(time.Millisecond), context.Cause(ctx))
		if timedOut {
			why = fmt.Sprintf("a call got no answer within the call timeout of %s", v.callTimeout)
		}
		s.Suspect(why)
	}
	if timedOut {
		return nil, fmt.Errorf("%w: no answer within the call timeout of %s", runtime.ErrUnavailable, v.callTimeout)
	}
	return nil, err
}

// parkPoll is how often a parked execution slot looks whether its instance
// serves again.
const parkPoll = 20 * time.Millisecond

// pick takes an execution slot for a request, preferring instances that
// can serve now and, for a retry, another than avoid. The slots of an
// instance that cannot serve (restarting, being checked, failed) leave the
// rotation while another instance of the version can serve, and come back
// when it can. When no other instance can serve, the slot is used anyway:
// the call then fails at once, with the instance's reason.
func (v *version) pick(ctx context.Context, avoid Instance) (Instance, error) {
	for skipped := 0; ; skipped++ {
		var inst Instance
		select {
		case inst = <-v.idle:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		ready := instanceReady(inst)
		if skipped >= cap(v.idle) || (ready && inst != avoid) || !v.otherReady(inst) {
			return inst, nil
		}
		if ready {
			v.idle <- inst // avoid: a last resort
			continue
		}
		v.park(inst)
	}
}

// putBack returns an execution slot after a call: to the pool, or parked
// while its instance cannot serve and another can.
func (v *version) putBack(inst Instance) {
	if !instanceReady(inst) && v.otherReady(inst) {
		v.park(inst)
		return
	}
	v.idle <- inst
}

// park holds an execution slot out of the pool until its instance can
// serve again, no other instance of the version can, or the instance has
// been replaced; it drops the slot when the version stops.
func (v *version) park(inst Instance) {
	go func() {
		t := time.NewTicker(parkPoll)
		defer t.Stop()
		for {
			select {
			case <-v.stopped:
				return
			case <-t.C:
			}
			if instanceReady(inst) || !v.otherReady(inst) || !v.current(inst) {
				v.idle <- inst
				return
			}
		}
	}()
}

func instanceReady(inst Instance) bool {
	ok, _ := inst.Status()
	return ok
}

// otherReady reports whether an instance of the version other than inst
// can serve now.
func (v *version) otherReady(inst Instance) bool {
	v.instMu.RLock()
	defer v.instMu.RUnlock()
	for _, o := range v.instances {
		if o != inst && instanceReady(o) {
			return true
		}
	}
	return false
}

// current reports whether inst is still one of the version's instances
// (a swap replaces them).
func (v *version) current(inst Instance) bool {
	v.instMu.RLock()
	defer v.instMu.RUnlock()
	return slices.Contains(v.instances, inst)
}

func (v *version) finish(o outcome, batch int, start time.Time, queue time.Duration, t *runtime.Timing) {
	total := time.Since(start)
	v.stats.record(o, batch, total, queue, t)
	v.obs.observe(o, total, queue, t)
}

// ModelReady reports whether a version ("" = any) of the model can serve.
func (r *Registry) ModelReady(name, ver string) (bool, error) {
	if err := validName(name); err != nil {
		return false, fmt.Errorf("%w: %q", ErrModelNotFound, name)
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	m, ok := r.models[name]
	if !ok {
		return false, fmt.Errorf("%w: %q", ErrModelNotFound, name)
	}
	v, err := m.resolve(ver)
	if errors.Is(err, ErrNotReady) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return v.ready(), nil
}

// notes joins what the version's instances say about themselves (why one
// cannot serve) or, when all serve, the last fault they recovered from.
func (v *version) notes() string {
	v.instMu.RLock()
	defer v.instMu.RUnlock()
	var out []string
	for i, inst := range v.instances {
		if _, why := inst.Status(); why != "" {
			if len(v.instances) > 1 {
				why = fmt.Sprintf("instance %d: %s", i, why)
			}
			out = append(out, why)
		}
	}
	if len(out) == 0 {
		if f := v.fault.Load(); f != nil {
			return *f
		}
	}
	return strings.Join(out, "; ")
}

// setFault records an unexpected end of instance i's process.
func (v *version) setFault(i int, cause string) {
	f := fmt.Sprintf("recovered: instance %d's runner ended at %s: %s", i, time.Now().UTC().Format(time.RFC3339), cause)
	v.fault.Store(&f)
}

// ready reports whether any instance of the version can serve now.
func (v *version) ready() bool {
	for _, inst := range v.instances {
		if ok, _ := inst.Status(); ok {
			return true
		}
	}
	return false
}

// Metadata describes a model; ver "" describes its highest ready version.
func (r *Registry) Metadata(name, ver string) (Metadata, error) {
	if err := validName(name); err != nil {
		return Metadata{}, fmt.Errorf("%w: %q", ErrModelNotFound, name)
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	m, ok := r.models[name]
	if !ok {
		return Metadata{}, fmt.Errorf("%w: %q", ErrModelNotFound, name)
	}
	v, err := m.resolve(ver)
	if err != nil {
		return Metadata{}, err
	}
	md := Metadata{Name: name, Platform: "onnxruntime_onnx", Inputs: v.inputs, Outputs: v.outputs}
	for _, sv := range m.serving {
		md.Versions = append(md.Versions, sv.label)
	}
	slices.SortFunc(md.Versions, func(a, b string) int { return cmp.Compare(len(a), len(b))*2 + cmp.Compare(a, b) })
	if ver != "" {
		md.Versions = []string{v.label}
	}
	return md, nil
}

// ModelConfig is the config a version ("" = the highest ready one) serves
// with, its inputs and outputs those of the loaded model. The copy shares
// its lists and policies with the version's: read it, do not change it.
func (r *Registry) ModelConfig(name, ver string) (*configs.Model, error) {
	if err := validName(name); err != nil {
		return nil, fmt.Errorf("%w: %q", ErrModelNotFound, name)
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	m, ok := r.models[name]
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrModelNotFound, name)
	}
	v, err := m.resolve(ver)
	if err != nil {
		return nil, err
	}
	cfg := *v.cfg
	cfg.Inputs, cfg.Outputs = tensorConfigs(v.inputs), tensorConfigs(v.outputs)
	cfg.Warnings = nil
	return &cfg, nil
}

func tensorConfigs(specs []runtime.TensorSpec) []configs.TensorConfig {
	out := make([]configs.TensorConfig, len(specs))
	for i, s := range specs {
		out[i] = configs.TensorConfig{Name: s.Name, DataType: string(s.DataType), Shape: slices.Clone(s.Shape)}
	}
	return out
}

// Index lists every model in the repositories with the state of each of its
// versions; readyOnly keeps the ready ones.
func (r *Registry) Index(readyOnly bool) []IndexEntry {
	if r.opts.Control == ControlExplicit {
		r.scan()
	}
	return r.IndexKnown(readyOnly)
}

// IndexKnown is Index without rescanning the repositories: the models the
// registry knows, for readers that come often (metrics, the dashboard).
func (r *Registry) IndexKnown(readyOnly bool) []IndexEntry {
	r.mu.RLock()
	defer r.mu.RUnlock()
	var out []IndexEntry
	for _, m := range r.models {
		if len(m.states) == 0 {
			if !readyOnly {
				out = append(out, IndexEntry{Name: m.name, State: StateUnavailable, Reason: m.reason})
			}
			continue
		}
		for n, e := range m.states {
			if v, ok := m.serving[n]; ok && e.State == StateReady {
				if !v.ready() {
					e = IndexEntry{Name: e.Name, Version: e.Version, State: StateUnavailable, Reason: v.notes()}
				} else if e.Reason == "" {
					e.Reason = v.notes()
				}
			}
			if readyOnly && e.State != StateReady {
				continue
			}
			out = append(out, e)
		}
	}
	slices.SortFunc(out, func(a, b IndexEntry) int {
		return cmp.Or(cmp.Compare(a.Name, b.Name), cmp.Compare(len(a.Version), len(b.Version)), cmp.Compare(a.Version, b.Version))
	})
	return out
}

// loadFailures tells, for every model in the repositories, whether its last
// load or reload failed.
func (r *Registry) loadFailures() map[string]bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make(map[string]bool, len(r.models))
	for name, m := range r.models {
		out[name] = m.loadFailed
	}
	return out
}

// Statistics returns per-version statistics of loaded versions: all models
// when name is "", all versions of the model when ver is "".
func (r *Registry) Statistics(name, ver string) ([]Statistics, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	var ms []*model
	if name == "" {
		for _, m := range r.models {
			ms = append(ms, m)
		}
	} else {
		m, ok := r.models[name]
		if !ok {
			return nil, fmt.Errorf("%w: %q", ErrModelNotFound, name)
		}
		ms = []*model{m}
		if ver != "" {
			v, err := m.resolve(ver)
			if err != nil {
				return nil, err
			}
			return []Statistics{v.statistics()}, nil
		}
	}
	var out []Statistics
	for _, m := range ms {
		for _, v := range m.serving {
			out = append(out, v.statistics())
		}
	}
	slices.SortFunc(out, func(a, b Statistics) int {
		return cmp.Or(cmp.Compare(a.Name, b.Name), cmp.Compare(len(a.Version), len(b.Version)), cmp.Compare(a.Version, b.Version))
	})
	return out, nil
}

// statistics is the version's statistics, with its scheduler's SLO
// accounting when it has one.
func (v *version) statistics() Statistics {
	s := v.stats.snapshot()
	s.Name, s.Version = v.model, v.label
	if v.sched == nil {
		return s
	}
	if q, ok := v.sched.Stats(v.key); ok {
		s.SLO = &SLOStatistics{
			Class: string(q.Class), LatencyTarget: v.cfg.LatencyTarget(),
			Arrived: q.Arrived, Good: q.Good, Late: q.Late, Rejected: q.Rejected,
			Dropped: q.Dropped, Failed: q.Failed, Canceled: q.Canceled,
			QueueDepth: q.QueueDepth, Goodput: q.Goodput, Attainment: q.Attainment,
			MeanQueueDelay: q.MeanQueueDelay,
		}
	}
	return s
}

// Instances calls fn for every instance of every serving version, for
// per-process metrics.
func (r *Registry) Instances(fn func(model, version string, index int, inst Instance)) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	for _, m := range r.models {
		for _, v := range m.serving {
			v.instMu.RLock()
			for i, inst := range v.instances {
				fn(m.name, v.label, i, inst)
			}
			v.instMu.RUnlock()
		}
	}
}
