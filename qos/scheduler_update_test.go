package qos

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

// A reload swaps the executor: queued requests stay and run on the new one.
func TestUpdateModelSwapsExecutor(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, err := NewScheduler(Options{DeviceSlots: 1})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- s.Run(ctx) }()

		var oldCalls, newCalls atomic.Int64
		slow := ExecutorFunc(func(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
			oldCalls.Add(1)
			time.Sleep(10 * time.Millisecond)
			return &runtime.InferResponse{}, nil
		})
		fresh := ExecutorFunc(func(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
			newCalls.Add(1)
			time.Sleep(10 * time.Millisecond)
			return &runtime.InferResponse{}, nil
		})
		if err := s.AddModel(ModelSpec{Name: "m/1", Executor: slow}); err != nil {
			t.Fatal(err)
		}
		results := make(chan error, 3)
		for range 3 {
			go func() {
				_, err := s.Submit(context.Background(), "m/1", &runtime.InferRequest{}, RequestOptions{})
				results <- err
			}()
		}
		synctest.Wait() // one running on the old executor, two queued
		if err := s.UpdateModel(ModelSpec{Name: "m/1", Executor: fresh, Class: ClassLatencyCritical, SLO: time.Second}); err != nil {
			t.Fatal(err)
		}
		for range 3 {
			if err := <-results; err != nil {
				t.Fatal(err)
			}
		}
		if oldCalls.Load() != 1 || newCalls.Load() != 2 {
			t.Errorf("old executor ran %d, new %d; want 1 and 2", oldCalls.Load(), newCalls.Load())
		}
		if err := s.UpdateModel(ModelSpec{Name: "nope", Executor: fresh}); !errors.Is(err, ErrUnknownModel) {
			t.Errorf("updating an unknown model: %v", err)
		}
		if !s.HasModel("m/1") || s.HasModel("nope") {
			t.Error("HasModel is wrong")
		}
		cancel()
		<-done
	})
}

func TestTypicalBatch(t *testing.T) {
	for _, tc := range []struct {
		max    int
		recent float64
		want   int
	}{
		{8, 0, 8},     // never ran: assume full batches
		{8, 2.4, 2},   // recent executions averaged 2.4 rows
		{8, 2.6, 3},   // rounded
		{8, 0.2, 1},   // at least 1
		{8, 12, 8},    // at most the maximum
		{0, 3, 1},     // no batching
		{4, 3.49, 3},  // rounding down
		{4, 3.5, 4},   // rounding up
		{16, 16, 16},  // full
		{16, 1.0, 1},  // light load
		{2, 1.99, 2},  // near the top
		{1, 0.5, 1},   // max 1
		{8, 7.5, 8},   // rounds to 8
		{8, 7.49, 7},  // rounds to 7
		{8, 1e-9, 1},  // tiny
		{8, 8.0, 8},   // exact
		{3, 2.0, 2},   // exact
		{3, 2.5, 3},   // half up
		{3, 1.49, 1},  // half down
		{100, 50, 50}, // large
	} {
		m := &model{spec: ModelSpec{MaxBatchSize: tc.max}, recentBatch: tc.recent}
		if got := m.typicalBatch(); got != tc.want {
			t.Errorf("max %d recent %v: typical batch %d, want %d", tc.max, tc.recent, got, tc.want)
		}
	}
}

// Admission plays the model's own queue forward as the dispatcher will
// batch it (playOwnLocked); where it cannot (requests of several shapes)
// it assumes the queued work ahead runs in batches of the size the model's
// executions recently had, not full ones.
func TestAdmissionUsesRecentBatchSizes(t *testing.T) {
	for _, mixed := range []bool{false, true} {
		t.Run(fmt.Sprintf("mixed=%v", mixed), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) { admissionRecentBatches(t, mixed) })
		})
	}
}

func admissionRecentBatches(t *testing.T, mixed bool) {
	h := newHarness(t, Options{DeviceSlots: 1})
	// 10ms + 5ms per row: a batch of 4 takes 30ms, four batches of 1 take 60ms.
	took := func(ids []int64) time.Duration { return 10*ms + time.Duration(len(ids))*5*ms }
	h.model(ModelSpec{Name: "m", Class: lc, SLO: time.Second, MaxBatchSize: 8}, took)
	h.run()
	ctx := t.Context()
	// Seed the estimates and the recent batch size (1) with single runs.
	for i := range int64(4) {
		mustSucceed(t, h.submit(ctx, "m", RequestOptions{}, 100+i))
	}
	for b := 2; b <= 8; b++ {
		h.s.est.Observe("m", b, 10*ms+time.Duration(b)*5*ms)
	}
	t0 := time.Since(h.rec.start)
	blocker := h.submit(ctx, "m", RequestOptions{}, 1) // runs 15ms
	synctest.Wait()
	var queued []*pending
	for i := range int64(3) {
		req := idRequest(2 + i)
		if mixed { // another shape: merged with each other, not with r
			req.Inputs = append(req.Inputs, runtime.Tensor{Name: "z", DataType: runtime.Int64, Shape: []int64{1}, Data: make([]byte, 8)})
		}
		queued = append(queued, h.submitRequest(ctx, "m", RequestOptions{Deadline: time.Now().Add(65 * ms)}, req))
	}
	r := h.submit(ctx, "m", RequestOptions{Deadline: time.Now().Add(70 * ms)}, 9)
	<-r.done
	if !mixed {
		// The dispatcher runs the three and r in one batch of 4 when the
		// blocker ends: 15 + 30 = 45ms.
		if r.err != nil {
			t.Errorf("one shape: %v, want admitted (15ms + a batch of 4, 30ms)", r.err)
		}
		if at := r.at - t0; at != 45*ms {
			t.Errorf("one shape: answered at %s, want 45ms", at)
		}
	} else {
		// They go before r (earlier deadlines). Ahead of r: 15ms running + 3 x 15ms (batches of 1) = 60ms; r 15ms:
		// 75ms > 70ms. With full batches it would have been 15 + 30 = 45ms.
		if !errors.Is(r.err, ErrRejected) || !strings.Contains(r.err.Error(), "by 5.0ms") {
			t.Errorf("several shapes: got %v, want rejected by 5.0ms", r.err)
		}
	}
	mustSucceed(t, append(queued, blocker)...)
}
