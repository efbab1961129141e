package api

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/qos"
)

// countingListener counts the bytes the server reads from its connections.
type countingListener struct {
	net.Listener
	read *atomic.Int64
}

func (l countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return countingConn{Conn: c, read: l.read}, nil
}

type countingConn struct {
	net.Conn
	read *atomic.Int64
}

func (c countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.read.Add(int64(n))
	return n, err
}

// While the server is at its limit on requests in flight, a ModelInfer call
// over a real socket is refused with RESOURCE_EXHAUSTED from its headers:
// its 32 MiB message is not read (the server reads at most a few flow
// control windows of it) and the backend never sees it. Other calls go on,
// and once the server has room the same call on the same connection is
// served.
func TestGRPCRefusedBeforeItsMessageIsRead(t *testing.T) {
	var overloaded atomic.Bool
	overloaded.Store(true)
	refuse := func() error {
		if overloaded.Load() {
			return fmt.Errorf("%w: limit 4", qos.ErrOverloaded)
		}
		return nil
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var read atomic.Int64
	fb := newFakeBackend()
	srv := NewGRPC(fb, Limits{MaxRequestBytes: 64 << 20, MaxTensorElements: 1 << 24, RefuseUnread: refuse}, slog.New(slog.DiscardHandler))
	go srv.Serve(countingListener{Listener: lis, read: &read})
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(1<<30)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	c := inference.NewGRPCInferenceServiceClient(conn)
	if _, err := c.ServerLive(t.Context(), &inference.ServerLiveRequest{}); err != nil {
		t.Fatalf("ServerLive while overloaded: %v", err)
	}

	const size = 32 << 20
	big := grpcSumRequest(true)
	big.Inputs[0].Shape = []int64{2, size / 8}
	big.RawInputContents = [][]byte{make([]byte, size)}
	before := read.Load()
	_, err = c.ModelInfer(t.Context(), big)
	wantGRPCCode(t, err, codes.ResourceExhausted, "limit 4")
	if got := read.Load() - before; got > 4<<20 {
		t.Errorf("the server read %d bytes of a refused 32 MiB call, want a few flow-control windows at most", got)
	}
	fb.mu.Lock()
	seen := fb.lastReq
	fb.mu.Unlock()
	if seen != nil {
		t.Errorf("the backend saw the refused call")
	}
	t.Logf("refused after reading %d bytes of %d", read.Load()-before, size)

	overloaded.Store(false)
	resp, err := c.ModelInfer(context.Background(), grpcSumRequest(true))
	if err != nil || resp.ModelName != "sum" {
		t.Fatalf("with room again: %v, %v", resp, err)
	}
	if st, _ := status.FromError(err); st.Code() != codes.OK {
		t.Fatalf("with room again: %v", st)
	}
}
