package api

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// LimitedListener counts the connections it has accepted that are still
// open. Up to max are served normally. Past max, up to overflow more are
// accepted as overflow connections, which live at most overflowTimeout and
// on which the REST handler answers health probes only (everything else gets
// 503 and the connection closes): an orchestrator's liveness and readiness
// probes keep working while clients hold every normal slot. Past both, a new
// connection is closed as soon as it is accepted.
//
// Closing excess connections rather than leaving them in the kernel's accept
// queue tells clients at once (a gRPC client sees UNAVAILABLE and backs off)
// instead of letting them time out, and keeps the accept queue free for the
// connections that will fit.
type LimitedListener struct {
	net.Listener
	max             int
	slots           chan struct{}
	spare           chan struct{}
	overflowTimeout time.Duration
	refused         atomic.Uint64

	// The connections' memory (ReserveMemory); nil mem: not counted.
	mem        *MemoryBudget
	perConn    int64
	memRefused atomic.Uint64
	logger     *slog.Logger
	lastLog    atomic.Int64 // unix nanoseconds of the last refusal logged

	// Connections closed because their start came too late
	// (CountSlowHeaders, CountSlowHandshakes); nil: not counted.
	starts *slowStarts
}

// OverflowTimeout is how long an overflow connection may stay open.
const OverflowTimeout = 2 * time.Second

// NewLimitedListener limits ln to max open connections plus overflow
// connections that only answer health probes (0: none).
func NewLimitedListener(ln net.Listener, max, overflow int) *LimitedListener {
	return &LimitedListener{
		Listener:        ln,
		max:             max,
		slots:           make(chan struct{}, max),
		spare:           make(chan struct{}, overflow),
		overflowTimeout: OverflowTimeout,
	}
}

// Accept waits for the next connection that fits, closing those that do
// not.
func (l *LimitedListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		select {
		case l.slots <- struct{}{}:
			res, err := l.mem.Reserve(l.perConn, "a connection's buffers")
			if err == nil {
				lc := newLimitedConn(c, l, l.slots)
				lc.mem = res
				return lc, nil
			}
			<-l.slots
			l.memRefused.Add(1)
			l.logMemoryRefusal()
		default:
		}
		select {
		case l.spare <- struct{}{}:
			lc := newLimitedConn(c, l, l.spare)
			lc.overflow, lc.until = true, time.Now().Add(l.overflowTimeout)
			if err := lc.Conn.SetDeadline(lc.until); err != nil {
				lc.Close()
				continue
			}
			return lc, nil
		default:
		}
		l.refused.Add(1)
		c.Close()
	}
}

// ReserveMemory makes every normal connection the listener accepts reserve
// perConn bytes (its buffers, see GRPCConnectionBytes and
// RESTConnectionBytes) from budget for its whole life, given back when it
// closes. A connection whose bytes do not fit is treated as one past
// max: an overflow connection if one is free, else closed at once, counted
// in Refused and MemoryRefused and logged on logger at most once a second.
// Overflow connections reserve nothing from budget: their number bounds
// their memory (overflow x perConn), which the caller sets aside with the
// budget (MemoryReserved counts them). Call it before Accept.
func (l *LimitedListener) ReserveMemory(budget *MemoryBudget, perConn int64, logger *slog.Logger) {
	l.mem, l.perConn, l.logger = budget, perConn, logger
}

// MemoryReserved is the memory the open connections hold reserved,
// overflow ones included.
func (l *LimitedListener) MemoryReserved() int64 {
	if l.mem == nil {
		return 0
	}
	return l.mem.Used() + int64(len(l.spare))*l.perConn
}

// MemoryRefused is how many connections did not fit in the listener's
// memory (ReserveMemory), the overflow's health-only ones taken included.
func (l *LimitedListener) MemoryRefused() uint64 { return l.memRefused.Load() }

// connRefusalLogEvery is the least time between two logged refusals of
// connections for memory.
const connRefusalLogEvery = time.Second

func (l *LimitedListener) logMemoryRefusal() {
	if l.logger == nil {
		return
	}
	if !due(&l.lastLog, connRefusalLogEvery) {
		return
	}
	l.logger.Warn("connection refused: its buffers do not fit in the listener's share of limits.max_memory (on REST it may still answer health probes, as an overflow connection)",
		"addr", l.Addr().String(), "open", l.Open(), "reserved", formatBytes(l.mem.Used()), "of", formatBytes(l.mem.Limit()),
		"per_connection", formatBytes(l.perConn), "refused_for_memory", l.memRefused.Load())
}

// due reports whether every has passed since *last (unix nanoseconds) and,
// if so, makes now the last: of callers at one moment, one is due.
func due(last *atomic.Int64, every time.Duration) bool {
	now, prev := time.Now().UnixNano(), last.Load()
	return now-prev >= int64(every) && last.CompareAndSwap(prev, now)
}

// Open is the number of connections open now, overflow ones included.
func (l *LimitedListener) Open() int { return len(l.slots) + len(l.spare) }

// Refused is the number of connections closed at once because every normal
// and overflow slot was taken, or a normal one's memory did not fit and
// every overflow slot was taken.
func (l *LimitedListener) Refused() uint64 { return l.refused.Load() }

// Serving is the number of connections open and served normally: max,
// or fewer when their memory is what is full.
func (l *LimitedListener) Serving() int { return len(l.slots) }

// ConnContext marks the context of an overflow connection's requests, for
// http.Server.ConnContext.
func (l *LimitedListener) ConnContext(ctx context.Context, c net.Conn) context.Context {
	if lc := limitedOf(c); lc != nil && lc.overflow {
		return context.WithValue(ctx, overflowKey{}, lc.owner)
	}
	return ctx
}

// overflowKey marks the requests of an overflow connection; its value is
// the listener.
type overflowKey struct{}

// overflowListener returns the listener whose overflow connection ctx
// belongs to, or nil.
func overflowListener(ctx context.Context) *LimitedListener {
	l, _ := ctx.Value(overflowKey{}).(*LimitedListener)
	return l
}

var _ interface{ CloseWrite() error } = (*limitedConn)(nil)

// limitedConn gives its slot back when closed. An overflow connection's
// deadlines never go past until, whatever the server asks. It counts the
// bytes read from it, for gRPC's accounting of messages being read
// (connReading), and follows a gRPC connection's frames (connWrites, from
// GRPCCredentials); its remote address carries both to the gRPC server.
type limitedConn struct {
	net.Conn
	owner    *LimitedListener
	slots    chan struct{}
	overflow bool
	until    time.Time
	once     sync.Once
	reading  connReading
	writes   connWrites
	remote   connAddr
	mem      *Reservation // its buffers (LimitedListener.ReserveMemory)

	// For counting a start that came too late (slowStarts): the REST
	// server's state of the connection plus one (0: not followed), the
	// bytes read when it last went idle, and whether it was counted.
	httpState atomic.Int32
	idleRead  atomic.Int64
	slowStart atomic.Bool
}

func newLimitedConn(c net.Conn, owner *LimitedListener, slots chan struct{}) *limitedConn {
	lc := &limitedConn{Conn: c, owner: owner, slots: slots}
	lc.remote = connAddr{Addr: c.RemoteAddr(), reading: &lc.reading, writes: &lc.writes}
	lc.reading.closeConn, lc.reading.peer = lc.Close, c.RemoteAddr()
	lc.writes.reading, lc.writes.peer = &lc.reading, c.RemoteAddr()
	return lc
}

// Read reads, and closes the connection when what it read does not fit in
// the memory its gRPC calls may hold (connReading.arrived). A read that
// fails at its deadline may be the connection's start come too late
// (slowStarts).
func (c *limitedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		if merr := c.reading.arrived(n); merr != nil {
			c.Close()
			return 0, merr
		}
	}
	if err != nil && c.owner.starts != nil && errors.Is(err, os.ErrDeadlineExceeded) {
		c.owner.starts.timedOut(c)
	}
	return n, err
}

// RemoteAddr is the peer's address, carrying the connection's accounting.
func (c *limitedConn) RemoteAddr() net.Addr {
	if c.remote.Addr == nil {
		return nil
	}
	return &c.remote
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		c.reading.close()
		c.writes.closeAll()
		c.mem.Release()
		<-c.slots
	})
	return err
}

// clamp keeps an overflow connection's deadline at or before until; the
// zero time (no deadline) becomes until.
func (c *limitedConn) clamp(t time.Time) time.Time {
	if c.overflow && (t.IsZero() || t.After(c.until)) {
		return c.until
	}
	return t
}

// CloseWrite half-closes the connection when the accepted one can:
// http.Server does so before it hangs up on a request it refuses unread
// (431, 400), so that the client reads the answer instead of a reset.
func (c *limitedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

func (c *limitedConn) SetDeadline(t time.Time) error { return c.Conn.SetDeadline(c.clamp(t)) }
func (c *limitedConn) SetReadDeadline(t time.Time) error {
	return c.Conn.SetReadDeadline(c.clamp(t))
}
func (c *limitedConn) SetWriteDeadline(t time.Time) error {
	return c.Conn.SetWriteDeadline(c.clamp(t))
}

// errTooManyConnections refuses a request that came on an overflow
// connection.
var errTooManyConnections = errors.New("too many connections")
