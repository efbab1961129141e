package api

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	goruntime "runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/qos"
)

// peekInferModel reads model_name and model_version from the first bytes
// only when the message starts with them.
func TestPeekInferModel(t *testing.T) {
	wire := func(m *inference.ModelInferRequest) []byte {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	full := wire(&inference.ModelInferRequest{ModelName: "det", ModelVersion: "3", Id: "x",
		RawInputContents: [][]byte{make([]byte, 100)}})
	noVersion := wire(&inference.ModelInferRequest{ModelName: "det", Id: "x"})
	noName := wire(&inference.ModelInferRequest{ModelVersion: "3", Id: "x"})
	// The same fields, written version first (an encoder of its own).
	reordered := append(wire(&inference.ModelInferRequest{ModelVersion: "3"}), wire(&inference.ModelInferRequest{ModelName: "det"})...)
	for _, tc := range []struct {
		name       string
		b          []byte
		model, ver string
		ok         bool
	}{
		{"name and version", full, "det", "3", true},
		{"name only", noVersion, "det", "", true},
		{"cut after the name's tag", full[:3], "", "", false},
		{"cut in the version", full[:7], "", "", false},
		{"no name", noName, "", "", false},
		{"another field order", reordered, "", "", false},
		{"empty", nil, "", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			model, ver, ok := peekInferModel(tc.b)
			if model != tc.model || ver != tc.ver || ok != tc.ok {
				t.Errorf("got %q %q %v, want %q %q %v", model, ver, ok, tc.model, tc.ver, tc.ok)
			}
		})
	}
}

// A ModelInferRequest its model would refuse is neither copied nor decoded:
// the codec asks the model from the message's first bytes, and the handler
// gets the refusal. Measured in bytes allocated per message, against the
// same message for a model that admits it: a refusal costs well under a
// hundredth of a decode, which allocates at least the tensor.
func TestGRPCRefusedMessageIsNotDecoded(t *testing.T) {
	refused := fmt.Errorf("%w: model busy", qos.ErrQueueFull)
	var asked []string
	c := newGRPCDecodeCodec(NewMemoryBudget(1<<40), func(name, version string) error {
		asked = append(asked, name+"/"+version)
		if name == "busy" {
			return refused
		}
		return nil
	})
	const tensor = 4 << 20
	wire := func(model string) mem.BufferSlice {
		b, err := proto.Marshal(&inference.ModelInferRequest{ModelName: model, ModelVersion: "1",
			Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1 << 20}}},
			RawInputContents: [][]byte{make([]byte, tensor)}})
		if err != nil {
			t.Fatal(err)
		}
		return mem.BufferSlice{mem.SliceBuffer(b)}
	}
	bytesPer := func(model string) (int64, *inference.ModelInferRequest, error) {
		const runs = 20
		data := wire(model)
		var req *inference.ModelInferRequest
		var err error
		var before, after goruntime.MemStats
		goruntime.GC()
		goruntime.ReadMemStats(&before)
		for range runs {
			req = &inference.ModelInferRequest{}
			if uerr := c.Unmarshal(data, req); uerr != nil {
				t.Fatal(uerr)
			}
			var res *Reservation
			res, err = c.takeDecoded(t.Context(), req)
			res.Release()
		}
		goruntime.ReadMemStats(&after)
		return int64(after.TotalAlloc-before.TotalAlloc) / runs, req, err
	}
	admittedBytes, req, err := bytesPer("sum")
	if err != nil || len(req.GetRawInputContents()) != 1 || len(req.GetRawInputContents()[0]) != tensor {
		t.Fatalf("admitted: %v, decoded %d raw inputs", err, len(req.GetRawInputContents()))
	}
	refusedBytes, req, err := bytesPer("busy")
	if !errors.Is(err, qos.ErrQueueFull) {
		t.Fatalf("refused: %v, want the model's refusal", err)
	}
	if req.GetModelName() != "" || req.GetRawInputContents() != nil {
		t.Errorf("the refused message was decoded: model %q, %d raw inputs", req.GetModelName(), len(req.GetRawInputContents()))
	}
	if admittedBytes < tensor {
		t.Fatalf("an admitted message allocated %d bytes, less than its %d-byte tensor: the measure is broken", admittedBytes, tensor)
	}
	if refusedBytes*100 > admittedBytes {
		t.Errorf("a refused message allocated %d bytes, an admitted one %d: want under 1/100", refusedBytes, admittedBytes)
	}
	if len(asked) != 40 || asked[0] != "sum/1" || asked[39] != "busy/1" {
		t.Errorf("preadmit asked %d times (%v ... ), want 40, with the model and version", len(asked), asked[:min(2, len(asked))])
	}
	t.Logf("bytes allocated per message: admitted %d, refused %d", admittedBytes, refusedBytes)
}

// Over gRPC, a ModelInfer call its model would refuse is answered
// RESOURCE_EXHAUSTED with the model's reason and never reaches Infer.
func TestGRPCPreadmitRefusesBeforeInfer(t *testing.T) {
	fb := newFakeBackend()
	fb.preadmitErr = fmt.Errorf("%w: model sum: 256 queued", qos.ErrQueueFull)
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, fb, grpcTestLimits))
	req := &inference.ModelInferRequest{ModelName: "sum",
		Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1, 4},
			Contents: &inference.InferTensorContents{Fp32Contents: []float32{1, 2, 3, 4}}}}}
	_, err := c.ModelInfer(t.Context(), req)
	if st := status.Convert(err); st.Code() != codes.ResourceExhausted || st.Message() != fb.preadmitErr.Error() {
		t.Errorf("refused call: %v, want RESOURCE_EXHAUSTED %q", err, fb.preadmitErr)
	}
	fb.mu.Lock()
	calls, last := fb.preadmitCalls, fb.lastReq
	fb.preadmitErr = nil
	fb.mu.Unlock()
	if calls != 1 || last != nil {
		t.Errorf("preadmit asked %d times, Infer saw %v; want 1, nothing", calls, last)
	}
	if _, err := c.ModelInfer(t.Context(), req); err != nil {
		t.Errorf("the same call once the model admits: %v", err)
	}
}

// A ModelInferRequest that an interceptor refuses (authentication does)
// never reaches its handler, which is what takes the codec's reservation
// of its decoded form: the call's end gives it back, and nothing of the
// call stays in the budget or in the codec.
func TestGRPCRefusedByInterceptorLeavesNothing(t *testing.T) {
	lim := Limits{MaxRequestBytes: 8 << 20, Memory: NewMemoryBudget(1 << 30)}
	denied := status.Error(codes.Unauthenticated, "no credentials")
	var refused atomic.Int64
	refuse := grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if info.FullMethod == inference.GRPCInferenceService_ModelInfer_FullMethodName {
			refused.Add(1)
			return nil, denied
		}
		return h(ctx, req)
	})
	srv := NewGRPC(newFakeBackend(), lim, slog.New(slog.DiscardHandler), refuse)
	client := inference.NewGRPCInferenceServiceClient(serveGRPC(t, srv))
	const calls = 20
	req := &inference.ModelInferRequest{ModelName: "m", ModelVersion: "1",
		Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1 << 18}}},
		RawInputContents: [][]byte{make([]byte, 1<<20)}}
	for range calls {
		if _, err := client.ModelInfer(t.Context(), req); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("ModelInfer: %v, want Unauthenticated", err)
		}
	}
	if refused.Load() != calls {
		t.Fatalf("the interceptor refused %d calls, want %d", refused.Load(), calls)
	}
	// The stats handler's End runs after the status is written: a
	// graceful stop waits for every call's end.
	srv.GracefulStop()
	held := lim.Memory.Used()
	if held != 0 {
		t.Errorf("after %d refused calls of 1 MiB the budget holds %d bytes (%.1f per call), want 0", calls, held, float64(held)/calls)
	}
	if lim.Memory.Peak() < 1<<20 {
		t.Errorf("peak %d bytes: the calls never reserved their messages", lim.Memory.Peak())
	}
}

// busyBackend refuses every request for one model before its message is
// decoded, as a model whose queue is full does.
type busyBackend struct {
	*fakeBackend
	busy string
}

func (b busyBackend) Preadmit(_ context.Context, name, _ string, _ time.Time) error {
	if name == b.busy {
		return fmt.Errorf("%w: %s holds 8 requests", qos.ErrQueueFull, name)
	}
	return nil
}

// ModelMesh names the model a call is for in its mm-model-id (or
// mm-model-id-bin) header, whatever the message's model_name says. The
// refusal from the message's first bytes is about the model the message
// names: when the header names another, the message is decoded and served
// by the header's model, not refused for the other's queue.
func TestGRPCPeekRefusalFollowsModelMeshHeader(t *testing.T) {
	fb := newFakeBackend()
	lim := grpcTestLimits
	lim.Memory = NewMemoryBudget(1 << 30)
	srv := NewGRPC(busyBackend{fakeBackend: fb, busy: "echo"}, lim, slog.New(slog.DiscardHandler))
	c := inference.NewGRPCInferenceServiceClient(serveGRPC(t, srv))
	req := grpcSumRequest(true)
	req.ModelName = "echo" // busy; the header names sum
	for _, tc := range []struct {
		name string
		md   metadata.MD
		code codes.Code
	}{
		{"no header: refused for echo", nil, codes.ResourceExhausted},
		{"mm-model-id names sum", metadata.Pairs(ModelMeshModelIDHeader, "sum"), codes.OK},
		{"mm-model-id-bin names sum", metadata.Pairs(ModelMeshModelIDBinHeader, "sum"), codes.OK},
		{"mm-model-id names echo", metadata.Pairs(ModelMeshModelIDHeader, "echo"), codes.ResourceExhausted},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := t.Context()
			if tc.md != nil {
				ctx = metadata.NewOutgoingContext(ctx, tc.md)
			}
			resp, err := c.ModelInfer(ctx, req)
			if status.Code(err) != tc.code {
				t.Fatalf("%v, want %v", err, tc.code)
			}
			if tc.code == codes.ResourceExhausted && !strings.Contains(err.Error(), "echo holds 8 requests") {
				t.Errorf("%v, want echo's refusal", err)
			}
			if tc.code == codes.OK {
				if resp.GetModelName() != "sum" || len(resp.GetRawOutputContents()) == 0 ||
					!bytes.Equal(resp.GetRawOutputContents()[0], grpcFP32Bytes(10, 26)) {
					t.Errorf("response %v, want sum's y = [10 26]", resp)
				}
			}
		})
	}
	srv.GracefulStop()
	if held := lim.Memory.Used(); held != 0 {
		t.Errorf("the budget holds %d bytes after the calls, want 0", held)
	}
}

// A call being read reserves the largest message it may send once: what
// decoding adds is reserved by the codec from the message itself, its
// decompressed or gathered copies by its length and the decoded
// structures by their estimate. (Twice the largest message per
// call let 32 calls be read at once in the default 4 GiB; at 10x overload
// over gRPC the detector's own slow-arriving calls filled it and 6,518 of
// 7,107 were refused at their headers.)
func TestGRPCReadingReservesOneMessage(t *testing.T) {
	const message = 16 << 20
	budget := NewMemoryBudget(3 * message)
	m := newGRPCMemory(budget, message, 0)
	m.methods.Store(&map[string]bool{inference.GRPCInferenceService_ModelInfer_FullMethodName: false})
	var calls []*Reservation
	for i := range 3 {
		ctx, err := m.reserve(t.Context(), inference.GRPCInferenceService_ModelInfer_FullMethodName, nil, 0)
		if err != nil {
			t.Fatalf("call %d of 3 in a budget of three messages: %v", i+1, err)
		}
		calls = append(calls, grpcCallMemory(ctx))
	}
	if _, err := m.reserve(t.Context(), inference.GRPCInferenceService_ModelInfer_FullMethodName, nil, 0); !errors.Is(err, errMemory) {
		t.Errorf("a fourth call: %v, want errMemory", err)
	}
	if got := budget.Used(); got != 3*message {
		t.Errorf("three calls being read hold %d bytes, want %d", got, 3*message)
	}
	for _, r := range calls {
		r.Release()
	}

	b, err := proto.Marshal(&inference.ModelInferRequest{ModelName: "m",
		Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1 << 20}}},
		RawInputContents: [][]byte{make([]byte, 4<<20)}})
	if err != nil {
		t.Fatal(err)
	}
	// Room for the message (decompressed, had it been compressed) and
	// its decoded copy, not also for a gathered one.
	small := NewMemoryBudget(int64(len(b)) * 5 / 2)
	c := newGRPCDecodeCodec(small, nil)
	for _, tc := range []struct {
		name string
		data mem.BufferSlice
		want string // "" when decoded
	}{
		{"one buffer", mem.BufferSlice{mem.SliceBuffer(b)}, ""},
		// Received in pieces, gathered and decoded: 12 MiB, over the 10.
		{"two pieces", mem.BufferSlice{mem.SliceBuffer(b[:len(b)/2]), mem.SliceBuffer(b[len(b)/2:])}, "limits.max_memory"},
	} {
		req := &inference.ModelInferRequest{}
		if err := c.Unmarshal(tc.data, req); err != nil {
			t.Fatalf("%s: Unmarshal: %v", tc.name, err)
		}
		res, err := c.takeDecoded(t.Context(), req)
		switch {
		case tc.want == "" && (err != nil || len(req.GetRawInputContents()) != 1 || len(req.GetRawInputContents()[0]) != 4<<20):
			t.Errorf("%s: %v, want decoded with its 4 MiB tensor", tc.name, err)
		case tc.want != "" && (!errors.Is(err, errMemory) || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: %v, want errMemory %q", tc.name, err, tc.want)
		}
		res.Release()
		if small.Used() != 0 {
			t.Errorf("%s: %d bytes still reserved", tc.name, small.Used())
		}
	}
}
