package qos

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"
)

// A latency-critical batch grows past its head only while the grown batch
// ends by the head's deadline with room for its execution's error. The
// model's executions take 1.5x their prediction (10 ms a row predicted,
// 15 ms taken), so after a window of them admission's room for a 20 ms
// batch is about 10 ms. A head with 40 ms to its deadline waits behind a
// running execution until 15 ms; a request arrives behind it. On the mean
// the two fit one batch (15 + 20 = 35 ms); with the room they do not
// (45 ms), and the batch of two, taking 30 ms, would end the head at 45 ms,
// late. Run alone, the head ends at 30 ms, and the second request, whose
// deadline is the SLO's 100 ms, at 45 ms: both on time.
func TestBatchGrowsWithRoomForError(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h, ctx := slowerThanPredicted(t)
		h.s.mu.Lock()
		room := h.s.models["a"].room(20 * ms)
		h.s.mu.Unlock()
		if room < 5*ms {
			t.Fatalf("room for 20 ms predicted is %v after executions 1.5x their prediction, want about 10 ms", room)
		}

		start := time.Now()
		running := h.submit(ctx, "a", RequestOptions{}, 1000)
		head := h.submit(ctx, "a", RequestOptions{Deadline: start.Add(40 * ms)}, 1001)
		behind := h.submit(ctx, "a", RequestOptions{}, 1002)
		mustSucceed(t, running, head, behind)

		calls := h.rec.snapshot()
		var got []string
		for _, c := range calls[len(calls)-3:] {
			got = append(got, c.String())
		}
		st, _ := h.s.Stats("a")
		if st.Late != 0 {
			t.Errorf("%d late (executions %v), want none: the head's batch should not grow past its room", st.Late, got)
		}
		if n := len(calls[len(calls)-2].ids); n != 1 {
			t.Errorf("the head ran in a batch of %d (executions %v), want it alone", n, got)
		}
	})
}

// Admission plays the queue with the dispatcher's rule. Behind the same
// running execution (predicted to end at 10 ms, ending at 15), a head due
// at 35 ms and a request due at 36 ms: on the mean the two would share a
// batch ending at 30 ms, so a play that grew batches on the mean admitted
// the second, which the dispatcher, leaving room, then runs after the head
// and drops when its deadline can no longer be met. Played with the room,
// it runs after the head, with a batch ahead of it and its own room, past
// 36 ms: refused at once, not admitted and dropped.
func TestAdmissionPlaysBatchesWithRoom(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h, ctx := slowerThanPredicted(t)
		start := time.Now()
		running := h.submit(ctx, "a", RequestOptions{}, 1000)
		head := h.submit(ctx, "a", RequestOptions{Deadline: start.Add(35 * ms)}, 1001)
		second := h.submit(ctx, "a", RequestOptions{Deadline: start.Add(36 * ms)}, 1002)
		mustSucceed(t, running, head)
		if err := second.wait(t); !errors.Is(err, ErrRejected) {
			t.Errorf("the second request: %v, want it refused at admission (%v)", err, ErrRejected)
		}
		if st, _ := h.s.Stats("a"); st.Dropped+st.Late != 0 {
			t.Errorf("%d dropped and %d late, want none: admission should not admit what the dispatcher cannot run in time", st.Dropped, st.Late)
		}
	})
}

// slowerThanPredicted is a harness with one latency-critical model "a"
// (SLO 100 ms, batches up to 4) whose executions take 1.5x their
// prediction (10 ms a row predicted, 15 taken), after a window of them:
// admission's room for error has read them. Call it inside synctest.
func slowerThanPredicted(t *testing.T) (*harness, context.Context) {
	h := newHarness(t, Options{Estimator: fixedEstimator(10 * ms)})
	h.model(ModelSpec{Name: "a", Class: lc, SLO: 100 * ms, MaxBatchSize: 4, QueueCapacity: 10},
		func(ids []int64) time.Duration { return 15 * ms * time.Duration(len(ids)) })
	h.run()
	ctx := t.Context()
	for id := range int64(minTail + tailRefresh) {
		mustSucceed(t, h.submit(ctx, "a", RequestOptions{}, id+1))
	}
	return h, ctx
}
