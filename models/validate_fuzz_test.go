package models

import (
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/runtime"
)

// FuzzValidate checks requests against a model's metadata, as the registry
// does for every request after the protocol layer has decoded it. The
// tensors are taken from a ModelInferRequest as they are (raw contents only,
// nothing checked first), so validation sees what no decoder would pass:
// negative and overflowing dimensions, data of any length, unknown
// datatypes. It must not panic; what it accepts must match the metadata
// exactly.
func FuzzValidate(f *testing.F) {
	type input = inference.ModelInferRequest_InferInputTensor
	seeds := []*inference.ModelInferRequest{
		{Inputs: []*input{{Name: "x", Datatype: "FP32", Shape: []int64{2, 4}}, {Name: "ids", Datatype: "INT64", Shape: []int64{2}}},
			RawInputContents: [][]byte{make([]byte, 32), make([]byte, 16)}},
		{Inputs: []*input{{Name: "x", Datatype: "FP32", Shape: []int64{1, 1 << 40}}, {Name: "ids", Datatype: "INT64", Shape: []int64{1}}},
			RawInputContents: [][]byte{make([]byte, 4), make([]byte, 8)}},
		{Inputs: []*input{{Name: "x", Datatype: "FP32", Shape: []int64{-1, 4}}}, RawInputContents: [][]byte{nil}},
		{Inputs: []*input{{Name: "x", Datatype: "FP32", Shape: []int64{1 << 62, 4}}, {Name: "ids", Datatype: "INT64", Shape: []int64{1 << 61}}},
			RawInputContents: [][]byte{nil, nil}},
		{Inputs: []*input{{Name: "x", Datatype: "FP32", Shape: []int64{9, 4}}, {Name: "ids", Datatype: "INT64", Shape: []int64{9}}},
			RawInputContents: [][]byte{make([]byte, 144), make([]byte, 72)}},
		{Inputs: []*input{{Name: "x", Datatype: "FP32", Shape: []int64{1, 4}}, {Name: "x", Datatype: "FP32", Shape: []int64{1, 4}}},
			RawInputContents: [][]byte{make([]byte, 16), make([]byte, 16)}},
		{Inputs: []*input{{Name: "x", Datatype: "BYTES", Shape: []int64{1, 4}}, {Name: "ids", Datatype: "INT64", Shape: []int64{1}}},
			RawInputContents: [][]byte{{1, 0, 0, 0, 0xff}, make([]byte, 8)}},
		{Inputs: []*input{{Name: "x", Datatype: "FP32", Shape: []int64{1, 4}}, {Name: "ids", Datatype: "INT64", Shape: []int64{2}}},
			RawInputContents: [][]byte{make([]byte, 16), make([]byte, 16)}, Outputs: []*inference.ModelInferRequest_InferRequestedOutputTensor{{Name: "nope"}}},
	}
	for _, s := range seeds {
		b, err := proto.Marshal(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, int64(0))
		f.Add(b, int64(64))
	}
	v := &version{
		model:    "m",
		maxBatch: 8,
		inputs: []runtime.TensorSpec{
			{Name: "x", DataType: runtime.FP32, Shape: []int64{-1, 4}},
			{Name: "ids", DataType: runtime.Int64, Shape: []int64{-1}},
		},
		outputs: []runtime.TensorSpec{{Name: "y", DataType: runtime.FP32, Shape: []int64{-1}}},
	}
	f.Fuzz(func(t *testing.T, data []byte, maxElements int64) {
		var msg inference.ModelInferRequest
		if proto.Unmarshal(data, &msg) != nil {
			t.Skip()
		}
		req := &runtime.InferRequest{}
		raw := msg.GetRawInputContents()
		for i, in := range msg.GetInputs() {
			tensor := runtime.Tensor{Name: in.GetName(), DataType: runtime.DataType(in.GetDatatype()), Shape: in.GetShape()}
			if i < len(raw) {
				tensor.Data = raw[i]
			}
			req.Inputs = append(req.Inputs, tensor)
		}
		for _, out := range msg.GetOutputs() {
			req.Outputs = append(req.Outputs, out.GetName())
		}
		batch, err := v.validate(req, maxElements)
		if err != nil {
			return
		}
		if batch < 1 || batch > v.maxBatch {
			t.Fatalf("accepted batch %d", batch)
		}
		if len(req.Inputs) != len(v.inputs) {
			t.Fatalf("accepted %d inputs for %d", len(req.Inputs), len(v.inputs))
		}
		for _, in := range req.Inputs {
			n, err := runtime.ElementCount(in.Shape, maxElements)
			if err != nil {
				t.Fatalf("input %q accepted with shape %v: %v", in.Name, in.Shape, err)
			}
			if in.Shape[0] != int64(batch) {
				t.Fatalf("input %q has batch %d, validate said %d", in.Name, in.Shape[0], batch)
			}
			size := int64(in.DataType.Size())
			if size <= 0 || int64(len(in.Data)) != n*size || n > (1<<62)/size {
				t.Fatalf("input %q %s %v accepted with %d bytes", in.Name, in.DataType, in.Shape, len(in.Data))
			}
		}
		for _, o := range req.Outputs {
			if o != "y" {
				t.Fatalf("accepted output %q", o)
			}
		}
	})
}
