package api

import (
	"context"
	"log/slog"
	"net"
	"reflect"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// gRPC answers being written, followed on their connection.
//
// grpc-go queues a unary call's answer for its connection's writer and
// ends the call at once (stats.End): the handler's return does not wait
// for the bytes to leave. A client that never reads (it grants no
// flow-control window, or does not read its socket) leaves the whole
// encoded answer in the server's memory for as long as it keeps the
// connection open, and grpc-go has no write timeout. So, on a connection
// the server's LimitedListener accepted, the frames the server writes are
// followed (connWrites): a call that ends with its answer not yet written
// hands its reservation to its stream, which gives it back once the
// stream's last frame (its trailers, or a reset) is written, or the client
// resets the stream, or the connection closes. A connection that has
// answers to write and writes none of their bytes for
// limits.write_timeout is closed (frames other than an answer's, such as
// the acknowledgements of a client's pings, do not count),
// as REST closes a connection whose response is not read in time: its
// calls end UNAVAILABLE, and everything they held is given back.
//
// The frames are read after TLS (GRPCCredentials wraps the connection the
// handshake returns), and the server's own stream IDs are read from
// grpc-go's stream (grpcStreamID): grpc-go tells a stats handler nothing
// that names a call's stream.

// connWrites follows the HTTP/2 frames of one gRPC connection: the
// server's, as written, and the client's, as read, for its stream resets
// and for what grpc-go holds of the messages being read (connReading).
// Its zero value is off: GRPCCredentials turns it on for connections of a
// LimitedListener.
type connWrites struct {
	mu      sync.Mutex
	on      bool
	closed  bool
	streams map[uint32]*streamWrites
	resets  map[uint32]struct{} // streams the client reset (at most maxResetsKept)
	// When the connection last wrote an answer's bytes, or last came to
	// have some to write; the timer closes it when that is older than
	// timeout.
	progress time.Time
	limit    writeLimit
	timer    *time.Timer
	close    func() error // closes the accepted connection
	peer     net.Addr     // the client's, for the log

	out frameReader // the server's frames
	in  frameReader // the client's, after its preface
	// reading counts what grpc-go holds of the messages being read from
	// the client's frames; lock order: mu, then reading.mu.
	reading *connReading
}

// streamWrites is one stream's answers: bytes queued by grpc-go (its
// messages' wire length) and written (its DATA frames), and the
// reservation of its call once the call has ended, which holds the bytes
// not yet written.
type streamWrites struct {
	queued, written int64
	res             *Reservation
}

// pending reports whether the stream still has bytes to write: an answer
// not all written, or a call ended whose trailers are not.
func (s *streamWrites) pending() bool { return s.queued > s.written || s.res != nil }

// start turns the following on; closeConn closes the connection, slack
// is what may be read below TLS and not yet parsed (tlsReadSlack; 0
// without TLS).
func (w *connWrites) start(closeConn func() error, slack int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.on, w.close = true, closeConn
	w.streams = make(map[uint32]*streamWrites)
	w.resets = make(map[uint32]struct{})
	w.in.skip = len(http2ClientPreface)
	w.reading.follow(slack)
}

// maxResetsKept bounds the streams a connection remembers the client
// reset: past it they are forgotten, and an answer queued on one of them
// just as it was reset holds its reservation until the connection closes
// or stalls.
const maxResetsKept = 256

// http2ClientPreface opens every HTTP/2 connection, from the client.
const http2ClientPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// connWritesOf is the following of the connection whose remote address is
// addr, or nil when its frames are not followed.
func connWritesOf(addr net.Addr) *connWrites {
	a, ok := addr.(*connAddr)
	if !ok || a.writes == nil {
		return nil
	}
	a.writes.mu.Lock()
	defer a.writes.mu.Unlock()
	if !a.writes.on {
		return nil
	}
	return a.writes
}

// stream is the entry of stream id, made if needed; mu is held.
func (w *connWrites) stream(id uint32) *streamWrites {
	s := w.streams[id]
	if s == nil {
		s = &streamWrites{}
		w.streams[id] = s
	}
	return s
}

// queued counts a message of wire bytes queued on stream id; the
// connection is closed if it writes nothing for limit's timeout while it
// has bytes to write.
func (w *connWrites) queued(id uint32, wire int64, limit writeLimit) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.on || w.closed {
		return
	}
	if _, reset := w.resets[id]; reset {
		return // grpc-go drops it
	}
	w.wakeLocked(limit)
	w.stream(id).queued += wire
}

// ended hands res, the reservation of the call on stream id that has just
// ended, to the stream until its bytes are written; it gives it back at
// once when they are, or when the connection is not followed. What the
// reservation holds beyond the bytes still to write is given back now.
func (w *connWrites) ended(id uint32, res *Reservation, limit writeLimit) {
	w.mu.Lock()
	s := w.streams[id]
	if !w.on || w.closed || s == nil || !s.pending() {
		w.mu.Unlock()
		res.Release()
		return
	}
	w.wakeLocked(limit)
	res.ShrinkTo(max(s.queued-s.written, 0))
	s.res = res
	w.mu.Unlock()
}

// writeLimit is limits.write_timeout for a connection's answers (0:
// none), with where a connection closed for it is counted and logged.
type writeLimit struct {
	timeout time.Duration
	slow    *SlowClients
	logger  *slog.Logger
}

// wakeLocked makes the stall timer run when the connection comes to have
// bytes to write; mu is held.
func (w *connWrites) wakeLocked(limit writeLimit) {
	if limit.timeout <= 0 {
		return
	}
	w.limit = limit
	if !w.pendingLocked() {
		w.progress = time.Now()
	}
	if w.timer == nil {
		w.timer = time.AfterFunc(limit.timeout, w.check)
	}
}

func (w *connWrites) pendingLocked() bool {
	for _, s := range w.streams {
		if s.pending() {
			return true
		}
	}
	return false
}

// check closes the connection when it has had bytes to write and written
// nothing for its timeout; else it looks again when that could be so.
func (w *connWrites) check() {
	w.mu.Lock()
	if w.closed || !w.pendingLocked() {
		w.timer = nil
		w.mu.Unlock()
		return
	}
	if idle := time.Since(w.progress); idle < w.limit.timeout {
		w.timer.Reset(w.limit.timeout - idle)
		w.mu.Unlock()
		return
	}
	w.timer = nil
	closeConn, limit, peer := w.close, w.limit, w.peer
	w.mu.Unlock()
	limit.slow.add(slowGRPC, slowWrite)
	if limit.logger != nil {
		limit.logger.Warn("gRPC connection closed: its answers were not taken within limits.write_timeout; its calls end UNAVAILABLE",
			"peer", peer, "write_timeout", limit.timeout)
	}
	_ = closeConn() // its reads and writes fail; closeAll gives back the rest
}

// finishedLocked gives back what stream id held: its last frame is
// written, or the client reset it; mu is held.
func (w *connWrites) finishedLocked(id uint32) {
	if s := w.streams[id]; s != nil {
		s.res.Release()
		delete(w.streams, id)
	}
}

// closeAll gives back what the connection's streams held, once it is
// closed.
func (w *connWrites) closeAll() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.closed = true
	for id := range w.streams {
		w.finishedLocked(id)
	}
	if w.timer != nil {
		w.timer.Stop()
		w.timer = nil
	}
}

// wrote follows p, bytes the server wrote.
func (w *connWrites) wrote(p []byte) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return
	}
	w.out.feed(p, func(f frameHeader) {
		ends := f.kind == http2FrameRSTStream ||
			(f.kind == http2FrameHeaders || f.kind == http2FrameData) && f.flags&http2FlagEndStream != 0
		if ends {
			// grpc-go has forgotten the stream: it holds nothing more
			// of what the client sent on it, and drops what comes.
			w.reading.streamEnded(f.stream)
		}
		switch {
		case f.kind == http2FrameData:
			// Only an answer's bytes are progress: the acknowledgements
			// of a client's pings, say, are not.
			if f.length > 0 {
				w.progress = time.Now()
			}
			s := w.stream(f.stream)
			s.written += f.length
			if s.res != nil {
				s.res.ShrinkTo(max(s.queued-s.written, 0))
			}
			if f.flags&http2FlagEndStream != 0 {
				w.finishedLocked(f.stream)
			}
		case f.kind == http2FrameHeaders && f.flags&http2FlagEndStream != 0, f.kind == http2FrameRSTStream:
			w.finishedLocked(f.stream)
		}
	}, nil)
}

// read follows p, bytes the client sent, before grpc-go reads them: a
// stream it resets has its queued answer dropped by grpc-go, and the
// DATA of its streams is what grpc-go holds of the messages being read
// (connReading).
func (w *connWrites) read(p []byte) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return
	}
	a := w.reading
	a.mu.Lock()
	defer a.mu.Unlock()
	a.clientReadLocked(len(p))
	w.in.feed(p, func(f frameHeader) {
		a.clientFrameLocked(f)
		if f.kind == http2FrameRSTStream {
			w.finishedLocked(f.stream)
			// grpc-go reads the reset later than this, so an answer
			// may still be queued on the stream, and dropped: it is
			// not counted.
			if len(w.resets) >= maxResetsKept {
				clear(w.resets)
			}
			w.resets[f.stream] = struct{}{}
		}
	}, a.clientPayloadLocked)
	a.settleLocked()
}

// HTTP/2 frame types and flags (RFC 9113, section 6).
const (
	http2FrameHeaderLen = 9
	http2FrameData      = 0x0
	http2FrameHeaders   = 0x1
	http2FrameRSTStream = 0x3
	http2FlagEndStream  = 0x1
	http2FlagPadded     = 0x8
)

// frameHeader is an HTTP/2 frame's header.
type frameHeader struct {
	length int64
	kind   byte
	flags  byte
	stream uint32
}

// frameReader finds the frame headers in a stream of HTTP/2 frames fed to
// it in pieces.
type frameReader struct {
	skip int         // bytes to pass before the next frame (a preface)
	cur  frameHeader // the current frame
	left int64       // bytes of its payload still to come
	head [http2FrameHeaderLen]byte
	n    int // bytes of head read
}

// feed reads p, calling frame for each frame header completed in it and,
// if payload is not nil, payload for each piece of a frame's payload in
// it, with the frame and the piece's offset in its payload.
func (r *frameReader) feed(p []byte, frame func(frameHeader), payload func(f frameHeader, off int64, piece []byte)) {
	for len(p) > 0 {
		switch {
		case r.skip > 0:
			k := min(r.skip, len(p))
			r.skip -= k
			p = p[k:]
		case r.left > 0:
			k := min(r.left, int64(len(p)))
			if payload != nil {
				payload(r.cur, r.cur.length-r.left, p[:k])
			}
			r.left -= k
			p = p[k:]
		default:
			k := copy(r.head[r.n:], p)
			r.n += k
			p = p[k:]
			if r.n < http2FrameHeaderLen {
				return
			}
			r.n = 0
			h := r.head
			f := frameHeader{
				length: int64(h[0])<<16 | int64(h[1])<<8 | int64(h[2]),
				kind:   h[3],
				flags:  h[4],
				stream: (uint32(h[5])<<24 | uint32(h[6])<<16 | uint32(h[7])<<8 | uint32(h[8])) & 0x7fffffff,
			}
			r.cur, r.left = f, f.length
			frame(f)
		}
	}
}

// writesConn is a gRPC connection after its handshake whose frames are
// followed both ways.
type writesConn struct {
	net.Conn
	w *connWrites
}

func (c *writesConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.w.read(p[:n])
	}
	return n, err
}

func (c *writesConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if n > 0 {
		c.w.wrote(p[:n])
	}
	return n, err
}

// GRPCCredentials are tc (nil: plain TCP) with the frames of each
// connection a LimitedListener accepted followed after the handshake, so
// that the server's answers are reserved until they are written and a
// connection that does not take them within limits.write_timeout is
// closed (connWrites). Give them to NewGRPC with grpc.Creds.
func GRPCCredentials(tc credentials.TransportCredentials) credentials.TransportCredentials {
	if tc == nil {
		tc = insecure.NewCredentials()
	}
	return writesCredentials{tc}
}

// writesCredentials wraps a server's transport credentials (GRPCCredentials).
type writesCredentials struct {
	credentials.TransportCredentials
}

func (c writesCredentials) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ServerHandshake(raw)
	if err != nil {
		return conn, info, err
	}
	lc, ok := raw.(*limitedConn)
	if !ok {
		return conn, info, nil
	}
	slack := int64(0)
	if conn != raw {
		slack = tlsReadSlack
	}
	lc.writes.start(lc.Close, slack)
	return &writesConn{Conn: conn, w: &lc.writes}, info, nil
}

func (c writesCredentials) Clone() credentials.TransportCredentials {
	return writesCredentials{c.TransportCredentials.Clone()}
}

// grpcStreamID is the HTTP/2 stream ID of the call ctx belongs to, read
// from grpc-go's stream (its unexported id field: grpc-go exposes no
// other). ok is false if it cannot be read; TestGRPCStreamID fails then.
func grpcStreamID(ctx context.Context) (id uint32, ok bool) {
	st := grpc.ServerTransportStreamFromContext(ctx)
	if st == nil {
		return 0, false
	}
	v := reflect.ValueOf(st)
	if v.Kind() != reflect.Pointer || v.IsNil() || v.Elem().Kind() != reflect.Struct {
		return 0, false
	}
	f := v.Elem().FieldByName("id")
	if !f.IsValid() || f.Kind() != reflect.Uint32 {
		return 0, false
	}
	return uint32(f.Uint()), true
}
