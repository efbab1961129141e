package runtime

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

func testIO() *modelIO {
	return newModelIO(
		[]TensorSpec{
			{Name: "x", DataType: FP32, Shape: []int64{-1, 3}},
			{Name: "s", DataType: Bytes, Shape: []int64{-1}},
			{Name: "m", DataType: Bool, Shape: []int64{2}},
		},
		[]TensorSpec{
			{Name: "a", DataType: FP32, Shape: []int64{-1}},
			{Name: "b", DataType: Int64, Shape: []int64{1}},
		},
	)
}

func bytesTensor(name string, elems ...string) *runnerpb.Tensor {
	var data []byte
	for _, e := range elems {
		data = AppendBytesElement(data, []byte(e))
	}
	return &runnerpb.Tensor{Name: name, Datatype: "BYTES", Shape: []int64{int64(len(elems))}, Data: data}
}

func TestOrderInputs(t *testing.T) {
	x := &runnerpb.Tensor{Name: "x", Datatype: "FP32", Shape: []int64{2, 3}, Data: make([]byte, 24)}
	s := bytesTensor("s", "hello", "", "wörld")
	m := &runnerpb.Tensor{Name: "m", Datatype: "BOOL", Shape: []int64{2}, Data: []byte{1, 0}}

	got, err := testIO().orderInputs([]*runnerpb.Tensor{m, s, x})
	if err != nil {
		t.Fatal(err)
	}
	if got[0].tensor != x || got[1].tensor != s || got[2].tensor != m {
		t.Errorf("inputs not in model order: %v", got)
	}
	if got[0].elements != 6 {
		t.Errorf("x elements = %d, want 6", got[0].elements)
	}
	if want := []string{"hello", "", "wörld"}; !slices.Equal(got[1].strings, want) {
		t.Errorf("s strings = %q, want %q", got[1].strings, want)
	}
}

func TestOrderInputsRejects(t *testing.T) {
	x := func(mod func(*runnerpb.Tensor)) *runnerpb.Tensor {
		t := &runnerpb.Tensor{Name: "x", Datatype: "FP32", Shape: []int64{2, 3}, Data: make([]byte, 24)}
		if mod != nil {
			mod(t)
		}
		return t
	}
	s := bytesTensor("s", "a")
	m := &runnerpb.Tensor{Name: "m", Datatype: "BOOL", Shape: []int64{2}, Data: []byte{1, 0}}
	tests := []struct {
		name   string
		inputs []*runnerpb.Tensor
		want   string
	}{
		{"unknown name", []*runnerpb.Tensor{x(nil), s, m, {Name: "y", Datatype: "FP32"}}, `no input "y"`},
		{"missing", []*runnerpb.Tensor{x(nil), s}, `input "m" is missing`},
		{"twice", []*runnerpb.Tensor{x(nil), x(nil), s, m}, `input "x" given twice`},
		{"wrong datatype", []*runnerpb.Tensor{x(func(t *runnerpb.Tensor) { t.Datatype = "FP64"; t.Data = make([]byte, 48) }), s, m}, "datatype is FP64, the model expects FP32"},
		{"unknown datatype", []*runnerpb.Tensor{x(func(t *runnerpb.Tensor) { t.Datatype = "COMPLEX" }), s, m}, `unknown datatype "COMPLEX"`},
		{"wrong rank", []*runnerpb.Tensor{x(func(t *runnerpb.Tensor) { t.Shape = []int64{6} }), s, m}, "has rank 1, the model expects [?,3]"},
		{"wrong fixed dim", []*runnerpb.Tensor{x(func(t *runnerpb.Tensor) { t.Shape = []int64{3, 2} }), s, m}, "does not fit the model's [?,3] at dimension 1"},
		{"negative dim", []*runnerpb.Tensor{x(func(t *runnerpb.Tensor) { t.Shape = []int64{-2, 3} }), s, m}, "negative"},
		{"short data", []*runnerpb.Tensor{x(func(t *runnerpb.Tensor) { t.Data = t.Data[:20] }), s, m}, "data has 20 bytes, shape [2 3] of FP32 needs 24"},
		{"long data", []*runnerpb.Tensor{x(func(t *runnerpb.Tensor) { t.Data = make([]byte, 28) }), s, m}, "needs 24"},
		{"bad bool", []*runnerpb.Tensor{x(nil), s, {Name: "m", Datatype: "BOOL", Shape: []int64{2}, Data: []byte{1, 7}}}, "BOOL element 1 is 7"},
		{"bytes count", []*runnerpb.Tensor{x(nil), {Name: "s", Datatype: "BYTES", Shape: []int64{2}, Data: s.Data}, m}, "holds 1 elements, shape needs 2"},
		{"bytes NUL", []*runnerpb.Tensor{x(nil), bytesTensor("s", "a\x00b"), m}, "NUL"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := testIO().orderInputs(tt.inputs)
			if !errors.Is(err, ErrInvalidTensor) {
				t.Fatalf("err = %v, want ErrInvalidTensor", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("err = %q, want it to contain %q", err, tt.want)
			}
		})
	}
}

func TestCheckShapeUnknownRank(t *testing.T) {
	// ORT reports unknown-rank tensors with no dimensions: accept any shape.
	if err := checkShape(nil, []int64{4, 5}); err != nil {
		t.Errorf("checkShape(nil, [4 5]) = %v", err)
	}
	if err := checkShape(nil, []int64{}); err != nil {
		t.Errorf("checkShape(nil, []) = %v", err)
	}
}

func TestSelectOutputs(t *testing.T) {
	tests := []struct {
		names []string
		want  []int
		err   string
	}{
		{nil, []int{0, 1}, ""},
		{[]string{"b"}, []int{1}, ""},
		{[]string{"b", "a"}, []int{1, 0}, ""},
		{[]string{"c"}, nil, `no output "c"`},
		{[]string{"a", "a"}, nil, `output "a" requested twice`},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.names, ","), func(t *testing.T) {
			got, err := testIO().selectOutputs(tt.names)
			if tt.err != "" {
				if !errors.Is(err, ErrInvalidTensor) || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err = %v, want ErrInvalidTensor containing %q", err, tt.err)
				}
				return
			}
			if err != nil || !slices.Equal(got, tt.want) {
				t.Errorf("selectOutputs(%q) = %v, %v; want %v", tt.names, got, err, tt.want)
			}
		})
	}
}

func TestProtoRoundTrip(t *testing.T) {
	specs := []TensorSpec{{Name: "x", DataType: BF16, Shape: []int64{-1, 2}}}
	back, err := specsFromProto(specsToProto(specs))
	if err != nil || len(back) != 1 || back[0].Name != "x" || back[0].DataType != BF16 || !slices.Equal(back[0].Shape, specs[0].Shape) {
		t.Errorf("specs round trip = %v, %v", back, err)
	}
	if _, err := specsFromProto([]*runnerpb.TensorSpec{{Name: "x", Datatype: "FP8"}}); err == nil {
		t.Error("specsFromProto accepted FP8")
	}

	req := requestToProto(&InferRequest{
		Inputs:  []Tensor{{Name: "x", DataType: Int16, Shape: []int64{1}, Data: []byte{1, 2}}},
		Outputs: []string{"y"},
	})
	if in := req.GetInputs()[0]; in.GetDatatype() != "INT16" || string(in.GetData()) != "\x01\x02" || req.GetOutputs()[0] != "y" {
		t.Errorf("requestToProto = %v", req)
	}

	resp, err := responseFromProto(&runnerpb.InferResponse{
		Outputs: []*runnerpb.Tensor{{Name: "y", Datatype: "UINT8", Shape: []int64{2}, Data: []byte{3, 4}}},
		InputNs: 1, InferNs: 2000, OutputNs: 3,
	})
	if err != nil {
		t.Fatal(err)
	}
	if o := resp.Outputs[0]; o.DataType != Uint8 || string(o.Data) != "\x03\x04" || resp.Timing.Infer != 2000 || resp.Timing.Input != 1 || resp.Timing.Output != 3 {
		t.Errorf("responseFromProto = %+v", resp)
	}
	if _, err := responseFromProto(&runnerpb.InferResponse{Outputs: []*runnerpb.Tensor{{Name: "y", Datatype: "?"}}}); err == nil {
		t.Error("responseFromProto accepted datatype ?")
	}
}

func TestFormatShape(t *testing.T) {
	if got := formatShape([]int64{-1, 3, -1}); got != "[?,3,?]" {
		t.Errorf("formatShape = %s", got)
	}
	if got := formatShape(nil); got != "[]" {
		t.Errorf("formatShape(nil) = %s", got)
	}
}
