package api

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// A REST listener that refuses clearly while the server drains.
//
// http.Server.Shutdown closes its listener at once, and the kernel resets
// every connection that had completed its handshake but was not accepted
// yet: a client that connected just before sees its request, already sent,
// answered by a reset or EOF, and cannot tell it from a server that died
// while running it. Under load on a busy host such connections wait in
// the accept queue for milliseconds, so some request meets the close on
// almost every stop (a client that has been told to close its keep-alive
// connection, see closeWhileNotReady, connects anew for every request).
//
// A DrainingListener keeps the socket open when the server closes it: its
// Accept ends, as Shutdown expects, and from then on the connections the
// socket accepts are answered by a small server of its own, each request
// with 503 "the server is shutting down" and the connection closed after
// it, a refusal every client understands, until Stop closes the socket.
// The server stops it once its admitted requests have been answered and
// it has refused for at least the shutdown delay, so that clients still
// sending have been told to stop before the socket closes: a connection
// that meets that close in the accept queue is still reset. (A wait for a
// quiet socket would last the whole grace period: readiness probes keep
// coming.)

// DrainingListener is a listener whose Close hands the socket to a refusing
// server instead of closing it (see above). Serve an http.Server on it,
// and call Stop once that server has drained.
type DrainingListener struct {
	inner    net.Listener
	conns    chan net.Conn // accepted, for Accept or, once closed, for the refuser
	errs     chan error    // the socket's Accept error, once
	closing  chan struct{} // Close was called: Accept ends
	close    sync.Once
	refusing chan struct{} // Refuse or Close was called: the refuser has the socket
	refuse   sync.Once
	refuser  *http.Server
	stop     sync.Once
	handoff  chan net.Conn // taken by Accept once the refuser had the socket: for the refuser
	pumped   chan struct{} // the accept loop has ended
	served   chan struct{} // the refuser has ended
	closed   time.Time     // when Close handed the socket to the refuser
	fresh    sync.Map      // net.Conn -> struct{}: handed to the server, no request at its handler yet
}

// NewDrainingListener wraps ln and starts accepting on it.
func NewDrainingListener(ln net.Listener, logger *slog.Logger) *DrainingListener {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	l := &DrainingListener{
		inner:    ln,
		conns:    make(chan net.Conn),
		errs:     make(chan error, 1),
		closing:  make(chan struct{}),
		refusing: make(chan struct{}),
		handoff:  make(chan net.Conn, 1),
		pumped:   make(chan struct{}),
		served:   make(chan struct{}),
	}
	l.refuser = &http.Server{
		Handler:           http.HandlerFunc(refuseDraining),
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelDebug),
		ReadHeaderTimeout: drainingHeaderTimeout,
		IdleTimeout:       drainingHeaderTimeout,
	}
	go l.pump()
	return l
}

// drainingHeaderTimeout bounds how long the refuser waits for a request on
// a connection.
const drainingHeaderTimeout = 5 * time.Second

// drainingBodyRead is how much of a request's body the refuser reads (and
// throws away) before it answers: a connection closed with unread data is
// reset, and the reset can overtake the answer.
const drainingBodyRead = 16 << 20

func (l *DrainingListener) pump() {
	defer close(l.pumped)
	for {
		c, err := l.inner.Accept()
		if err != nil {
			l.errs <- err
			return
		}
		l.conns <- c
	}
}

// Accept returns the next connection until the refuser has the socket,
// then waits for Close and returns net.ErrClosed.
func (l *DrainingListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		// Fresh from here, not only from the server's StateNew hook: a
		// Refuse between this return and the hook would miss it.
		l.fresh.Store(c, struct{}{})
		// A select picks at random among ready cases: with the refuser
		// started and a connection waiting, this one can take it after
		// Refuse has looked for fresh connections, and the server would
		// read its request while shutting down and drop it unanswered.
		// Stored first, then checked: a Refuse that began after the
		// check sees it fresh and waits for it.
		select {
		case <-l.refusing:
			l.fresh.Delete(c)
			l.handoff <- c // at most one: Accept waits for Close below
		default:
			return c, nil
		}
	case err := <-l.errs:
		l.errs <- err
		return nil, err
	case <-l.refusing:
	}
	<-l.closing
	return nil, net.ErrClosed
}

// Close ends Accept and hands the socket's connections to the refuser; the
// socket stays open until Stop.
func (l *DrainingListener) Close() error {
	l.startRefusing()
	l.close.Do(func() { close(l.closing) })
	return nil
}

// startRefusing hands the socket's new connections to the refuser.
func (l *DrainingListener) startRefusing() {
	l.refuse.Do(func() {
		l.closed = time.Now()
		close(l.refusing)
		go func() {
			defer close(l.served)
			_ = l.refuser.Serve(refuserListener{l})
		}()
	})
}

// ConnState, as the served http.Server's ConnState, follows the
// connections it was handed, for Refuse: fresh when new, no longer once
// idle (a request was answered), closed or hijacked. Active is not enough:
// net/http marks a connection active once it has read bytes of a request,
// and only then drops the request if it is shutting down; a connection
// stays fresh until its first request reaches the handler (Wire).
func (l *DrainingListener) ConnState(c net.Conn, st http.ConnState) {
	switch st {
	case http.StateNew:
		l.fresh.Store(c, struct{}{})
	case http.StateIdle, http.StateClosed, http.StateHijacked:
		l.fresh.Delete(c)
	}
}

// drainingConnKey is the context key of a request's connection (Wire).
type drainingConnKey struct{}

// drainingConn is a connection as its requests' context carries it:
// reached is set by its first request at the handler, so that the
// requests after it leave the fresh map alone.
type drainingConn struct {
	c       net.Conn
	reached atomic.Bool
}

// Wire sets srv up to serve on l, keeping srv's own hooks: its ConnState
// follows the connections (ConnState), its ConnContext puts each
// connection in its requests' context, and its Handler marks the
// connection's first request as reached, so that Refuse waits for that
// request past the point where net/http would drop it.
func (l *DrainingListener) Wire(srv *http.Server) {
	state, conn, next := srv.ConnState, srv.ConnContext, srv.Handler
	srv.ConnState = func(c net.Conn, st http.ConnState) {
		l.ConnState(c, st)
		if state != nil {
			state(c, st)
		}
	}
	srv.ConnContext = func(ctx context.Context, c net.Conn) context.Context {
		if conn != nil {
			ctx = conn(ctx, c)
		}
		return context.WithValue(ctx, drainingConnKey{}, &drainingConn{c: c})
	}
	if next == nil {
		next = http.DefaultServeMux
	}
	srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if dc, ok := r.Context().Value(drainingConnKey{}).(*drainingConn); ok && dc.reached.CompareAndSwap(false, true) {
			l.fresh.Delete(dc.c)
		}
		next.ServeHTTP(w, r)
	})
}

// Refuse hands the socket's new connections to the refuser and waits, at
// most until ctx ends, until every connection the server was handed has
// had its first request reach the handler (Wire), or is idle or closed.
// Call it before the server's Shutdown: a request read after Shutdown has
// begun is dropped with the connection, unanswered (net/http's server
// does that), so a connection accepted just before the drain would
// otherwise lose the request its client had already sent.
func (l *DrainingListener) Refuse(ctx context.Context) {
	l.startRefusing()
	t := time.NewTicker(time.Millisecond)
	defer t.Stop()
	for {
		empty := true
		l.fresh.Range(func(any, any) bool { empty = false; return false })
		if empty {
			return
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
	}
}

// Addr is the socket's address.
func (l *DrainingListener) Addr() net.Addr { return l.inner.Addr() }

// Stop closes the socket (new connections are refused by the kernel) once
// the refuser has answered for at least refuseFor, or ctx ends, and then
// the refuser, after the refusals it is writing, within ctx.
func (l *DrainingListener) Stop(ctx context.Context, refuseFor time.Duration) {
	l.stop.Do(func() {
		_ = l.Close()
		if wait := refuseFor - time.Since(l.closed); wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
			}
		}
		_ = l.inner.Close()
		<-l.pumped
		_ = l.refuser.Shutdown(ctx)
		<-l.served
		select { // handed to a refuser that ended first
		case c := <-l.handoff:
			_ = c.Close()
		default:
		}
	})
}

// refuserListener is the refuser's view of a closed DrainingListener.
type refuserListener struct{ l *DrainingListener }

func (r refuserListener) Accept() (net.Conn, error) {
	select {
	case c := <-r.l.conns:
		return c, nil
	case c := <-r.l.handoff:
		return c, nil
	case err := <-r.l.errs:
		r.l.errs <- err
		return nil, err
	}
}

func (r refuserListener) Close() error   { return nil } // Stop closes the socket
func (r refuserListener) Addr() net.Addr { return r.l.inner.Addr() }

// errDraining is the refuser's answer.
const errDraining = `{"error":"the server is shutting down; retry on another instance"}`

func refuseDraining(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, drainingBodyRead))
	h := w.Header()
	h.Set("Connection", "close")
	h.Set("Content-Type", "application/json")
	h.Set("Retry-After", "1")
	w.WriteHeader(http.StatusServiceUnavailable)
	_, _ = w.Write([]byte(errDraining))
}

var _ net.Listener = (*DrainingListener)(nil)
