package api

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/runtime"
)

func TestGRPCDecodeInferTyped(t *testing.T) {
	for _, tc := range grpcEchoCases() {
		if tc.contents == nil {
			continue
		}
		t.Run(tc.dt, func(t *testing.T) {
			msg := &inference.ModelInferRequest{Inputs: []*inference.ModelInferRequest_InferInputTensor{
				{Name: "a", Datatype: tc.dt, Shape: tc.shape, Contents: tc.contents},
			}}
			req, err := decodeGRPCInfer(msg, grpcTestLimits, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			got := req.Inputs[0]
			if string(got.DataType) != tc.dt || !slices.Equal(got.Shape, tc.shape) || string(got.Data) != string(tc.raw) {
				t.Fatalf("got %+v, want data %x", got, tc.raw)
			}
		})
	}
}

func TestGRPCDecodeInferRawAliases(t *testing.T) {
	raw := grpcFP32Bytes(1, 2)
	msg := &inference.ModelInferRequest{
		Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "a", Datatype: "FP32", Shape: []int64{2}}},
		RawInputContents: [][]byte{raw},
	}
	req, err := decodeGRPCInfer(msg, grpcTestLimits, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if &req.Inputs[0].Data[0] != &raw[0] {
		t.Error("raw input data was copied")
	}
}

func TestGRPCDecodeInferRawWithEmptyContents(t *testing.T) {
	// Some clients send an empty contents message beside raw data.
	msg := &inference.ModelInferRequest{
		Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "a", Datatype: "INT64", Shape: []int64{1}, Contents: &inference.InferTensorContents{}}},
		RawInputContents: [][]byte{grpcInt64Bytes(-3)},
	}
	req, err := decodeGRPCInfer(msg, grpcTestLimits, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if string(req.Inputs[0].Data) != string(grpcInt64Bytes(-3)) {
		t.Fatalf("got data %x", req.Inputs[0].Data)
	}
}

func TestGRPCDecodeInferManyInputs(t *testing.T) {
	// Many inputs with a repeat at the end: found, and in linear time.
	msg := &inference.ModelInferRequest{}
	for i := range 50000 {
		msg.Inputs = append(msg.Inputs, &inference.ModelInferRequest_InferInputTensor{Name: fmt.Sprint(i), Datatype: "BOOL", Shape: []int64{0}})
	}
	if _, err := decodeGRPCInfer(msg, grpcTestLimits, time.Now()); err != nil {
		t.Fatal(err)
	}
	msg.Inputs = append(msg.Inputs, &inference.ModelInferRequest_InferInputTensor{Name: "17", Datatype: "BOOL", Shape: []int64{0}})
	if _, err := decodeGRPCInfer(msg, grpcTestLimits, time.Now()); err == nil || !strings.Contains(err.Error(), `input "17" appears more than once`) {
		t.Fatalf("got %v", err)
	}
}

func TestGRPCDecodeInferLimits(t *testing.T) {
	for _, tc := range []struct {
		name  string
		lim   Limits
		dt    string
		shape []int64
		code  codes.Code
		inMsg string
	}{
		{"at the limit", Limits{MaxTensorElements: 4}, "FP32", []int64{2, 2}, codes.InvalidArgument, "contents hold 0 elements, the shape needs 4"},
		{"over the limit", Limits{MaxTensorElements: 4}, "FP32", []int64{5}, codes.ResourceExhausted, "the limit is 4"},
		{"zero dim beats overflow", Limits{MaxTensorElements: 4}, "FP32", []int64{math.MaxInt64, 0, math.MaxInt64}, codes.OK, ""},
		{"zero after a large prefix", Limits{MaxTensorElements: 4}, "FP32", []int64{1 << 40, 1 << 20, 0}, codes.OK, ""},
		{"zero with a negative", Limits{}, "FP32", []int64{0, -1}, codes.InvalidArgument, "dimension 1 is -1"},
		{"bytes overflow without a limit", Limits{}, "FP64", []int64{math.MaxInt64 / 4}, codes.ResourceExhausted, "elements of 8 bytes"},
		{"product overflow", Limits{}, "UINT8", []int64{1 << 32, 1 << 32}, codes.InvalidArgument, "invalid shape"},
		{"negative", Limits{}, "UINT8", []int64{3, -2}, codes.InvalidArgument, "dimension 1 is -2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg := &inference.ModelInferRequest{Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "a", Datatype: tc.dt, Shape: tc.shape}}}
			_, err := decodeGRPCInfer(msg, tc.lim, time.Now())
			if tc.code == codes.OK {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if _, code := statusOf(err); code != tc.code || !strings.Contains(err.Error(), tc.inMsg) {
				t.Fatalf("got %s %v, want %s containing %q", code, err, tc.code, tc.inMsg)
			}
		})
	}
}

func TestGRPCEncodeInferResponse(t *testing.T) {
	y := runtime.Tensor{Name: "y", DataType: runtime.FP32, Shape: []int64{2}, Data: grpcFP32Bytes(10, 26)}
	s := runtime.Tensor{Name: "s", DataType: runtime.Bytes, Shape: []int64{1}, Data: runtime.AppendBytesElement(nil, []byte("hi"))}
	msg := encodeGRPCInferResponse("m", "3", "id-7", &runtime.InferResponse{Outputs: []runtime.Tensor{y, s}})
	want := &inference.ModelInferResponse{
		ModelName:    "m",
		ModelVersion: "3",
		Id:           "id-7",
		Outputs: []*inference.ModelInferResponse_InferOutputTensor{
			{Name: "y", Datatype: "FP32", Shape: []int64{2}},
			{Name: "s", Datatype: "BYTES", Shape: []int64{1}},
		},
		RawOutputContents: [][]byte{y.Data, s.Data},
	}
	if !proto.Equal(msg, want) {
		t.Fatalf("got %v\nwant %v", msg, want)
	}
	if &msg.RawOutputContents[0][0] != &y.Data[0] {
		t.Error("output data was copied")
	}
	// The message survives a wire round trip.
	b, err := proto.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	var back inference.ModelInferResponse
	if err := proto.Unmarshal(b, &back); err != nil || !proto.Equal(&back, want) {
		t.Fatalf("round trip: %v, %v", &back, err)
	}
}

func TestGRPCCheckModelName(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{"resnet50", true},
		{"ocr-det_v4.1", true},
		{"", false},
		{"..", false},
		{"../x", false},
		{"a/b", false},
		{"/abs", false},
		{`a\b`, false},
		{"a..b", false},
		{"a\x00b", false},
	} {
		err := grpcCheckModelName(tc.name)
		if (err == nil) != tc.ok {
			t.Errorf("grpcCheckModelName(%q) = %v, want ok=%v", tc.name, err, tc.ok)
		}
		if err != nil && !errors.Is(err, errBadRequest) {
			t.Errorf("grpcCheckModelName(%q) = %v, not a bad request", tc.name, err)
		}
	}
}
