package qos

import (
	"context"
	"runtime/debug"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

// stackExecutor notes, per request id, whether it ran on the goroutine of
// the Submit that brought it; it takes 10 ms.
type stackExecutor struct {
	mu     sync.Mutex
	inline map[int64]bool
}

func (x *stackExecutor) Execute(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
	inline := strings.Contains(string(debug.Stack()), "qos.(*Scheduler).Submit")
	x.mu.Lock()
	for _, id := range decodeIDs(req.Inputs[0]) {
		x.inline[id] = inline
	}
	x.mu.Unlock()
	select {
	case <-time.After(10 * ms):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	var tens []int64
	for _, id := range decodeIDs(req.Inputs[0]) {
		tens = append(tens, 10*id)
	}
	out := idTensor(tens...)
	out.Name = "y"
	return &runtime.InferResponse{Outputs: []runtime.Tensor{out}}, nil
}

// A request that finds nothing queued and a slot free runs on the caller's
// goroutine, with no handoff to the dispatcher; one that has to wait goes
// through the dispatcher, as before.
func TestIdleRequestRunsOnCallersGoroutine(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{DeviceSlots: 1})
		x := &stackExecutor{inline: map[int64]bool{}}
		if err := h.s.AddModel(ModelSpec{Name: "m", Executor: x}); err != nil {
			t.Fatal(err)
		}
		h.run()
		ctx := t.Context()
		first := h.submit(ctx, "m", RequestOptions{}, 1)  // idle: inline
		second := h.submit(ctx, "m", RequestOptions{}, 2) // the slot is busy: queued
		mustSucceed(t, first, second)
		third := h.submit(ctx, "m", RequestOptions{}, 3) // idle again
		mustSucceed(t, third)
		want := map[int64]bool{1: true, 2: false, 3: true}
		for id, inline := range want {
			if x.inline[id] != inline {
				t.Errorf("request %d ran on its caller's goroutine: %v, want %v", id, x.inline[id], inline)
			}
		}
		if st, _ := h.s.Stats("m"); st.Good != 3 {
			t.Errorf("stats = %+v", st)
		}
	})
}

// Before Run dispatches, a request waits in the queue even when idle.
func TestIdleRequestWaitsForRun(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		x := &stackExecutor{inline: map[int64]bool{}}
		if err := h.s.AddModel(ModelSpec{Name: "m", Executor: x}); err != nil {
			t.Fatal(err)
		}
		p := h.submit(t.Context(), "m", RequestOptions{}, 1)
		if st, _ := h.s.Stats("m"); st.QueueDepth != 1 {
			t.Fatalf("queue depth %d before Run, want 1", st.QueueDepth)
		}
		h.run()
		mustSucceed(t, p)
		if x.inline[1] {
			t.Error("a request queued before Run ran on its caller's goroutine")
		}
	})
}
