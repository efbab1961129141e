package api

import (
	"context"
	"net"
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/runtime"
)

// A call's metadata as a typical client sends it, with a token.
func perfCallContext() context.Context {
	ctx := peer.NewContext(context.Background(), &peer.Peer{Addr: &net.TCPAddr{IP: net.ParseIP("192.0.2.7"), Port: 40000}})
	return metadata.NewIncomingContext(ctx, metadata.Pairs(
		"authorization", "Bearer "+testInferenceToken,
		"user-agent", "grpc-go/1.85.0",
		"content-type", "application/grpc",
		":authority", "localhost:8001",
		"grpc-accept-encoding", "identity,deflate,gzip",
		"x-request-id", "4b1c0f6e",
	))
}

// The per-call reads of one metadata key (the token, ModelMesh's model
// header) and the peer's loopback check copy nothing but the key's values:
// the whole metadata (a map and a slice per key) and the peer's address
// string were copied on every call.
func TestGRPCCallMetadataAllocations(t *testing.T) {
	ctx := perfCallContext()
	a, _ := newTestAuth(t, AuthOptions{InferenceToken: testInferenceToken})
	const infer = "/inference.GRPCInferenceService/ModelInfer"
	for _, tc := range []struct {
		name string
		f    func()
		max  float64
	}{
		{"grpcCheck", func() {
			if err := a.grpcCheck(ctx, infer, grpcAccess(infer)); err != nil {
				t.Fatal(err)
			}
		}, 1},
		{"meshModelName", func() { meshModelName(ctx, "m") }, 0},
		{"grpcAuthHeader", func() { grpcAuthHeader(ctx) }, 1},
	} {
		if n := testing.AllocsPerRun(100, tc.f); n > tc.max {
			t.Errorf("%s allocates %v times a call, want at most %v", tc.name, n, tc.max)
		}
	}
}

// The codec's own work on a ModelInferRequest, beyond proto.Unmarshal's,
// allocates only what the handler takes (its reservation, and the entry
// that keeps it until then): the refusal reasons were formatted on every
// call (two allocations each), and the message's copies held a
// reservation of their own.
func TestGRPCDecodeCodecAllocations(t *testing.T) {
	req := &inference.ModelInferRequest{
		ModelName:        "tiny",
		Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{1, 10}}},
		RawInputContents: [][]byte{make([]byte, 40)},
	}
	wire, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	data := mem.BufferSlice{mem.SliceBuffer(wire)}
	budget := NewMemoryBudget(1 << 30)
	codec := newGRPCDecodeCodec(budget, nil)
	bare := testing.AllocsPerRun(100, func() {
		if err := proto.Unmarshal(wire, &inference.ModelInferRequest{}); err != nil {
			t.Fatal(err)
		}
	})
	decode := func() {
		m := &inference.ModelInferRequest{}
		if err := codec.Unmarshal(data, m); err != nil {
			t.Fatal(err)
		}
		res, err := codec.takeDecoded(context.Background(), m)
		if err != nil || res.Size() <= 0 || m.GetModelName() != "tiny" {
			t.Fatalf("decoded %v, reservation %v, %v", m, res, err)
		}
		res.Release()
	}
	if n := testing.AllocsPerRun(100, decode); n-bare > 2 {
		t.Errorf("the codec allocates %v times beyond proto.Unmarshal's %v, want at most 2", n-bare, bare)
	}
	if used := budget.Used(); used != 0 {
		t.Errorf("%d bytes still reserved after the calls released theirs", used)
	}
}

// sinkInferResponse keeps what an allocation test builds on the heap,
// where the handler's would be.
var sinkInferResponse *inference.ModelInferResponse

// A response of one output is built in one allocation (it took four).
func TestEncodeGRPCInferResponseOneAllocation(t *testing.T) {
	out := &runtime.InferResponse{Outputs: []runtime.Tensor{{Name: "output_scalars", DataType: runtime.FP32, Shape: []int64{1}, Data: []byte{1, 2, 3, 4}}}}
	if n := testing.AllocsPerRun(100, func() { sinkInferResponse = encodeGRPCInferResponse("tiny", "1", "id-1", out) }); n > 1 {
		t.Errorf("encodeGRPCInferResponse of one output allocates %v times, want 1", n)
	}
	msg := encodeGRPCInferResponse("tiny", "1", "id-1", out)
	if msg.GetModelName() != "tiny" || msg.GetModelVersion() != "1" || msg.GetId() != "id-1" || len(msg.GetOutputs()) != 1 ||
		msg.GetOutputs()[0].GetName() != "output_scalars" || msg.GetOutputs()[0].GetDatatype() != "FP32" ||
		len(msg.GetRawOutputContents()) != 1 || string(msg.GetRawOutputContents()[0]) != "\x01\x02\x03\x04" {
		t.Errorf("response %v", msg)
	}
	// Its wire form is the one a response built field by field has.
	want := &inference.ModelInferResponse{ModelName: "tiny", ModelVersion: "1", Id: "id-1",
		Outputs:           []*inference.ModelInferResponse_InferOutputTensor{{Name: "output_scalars", Datatype: "FP32", Shape: []int64{1}}},
		RawOutputContents: [][]byte{{1, 2, 3, 4}}}
	if !proto.Equal(msg, want) {
		t.Errorf("response %v, want %v", msg, want)
	}
}
