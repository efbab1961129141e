package runtime

import (
	"errors"
	"testing"
	"testing/synctest"

	"github.com/sloserve/sloserve/simgpu"
)

// A simulated MPS client's batch bound is the largest batch whose arena
// fits its pinned limit beside its context and weights: that batch runs,
// one more item runs out of memory. Without a daemon (the limit does not
// hold) or without a limit there is no bound.
func TestSimulatedMaxBatchIsWhatThePinnedLimitHolds(t *testing.T) {
	path := testModel(t, "example_dynamic_axes.onnx")
	synctest.Test(t, func(t *testing.T) {
		sim, err := simgpu.New(simgpu.Spec{Devices: 1, SMs: 100, Memory: 8 << 30})
		if err != nil {
			t.Fatal(err)
		}
		m := simgpu.Presets["resnet50"] // 100MiB of weights, 25MiB an item
		start := func(env ...string) *Simulated {
			s, err := StartSimulated(t.Context(), SimulatedConfig{Name: "m", ModelPath: path, Device: sim.Devices()[0], Model: m, Batched: true, Env: env, Logger: testLogger(t)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Stop(t.Context()) })
			return s
		}
		in := func(s *Simulated, b int) *InferRequest {
			i := s.Inputs()[0]
			return &InferRequest{Inputs: []Tensor{{Name: i.Name, DataType: i.DataType, Shape: []int64{int64(b), 10}, Data: make([]byte, b*10*i.DataType.Size())}}}
		}
		// 532MiB: 300 context + 100 weights + 132 arena, 5 items.
		s := start("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=532M")
		if n, ok := s.MaxBatch(); n != 5 || !ok {
			t.Fatalf("MaxBatch %d %v under 532MiB, want 5", n, ok)
		}
		if _, err := s.Infer(t.Context(), in(s, 5)); err != nil {
			t.Errorf("a batch of 5: %v", err)
		}
		if _, err := s.Infer(t.Context(), in(s, 6)); !errors.Is(err, simgpu.ErrOutOfMemory) {
			t.Errorf("a batch of 6: %v, want out of memory", err)
		}
		if _, ok := start().MaxBatch(); ok {
			t.Error("bounded without a pinned limit")
		}
		sim.Devices()[0].SetDaemon(false)
		if _, ok := start("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=532M").MaxBatch(); ok {
			t.Error("bounded without an MPS daemon, whose limit does not hold")
		}
	})
}
