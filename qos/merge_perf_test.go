package qos

import (
	"testing"

	"github.com/sloserve/sloserve/runtime"
)

// mergeKey runs for every request a model with batching takes: the key
// string is its one allocation, whatever the order of inputs and outputs.
func TestMergeKeyAllocations(t *testing.T) {
	x := runtime.Tensor{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 10}}
	y := runtime.Tensor{Name: "y", DataType: runtime.Int64, Shape: []int64{1, 3, 4}}
	for _, tc := range []struct {
		name      string
		req       *runtime.InferRequest
		maxAllocs float64
	}{
		{"one input", &runtime.InferRequest{Inputs: []runtime.Tensor{x}}, 1},
		{"sorted", &runtime.InferRequest{Inputs: []runtime.Tensor{x, y}, Outputs: []string{"a", "b"}}, 1},
		// Out of order: the sorted copies cost an allocation each.
		{"unsorted", &runtime.InferRequest{Inputs: []runtime.Tensor{y, x}, Outputs: []string{"b", "a", "a"}}, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if n := testing.AllocsPerRun(100, func() { mergeKey(tc.req) }); n > tc.maxAllocs {
				t.Errorf("mergeKey allocates %v times, want at most %v", n, tc.maxAllocs)
			}
		})
	}
	// Order does not change the key; outputs are a set.
	a := mergeKey(&runtime.InferRequest{Inputs: []runtime.Tensor{x, y}, Outputs: []string{"a", "b"}})
	b := mergeKey(&runtime.InferRequest{Inputs: []runtime.Tensor{y, x}, Outputs: []string{"b", "a", "a"}})
	if a != b {
		t.Errorf("keys differ: %q, %q", a, b)
	}
	if want := `"x":FP32,10;"y":INT64,3,4;->"a","b",`; a != want {
		t.Errorf("key %q, want %q", a, want)
	}
}
