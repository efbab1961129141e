package server

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// On a simulated GPU under the adaptive policy the memory share follows
// the load: it grows for a busy model's batches, shrinks once the model is
// idle (a new, smaller client), and a burst after the idleness runs in the
// batches the small client's pinned memory holds, failing none, while the
// share grows again for it.
func TestSimulatedGPUBurstAfterIdleFitsShrunkMemory(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := configs.DefaultServer()
		cfg.GPU.Simulator.Devices = 1
		cfg.Control.Policy = control.SharePolicyAdaptive
		model := "max_batch_size: 8\nslo: {latency_ms: 200, class: latency-critical}\n" +
			"execution: {provider: cuda, simulated: {preset: resnet50}}\nresources: {memory_limit: 4GiB}\n"
		reg, devs := simulatedServer(t, cfg, map[string]string{"m": model})
		const mib = 1 << 20
		ws1, _ := devs.pred.WorkingSet("m/1", 1)
		ws8, _ := devs.pred.WorkingSet("m/1", 8)
		idle := (ws1 + ws1/4 + mib - 1) / mib * mib // batch 1's working set + 25%
		dev := devs.sim.Devices()[0]

		// failed counts the requests that failed; a refusal of the
		// scheduler's (a deadline it predicts missed) is not a failure.
		var failed, refused, good, sent atomic.Int64
		var firstErr atomic.Value
		send := func() {
			sent.Add(1)
			req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 16}, Data: make([]byte, 64)}}}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, _, err := reg.Infer(ctx, "m", "", req)
			switch {
			case err == nil:
				good.Add(1)
			case errors.Is(err, qos.ErrRejected), errors.Is(err, qos.ErrDropped), errors.Is(err, qos.ErrQueueFull):
				refused.Add(1)
			default:
				failed.Add(1)
				firstErr.CompareAndSwap(nil, err.Error())
			}
		}
		// load sends rate requests a second for d, each on its own.
		load := func(rate int, d time.Duration) {
			var wg sync.WaitGroup
			for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(time.Second / time.Duration(rate)) {
				wg.Go(send)
			}
			wg.Wait()
		}
		share := func() int64 {
			s, _, err := reg.ShareInEffect("m/1")
			if err != nil {
				t.Fatal(err)
			}
			return s.Memory
		}
		peak := func(d time.Duration) (most int64) { // the device's memory in use over d
			for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
				most = max(most, dev.MemoryUsed())
			}
			return most
		}

		time.Sleep(15 * time.Second) // profiled and idle: a pass and the new client
		if got := share(); got != idle {
			t.Fatalf("idle after profiling: memory share %dMiB, want %dMiB (batch 1's %dMiB + 25%%)", got/mib, idle/mib, ws1/mib)
		}

		// Busy: the share grows for larger batches.
		load(200, 20*time.Second)
		busy := share()
		if busy <= idle {
			t.Fatalf("busy at 200 req/s: memory share %dMiB, want more than the idle %dMiB", busy/mib, idle/mib)
		}
		t.Logf("working sets: batch 1 %dMiB, batch 8 %dMiB; memory share idle %dMiB, busy %dMiB", ws1/mib, ws8/mib, idle/mib, busy/mib)

		// Idle: it shrinks back (the hysteresis passes first; the last
		// small step waits for a compute resize to ride along with).
		time.Sleep(2 * time.Minute)
		shrunk := share()
		// The shrunk client holds batches up to fit (resnet50: 25MiB an
		// item beside the context and weights), below the maximum 8.
		fit := int((shrunk - (ws1 - 25*mib)) / (25 * mib))
		if shrunk >= busy || fit >= 8 || fit < 1 {
			t.Fatalf("idle again: memory share %dMiB (batches up to %d), want under the busy %dMiB and batches under 8", shrunk/mib, fit, busy/mib)
		}

		// A burst of 64 at once, then 200 req/s: none fails, and the share
		// grows for it.
		before, goodBefore := failed.Load(), good.Load()
		var wg sync.WaitGroup
		var most int64
		wg.Go(func() { most = peak(10 * time.Second) })
		for range 64 {
			wg.Go(send)
		}
		load(200, 10*time.Second)
		wg.Wait()
		if n := failed.Load() - before; n != 0 {
			t.Errorf("%d of the burst's requests failed (first: %v), want none", n, firstErr.Load())
		}
		if n := good.Load() - goodBefore; n < 1000 {
			t.Errorf("%d of the burst's and the load's 2064 requests answered, want most", n)
		}
		if got := share(); got <= shrunk {
			t.Errorf("after the burst: memory share %dMiB, want grown past the idle %dMiB", got/mib, shrunk/mib)
		}
		if failed.Load() != 0 {
			t.Errorf("%d of %d requests failed in all (first: %v)", failed.Load(), sent.Load(), firstErr.Load())
		}
		t.Logf("idle again %dMiB (batches up to %d); burst after idle: answered %d, refused %d of %d in all, device memory at most %dMiB, share now %dMiB",
			shrunk/mib, fit, good.Load()-goodBefore, refused.Load(), sent.Load(), most/mib, share()/mib)
	})
}
