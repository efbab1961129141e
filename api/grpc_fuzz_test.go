package api

import (
	"math"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/runtime"
)

// FuzzDecodeModelInfer decodes arbitrary ModelInferRequest messages with
// small limits. Decoding must not panic; a decoded request must keep every
// input, with data that matches its datatype and shape; a refusal must be a
// client error, never INTERNAL.
func FuzzDecodeModelInfer(f *testing.F) {
	type input = inference.ModelInferRequest_InferInputTensor
	seeds := []*inference.ModelInferRequest{
		grpcSumRequest(false),
		grpcSumRequest(true),
		{Inputs: []*input{{Name: "s", Datatype: "BYTES", Shape: []int64{2}, Contents: &inference.InferTensorContents{BytesContents: [][]byte{[]byte("a"), nil}}}}},
		{Inputs: []*input{{Name: "s", Datatype: "BYTES", Shape: []int64{1}}}, RawInputContents: [][]byte{{2, 0, 0, 0, 'h', 'i'}}},
		{Inputs: []*input{{Name: "h", Datatype: "FP16", Shape: []int64{1, 1}}}, RawInputContents: [][]byte{{0, 0x3c}}},
		{Inputs: []*input{{Name: "u", Datatype: "UINT8", Shape: []int64{2}, Contents: &inference.InferTensorContents{UintContents: []uint32{1, 300}}}}},
		{Inputs: []*input{{Name: "i", Datatype: "INT8", Shape: []int64{1}, Contents: &inference.InferTensorContents{IntContents: []int32{-1}}}}},
		{Inputs: []*input{{Name: "b", Datatype: "BOOL", Shape: []int64{1}, Contents: &inference.InferTensorContents{BoolContents: []bool{true}}}}},
		{Inputs: []*input{{Name: "n", Datatype: "FP32", Shape: []int64{-1}}}},
		{Inputs: []*input{{Name: "o", Datatype: "FP64", Shape: []int64{math.MaxInt64, math.MaxInt64}}}},
		{Inputs: []*input{{Name: "a", Datatype: "FP32", Shape: []int64{1}}, {Name: "a", Datatype: "FP32", Shape: []int64{1}}}, RawInputContents: [][]byte{grpcFP32Bytes(1), grpcFP32Bytes(2)}},
		{Inputs: []*input{{Name: "a", Datatype: "INT64", Shape: []int64{1}, Contents: &inference.InferTensorContents{Int64Contents: []int64{1}}}}, RawInputContents: [][]byte{grpcInt64Bytes(1)}},
		{Inputs: []*input{{Name: "a", Datatype: "FLOAT", Shape: []int64{1}}}},
		{Inputs: []*input{{Name: "a", Datatype: "FP32", Shape: []int64{0}}}, Parameters: map[string]*inference.InferParameter{
			"timeout": grpcInt64(250000), "priority": grpcUint64(2)}},
		{Inputs: []*input{{Name: "a", Datatype: "FP32", Shape: []int64{0}}}, Parameters: map[string]*inference.InferParameter{
			"timeout": grpcInt64(math.MinInt64), "priority": grpcUint64(math.MaxUint64)}},
		// Hostile: shapes far beyond the data, products past int64 and
		// past int64 bytes, raw entries that do not match the inputs.
		{Inputs: []*input{{Name: "x", Datatype: "FP32", Shape: []int64{1, 1 << 40}}}, RawInputContents: [][]byte{grpcFP32Bytes(1)}},
		{Inputs: []*input{{Name: "x", Datatype: "FP32", Shape: []int64{8, 8}, Contents: &inference.InferTensorContents{Fp32Contents: []float32{1}}}}},
		{Inputs: []*input{{Name: "x", Datatype: "INT64", Shape: []int64{1 << 61}}}, RawInputContents: [][]byte{grpcInt64Bytes(1)}},
		{Inputs: []*input{{Name: "x", Datatype: "FP32", Shape: []int64{1 << 32, 1 << 32, 0}}}, RawInputContents: [][]byte{nil}},
		{Inputs: []*input{{Name: "x", Datatype: "FP32", Shape: []int64{1}}}, RawInputContents: [][]byte{grpcFP32Bytes(1), grpcFP32Bytes(2)}},
		{Inputs: []*input{{Name: "s", Datatype: "BYTES", Shape: []int64{2}}}, RawInputContents: [][]byte{{0xff, 0xff, 0xff, 0xff, 0xfe}}},
	}
	for _, s := range seeds {
		b, err := proto.Marshal(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	lim := Limits{MaxRequestBytes: 1 << 12, MaxTensorElements: 64}
	f.Fuzz(func(t *testing.T, data []byte) {
		var msg inference.ModelInferRequest
		if err := proto.Unmarshal(data, &msg); err != nil {
			t.Skip()
		}
		arrival := time.Now()
		req, err := decodeGRPCInfer(&msg, lim, arrival)
		if err != nil {
			if _, code := statusOf(err); code != codes.InvalidArgument && code != codes.ResourceExhausted {
				t.Fatalf("refusal %v has code %s", err, code)
			}
			return
		}
		if d := req.Deadline.Sub(arrival); !req.Deadline.IsZero() && (d <= 0 || d > maxRequestTimeout) || req.Priority < 0 {
			t.Fatalf("accepted deadline arrival+%v, priority %d", d, req.Priority)
		}
		if len(req.Inputs) != len(msg.GetInputs()) {
			t.Fatalf("%d inputs decoded from %d", len(req.Inputs), len(msg.GetInputs()))
		}
		for _, in := range req.Inputs {
			// A 0 anywhere makes the tensor empty, however large the other
			// dimensions; runtime.ElementCount may stop before it sees it.
			var n int64
			if !slices.Contains(in.Shape, 0) {
				var err error
				if n, err = runtime.ElementCount(in.Shape, lim.MaxTensorElements); err != nil {
					t.Fatalf("input %q was accepted with shape %v: %v", in.Name, in.Shape, err)
				}
			} else if slices.ContainsFunc(in.Shape, func(d int64) bool { return d < 0 }) {
				t.Fatalf("input %q was accepted with shape %v", in.Name, in.Shape)
			}
			if !in.DataType.Valid() {
				t.Fatalf("input %q was accepted with datatype %q", in.Name, in.DataType)
			}
			if in.DataType == runtime.Bytes {
				if _, err := runtime.SplitBytes(in.Data, n); err != nil {
					t.Fatalf("input %q: %v", in.Name, err)
				}
			} else if int64(len(in.Data)) != in.DataType.ByteSize(n) {
				t.Fatalf("input %q %s %v has %d bytes", in.Name, in.DataType, in.Shape, len(in.Data))
			}
		}
	})
}
