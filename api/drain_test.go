package api

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// gatedListener holds Accept until open is closed, so that connections wait
// in the kernel's accept queue, as they do on a busy host.
type gatedListener struct {
	net.Listener
	open chan struct{}
}

func (g gatedListener) Accept() (net.Conn, error) {
	<-g.open
	return g.Listener.Accept()
}

// inferOn sends one small inference request on the open connection c, as a
// client writes it, and reads the answer whole (postRaw dials its own and
// fails the test: these connections are open already, some in goroutines).
func inferOn(c net.Conn) (*http.Response, []byte, error) {
	fmt.Fprintf(c, "POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return nil, nil, err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, body, err
}

// Connections that reached the socket but were not accepted when the REST
// server's drain closed its listener are answered 503 "shutting down" with
// the connection closed after it, each request read first; a bare listener
// would have been closed under them, and the clients, their requests sent,
// would have read a reset or EOF. Once stopped, the socket refuses new
// connections.
func TestDrainingListenerRefusesQueuedConnections(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gate := gatedListener{Listener: inner, open: make(chan struct{})}
	ln := NewDrainingListener(gate, slog.New(slog.DiscardHandler))
	defer ln.Stop(context.Background(), 0)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "served") })}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()

	const queued = 8
	conns := make([]net.Conn, queued)
	for i := range conns {
		if conns[i], err = net.Dial("tcp", inner.Addr().String()); err != nil {
			t.Fatal(err)
		}
		defer conns[i].Close()
	}
	if err := srv.Shutdown(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := <-served; err != http.ErrServerClosed {
		t.Fatalf("Serve: %v, want ErrServerClosed", err)
	}
	close(gate.open)
	for i, c := range conns {
		resp, body, err := inferOn(c)
		if err != nil {
			t.Errorf("connection %d, queued when the server closed its listener: %v, want a 503", i, err)
			continue
		}
		if resp.StatusCode != http.StatusServiceUnavailable || !resp.Close || !strings.Contains(string(body), "shutting down") {
			t.Errorf("connection %d: %d close=%v %s, want 503, closed, shutting down", i, resp.StatusCode, resp.Close, body)
		}
	}
	ln.Stop(t.Context(), 0)
	if c, err := net.Dial("tcp", inner.Addr().String()); err == nil {
		c.Close()
		t.Error("a connection after Stop was accepted")
	}
}

// A connection the server accepted before the drain, whose client sends its
// request only as the drain begins, is served: Refuse waits for that
// request to be read before Shutdown, which would drop it unanswered
// (net/http closes a connection whose request it reads while shutting
// down).
func TestDrainingListenerRefuseKeepsAcceptedRequests(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := NewDrainingListener(inner, slog.New(slog.DiscardHandler))
	defer ln.Stop(context.Background(), 0)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "served")
	}), ConnState: ln.ConnState}
	shutdownBegan := make(chan struct{})
	srv.RegisterOnShutdown(func() { close(shutdownBegan) })
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()

	c, err := net.Dial("tcp", inner.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for { // the server has the connection, no request read
		n := 0
		ln.fresh.Range(func(any, any) bool { n++; return true })
		if n == 1 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	drained := make(chan error, 1)
	go func() {
		ln.Refuse(context.Background())
		drained <- srv.Shutdown(context.Background())
	}()
	<-ln.refusing
	// Shutdown would begin now if nothing held it.
	select {
	case <-shutdownBegan:
	case <-time.After(100 * time.Millisecond):
	}
	resp, body, err := inferOn(c)
	if err != nil {
		t.Fatalf("the request sent on the accepted connection as the drain began: %v, want it served", err)
	}
	if resp.StatusCode != 200 || string(body) != "served" {
		t.Errorf("got %d %s, want 200 served", resp.StatusCode, body)
	}
	if err := <-drained; err != nil {
		t.Errorf("Shutdown: %v", err)
	}
	if err := <-served; err != http.ErrServerClosed {
		t.Errorf("Serve: %v", err)
	}
}

// Clients that connect anew for every request (as they do once told to
// close, see closeWhileNotReady) through a drain, wired as the server
// wires its REST listener: every request is answered, 200 before the
// drain or 503 "shutting down" during it, or its connection is refused
// once the socket closes; none meets a connection closed under it. A
// connection the socket accepted as the refusal began went, one time in
// two, to the server's Accept instead of the refuser (a select between
// the two), after Refuse had looked for connections to wait for: the
// server read its request while shutting down and closed the
// connection unanswered (EOF at the client).
func TestDrainingListenerLosesNoRequestOfNewConnections(t *testing.T) {
	rounds := 30
	if testing.Short() {
		rounds = 5
	}
	for round := range rounds {
		inner, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ln := NewDrainingListener(inner, slog.New(slog.DiscardHandler))
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			w.Header().Set("Connection", "close")
			io.WriteString(w, "served")
		})}
		ln.Wire(srv)
		served := make(chan error, 1)
		go func() { served <- srv.Serve(ln) }()

		clients, stopClients := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		var mu sync.Mutex
		var ok, refused, lost int
		var firstLost error
		for range 4 {
			wg.Go(func() {
				for clients.Err() == nil {
					c, err := net.Dial("tcp", inner.Addr().String())
					if err != nil { // refused: the socket is closed
						return
					}
					resp, body, err := inferOn(c)
					c.Close()
					mu.Lock()
					switch {
					case err == nil && resp.StatusCode == 200:
						ok++
					case err == nil && resp.StatusCode == http.StatusServiceUnavailable && strings.Contains(string(body), "shutting down"):
						refused++
					default:
						lost++
						if firstLost == nil {
							firstLost = fmt.Errorf("%v (status %v)", err, resp)
						}
					}
					mu.Unlock()
				}
			})
		}
		// Both sides of the drain, whatever the machine's load: a request
		// answered before it, one refused in it.
		seen := func(n *int) func() bool {
			return func() bool { mu.Lock(); defer mu.Unlock(); return *n > 0 }
		}
		waitUntil(t, fmt.Sprintf("round %d: a request answered before the drain", round), seen(&ok))
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		ln.Refuse(ctx)
		if err := srv.Shutdown(ctx); err != nil {
			t.Errorf("round %d: Shutdown: %v", round, err)
		}
		waitUntil(t, fmt.Sprintf("round %d: a request refused in the drain", round), seen(&refused))
		stopClients()
		wg.Wait()
		ln.Stop(ctx, 0)
		cancel()
		if err := <-served; err != http.ErrServerClosed {
			t.Errorf("round %d: Serve: %v", round, err)
		}
		if lost > 0 {
			t.Fatalf("round %d: %d answered, %d refused, %d lost (the first: %v)", round, ok, refused, lost, firstLost)
		}
	}
}
