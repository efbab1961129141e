package qos

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/runtime"
)

// Class is a model's SLO class.
type Class string

// The SLO classes, named as in model config files.
const (
	// ClassLatencyCritical requests are scheduled earliest-deadline-first
	// ahead of best-effort work.
	ClassLatencyCritical Class = "latency-critical"
	// ClassBestEffort requests use the capacity latency-critical work
	// leaves, and a small floor of it (Options.BestEffortFloor).
	ClassBestEffort Class = "best-effort"
)

// The scheduling policies.
const (
	// PolicyQoS is sloserve's policy: EDF for latency-critical work,
	// best-effort in the gaps, deadline-aware batching, admission control
	// and dropping.
	PolicyQoS = "qos"
	// PolicyFIFO is the baseline: one FIFO queue per model, the model whose
	// head arrived first goes next, batches take what is queued up to the
	// maximum; no classes, priorities, admission or dropping.
	PolicyFIFO = "fifo"
)

// Defaults for zero values in Options and ModelSpec.
const (
	DefaultBestEffortFloor = 0.05
	DefaultWindow          = 10 * time.Second
	DefaultQueueCapacity   = 256
	// DefaultMaxBestEffortExecution is Options.MaxBestEffortExecution's
	// default.
	DefaultMaxBestEffortExecution = 200 * time.Millisecond
)

// Executor runs one request, possibly merged from several, on a model's
// instances. A runtime.Instance can be adapted with ExecutorFunc.
type Executor interface {
	Execute(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error)
}

// ExecutorFunc adapts a function to Executor.
type ExecutorFunc func(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error)

// Execute implements Executor.
func (f ExecutorFunc) Execute(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
	return f(ctx, req)
}

var _ Executor = ExecutorFunc(nil)

// ModelSpec is what the scheduler needs to know about a model.
type ModelSpec struct {
	// Name is the registry key, such as "ocr-det/1".
	Name string
	// Class is the SLO class; empty means best-effort.
	Class Class
	// Priority breaks ties between equal deadlines and orders best-effort
	// models: 1 is highest, then 2, 3...; 0 (default) ranks after them all.
	Priority int
	// SLO is the latency target; 0 means none.
	SLO time.Duration
	// MaxBatchSize is the largest merged batch; 0 means the model has no
	// batch dimension and requests are never merged.
	MaxBatchSize int
	// MaxQueueDelay is how long the head request may wait for a batch to
	// fill; under the qos policy never longer than its deadline allows.
	MaxQueueDelay time.Duration
	// PreferredBatchSizes: a batch that can be cut to one of these sizes is
	// cut to the largest and sent at once (qos policy).
	PreferredBatchSizes []int
	// QueueCapacity bounds the queue; 0 means DefaultQueueCapacity.
	QueueCapacity int
	// Slots is how many executions the model runs at once (instances ×
	// concurrency); 0 means 1.
	Slots int
	// Executor runs the model's batches.
	Executor Executor

	// MinShare and MaxShare bound the compute share the adjuster gives the
	// model, as fractions of the device; 0 means the adjuster's MinShare
	// and 1.
	MinShare, MaxShare float64
	// Pin fixes the model's share (from its config); the adjuster applies
	// it as it is. nil leaves the share to the adjuster's policy.
	Pin *limiter.Share
	// Memory is the model's memory share in bytes; 0 means none.
	Memory int64
}

// LogValue implements slog.LogValuer.
func (s ModelSpec) LogValue() slog.Value {
	return slog.GroupValue(
		slog.String("name", s.Name), slog.String("class", string(s.Class)),
		slog.Int("priority", s.Priority), slog.Duration("slo", s.SLO),
		slog.Int("max_batch_size", s.MaxBatchSize), slog.Int("slots", s.Slots))
}

// Options configure a Scheduler.
type Options struct {
	// Policy is PolicyQoS (default) or PolicyFIFO.
	Policy string
	// BestEffortFloor is the fraction of executions best-effort work gets
	// while it waits under latency-critical load: 0 means
	// DefaultBestEffortFloor, negative means no floor.
	BestEffortFloor float64
	// DeviceSlots is how many executions the device runs at once across
	// all models (CPU cores, or the clients of a GPU's MPS server); 0 means 1.
	DeviceSlots int
	// SeparateClasses gives latency-critical and best-effort executions
	// DeviceSlots each instead of one pool: best-effort executions then
	// never hold a slot a latency-critical request waits for, and
	// latency-critical admission does not count them. Set it only where
	// the device itself runs best-effort work behind latency-critical
	// work (the limiter's background mode); elsewhere the two pools
	// would oversubscribe the device. Ignored under PolicyFIFO.
	SeparateClasses bool
	// OverlapSlowdown is how much slower an execution runs while another
	// latency-critical execution runs beside it on the device (qos
	// policy). Above 1, the dispatcher holds a latency-critical batch
	// back instead of starting it beside a running latency-critical
	// execution that the overlap would make late, when the held batch can
	// wait for that execution's predicted end and still meet its own
	// deadline (yieldLocked). 0 or 1: batches start whenever a slot is
	// free.
	OverlapSlowdown float64
	// MaxBestEffortExecution bounds the predicted duration of a
	// best-effort batch (qos policy): a batch stops growing before its
	// prediction passes it, so that best-effort work yields at batch
	// boundaries this often. 0 means DefaultMaxBestEffortExecution,
	// negative no bound. A single request is never cut.
	MaxBestEffortExecution time.Duration
	// Estimator predicts execution times; nil means a new EWMAEstimator.
	Estimator Estimator
	// Logger; nil discards.
	Logger *slog.Logger
	// Registerer receives the metrics; nil leaves them unregistered.
	Registerer prometheus.Registerer
	// Device labels the metrics (const label "device") so that the
	// schedulers of several devices can share a registry.
	Device string
	// Window is the sliding window of goodput and attainment; 0 means
	// DefaultWindow.
	Window time.Duration
	// Gate bounds the requests in flight across the schedulers that share
	// it; nil bounds nothing.
	Gate *Gate
}

// Scheduler queues, batches and dispatches the requests of the models on
// one execution device. Run owns the dispatch loop; the other methods are
// safe for concurrent use.
type Scheduler struct {
	opts     Options
	fifo     bool
	separate bool // Options.SeparateClasses, and not fifo
	floor    float64
	est      SizedEstimator
	log      *slog.Logger
	metrics  *metrics
	trigger  chan struct{} // capacity 1: dispatch passes collapse

	mu      sync.Mutex
	models  map[string]*model
	running int // executions in progress on the device
	// runningBE is the best-effort part of running.
	runningBE int
	seq       uint64  // last request sequence number
	beCredit  float64 // best-effort floor credit, see pickLocked
	started   bool
	stopped   bool
	runCtx    context.Context
	execs     sync.WaitGroup
	// scratch holds admitLocked's slot tables between calls (guarded by
	// mu): 48 device slots on an MPS GPU made them most of the bytes a
	// request allocated.
	scratch [2]slots
	// estCache is playOwnLocked's estimates by batch size (guarded by mu).
	estCache estimates
	// logs are the per-request log lines written under mu (logLocked),
	// emitted by unlock once mu is free: a log handler takes a lock of its
	// own and writes to a file or pipe, and under overload thousands of
	// refusals a second queued behind it while holding mu stalled every
	// arrival and the dispatcher with them.
	logs []pendingLog
}

// pendingLog is a log line waiting for the scheduler's lock to be free.
type pendingLog struct {
	log  *slog.Logger
	msg  string
	args []any
}

// logLocked logs msg at debug level once mu is released.
func (s *Scheduler) logLocked(log *slog.Logger, msg string, args ...any) {
	if !log.Enabled(context.Background(), slog.LevelDebug) {
		return
	}
	s.logs = append(s.logs, pendingLog{log, msg, args})
}

// unlock releases mu, then writes the log lines logged under it.
func (s *Scheduler) unlock() {
	logs := s.logs
	s.logs = nil
	s.mu.Unlock()
	for _, l := range logs {
		l.log.Debug(l.msg, l.args...)
	}
}

// model is one model's queue and accounting.
type model struct {
	spec     ModelSpec
	log      *slog.Logger
	q        queue
	running  int
	execs    map[*execution]struct{}
	removing bool
	drained  chan struct{} // closed when a removal completes

	added time.Time
	// lastStart is when the model's last execution started; zero before
	// the first.
	lastStart time.Time
	// refused counts the requests refused (ErrRejected) or dropped on a
	// prediction since lastStart: predictions nothing has corrected.
	refused int
	// recentBatch is a moving average of the model's execution batch
	// sizes. Admission assumes the work of other models queued ahead, and
	// a model's own queue it cannot play forward (playOwnLocked), runs in
	// batches of this size: under pressure, deadline-aware batching forms
	// batches well below the maximum, and assuming full ones would
	// under-predict the wait.
	recentBatch float64
	// vtime is a best-effort model's virtual time: the predicted
	// execution seconds it has been given, over its weight. The
	// backlogged best-effort model with the least goes next (fair
	// queueing on estimated work, see pickLocked).
	vtime       float64
	arrived     uint64
	lastArrival time.Time // zero until a request arrives
	// gaps and service are the variability the adjuster's queueing model
	// needs: the inter-arrival times, and each execution's time over its
	// prediction.
	gaps, service moments
	tail          tail // the executions' predicted and observed times, for admission's room for error
	counts        [numOutcomes]uint64
	queueFull     uint64           // rejections for a full queue, of counts[outcomeRejected]
	overloaded    uint64           // rejections by the Gate, of counts[outcomeRejected]
	latency       LatencyHistogram // arrival to answer, of the good and late requests
	requests      requestStats
	executions    uint64
	batches       map[int]*BatchStats // successful executions by batch size
	// overlapHeld is the sequence number of the head of the latest batch
	// of m held back beside a running execution (yieldLocked), so that a
	// hold is counted and logged once however many dispatch passes
	// repeat it (a number, not the request: a finished request's inputs
	// are not kept alive by it).
	overlapHeld uint64
	// memHeld says the last plan held m's head for its instances' memory
	// to grow (memory.go); bigRows and bigRowsAt are the largest request
	// of late (observeRows).
	memHeld   bool
	bigRows   int
	bigRowsAt time.Time
	win       *window
	mm        *modelMetrics
}

// batchSizeWeight is the weight of each new execution in recentBatch.
const batchSizeWeight = 0.1

// typicalBatch is the batch size admission assumes for queued work: the
// recent average, rounded, within 1..max batch size. A model that has not
// run yet is assumed to fill its batches.
func (m *model) typicalBatch() int {
	maxBatch := max(m.spec.MaxBatchSize, 1)
	if m.recentBatch == 0 {
		return maxBatch
	}
	return min(max(int(m.recentBatch+0.5), 1), maxBatch)
}

// maxTailRatio bounds the room admission leaves for error: at most
// (maxTailRatio-1) times the queue's predicted time.
const maxTailRatio = 3

// room is the time admission leaves for the error of a queue of the
// model's executions predicted to take queue (see tail): counted in time,
// so that the stalls of a busy host, which delay a queue once, are not
// charged to every execution in it. (A ratio per execution did: sixteen
// closed-loop clients of a 1 ms model got 429s against a 40 ms SLO.)
func (m *model) room(queue time.Duration) time.Duration { return m.tail.room(queue) }

// parallelLocked is how many of m's executions run at once when its
// queue drains: its slots, at most the device's.
func (s *Scheduler) parallelLocked(m *model) int {
	return max(min(m.spec.Slots, s.opts.DeviceSlots), 1)
}

// sharedRoom is room for a plan of queue that holds work of the model's
// predicted executions spread over its slots (see tail.shared).
func (m *model) sharedRoom(queue, work time.Duration) time.Duration {
	return m.tail.shared(queue, work)
}

// execution is one batch in progress.
type execution struct {
	m         *model
	name      string   // the model's name, read without the lock
	exec      Executor // the model's executor when the batch started
	reqs      []*request
	size      int
	elements  int64 // per row, as its requests' (one merge key: one shape); 0 unknown
	start     time.Time
	predicted time.Duration // 0: unknown
	deadline  time.Time     // the earliest of its requests' deadlines; zero: none
	live      int           // members whose clients still wait
	cancel    context.CancelFunc
}

// NewScheduler returns a scheduler for one device. Call Run to dispatch.
func NewScheduler(opts Options) (*Scheduler, error) {
	switch opts.Policy {
	case "":
		opts.Policy = PolicyQoS
	case PolicyQoS, PolicyFIFO:
	default:
		return nil, fmt.Errorf("qos: unknown policy %q (want %q or %q)", opts.Policy, PolicyQoS, PolicyFIFO)
	}
	switch {
	case math.IsNaN(opts.BestEffortFloor) || opts.BestEffortFloor > 1:
		return nil, fmt.Errorf("qos: best-effort floor %v is not a fraction", opts.BestEffortFloor)
	case opts.BestEffortFloor == 0:
		opts.BestEffortFloor = DefaultBestEffortFloor
	case opts.BestEffortFloor < 0:
		opts.BestEffortFloor = 0
	}
	if math.IsNaN(opts.OverlapSlowdown) || math.IsInf(opts.OverlapSlowdown, 0) || opts.OverlapSlowdown < 0 {
		return nil, fmt.Errorf("qos: overlap slowdown %v is not a factor >= 0", opts.OverlapSlowdown)
	}
	if opts.DeviceSlots < 0 || opts.Window < 0 {
		return nil, fmt.Errorf("qos: negative device slots (%d) or window (%s)", opts.DeviceSlots, opts.Window)
	}
	opts.DeviceSlots = max(opts.DeviceSlots, 1)
	switch {
	case opts.MaxBestEffortExecution == 0:
		opts.MaxBestEffortExecution = DefaultMaxBestEffortExecution
	case opts.MaxBestEffortExecution < 0:
		opts.MaxBestEffortExecution = 0
	}
	opts.Window = cmp.Or(opts.Window, DefaultWindow)
	if opts.Estimator == nil {
		opts.Estimator = NewEWMAEstimator(DefaultEWMAAlpha)
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Scheduler{
		opts:     opts,
		fifo:     opts.Policy == PolicyFIFO,
		separate: opts.SeparateClasses && opts.Policy != PolicyFIFO,
		floor:    opts.BestEffortFloor,
		est:      sized(opts.Estimator),
		log:      opts.Logger.With("component", "qos", "policy", opts.Policy),
		trigger:  make(chan struct{}, 1),
		models:   map[string]*model{},
	}
	m, err := newMetrics(opts.Registerer, opts.Device, s)
	if err != nil {
		return nil, err
	}
	s.metrics = m
	return s, nil
}

// kick asks the dispatch loop for a pass.
func (s *Scheduler) kick() {
	select {
	case s.trigger <- struct{}{}:
	default:
	}
}

// AddModel starts queueing requests for a model.
func (s *Scheduler) AddModel(spec ModelSpec) error {
	if err := validateSpec(&spec); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.unlock()
	if old, ok := s.models[spec.Name]; ok {
		if old.removing {
			return fmt.Errorf("qos: model %s is still being removed", spec.Name)
		}
		return fmt.Errorf("qos: model %s added twice", spec.Name)
	}
	now := time.Now()
	m := &model{
		spec:    spec,
		log:     s.log.With("model", spec.Name),
		q:       queue{fifo: s.fifo},
		execs:   map[*execution]struct{}{},
		drained: make(chan struct{}),
		added:   now,
		win:     newWindow(now, s.opts.Window),
		mm:      s.metrics.forModel(spec.Name, spec.Class),
	}
	s.models[spec.Name] = m
	m.log.Info("model added", "spec", spec)
	return nil
}

// UpdateModel replaces the spec of a model already added, as a reload does:
// queued requests stay queued, new executions use the new executor and
// limits, executions already running finish on the old executor.
func (s *Scheduler) UpdateModel(spec ModelSpec) error {
	if err := validateSpec(&spec); err != nil {
		return err
	}
	s.mu.Lock()
	m, ok := s.models[spec.Name]
	if !ok || m.removing {
		s.unlock()
		return fmt.Errorf("%w: %s", ErrUnknownModel, spec.Name)
	}
	if spec.Class != m.spec.Class {
		m.mm = s.metrics.forModel(spec.Name, spec.Class)
	}
	m.spec = spec
	m.log.Info("model updated", "spec", spec)
	s.unlock()
	s.kick()
	return nil
}

// HasModel reports whether a model has been added and not removed.
func (s *Scheduler) HasModel(name string) bool {
	s.mu.Lock()
	defer s.unlock()
	m, ok := s.models[name]
	return ok && !m.removing
}

func validateSpec(spec *ModelSpec) error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if spec.Name == "" {
		bad("name is empty")
	}
	switch spec.Class {
	case "":
		spec.Class = ClassBestEffort
	case ClassLatencyCritical, ClassBestEffort:
	default:
		bad("class %q is neither %s nor %s", spec.Class, ClassLatencyCritical, ClassBestEffort)
	}
	if spec.Priority < 0 {
		bad("priority %d is negative", spec.Priority)
	}
	if spec.SLO < 0 || spec.MaxQueueDelay < 0 {
		bad("negative SLO (%s) or max queue delay (%s)", spec.SLO, spec.MaxQueueDelay)
	}
	if spec.MaxBatchSize < 0 || spec.QueueCapacity < 0 || spec.Slots < 0 {
		bad("negative max batch size (%d), queue capacity (%d) or slots (%d)", spec.MaxBatchSize, spec.QueueCapacity, spec.Slots)
	}
	for _, p := range spec.PreferredBatchSizes {
		if p < 1 || p > spec.MaxBatchSize {
			bad("preferred batch size %d is outside 1..max batch size %d", p, spec.MaxBatchSize)
		}
	}
	if spec.Executor == nil {
		bad("no executor")
	}
	minOK := spec.MinShare >= 0 && spec.MinShare <= 1 // false for NaN
	maxOK := spec.MaxShare >= 0 && spec.MaxShare <= 1
	if !minOK || !maxOK {
		bad("min share %v or max share %v is not a fraction", spec.MinShare, spec.MaxShare)
	} else if spec.MaxShare > 0 && spec.MinShare > spec.MaxShare {
		bad("min share %v is over max share %v", spec.MinShare, spec.MaxShare)
	}
	if spec.Pin != nil && (!(spec.Pin.Compute >= 0) || math.IsInf(spec.Pin.Compute, 0) || spec.Pin.Memory < 0) {
		bad("pinned share %+v is negative or not a number", *spec.Pin)
	}
	if spec.Memory < 0 {
		bad("memory share %d is negative", spec.Memory)
	}
	if len(errs) > 0 {
		return fmt.Errorf("qos: model %q: %w", spec.Name, errors.Join(errs...))
	}
	spec.QueueCapacity = cmp.Or(spec.QueueCapacity, DefaultQueueCapacity)
	spec.Slots = max(spec.Slots, 1)
	spec.PreferredBatchSizes = slices.Clone(spec.PreferredBatchSizes)
	if spec.Pin != nil {
		pin := *spec.Pin
		spec.Pin = &pin
	}
	return nil
}

// RemoveModel stops admitting requests to a model, lets the queued ones run
// and waits for its executions to end. If ctx ends first, the requests still
// queued fail with ErrModelRemoved and RemoveModel returns ctx's error; the
// model then goes when its last execution ends.
func (s *Scheduler) RemoveModel(ctx context.Context, name string) error {
	s.mu.Lock()
	m, ok := s.models[name]
	if !ok {
		s.unlock()
		return fmt.Errorf("qos: %w: %s", ErrUnknownModel, name)
	}
	if !m.removing {
		m.removing = true
		m.log.Info("removing model", "queued", m.q.len(), "running", m.running)
	}
	s.finalizeLocked(m)
	s.unlock()
	s.kick()

	select {
	case <-m.drained:
		return nil
	case <-ctx.Done():
	}
	s.mu.Lock()
	now := time.Now()
	for _, r := range m.q.items {
		s.finishLocked(r, outcomeFailed, now, result{err: fmt.Errorf("%w: %s", ErrModelRemoved, name)})
	}
	m.q.items = nil
	s.finalizeLocked(m)
	s.unlock()
	select {
	case <-m.drained:
		return nil
	default:
		return fmt.Errorf("qos: removing %s, executions still running: %w", name, ctx.Err())
	}
}

// finalizeLocked completes a removal once nothing is queued or running.
func (s *Scheduler) finalizeLocked(m *model) {
	if !m.removing || m.q.len() > 0 || m.running > 0 || s.models[m.spec.Name] != m {
		return
	}
	delete(s.models, m.spec.Name)
	s.metrics.forget(m.spec.Name)
	close(m.drained)
	m.log.Info("model removed")
}

// RequestOptions are a request's own scheduling parameters.
type RequestOptions struct {
	// Deadline tightens the model's SLO: the effective deadline is the
	// earliest of Deadline, arrival + SLO and the context's deadline. Zero
	// adds nothing.
	Deadline time.Time
	// Priority overrides the model's priority (same scale); 0 keeps it.
	Priority int
}

// Device is the device the scheduler's metrics are labelled with.
func (s *Scheduler) Device() string { return s.opts.Device }

// Submit queues a request for a model and waits for its response. It
// returns ErrRejected, ErrQueueFull, ErrDropped, ErrUnknownModel,
// ErrModelRemoved, ErrInvalidRequest, ErrStopped, the executor's error, or
// ctx's error: ending ctx takes the request out of the queue at once.
func (s *Scheduler) Submit(ctx context.Context, name string, req *runtime.InferRequest, o RequestOptions) (*runtime.InferResponse, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	now := time.Now()
	s.mu.Lock()
	m, ok := s.models[name]
	switch {
	case s.stopped:
		s.unlock()
		return nil, ErrStopped
	case !ok:
		s.unlock()
		return nil, fmt.Errorf("%w: %s", ErrUnknownModel, name)
	case m.removing:
		s.unlock()
		return nil, fmt.Errorf("%w: %s", ErrModelRemoved, name)
	}
	r, err := newRequest(ctx, m, req, o, now)
	if err != nil {
		s.countInvalidLocked(m, r.arrival, now)
		s.unlock()
		return nil, err
	}
	if err := s.arriveLocked(m, r, now); err != nil {
		s.unlock()
		return nil, err
	}
	s.wakeLocked(m)
	m.q.push(r)
	if e, ectx := s.startInlineLocked(m, r, now); e != nil {
		s.unlock()
		return s.executeInline(ctx, ectx, e, r)
	}
	s.unlock()
	s.kick()

	select {
	case res := <-r.done:
		return res.resp, res.err
	case <-ctx.Done():
	}
	s.mu.Lock()
	now = time.Now()
	switch r.state {
	case stateDone: // the result came as ctx ended
		s.unlock()
		res := <-r.done
		return res.resp, res.err
	case stateQueued:
		m.q.remove(r)
		o := outcomeCanceled
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			o = outcomeDropped
		}
		s.finishLocked(r, o, now, result{err: ctx.Err()})
		s.finalizeLocked(m)
	case stateRunning:
		e := r.exec
		s.finishLocked(r, outcomeCanceled, now, result{err: ctx.Err()})
		if e.live--; e.live == 0 {
			e.cancel() // nobody waits for this execution any more
		}
	}
	s.unlock()
	s.kick()
	return nil, ctx.Err()
}

// arriveLocked counts r's arrival and admits it: into the Gate, then past
// refusalLocked; or settles it as rejected and returns why. This is the
// one place a request is admitted.
func (s *Scheduler) arriveLocked(m *model, r *request, now time.Time) error {
	s.countArrivalLocked(m, r, now)
	leave, err := s.opts.Gate.enter(inputBytes(r.req.Inputs))
	if err == nil {
		r.leave = leave
		err = s.refusalLocked(m, r, now)
	}
	if err != nil {
		s.rejectLocked(m, r, now, err)
		return err
	}
	return nil
}

// CountInvalid counts a request for a model that was refused as invalid
// before it was submitted (its tensors do not match the model's metadata),
// so that every request is counted once, here. arrival is when the
// request reached the server.
func (s *Scheduler) CountInvalid(name string, arrival time.Time) {
	now := time.Now()
	s.mu.Lock()
	defer s.unlock()
	if m, ok := s.models[name]; ok {
		s.countInvalidLocked(m, arrival, now)
	}
}

func (s *Scheduler) countInvalidLocked(m *model, arrival, now time.Time) {
	if arrival.IsZero() || arrival.After(now) {
		arrival = now
	}
	m.counts[outcomeInvalid]++
	m.requests.fail.add(now.Sub(arrival))
	m.mm.outcomes[outcomeInvalid].Inc()
}

// countArrivalLocked counts r as arrived: its sequence number, and the
// model's arrivals and their gaps.
func (s *Scheduler) countArrivalLocked(m *model, r *request, now time.Time) {
	s.seq++
	r.seq = s.seq
	m.arrived++
	if !m.lastArrival.IsZero() {
		m.gaps.observe(now.Sub(m.lastArrival).Seconds())
	}
	m.lastArrival = now
	m.observeRows(r.batch, now)
}

// rejectLocked settles an arrived r as rejected for err.
func (s *Scheduler) rejectLocked(m *model, r *request, now time.Time, err error) {
	if errors.Is(err, ErrRejected) {
		m.refused++
	}
	switch {
	case errors.Is(err, ErrQueueFull):
		m.queueFull++
	case errors.Is(err, ErrOverloaded):
		m.overloaded++
	}
	s.logLocked(m.log, "request rejected", "error", err)
	s.finishLocked(r, outcomeRejected, now, result{err: err})
}

// refusalLocked says why r would be refused now, or nil: its model's queue
// is full, or (under qos) its predicted completion misses its deadline and
// it is not due as a probe. It counts nothing; a probe is marked on r.
func (s *Scheduler) refusalLocked(m *model, r *request, now time.Time) error {
	if m.q.len() >= m.spec.QueueCapacity {
		return fmt.Errorf("%w: %s holds %d requests", ErrQueueFull, m.spec.Name, m.q.len())
	}
	if s.fifo {
		return nil
	}
	err := s.admitLocked(m, r, now)
	// An admitted request is a probe too while the model is starved by
	// predictions, so that the dispatcher does not drop it as hopeless.
	if (err != nil || m.refused > 0) && s.probeDueLocked(m, r, now) {
		s.logLocked(m.log, "admitted as a probe: nothing has run for a while", "would be", err)
		r.probe = true
		return nil
	}
	return err
}

// probeEvery is how long a model may go without an execution while
// admission refuses all of its requests before one is admitted anyway.
const probeEvery = time.Second

// probeDueLocked reports whether a request admission would refuse should be
// admitted as a probe. Admission refuses on predictions, and only
// executions correct them: a model whose estimate rose past its SLO (a burst
// of interference, a slow restart) would otherwise refuse every request for
// ever, with nothing to bring the estimate back. So when nothing of the
// model runs or waits, nothing has started for probeEvery, and either the
// estimate of one row alone is over the SLO or requests have been refused
// or dropped on predictions since the last start, one request runs and its
// execution measures the model afresh. The second case is an estimate just
// under the SLO: admission lets a request in with a millisecond to spare,
// the batching delay and the dispatcher's wake-up use it up, the dispatcher
// drops it as hopeless, and nothing ever runs (seen on the simulated GPU
// day: a model whose estimate was 27.7 ms against a 30 ms SLO, after
// running at a twentieth of a device, served nothing for six minutes).
//
// In the second case the probe must have time for its own execution as
// estimated: a request whose deadline is shorter than that (a timeout of a
// microsecond) is refused as before; it would only run past its deadline
// and measure nothing.
func (s *Scheduler) probeDueLocked(m *model, r *request, now time.Time) bool {
	if m.spec.SLO <= 0 || m.running > 0 || m.q.len() > 0 || now.Sub(laterOf(m.lastStart, m.added)) < probeEvery {
		return false
	}
	e, ok := s.est.EstimateSize(m.spec.Name, 1, r.elements)
	if ok && e >= m.spec.SLO {
		return true
	}
	if m.refused == 0 {
		return false
	}
	own, _ := s.est.EstimateSize(m.spec.Name, r.batch, r.elements)
	return r.deadline.IsZero() || r.deadline.Sub(now) >= own
}

// Preadmit tells, before a request's body is read, whether a request of
// one row for the model would be refused now: the Gate is full
// (ErrOverloaded), its queue is full, or admission predicts that even one row queued now misses its deadline
// (o.Deadline, the model's SLO, ctx's deadline). A refusal counts as the
// request's arrival and outcome, as in Submit, and is returned; nil
// promises nothing, and the request is counted when it is submitted. A
// front end uses it to refuse a request for an overloaded model without
// paying for its body.
func (s *Scheduler) Preadmit(ctx context.Context, name string, o RequestOptions) error {
	now := time.Now()
	s.mu.Lock()
	defer s.unlock()
	m, ok := s.models[name]
	switch {
	case s.stopped:
		return ErrStopped
	case !ok:
		return fmt.Errorf("%w: %s", ErrUnknownModel, name)
	case m.removing:
		return fmt.Errorf("%w: %s", ErrModelRemoved, name)
	}
	r, err := newRequest(ctx, m, nil, o, now)
	if err != nil {
		return err
	}
	err = s.opts.Gate.full()
	if err == nil {
		err = s.refusalLocked(m, r, now)
	}
	if err == nil {
		return nil
	}
	// Refused: counted as Submit counts a refusal.
	s.countArrivalLocked(m, r, now)
	s.rejectLocked(m, r, now, err)
	return err
}

func newRequest(ctx context.Context, m *model, req *runtime.InferRequest, o RequestOptions, now time.Time) (*request, error) {
	r := &request{
		m:        m,
		req:      req,
		batch:    1,
		arrival:  now,
		deadline: o.Deadline,
		rank:     priorityRank(cmp.Or(o.Priority, m.spec.Priority)),
		done:     make(chan result, 1),
		span:     traceOf(ctx),
	}
	if req != nil && !req.Arrival.IsZero() && req.Arrival.Before(now) {
		// The SLO counts from when the request reached the server.
		r.arrival = req.Arrival
	}
	if o.Priority < 0 {
		return r, fmt.Errorf("%w: priority %d is negative", ErrInvalidRequest, o.Priority)
	}
	if m.spec.SLO > 0 {
		r.deadline = earliest(r.deadline, r.arrival.Add(m.spec.SLO))
	}
	if d, ok := ctx.Deadline(); ok {
		r.deadline = earliest(r.deadline, d)
	}
	if m.spec.MaxBatchSize > 0 && req != nil { // nil: one row (Preadmit)
		b, err := requestBatch(req)
		if err != nil {
			return r, err
		}
		if b > m.spec.MaxBatchSize {
			return r, fmt.Errorf("%w: batch of %d is over the maximum %d of %s", ErrInvalidRequest, b, m.spec.MaxBatchSize, m.spec.Name)
		}
		r.batch, r.key = b, mergeKey(req)
	}
	if req != nil {
		r.elements = RowElements(req, m.spec.MaxBatchSize > 0)
	}
	return r, nil
}

// earliest is the earlier of two times, a zero time meaning none.
func earliest(a, b time.Time) time.Time {
	switch {
	case a.IsZero():
		return b
	case b.IsZero() || a.Before(b):
		return a
	default:
		return b
	}
}

// finishLocked settles a request's outcome once, counts it (the one count
// of every request) and hands it its result.
func (s *Scheduler) finishLocked(r *request, o outcome, now time.Time, res result) {
	if r.state == stateDone {
		return
	}
	e := r.exec
	r.state, r.exec = stateDone, nil
	if r.leave != nil {
		r.leave()
		r.leave = nil
	}
	traceFinishLocked(r, o, now, res.err)
	m := r.m
	s.logFinishLocked(m, r, e, o, now)
	if r.plan.atMargin && (o == outcomeGood || o == outcomeLate || o == outcomeDropped) {
		m.tail.learn(o != outcomeGood)
	}
	m.counts[o]++
	m.requests.record(r, o, now, res)
	if o == outcomeGood || o == outcomeLate {
		d := now.Sub(r.arrival)
		m.latency.Observe(d)
		m.mm.latency.Observe(d.Seconds())
		if res.resp != nil {
			t := res.resp.Timing
			m.mm.compute.Observe((t.Input + t.Infer + t.Output).Seconds())
		}
	}
	m.win.record(now, o)
	m.mm.outcomes[o].Inc()
	r.done <- res
}

// Run dispatches requests until ctx ends. Then the requests still queued fail
// with ErrStopped, running executions see ctx canceled, and Run returns nil
// once they have ended. Requests submitted before Run wait for it. Run may be
// called once.
func (s *Scheduler) Run(ctx context.Context) error {
	s.mu.Lock()
	if s.started {
		s.unlock()
		return errors.New("qos: Run called twice")
	}
	s.started, s.runCtx = true, ctx
	s.unlock()
	defer s.shutdown()

	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		s.mu.Lock()
		now := time.Now()
		wake := s.dispatchLocked(now)
		s.unlock()
		if wake.IsZero() {
			timer.Stop()
		} else {
			timer.Reset(wake.Sub(now))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-s.trigger:
		case <-timer.C:
		}
	}
}

func (s *Scheduler) shutdown() {
	s.mu.Lock()
	s.stopped = true
	now := time.Now()
	for _, m := range s.models {
		for _, r := range m.q.items {
			s.finishLocked(r, outcomeFailed, now, result{err: ErrStopped})
		}
		m.q.items = nil
		s.finalizeLocked(m)
	}
	s.unlock()
	s.execs.Wait()
	s.log.Info("scheduler stopped")
}

// Stats returns a model's statistics; false if no such model.
func (s *Scheduler) Stats(name string) (Stats, bool) {
	s.mu.Lock()
	defer s.unlock()
	m, ok := s.models[name]
	if !ok {
		return Stats{}, false
	}
	return m.stats(time.Now()), true
}

// AllStats returns every model's statistics, by name.
func (s *Scheduler) AllStats() []Stats {
	s.mu.Lock()
	defer s.unlock()
	now := time.Now()
	out := make([]Stats, 0, len(s.models))
	for _, m := range s.models {
		out = append(out, m.stats(now))
	}
	slices.SortFunc(out, func(a, b Stats) int { return cmp.Compare(a.Model, b.Model) })
	return out
}

// ClassStats aggregates the queues of the models of one class.
func (s *Scheduler) ClassStats(c Class) ClassStats {
	s.mu.Lock()
	defer s.unlock()
	now := time.Now()
	cs := ClassStats{Class: c}
	var sum time.Duration
	var n uint64
	for _, m := range s.models {
		if m.spec.Class != c {
			continue
		}
		cs.QueueDepth += m.q.len()
		w := m.win.sum(now)
		sum += w.delaySum
		n += w.delayCount
	}
	if n > 0 {
		cs.MeanQueueDelay = sum / time.Duration(n)
	}
	return cs
}

func (m *model) stats(now time.Time) Stats {
	st := Stats{
		Model:      m.spec.Name,
		Class:      m.spec.Class,
		Arrived:    m.arrived,
		Good:       m.counts[outcomeGood],
		Late:       m.counts[outcomeLate],
		Rejected:   m.counts[outcomeRejected],
		Dropped:    m.counts[outcomeDropped],
		Failed:     m.counts[outcomeFailed],
		Canceled:   m.counts[outcomeCanceled],
		Invalid:    m.counts[outcomeInvalid],
		QueueFull:  m.queueFull,
		Overloaded: m.overloaded,
		SLO:        m.spec.SLO,
		Latency:    m.latency,
		QueueDepth: m.q.len(),
		Running:    m.running,
		InFlight:   m.q.len(),
		Executions: m.executions,
		Batches:    m.batchStats(),

		Success: m.requests.success, Fail: m.requests.fail, Queue: m.requests.queue,
		ComputeInput: m.requests.computeInput, ComputeInfer: m.requests.computeInfer, ComputeOutput: m.requests.computeOutput,
		Inferences: m.requests.inferences, LastInference: m.requests.last,
	}
	for e := range m.execs {
		for _, r := range e.reqs {
			if r.state == stateRunning {
				st.InFlight++
			}
		}
	}
	w := m.win.sum(now)
	for _, c := range w.outcomes {
		st.WindowSettled += c
	}
	st.WindowGood = w.outcomes[outcomeGood]
	if span := m.win.span(now); span > 0 {
		st.Goodput = float64(st.WindowGood) / span.Seconds()
	}
	if st.WindowSettled > 0 {
		st.Attainment = float64(st.WindowGood) / float64(st.WindowSettled)
	}
	if w.delayCount > 0 {
		st.MeanQueueDelay = w.delaySum / time.Duration(w.delayCount)
	}
	return st
}
