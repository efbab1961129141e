package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/runtime"
)

// Every request on a stream is answered once, with its id; a bad request
// gets error_message and ends only itself.
func TestGRPCModelStreamInfer(t *testing.T) {
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, newFakeBackend(), grpcTestLimits))
	stream, err := c.ModelStreamInfer(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{} // id -> error substring, "" for success
	for i := range 6 {
		req := grpcSumRequest(i%2 == 0)
		req.Id = fmt.Sprintf("good-%d", i)
		want[req.Id] = ""
		if err := stream.Send(req); err != nil {
			t.Fatal(err)
		}
		if i == 2 {
			bad := grpcSumRequest(true)
			bad.Id, bad.ModelName = "unknown-model", "nope"
			want[bad.Id] = `model not found: "nope"`
			wrong := grpcSumRequest(true)
			wrong.Id, wrong.Inputs[0].Shape = "bad-shape", []int64{2, 3}
			want[wrong.Id] = "raw data has 32 bytes"
			for _, r := range []*inference.ModelInferRequest{bad, wrong} {
				if err := stream.Send(r); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for {
		a, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("stream ended with %v after %d answers", err, len(seen))
		}
		id := a.GetInferResponse().GetId()
		wantErr, ok := want[id]
		switch {
		case !ok || seen[id]:
			t.Errorf("unexpected answer for id %q", id)
		case wantErr == "" && a.GetErrorMessage() != "":
			t.Errorf("%s: error %q", id, a.GetErrorMessage())
		case wantErr == "" && (len(a.GetInferResponse().GetOutputs()) != 2 || a.GetInferResponse().GetModelVersion() != "1"):
			t.Errorf("%s: response %v", id, a.GetInferResponse())
		case wantErr != "" && !strings.Contains(a.GetErrorMessage(), wantErr):
			t.Errorf("%s: error %q, want it to contain %q", id, a.GetErrorMessage(), wantErr)
		}
		seen[id] = true
	}
	if len(seen) != len(want) {
		t.Errorf("%d answers, want %d", len(seen), len(want))
	}
}

// countingBackend counts the inferences a backend runs.
type countingBackend struct {
	*fakeBackend
	calls atomic.Int64
}

func (b *countingBackend) Infer(ctx context.Context, name, version string, req *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	b.calls.Add(1)
	return b.fakeBackend.Infer(ctx, name, version, req)
}

// A client that sends and never reads stalls its own stream: the server
// stops reading once its in-flight slots hold unsent answers, so what it
// runs (and holds) stays bounded, and everything is answered once the
// client reads.
func TestGRPCModelStreamInferSlowReader(t *testing.T) {
	const (
		slots    = 4
		requests = 60
		size     = 256 << 10 // well over the flow-control windows below
	)
	b := &countingBackend{fakeBackend: newFakeBackend()}
	// Fixed 64 KiB windows on both sides (no window growth): what the
	// transport may buffer beyond the handler is under one message.
	srv := NewGRPC(b, Limits{MaxRequestBytes: 1 << 20, MaxTensorElements: 1 << 20, StreamInflight: slots},
		slog.New(slog.DiscardHandler), grpc.InitialWindowSize(64<<10), grpc.InitialConnWindowSize(64<<10))
	lis := bufconn.Listen(64 << 10)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	conn, err := grpc.NewClient("passthrough:///bufconn",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(64<<10), grpc.WithInitialConnWindowSize(64<<10),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(1<<30)),
	)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
		<-served
	})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	stream, err := inference.NewGRPCInferenceServiceClient(conn).ModelStreamInfer(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var sent atomic.Int64
	sendDone := make(chan error, 1)
	go func() {
		for i := range requests {
			req := &inference.ModelInferRequest{
				ModelName: "echo", Id: fmt.Sprint(i),
				Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "b", Datatype: "UINT8", Shape: []int64{size}}},
				RawInputContents: [][]byte{make([]byte, size)},
			}
			if err := stream.Send(req); err != nil {
				sendDone <- err
				return
			}
			sent.Add(1)
		}
		sendDone <- stream.CloseSend()
	}()

	// Wait until the server has stopped running more: the count holds
	// still for a while.
	var settled int64
	for stable, last := 0, int64(-1); stable < 10; {
		time.Sleep(20 * time.Millisecond)
		if n := b.calls.Load(); n == last {
			stable++
		} else {
			stable, last = 0, n
		}
		settled = last
	}
	t.Logf("a stalled stream: %d requests run, %d sent", settled, sent.Load())
	// The slots' answers, plus at most one answer in the transport and
	// one request read as a slot frees.
	if settled > slots+2 {
		t.Errorf("with a client that does not read, the server ran %d requests; want at most %d", settled, slots+2)
	}
	if n := sent.Load(); n >= requests {
		t.Errorf("all %d sends went through against a stalled stream", n)
	}

	got := map[string]bool{}
	for len(got) < requests {
		a, err := stream.Recv()
		if err != nil {
			t.Fatalf("after %d answers: %v", len(got), err)
		}
		if a.GetErrorMessage() != "" || len(a.GetInferResponse().GetRawOutputContents()) != 1 || len(a.GetInferResponse().GetRawOutputContents()[0]) != size {
			t.Fatalf("answer %q: error %q", a.GetInferResponse().GetId(), a.GetErrorMessage())
		}
		got[a.GetInferResponse().GetId()] = true
	}
	if err := <-sendDone; err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
		t.Errorf("stream end: %v, want EOF", err)
	}
	if b.calls.Load() != requests {
		t.Errorf("%d inferences, want %d", b.calls.Load(), requests)
	}
}

// A client that goes away ends the handler and the requests it runs.
func TestGRPCModelStreamInferCancel(t *testing.T) {
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, newFakeBackend(), grpcTestLimits))
	ctx, cancel := context.WithCancel(t.Context())
	stream, err := c.ModelStreamInfer(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := stream.Send(grpcSumRequest(true)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	cancel()
	// Answers already on their way may arrive; then the stream ends.
	for i := 0; ; i++ {
		if _, err := stream.Recv(); err != nil {
			break
		}
		if i == 2 {
			t.Fatal("the stream goes on after cancel")
		}
	}
	// goleak (TestMain) checks that the handler's goroutines ended.
}

// BenchmarkGRPCStreamInfer compares requests over one ModelStreamInfer
// stream (window requests in flight) with unary ModelInfer calls made one
// after another, on the fake backend: the protocol's own cost.
func BenchmarkGRPCStreamInfer(b *testing.B) {
	c := inference.NewGRPCInferenceServiceClient(startGRPC(b, newFakeBackend(), grpcTestLimits))
	b.Run("unary", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := c.ModelInfer(b.Context(), grpcSumRequest(true)); err != nil {
				b.Fatal(err)
			}
		}
	})
	for _, window := range []int{1, DefaultStreamInflight} {
		b.Run(fmt.Sprintf("stream/window=%d", window), func(b *testing.B) {
			b.ReportAllocs()
			stream, err := c.ModelStreamInfer(b.Context())
			if err != nil {
				b.Fatal(err)
			}
			pending := 0
			for b.Loop() {
				if err := stream.Send(grpcSumRequest(true)); err != nil {
					b.Fatal(err)
				}
				if pending++; pending == window {
					if _, err := stream.Recv(); err != nil {
						b.Fatal(err)
					}
					pending--
				}
			}
			if err := stream.CloseSend(); err != nil {
				b.Fatal(err)
			}
			for {
				if _, err := stream.Recv(); err != nil {
					break
				}
			}
		})
	}
}

// TestGRPCStreamMessagesCounted: on a connection the server's listener
// accepted, with its frames followed, a ModelStreamInfer stream reserves
// its buffers only, and each 1 MiB message is counted as it arrives and
// given back once its handler has it: between messages the stream holds
// its buffers, not the messages it was sent, and nothing once it ends.
func TestGRPCStreamMessagesCounted(t *testing.T) {
	const message, header = 8 << 20, 16 << 10
	mem := NewMemoryBudget(256 << 20)
	srv := NewGRPC(newFakeBackend(), Limits{MaxRequestBytes: message, MaxTensorElements: 1 << 16, MaxHeaderBytes: header, Memory: mem},
		slog.New(slog.DiscardHandler), append(GRPCTransportOptions(), grpc.Creds(GRPCCredentials(nil)), grpc.MaxHeaderListSize(header))...)
	conn, err := grpc.NewClient(serveGRPCLimited(t, srv), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	stream, err := inference.NewGRPCInferenceServiceClient(conn).ModelStreamInfer(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	idle := GRPCStreamBytes(header)
	// A guard against a server that never gives back: far longer than
	// the first message's round trip.
	guard := time.Minute
	for i := range 10 {
		start := time.Now()
		req := grpcSumRequest(true)
		req.Id = fmt.Sprintf("big-%d", i)
		req.Parameters = map[string]*inference.InferParameter{
			"padding": {ParameterChoice: &inference.InferParameter_StringParam{StringParam: strings.Repeat("x", 1<<20)}},
		}
		if err := stream.Send(req); err != nil {
			t.Fatal(err)
		}
		a, err := stream.Recv()
		if err != nil || a.GetErrorMessage() != "" {
			t.Fatalf("message %d: %v %q", i, err, a.GetErrorMessage())
		}
		if i == 0 {
			guard = max(10*time.Second, 1000*time.Since(start))
		}
		// Its answer's memory comes back once written.
		if !waitFor(guard, func() bool { return mem.Used() == idle }) {
			t.Fatalf("after message %d: the budget holds %d bytes, want the stream's buffers' %d", i, mem.Used(), idle)
		}
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("the stream's end: %v", err)
	}
	if !waitFor(guard, func() bool { return mem.Used() == 0 }) {
		t.Errorf("the stream ended: the budget holds %d bytes, want 0", mem.Used())
	}
}
