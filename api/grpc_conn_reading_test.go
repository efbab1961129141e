package api

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"golang.org/x/net/http2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/internal/rawgrpc"
)

// followedConn is a connection's accounting with its frames followed, fed
// synthetic frames: what the client sends is read below TLS (arrived) and
// then parsed (connWrites.read), as writesConn reads it.
type followedConn struct {
	a      *connReading
	w      *connWrites
	m      *grpcMemory
	mem    *MemoryBudget
	logs   *bytes.Buffer
	mu     sync.Mutex
	closed int

	client, server frameWriter
}

// frameWriter writes HTTP/2 frames into a buffer.
type frameWriter struct {
	buf bytes.Buffer
	fr  *http2.Framer
}

func (f *frameWriter) take() []byte {
	b := bytes.Clone(f.buf.Bytes())
	f.buf.Reset()
	return b
}

// newFollowedConn follows a connection on which messages are at most
// message bytes, in a budget of budget, with a body timeout of timeout.
func newFollowedConn(t *testing.T, message, budget int64, timeout time.Duration) *followedConn {
	t.Helper()
	c := &followedConn{a: &connReading{}, mem: NewMemoryBudget(budget), logs: &bytes.Buffer{}}
	c.w = &connWrites{reading: c.a}
	c.m = newGRPCMemory(c.mem, message, 0)
	c.m.bodyTimeout, c.m.logger = timeout, slog.New(slog.NewTextHandler(c.logs, nil))
	c.a.peer = &net.TCPAddr{IP: net.IPv4(192, 0, 2, 1), Port: 4242}
	c.a.closeConn = func() error {
		c.mu.Lock()
		c.closed++
		c.mu.Unlock()
		c.a.close()
		c.w.closeAll()
		return nil
	}
	c.w.start(c.a.closeConn, 0)
	c.client.fr = http2.NewFramer(&c.client.buf, nil)
	c.server.fr = http2.NewFramer(&c.server.buf, nil)
	c.send(append([]byte(http2ClientPreface), c.client.take()...))
	_ = c.client.fr.WriteSettings()
	c.send(c.client.take())
	return c
}

// send reads p from the client.
func (c *followedConn) send(p []byte) {
	if err := c.a.arrived(len(p)); err != nil {
		panic(err)
	}
	c.w.read(p)
}

// open sends the headers of stream id and returns its call, admitted
// as a unary call (unary) or reserved as a stream's.
func (c *followedConn) open(t *testing.T, id uint32, unary bool) *grpcCall {
	t.Helper()
	_ = c.client.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: []byte{0x83, 0x86}, EndHeaders: true})
	c.send(c.client.take())
	call := &grpcCall{method: "/test/Method", readFrom: c.a}
	if !unary {
		c.a.configure(c.m)
		return call
	}
	if err := c.a.admit(call, c.m); err != nil {
		t.Fatalf("admitting stream %d: %v", id, err)
	}
	return call
}

// data sends n bytes of messages on stream id in frames of 16 KiB, the
// first beginning with a length prefix of size (< 0: none).
func (c *followedConn) data(id uint32, size, n int, end bool) {
	b := make([]byte, n)
	if size >= 0 {
		copy(b, rawgrpc.Prefix(size))
	}
	for first := true; first || len(b) > 0; first = false {
		k := min(len(b), 16<<10)
		_ = c.client.fr.WriteData(id, end && k == len(b), b[:k])
		b = b[k:]
	}
	c.send(c.client.take())
}

// end writes the server's trailers on stream id.
func (c *followedConn) end(id uint32) {
	_ = c.server.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: []byte{0x88}, EndHeaders: true, EndStream: true})
	c.w.wrote(c.server.take())
}

// held is what the connection counts as held of messages being read.
func (c *followedConn) held() int64 {
	c.a.mu.Lock()
	defer c.a.mu.Unlock()
	return c.a.heldLocked()
}

func (c *followedConn) closes() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// TestConnReadingCountsWhatIsHeld: with the client's frames followed, a
// connection counts the DATA of the streams the server has not ended,
// less the messages its calls took whole. The DATA of a call refused at
// its headers counts until the server's trailers for it are written, and
// what comes after is not counted (grpc-go drops it): before, everything
// read since the oldest call being read began counted, and a connection
// whose refused calls' clients sent on held hundreds of MiB it did not.
// Padding is not counted; a stream the client resets is given back at its
// next read (grpc-go handles the reset only after the frames read before
// it); the message of a streaming call that reserved the largest one (a
// health Watch) is its own reservation's.
func TestConnReadingCountsWhatIsHeld(t *testing.T) {
	const message, budget = 256 << 10, 64 << 20
	c := newFollowedConn(t, message, budget, 0)
	first := c.open(t, 1, true)
	c.open(t, 3, true)
	c.data(1, message, 20<<10, false)
	if got := c.held(); got != 20<<10 {
		t.Errorf("20 KiB of a message arrived: %d bytes held, want %d", got, 20<<10)
	}

	// A call refused at its headers: its DATA counts until its trailers
	// are written, not after.
	c.open(t, 5, false)
	c.data(5, message, 64<<10, false)
	if got := c.held(); got != 84<<10 {
		t.Errorf("64 KiB more on a stream not yet ended: %d bytes held, want %d", got, 84<<10)
	}
	c.end(5)
	c.data(5, -1, 1<<20, false)
	if got := c.held(); got != 20<<10 {
		t.Errorf("a refused call's stream ended, then 1 MiB on it: %d bytes held, want %d", got, 20<<10)
	}
	if got, want := c.mem.Used(), int64(2*message); got != want {
		t.Errorf("the budget holds %d bytes, want the two calls' %d", got, want)
	}

	// Padding is not held.
	_ = c.client.fr.WriteDataPadded(3, false, make([]byte, 1000), make([]byte, 200))
	c.send(c.client.take())
	if got := c.held(); got != 21<<10-24 {
		t.Errorf("1000 bytes padded with 200 more: %d bytes held, want %d", got, 21<<10-24)
	}

	// A message taken whole is given back; its stream is known once the
	// handler starts, and its end does not give it back twice.
	c.data(1, -1, message+5-20<<10, true)
	if got := c.held(); got != message+5+1000 {
		t.Errorf("one message whole: %d bytes held, want %d", got, message+5+1000)
	}
	c.a.finish(first, 0, message+5)
	c.a.begin(first, 1, true)
	c.end(1)
	if got := c.held(); got != 1000 {
		t.Errorf("the whole message taken and its stream ended: %d bytes held, want 1000", got)
	}

	// A stream the server ends after its call took its message whole but
	// before the call's handler started (a second message broke it): the
	// message is not given back twice.
	broken := c.open(t, 11, true)
	c.data(11, 100, 105, false)
	c.a.finish(broken, 0, 105)
	c.data(11, 100, 105, true)
	c.end(11)
	c.a.ended(broken, 11, true)
	if got := c.held(); got != 1000 {
		t.Errorf("a stream ended between its message taken and its handler's start: %d bytes held, want 1000", got)
	}

	// A stream the client resets is given back at its next read.
	c.open(t, 13, true)
	c.data(13, message, 10<<10, false)
	_ = c.client.fr.WriteRSTStream(13, http2.ErrCodeCancel)
	c.send(c.client.take())
	if got := c.held(); got != 11<<10-24 {
		t.Errorf("a stream reset in the latest read: %d bytes held, want its data still counted, %d", got, 11<<10-24)
	}
	_ = c.client.fr.WritePing(false, [8]byte{})
	c.send(c.client.take())
	if got := c.held(); got != 1000 {
		t.Errorf("a stream reset before the latest read: %d bytes held, want 1000", got)
	}

	// A health Watch's message is its own reservation's.
	stream := c.open(t, 15, false)
	c.data(15, message, 8<<10, false)
	c.a.streaming(stream, 15)
	c.data(15, -1, 8<<10, false)
	if got := c.held(); got != 1000 {
		t.Errorf("16 KiB on a streaming call's stream: %d bytes held, want 1000", got)
	}
}

// TestConnReadingLiveStreamsBounded: a connection follows at most
// maxLiveStreams streams at once; the DATA of one it could not follow
// counts, even after its end: from above, never below.
func TestConnReadingLiveStreamsBounded(t *testing.T) {
	c := newFollowedConn(t, 256<<10, 64<<20, 0)
	c.open(t, 1, true)
	id := uint32(3)
	for ; id < 3+2*maxLiveStreams; id += 2 {
		_ = c.client.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: []byte{0x83}, EndHeaders: true})
	}
	c.send(c.client.take())
	if n := len(c.a.live); n != maxLiveStreams {
		t.Fatalf("%d streams followed, want at most %d", n, maxLiveStreams)
	}
	c.data(id-2, 100, 105, false)
	c.end(id - 2)
	c.data(id-2, -1, 100, false)
	if got := c.held(); got != 205 {
		t.Errorf("205 bytes on a stream not followed, ended between them: %d bytes held, want 205", got)
	}
}

// TestConnReadingBodyTimeout: a unary call whose message (and end) has not
// arrived limits.body_timeout after its headers closes its connection,
// once, logged at WARN with its peer; so does a streaming call's message
// begun and not finished while its handler waits for it. A unary call
// whose handler started in time, a stream idle between messages and a
// stream whose handler does not ask for the message it began (the server
// is busy) do not.
func TestConnReadingBodyTimeout(t *testing.T) {
	const message, budget, timeout = 256 << 10, 64 << 20, time.Minute
	cases := []struct {
		name  string
		setup func(t *testing.T, c *followedConn)
		close bool
	}{
		{"unary message unfinished", func(t *testing.T, c *followedConn) {
			c.open(t, 1, true)
			c.data(1, message, 10<<10, false)
		}, true},
		{"unary without its end", func(t *testing.T, c *followedConn) {
			call := c.open(t, 1, true)
			c.data(1, 100, 105, false)
			c.a.finish(call, 0, 105)
		}, true},
		{"unary whole", func(t *testing.T, c *followedConn) {
			call := c.open(t, 1, true)
			c.data(1, 100, 105, true)
			c.a.finish(call, 0, 105)
			time.Sleep(timeout / 2)
			c.a.begin(call, 1, true)
		}, false},
		{"health check unfinished", func(t *testing.T, c *followedConn) {
			call := c.open(t, 1, false)
			c.a.await(call, c.m)
		}, true},
		{"stream message unfinished", func(t *testing.T, c *followedConn) {
			call := c.open(t, 1, false)
			c.a.streaming(call, 1)
			c.a.receiving(1, true)
			time.Sleep(2 * timeout) // idle between messages
			c.data(1, message, 10<<10, false)
		}, true},
		{"stream idle", func(t *testing.T, c *followedConn) {
			call := c.open(t, 1, false)
			c.a.streaming(call, 1)
			c.data(1, 100, 105, false)
			c.a.receiving(1, true)
		}, false},
		{"stream not receiving", func(t *testing.T, c *followedConn) {
			call := c.open(t, 1, false)
			c.a.streaming(call, 1)
			c.data(1, 100, 105, false)
			c.data(1, message, 10<<10, false)
		}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				c := newFollowedConn(t, message, budget, timeout)
				tc.setup(t, c)
				time.Sleep(timeout - time.Second)
				synctest.Wait()
				if got := c.closes(); got != 0 {
					t.Fatalf("closed %d times before the body timeout", got)
				}
				time.Sleep(10 * timeout)
				synctest.Wait()
				want := 0
				if tc.close {
					want = 1
				}
				if got := c.closes(); got != want {
					t.Errorf("closed %d times, want %d", got, want)
				}
				logs := c.logs.String()
				if n := strings.Count(logs, "level=WARN"); n != want || want == 1 && !strings.Contains(logs, "peer=192.0.2.1:4242") || want == 1 && !strings.Contains(logs, "limits.body_timeout") {
					t.Errorf("logs %q: want %d WARN naming the peer and limits.body_timeout", logs, want)
				}
				c.a.close()
				c.w.closeAll()
			})
		})
	}
}

// TestGRPCExpiredCallGivesBack: a call whose deadline has passed when its
// headers are read is ended by grpc-go as soon as its tap returns, without
// running it or telling the stats handler of its end: what it reserved
// from its headers is given back at once (before, the largest message, 16
// MiB on a fresh connection, stayed reserved until the connection closed,
// and four such calls filled the connection's share), and the connection
// goes on serving.
func TestGRPCExpiredCallGivesBack(t *testing.T) {
	const message, budget = 16 << 20, 256 << 20
	mem := NewMemoryBudget(budget)
	srv := NewGRPC(newFakeBackend(), Limits{MaxRequestBytes: message, MaxTensorElements: 1 << 24, Memory: mem, BodyTimeout: time.Minute},
		slog.New(slog.DiscardHandler), append(GRPCTransportOptions(), grpc.Creds(GRPCCredentials(nil)))...)
	addr := serveGRPCLimited(t, srv)
	r := rawgrpc.Dial(t, addr)
	r.GiveUpAfter(time.Minute)
	for range 8 {
		id := r.Start(inference.GRPCInferenceService_ModelInfer_FullMethodName, "grpc-timeout", "0n")
		if err := r.Send(id, rawgrpc.Prefix(0), true); err != nil {
			t.Fatal(err)
		}
		if got := r.Wait(id); !strings.HasPrefix(got, "4 ") {
			t.Fatalf("a call whose deadline has passed: %q, want grpc-status 4 (DEADLINE_EXCEEDED)", got)
		}
	}
	if got := mem.Used(); got != 0 {
		t.Errorf("%d bytes held after 8 calls whose deadlines had passed, want 0", got)
	}
	if got := warmRaw(t, r, 1); got <= 0 {
		t.Fatal("ServerLive not timed")
	}
}

// TestGRPCRefusedFramesNotCounted: with more than half of the budget taken
// elsewhere, on a fresh connection four calls take its share (a quarter of
// the budget: four messages of the largest size) with 64 KiB of their
// messages sent, and twenty more, refused at their headers for the share,
// get 4 MiB sent each before the client hears. The
// connection holds its four calls' reservations and nothing for the
// refused calls' 80 MiB, which grpc-go drops (before, it counted them:
// everything read since its oldest call being read began), over plain TCP
// and over TLS, whose frames are read after the handshake.
func TestGRPCRefusedFramesNotCounted(t *testing.T) {
	certs, roots := localhostTLS()
	for _, tc := range []struct {
		name   string
		server credentials.TransportCredentials
		client *tls.Config
	}{
		{"plain", nil, nil},
		{"TLS", credentials.NewTLS(&tls.Config{Certificates: certs}), &tls.Config{RootCAs: roots, ServerName: "127.0.0.1", NextProtos: []string{"h2"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const message, budget = 16 << 20, 256 << 20
			share := connReadingShare(budget, message)
			mem := NewMemoryBudget(budget)
			srv := NewGRPC(newFakeBackend(), Limits{MaxRequestBytes: message, MaxTensorElements: 1 << 24, Memory: mem},
				slog.New(slog.DiscardHandler), append(GRPCTransportOptions(), grpc.Creds(GRPCCredentials(tc.server)))...)
			addr := serveGRPCLimited(t, srv)
			// Over half of the budget taken: the connection keeps to its
			// share.
			elsewhere, err := mem.Reserve(budget/2, "another connection's calls")
			if err != nil {
				t.Fatal(err)
			}
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			if tc.client != nil {
				c = tls.Client(c, tc.client)
			}
			r := rawgrpc.Over(t, c)
			r.GiveUpAfter(time.Minute)

			admitted, refused := int(share/message), 20
			var ids []uint32
			for range admitted + refused {
				ids = append(ids, r.Start(inference.GRPCInferenceService_ModelInfer_FullMethodName))
			}
			for i, id := range ids {
				n := 64 << 10
				if i >= admitted {
					n = 4 << 20
				}
				if err := r.Send(id, append(rawgrpc.Prefix(message-5), make([]byte, n-5)...), false); err != nil {
					t.Fatal(err)
				}
			}
			// Answered once every frame before it is read.
			got, err := r.Live()
			if err != nil {
				t.Fatal(err)
			}
			if got == "" {
				t.Fatal("the connection ended before its last call was answered")
			}
			for i, id := range ids {
				end, ok := r.Ended(id)
				if i < admitted && ok || i >= admitted && !strings.HasPrefix(end, "8 ") {
					t.Fatalf("call %d of %d admitted: ended %v, %q", i, admitted, ok, end)
				}
			}
			if got := mem.Used() - elsewhere.Size(); got < share || got > share+int64(admitted)*callHeadersHeld {
				t.Errorf("%d calls with 64 KiB sent and %d refused with 4 MiB sent each: %d bytes held, want the calls' %d and their headers (at most %d each)",
					admitted, refused, got, share, callHeadersHeld)
			}
			elsewhere.Release()
			r.Close()
			if !waitFor(time.Minute, func() bool { return mem.Used() == 0 }) {
				t.Errorf("%d bytes held after the connection closed", mem.Used())
			}
		})
	}
}

// stallConn passes the first left bytes written to it and drops the rest:
// a client whose link stops mid-message (its writes do not block, so that
// grpc-go's client closes at once when the server does).
type stallConn struct {
	net.Conn
	mu   sync.Mutex
	left int
}

func (c *stallConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	n := min(len(p), c.left)
	c.left -= n
	c.mu.Unlock()
	if n > 0 {
		if _, err := c.Conn.Write(p[:n]); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// TestGRPCBodyTimeoutUnavailable: a grpc-go client whose link stalls
// halfway through a call's message sees the call end UNAVAILABLE once
// limits.body_timeout has passed at the server, which gives back what the
// call and its connection held and serves the next connection.
func TestGRPCBodyTimeoutUnavailable(t *testing.T) {
	const message, budget = 16 << 20, 256 << 20
	mem := NewMemoryBudget(budget)
	lim := Limits{MaxRequestBytes: message, MaxTensorElements: 1 << 24, Memory: mem, BodyTimeout: 200 * time.Millisecond}
	addr := serveGRPCLimited(t, NewGRPC(newFakeBackend(), lim, slog.New(slog.DiscardHandler),
		append(GRPCTransportOptions(), grpc.Creds(GRPCCredentials(nil)))...))
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
			if err != nil {
				return nil, err
			}
			return &stallConn{Conn: c, left: 256 << 10}, nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	req := grpcSumRequest(true)
	req.Inputs[0].Shape = []int64{grpcBaselineBytes / 16, 4}
	req.RawInputContents = [][]byte{make([]byte, grpcBaselineBytes)}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute) // a guard only
	defer cancel()
	_, err = inference.NewGRPCInferenceServiceClient(conn).ModelInfer(ctx, req)
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("a call whose message stalled halfway: %v, want UNAVAILABLE", err)
	}
	if !waitFor(time.Minute, func() bool { return mem.Used() == 0 }) {
		t.Errorf("%d bytes held after the stalled call's connection closed", mem.Used())
	}
	other, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if _, err := inference.NewGRPCInferenceServiceClient(other).ModelInfer(t.Context(), grpcSumRequest(true)); err != nil {
		t.Errorf("a call on another connection after: %v", err)
	}
}

// openStream sends the headers of stream id and, with them when data is
// not nil, the start of its messages, admits it as a streaming call whose
// messages the connection counts (admitStream), and starts its handler.
func (c *followedConn) openStream(t *testing.T, id uint32, data []byte) (*grpcCall, error) {
	t.Helper()
	_ = c.client.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: []byte{0x83, 0x86}, EndHeaders: true})
	if data != nil {
		_ = c.client.fr.WriteData(id, false, data)
	}
	c.send(c.client.take())
	call := &grpcCall{method: "/test/Stream", readFrom: c.a}
	counted, err := c.a.admitStream(call, c.m)
	if !counted {
		t.Fatalf("stream %d: not counted on a connection whose frames are followed", id)
	}
	if err != nil {
		return nil, err
	}
	c.a.streaming(call, id)
	return call, nil
}

// TestConnReadingCountsStreamMessages: on a connection whose frames are
// followed, a streaming call reserves its stream's buffers only, and its
// messages are counted as they arrive and given back as its handler takes
// each whole: forty idle streams fit in a budget that held four before (a
// stream reserved the largest message for its life), a message is counted
// while it arrives, DATA read with a stream's headers is counted from its
// admission, a stream's end gives back what it still counted, a read that
// does not fit in the budget closes the connection, and the streams'
// reservations count in their connection's share.
func TestConnReadingCountsStreamMessages(t *testing.T) {
	const message, budget = 4 << 20, 16 << 20
	c := newFollowedConn(t, message, budget, 0)
	c.m.stream = GRPCStreamBytes(4 << 10)
	stream := c.m.stream
	calls := map[uint32]*grpcCall{}
	for id := uint32(1); id < 80; id += 2 {
		call, err := c.openStream(t, id, nil)
		if err != nil {
			t.Fatalf("idle stream %d: %v", id, err)
		}
		calls[id] = call
	}
	idle := 40 * stream
	if got := c.mem.Used(); got != idle {
		t.Fatalf("40 idle streams hold %d bytes of the budget, want their buffers' %d", got, idle)
	}
	if got := c.held(); got != 0 {
		t.Errorf("40 idle streams: %d bytes held of messages, want 0", got)
	}

	// A message counted as it arrives, given back once taken whole.
	const size = 2 << 20
	c.data(1, size, 1<<20, false)
	if got, want := c.mem.Used(), idle+1<<20; got != want {
		t.Errorf("1 MiB of a stream's message arrived: the budget holds %d bytes, want %d", got, want)
	}
	c.data(1, -1, size+5-1<<20, false)
	if got := c.held(); got != size+5 {
		t.Errorf("a stream's message whole: %d bytes held, want %d", got, size+5)
	}
	c.a.took(1, size+5)
	if got := c.held(); got != 0 {
		t.Errorf("a stream's message taken: %d bytes held, want 0", got)
	}
	if got := c.mem.Used(); got != idle {
		t.Errorf("a stream's message taken: the budget holds %d bytes, want %d", got, idle)
	}

	// DATA read with a stream's headers, before it was admitted, counts.
	first := append(rawgrpc.Prefix(size), make([]byte, 16<<10-5)...)
	calls[81], _ = c.openStream(t, 81, first)
	if got := c.held(); got != 16<<10 {
		t.Errorf("16 KiB read with a stream's headers: %d bytes held, want %d", got, 16<<10)
	}
	if got, want := c.mem.Used(), idle+stream+16<<10; got < want {
		t.Errorf("16 KiB read with a stream's headers: the budget holds %d bytes, want at least %d", got, want)
	}
	// Its end gives back its stream's buffers and what it counted.
	c.a.ended(calls[81], 81, true)
	calls[81].res.Release()
	c.end(81)
	if got := c.held(); got != 0 {
		t.Errorf("a stream with 16 KiB of a message ended: %d bytes held, want 0", got)
	}
	if got := c.mem.Used(); got != idle {
		t.Errorf("a stream with 16 KiB of a message ended: the budget holds %d bytes, want %d", got, idle)
	}

	// Messages past the budget: the read that does not fit closes the
	// connection, and what it held is given back.
	for _, id := range []uint32{3, 5, 7, 9} {
		c.data(id, message, 7<<19, false)
	}
	_ = c.client.fr.WriteData(11, false, append(rawgrpc.Prefix(message), make([]byte, 16<<10-5)...))
	p := c.client.take()
	for range 64 {
		_ = c.client.fr.WriteData(11, false, make([]byte, 16<<10))
	}
	p = append(p, c.client.take()...)
	err := c.a.arrived(len(p))
	if !errors.Is(err, errMemory) {
		t.Fatalf("a read past the budget: %v, want it refused for memory", err)
	}
	if got := c.mem.Used(); got != idle {
		t.Errorf("the connection closed: the budget holds %d bytes, want its streams' %d (given back as they end)", got, idle)
	}
	for id, call := range calls {
		if id != 81 {
			c.a.ended(call, id, true)
			call.res.Release()
		}
	}
	if got := c.mem.Used(); got != 0 {
		t.Errorf("every stream ended: the budget holds %d bytes, want 0", got)
	}

	// The streams' reservations count in their connection's share: a
	// quarter of the budget, or two messages (8 MiB).
	c = newFollowedConn(t, message, budget, 0)
	c.m.stream = 1 << 20
	for id := uint32(1); id < 16; id += 2 {
		if _, err := c.openStream(t, id, nil); err != nil {
			t.Fatalf("stream %d of 1 MiB: %v", id, err)
		}
	}
	if _, err := c.openStream(t, 17, nil); !errors.Is(err, errMemory) {
		t.Errorf("a ninth stream of 1 MiB on a connection whose share is 8 MiB: %v, want refused for memory", err)
	}
	if err := c.a.admit(&grpcCall{method: "/test/Method", readFrom: c.a}, c.m); !errors.Is(err, errMemory) {
		t.Errorf("a unary call on a connection whose streams hold its share: %v, want refused for memory", err)
	}
}

// unknownStream is a grpc.ServerStream whose HTTP/2 stream cannot be read
// from its context.
type unknownStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s unknownStream) Context() context.Context { return s.ctx }

// TestGRPCStreamUnknownReservesLargest: a streaming call that reserved its
// stream's buffers only (admitStream) and whose stream cannot be read from
// grpc-go (grpcStreamID: its messages cannot be taken off its stream's
// count) reserves the largest message before its handler runs, as on
// connections whose frames are not followed; refused RESOURCE_EXHAUSTED
// when that does not fit.
func TestGRPCStreamUnknownReservesLargest(t *testing.T) {
	const message, budget = 4 << 20, 18 << 20
	c := newFollowedConn(t, message, budget, 0)
	c.m.stream = 64 << 10
	run := func() (int64, error) {
		call := &grpcCall{method: "/test/Stream", readFrom: c.a}
		if counted, err := c.a.admitStream(call, c.m); !counted || err != nil {
			t.Fatalf("admitStream: %v %v", counted, err)
		}
		call.writes = c.w
		ctx := context.WithValue(t.Context(), grpcCallKey{}, call)
		var held int64 = -1
		err := grpcCallStreamStream(nil, unknownStream{ctx: ctx}, nil, func(any, grpc.ServerStream) error {
			held = call.res.Size()
			return nil
		})
		return held, err
	}
	for i := range 4 {
		if held, err := run(); err != nil || held != message {
			t.Fatalf("stream %d: its handler ran with %d bytes reserved (%v), want the largest message, %d", i, held, err, message)
		}
	}
	if held, err := run(); status.Code(err) != codes.ResourceExhausted || held != -1 {
		t.Errorf("a fifth stream past the budget: %v (its handler ran: %v), want RESOURCE_EXHAUSTED", err, held != -1)
	}
}
