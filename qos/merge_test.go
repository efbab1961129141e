package qos

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

func fp32(shape []int64, vals ...float32) runtime.Tensor {
	var data []byte
	for _, v := range vals {
		data = binary.LittleEndian.AppendUint32(data, math.Float32bits(v))
	}
	return runtime.Tensor{Name: "x", DataType: runtime.FP32, Shape: shape, Data: data}
}

func byteStrings(name string, shape []int64, elems ...string) runtime.Tensor {
	var data []byte
	for _, e := range elems {
		data = runtime.AppendBytesElement(data, []byte(e))
	}
	return runtime.Tensor{Name: name, DataType: runtime.Bytes, Shape: shape, Data: data}
}

func TestMergeAndSplitFixedSize(t *testing.T) {
	a := &runtime.InferRequest{Inputs: []runtime.Tensor{fp32([]int64{1, 2}, 1, 2)}, Outputs: []string{"y"}}
	b := &runtime.InferRequest{Inputs: []runtime.Tensor{fp32([]int64{2, 2}, 3, 4, 5, 6)}, Outputs: []string{"y"}}
	merged, sizes, _, err := mergeRequests([]*runtime.InferRequest{a, b})
	if err != nil {
		t.Fatal(err)
	}
	want := fp32([]int64{3, 2}, 1, 2, 3, 4, 5, 6)
	if got := merged.Inputs[0]; !slices.Equal(got.Shape, want.Shape) || !bytes.Equal(got.Data, want.Data) {
		t.Errorf("merged input = %v %v, want %v %v", got.Shape, got.Data, want.Shape, want.Data)
	}
	if !slices.Equal(sizes, []int{1, 2}) || !slices.Equal(merged.Outputs, []string{"y"}) {
		t.Errorf("sizes = %v, outputs = %v", sizes, merged.Outputs)
	}
	// The inputs were not modified.
	if a.Inputs[0].Shape[0] != 1 || len(a.Inputs[0].Data) != 8 {
		t.Errorf("merge modified its input: %v", a.Inputs[0])
	}

	out := fp32([]int64{3, 1}, 10, 20, 30)
	out.Name = "y"
	resp := &runtime.InferResponse{Outputs: []runtime.Tensor{out}, Timing: runtime.Timing{Infer: 7}}
	parts, err := splitResponse(resp, sizes)
	if err != nil {
		t.Fatal(err)
	}
	wantParts := []runtime.Tensor{fp32([]int64{1, 1}, 10), fp32([]int64{2, 1}, 20, 30)}
	for i, p := range parts {
		got := p.Outputs[0]
		if got.Name != "y" || !slices.Equal(got.Shape, wantParts[i].Shape) || !bytes.Equal(got.Data, wantParts[i].Data) {
			t.Errorf("part %d = %s %v %v, want %v %v", i, got.Name, got.Shape, got.Data, wantParts[i].Shape, wantParts[i].Data)
		}
		if p.Timing.Infer != 7 {
			t.Errorf("part %d timing = %v", i, p.Timing)
		}
	}
	// A part cannot grow into its neighbour's bytes.
	if c := cap(parts[0].Outputs[0].Data); c != 4 {
		t.Errorf("part 0 capacity = %d, want 4", c)
	}
}

func TestMergeAndSplitBytes(t *testing.T) {
	// Two inputs, one of them BYTES with two elements per row.
	a := &runtime.InferRequest{Inputs: []runtime.Tensor{
		byteStrings("s", []int64{1, 2}, "a", "bcd"),
		fp32([]int64{1}, 1),
	}}
	b := &runtime.InferRequest{Inputs: []runtime.Tensor{
		fp32([]int64{2}, 2, 3), // another order of the same inputs
		byteStrings("s", []int64{2, 2}, "", "ef", "ghij", "k"),
	}}
	if mergeKey(a) != mergeKey(b) {
		t.Fatalf("keys differ: %q %q", mergeKey(a), mergeKey(b))
	}
	merged, sizes, _, err := mergeRequests([]*runtime.InferRequest{a, b})
	if err != nil {
		t.Fatal(err)
	}
	s := merged.Inputs[0]
	elems, err := runtime.SplitBytes(s.Data, 6)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range elems {
		got = append(got, string(e))
	}
	if !slices.Equal(got, []string{"a", "bcd", "", "ef", "ghij", "k"}) || !slices.Equal(s.Shape, []int64{3, 2}) {
		t.Errorf("merged BYTES = %q shape %v", got, s.Shape)
	}
	if x := merged.Inputs[1]; !bytes.Equal(x.Data, fp32(nil, 1, 2, 3).Data) {
		t.Errorf("merged x = %v", x.Data)
	}

	resp := &runtime.InferResponse{Outputs: []runtime.Tensor{byteStrings("out", []int64{3}, "first", "", "third!")}}
	parts, err := splitResponse(resp, sizes)
	if err != nil {
		t.Fatal(err)
	}
	want := []runtime.Tensor{byteStrings("out", []int64{1}, "first"), byteStrings("out", []int64{2}, "", "third!")}
	for i, p := range parts {
		if got := p.Outputs[0]; !slices.Equal(got.Shape, want[i].Shape) || !bytes.Equal(got.Data, want[i].Data) {
			t.Errorf("part %d = %v %q, want %v %q", i, got.Shape, got.Data, want[i].Shape, want[i].Data)
		}
	}
}

func TestMergeRefusesIncompatibleRequests(t *testing.T) {
	base := &runtime.InferRequest{Inputs: []runtime.Tensor{fp32([]int64{1, 2}, 1, 2)}}
	tests := []struct {
		name  string
		other *runtime.InferRequest
	}{
		{"non-batch dimension", &runtime.InferRequest{Inputs: []runtime.Tensor{fp32([]int64{1, 3}, 1, 2, 3)}}},
		{"rank", &runtime.InferRequest{Inputs: []runtime.Tensor{fp32([]int64{1, 2, 1}, 1, 2)}}},
		{"data type", &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.Int32, Shape: []int64{1, 2}, Data: make([]byte, 8)}}}},
		{"input name", &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "z", DataType: runtime.FP32, Shape: []int64{1, 2}, Data: make([]byte, 8)}}}},
		{"outputs", &runtime.InferRequest{Inputs: []runtime.Tensor{fp32([]int64{1, 2}, 1, 2)}, Outputs: []string{"y"}}},
		{"extra input", &runtime.InferRequest{Inputs: []runtime.Tensor{fp32([]int64{1, 2}, 1, 2), byteStrings("s", []int64{1}, "a")}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if mergeKey(base) == mergeKey(tt.other) {
				t.Errorf("keys equal: %q", mergeKey(base))
			}
			if _, _, _, err := mergeRequests([]*runtime.InferRequest{base, tt.other}); err == nil {
				t.Error("merged")
			}
		})
	}
	t.Run("same output set in another order", func(t *testing.T) {
		a := &runtime.InferRequest{Inputs: base.Inputs, Outputs: []string{"p", "q"}}
		b := &runtime.InferRequest{Inputs: base.Inputs, Outputs: []string{"q", "p"}}
		if mergeKey(a) != mergeKey(b) {
			t.Errorf("keys differ")
		}
	})
}

func TestRequestBatch(t *testing.T) {
	tests := []struct {
		name   string
		inputs []runtime.Tensor
		want   int
		err    string
	}{
		{"one input", []runtime.Tensor{fp32([]int64{3, 2}, 1, 2, 3, 4, 5, 6)}, 3, ""},
		{"agreeing inputs", []runtime.Tensor{fp32([]int64{2}, 1, 2), byteStrings("s", []int64{2}, "a", "b")}, 2, ""},
		{"disagreeing inputs", []runtime.Tensor{fp32([]int64{2}, 1, 2), byteStrings("s", []int64{1}, "a")}, 0, "batch dimension 1"},
		{"scalar", []runtime.Tensor{fp32([]int64{}, 1)}, 0, "no batch dimension"},
		{"empty batch", []runtime.Tensor{fp32([]int64{0, 2})}, 0, "batch dimension 0"},
		{"no inputs", nil, 0, "no inputs"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := requestBatch(&runtime.InferRequest{Inputs: tt.inputs})
			if tt.err == "" {
				if err != nil || got != tt.want {
					t.Errorf("= %d, %v; want %d", got, err, tt.want)
				}
				return
			}
			if err == nil || !errors.Is(err, ErrInvalidRequest) || !strings.Contains(err.Error(), tt.err) {
				t.Errorf("error = %v, want ErrInvalidRequest containing %q", err, tt.err)
			}
		})
	}
}

func TestSplitRejectsBadOutputs(t *testing.T) {
	sizes := []int{1, 2}
	tests := []struct {
		name string
		out  runtime.Tensor
		err  string
	}{
		{"wrong batch", fp32([]int64{2, 1}, 1, 2), "first dimension"},
		{"scalar", fp32([]int64{}, 1), "first dimension"},
		{"short data", fp32([]int64{3, 1}, 1, 2), "data bytes"},
		{"BYTES too few elements", byteStrings("s", []int64{3}, "a", "b"), "truncated"},
		{"BYTES too many elements", byteStrings("s", []int64{3}, "a", "b", "c", "d"), "left after"},
		{"BYTES bad length", runtime.Tensor{Name: "s", DataType: runtime.Bytes, Shape: []int64{3}, Data: []byte{9, 0, 0, 0, 'a'}}, "declares 9 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := splitResponse(&runtime.InferResponse{Outputs: []runtime.Tensor{tt.out}}, sizes)
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Errorf("error = %v, want one containing %q", err, tt.err)
			}
		})
	}
}

// A merged batch carries its latest deadline, which bounds its execution;
// one request without a deadline leaves the batch without one.
func TestMergeKeepsLatestDeadline(t *testing.T) {
	now := time.Now()
	row := func(d time.Time) *runtime.InferRequest {
		return &runtime.InferRequest{Deadline: d, Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 1}, Data: make([]byte, 4)}}}
	}
	for _, tc := range []struct {
		name string
		in   []time.Time
		want time.Time
	}{
		{"all set", []time.Time{now.Add(time.Second), now.Add(3 * time.Second), now.Add(2 * time.Second)}, now.Add(3 * time.Second)},
		{"one without", []time.Time{now.Add(time.Second), {}}, time.Time{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var reqs []*runtime.InferRequest
			for _, d := range tc.in {
				reqs = append(reqs, row(d))
			}
			merged, _, _, err := mergeRequests(reqs)
			if err != nil {
				t.Fatal(err)
			}
			if !merged.Deadline.Equal(tc.want) {
				t.Errorf("deadline %v, want %v", merged.Deadline, tc.want)
			}
		})
	}
}
