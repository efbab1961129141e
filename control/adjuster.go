package control

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/qos"
)

// Defaults for zero values in AdjusterOptions.
const (
	DefaultAdjustPeriod   = time.Second
	DefaultHeadroom       = 0.1
	DefaultQuantile       = 0.99
	DefaultMaxUtilization = 0.8
	DefaultScaleDownAfter = 10 * time.Second
	DefaultCooldown       = 5 * time.Second
	DefaultShareStep      = 0.05
	DefaultMinShare       = 0.05
	DefaultKeepAlive      = 5 * time.Minute
	DefaultEventCapacity  = 1024
)

// Sources of a model's share, as ModelShare.Source reports them.
const (
	SourcePinned = "pinned" // Adjuster.Pin
	SourceConfig = "config" // qos.ModelSpec.Pin
)

// Event kinds.
const (
	EventResize = "resize"
	EventEvict  = "evict"
	EventPin    = "pin"
	EventUnpin  = "unpin"
	EventError  = "error"
)

var eventKinds = []string{EventResize, EventEvict, EventPin, EventUnpin, EventError}

// Predictor is what the adjuster needs from the predictor package.
type Predictor interface {
	// Latency predicts one execution of a batch of the model at a compute
	// share; false when it does not know yet.
	Latency(model string, batch int, share float64) (time.Duration, bool)
	// ObserveArrivals receives the model's cumulative arrival count, once
	// a pass.
	ObserveArrivals(model string, at time.Time, arrived uint64)
	// ForecastRate is the arrival rate, in requests per second, expected
	// over the next horizon.
	ForecastRate(model string, horizon time.Duration) float64
	// SetShare tells the predictor the model's compute share now in effect
	// (1 when unlimited), so that its estimates follow.
	SetShare(model string, share float64)
}

// Actuator applies the adjuster's decisions; the models registry
// implements it.
type Actuator interface {
	// SetShare resizes every instance of the model.
	SetShare(ctx context.Context, model string, s limiter.Share) error
	// Evict unloads an idle model; it loads again on demand.
	Evict(ctx context.Context, model string) error
	// MemoryUsage is the bytes the model's instances use now; 0 unknown.
	MemoryUsage(model string) int64
}

// AsyncActuator is an Actuator that can resize without waiting for a
// model's replacement instances to start (on MPS every resize is a new
// client: a context, the weights, a warm-up). When the Actuator is one,
// the adjuster requests a share and goes on with the other models; the
// predictor is told the share, and the resize event recorded, once the
// share is in effect.
type AsyncActuator interface {
	Actuator
	// RequestShare starts resizing the model and returns; a later request
	// supersedes one still in progress. The error is one the resize
	// failed with at once.
	RequestShare(model string, s limiter.Share) error
	// ShareInEffect is the share the model's instances run at, whether a
	// requested one is still in progress, and why the last one that
	// finished did not apply (nil when it did).
	ShareInEffect(model string) (s limiter.Share, pending bool, err error)
}

// AdjusterOptions configure an Adjuster. Zero values mean the defaults.
type AdjusterOptions struct {
	// Policy is SharePolicyAdaptive (default), SharePolicyStatic or
	// SharePolicyShared.
	Policy string
	// Period is the time between two passes.
	Period time.Duration
	// Capacity is the compute to split, as a fraction of the device
	// (0, 1]; default 1.
	Capacity float64
	// Headroom: a latency-critical model's predicted latency must be at
	// most SLO × (1 - Headroom). Default 0.2; negative means none.
	Headroom float64
	// Quantile is the fraction of a latency-critical model's requests
	// that must meet its SLO: the adaptive policy sizes its share so that
	// the predicted latency at this quantile meets the SLO, and grows it
	// whatever the prediction while the observed attainment is below it.
	// Default 0.99.
	Quantile float64
	// MaxUtilization bounds a model's predicted utilisation, rate ×
	// execution time / (batch × slots). Default 0.8.
	MaxUtilization float64
	// ScaleDownAfter: a share shrinks only once every target computed over
	// this long has been below it.
	ScaleDownAfter time.Duration
	// Cooldown is the least time between a change of a model's share and
	// its next shrink. Growth is never delayed.
	Cooldown time.Duration
	// Step is the granularity of the shares the adaptive policy chooses.
	Step float64
	// MinShare is the least compute share of any model (adaptive policy),
	// above 0: a zero compute share would mean no limit.
	MinShare float64
	// MemoryBudget is the bytes all the models of the device may use; 0
	// means no budget. Over it, the adaptive policy evicts idle models.
	MemoryBudget int64
	// MemoryHeadroom is the fraction the adaptive policy adds to a
	// model's working set for its memory share; default
	// DefaultMemoryHeadroom, negative means none.
	MemoryHeadroom float64
	// MemoryFloor is the least memory share the adaptive policy sets;
	// default DefaultMemoryFloor.
	MemoryFloor int64
	// KeepAlive is how long a model must have been idle (no arrivals,
	// nothing queued or running) before it may be evicted.
	KeepAlive time.Duration
	// Predictor is required by the adaptive policy.
	Predictor Predictor
	// Actuator applies the shares; required.
	Actuator Actuator
	// Usage is device telemetry: the fraction of the device a model's
	// instances have used lately (CPU time of its limiter units over the
	// device's CPUs), false when unknown. The adaptive policy keeps that
	// much, with a margin, of a latency-critical floor from the
	// best-effort caps; nil means always unknown, and the prediction
	// stands in.
	Usage func(model string) (float64, bool)
	// CapsOnly says the device's limiter enforces every share as a cap
	// (MPS: an active-thread percentage is a ceiling, nothing is
	// work-conserving, and a resize starts a new client): latency-critical
	// models get caps instead of floors, sized for the rate forecast over
	// ScaleDownAfter, their targets held for capsOnlyTargetWindow
	// ScaleDownAfter, never past the model's knee (the knee of its largest
	// batch when no share meets its SLO), and not scaled to fit the
	// device; the best-effort caps leave each latency-critical model the
	// knee of a single request; best-effort caps grow only by two Steps or
	// more, once a Cooldown.
	CapsOnly bool
	// Background says a best-effort share (limiter.ModeBackground) gives
	// the device up to the other shares by itself (limiter.Capabilities
	// Background: an idle class on a CPU, a client below normal priority
	// under MPS). Where every share is a cap (CapsOnly) a best-effort cap
	// is then a fill, not a partition: each busy best-effort model gets
	// its largest share, runs on what the latency-critical clients leave
	// and gives it back as its running blocks end, and the
	// latency-critical caps keep nothing from it.
	Background bool
	// EventCapacity is how many events Events keeps.
	EventCapacity int
	// Logger; nil discards.
	Logger *slog.Logger
	// Registerer receives the metrics; nil leaves them unregistered.
	Registerer prometheus.Registerer
	// Device labels the metrics and events; empty means the scheduler's.
	Device string
}

// ModelShare is one model's share as the API shows it.
type ModelShare struct {
	Model string
	Class qos.Class
	// Share is what was last applied successfully (zero before that).
	Share limiter.Share
	// Pending is a share asked for and not in effect yet: its replacement
	// instances are starting (AsyncActuator); nil when none.
	Pending *limiter.Share
	// Target is the compute share the last pass wanted; it differs from
	// Share while a shrink waits out the hysteresis, or a change failed.
	Target float64
	// MemoryTarget is the memory share the last pass wanted (adaptive
	// policy, from the model's working set; 0 when memory is not sized),
	// and MemoryReason why the memory share last moved.
	MemoryTarget int64
	MemoryReason string
	// Pinned: the share is fixed by Pin or the model's config.
	Pinned bool
	// Source is the policy that chose the share (SharePolicy*), or
	// SourcePinned or SourceConfig.
	Source string
	// PredictedLatency and ForecastRate are the predictions behind Target
	// (adaptive policy; 0 unknown).
	PredictedLatency time.Duration
	ForecastRate     float64
	SLO              time.Duration
	Attainment       float64 // over the scheduler's window
}

// Event is one decision or failure of the adjuster.
type Event struct {
	Time   time.Time
	Device string
	Model  string
	Kind   string // EventResize, EventEvict, EventPin, EventUnpin or EventError
	Old    limiter.Share
	New    limiter.Share
	// Reason says why, for people: "forecast 42.0 req/s needs 0.35 to
	// meet 100ms (predicted 71.0ms at batch 4)".
	Reason       string
	Predicted    time.Duration
	ForecastRate float64
}

// LogValue implements slog.LogValuer.
func (e Event) LogValue() slog.Value {
	return slog.GroupValue(
		slog.String("model", e.Model), slog.String("kind", e.Kind),
		slog.Float64("old_compute", e.Old.Compute), slog.Int64("old_memory", e.Old.Memory),
		slog.Float64("new_compute", e.New.Compute), slog.Int64("new_memory", e.New.Memory),
		slog.String("reason", e.Reason))
}

// Adjuster chooses the share of each model on one device and applies it
// through an Actuator. Run owns the decisions; the other methods are safe
// for concurrent use.
type Adjuster struct {
	s       *qos.Scheduler
	opts    AdjusterOptions
	policy  Policy // opts.Policy's
	log     *slog.Logger
	metrics *adjusterMetrics
	events  *EventLog     // at most EventCapacity
	trigger chan struct{} // capacity 1: passes asked for by Pin collapse

	// Owned by the goroutine in Run.
	models map[string]*tracked

	mu      sync.Mutex
	started bool
	pins    map[string]limiter.Share // set by Pin
	view    []ModelShare             // as of the last pass, by name
}

// tracked is what the loop remembers of one model between passes.
type tracked struct {
	applied    limiter.Share // last applied successfully
	hasApplied bool
	lastChange time.Time // of the applied compute share
	// slackSince is the first of the consecutive passes whose target was
	// below the applied share (zero: the last one was not); slack holds
	// the targets of the last ScaleDownAfter of them.
	slackSince time.Time
	slack      []slackSample
	// pin is the pin in effect at the last pass; pinSource its source.
	pin       *limiter.Share
	pinSource string
	cfgPin    *limiter.Share // the config pin last seen
	// fresh: the pin just ended, the next share applies at once.
	fresh bool
	// failures counts consecutive failed SetShare calls; none is tried
	// again before retryAt.
	failures int
	retryAt  time.Time
	// pending is the share requested of an AsyncActuator and not in
	// effect yet (nil: none), with the decision that asked for it, the
	// share it replaces and when it was asked for.
	pending       *limiter.Share
	firstPending  bool // pending is the model's first share (see staggerFirst)
	pendingD      decision
	pendingReason string
	pendingOld    limiter.Share
	pendingFrom   time.Time
	// targets are the latency-critical targets of the last passes where
	// every share is a cap (see holdTarget).
	targets []slackSample
	// boost is the floor observed misses have raised a latency-critical
	// model to (0: none), boostAt when it last rose.
	boost   float64
	boostAt time.Time
	// memSlackSince, memSlack and memChange are the memory share's
	// hysteresis (see settleMemory); memReason says why it last moved.
	memSlackSince time.Time
	memSlack      []memorySample
	memChange     time.Time
	memReason     string
}

type slackSample struct {
	at     time.Time
	target float64
}

// NewAdjuster returns the adjuster of the scheduler's device. Call Run to
// start it.
func NewAdjuster(s *qos.Scheduler, opts AdjusterOptions) (*Adjuster, error) {
	if s == nil {
		return nil, errors.New("control: adjuster without a scheduler")
	}
	if err := opts.setDefaults(); err != nil {
		return nil, err
	}
	policy, _ := PolicyNamed(opts.Policy) // setDefaults checked the name
	opts.Device = cmp.Or(opts.Device, s.Device())
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	a := &Adjuster{
		s:       s,
		opts:    opts,
		policy:  policy,
		log:     opts.Logger.With("component", "adjuster", "policy", opts.Policy, "device", opts.Device),
		trigger: make(chan struct{}, 1),
		models:  map[string]*tracked{},
		pins:    map[string]limiter.Share{},
		events:  NewEventLog(opts.EventCapacity),
	}
	m, err := newAdjusterMetrics(opts.Registerer, opts.Device, a)
	if err != nil {
		return nil, err
	}
	a.metrics = m
	return a, nil
}

func (o *AdjusterOptions) setDefaults() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if o.Policy == "" {
		o.Policy = SharePolicyAdaptive
	}
	policy, err := PolicyNamed(o.Policy)
	if err != nil {
		bad("%v", err)
	}
	fraction := func(name string, v *float64, def float64, zeroOK bool) {
		switch {
		case *v == 0:
			*v = def
		case !(*v > 0 && *v <= 1): // also NaN
			if zeroOK && *v < 0 {
				*v = 0
				return
			}
			bad("%s %v is not a fraction in (0, 1]", name, *v)
		}
	}
	fraction("capacity", &o.Capacity, 1, false)
	fraction("max utilization", &o.MaxUtilization, DefaultMaxUtilization, false)
	fraction("step", &o.Step, DefaultShareStep, false)
	fraction("min share", &o.MinShare, DefaultMinShare, false)
	fraction("headroom", &o.Headroom, DefaultHeadroom, true)
	fraction("quantile", &o.Quantile, DefaultQuantile, false)
	if o.Quantile >= 1 {
		bad("quantile %v: no queue meets an SLO always", o.Quantile)
	}
	if o.Headroom >= 1 {
		bad("headroom %v leaves no latency budget", o.Headroom)
	}
	if o.MinShare > o.Capacity {
		bad("min share %v is over the capacity %v", o.MinShare, o.Capacity)
	}
	if o.Period < 0 || o.ScaleDownAfter < 0 || o.Cooldown < 0 || o.KeepAlive < 0 {
		bad("negative period (%s), scale-down delay (%s), cooldown (%s) or keep-alive (%s)", o.Period, o.ScaleDownAfter, o.Cooldown, o.KeepAlive)
	}
	if o.MemoryBudget < 0 || o.EventCapacity < 0 || o.MemoryFloor < 0 {
		bad("negative memory budget (%d), memory floor (%d) or event capacity (%d)", o.MemoryBudget, o.MemoryFloor, o.EventCapacity)
	}
	switch {
	case o.MemoryHeadroom == 0:
		o.MemoryHeadroom = DefaultMemoryHeadroom
	case o.MemoryHeadroom < 0:
		o.MemoryHeadroom = 0
	case !(o.MemoryHeadroom <= 10): // also NaN
		bad("memory headroom %v is not a fraction of the working set", o.MemoryHeadroom)
	}
	if o.Actuator == nil {
		bad("no actuator")
	}
	if policy != nil && policy.Forecasts() && o.Predictor == nil {
		bad("the adaptive policy needs a predictor")
	}
	if len(errs) > 0 {
		return fmt.Errorf("control: adjuster: %w", errors.Join(errs...))
	}
	o.Period = cmp.Or(o.Period, DefaultAdjustPeriod)
	o.ScaleDownAfter = cmp.Or(o.ScaleDownAfter, DefaultScaleDownAfter)
	o.Cooldown = cmp.Or(o.Cooldown, DefaultCooldown)
	o.KeepAlive = cmp.Or(o.KeepAlive, DefaultKeepAlive)
	o.EventCapacity = cmp.Or(o.EventCapacity, DefaultEventCapacity)
	o.MemoryFloor = cmp.Or(o.MemoryFloor, DefaultMemoryFloor)
	return nil
}

// Policy returns the share policy.
func (a *Adjuster) Policy() Policy { return a.policy }

// Run decides and applies shares: a pass at once, then one every Period
// and one after each Pin, until ctx ends. It returns nil then. Run may be
// called once.
func (a *Adjuster) Run(ctx context.Context) error {
	a.mu.Lock()
	if a.started {
		a.mu.Unlock()
		return errors.New("control: adjuster Run called twice")
	}
	a.started = true
	a.mu.Unlock()
	a.log.Info("adjuster started", "period", a.opts.Period, "capacity", a.opts.Capacity)
	defer a.log.Info("adjuster stopped")

	ticker := time.NewTicker(a.opts.Period)
	defer ticker.Stop()
	for {
		a.pass(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
		case <-a.trigger:
		}
	}
}

// Pin fixes a model's share until Pin(model, nil) unpins it; the next pass,
// asked for at once, applies it. A pin set here overrides the model's
// config pin. It returns qos.ErrUnknownModel for a model the scheduler does not
// have.
func (a *Adjuster) Pin(model string, s *limiter.Share) error {
	if !a.s.HasModel(model) {
		return fmt.Errorf("control: pin: %w: %s", qos.ErrUnknownModel, model)
	}
	if s != nil && (!(s.Compute >= 0) || math.IsInf(s.Compute, 0) || s.Memory < 0) {
		return fmt.Errorf("control: pin %s: share %+v is negative or not a number", model, *s)
	}
	a.mu.Lock()
	old, pinned := a.pins[model]
	cur := old
	if i, ok := slices.BinarySearchFunc(a.view, model, func(v ModelShare, name string) int { return cmp.Compare(v.Model, name) }); ok {
		cur = a.view[i].Share
	}
	var e Event
	switch {
	case s != nil:
		a.pins[model] = *s
		e = Event{Model: model, Kind: EventPin, Old: cur, New: *s, Reason: "pinned by operator"}
	case pinned:
		delete(a.pins, model)
		e = Event{Model: model, Kind: EventUnpin, Old: old, Reason: "unpinned by operator: the " + a.opts.Policy + " policy decides again"}
	default:
		a.mu.Unlock()
		return nil
	}
	a.recordLocked(e)
	a.mu.Unlock()
	select {
	case a.trigger <- struct{}{}:
	default:
	}
	return nil
}

// Shares returns every model's share as of the last pass, by name.
func (a *Adjuster) Shares() []ModelShare {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.view)
}

// Events returns the kept events at or after since (zero: all), oldest
// first; with limit > 0, only the newest limit of them.
func (a *Adjuster) Events(since time.Time, limit int) []Event {
	return a.events.Since(since, limit)
}

// record keeps an event, counts it and logs it.
func (a *Adjuster) record(e Event) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.recordLocked(e)
}

func (a *Adjuster) recordLocked(e Event) {
	e.Device = a.opts.Device
	e = a.events.Add(e)
	a.metrics.events.WithLabelValues(e.Kind).Inc()
	level := slog.LevelInfo
	if e.Kind == EventError {
		level = slog.LevelWarn
	}
	a.log.Log(context.Background(), level, "share "+e.Kind, "event", e)
}

// decision is what a pass wants for one model.
type decision struct {
	share     limiter.Share
	source    string
	reason    string
	predicted time.Duration
	rate      float64
	// exact decisions (pins, static and shared policies) apply as they
	// are; adaptive ones go through the hysteresis and ignore changes
	// under Step/2.
	exact bool
	class qos.Class
	rank  int // priority rank, 1 highest
	// reserve is the part of a latency-critical floor the best-effort
	// caps leave free (see Adjuster.reserve).
	reserve float64
	// memTarget is the memory share wanted (0: not sized); memReason says
	// why the share's memory changes, "" when it does not.
	memTarget int64
	memReason string
}

// pass is one round of decisions: read the models, decide, apply what
// changed, evict when memory is short, publish.
func (a *Adjuster) pass(ctx context.Context) {
	began := time.Now()
	defer func() { a.metrics.pass.Observe(time.Since(began).Seconds()) }()

	states := a.s.Snapshot()
	now := time.Now()
	a.mu.Lock()
	live := make(map[string]bool, len(states))
	for _, st := range states {
		live[st.Spec.Name] = true
	}
	maps.DeleteFunc(a.pins, func(name string, _ limiter.Share) bool { return !live[name] })
	pins := maps.Clone(a.pins)
	a.mu.Unlock()
	maps.DeleteFunc(a.models, func(name string, _ *tracked) bool { return !live[name] })
	a.settlePending(now)
	for _, st := range states {
		if a.models[st.Spec.Name] == nil {
			a.models[st.Spec.Name] = &tracked{}
		}
		a.notePins(st, pins)
	}

	p := newPlan(len(states))
	a.policy.decide(a, now, states, p)
	a.release(p)
	if a.policy.Forecasts() {
		a.sizeMemory(now, states, p)
	}
	// Shrink before growing, so that the device is not oversubscribed
	// in between.
	order := make([]string, 0, len(states))
	for _, st := range states {
		order = append(order, st.Spec.Name)
	}
	delta := func(name string) float64 {
		return limiter.LimitedOrWhole(p.next[name].Compute) - limiter.LimitedOrWhole(a.models[name].applied.Compute)
	}
	slices.SortStableFunc(order, func(x, y string) int { return cmp.Compare(delta(x), delta(y)) })
	first := a.firstSwapping()
	for _, name := range order {
		if ctx.Err() != nil {
			return
		}
		t := a.models[name]
		if a.staggerFirst() && !t.hasApplied && first {
			continue // after the first swap in flight (a later pass)
		}
		a.apply(ctx, now, name, p.next[name], p.ds[name])
		first = first || t.firstPending
	}
	if a.policy.Forecasts() && a.opts.MemoryBudget > 0 && ctx.Err() == nil {
		a.evictIdle(ctx, now, states, p)
	}
	a.publish(states, p.ds)
}

// staggerFirst reports whether the models' first shares go one at a time:
// where every share is a cap (MPS) each is a new client started beside
// the one load started, both pinning their memory until it takes over,
// and the first pass after load sizes most of a device's models at once
// (six swaps at once, 20.4 GiB pinned on one device, on the GPU day
// scaled to 36 models on nine simulated GPUs). A model's later shares do
// not wait: a service's growth must not queue behind its neighbours'.
func (a *Adjuster) staggerFirst() bool {
	_, async := a.opts.Actuator.(AsyncActuator)
	return a.opts.CapsOnly && async
}

// firstSwapping reports whether a model's first share is still starting.
func (a *Adjuster) firstSwapping() bool {
	for _, t := range a.models {
		if t.pending != nil && t.firstPending {
			return true
		}
	}
	return false
}

// notePins records the pin in effect for a model and the events of its
// config pin. A change of pin applies at once and clears the retry backoff.
func (a *Adjuster) notePins(st qos.ModelState, pins map[string]limiter.Share) {
	t := a.models[st.Spec.Name]
	name := st.Spec.Name
	if cfg := st.Spec.Pin; !sameSharePtr(cfg, t.cfgPin) {
		switch {
		case cfg != nil:
			a.record(Event{Model: name, Kind: EventPin, Old: t.applied, New: *cfg, Reason: "pinned in config"})
		default:
			a.record(Event{Model: name, Kind: EventUnpin, Old: *t.cfgPin, Reason: "config pin removed: the " + a.opts.Policy + " policy decides again"})
		}
		t.cfgPin = cfg
	}
	var pin *limiter.Share
	source := ""
	if p, ok := pins[name]; ok {
		pin, source = &p, SourcePinned
	} else if st.Spec.Pin != nil {
		pin, source = st.Spec.Pin, SourceConfig
	}
	if !sameSharePtr(pin, t.pin) {
		t.failures, t.retryAt = 0, time.Time{}
		t.slackSince, t.slack = time.Time{}, nil
		t.fresh = pin == nil
	}
	t.pin, t.pinSource = pin, source
}

func sameSharePtr(a, b *limiter.Share) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// plan is a pass's outcome: the decisions, and the shares to apply after
// the hysteresis.
type plan struct {
	ds   map[string]decision
	next map[string]limiter.Share
	held []string // models whose shrink the hysteresis holds back
}

func newPlan(n int) *plan {
	return &plan{ds: make(map[string]decision, n), next: make(map[string]limiter.Share, n)}
}

// settle turns a model's decision into the share to apply: pins and the
// static and shared policies as they are; adaptive growth at once, and
// shrinking only once every target of the last ScaleDownAfter has been
// below the applied share and Cooldown has passed since its last change,
// to the largest of those targets.
func (a *Adjuster) settle(now time.Time, name string, d decision, p *plan) {
	t := a.models[name]
	defer func() { p.ds[name] = d }()
	if d.exact || !t.hasApplied || t.fresh {
		p.next[name] = d.share
		t.slackSince, t.slack = time.Time{}, nil
		return
	}
	cur, target := t.applied.Compute, d.share.Compute
	if a.holdGrowth(now, t, d) {
		// A best-effort cap on MPS grows only by a few steps at once and
		// once a cooldown: each resize is a new client.
		d.share.Compute = cur
		d.reason = fmt.Sprintf("held at %.2f (resizing an MPS client costs a new client; growth to %.2f waits): %s", cur, target, d.reason)
		p.next[name] = d.share
		t.slackSince, t.slack = time.Time{}, nil
		return
	}
	if target >= cur-a.opts.Step/2 {
		// Growth, or a change within the dead band: at once.
		p.next[name] = d.share
		t.slackSince, t.slack = time.Time{}, nil
		return
	}
	if t.slackSince.IsZero() {
		t.slackSince = now
	}
	from := now.Add(-a.opts.ScaleDownAfter)
	t.slack = append(t.slack, slackSample{now, target})
	t.slack = slices.DeleteFunc(t.slack, func(s slackSample) bool { return s.at.Before(from) })
	share := d.share
	if t.slackSince.After(from) || t.lastChange.After(now.Add(-a.opts.Cooldown)) {
		share.Compute = cur
		p.held = append(p.held, name)
	} else {
		share.Compute = maxTarget(t.slack)
		d.reason = fmt.Sprintf("slack for %s: %.2f -> %.2f; %s", shortDuration(now.Sub(t.slackSince)), cur, share.Compute, d.reason)
	}
	p.next[name] = share
}

// capsOnlyGrowBand is how many Steps a best-effort cap must be able to
// grow by before it is resized where shares are caps (CapsOnly).
const capsOnlyGrowBand = 2

// holdGrowth reports whether a best-effort cap's growth waits, where every
// resize starts a new client (CapsOnly): growth under capsOnlyGrowBand
// steps, or within Cooldown of the model's last change, is held. A
// latency-critical model's growth never waits, and neither does a shrink
// forced by the capacity (release).
func (a *Adjuster) holdGrowth(now time.Time, t *tracked, d decision) bool {
	if !a.opts.CapsOnly || d.class != qos.ClassBestEffort || !t.hasApplied {
		return false
	}
	cur := limiter.LimitedOrWhole(t.applied.Compute)
	grow := limiter.LimitedOrWhole(d.share.Compute) - cur
	if grow <= a.opts.Step/2 {
		return false // a shrink, or within the dead band: the usual rules
	}
	return grow < capsOnlyGrowBand*a.opts.Step-shareEpsilon || t.lastChange.After(now.Add(-a.opts.Cooldown))
}

// release gives back at once what the hysteresis holds when the shares
// would oversubscribe the capacity: best-effort models first, lowest
// priority first.
func (a *Adjuster) release(p *plan) {
	over := -a.opts.Capacity
	for name, s := range p.next {
		c := min(s.Compute, 1) // a share of 1 or more wants the whole device
		if s.Mode == limiter.ModeFloor || a.opts.CapsOnly && p.ds[name].class == qos.ClassLatencyCritical && p.ds[name].reserve > 0 {
			c = min(c, p.ds[name].reserve)
		}
		over += c
	}
	slices.SortStableFunc(p.held, func(x, y string) int {
		dx, dy := p.ds[x], p.ds[y]
		if dx.class != dy.class {
			return cmp.Compare(classOrder(dx.class), classOrder(dy.class))
		}
		return cmp.Or(cmp.Compare(dy.rank, dx.rank), cmp.Compare(x, y))
	})
	for _, name := range p.held {
		if over <= shareEpsilon {
			return
		}
		d, s := p.ds[name], p.next[name]
		over -= s.Compute - d.share.Compute
		d.reason = fmt.Sprintf("capacity needed by other models: %.2f -> %.2f; %s", s.Compute, d.share.Compute, d.reason)
		p.ds[name], p.next[name] = d, d.share
		t := a.models[name]
		t.slackSince, t.slack = time.Time{}, nil
	}
}

func maxTarget(samples []slackSample) float64 {
	m := 0.0
	for _, s := range samples {
		m = max(m, s.target)
	}
	return m
}

func classOrder(c qos.Class) int {
	if c == qos.ClassBestEffort {
		return 0
	}
	return 1
}

// shareEpsilon absorbs floating-point noise in share arithmetic.
const shareEpsilon = 1e-9

// limitedCompute is the compute a pinned share reserves: none when it has
// no compute limit, since such a model contends with the others.
func limitedCompute(c float64) float64 {
	if c <= 0 || c >= 1 {
		return 0
	}
	return c
}

// sameCompute compares compute shares, 0 and >= 1 both meaning no limit.
func sameCompute(x, y, tolerance float64) bool {
	return math.Abs(limiter.LimitedOrWhole(x)-limiter.LimitedOrWhole(y)) <= tolerance
}

// apply sends a changed share to the actuator and then the predictor.
func (a *Adjuster) apply(ctx context.Context, now time.Time, name string, want limiter.Share, d decision) {
	t := a.models[name]
	tolerance := shareEpsilon
	if !d.exact {
		tolerance = a.opts.Step/2 - shareEpsilon
	}
	if t.hasApplied && want.Memory == t.applied.Memory && want.Mode == t.applied.Mode && sameCompute(want.Compute, t.applied.Compute, tolerance) {
		t.fresh = false
		return
	}
	if t.failures > 0 && now.Before(t.retryAt) {
		return
	}
	if t.hasApplied && want.Mode == t.applied.Mode && sameCompute(want.Compute, t.applied.Compute, tolerance) {
		want.Compute = t.applied.Compute // only the memory moves
	}
	async, isAsync := a.opts.Actuator.(AsyncActuator)
	var err error
	if isAsync {
		err = async.RequestShare(name, want)
	} else {
		err = a.opts.Actuator.SetShare(ctx, name, want)
	}
	if err != nil {
		if ctx.Err() != nil {
			return // stopping
		}
		if errors.Is(err, ErrElsewhere) {
			return // moved: the target device's adjuster sizes it now
		}
		a.failed(now, name, t.applied, want, d, err)
		return
	}
	old, first := t.applied, !t.hasApplied
	if !t.hasApplied || !sameCompute(want.Compute, old.Compute, shareEpsilon) {
		t.lastChange = now
	}
	reason := d.reason
	if want.Memory != old.Memory {
		t.memChange = now
		if d.memReason != "" {
			t.memReason = d.memReason
			if t.hasApplied && sameCompute(want.Compute, old.Compute, tolerance) && want.Mode == old.Mode {
				reason = d.memReason // only the memory moved
			} else {
				reason += "; " + d.memReason
			}
		}
	}
	if !t.hasApplied || !sameCompute(want.Compute, old.Compute, shareEpsilon) || want.Mode != old.Mode {
		// A move of the memory alone leaves the compute's slack running.
		t.slackSince, t.slack = time.Time{}, nil
	}
	t.applied, t.hasApplied, t.fresh = want, true, false
	if isAsync {
		if _, pending, _ := async.ShareInEffect(name); pending {
			if t.pending == nil {
				t.pendingOld, t.firstPending = old, first
			}
			t.pending, t.pendingD, t.pendingReason, t.pendingFrom = &want, d, reason, now
			return // settlePending tells the predictor once it is in effect
		}
		t.pending = nil
	}
	a.applied(name, old, want, d, reason)
}

// failed counts a share that did not apply and schedules the next try.
func (a *Adjuster) failed(now time.Time, name string, old, want limiter.Share, d decision, err error) {
	t := a.models[name]
	t.failures++
	backoff := a.opts.Period << min(t.failures-1, 5)
	t.retryAt = now.Add(backoff)
	a.record(Event{Model: name, Kind: EventError, Old: old, New: want,
		Reason:    fmt.Sprintf("setting the share failed (attempt %d, next in %s): %v", t.failures, shortDuration(backoff), err),
		Predicted: d.predicted, ForecastRate: d.rate})
}

// settlePending looks at the shares requested of an AsyncActuator in earlier
// passes: one now in effect is applied (the predictor told, the resize
// recorded); one that failed is an error, retried with backoff from the
// share in effect.
func (a *Adjuster) settlePending(now time.Time) {
	async, ok := a.opts.Actuator.(AsyncActuator)
	if !ok {
		return
	}
	for name, t := range a.models {
		if t.pending == nil {
			continue
		}
		in, pending, err := async.ShareInEffect(name)
		if pending {
			continue
		}
		want := *t.pending
		t.pending = nil
		if err != nil || in != want {
			if err == nil {
				err = fmt.Errorf("compute %.4g, memory %d is in effect, not the share asked for", in.Compute, in.Memory)
			}
			t.applied = in
			a.failed(now, name, in, want, t.pendingD, err)
			continue
		}
		a.applied(name, t.pendingOld, want, t.pendingD, t.pendingReason+
			fmt.Sprintf(" (in effect %s after it was asked for: replacement instances started)", shortDuration(now.Sub(t.pendingFrom))))
	}
}

// applied tells the predictor a share now in effect and records the
// resize for the reason given.
func (a *Adjuster) applied(name string, old, want limiter.Share, d decision, reason string) {
	t := a.models[name]
	t.failures, t.retryAt = 0, time.Time{}
	if a.opts.Predictor != nil {
		c := want.Compute
		if c <= 0 || c > 1 || want.Mode == limiter.ModeFloor {
			c = 1 // a floor takes what is idle: it runs as fast as the device
		}
		a.opts.Predictor.SetShare(name, c)
	}
	a.record(Event{Model: name, Kind: EventResize, Old: old, New: want, Reason: reason, Predicted: d.predicted, ForecastRate: d.rate})
}

// evictIdle unloads idle models, least recently used first, while the
// models' memory is over the budget: what they use, or what their memory
// shares would let them use where that is more (the shares of busy models
// grow before their batches need it, and an idle model's share shrinks to
// its smallest batch first). A model with requests queued or running, or
// with arrivals within KeepAlive, is never evicted.
func (a *Adjuster) evictIdle(ctx context.Context, now time.Time, states []qos.ModelState, p *plan) {
	usage := make(map[string]int64, len(states))
	var total int64
	for _, st := range states {
		name := st.Spec.Name
		u := a.opts.Actuator.MemoryUsage(name)
		if a.opts.CapsOnly {
			usage[name] = u
		} else {
			usage[name] = memoryShareSum(p, name, u)
		}
		total += usage[name]
	}
	if total <= a.opts.MemoryBudget {
		return
	}
	idle := func(st qos.ModelState) bool {
		return st.QueueDepth == 0 && st.Running == 0 && now.Sub(st.LastActive) >= a.opts.KeepAlive
	}
	var candidates []qos.ModelState
	for _, st := range states {
		if usage[st.Spec.Name] > 0 && idle(st) {
			candidates = append(candidates, st)
		}
	}
	slices.SortStableFunc(candidates, func(x, y qos.ModelState) int { return x.LastActive.Compare(y.LastActive) })
	for _, c := range candidates {
		if total <= a.opts.MemoryBudget || ctx.Err() != nil {
			return
		}
		name := c.Spec.Name
		// A request may have come since the snapshot.
		if st, ok := a.s.ModelState(name); !ok || !idle(st) {
			continue
		}
		t := a.models[name]
		reason := fmt.Sprintf("memory %s over budget %s: evicted idle %s", formatBytes(total), formatBytes(a.opts.MemoryBudget), shortDuration(now.Sub(c.LastActive)))
		if err := a.opts.Actuator.Evict(ctx, name); errors.Is(err, ErrElsewhere) {
			continue
		} else if err != nil {
			a.record(Event{Model: name, Kind: EventError, Old: t.applied, New: t.applied, Reason: fmt.Sprintf("evicting failed (%s): %v", reason, err)})
			continue
		}
		total -= usage[name]
		a.record(Event{Model: name, Kind: EventEvict, Old: t.applied, New: t.applied, Reason: reason})
	}
	if total > a.opts.MemoryBudget {
		a.log.Debug("memory over budget with no idle model to evict", "usage", total, "budget", a.opts.MemoryBudget)
	}
}

// publish makes the pass's outcome visible to Shares and the metrics.
func (a *Adjuster) publish(states []qos.ModelState, ds map[string]decision) {
	view := make([]ModelShare, 0, len(states))
	for _, st := range states {
		name := st.Spec.Name
		d, t := ds[name], a.models[name]
		share := t.applied
		var pending *limiter.Share
		if t.pending != nil {
			share, pending = t.pendingOld, new(*t.pending)
		}
		view = append(view, ModelShare{
			Model:            name,
			Class:            st.Spec.Class,
			Share:            share,
			Pending:          pending,
			Target:           d.share.Compute,
			MemoryTarget:     d.memTarget,
			MemoryReason:     t.memReason,
			Pinned:           t.pin != nil,
			Source:           d.source,
			PredictedLatency: d.predicted,
			ForecastRate:     d.rate,
			SLO:              st.Spec.SLO,
			Attainment:       st.Attainment,
		})
	}
	a.mu.Lock()
	a.view = view
	a.mu.Unlock()
}

// formatBytes prints a byte count in binary units: "1.2GiB".
func formatBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%dB", n)
	}
	v, i := float64(n)/unit, 0
	for v >= unit && i < 4 {
		v /= unit
		i++
	}
	return fmt.Sprintf("%.3g%ciB", v, "KMGTP"[i])
}

// shortDuration prints a duration without trailing zero units: "4m",
// "10s", "1h30m".
func shortDuration(d time.Duration) string {
	switch {
	case d >= time.Second:
		d = d.Round(time.Second)
	case d >= time.Millisecond:
		d = d.Round(time.Millisecond)
	}
	s := d.String()
	if len(s) > 2 && s[len(s)-2:] == "0s" && (s[len(s)-3] == 'm' || s[len(s)-3] == 'h') {
		s = s[:len(s)-2]
	}
	if len(s) > 2 && s[len(s)-2:] == "0m" && s[len(s)-3] == 'h' {
		s = s[:len(s)-2]
	}
	return s
}
