// Package models is the catalogue of models: it finds models in repository
// folders, loads the versions a model's policy selects, answers which
// versions are ready, and unloads or reloads models without dropping
// requests. A request's name and version resolve to a version: its
// metadata, which the request is validated against, and the runtime.Pool of
// its instances, which its device's qos scheduler executes on directly.
//
// It also starts each instance in a limiter unit and applies the shares the
// adjuster chooses to them (it is the qos Actuator): a live resize, or a
// replacement it starts and the pool swaps in; it evicts idle models and
// loads them again on demand; it moves a version to another GPU by a warm
// shadow when placement asks (place.go). It must not decide shares or
// placements (control does), admit, order or count requests (qos does),
// pick instances or run calls (the pool does), or speak a wire protocol
// (api does).
package models

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
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
	runtime.Member
	Inputs() []runtime.TensorSpec
	Outputs() []runtime.TensorSpec
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
	// Restarting, when set, is called before each restart of the
	// instance's process and returns what to call once the new process
	// is ready, before it serves, with its pid (runtime.RunnerConfig.Restarting):
	// it lifts the instance's unit while the process loads and gives it its
	// share after, and tells a backend that accounts by process the new
	// pid; an error from the second fails that start.
	Restarting func() (ready func(pid int) error)
}

// Options configure a Registry.
type Options struct {
	Repositories      []string
	Control           string // ControlNone, ControlExplicit or ControlPoll
	PollInterval      time.Duration
	StartupModels     []string // explicit mode; "*" loads all
	MaxTensorElements int64
	MaxBatchSize      int           // largest max_batch_size a model may have; 0 = no limit
	DrainTimeout      time.Duration // how long unload waits for in-flight requests
	// CallTimeout bounds one call to an instance (0:
	// runtime.DefaultCallTimeout); see runtime.PoolOptions.
	CallTimeout time.Duration
	// NewInstance starts one instance; it returns once the instance is ready
	// or has failed to start.
	NewInstance func(ctx context.Context, spec InstanceSpec) (Instance, error)
	Logger      *slog.Logger
	Registerer  prometheus.Registerer
	// Scheduler returns the QoS scheduler of an execution device ("cpu",
	// "cuda:0", ...). Every request goes through its version's scheduler:
	// admission, queueing, batching, deadlines, and the count of its
	// outcome. Nil: the registry runs one scheduler of its own, with qos's
	// defaults, for every device, from Start to Stop.
	Scheduler func(device string) (*qos.Scheduler, error)
	// Estimator receives the warm-up runs at load; it should be the one
	// the schedulers predict with. Nil skips the warm-up.
	Estimator qos.Estimator
	// Limiter returns the share enforcer of an execution device; nil (or a
	// nil Limiter) enforces nothing.
	Limiter func(device string) limiter.Limiter
	// BestEffortMode, when set, is the class (limiter.Mode) a best-effort
	// version's instances start in on a device: the one its device's
	// control loop will give it (limiter.ModeBackground where the policy
	// runs best-effort work behind the rest on a limiter with a
	// background class), so that the loop's first share is no change of
	// class. On MPS a change of class is a new client, whose warm-up
	// below normal priority waited behind its own predecessor's batches
	// at normal priority for up to a minute on the simulated GPU day,
	// with both clients' memory pinned. Nil: the limiter's default.
	BestEffortMode func(device string) limiter.Mode
	// Profile, when set, runs the predictor's sweep for each freshly
	// loaded version before it takes traffic (see ProfileRun).
	Profile func(ctx context.Context, run ProfileRun) error
	// Place, when set, chooses the cuda device (its index) of a model
	// whose config names none (see place.go); nil loads it on device 0.
	// It is called for the cuda models that name one too, and must
	// return that one. memory is what each instance will pin at load: its
	// first memory share (FirstMemory), 0 for its memory_limit.
	Place func(model string, cfg *configs.Model, memory int64) (int, error)
	// FirstMemory, when set, is the memory share (bytes per instance) a
	// new version starts at instead of its memory_limit: the server gives
	// one where the control loop sizes memory shares from working sets
	// (the adaptive policy on a GPU) and a profile of the model file
	// (path) measured them before; 0, or one not under the memory_limit,
	// keeps the memory_limit. The profile at load runs at it, so it must
	// hold every batch size the version runs.
	FirstMemory func(path string, cfg *configs.Model) int64
	// HasGPU says the server has a GPU (a real or a simulated one): a
	// model whose config leaves the device to the server
	// (configs.Execution.Auto, Triton's KIND_AUTO) runs there, else on
	// the CPU.
	HasGPU bool
	// Forget, when set, is called with a version's scheduler name
	// ("model/N") once the version is gone for good: replaced by other
	// versions, unloaded through the API, or its model removed from the
	// repositories (not when evicted: it comes back on demand).
	Forget func(key string)
}

// Registry holds every model the repositories contain and the versions of
// them that are loaded.
type Registry struct {
	opts    Options
	log     *slog.Logger
	metrics *metrics

	// own is the scheduler the registry runs itself when
	// Options.Scheduler is nil; ownStop ends its Run, which closes ownDone.
	own     *qos.Scheduler
	ownStop context.CancelFunc
	ownDone chan struct{}

	// Settings a config reload changes while the registry runs; they start
	// as Options says.
	drainTimeout atomic.Int64 // a time.Duration
	pollInterval atomic.Int64 // a time.Duration

	mu     sync.RWMutex
	models map[string]*model
	repos  []string // the repositories; guarded by mu

	// rescan asks the watcher for a pass over the repositories now.
	rescan    chan struct{}
	watchDone chan struct{} // closed when the watcher has returned
	started   atomic.Bool
	unitSeq   atomic.Uint64 // makes limiter unit ids unique
	// capsLifted is set once LiftCaps has run: the server is stopping.
	capsLifted atomic.Bool
}

// model is one folder of a repository and what is loaded from it.
type model struct {
	name string
	dir  string

	op sync.Mutex // serialises load, reload and unload of this model

	// Guarded by Registry.mu.
	cfg         *configs.Model
	serving     map[int64]*version
	ens         *ensemble            // the loaded ensemble, when the model is one (ensemble.go); serving is then empty
	states      map[int64]IndexEntry // last known state of each version
	reason      string               // why the model as a whole is not serving
	fingerprint string               // of the files that the last load read
	evicted     bool                 // unloaded for memory: the next request loads it
	loadFailed  bool                 // the last load or reload failed; reason says why
	removed     bool                 // its folder is gone: requests find no model
	// override is the Triton config (JSON) the last load was given in
	// place of the folder's config; nil when it read the folder's. Loads
	// on demand and reloads keep it; the next load by request replaces it.
	override []byte

	demand sync.Mutex // one load on demand at a time
	// reviving counts the requests in revive, so that a request that finds
	// the model not ready while another loads it on demand waits for that
	// load instead of failing.
	reviving atomic.Int32
}

// version is one loaded model version: its config, metadata and the pool
// of its instances.
type version struct {
	model   string
	number  int64
	label   string
	key     string         // model/version, the scheduler's name for it
	sched   *qos.Scheduler // set once it is scheduled; runs and counts its requests
	cfg     *configs.Model
	path    string // the model.onnx file
	device  string // "cpu" or "cuda:N"
	lim     limiter.Limiter
	inputs  []runtime.TensorSpec // as the model file has them
	outputs []runtime.TensorSpec
	// wireInputs and wireOutputs are the tensors as clients send and get
	// them: inputs and outputs but for the shapes of reshaped ones
	// (configs.TensorConfig.Reshape); nil: the same as the model's. Read
	// them through wire.
	wireInputs  []runtime.TensorSpec
	wireOutputs []runtime.TensorSpec
	maxBatch    int
	// maxElements is the server's limits.max_tensor_elements: no sample
	// request the version builds (warm-up, profiling) is larger.
	maxElements int64
	pool        *runtime.Pool // the instances; the scheduler executes on it

	shareMu sync.Mutex // serialises share changes and swaps
	retired bool       // guarded by shareMu: being stopped, no more swaps
	// retiring ends when the version starts to be stopped (retire): a
	// swap that holds shareMu (SetShare, profiling) then abandons the
	// replacement it is starting instead of holding the stop until that
	// replacement is ready (up to runtime.ready_timeout). nil in versions
	// made by tests.
	retiring context.Context
	retire   context.CancelFunc
	moving   atomic.Bool // moving to another device (place.go): no more swaps

	resizeMu  sync.Mutex // guards the fields below (RequestShare)
	resizing  *resize    // the latest request whose replacements run; nil: none
	resizeErr error      // why the last finished request did not apply

	instMu   sync.RWMutex            // guards the fields below; swaps replace instances
	units    map[runtime.Member]unit // the limiter unit of each instance
	share    limiter.Share           // the version's share of its device
	inflight sync.WaitGroup
	// requests counts the inferences in inflight (not Preadmit's brief
	// holds): what a drain reports it waited for.
	requests atomic.Int64
	// fault is the last unexpected end of one of the version's instance
	// processes, kept for the index once the instance serves again.
	fault atomic.Pointer[string]
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
	if opts.Scheduler == nil {
		own, err := qos.NewScheduler(qos.Options{Logger: opts.Logger, Registerer: opts.Registerer})
		if err != nil {
			return nil, err
		}
		r.own = own
		r.opts.Scheduler = func(string) (*qos.Scheduler, error) { return own, nil }
	}
	r.drainTimeout.Store(int64(cmp.Or(opts.DrainTimeout, 30*time.Second)))
	r.pollInterval.Store(int64(opts.PollInterval))
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
	if r.own != nil {
		runCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
		r.ownStop, r.ownDone = stop, make(chan struct{})
		go func() {
			defer close(r.ownDone)
			_ = r.own.Run(runCtx)
		}()
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
	// Ensembles load once the models they run have.
	for _, wave := range r.ensemblesLast(names) {
		var wg sync.WaitGroup
		for _, name := range wave {
			wg.Go(func() {
				if err := r.load(ctx, name); err != nil {
					r.log.Error("model failed to load", "model", name, "err", err)
				}
			})
		}
		wg.Wait()
	}
	r.started.Store(true)
	if r.opts.Control != ControlExplicit {
		r.watchDone = make(chan struct{})
		go r.watch(ctx)
	}
	return nil
}

// Started reports whether Start has finished its initial loads.
func (r *Registry) Started() bool { return r.started.Load() }

// Stop unloads every model, draining in-flight requests first, then stops
// the registry's own scheduler, if it runs one. In poll and none modes it
// expects Start's ctx to be cancelled already and waits for the watcher.
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
	if r.ownStop != nil {
		r.ownStop()
		<-r.ownDone
	}
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
	m, err := r.modelLocked(name)
	r.mu.RUnlock()
	if err == nil {
		return m, nil
	}
	r.scan()
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.modelLocked(name)
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
	_, v, err := r.findLocked(name, ver)
	return v, err
}

// findLocked is the one lookup of a model version by name ("" = the
// model's default version) on the request path: the model, and its serving
// version or why there is none (ErrModelNotFound for a name that is not
// valid or not known; resolve's errors for the version). The caller holds
// r.mu, for reading at least.
func (r *Registry) findLocked(name, ver string) (*model, *version, error) {
	m, err := r.modelLocked(name)
	if err != nil {
		return nil, nil, err
	}
	v, err := m.resolve(ver)
	return m, v, err
}

// modelLocked is the model named name, or ErrModelNotFound for a name
// that is not valid or not known. The caller holds r.mu.
func (r *Registry) modelLocked(name string) (*model, error) {
	if validName(name) != nil {
		return nil, modelNotFound(name, "")
	}
	m, ok := r.models[name]
	if !ok {
		return nil, modelNotFound(name, "")
	}
	return m, nil
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
