package runtime

import (
	"math"
	goruntime "runtime"
	"sync/atomic"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// leanAnswers plays a runner's worker that allocates nothing: it polls the
// mailbox for posted slots and answers each with answer, its id set to
// the request's, until stop is closed. What a call allocates is then the
// server's side alone.
func leanAnswers(m mailboxMem, answer *runnerpb.InferResponse, stop chan struct{}) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		for i := range m.slots {
			if !atomic.CompareAndSwapUint32(m.state(i), slotPosted, slotTaken) {
				continue
			}
			// Stamped as a real worker does at take: a slot answered with
			// no take time adds minus a Unix time to the process's take
			// total and plus one to its answer total.
			atomic.StoreInt64(m.takenAt(i), monoNanos())
			var id uint64
			_ = forEachField(m.reqArea(i)[:atomic.LoadUint32(m.reqLen(i))], func(num protowire.Number, typ protowire.Type, _ []byte, x uint64) error {
				if num == 3 && typ == protowire.VarintType {
					id = x
				}
				return nil
			})
			answer.Id = id
			b, err := proto.MarshalOptions{}.MarshalAppend(m.respArea(i)[:0], answer)
			if err != nil {
				panic(err)
			}
			atomic.StoreUint32(m.respLen(i), uint32(len(b)))
			atomic.StoreInt64(m.answeredAt(i), monoNanos())
			atomic.StoreUint32(m.state(i), slotAnswered)
			if atomic.LoadUint32(m.waiting(i)) != 0 {
				futexWake(m.state(i), math.MaxInt32)
			}
		}
		goruntime.Gosched()
	}
}

// A call through the mailbox allocates, on the server's side, only its
// answer (one allocation for the usual answer of one output): the reply
// channel is reused, and a caller that polls registers nothing on its
// context. It took nine (a channel, seven for proto.Unmarshal, and the
// context's wake-up).
func TestMailboxCallAllocations(t *testing.T) {
	spinQuietUntil.Store(0)
	rig := newMailboxRig(t, 4, 1, echo)
	rig.workers.stop() // the lean worker answers instead
	stop := make(chan struct{})
	done := make(chan struct{})
	answer := &runnerpb.InferResponse{InferNs: 5, Outputs: []*runnerpb.Tensor{
		{Name: "output_scalars", Datatype: "FP32", Shape: []int64{1}, Arena: &runnerpb.ArenaSlice{Offset: 64, Length: 4}}}}
	go func() {
		defer close(done)
		leanAnswers(rig.box.mailboxMem, answer, stop)
	}()
	t.Cleanup(func() {
		close(stop)
		<-done
	})
	rig.box.spin = wideSpin
	req := &runnerpb.InferRequest{Inputs: []*runnerpb.Tensor{{Name: "x", Datatype: "FP32", Shape: []int64{1, 10}, Arena: &runnerpb.ArenaSlice{Offset: 0, Length: 40}}}}
	var call pendingCall
	one := func() {
		call = pendingCall{}
		resp, err := rig.c.call(t.Context(), req, &call)
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetId() != req.GetId() || resp.GetOutputs()[0].GetName() != "output_scalars" || resp.GetInferNs() != 5 {
			t.Fatalf("answer %v to call %d", resp, req.GetId())
		}
	}
	for range 20 {
		one() // learn to poll
	}
	if n := testing.AllocsPerRun(200, one); n > 1.1 {
		t.Errorf("a call through the mailbox allocates %v times on the server's side, want 1", n)
	}
	if got := rig.box.stats.caught.Load(); got < 100 {
		t.Errorf("only %d calls caught their answer polling", got)
	}
	if n := rig.socketCalls.Load(); n != 0 {
		t.Errorf("%d calls on the socket, want 0", n)
	}
}
