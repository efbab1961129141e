package api

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/internal/rawgrpc"
)

// TestGRPCStreamID: the stream ID is read from grpc-go's stream (a field
// it does not export): calls on one connection are on streams 1, 3, 5.
func TestGRPCStreamID(t *testing.T) {
	ids := make(chan uint32, 3)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		id, ok := grpcStreamID(ctx)
		if !ok {
			t.Error("no stream ID read from grpc-go's stream")
		}
		ids <- id
		return h(ctx, req)
	}))
	inference.RegisterGRPCInferenceServiceServer(srv, &grpcService{b: newFakeBackend(), logger: slog.New(slog.DiscardHandler)})
	conn := serveGRPC(t, srv)
	for want := uint32(1); want <= 5; want += 2 {
		if _, err := inference.NewGRPCInferenceServiceClient(conn).ServerLive(t.Context(), &inference.ServerLiveRequest{}); err != nil {
			t.Fatal(err)
		}
		if got := <-ids; got != want {
			t.Errorf("stream ID %d, want %d", got, want)
		}
	}
}

// localhostTLS is a server certificate for 127.0.0.1 (httptest's) and the
// roots a client trusts it with.
func localhostTLS() ([]tls.Certificate, *x509.CertPool) {
	certs := httptest.NewUnstartedServer(nil)
	certs.StartTLS()
	certs.Close()
	roots := x509.NewCertPool()
	roots.AddCert(certs.Certificate())
	return certs.TLS.Certificates, roots
}

// TestGRPCUnreadAnswer: an answer the client never reads (it grants no
// window past grpc-go's smallest, 64 KiB) keeps the memory of its bytes
// not yet written after its call has ended, until limits.write_timeout
// passes with nothing written; then its connection is closed, the call
// ends UNAVAILABLE at the client, and the memory is given back. A client
// that resets such a call gives it back at once, its connection open; a
// client that reads gets its answer and gives it back at once.
func TestGRPCUnreadAnswer(t *testing.T) {
	// The frames are followed after TLS as on plain TCP.
	certs, roots := localhostTLS()
	for _, tc := range []struct {
		name           string
		server, client credentials.TransportCredentials
	}{
		{"plain", nil, insecure.NewCredentials()},
		{"TLS", credentials.NewTLS(&tls.Config{Certificates: certs}), credentials.NewTLS(&tls.Config{RootCAs: roots})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const size = 8 << 20
			req := &inference.ModelInferRequest{ModelName: "echo", Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "UINT8", Shape: []int64{size}}},
				RawInputContents: [][]byte{make([]byte, size)}}
			// serve starts a server whose write timeout is timeout.
			serve := func(timeout time.Duration) (*MemoryBudget, func(...grpc.DialOption) *grpc.ClientConn) {
				mem := NewMemoryBudget(256 << 20)
				lim := Limits{MaxRequestBytes: 64 << 20, MaxTensorElements: 1 << 24, Memory: mem, WriteTimeout: timeout}
				addr := serveGRPCLimited(t, NewGRPC(newFakeBackend(), lim, slog.New(slog.DiscardHandler), append(GRPCTransportOptions(), grpc.Creds(GRPCCredentials(tc.server)))...))
				return mem, func(opts ...grpc.DialOption) *grpc.ClientConn {
					conn, err := grpc.NewClient(addr, append(opts, grpc.WithTransportCredentials(tc.client),
						grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))...)
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { conn.Close() })
					return conn
				}
			}
			// unread starts a call on a connection that grants the server no more
			// than 64 KiB, and waits until the call has ended at the server: what
			// it holds is then its answer less what was written (less than
			// the answer: while it is decoded and run it holds more).
			unread := func(mem *MemoryBudget, conn *grpc.ClientConn, ctx context.Context, guard time.Duration) (grpc.ClientStream, int64) {
				st, err := conn.NewStream(ctx, &grpc.StreamDesc{}, inference.GRPCInferenceService_ModelInfer_FullMethodName)
				if err != nil {
					t.Fatal(err)
				}
				if err := st.SendMsg(req); err != nil {
					t.Fatal(err)
				}
				if err := st.CloseSend(); err != nil {
					t.Fatal(err)
				}
				var held int64
				if !waitFor(guard, func() bool { held = mem.Used(); return held > size-128<<10 && held < size }) {
					t.Fatalf("an unread answer of %d bytes: %d held, want its bytes not yet written", size, mem.Used())
				}
				return st, held
			}
			stalled := []grpc.DialOption{grpc.WithInitialWindowSize(64 << 10), grpc.WithInitialConnWindowSize(64 << 10)}

			// Read: served, and nothing held once the answer is in.
			mem, dial := serve(time.Hour)
			start := time.Now()
			resp, err := inference.NewGRPCInferenceServiceClient(dial()).ModelInfer(t.Context(), req)
			if err != nil || len(resp.GetRawOutputContents()) != 1 || len(resp.GetRawOutputContents()[0]) != size {
				t.Fatalf("a read answer: %v", err)
			}
			guard := 100 * time.Since(start)
			if !waitFor(guard, func() bool { return mem.Used() == 0 }) {
				t.Fatalf("%d bytes held after a read answer", mem.Used())
			}

			// Reset by the client: given back with the write timeout far off,
			// and the connection serves on.
			conn := dial(stalled...)
			ctx, cancel := context.WithCancel(t.Context())
			_, held := unread(mem, conn, ctx, guard)
			cancel()
			if !waitFor(guard, func() bool { return mem.Used() == 0 }) {
				t.Fatalf("an unread answer reset by its client still holds %d bytes (held %d)", mem.Used(), held)
			}
			if _, err := inference.NewGRPCInferenceServiceClient(conn).ServerLive(t.Context(), &inference.ServerLiveRequest{}); err != nil {
				t.Fatalf("a call after a reset one: %v", err)
			}

			// Never read: held until the write timeout closes the connection.
			mem, dial = serve(guard / 10)
			st, held := unread(mem, dial(stalled...), context.WithoutCancel(t.Context()), guard)
			if !waitFor(guard, func() bool { return mem.Used() == 0 }) {
				t.Fatalf("an unread answer still holds %d bytes after %v (write timeout %v)", mem.Used(), guard, guard/10)
			}
			var out inference.ModelInferResponse
			err = st.RecvMsg(&out)
			t.Logf("an unread answer of %d bytes held %d until its connection was closed; the client then read: %v", size, held, err)
			if status.Code(err) != codes.Unavailable {
				t.Errorf("the unread call, read after its connection closed: %v, want UNAVAILABLE", err)
			}
		})
	}
}

// TestGRPCUnreadAnswerPinged: a client that grants no window for its
// answer but pings the server, which acknowledges each ping, is cut off
// all the same: only an answer's bytes count as progress.
func TestGRPCUnreadAnswerPinged(t *testing.T) {
	const size = 1 << 20
	mem := NewMemoryBudget(256 << 20)
	lim := Limits{MaxRequestBytes: 16 << 20, MaxTensorElements: 1 << 24, Memory: mem, WriteTimeout: time.Hour}
	probe := serveGRPCLimited(t, NewGRPC(newFakeBackend(), lim, slog.New(slog.DiscardHandler), grpc.Creds(GRPCCredentials(nil))))
	conn, err := grpc.NewClient(probe, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	start := time.Now()
	if _, err := inference.NewGRPCInferenceServiceClient(conn).ServerLive(t.Context(), &inference.ServerLiveRequest{}); err != nil {
		t.Fatal(err)
	}
	lim.WriteTimeout = max(100*time.Since(start), 100*time.Millisecond)
	guard := 20 * lim.WriteTimeout
	addr := serveGRPCLimited(t, NewGRPC(newFakeBackend(), lim, slog.New(slog.DiscardHandler), grpc.Creds(GRPCCredentials(nil)),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: time.Nanosecond, PermitWithoutStream: true})))

	msg, err := proto.Marshal(&inference.ModelInferRequest{ModelName: "echo", Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "UINT8", Shape: []int64{size}}},
		RawInputContents: [][]byte{make([]byte, size)}})
	if err != nil {
		t.Fatal(err)
	}
	// A frame-by-frame client grants no window beyond HTTP/2's first
	// 64 KiB: the answer stalls.
	r := rawgrpc.Dial(t, addr)
	r.GiveUpAfter(guard)
	id := r.Start(inference.GRPCInferenceService_ModelInfer_FullMethodName)
	if err := r.Send(id, append(rawgrpc.Prefix(len(msg)), msg...), true); err != nil {
		t.Fatal(err)
	}
	// Ping until the answer, once held, is given back (or the guard
	// passes): on a busy machine the server may not have read the call
	// yet at the first ping, when nothing is held.
	pinged, held := 0, false
	for {
		if closed, _ := r.ClosedByServer(); closed || time.Since(start) > guard {
			break
		}
		if used := mem.Used(); used > 0 {
			held = true
		} else if held {
			break
		}
		if err := r.Ping(); err != nil {
			break
		}
		pinged++
		time.Sleep(lim.WriteTimeout / 10)
	}
	closed, readErr := r.ClosedByServer()
	t.Logf("pinged %d times, every tenth of the write timeout (%v): closed by the server %v (%v), %d bytes held", pinged, lim.WriteTimeout, closed, readErr, mem.Used())
	if !held && !closed {
		t.Fatalf("the answer was never held within %v", guard)
	}
	if !closed || mem.Used() != 0 {
		t.Errorf("a client pinging but not reading its answer: closed %v, %d bytes held; want closed, nothing held", closed, mem.Used())
	}
}

// TestFrameReader: frame headers are found however the bytes are cut, and
// each frame's payload is handed on whole, in order.
func TestFrameReader(t *testing.T) {
	var buf bytes.Buffer
	fr := http2.NewFramer(&buf, nil)
	want := []frameHeader{
		{length: 6, kind: 0x4}, // settings
		{length: 3, kind: http2FrameHeaders, flags: 0x4, stream: 1}, // headers
		{length: 40000 % (16 << 10), kind: http2FrameData, stream: 1},
		{length: 0, kind: http2FrameData, stream: 3, flags: http2FlagEndStream},
		{length: 4, kind: http2FrameRSTStream, stream: 5},
		{length: 2, kind: http2FrameHeaders, flags: 0x5, stream: 1}, // trailers
	}
	_ = fr.WriteSettings(http2.Setting{ID: http2.SettingMaxFrameSize, Val: 1 << 14})
	_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte{1, 2, 3}, EndHeaders: true})
	_ = fr.WriteData(1, false, make([]byte, 40000%(16<<10)))
	_ = fr.WriteData(3, true, nil)
	_ = fr.WriteRSTStream(5, http2.ErrCodeCancel)
	_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte{1, 2}, EndHeaders: true, EndStream: true})
	wire := append([]byte(http2ClientPreface), buf.Bytes()...)
	for _, piece := range []int{1, 2, 5, 9, 10, 100, len(wire)} {
		t.Run(fmt.Sprint(piece), func(t *testing.T) {
			r := frameReader{skip: len(http2ClientPreface)}
			var got []frameHeader
			var payloads [][]byte
			for p := wire; len(p) > 0; {
				n := min(piece, len(p))
				r.feed(p[:n], func(f frameHeader) {
					got = append(got, f)
					payloads = append(payloads, nil)
				}, func(f frameHeader, off int64, b []byte) {
					last := &payloads[len(payloads)-1]
					if f != got[len(got)-1] || off != int64(len(*last)) {
						t.Errorf("a piece of %+v at %d, after %d bytes of the frame %+v", f, off, len(*last), got[len(got)-1])
					}
					*last = append(*last, b...)
				})
				p = p[n:]
			}
			if !slices.Equal(got, want) {
				t.Errorf("got %+v\nwant %+v", got, want)
			}
			for i, f := range want {
				if i < len(payloads) && int64(len(payloads[i])) != f.length {
					t.Errorf("frame %+v: %d bytes of payload handed on, want %d", f, len(payloads[i]), f.length)
				}
			}
			if len(payloads) > 1 && !bytes.Equal(payloads[1], []byte{1, 2, 3}) {
				t.Errorf("the headers' payload %v, want [1 2 3]", payloads[1])
			}
		})
	}
}
