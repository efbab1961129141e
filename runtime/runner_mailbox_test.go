package runtime

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// mailboxRig is a callStream with a mailbox of real shared memory (a
// memfd, as a runner's) and a socket pair, and the runner's side played in
// this process: mailbox workers and a socket reader that answer with
// answer. socketCalls counts the calls that came on the socket.
type mailboxRig struct {
	c           *callStream
	box         *mailbox
	runner      net.Conn
	workers     *mailboxWorkers
	socketCalls atomic.Int64
	abandoned   chan *pendingCall
	brokenWith  chan error
}

func newMailboxRig(t *testing.T, slots, workers int, answer func(*runnerpb.InferRequest) *runnerpb.InferResponse) *mailboxRig {
	t.Helper()
	return newMailboxRigSpin(t, slots, workers, answer, spinPolicy{}, nil)
}

// newMailboxRigSpin is newMailboxRig with workers that poll by spin and
// see the idle class as idleClass says (nil: as the thread is).
func newMailboxRigSpin(t *testing.T, slots, workers int, answer func(*runnerpb.InferRequest) *runnerpb.InferResponse, spin spinPolicy, idleClass func() bool) *mailboxRig {
	t.Helper()
	ar, err := newArena("test", 4096, slots)
	if err != nil {
		t.Fatal(err)
	}
	ar.file.Close()
	mine, theirs, err := newCallPair()
	if err != nil {
		t.Fatal(err)
	}
	runner, err := net.FileConn(theirs)
	theirs.Close()
	if err != nil {
		t.Fatal(err)
	}
	rig := &mailboxRig{box: ar.box, runner: runner, abandoned: make(chan *pendingCall, 100), brokenWith: make(chan error, 1)}
	rig.c = openStream(mine, ar.box, func(call *pendingCall) { rig.abandoned <- call }, func(err error) { rig.brokenWith <- err })
	w := &frameWriter{conn: runner}
	rig.workers = &mailboxWorkers{
		mailboxMem: ar.box.mailboxMem,
		answer:     answer,
		onSocket:   func(resp *runnerpb.InferResponse) error { return w.write(resp) },
		spin:       spin,
		idleClass:  idleClass,
	}
	rig.workers.start(workers)
	go func() {
		fr := newFrameReader(runner)
		for {
			req := &runnerpb.InferRequest{}
			if err := fr.next(req); err != nil {
				return
			}
			rig.socketCalls.Add(1)
			go func() {
				resp := answer(req)
				resp.Id = req.GetId()
				_ = w.write(resp)
			}()
		}
	}()
	t.Cleanup(func() {
		runner.Close()
		rig.c.close()
		rig.workers.stop()
		ar.close()
	})
	return rig
}

// echo answers a call with one output named after the call's first input
// and holding its data.
func echo(req *runnerpb.InferRequest) *runnerpb.InferResponse {
	in := req.GetInputs()[0]
	return &runnerpb.InferResponse{Outputs: []*runnerpb.Tensor{{Name: "echo-" + in.GetName(), Datatype: "UINT8", Shape: []int64{int64(len(in.GetData()))}, Data: in.GetData()}}}
}

// echoCall sends a call with input name and data and checks the echo.
func echoCall(ctx context.Context, c *callStream, name string, data []byte) error {
	resp, err := c.call(ctx, &runnerpb.InferRequest{Inputs: []*runnerpb.Tensor{{Name: name, Datatype: "UINT8", Shape: []int64{int64(len(data))}, Data: data}}}, &pendingCall{})
	if err != nil {
		return err
	}
	if len(resp.GetOutputs()) != 1 || resp.GetOutputs()[0].GetName() != "echo-"+name || string(resp.GetOutputs()[0].GetData()) != string(data) {
		return fmt.Errorf("call %s answered %v", name, resp)
	}
	return nil
}

// freeSlots is how many slots no call holds.
func (m *mailbox) freeSlots() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.free)
}

// Calls that fit cross in the mailbox, none on the socket; the doorbell
// wraps around its 32 bits and every slot is reused many times over.
func TestMailboxCallsCrossWithoutTheSocket(t *testing.T) {
	const slots = 4
	rig := newMailboxRig(t, slots, 1, echo)
	// The doorbell a few rings from wrapping.
	*rig.box.doorbell() = math.MaxUint32 - 3
	for i := range 25 * slots {
		if err := echoCall(t.Context(), rig.c, fmt.Sprint("x", i), []byte(fmt.Sprint("data", i))); err != nil {
			t.Fatal(err)
		}
	}
	if n := rig.socketCalls.Load(); n != 0 {
		t.Errorf("%d calls came on the socket, want 0", n)
	}
	if got := *rig.box.doorbell(); got != 25*slots-4 {
		t.Errorf("doorbell %d after %d calls from MaxUint32-3, want %d", got, 25*slots, 25*slots-4)
	}
	if n := rig.box.freeSlots(); n != slots {
		t.Errorf("%d free slots after the calls, want %d", n, slots)
	}
}

// A full mailbox sends the next call on the socket; a request or an
// answer too large for a slot travels on the socket too.
func TestMailboxFullOrTooLargeGoesOnTheSocket(t *testing.T) {
	gate := make(chan struct{})
	var held atomic.Int64
	rig := newMailboxRig(t, 2, 2, func(req *runnerpb.InferRequest) *runnerpb.InferResponse {
		if strings.HasPrefix(req.GetInputs()[0].GetName(), "held") {
			held.Add(1)
			<-gate
		}
		return echo(req)
	})
	errs := make(chan error, 2)
	for i := range 2 {
		go func() { errs <- echoCall(t.Context(), rig.c, fmt.Sprint("held", i), []byte{byte(i)}) }()
	}
	waitFor(t, 10*time.Second, "both slots taken", func() bool { return held.Load() == 2 })
	if err := echoCall(t.Context(), rig.c, "third", []byte("over the socket")); err != nil {
		t.Fatal(err)
	}
	if n := rig.socketCalls.Load(); n != 1 {
		t.Errorf("%d calls on the socket with the mailbox full, want 1", n)
	}
	close(gate)
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	// A request larger than a slot.
	big := make([]byte, mailboxArea+1)
	if err := echoCall(t.Context(), rig.c, "big-request", big); err != nil {
		t.Fatal(err)
	}
	if n := rig.socketCalls.Load(); n != 2 {
		t.Errorf("%d calls on the socket after a large request, want 2", n)
	}
	// An answer larger than a slot: the request fits, its echo does not.
	rig2 := newMailboxRig(t, 2, 1, func(req *runnerpb.InferRequest) *runnerpb.InferResponse {
		resp := echo(req)
		resp.Message = strings.Repeat("m", mailboxArea)
		return resp
	})
	for i := range 5 {
		if err := echoCall(t.Context(), rig2.c, fmt.Sprint("y", i), []byte("small")); err != nil {
			t.Fatal(err)
		}
	}
	if n := rig2.socketCalls.Load(); n != 0 {
		t.Errorf("%d requests on the socket, want 0 (only the answers)", n)
	}
	if n := rig2.box.freeSlots(); n != 2 {
		t.Errorf("%d free slots after answers on the socket, want 2", n)
	}
}

// Many callers at once, more than the slots and the workers: every call
// gets its own answer, whichever way it went.
func TestMailboxConcurrentCallers(t *testing.T) {
	rig := newMailboxRig(t, 4, 2, func(req *runnerpb.InferRequest) *runnerpb.InferResponse {
		if rand.IntN(4) == 0 {
			time.Sleep(time.Duration(rand.IntN(200)) * time.Microsecond)
		}
		return echo(req)
	})
	const callers, calls = 8, 200
	var wg sync.WaitGroup
	errs := make(chan error, callers)
	for g := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range calls {
				if err := echoCall(t.Context(), rig.c, fmt.Sprintf("g%d-%d", g, i), []byte(fmt.Sprint(g*calls+i))); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := rig.box.freeSlots(); n != 4 {
		t.Errorf("%d free slots after the calls, want 4", n)
	}
	t.Logf("%d of %d calls went on the socket", rig.socketCalls.Load(), callers*calls)
}

// A runner that dies while calls wait in the mailbox fails them with
// codes.Unavailable as soon as its connection ends, and the stream takes
// no more calls. The calls' wait is measured against how long a call
// takes when the runner answers.
func TestMailboxPeerDeathWhileWaiting(t *testing.T) {
	var stuck atomic.Int64
	release := make(chan struct{})
	rig := newMailboxRig(t, 4, 2, func(req *runnerpb.InferRequest) *runnerpb.InferResponse {
		if req.GetInputs()[0].GetName() == "stuck" {
			stuck.Add(1)
			<-release // the runner never answers: it dies
		}
		return echo(req)
	})
	t.Cleanup(func() { close(release) }) // before the rig's: its workers end
	start := time.Now()
	if err := echoCall(t.Context(), rig.c, "live", []byte("ok")); err != nil {
		t.Fatal(err)
	}
	baseline := time.Since(start)
	type result struct {
		err error
		at  time.Time
	}
	results := make(chan result, 3)
	for range 3 { // two taken by the workers, one posted and not taken
		go func() {
			err := echoCall(t.Context(), rig.c, "stuck", []byte("x"))
			results <- result{err, time.Now()}
		}()
	}
	waitFor(t, 10*time.Second, "the workers stuck", func() bool { return stuck.Load() == 2 })
	waitFor(t, 10*time.Second, "three calls in the mailbox", func() bool { return rig.box.freeSlots() == 1 })
	died := time.Now()
	rig.runner.Close() // what the kernel does when the runner dies
	for range 3 {
		res := <-results
		if status.Code(res.err) != codes.Unavailable {
			t.Errorf("call waiting on a dead runner: %v, want Unavailable", res.err)
		}
		// Woken by the broken stream, not by the recheck timer or a
		// deadline: within a few baselines and well under the recheck.
		if d := res.at.Sub(died); d > max(20*baseline, mailboxRecheck/2) {
			t.Errorf("call failed %v after the runner died (a live call takes %v)", d, baseline)
		}
	}
	if err := <-rig.brokenWith; err == nil {
		t.Error("stream broke without a cause")
	}
	if err := echoCall(t.Context(), rig.c, "after", []byte("x")); status.Code(err) != codes.Unavailable {
		t.Errorf("call after the runner died: %v, want Unavailable", err)
	}
}

// A caller whose context ends returns at once; the runner's late answer
// then frees the call's slot and what the call held (onAbandoned).
func TestMailboxAbandonedCall(t *testing.T) {
	gate := make(chan struct{})
	taken := make(chan struct{}, 1)
	rig := newMailboxRig(t, 2, 1, func(req *runnerpb.InferRequest) *runnerpb.InferResponse {
		if req.GetInputs()[0].GetName() == "slow" {
			taken <- struct{}{}
			<-gate
		}
		return echo(req)
	})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	call := &pendingCall{slot: 4242, hasSlot: true}
	go func() {
		_, err := rig.c.call(ctx, &runnerpb.InferRequest{Inputs: []*runnerpb.Tensor{{Name: "slow"}}}, call)
		done <- err
	}()
	<-taken
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("abandoned call: %v, want context.Canceled", err)
	}
	if n := rig.box.freeSlots(); n != 1 {
		t.Errorf("%d free slots while the runner still runs the abandoned call, want 1", n)
	}
	select {
	case c := <-rig.abandoned:
		t.Fatalf("call %v disposed of before the runner answered", c)
	default:
	}
	close(gate)
	select {
	case c := <-rig.abandoned:
		if c.slot != 4242 {
			t.Errorf("onAbandoned for %+v, want the abandoned call", c)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the late answer was never disposed of")
	}
	waitFor(t, 10*time.Second, "the slot free again", func() bool { return rig.box.freeSlots() == 2 })
	if err := echoCall(t.Context(), rig.c, "next", []byte("y")); err != nil {
		t.Fatal(err)
	}
}

// A runner that answers in a slot with another call's id, or a length
// over the slot, breaks the protocol: the call fails with Unavailable and
// the stream ends, as for an unknown id on the socket.
func TestMailboxBadAnswerEndsTheStream(t *testing.T) {
	for _, tt := range []struct {
		name  string
		spoil func(m *mailbox, i int)
		want  string
	}{
		{"wrong id", func(m *mailbox, i int) {
			b, err := proto.Marshal(&runnerpb.InferResponse{Id: 999})
			if err != nil {
				panic(err)
			}
			copy(m.respArea(i), b)
			atomic.StoreUint32(m.respLen(i), uint32(len(b)))
		}, "runner answered call 999 in the slot of call"},
		{"length over the slot", func(m *mailbox, i int) {
			atomic.StoreUint32(m.respLen(i), mailboxArea+1)
		}, "over the slot"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rig := newMailboxRig(t, 2, 1, echo)
			// The runner's side answers by hand instead of its workers.
			rig.workers.stop()
			go func() {
				for {
					i, ok := rig.workers.take(0)
					if !ok {
						time.Sleep(time.Millisecond)
						continue
					}
					tt.spoil(rig.box, i)
					atomic.StoreUint32(rig.box.state(i), slotAnswered)
					rig.box.wake(i)
					return
				}
			}()
			err := echoCall(t.Context(), rig.c, "x", []byte("y"))
			if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("call answered badly: %v, want Unavailable naming %q", err, tt.want)
			}
			if err := <-rig.brokenWith; !strings.Contains(fmt.Sprint(err), tt.want) {
				t.Errorf("stream broke with %v, want %q", err, tt.want)
			}
		})
	}
}

// The slots a runner has not answered are dropped when the stream breaks,
// so that neither side waits on them; answered ones keep their answer.
func TestMailboxDropKeepsAnswers(t *testing.T) {
	ar, err := newArena("test", 4096, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer ar.close()
	m := ar.box
	states := []uint32{slotPosted, slotTaken, slotAnswered, slotFree}
	for i, s := range states {
		*m.state(i) = s
	}
	m.drop()
	var got []uint32
	for i := range states {
		got = append(got, *m.state(i))
	}
	if want := []uint32{slotDropped, slotDropped, slotAnswered, slotFree}; !slices.Equal(got, want) {
		t.Errorf("states after drop %v, want %v", got, want)
	}
}

// The slot's three stamps split each call's wait into the worker's
// coming, the run and the caller's coming (mailboxStats): with a run of
// known length, the runs add up to at least that length a call, and the
// three parts, none negative, to no more than the callers waited.
func TestMailboxStampsSplitTheWait(t *testing.T) {
	const run = 2 * time.Millisecond
	rig := newMailboxRig(t, 4, 1, func(req *runnerpb.InferRequest) *runnerpb.InferResponse {
		for t0 := time.Now(); time.Since(t0) < run; {
		}
		return echo(req)
	})
	const calls = 20
	var waited time.Duration
	for i := range calls {
		t0 := time.Now()
		if err := echoCall(t.Context(), rig.c, "x", []byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
		waited += time.Since(t0)
	}
	st := rig.box.stats
	if n := st.calls.Load(); n != calls {
		t.Fatalf("%d calls counted, want %d", n, calls)
	}
	toTake, toAnswer, toSeen := time.Duration(st.toTake.Load()), time.Duration(st.toAnswer.Load()), time.Duration(st.toSeen.Load())
	t.Logf("a call: worker's coming %v, run %v, caller's coming %v; waited %v",
		toTake/calls, toAnswer/calls, toSeen/calls, waited/calls)
	if toTake < 0 || toSeen < 0 {
		t.Errorf("a negative part: worker's coming %v, caller's coming %v in all", toTake, toSeen)
	}
	if toAnswer < calls*run {
		t.Errorf("runs of %v in all, want at least %v (%d runs of %v)", toAnswer, calls*run, calls, run)
	}
	if sum := toTake + toAnswer + toSeen; sum > waited {
		t.Errorf("the parts add up to %v, over the %v the callers waited", sum, waited)
	}
}
