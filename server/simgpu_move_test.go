package server

import (
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/runtime"
	"github.com/sloserve/sloserve/simgpu"
)

// A latency-critical model loaded on a simulated GPU, and moved to
// another, is warmed at every batch size on each of its instances, as a
// replacement after a resize is: before, a load or a move warmed batch 1
// and the largest through the pool, which sent those runs to one
// instance, and the first live batch of 2 or 3 on each instance (each its
// own MPS client) paid the model's warm-up (600 ms for bert-base against
// an SLO of 60 ms). The SLO here is loose,
// so that admission, which predicts the cold runs, refuses none of them.
//
// The two instances run a batch of 2 and one of 3 at once (two requests
// the scheduler cannot merge past the maximum of 4), four times: after
// the load, and after the move, the slowest of these pairs is as fast as
// the fastest, none paid a warm-up whichever instance took which size.
// Without the warm-up of each instance the slowest pair took 606-608 ms
// against 8.2 ms: after the load without the load's (models/load.go), after
// the move without the move's.
func TestLoadAndMoveWarmEveryBatchSizeOnGPU(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		reg, _, _, to, _ := movableBert(t)

		fastBefore, slowBefore := pairs(t, reg)
		if slowBefore > fastBefore+fastBefore/10 {
			t.Errorf("after the load the batches of 2 and 3 took %v to %v: a size was cold", fastBefore, slowBefore)
		}
		if err := reg.Move(t.Context(), "m/1", to); err != nil {
			t.Fatal(err)
		}
		if d := deviceOfModel(t, reg, "m"); d != to {
			t.Fatalf("m on %s after the move, want %s", d, to)
		}
		fast, slow := pairs(t, reg)
		if slow > fast+fast/10 {
			t.Errorf("after the move to %s the batches of 2 and 3 took %v to %v: a size was cold (after the load: %v to %v)", to, fast, slow, fastBefore, slowBefore)
		}
		t.Logf("batches of 2 and 3 at once: after the load %v to %v; after the move %v to %v", fastBefore, slowBefore, fast, slow)
	})
}

// pairs sends m a batch of 2 and one of 3 at once, four times, a second
// apart, and returns the fastest and the slowest pair (a pair's latency is
// its slower request's).
func pairs(t *testing.T, reg *models.Registry) (fastest, slowest time.Duration) {
	t.Helper()
	for i := range 4 {
		var (
			wg   sync.WaitGroup
			mu   sync.Mutex
			pair time.Duration
		)
		for _, b := range []int64{2, 3} {
			wg.Go(func() {
				req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{b, 16}, Data: make([]byte, 64*b)}}}
				start := time.Now()
				if _, _, err := reg.Infer(t.Context(), "m", "", req); err != nil {
					t.Errorf("batch of %d: %v", b, err)
				}
				mu.Lock()
				pair = max(pair, time.Since(start))
				mu.Unlock()
			})
		}
		wg.Wait()
		if i == 0 || pair < fastest {
			fastest = pair
		}
		slowest = max(slowest, pair)
		time.Sleep(time.Second)
	}
	return fastest, slowest
}

// A move whose warm-up fails on the target (here its memory, taken by
// another tenant, holds the new clients' contexts and weights but not one
// batch's activations) stops the new instances and fails with the reason:
// the version stays on its device and serves there, and the target has
// its memory back.
func TestMoveFailingItsWarmUpStaysPut(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		reg, h, from, to, idx := movableBert(t)
		target := h.sim.Devices()[idx]
		// Room for two contexts and two copies of the weights, and 20 MiB:
		// half a batch-1 arena of bert-base.
		m := simgpu.Presets["bert-base"]
		room := 2*(simgpu.ContextMemory+m.Weights) + 20<<20
		if err := target.InjectMemory(target.MemoryTotal() - target.MemoryUsed() - room); err != nil {
			t.Fatal(err)
		}
		before := target.MemoryUsed()
		err := reg.Move(t.Context(), "m/1", to)
		if err == nil || !strings.Contains(err.Error(), "warming on "+to) {
			t.Fatalf("move onto a device without room for a batch: %v, want a warm-up failure", err)
		}
		if d := deviceOfModel(t, reg, "m"); d != from {
			t.Errorf("m on %s after the failed move, want %s", d, from)
		}
		infer(t, reg, "m")
		synctest.Wait()
		if used := target.MemoryUsed(); used != before || target.Clients() != 0 {
			t.Errorf("after the failed move the target holds %d clients and %d bytes, want none and %d", target.Clients(), used, before)
		}
		// The version moves again once the target has room.
		if err := target.InjectMemory(-(target.MemoryTotal() - room)); err != nil {
			t.Fatal(err)
		}
		if err := reg.Move(t.Context(), "m/1", to); err != nil {
			t.Fatalf("moving once the target has room: %v", err)
		}
		infer(t, reg, "m")
	})
}

// movableBert loads m, a latency-critical bert-base with two instances
// and a loose SLO, on one of two simulated GPUs under the shared policy
// (no resize: no replacement warms a size), and names the other GPU and
// its index.
func movableBert(t *testing.T) (reg *models.Registry, h *house, from, to string, idx int) {
	t.Helper()
	cfg := configs.DefaultServer()
	cfg.GPU.Simulator.Devices = 2
	cfg.Control.Policy = control.SharePolicyShared
	cfg.Control.Profile.Enabled = false
	model := "max_batch_size: 4\ninstances: 2\n" +
		"execution: {provider: cuda, simulated: {preset: bert-base}}\n" +
		"slo: {latency_ms: 5000, class: latency-critical}\nresources: {memory_limit: 4GiB}\n"
	reg, h = simulatedServer(t, cfg, map[string]string{"m": model})
	from = deviceOfModel(t, reg, "m")
	to, idx = "cuda:1", 1
	if from == to {
		to, idx = "cuda:0", 0
	}
	return reg, h, from, to, idx
}
