package control

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/sloserve/sloserve/qos"
)

// This file places models across devices (GPUs): at load for a model whose
// config names no device, and again when the day's mix drifts, in the
// spirit of MuxFlow's matching-based placement (Zhao et al., "MuxFlow:
// Efficient and Safe GPU Sharing in Large-Scale Production Deep Learning
// Clusters", 2023): each period, candidate moves (a model, a target device)
// are weighed by how much they lower a placement cost, and a matching
// picks the moves so that every device takes part in one move at most.

// Event kinds of placement.
const (
	// EventPlace is a model's initial placement, at load.
	EventPlace = "place"
	// EventMove is a model moved to another device by a warm shadow.
	EventMove = "move"
)

// ErrElsewhere is what an actuator answers a device's adjuster for a model
// that runs on another device now (it moved): the adjuster drops the
// change without an error event.
var ErrElsewhere = errors.New("control: the model runs on another device now")

// PlacementDevice is a device placement may use.
type PlacementDevice struct {
	Name string
	// Memory is the device's memory in bytes; 0 means unknown (not
	// checked).
	Memory int64
	// Capacity is the compute the models may use, a fraction of the
	// device; 0 means 1.
	Capacity float64
}

// PlacementModel is one model as placement sees it.
type PlacementModel struct {
	Name  string
	Class qos.Class
	// Demand is the compute share the model needs at its forecast rate
	// (see docs/gpu.md: the adjuster's target for a latency-critical
	// model under the adaptive policy, else its busy fraction at the
	// whole device).
	Demand float64
	// Memory is the bytes its instances need on a device (memory_limit,
	// or the working set observed).
	Memory int64
	// Device is where it runs now; "" when it is not placed yet.
	Device string
	// Pinned: its config names Device; placement never moves it.
	Pinned bool
	// Risky: a best-effort model whose faults have taken a device down
	// (RiskyModels); kept apart from latency-critical models when the
	// devices allow.
	Risky bool
	// Yields: a best-effort model that runs behind the others on its
	// device (a background share on a limiter with a background class:
	// MPS clients below normal priority) and fills what they leave. Its
	// demand is what it gets, not what it keeps from anyone: it counts
	// only against the other yielding models' (their balance), so that
	// the latency-critical models spread by their own demand instead of
	// crowding onto the devices without a batch job.
	Yields bool
}

// RiskyModels says which models (by name) placement keeps apart from
// latency-critical ones, and why. *Isolation implements it: device-fault
// recovery marks a best-effort model whose client faulted its device more
// than once lately. A nil RiskyModels marks none.
type RiskyModels interface {
	Risky(model string) (why string, ok bool)
}

var _ RiskyModels = (*Isolation)(nil)

// Move is one model's move from one device to another.
type Move struct {
	Model, From, To string
	// Gain is how much the move lowers the placement cost.
	Gain float64
	// Reason says why, for people.
	Reason string
}

// Weights of the placement cost of a device (see load.cost). The unit is
// a device's compute: a latency-critical overload of 0.1 costs 1; a mix
// of a risky best-effort model with latency-critical ones costs as much
// as an overload of 0.05; balance costs the square of the load.
const (
	weightLCOver   = 10  // per unit of latency-critical demand over capacity
	weightAllOver  = 2   // per unit of all demand over capacity
	weightRisky    = 0.5 // a risky best-effort model beside latency-critical ones
	weightMemOver  = 100 // per device of memory over what fits
	weightBalance  = 1   // times (load/capacity)^2
	placeEpsilon   = 1e-9
	defaultMinGain = 0.1
)

// load is what a device holds in a placement.
type load struct {
	dev      PlacementDevice
	lc, all  float64
	fill     float64 // the demand of the models that yield
	mem      int64
	maxMem   int64 // the largest model's memory: room for one shadow
	lcCount  int
	risky    int
	count    int
	contents []string
}

func newLoad(d PlacementDevice) *load {
	if d.Capacity <= 0 {
		d.Capacity = 1
	}
	return &load{dev: d}
}

func (l *load) with(m PlacementModel, sign int) *load {
	n := *l
	s := float64(sign)
	if m.Yields {
		n.fill += s * m.Demand
	} else {
		n.all += s * m.Demand
	}
	n.mem += int64(sign) * m.Memory
	n.count += sign
	if m.Class == qos.ClassLatencyCritical {
		n.lc += s * m.Demand
		n.lcCount += sign
	} else if m.Risky {
		n.risky += sign
	}
	if sign > 0 {
		n.maxMem = max(n.maxMem, m.Memory)
	}
	return &n
}

// fits reports whether m fits in the device's memory beside what it
// holds, with room left for one shadow instance of the largest model
// during a swap or a move.
func (l *load) fits(m PlacementModel) bool {
	if l.dev.Memory <= 0 {
		return true
	}
	return l.mem+m.Memory+max(l.maxMem, m.Memory) <= l.dev.Memory
}

// cost is the device's part of the placement cost: latency-critical
// demand over capacity, all demand over capacity, a risky best-effort
// model beside latency-critical ones, memory over the device, and the
// square of the load (so that spreading lowers the cost); the demand of
// the models that yield counts only in a square of its own.
func (l *load) cost() float64 {
	c := l.dev.Capacity
	cost := weightLCOver*max(0, l.lc-c) + weightAllOver*max(0, l.all-c) + weightBalance*(l.all/c)*(l.all/c) +
		weightBalance*(l.fill/c)*(l.fill/c)
	if l.risky > 0 && l.lcCount > 0 {
		cost += weightRisky
	}
	if l.dev.Memory > 0 {
		if over := l.mem + l.maxMem - l.dev.Memory; over > 0 {
			cost += weightMemOver * float64(over) / float64(l.dev.Memory)
		}
	}
	return cost
}

func (l *load) String() string {
	s := fmt.Sprintf("%s LC %.2f, all %.2f of %.2f", l.dev.Name, l.lc, l.all, l.dev.Capacity)
	if l.fill > 0 {
		s += fmt.Sprintf(", filled by %.2f that yields", l.fill)
	}
	if l.risky > 0 && l.lcCount > 0 {
		s += ", risky BE beside LC"
	}
	return s
}

// Placed is a model's initial device and why.
type Placed struct {
	Device string
	Reason string
}

// Assign places the models that have no Device yet, beside those that
// have one: latency-critical ones first, largest demand first, then
// best-effort ones, risky last; each on the device where it raises the
// placement cost least among those with room for it in memory (ties: the
// device with fewer models, then by name). It fails for a model no device
// has room for.
func Assign(devs []PlacementDevice, models []PlacementModel) (map[string]Placed, error) {
	if len(devs) == 0 {
		return nil, errors.New("control: placement: no device")
	}
	loads := make(map[string]*load, len(devs))
	for _, d := range devs {
		loads[d.Name] = newLoad(d)
	}
	var todo []PlacementModel
	for _, m := range models {
		if m.Device == "" {
			todo = append(todo, m)
			continue
		}
		if l, ok := loads[m.Device]; ok {
			loads[m.Device] = l.with(m, 1)
		}
	}
	slices.SortStableFunc(todo, func(a, b PlacementModel) int {
		return cmp.Or(cmp.Compare(placeOrder(a), placeOrder(b)), cmp.Compare(b.Demand, a.Demand),
			cmp.Compare(b.Memory, a.Memory), strings.Compare(a.Name, b.Name))
	})
	out := make(map[string]Placed, len(todo))
	var errs []error
	for _, m := range todo {
		var best *load
		bestDelta := math.Inf(1)
		for _, d := range devs {
			l := loads[d.Name]
			if !l.fits(m) {
				continue
			}
			delta := l.with(m, 1).cost() - l.cost()
			if best == nil || delta < bestDelta-placeEpsilon ||
				(math.Abs(delta-bestDelta) <= placeEpsilon && l.count < best.count) {
				best, bestDelta = l, delta
			}
		}
		if best == nil {
			errs = append(errs, fmt.Errorf("control: placement: no device has room for %s (%s with one shadow's headroom)", m.Name, formatBytes(m.Memory)))
			continue
		}
		after := best.with(m, 1)
		loads[best.dev.Name] = after
		out[m.Name] = Placed{Device: best.dev.Name, Reason: fmt.Sprintf("placed at load (demand %.2f, memory %s): least added cost %.2f; now %s", m.Demand, formatBytes(m.Memory), bestDelta, after)}
	}
	return out, errors.Join(errs...)
}

// placeOrder: latency-critical, then best-effort, then risky best-effort.
func placeOrder(m PlacementModel) int {
	switch {
	case m.Class == qos.ClassLatencyCritical:
		return 0
	case m.Risky:
		return 2
	default:
		return 1
	}
}

// PlanMoves chooses the moves of one re-placement pass: every move of a
// movable model (placed, not pinned, and movable says so) to another
// device with room for it and its shadow whose gain (the placement cost
// before less after) is at least minGain; then, greedily by gain, a
// matching in which a device takes part in one move at most (as its
// source or its target). Greedy matching is within half of the best
// total gain; a device's other moves wait for the next pass, when the
// costs are read again.
func PlanMoves(devs []PlacementDevice, models []PlacementModel, minGain float64, movable func(model string) bool) []Move {
	loads := make(map[string]*load, len(devs))
	for _, d := range devs {
		loads[d.Name] = newLoad(d)
	}
	for _, m := range models {
		if l, ok := loads[m.Device]; ok {
			loads[m.Device] = l.with(m, 1)
		}
	}
	// A device's largest model after one leaves is needed for its shadow
	// headroom; recomputed per candidate from the models.
	byDevice := map[string][]PlacementModel{}
	for _, m := range models {
		byDevice[m.Device] = append(byDevice[m.Device], m)
	}
	var cands []Move
	for _, m := range models {
		from, ok := loads[m.Device]
		if !ok || m.Pinned || (movable != nil && !movable(m.Name)) {
			continue
		}
		fromAfter := from.with(m, -1)
		fromAfter.maxMem = 0
		for _, o := range byDevice[m.Device] {
			if o.Name != m.Name {
				fromAfter.maxMem = max(fromAfter.maxMem, o.Memory)
			}
		}
		for _, d := range devs {
			to := loads[d.Name]
			if d.Name == m.Device || !to.fits(m) {
				continue
			}
			toAfter := to.with(m, 1)
			gain := from.cost() + to.cost() - fromAfter.cost() - toAfter.cost()
			if gain < minGain || gain <= placeEpsilon {
				continue
			}
			cands = append(cands, Move{Model: m.Name, From: m.Device, To: d.Name, Gain: gain,
				Reason: fmt.Sprintf("%s -> %s (demand %.2f): before %s; %s; after %s; %s (cost lower by %.2f)",
					m.Device, d.Name, m.Demand, from, to, fromAfter, toAfter, gain)})
		}
	}
	slices.SortStableFunc(cands, func(a, b Move) int {
		return cmp.Or(cmp.Compare(b.Gain, a.Gain), strings.Compare(a.Model, b.Model), strings.Compare(a.To, b.To))
	})
	used := map[string]bool{}
	var out []Move
	for _, c := range cands {
		if used[c.From] || used[c.To] {
			continue
		}
		used[c.From], used[c.To] = true, true
		out = append(out, c)
	}
	return out
}

// Mover moves a model to another device by a warm shadow: a new instance
// on the target, warmed, then the scheduler registration switched, then
// the old one drained and stopped. The models registry implements it.
type Mover interface {
	Move(ctx context.Context, model, device string) error
}

// PlacerOptions configure a Placer.
type PlacerOptions struct {
	// Period is the time between two re-placement passes; default 10s.
	Period time.Duration
	// MinGain is the least cost a move must save; default 0.1, negative
	// means 0.
	MinGain float64
	// MinResidence is the least time a model stays on a device (since it
	// was placed or moved) before it may move again.
	MinResidence time.Duration
	// Snapshot reads the devices and the models placed on them now.
	Snapshot func() ([]PlacementDevice, []PlacementModel)
	// Mover applies the moves; required for Run.
	Mover Mover
	// EventCapacity is how many events Events keeps; default 1024.
	EventCapacity int
	Logger        *slog.Logger
}

// Placer places models at load (Place) and re-places them when the mix
// drifts (Run). Its methods are safe for concurrent use.
type Placer struct {
	opts PlacerOptions
	log  *slog.Logger

	mu sync.Mutex
	// pending are initial placements not yet in the snapshot (loading).
	pending map[string]PlacementModel
	// since is when each model was last placed or moved.
	since  map[string]time.Time
	events *EventLog
}

// NewPlacer returns a Placer.
func NewPlacer(opts PlacerOptions) (*Placer, error) {
	if opts.Snapshot == nil {
		return nil, errors.New("control: placer without a snapshot")
	}
	if opts.Period < 0 || opts.MinResidence < 0 || opts.EventCapacity < 0 || math.IsNaN(opts.MinGain) {
		return nil, fmt.Errorf("control: placer: negative period (%s), residence (%s) or event capacity (%d), or min gain %v", opts.Period, opts.MinResidence, opts.EventCapacity, opts.MinGain)
	}
	opts.Period = cmp.Or(opts.Period, 10*time.Second)
	opts.EventCapacity = cmp.Or(opts.EventCapacity, DefaultEventCapacity)
	opts.MinGain = max(opts.MinGain, 0)
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	return &Placer{opts: opts, log: opts.Logger.With("component", "placer"),
		pending: map[string]PlacementModel{}, since: map[string]time.Time{}, events: NewEventLog(opts.EventCapacity)}, nil
}

// Place chooses the device of a model about to load, beside the models
// placed already and those placed but still loading. A model that runs
// already keeps its device; one pinned (m.Pinned, with m.Device) is
// counted on its device while it loads.
func (p *Placer) Place(m PlacementModel) (string, error) {
	devs, models := p.opts.Snapshot()
	p.mu.Lock()
	defer p.mu.Unlock()
	if m.Pinned && m.Device != "" {
		p.pending[m.Name] = m
		p.since[m.Name] = time.Now()
		return m.Device, nil
	}
	for _, o := range models {
		if o.Name == m.Name && o.Device != "" {
			return o.Device, nil
		}
	}
	if prev, ok := p.pending[m.Name]; ok {
		return prev.Device, nil
	}
	seen := map[string]bool{}
	for _, o := range models {
		seen[o.Name] = true
	}
	for name, o := range p.pending {
		if seen[name] || time.Since(p.since[name]) > pendingFor {
			delete(p.pending, name) // loaded (the snapshot has it), or its load failed
			continue
		}
		models = append(models, o)
	}
	m.Device = ""
	got, err := Assign(devs, append(models, m))
	if err != nil {
		return "", err
	}
	placed := got[m.Name]
	m.Device = placed.Device
	p.pending[m.Name] = m
	p.since[m.Name] = time.Now()
	p.recordLocked(Event{Device: placed.Device, Model: m.Name, Kind: EventPlace, Reason: placed.Reason})
	return placed.Device, nil
}

// pendingFor is how long a placement made at load counts before the model
// shows in the snapshot: a load that takes longer (or failed) stops
// counting.
const pendingFor = 10 * time.Minute

// Run re-places once every Period until ctx ends: it reads the snapshot,
// plans the moves and applies them, at once and in parallel (they touch
// distinct devices). It returns nil when ctx ends.
func (p *Placer) Run(ctx context.Context) error {
	if p.opts.Mover == nil {
		return errors.New("control: placer Run without a mover")
	}
	tick := time.NewTicker(p.opts.Period)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		p.Pass(ctx)
	}
}

// Pass is one re-placement pass; it returns the moves it made.
func (p *Placer) Pass(ctx context.Context) []Move {
	devs, models := p.opts.Snapshot()
	now := time.Now()
	p.mu.Lock()
	for _, m := range models {
		if _, ok := p.since[m.Name]; !ok {
			p.since[m.Name] = now // a model seen for the first time settles first
		}
	}
	since := make(map[string]time.Time, len(p.since))
	for k, v := range p.since {
		since[k] = v
	}
	p.mu.Unlock()
	movable := func(name string) bool { return now.Sub(since[name]) >= p.opts.MinResidence }
	moves := PlanMoves(devs, models, p.opts.MinGain, movable)
	var (
		wg   sync.WaitGroup
		done = make([]bool, len(moves))
	)
	for i, mv := range moves {
		wg.Go(func() {
			start := time.Now()
			if err := p.opts.Mover.Move(ctx, mv.Model, mv.To); err != nil {
				if ctx.Err() == nil {
					p.record(Event{Device: mv.From, Model: mv.Model, Kind: EventError, Reason: fmt.Sprintf("moving %s -> %s failed: %v", mv.From, mv.To, err)})
				}
				return
			}
			done[i] = true
			p.record(Event{Device: mv.To, Model: mv.Model, Kind: EventMove,
				Reason: fmt.Sprintf("moved by a warm shadow in %s: %s", shortDuration(time.Since(start)), mv.Reason)})
		})
	}
	wg.Wait()
	var out []Move
	p.mu.Lock()
	for i, mv := range moves {
		if done[i] {
			p.since[mv.Model] = time.Now()
			out = append(out, mv)
		}
	}
	live := map[string]bool{}
	for _, m := range models {
		live[m.Name] = true
	}
	for name := range p.since {
		if !live[name] && p.pending[name].Name == "" {
			delete(p.since, name)
		}
	}
	p.mu.Unlock()
	return out
}

// Events returns the kept events at or after since (zero: all), oldest
// first; with limit > 0, only the newest limit of them.
func (p *Placer) Events(since time.Time, limit int) []Event {
	return p.events.Since(since, limit)
}

func (p *Placer) record(e Event) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.recordLocked(e)
}

func (p *Placer) recordLocked(e Event) {
	e = p.events.Add(e)
	level := slog.LevelInfo
	if e.Kind == EventError {
		level = slog.LevelWarn
	}
	p.log.Log(context.Background(), level, "placement "+e.Kind, "model", e.Model, "device", e.Device, "reason", e.Reason)
}
