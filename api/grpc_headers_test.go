package api

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
)

// callHeadersHeld bounds what the headers of a call from grpc-go or
// rawgrpc hold reserved: four times theirs, well under 1 KiB (content-type,
// te, the user agent, the authority, a deadline).
const callHeadersHeld = grpcHeaderHeld << 10

// TestGRPCUnaryHeadersReserved: grpc-go keeps a call's headers decoded
// for the call's life, up to four times their HTTP/2 size. A unary call
// with 48 KiB of headers whose message has not come yet holds, beside what
// a message on its connection is expected to take (at first the largest,
// 1 MiB), four times its headers, until it ends; a call whose headers do
// not fit beside that is refused, naming limits.max_memory, while a call
// with ordinary headers is served. (Counting the message only, the call
// held 1 MiB and the second was served.)
func TestGRPCUnaryHeadersReserved(t *testing.T) {
	const message = 1 << 20
	pad := strings.Repeat("a", 48<<10)
	padded := func(ctx context.Context) context.Context {
		return metadata.AppendToOutgoingContext(ctx, "x-pad", pad)
	}
	dial := func(addr string) *grpc.ClientConn {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}

	t.Run("held", func(t *testing.T) {
		srv, mem := newConnBudgetServer(message, 64<<20)
		addr := serveGRPCLimited(t, srv)
		client := inference.NewGRPCInferenceServiceClient(dial(addr))
		start := time.Now()
		if _, err := client.ModelInfer(t.Context(), grpcSumRequest(true)); err != nil {
			t.Fatal(err)
		}
		guard := max(time.Minute, 10000*time.Since(start))
		if !waitFor(guard, func() bool { return mem.Used() == 0 }) {
			t.Fatalf("%d bytes held once a call ended, want 0", mem.Used())
		}
		conn := dial(addr) // a connection of its own: its first message is expected at the largest
		ctx, cancel := context.WithCancel(padded(t.Context()))
		// A unary call whose headers are sent and whose message is not.
		if _, err := conn.NewStream(ctx, &grpc.StreamDesc{}, inference.GRPCInferenceService_ModelInfer_FullMethodName); err != nil {
			t.Fatal(err)
		}
		least := int64(message + grpcHeaderHeld*(len("x-pad")+len(pad)+32))
		most := least + callHeadersHeld
		if !waitFor(guard, func() bool { return mem.Used() >= least }) {
			t.Fatalf("a call with %d KiB of headers waiting for its message holds %d bytes, want at least %d", len(pad)>>10, mem.Used(), least)
		}
		if used := mem.Used(); used > most {
			t.Errorf("the call holds %d bytes, want at most %d", used, most)
		}
		cancel()
		if !waitFor(guard, func() bool { return mem.Used() == 0 }) {
			t.Errorf("%d bytes held once the call was cancelled, want 0", mem.Used())
		}
	})

	t.Run("refused", func(t *testing.T) {
		// Room for the message and 100 KiB: not for four times 48 KiB.
		srv, mem := newConnBudgetServer(message, message+100<<10)
		client := inference.NewGRPCInferenceServiceClient(dial(serveGRPCLimited(t, srv)))
		_, err := client.ModelInfer(padded(t.Context()), grpcSumRequest(true))
		if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "limits.max_memory") || !strings.Contains(err.Error(), "headers") {
			t.Errorf("a call with %d KiB of headers: %v, want RESOURCE_EXHAUSTED naming its headers and limits.max_memory", len(pad)>>10, err)
		}
		if _, err := client.ModelInfer(t.Context(), grpcSumRequest(true)); err != nil {
			t.Errorf("a call with ordinary headers: %v, want it served", err)
		}
		if !waitFor(time.Minute, func() bool { return mem.Used() == 0 }) {
			t.Errorf("%d bytes held once the calls ended, want 0", mem.Used())
		}
	})
}
