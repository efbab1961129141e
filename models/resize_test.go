package models

import (
	"fmt"
	"slices"
	"testing"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/runtime"
)

// RequestShare returns while the replacement starts; the version serves at
// its old share meanwhile; a second request supersedes the first, whose
// replacement is stopped and its unit released; the share is recorded once
// the last replacement has switched.
func TestRequestShareSwapsInTheBackground(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
	lim := newFakeLimiter(2)
	lim.restart = true // every resize needs a replacement
	r, f := newShareRegistry(t, repo, lim, nil)
	initial, err := r.Share("sum/1")
	if err != nil {
		t.Fatal(err)
	}

	entered, release := make(chan struct{}, 2), make(chan struct{})
	f.mu.Lock()
	f.onStart = func(InstanceSpec) { entered <- struct{}{}; <-release }
	f.mu.Unlock()

	if err := r.RequestShare("sum/1", limiter.Share{Compute: 0.3}); err != nil {
		t.Fatal(err)
	}
	<-entered // the first replacement is starting, and RequestShare returned
	st, err := r.ShareStatus("sum/1")
	if err != nil {
		t.Fatal(err)
	}
	if st.Share != initial || st.Pending == nil || st.Pending.Compute != 0.3 || len(st.Swaps) != 1 || st.Swaps[0].State != runtime.SwapStarting {
		t.Errorf("while starting: %+v", st)
	}
	if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 2, 3, 4})); err != nil {
		t.Errorf("a request while the replacement starts: %v", err)
	}

	// The second request supersedes the first.
	if err := r.RequestShare("sum/1", limiter.Share{Compute: 0.6}); err != nil {
		t.Fatal(err)
	}
	if st, _ := r.ShareStatus("sum/1"); st.Pending == nil || st.Pending.Compute != 0.6 {
		t.Errorf("after the second request: pending %+v, want 0.6", st.Pending)
	}
	close(release) // both starts finish: the first's member is thrown away
	waitUntil(t, "the share to apply", func() bool {
		st, _ := r.ShareStatus("sum/1")
		return st.Pending == nil
	})
	st, _ = r.ShareStatus("sum/1")
	if st.Err != nil || st.Share.Compute != 0.6 || st.Swaps[0].State != runtime.SwapDone {
		t.Errorf("after the swaps: %+v", st)
	}
	insts := f.of("sum", 1)
	if len(insts) != 3 {
		t.Fatalf("%d instances started, want 3: the first, the superseded replacement, the last", len(insts))
	}
	if !insts[0].stopped.Load() || !insts[1].stopped.Load() || insts[2].stopped.Load() {
		t.Errorf("stopped: first %v, superseded %v, last %v; want true, true, false",
			insts[0].stopped.Load(), insts[1].stopped.Load(), insts[2].stopped.Load())
	}
	if got := lim.shares(); len(got) != 1 || got[0].Compute != 0.6 {
		t.Errorf("units = %+v, want one at 0.6", got)
	}
	resp, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 2, 3, 4}))
	if err != nil || floats(resp.Outputs[0].Data)[0] != 10 {
		t.Errorf("a request after the swaps: %v", err)
	}
	if n := insts[2].calls.Load(); n < 2 {
		t.Errorf("the last replacement ran %d calls, want its warm-up and the request", n)
	}

	// A share that needs no replacement (the same thread count) applies
	// at once.
	lim.mu.Lock()
	lim.restart = false
	lim.mu.Unlock()
	f.mu.Lock()
	f.onStart = nil
	f.mu.Unlock()
	if err := r.RequestShare("sum/1", limiter.Share{Compute: 0.6, Memory: 1 << 30}); err != nil {
		t.Fatal(err)
	}
	if st, _ := r.ShareStatus("sum/1"); st.Pending != nil || st.Share.Memory != 1<<30 || len(f.of("sum", 1)) != 3 {
		t.Errorf("a live resize: %+v", st)
	}
	if _, err := r.ShareStatus("nosuch/1"); err == nil {
		t.Error("status of an unknown version")
	}
}

// A replacement of a GPU model (a new process and MPS client at the new
// share) is warmed at every batch size up to the model's maximum before it
// takes requests, not only at 1 and the maximum as at load: a CUDA
// session's first run at a new input shape pays for it (cuDNN's algorithm
// search; the simulator's Warmup, 600 ms for bert-base), so a size left
// cold was paid by the first live batch of that size after every resize.
// On the simulated GPU day the berts (60 ms SLO, batches up to 4) ran
// batches of 2 and 3 in 614 ms after resizes, dropped the queue behind
// them, and the execution times' variability that left moved their caps
// again (docs/gpu.md). A best-effort model, and any on the CPU (no
// per-shape search there), keeps 1 and the maximum, as at load.
func TestReplacementWarmsEveryBatchSizeOnGPU(t *testing.T) {
	for _, tc := range []struct {
		name, config string
		want         []int64
	}{
		{"cuda", "execution: {provider: cuda}\nslo: {latency_ms: 100, class: latency-critical}\n", []int64{1, 2, 3, 4}},
		{"cuda, best-effort", "execution: {provider: cuda}\nslo: {latency_ms: 5000, class: best-effort}\n", []int64{1, 4}},
		{"cpu", "slo: {latency_ms: 100, class: latency-critical}\n", []int64{1, 4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			repo := t.TempDir()
			writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+tc.config, 1)
			lim := newFakeLimiter(2)
			lim.restart = true // every resize needs a replacement
			r, f := newShareRegistry(t, repo, lim, nil)
			if err := r.RequestShare("sum/1", limiter.Share{Compute: 0.3}); err != nil {
				t.Fatal(err)
			}
			waitUntil(t, "the share to apply", func() bool {
				st, _ := r.ShareStatus("sum/1")
				return st.Pending == nil
			})
			insts := f.of("sum", 1)
			if len(insts) != 2 {
				t.Fatalf("%d instances started, want the first and its replacement", len(insts))
			}
			if got := insts[1].batchSizes(); !slices.Equal(got, tc.want) {
				t.Errorf("the replacement ran batches of %v before any request, want %v", got, tc.want)
			}
		})
	}
}
