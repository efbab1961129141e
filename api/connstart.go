package api

import (
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"
)

// Connections whose start does not arrive in time.
//
// A REST connection has limits.header_timeout for its request line and
// headers, and a gRPC connection limits.grpc_connection_timeout for its
// HTTP/2 preface; a TLS handshake comes under the same time on both. The
// servers set these as read deadlines on the connection and close it
// when a read fails at one, telling nobody. limitedConn.Read sees the
// read fail, and the listener counts it in SlowClients.
//
// grpc-go sets a read deadline only for the handshake, so on gRPC every
// read that fails at a deadline is a slow start. net/http also sets one
// while a keep-alive connection waits for its next request
// (limits.idle_timeout: an idle client, not a slow one), and the REST
// handler sets one for a body (counted by the handler as body_timeout).
// So on REST the listener follows each connection's state through the
// server's ConnState hook: a read that fails at a deadline while the
// connection is new (no request read yet), or idle with some bytes of
// its next request read, is a header timeout. HTTP/2 connections never
// fail so: the HTTP/2 server times its streams with timers.

// slowStarts counts a listener's connections closed because their start
// did not arrive in time.
type slowStarts struct {
	slow      *SlowClients
	protocol  int  // slowREST or slowGRPC
	limit     int  // slowHeaders or slowHandshake
	followed  bool // REST: a connection's state comes from the ConnState hook
	timeout   time.Duration
	message   string // the WARN's
	key       string // the limit's configuration key, for the WARN
	logger    *slog.Logger
	lastLog   atomic.Int64 // unix nanoseconds of the last WARN
	sinceLast atomic.Int64 // counted and not logged since
}

// slowStartLogEvery is the least time between two WARNs of slow starts: a
// slow-loris attack is thousands of connections.
const slowStartLogEvery = time.Second

// CountSlowHeaders makes the listener count in slow, and log at WARN at
// most once a second, the REST connections closed because their request
// line and headers (or TLS handshake) did not arrive within timeout
// (limits.header_timeout). The http.Server serving the listener must pass
// every state change to ConnState. Call it before Accept.
func (l *LimitedListener) CountSlowHeaders(slow *SlowClients, timeout time.Duration, logger *slog.Logger) {
	l.starts = &slowStarts{slow: slow, protocol: slowREST, limit: slowHeaders, followed: true, timeout: timeout, logger: logger,
		key:     "header_timeout",
		message: "REST connection closed: its request line and headers did not arrive within limits.header_timeout (a TLS handshake included)"}
}

// CountSlowHandshakes makes the listener count in slow, and log at WARN at
// most once a second, the gRPC connections closed because their HTTP/2
// preface (or TLS handshake) did not arrive within timeout
// (limits.grpc_connection_timeout). Call it before Accept.
func (l *LimitedListener) CountSlowHandshakes(slow *SlowClients, timeout time.Duration, logger *slog.Logger) {
	l.starts = &slowStarts{slow: slow, protocol: slowGRPC, limit: slowHandshake, timeout: timeout, logger: logger,
		key:     "grpc_connection_timeout",
		message: "gRPC connection closed: its HTTP/2 preface did not arrive within limits.grpc_connection_timeout (a TLS handshake included)"}
}

// ConnState, from the REST server's ConnState hook, follows the state of
// each connection the listener accepted, for CountSlowHeaders.
func (l *LimitedListener) ConnState(c net.Conn, st http.ConnState) {
	lc := limitedOf(c)
	if lc == nil {
		return
	}
	if st == http.StateIdle {
		lc.idleRead.Store(lc.reading.bytesRead())
	}
	lc.httpState.Store(int32(st) + 1)
}

// timedOut notes that a read of c failed at its deadline, and counts it
// when that was c's start arriving too late.
func (s *slowStarts) timedOut(c *limitedConn) {
	if c.overflow {
		return // its deadline is the end of its life (OverflowTimeout)
	}
	if s.followed {
		st := c.httpState.Load()
		switch {
		case st == 0:
			return // not served by the REST server (the drain's refuser)
		case http.ConnState(st-1) == http.StateNew:
		case http.ConnState(st-1) == http.StateIdle && c.reading.bytesRead() > c.idleRead.Load():
		default:
			return // limits.idle_timeout between requests, or the handler's own deadline
		}
	}
	if !c.slowStart.CompareAndSwap(false, true) {
		return
	}
	s.slow.add(s.protocol, s.limit)
	if s.logger == nil || !due(&s.lastLog, slowStartLogEvery) {
		s.sinceLast.Add(1)
		return
	}
	s.logger.Warn(s.message, "peer", c.Conn.RemoteAddr().String(), "bytes", c.reading.bytesRead(),
		s.key, s.timeout, "more_since_last_warn", s.sinceLast.Swap(0))
}

// limitedOf is the connection a LimitedListener accepted under c (c
// itself, or under the TLS connections wrapping it), or nil.
func limitedOf(c net.Conn) *limitedConn {
	for {
		if lc, ok := c.(*limitedConn); ok {
			return lc
		}
		inner, ok := c.(interface{ NetConn() net.Conn })
		if !ok {
			return nil
		}
		c = inner.NetConn()
	}
}
