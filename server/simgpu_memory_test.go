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
	"github.com/sloserve/sloserve/predictor"
	"github.com/sloserve/sloserve/runtime"
)

// On a simulated GPU the profiling sweep records each batch size's device
// memory (the client's context, weights and arena, read through NVML's
// per-process memory), so the predictor knows the model's working set per
// batch, and the adaptive policy sizes the memory share on MPS from it and
// the load: an idle model's is batch 1's working set with headroom, not
// the memory_limit nor the largest batch's. A burst then runs in batches
// the new client's pinned memory holds, and none runs out of it.
func TestSimulatedGPUProfileRecordsWorkingSets(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := configs.DefaultServer()
		cfg.GPU.Simulator.Devices = 1
		cfg.Control.Policy = control.SharePolicyAdaptive
		model := "max_batch_size: 8\nexecution: {provider: cuda, simulated: {preset: resnet50}}\nresources: {memory_limit: 4GiB}\n"
		reg, devs := simulatedServer(t, cfg, map[string]string{"m": model})
		const mib = 1 << 20
		ws1, ok1 := devs.pred.WorkingSet("m/1", 1)
		ws8, ok8 := devs.pred.WorkingSet("m/1", 8)
		if !ok1 || !ok8 {
			t.Fatalf("no working set after profiling: batch 1 %d %v, batch 8 %d %v", ws1, ok1, ws8, ok8)
		}
		// resnet50's arena is 25MiB an item: 7 items between batch 1 and 8.
		if got := ws8 - ws1; got != 7*25*mib {
			t.Errorf("working set at batch 8 - batch 1 = %dMiB, want 175MiB (ws1 %dMiB, ws8 %dMiB)", got/mib, ws1/mib, ws8/mib)
		}
		if ws1 < 100*mib+25*mib {
			t.Errorf("working set at batch 1 %dMiB: under the weights and one item's arena", ws1/mib)
		}
		t.Logf("working sets: batch 1 %dMiB, batch 8 %dMiB", ws1/mib, ws8/mib)
		time.Sleep(10 * time.Second) // a pass, and the new client's start
		synctest.Wait()
		want := (ws1 + ws1/4 + mib - 1) / mib * mib // + 25%, whole MiB
		seen := 0
		for _, d := range devs.loops.All() {
			if d.Adjuster() == nil {
				continue
			}
			for _, s := range d.Adjuster().Shares() {
				seen++
				if s.Share.Memory != want || s.MemoryTarget != want {
					t.Errorf("%s on %s: memory share %dMiB, target %dMiB; want %dMiB (batch 1's working set + 25%%: idle), not the 4GiB limit",
						s.Model, d.Device().Name(), s.Share.Memory/mib, s.MemoryTarget/mib, want/mib)
				}
			}
		}
		if seen != 1 {
			t.Errorf("%d shares seen, want m/1's", seen)
		}
		if sh, pending, err := reg.ShareInEffect("m/1"); sh.Memory != want || pending || err != nil {
			t.Errorf("share in effect %+v (pending %v, err %v), want the runner restarted with %dMiB", sh, pending, err, want/mib)
		}
		// A burst that the scheduler batches within what the new client
		// holds (not by 8) fits it.
		var wg sync.WaitGroup
		for range 16 {
			wg.Go(func() {
				req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 16}, Data: make([]byte, 64)}}}
				if _, _, err := reg.Infer(t.Context(), "m", "", req); err != nil {
					t.Errorf("a request of the burst: %v", err)
				}
			})
		}
		wg.Wait()
		held := reg.InstanceMemory("m/1")
		if held <= ws1 || held > want {
			t.Errorf("the instance holds %dMiB after the burst, want batches over 1 (more than %dMiB) within its %dMiB", held/mib, ws1/mib, want/mib)
		}
		t.Logf("after a burst of 16: the instance holds %dMiB of its %dMiB", held/mib, want/mib)
	})
}

// The profile command prints each point's peak memory when the profile
// has it.
func TestWriteProfileShowsPeakMemory(t *testing.T) {
	pts := []predictor.Point{
		{Batch: 1, Share: 1, Latency: 10 * time.Millisecond, Memory: 100 << 20},
		{Batch: 8, Share: 1, Latency: 40 * time.Millisecond, Memory: 156 << 20},
		{Batch: 1, Share: 0.5, Latency: 20 * time.Millisecond, Memory: 156 << 20},
		{Batch: 8, Share: 0.5, Latency: 80 * time.Millisecond, Memory: 156 << 20},
	}
	prof, err := predictor.NewProfile("k", pts, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	writeProfile(&out, models.ProfileRun{Key: "m/1", Device: "cpu"}, prof, false, nil)
	if !strings.Contains(out.String(), "peak MiB") || !strings.Contains(out.String(), "156.0") {
		t.Errorf("profile printed without its memory:\n%s", out.String())
	}
}
