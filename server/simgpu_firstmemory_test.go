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

// Under the adaptive policy on a simulated GPU, a model whose file was
// profiled before (the profile cache) starts at the working set of its
// largest batch plus the loop's headroom, not at its memory_limit: its
// first client pins that, the profile at load runs within it (here on
// another device, whose profile is not cached, so every batch size is
// measured in it), and a burst right after load fails no request.
func TestSimulatedGPUFirstMemoryIsTheWorkingSet(t *testing.T) {
	const (
		mib   = 1 << 20
		limit = 4 << 30
	)
	cache := t.TempDir()
	server := func(t *testing.T, device string) (*house, func(string) error) {
		cfg := configs.DefaultServer()
		cfg.GPU.Simulator.Devices = 2
		cfg.Control.Policy = control.SharePolicyAdaptive
		cfg.Control.Profile.CacheDir = cache
		model := "max_batch_size: 8\nslo: {latency_ms: 200, class: latency-critical}\n" +
			"execution: {provider: cuda, device_id: " + device + ", simulated: {preset: resnet50}}\nresources: {memory_limit: 4GiB}\n"
		_, h := simulatedServer(t, cfg, map[string]string{"m": model})
		send := func(string) error {
			req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 16}, Data: make([]byte, 64)}}}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, _, err := h.reg.Infer(ctx, "m", "", req)
			return err
		}
		return h, send
	}

	// A first server profiles the model on cuda:0: its working sets.
	var ws8 int64
	synctest.Test(t, func(t *testing.T) {
		h, _ := server(t, "0")
		var ok bool
		if ws8, ok = h.pred.WorkingSet("m/1", 8); !ok || ws8 <= 0 {
			t.Fatalf("no working set of batch 8 after the profile (%d, %v)", ws8, ok)
		}
		if s, _, err := h.reg.ShareInEffect("m/1"); err != nil || s.Memory != limit {
			t.Fatalf("first load, nothing cached: memory share %dMiB (%v), want the memory_limit %dMiB", s.Memory/mib, err, limit/mib)
		}
	})
	first := (ws8 + ws8/4 + mib - 1) / mib * mib // + 25%, rounded up to a MiB

	// A second server on the same cache loads it on cuda:1.
	synctest.Test(t, func(t *testing.T) {
		h, send := server(t, "1")
		dev := h.sim.Devices()[1]
		s, _, err := h.reg.ShareInEffect("m/1")
		if err != nil {
			t.Fatal(err)
		}
		if s.Memory != first {
			t.Fatalf("loaded with the working sets cached: memory share %dMiB, want batch 8's working set %dMiB + 25%% = %dMiB, not the memory_limit %dMiB",
				s.Memory/mib, ws8/mib, first/mib, limit/mib)
		}
		if got := dev.MemoryPinned(); got >= limit {
			t.Fatalf("cuda:1 pins %dMiB after load, want under the memory_limit %dMiB", got/mib, limit/mib)
		}
		if got, ok := h.pred.WorkingSet("m/1", 8); !ok || got != ws8 {
			t.Errorf("profiled on cuda:1 within the first share: batch 8's working set %dMiB (%v), want %dMiB as on cuda:0", got/mib, ok, ws8/mib)
		}

		// A burst at once, then 200 requests a second: none fails.
		var failed, good, refused atomic.Int64
		var firstErr atomic.Value
		one := func() {
			switch err := send("m"); {
			case err == nil:
				good.Add(1)
			case errors.Is(err, qos.ErrRejected), errors.Is(err, qos.ErrDropped), errors.Is(err, qos.ErrQueueFull):
				refused.Add(1)
			default:
				failed.Add(1)
				firstErr.CompareAndSwap(nil, err.Error())
			}
		}
		var wg sync.WaitGroup
		var most int64
		done := make(chan struct{})
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				case <-time.After(50 * time.Millisecond):
					most = max(most, dev.MemoryUsed())
				}
			}
		})
		var load sync.WaitGroup
		for range 64 {
			load.Go(one)
		}
		for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
			load.Go(one)
		}
		load.Wait()
		close(done)
		wg.Wait()
		if n := failed.Load(); n != 0 {
			t.Errorf("%d requests of the burst after load failed (first: %v), want none", n, firstErr.Load())
		}
		if n := good.Load(); n < 1500 {
			t.Errorf("%d of the 2064 requests answered (%d refused), want most", n, refused.Load())
		}
		t.Logf("working set of batch 8 %dMiB; first memory share %dMiB (memory_limit %dMiB); burst: %d answered, %d refused; device memory in use at most %dMiB",
			ws8/mib, first/mib, limit/mib, good.Load(), refused.Load(), most/mib)
	})
}

// Placement counts a loading model at its first memory share: two models
// whose memory_limits and a shadow's room do not fit one device load
// there once their working sets are cached. The first server loads one of
// them alone; the second both, on a device of 6 GiB where 2 x 2.5 GiB of
// limits and room for a 2.5 GiB shadow would not fit.
func TestSimulatedGPUFirstMemoryPlacesMoreModels(t *testing.T) {
	cache := t.TempDir()
	model := "max_batch_size: 8\nslo: {latency_ms: 200, class: latency-critical}\n" +
		"execution: {provider: cuda, simulated: {preset: resnet50}}\nresources: {memory_limit: 2560MiB}\n"
	server := func(t *testing.T, names ...string) *house {
		cfg := configs.DefaultServer()
		cfg.GPU.Simulator.Devices = 1
		cfg.GPU.Simulator.Memory = 6 << 30
		cfg.GPU.Placement = configs.GPUPlacement{Enabled: true, Period: 10 * time.Second, MinGain: 0.1, MinResidence: 30 * time.Second}
		cfg.Control.Policy = control.SharePolicyAdaptive
		cfg.Control.Profile.CacheDir = cache
		cfgs := map[string]string{}
		for _, n := range names {
			cfgs[n] = model
		}
		_, h, _ := placedServer(t, cfg, cfgs)
		return h
	}
	synctest.Test(t, func(t *testing.T) {
		h := server(t, "a")
		if ok, _ := h.reg.ModelReady("a", ""); !ok {
			t.Fatal("a alone did not load")
		}
	})
	synctest.Test(t, func(t *testing.T) {
		h := server(t, "a", "b")
		for _, m := range []string{"a", "b"} {
			if ok, _ := h.reg.ModelReady(m, ""); !ok {
				why := ""
				for _, e := range h.reg.IndexKnown(false) {
					if e.Name == m {
						why = e.Reason
					}
				}
				t.Fatalf("%s did not load beside the other on 6 GiB with their working sets cached: %s", m, why)
			}
		}
		if got := h.sim.Devices()[0].MemoryPinned(); got >= 5<<30 {
			t.Errorf("the device pins %d MiB after load, want the two first shares, well under 2 x 2560 MiB", got>>20)
		}
	})
}
