package runtime

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeMember answers every call with its id in one INT32 output. It can be
// down (answers ErrUnavailable), hang (answers nothing until the call is
// abandoned), die of memory, or wait at a gate; told a call got no answer,
// it takes itself out of service as a runner does.
type fakeMember struct {
	id       int32
	calls    atomic.Int64
	running  atomic.Int64 // calls in progress
	peak     atomic.Int64 // most calls in progress at once
	down     atomic.Bool
	hang     atomic.Bool
	oom      atomic.Bool
	checking atomic.Bool
	suspects atomic.Int64
	stopped  atomic.Bool
	gate     chan struct{} // nil: answer at once
}

var (
	_ Member    = (*fakeMember)(nil)
	_ Suspecter = (*fakeMember)(nil)
)

func (f *fakeMember) Infer(ctx context.Context, req *InferRequest) (*InferResponse, error) {
	f.calls.Add(1)
	n := f.running.Add(1)
	defer f.running.Add(-1)
	for p := f.peak.Load(); n > p && !f.peak.CompareAndSwap(p, n); p = f.peak.Load() {
	}
	switch {
	case f.stopped.Load():
		return nil, errors.New("called after Stop")
	case f.hang.Load():
		<-ctx.Done()
		return nil, ctx.Err()
	case f.oom.Load():
		return nil, fmt.Errorf("%w: killed", ErrOutOfMemory)
	case f.down.Load():
		return nil, ErrUnavailable
	}
	if f.gate != nil {
		select {
		case <-f.gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return &InferResponse{Outputs: []Tensor{{Name: "id", DataType: Int32, Shape: []int64{1}, Data: []byte{byte(f.id), 0, 0, 0}}}}, nil
}

func (f *fakeMember) Status() (bool, string) {
	switch {
	case f.stopped.Load():
		return false, "stopped"
	case f.checking.Load():
		return false, "checking"
	case f.down.Load():
		return false, "down"
	}
	return true, ""
}

func (f *fakeMember) Stop(context.Context) error {
	f.stopped.Store(true)
	return nil
}

func (f *fakeMember) Suspect(string) {
	f.suspects.Add(1)
	f.checking.Store(true)
}

// answeredBy is the id of the member that answered resp.
func answeredBy(resp *InferResponse) int32 { return int32(resp.Outputs[0].Data[0]) }

// newTestPool returns a pool over n fake members (ids 0..n-1), stopped at
// the test's end, and counts its retries.
func newTestPool(t *testing.T, n int, opts PoolOptions) (*Pool, []*fakeMember, *atomic.Int64) {
	t.Helper()
	fakes := make([]*fakeMember, n)
	members := make([]Member, n)
	for i := range fakes {
		fakes[i] = &fakeMember{id: int32(i)}
		members[i] = fakes[i]
	}
	retries := new(atomic.Int64)
	opts.OnRetry = func() { retries.Add(1) }
	p, err := NewPool(members, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Stop(context.Background()) })
	return p, fakes, retries
}

func oneRow() *InferRequest {
	return &InferRequest{Inputs: []Tensor{{Name: "x", DataType: Int32, Shape: []int64{1}, Data: make([]byte, 4)}}}
}

func TestNewPoolNeedsAMember(t *testing.T) {
	if _, err := NewPool(nil, PoolOptions{}); err == nil {
		t.Error("a pool of no members was made")
	}
}

// A member that is down leaves the rotation; when every member is down the
// call fails with the members' error.
func TestPoolRetriesOnAnotherMember(t *testing.T) {
	p, fakes, retries := newTestPool(t, 2, PoolOptions{})
	fakes[0].down.Store(true)
	for range 4 {
		resp, err := p.Execute(t.Context(), oneRow())
		if err != nil {
			t.Fatalf("call failed although member 1 was healthy: %v", err)
		}
		if id := answeredBy(resp); id != 1 {
			t.Errorf("answered by member %d, want 1", id)
		}
	}
	fakes[1].down.Store(true)
	if _, err := p.Execute(t.Context(), oneRow()); !errors.Is(err, ErrUnavailable) {
		t.Errorf("every member down: err = %v, want ErrUnavailable", err)
	}
	if p.Ready() {
		t.Error("pool ready with every member down")
	}
	if retries.Load() == 0 {
		t.Error("no retry counted")
	}
}

// A hung member holds one call for the call timeout; the call is tried
// again on the other member, the hung one is told, leaves the rotation, and
// no later call goes to it until it serves again.
func TestPoolHungMemberLeavesRotation(t *testing.T) {
	const callTimeout = 50 * time.Millisecond
	p, fakes, retries := newTestPool(t, 2, PoolOptions{CallTimeout: callTimeout})
	fakes[0].hang.Store(true)
	var slowest time.Duration
	for range 20 {
		start := time.Now()
		if _, err := p.Execute(t.Context(), oneRow()); err != nil {
			t.Fatalf("call failed although member 1 was healthy: %v", err)
		}
		slowest = max(slowest, time.Since(start))
	}
	if got := fakes[0].calls.Load(); got != 1 {
		t.Errorf("the hung member got %d calls, want 1: it should leave the rotation after the first", got)
	}
	if got := fakes[0].suspects.Load(); got != 1 {
		t.Errorf("the hung member was told %d times, want 1", got)
	}
	if got := fakes[1].calls.Load(); got != 20 {
		t.Errorf("the healthy member got %d calls, want 20", got)
	}
	if got := retries.Load(); got != 1 {
		t.Errorf("retries = %d, want 1", got)
	}
	if slowest > callTimeout+time.Second {
		t.Errorf("slowest call took %v, want about the call timeout %v", slowest, callTimeout)
	}
	// Back in service once it checks out: its slot returns to the pool.
	fakes[0].hang.Store(false)
	fakes[0].checking.Store(false)
	deadline := time.Now().Add(5 * time.Second)
	for fakes[0].calls.Load() == 1 && time.Now().Before(deadline) {
		if _, err := p.Execute(t.Context(), oneRow()); err != nil {
			t.Fatal(err)
		}
	}
	if fakes[0].calls.Load() == 1 {
		t.Error("the member did not come back into rotation")
	}
}

// A request's own deadline bounds a call on a hung member even when the
// call timeout is long.
func TestPoolDeadlineBoundsHungCall(t *testing.T) {
	const callTimeout = time.Minute
	p, fakes, _ := newTestPool(t, 2, PoolOptions{CallTimeout: callTimeout})
	fakes[0].hang.Store(true)
	fakes[1].hang.Store(true)
	req := oneRow()
	req.Deadline = time.Now().Add(100 * time.Millisecond)
	start := time.Now()
	_, err := p.Execute(t.Context(), req)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v, want the deadline exceeded", err)
	}
	// What bounds the call is the deadline, not the call timeout (the
	// members never answer): a bound far from both, so that a busy
	// machine's scheduling delays do not matter.
	if took := time.Since(start); took < 100*time.Millisecond || took > callTimeout/4 {
		t.Errorf("the call returned after %v, want about its 100ms deadline, long before the %v call timeout", took, callTimeout)
	}
}

// A member killed for memory is not retried: the request would likely do
// the same to the other member.
func TestPoolOutOfMemoryNotRetried(t *testing.T) {
	p, fakes, retries := newTestPool(t, 2, PoolOptions{})
	fakes[0].oom.Store(true)
	fakes[1].oom.Store(true)
	_, err := p.Execute(t.Context(), oneRow())
	if !errors.Is(err, ErrOutOfMemory) || !errors.Is(err, ErrUnavailable) {
		t.Errorf("err = %v, want ErrOutOfMemory (an ErrUnavailable)", err)
	}
	if got := fakes[0].calls.Load() + fakes[1].calls.Load(); got != 1 {
		t.Errorf("%d calls for one request, want 1", got)
	}
	if retries.Load() != 0 {
		t.Errorf("retries = %d, want 0", retries.Load())
	}
}

// A member runs as many calls at once as it has slots, never more.
func TestPoolSlots(t *testing.T) {
	for _, slots := range []int{1, 3} {
		t.Run(fmt.Sprint(slots), func(t *testing.T) {
			p, fakes, _ := newTestPool(t, 1, PoolOptions{Slots: slots})
			if p.Slots() != slots {
				t.Errorf("Slots() = %d, want %d", p.Slots(), slots)
			}
			gate := make(chan struct{})
			fakes[0].gate = gate
			var wg sync.WaitGroup
			for range 5 {
				wg.Go(func() {
					if _, err := p.Execute(context.Background(), oneRow()); err != nil {
						t.Error(err)
					}
				})
			}
			deadline := time.Now().Add(2 * time.Second)
			for fakes[0].running.Load() < int64(slots) && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			time.Sleep(20 * time.Millisecond)
			if got := fakes[0].running.Load(); got != int64(slots) {
				t.Errorf("%d calls running at once on one member, want %d", got, slots)
			}
			close(gate)
			wg.Wait()
			if got := fakes[0].calls.Load(); got != 5 {
				t.Errorf("%d calls in all, want 5", got)
			}
			if got := fakes[0].peak.Load(); got != int64(slots) {
				t.Errorf("at most %d calls at once, want %d", got, slots)
			}
		})
	}
}

// Replace swaps a member under load: no call fails, the old member is
// stopped only after its last call, and later calls go to the new one.
func TestPoolReplaceLosesNoCall(t *testing.T) {
	var stops sync.Map
	p, fakes, _ := newTestPool(t, 2, PoolOptions{Slots: 2, Stop: func(ctx context.Context, m Member) {
		f := m.(*fakeMember)
		if f.running.Load() > 0 {
			t.Errorf("member %d stopped with %d calls running", f.id, f.running.Load())
		}
		stops.Store(f.id, true)
		_ = f.Stop(ctx)
	}})
	ctx, cancel := context.WithCancel(t.Context())
	var failed atomic.Int64
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for ctx.Err() == nil {
				if _, err := p.Execute(context.Background(), oneRow()); err != nil {
					failed.Add(1)
					t.Errorf("call during the swap: %v", err)
				}
			}
		})
	}
	time.Sleep(10 * time.Millisecond)
	fresh := &fakeMember{id: 7}
	if err := p.Replace(t.Context(), 0, func(context.Context) (Member, error) { return fresh, nil }); err != nil {
		t.Fatal(err)
	}
	if _, ok := stops.Load(int32(0)); !ok || !fakes[0].stopped.Load() {
		t.Error("the replaced member was not stopped")
	}
	if got := p.Members(); got[0] != Member(fresh) || got[1] != Member(fakes[1]) {
		t.Errorf("members after the swap = %v", got)
	}
	before := fresh.calls.Load()
	time.Sleep(20 * time.Millisecond)
	cancel()
	wg.Wait()
	if fresh.calls.Load() == before {
		t.Error("the new member took no calls after the swap")
	}
	if failed.Load() > 0 {
		t.Errorf("%d calls failed during the swap", failed.Load())
	}

	// A replacement that fails to start leaves the member serving.
	boom := errors.New("no room")
	if err := p.Replace(t.Context(), 1, func(context.Context) (Member, error) { return nil, boom }); !errors.Is(err, boom) {
		t.Errorf("failed replacement: err = %v", err)
	}
	if p.Members()[1] != Member(fakes[1]) || fakes[1].stopped.Load() {
		t.Error("a failed replacement touched the serving member")
	}
	if err := p.Replace(t.Context(), 2, func(context.Context) (Member, error) { return fresh, nil }); err == nil {
		t.Error("replaced a member the pool does not have")
	}
}

// Stop stops every member; a call waiting for a slot fails, and nothing is
// replaced afterwards.
func TestPoolStop(t *testing.T) {
	p, fakes, _ := newTestPool(t, 1, PoolOptions{})
	gate := make(chan struct{})
	fakes[0].gate = gate
	first := make(chan error, 1)
	go func() { _, err := p.Execute(context.Background(), oneRow()); first <- err }()
	for fakes[0].running.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	waiting := make(chan error, 1)
	go func() { _, err := p.Execute(context.Background(), oneRow()); waiting <- err }()
	dctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	if err := p.Drain(dctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Drain with a call held: %v, want the deadline", err)
	}
	p.Stop(t.Context())
	if err := <-waiting; !errors.Is(err, ErrPoolStopped) || !errors.Is(err, ErrUnavailable) {
		t.Errorf("a call waiting at Stop: %v, want ErrPoolStopped", err)
	}
	close(gate)
	<-first
	if !fakes[0].stopped.Load() {
		t.Error("member not stopped")
	}
	if err := p.Drain(t.Context()); err != nil {
		t.Errorf("Drain once idle: %v", err)
	}
	if err := p.Replace(t.Context(), 0, func(context.Context) (Member, error) { return &fakeMember{}, nil }); !errors.Is(err, ErrPoolStopped) {
		t.Errorf("Replace after Stop: %v, want ErrPoolStopped", err)
	}
}

// Swap returns at once; the swap starts the new member, switches to it and
// reports each state; a second Swap of the same member before the first
// switched supersedes it: the first start's context ends, a member it
// started anyway is stopped, and the second one serves.
func TestPoolSwapAsync(t *testing.T) {
	p, fakes, _ := newTestPool(t, 2, PoolOptions{})
	if _, ok := p.SwapStatus(0); ok {
		t.Error("a status before any swap")
	}

	// One swap, held in its start until released.
	release := make(chan struct{})
	fresh := &fakeMember{id: 5}
	outcome := make(chan error, 1)
	p.Swap(0, func(ctx context.Context) (Member, error) {
		<-release
		return fresh, nil
	}, func(err error) { outcome <- err })
	if st, _ := p.SwapStatus(0); st.State != SwapStarting {
		t.Errorf("state while starting = %q", st.State)
	}
	if _, err := p.Execute(t.Context(), oneRow()); err != nil {
		t.Errorf("a call while the swap starts: %v", err)
	}
	close(release)
	if err := <-outcome; err != nil {
		t.Fatalf("swap: %v", err)
	}
	if st, _ := p.SwapStatus(0); st.State != SwapDone || st.Err != nil {
		t.Errorf("status after the swap = %+v", st)
	}
	if p.Members()[0] != Member(fresh) || !fakes[0].stopped.Load() {
		t.Error("member 0 not replaced, or the old one not stopped")
	}

	// A swap superseded while it starts: its start honours the context.
	first := make(chan error, 1)
	started := make(chan struct{})
	p.Swap(1, func(ctx context.Context) (Member, error) {
		close(started)
		<-ctx.Done()
		return nil, ctx.Err()
	}, func(err error) { first <- err })
	<-started
	second := make(chan error, 1)
	latest := &fakeMember{id: 6}
	p.Swap(1, func(context.Context) (Member, error) { return latest, nil }, func(err error) { second <- err })
	if err := <-first; !errors.Is(err, ErrSuperseded) {
		t.Errorf("the superseded swap: %v, want ErrSuperseded", err)
	}
	if err := <-second; err != nil {
		t.Fatalf("the superseding swap: %v", err)
	}
	if p.Members()[1] != Member(latest) {
		t.Error("the superseding swap's member does not serve")
	}

	// A superseded start that returns a member anyway: that member is
	// stopped, never switched in.
	stubborn := &fakeMember{id: 8}
	third := make(chan error, 1)
	hold, entered := make(chan struct{}), make(chan struct{})
	p.Swap(1, func(context.Context) (Member, error) { close(entered); <-hold; return stubborn, nil }, func(err error) { third <- err })
	<-entered
	p.Swap(1, func(context.Context) (Member, error) { return &fakeMember{id: 9}, nil }, nil)
	close(hold)
	if err := <-third; !errors.Is(err, ErrSuperseded) {
		t.Errorf("the stubborn swap: %v, want ErrSuperseded", err)
	}
	if !stubborn.stopped.Load() {
		t.Error("a member started for a superseded swap was not stopped")
	}
	// The member serves from the switch on; the swap is done once the
	// old one's slots came back and it stopped: wait for both.
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if st, _ := p.SwapStatus(1); st.State == SwapDone && p.Members()[1].(*fakeMember).id == 9 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	if st, _ := p.SwapStatus(1); st.State != SwapDone || p.Members()[1].(*fakeMember).id != 9 {
		t.Errorf("after the last swap: status %+v, member %d", st, p.Members()[1].(*fakeMember).id)
	}

	// Stop ends a swap still starting.
	stopped := make(chan error, 1)
	p.Swap(0, func(ctx context.Context) (Member, error) { <-ctx.Done(); return nil, ctx.Err() }, func(err error) { stopped <- err })
	p.Stop(t.Context())
	if err := <-stopped; !errors.Is(err, ErrPoolStopped) {
		t.Errorf("a swap pending at Stop: %v, want ErrPoolStopped", err)
	}
	if st, _ := p.SwapStatus(0); st.State != SwapFailed {
		t.Errorf("state of a swap ended by Stop = %q", st.State)
	}
}

// BenchmarkPoolExecute is the pool's own cost per call on members that
// answer at once: picking a slot, the call timeout, putting it back.
func BenchmarkPoolExecute(b *testing.B) {
	for _, members := range []int{1, 4} {
		b.Run(fmt.Sprintf("members=%d", members), func(b *testing.B) {
			ms := make([]Member, members)
			for i := range ms {
				ms[i] = &fakeMember{id: int32(i)}
			}
			p, err := NewPool(ms, PoolOptions{Slots: 2})
			if err != nil {
				b.Fatal(err)
			}
			defer p.Stop(context.Background())
			req := oneRow()
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := p.Execute(context.Background(), req); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
