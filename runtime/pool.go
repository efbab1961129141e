package runtime

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Member is an instance a Pool holds: it runs calls, tells whether it can
// serve now, and stops.
type Member interface {
	Instance
	// Status tells whether the instance can serve now, and if not, why.
	Status() (ready bool, reason string)
	Stop(ctx context.Context) error
}

// Checker is implemented by members that can say they are out of service
// only while a check runs (Suspect's): alive, serving again or replaced
// soon. A call that finds no other member serving waits for the check's
// end (or its own deadline) instead of failing at once: a member starved
// of CPU or SMs may be checked for as long as it is starved, and its
// requests stay queued meanwhile, as they would behind a busy one.
type Checker interface {
	Checking() bool
}

// Suspecter is implemented by members that can be told that a call on them
// got no answer in time, so that they check themselves at once (see
// Runner.Suspect).
type Suspecter interface {
	Suspect(why string)
}

// DefaultCallTimeout is PoolOptions.CallTimeout's default.
const DefaultCallTimeout = 30 * time.Second

// ErrPoolStopped means the pool has been stopped: it runs no more calls
// and replaces no member. It wraps ErrUnavailable.
var ErrPoolStopped = fmt.Errorf("%w: instance pool stopped", ErrUnavailable)

// PoolOptions configure a Pool.
type PoolOptions struct {
	// Slots is how many calls one member runs at once; 0 means 1.
	Slots int
	// CallTimeout bounds one call to a member (0: DefaultCallTimeout). A
	// call without an answer by then is abandoned: the request is tried
	// once more on another member or fails with ErrUnavailable, and the
	// member checks its health at once.
	CallTimeout time.Duration
	// Stop stops a member the pool lets go of (a replaced one, or all at
	// Stop) and releases what the caller started it with; nil calls the
	// member's own Stop.
	Stop func(ctx context.Context, m Member)
	// OnRetry, when set, is called each time a call is tried again on
	// another member.
	OnRetry func()
}

// Pool is the set of instances of one model version and their execution
// slots. Execute runs a request on an idle member, so a scheduler executes
// on the pool directly; Replace swaps one member for a new one without
// failing a request; Stop drains and stops them all. The caller starts the
// members (it knows devices, limiter units and thread counts); the pool
// only chooses among them.
type Pool struct {
	opts PoolOptions
	// idle holds a token per free execution slot: the member it runs on.
	// Its room is every member's slots and one more member's, for the
	// replacement during a swap.
	idle chan Member

	// stopped is closed by Stop; parked slots (see park) are then dropped.
	stopped chan struct{}
	calls   atomic.Int64 // Execute calls in progress

	// swap holds a token while a replacement runs: one at a time, and
	// none after Stop. It is a channel, not a mutex, because a replacement
	// waits for its new member to warm up and the next one waits for it;
	// a goroutine blocked on a channel lets a simulated clock
	// (testing/synctest) move on, one blocked on a mutex stops it.
	swap   chan struct{}
	closed bool // guarded by swap

	// The asynchronous swaps (Swap), by member index.
	asyncMu sync.Mutex
	swaps   map[int]*asyncSwap

	mu      sync.RWMutex // guards members; Replace changes them
	members []Member

	bound batchBound // the batches in flight against the members' memory (pool_batch.go)
}

// NewPool returns a pool over members, at least one, each given opts.Slots
// execution slots.
func NewPool(members []Member, opts PoolOptions) (*Pool, error) {
	if len(members) == 0 {
		return nil, errors.New("runtime: a pool needs at least one member")
	}
	opts.Slots = max(opts.Slots, 1)
	if opts.CallTimeout <= 0 {
		opts.CallTimeout = DefaultCallTimeout
	}
	p := &Pool{
		opts:    opts,
		idle:    make(chan Member, (len(members)+1)*opts.Slots),
		stopped: make(chan struct{}),
		swap:    make(chan struct{}, 1),
		members: slices.Clone(members),
	}
	for range opts.Slots {
		for _, m := range members {
			p.idle <- m
		}
	}
	return p, nil
}

// Members returns the pool's members, in index order.
func (p *Pool) Members() []Member {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return slices.Clone(p.members)
}

// Len is the number of members; a swap replaces members, never changes it.
func (p *Pool) Len() int {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return len(p.members)
}

// Slots is the number of calls the pool runs at once.
func (p *Pool) Slots() int { return p.Len() * p.opts.Slots }

// Ready reports whether any member can serve now.
func (p *Pool) Ready() bool {
	p.mu.RLock()
	defer p.mu.RUnlock()
	for _, m := range p.members {
		if ready(m) {
			return true
		}
	}
	return false
}

// Execute runs one request on an idle member (it implements qos.Executor).
// If the member turns out to be down (it died during the call, or gave no
// answer within the call timeout) and the pool has others, the request is
// tried once more on another: inference is idempotent. A member killed for
// exceeding its memory limit is not retried: the request that did it would
// most likely do it again. The request's deadline, when set, ends the call.
func (p *Pool) Execute(ctx context.Context, req *InferRequest) (*InferResponse, error) {
	p.calls.Add(1)
	defer p.calls.Add(-1)
	if !req.Deadline.IsZero() {
		// The request's own deadline (a merged batch's latest) ends its
		// execution as a gRPC deadline does: a runner that hangs holds no
		// request past it.
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, req.Deadline)
		defer cancel()
	}
	b := rows(req)
	leave, err := p.enterBatch(b)
	if err != nil {
		return nil, err
	}
	defer leave()
	attempts := min(2, p.Len())
	var last Member
	for attempt := range attempts {
		if attempt > 0 && p.opts.OnRetry != nil {
			p.opts.OnRetry()
		}
		m, perr := p.pickFitting(ctx, b, last)
		if perr != nil {
			return nil, perr
		}
		var resp *InferResponse
		resp, err = p.call(ctx, m, req)
		p.putBack(m)
		if err == nil {
			return resp, nil
		}
		if !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrOutOfMemory) || ctx.Err() != nil {
			break
		}
		last = m
	}
	return nil, err
}

// suspectAfter is how long a call must have gone unanswered before its
// abandonment (by the caller's deadline or cancellation) makes the member
// check its health; the call timeout always does.
const suspectAfter = time.Second

// StarvationMeter is implemented by members that can tell a call
// without an answer because they are starved (of CPU: see Runner.Starved)
// from one without an answer because they hang: a call on a member
// starved at the call timeout is not abandoned while it stays starved,
// only at its own deadline, as a request queued behind busy work.
type StarvationMeter interface {
	// Starved reports whether the member is starved over the window
	// from now (it blocks up to window, or until done is closed).
	Starved(window time.Duration, done <-chan struct{}) bool
}

// call runs one request on one member under the call timeout. A call that
// gets no answer in time makes the member check its health at once, so
// that a hung runner is found without waiting for the periodic checks. A
// member starved at the call timeout (StarvationMeter) is given the call
// timeout's quarter again, and again, while it stays starved.
func (p *Pool) call(ctx context.Context, m Member, req *InferRequest) (*InferResponse, error) {
	start := time.Now()
	limit := p.opts.CallTimeout
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var starvedFor atomic.Int64
	timer := time.AfterFunc(limit, func() {
		if meter, ok := m.(StarvationMeter); ok {
			window := limit / starvedShare
			for t := time.Now(); meter.Starved(window, cctx.Done()); t = time.Now() {
				starvedFor.Add(int64(time.Since(t)))
			}
		}
		cancel()
	})
	defer timer.Stop()
	resp, err := m.Infer(cctx, req)
	if err == nil || cctx.Err() == nil {
		return resp, err
	}
	took := time.Since(start)
	timedOut := ctx.Err() == nil
	if s, ok := m.(Suspecter); ok && (timedOut || took >= min(suspectAfter, limit)) {
		why := fmt.Sprintf("a call was abandoned unanswered after %s (%v)", took.Round(time.Millisecond), context.Cause(ctx))
		if timedOut {
			why = fmt.Sprintf("a call got no answer within the call timeout of %s", limit)
		}
		s.Suspect(why)
	}
	if timedOut {
		if d := time.Duration(starvedFor.Load()); d > 0 {
			return nil, fmt.Errorf("%w: no answer within the call timeout of %s and %s more while the instance was starved", ErrUnavailable, limit, d.Round(time.Millisecond))
		}
		return nil, fmt.Errorf("%w: no answer within the call timeout of %s", ErrUnavailable, limit)
	}
	return nil, err
}

// parkPoll is how often a parked execution slot looks whether its member
// serves again.
const parkPoll = 20 * time.Millisecond

// pick takes an execution slot for a request, preferring members that can
// serve now and, for a retry, another than avoid. The slots of a member that
// cannot serve (restarting, being checked, failed) leave the rotation while
// another member can serve, and come back when it can. When no other member
// can serve, the slot is used anyway: a member being checked (Checker) is
// waited for until the check ends, and a call on a member that still
// cannot serve fails at once, with its reason.
func (p *Pool) pick(ctx context.Context, avoid Member) (Member, error) {
	for skipped := 0; ; skipped++ {
		var m Member
		select {
		case m = <-p.idle:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-p.stopped:
			return nil, ErrPoolStopped
		}
		ok := ready(m)
		if skipped >= cap(p.idle) || (ok && m != avoid) || !p.otherReady(m) {
			if ok {
				return m, nil
			}
			if err := p.awaitCheck(ctx, m); err != nil {
				p.idle <- m
				return nil, err
			}
			if ready(m) || !p.otherReady(m) {
				return m, nil
			}
			p.park(m) // another member serves now: take its slot
			continue
		}
		if ok {
			p.idle <- m // avoid: a last resort
			continue
		}
		p.park(m)
	}
}

// awaitCheck waits, holding m's slot, while m is out of service for a
// check (see Checker) and no other member serves; it returns ctx's error
// when ctx ends first, ErrPoolStopped when the pool stops.
func (p *Pool) awaitCheck(ctx context.Context, m Member) error {
	c, ok := m.(Checker)
	if !ok {
		return nil
	}
	var t *time.Ticker
	for c.Checking() && !p.otherReady(m) && p.current(m) {
		if t == nil {
			t = time.NewTicker(parkPoll)
			defer t.Stop()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-p.stopped:
			return ErrPoolStopped
		case <-t.C:
		}
	}
	return nil
}

// putBack returns an execution slot after a call: to the pool, or parked
// while its member cannot serve and another can.
func (p *Pool) putBack(m Member) {
	if !ready(m) && p.otherReady(m) {
		p.park(m)
		return
	}
	p.idle <- m
}

// park holds an execution slot out of the pool until its member can serve
// again, no other member can, or the member has been replaced; it drops
// the slot when the pool stops.
func (p *Pool) park(m Member) {
	go func() {
		t := time.NewTicker(parkPoll)
		defer t.Stop()
		for {
			select {
			case <-p.stopped:
				return
			case <-t.C:
			}
			if ready(m) || !p.otherReady(m) || !p.current(m) {
				p.idle <- m
				return
			}
		}
	}()
}

func ready(m Member) bool {
	ok, _ := m.Status()
	return ok
}

// otherReady reports whether a member other than m can serve now.
func (p *Pool) otherReady(m Member) bool {
	p.mu.RLock()
	defer p.mu.RUnlock()
	for _, o := range p.members {
		if o != m && ready(o) {
			return true
		}
	}
	return false
}

// current reports whether m is still one of the pool's members.
func (p *Pool) current(m Member) bool {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return slices.Contains(p.members, m)
}

// Replace swaps member i for one that start returns (started and warmed:
// it takes requests at once). The old member serves until start returns;
// then the new one takes the old one's execution slots as they come free,
// and the old one is stopped once it has none left, after its last call.
// The caller chooses where the new member runs (another share, another
// device). It returns ErrPoolStopped after Stop, and start's error, with
// the old member still serving.
func (p *Pool) Replace(ctx context.Context, i int, start func(ctx context.Context) (Member, error)) error {
	return p.replace(ctx, i, start, nil)
}

// replace is Replace, calling switching, when set, once the new member is
// in and the old one drains. A member start returns after ctx ended is
// stopped, not switched in.
func (p *Pool) replace(ctx context.Context, i int, start func(ctx context.Context) (Member, error), switching func()) error {
	p.swap <- struct{}{}
	defer func() { <-p.swap }()
	if p.closed {
		return ErrPoolStopped
	}
	if i < 0 || i >= p.Len() {
		return fmt.Errorf("runtime: no member %d in a pool of %d", i, p.Len())
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	fresh, err := start(ctx)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		p.stopMember(context.WithoutCancel(ctx), fresh)
		return err
	}
	clearBound := p.holdFor(fresh) // no larger batch in flight reaches it
	if switching != nil {
		switching()
	}
	p.mu.Lock()
	old := p.members[i]
	p.members[i] = fresh
	p.mu.Unlock()
	clearBound()

	for range p.opts.Slots {
		p.idle <- fresh // the pool has room for one swap's slots
	}
	for taken := 0; taken < p.opts.Slots; {
		m := <-p.idle // the old member's slots come back as its calls end
		if m == old {
			taken++
			continue
		}
		p.idle <- m
		time.Sleep(time.Millisecond) // let a waiting call take it
	}
	p.stopMember(context.WithoutCancel(ctx), old)
	return nil
}

// Drain waits for the calls in progress to end, or for ctx to. Calls that
// start meanwhile are waited for too.
func (p *Pool) Drain(ctx context.Context) error {
	t := time.NewTicker(parkPoll)
	defer t.Stop()
	for p.calls.Load() > 0 {
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// Stop stops every member, after a swap in progress has finished. The pool
// runs no call and replaces no member after it: calls waiting for a slot
// fail with ErrPoolStopped. Drain first to let calls in progress end.
// Stopping twice stops nothing more.
func (p *Pool) Stop(ctx context.Context) {
	p.asyncMu.Lock()
	for _, s := range p.swaps {
		s.cancel(ErrPoolStopped)
	}
	p.asyncMu.Unlock()
	p.swap <- struct{}{}
	was := p.closed
	p.closed = true
	<-p.swap
	if was {
		return
	}
	close(p.stopped)
	// All at once: each waits for its process to exit.
	var wg sync.WaitGroup
	for _, m := range p.Members() {
		wg.Go(func() { p.stopMember(context.WithoutCancel(ctx), m) })
	}
	wg.Wait()
}

// SwapState is where an asynchronous swap (Swap) of one member stands.
type SwapState string

// The states of a swap: starting the new member (and warming it), then
// switching to it while the old one drains, then done; or failed (start's
// error, the old member serving) or superseded by a later Swap of the same
// member before it switched.
const (
	SwapStarting   SwapState = "starting"
	SwapSwitching  SwapState = "switching"
	SwapDone       SwapState = "done"
	SwapFailed     SwapState = "failed"
	SwapSuperseded SwapState = "superseded"
)

// SwapStatus is the last asynchronous swap of one member.
type SwapStatus struct {
	Index   int
	State   SwapState
	Err     error // why it failed or was superseded
	Started time.Time
}

// ErrSuperseded is the outcome of a swap that a later Swap of the same
// member replaced before it switched.
var ErrSuperseded = errors.New("swap superseded by a later one")

// asyncSwap is one Swap in progress.
type asyncSwap struct {
	status SwapStatus // guarded by Pool.asyncMu
	cancel context.CancelCauseFunc
}

// Swap replaces member i as Replace does, in the background: it returns at
// once, and done (when set) gets the outcome. A swap of member i that has
// not switched yet is superseded: its start's context is canceled, a member
// it starts anyway is stopped, and this one runs after it; a swap already
// switching finishes first. SwapStatus reports where the last one stands.
func (p *Pool) Swap(i int, start func(ctx context.Context) (Member, error), done func(error)) {
	ctx, cancel := context.WithCancelCause(context.Background())
	s := &asyncSwap{status: SwapStatus{Index: i, State: SwapStarting, Started: time.Now()}, cancel: cancel}
	p.asyncMu.Lock()
	if p.swaps == nil {
		p.swaps = map[int]*asyncSwap{}
	}
	if prev := p.swaps[i]; prev != nil && prev.status.State == SwapStarting {
		prev.cancel(ErrSuperseded)
	}
	p.swaps[i] = s
	p.asyncMu.Unlock()
	go func() {
		defer cancel(nil)
		err := p.replace(ctx, i, start, func() { p.setSwapState(s, SwapSwitching, nil) })
		if err != nil && ctx.Err() != nil {
			err = context.Cause(ctx)
		}
		switch {
		case errors.Is(err, ErrSuperseded):
			p.setSwapState(s, SwapSuperseded, err)
		case err != nil:
			p.setSwapState(s, SwapFailed, err)
		default:
			p.setSwapState(s, SwapDone, nil)
		}
		if done != nil {
			done(err)
		}
	}()
}

// CancelSwap cancels member i's asynchronous swap if it is still starting
// (its outcome is ErrSuperseded, and a member it starts anyway is stopped)
// and reports whether it did; a swap already switching, done or absent is
// left alone.
func (p *Pool) CancelSwap(i int) bool {
	p.asyncMu.Lock()
	defer p.asyncMu.Unlock()
	s := p.swaps[i]
	if s == nil || s.status.State != SwapStarting {
		return false
	}
	s.cancel(ErrSuperseded)
	return true
}

func (p *Pool) setSwapState(s *asyncSwap, st SwapState, err error) {
	p.asyncMu.Lock()
	defer p.asyncMu.Unlock()
	s.status.State, s.status.Err = st, err
}

// SwapStatus is the last asynchronous swap of member i; false when it has
// had none.
func (p *Pool) SwapStatus(i int) (SwapStatus, bool) {
	p.asyncMu.Lock()
	defer p.asyncMu.Unlock()
	s, ok := p.swaps[i]
	if !ok {
		return SwapStatus{}, false
	}
	return s.status, true
}

func (p *Pool) stopMember(ctx context.Context, m Member) {
	if p.opts.Stop != nil {
		p.opts.Stop(ctx, m)
		return
	}
	_ = m.Stop(ctx)
}

var _ Suspecter = (*Runner)(nil)
