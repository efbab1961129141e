package runtime

import (
	"math"
	"testing"
)

// The per-call work of the server's side of a runner call allocates
// nothing it does not have to: these tests pin what was removed.

// An output of dynamic shape makes outputReserve fall back to the learnt
// output-to-input ratio without building an error on every call.
func TestOutputReserveDynamicAllocatesNothing(t *testing.T) {
	r := &Runner{outputs: []TensorSpec{{Name: "y", DataType: FP32, Shape: []int64{-1}}}}
	r.outRatio.Store(math.Float64bits(0.5))
	req := &InferRequest{}
	if got, want := r.outputReserve(req, 64), uint64(32+arenaAlign); got != want {
		t.Fatalf("reserve %d, want %d", got, want)
	}
	if n := testing.AllocsPerRun(100, func() { r.outputReserve(req, 64) }); n != 0 {
		t.Fatalf("outputReserve allocates %v times a call, want 0", n)
	}
	// A fixed shape is reserved exactly.
	r.outputs = []TensorSpec{{Name: "y", DataType: FP32, Shape: []int64{2, 3}}}
	if got, want := r.outputReserve(req, 64), uint64(24+arenaAlign); got != want {
		t.Fatalf("fixed reserve %d, want %d", got, want)
	}
}
