package api

import (
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	"google.golang.org/grpc/health/grpc_health_v1"

	"github.com/sloserve/sloserve/internal/syncbuf"
)

// slowStartTimeout is the header and idle timeout of the slow-start tests:
// long enough that a busy machine reads a whole request sent at once
// before it, since a request read late would count as slow.
const slowStartTimeout = 2 * time.Second

// slowStartServer serves a REST-like handler over HTTP/1.1 on a
// LimitedListener that counts slow headers, with header and idle
// timeouts of slowStartTimeout. The handler answers "ok"; on /body it
// gives its body 100 ms, as the REST handler gives limits.body_timeout.
func slowStartServer(t *testing.T, logs *syncbuf.Buffer) (*LimitedListener, *SlowClients) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := NewLimitedListener(ln, 16, 0)
	slow := NewSlowClients()
	l.CountSlowHeaders(slow, slowStartTimeout, slog.New(slog.NewTextHandler(logs, nil)))
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/body" {
				_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(100 * time.Millisecond))
				if _, err := io.ReadAll(r.Body); err != nil {
					w.WriteHeader(http.StatusRequestTimeout)
					return
				}
			}
			io.WriteString(w, "ok")
		}),
		ConnContext:       l.ConnContext,
		ConnState:         l.ConnState,
		ReadHeaderTimeout: slowStartTimeout,
		IdleTimeout:       slowStartTimeout,
	}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return l, slow
}

// closedAfterAll reports whether the server closes c within timeout,
// whatever it sends before.
func closedAfterAll(c net.Conn, timeout time.Duration) bool {
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	_, err := io.Copy(io.Discard, c)
	return !isTimeout(err)
}

// slowHeaderCount is what slow holds of REST header timeouts.
func slowHeaderCount(slow *SlowClients) int64 { return slow.counts[slowREST][slowHeaders].Load() }

// A REST connection whose request line and headers do not arrive within
// limits.header_timeout is counted once as a slow client, with a WARN,
// whether it sent nothing, part of its first request, or part of a next
// one; a keep-alive connection closed idle between requests and a body
// cut off at the handler's deadline are not.
func TestSlowHeadersCounted(t *testing.T) {
	full := "GET / HTTP/1.1\r\nHost: x\r\n\r\n"
	for _, tc := range []struct {
		name string
		// send writes to c; answers is how many responses it awaits.
		send    []string
		answers int
		want    int64
	}{
		{"nothing sent", nil, 0, 1},
		{"part of the headers", []string{"GET / HTTP/1.1\r\nHost:"}, 0, 1},
		{"a request, then idle", []string{full}, 1, 0},
		{"a request, then part of the next", []string{full, "GET / HT"}, 1, 1},
		{"two requests, then idle", []string{full, full}, 2, 0},
		{"a body cut off by the handler", []string{"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc"}, 1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var logs syncbuf.Buffer
			l, slow := slowStartServer(t, &logs)
			c, err := net.Dial("tcp", l.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			for i, s := range tc.send {
				if _, err := io.WriteString(c, s); err != nil {
					t.Fatal(err)
				}
				if i < tc.answers {
					readRawResponse(t, c)
				}
			}
			// The server closes every one of them: at the header, idle or
			// body timeout (net/http answers a next request cut off 400).
			if !closedAfterAll(c, 30*time.Second) {
				t.Fatal("the connection was not closed")
			}
			waitUntil(t, "the listener's connections closed", func() bool { return l.Open() == 0 })
			if got := slowHeaderCount(slow); got != tc.want {
				t.Errorf("%d counted as slow headers, want %d", got, tc.want)
			}
			warned := strings.Contains(logs.String(), "limits.header_timeout")
			if warned != (tc.want > 0) {
				t.Errorf("WARN logged %v, want %v: %q", warned, tc.want > 0, logs.String())
			}
			if tc.want > 0 && !strings.Contains(logs.String(), "peer=127.0.0.1:") {
				t.Errorf("the WARN does not name the peer: %q", logs.String())
			}
		})
	}
}

// Over TLS: a client that never finishes its handshake is counted (the
// handshake comes under limits.header_timeout); an HTTP/2 connection,
// which the HTTP/2 server times with timers, is not counted when it is
// closed idle after its requests.
func TestSlowHeadersCountedTLS(t *testing.T) {
	var logs syncbuf.Buffer
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, r.Proto)
	}))
	l := NewLimitedListener(srv.Listener, 16, 0)
	slow := NewSlowClients()
	l.CountSlowHeaders(slow, slowStartTimeout, slog.New(slog.NewTextHandler(&logs, nil)))
	srv.Listener = l
	srv.EnableHTTP2 = true
	srv.Config.ConnState = l.ConnState
	srv.Config.ReadHeaderTimeout = slowStartTimeout
	srv.Config.IdleTimeout = slowStartTimeout
	srv.StartTLS()
	defer srv.Close()

	client := srv.Client()
	for range 3 {
		resp, err := client.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(b) != "HTTP/2.0" {
			t.Fatalf("served over %q, want HTTP/2.0", b)
		}
	}
	// The connection closes idle.
	waitUntil(t, "the listener's connections closed", func() bool { return l.Open() == 0 })
	if got := slowHeaderCount(slow); got != 0 {
		t.Errorf("an HTTP/2 connection closed idle counted %d times as slow headers", got)
	}

	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if !closedByPeer(c, 30*time.Second) {
		t.Fatal("a connection that never began its TLS handshake was not closed")
	}
	waitUntil(t, "the listener's connections closed", func() bool { return l.Open() == 0 })
	if got := slowHeaderCount(slow); got != 1 {
		t.Errorf("a TLS handshake never begun counted %d times as slow headers, want 1", got)
	}
}

// A gRPC connection whose HTTP/2 preface does not arrive within
// limits.grpc_connection_timeout is counted once as a slow client, with a
// WARN; a client that called and hung up is not.
func TestSlowHandshakesCounted(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var logs syncbuf.Buffer
	l := NewLimitedListener(ln, 16, 0)
	slow := NewSlowClients()
	l.CountSlowHandshakes(slow, slowStartTimeout, slog.New(slog.NewTextHandler(&logs, nil)))
	srv := grpc.NewServer(grpc.ConnectionTimeout(slowStartTimeout))
	grpc_health_v1.RegisterHealthServer(srv, health.NewServer())
	go srv.Serve(l)
	defer srv.Stop()
	handshakes := func() int64 { return slow.counts[slowGRPC][slowHandshake].Load() }

	cc, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := grpc_health_v1.NewHealthClient(cc).Check(t.Context(), &grpc_health_v1.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	cc.Close()
	waitUntil(t, "the client's connection closed", func() bool { return l.Open() == 0 })

	for i, send := range []string{"", "PRI * HTTP/2.0\r\n"} {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		io.WriteString(c, send)
		if !closedAfterAll(c, 30*time.Second) { // grpc-go sends its settings first
			t.Fatalf("a connection that sent %q was not closed", send)
		}
		waitUntil(t, "the listener's connections closed", func() bool { return l.Open() == 0 })
		if got := handshakes(); got != int64(i+1) {
			t.Errorf("after a connection that sent %q: %d counted as slow handshakes, want %d", send, got, i+1)
		}
	}
	if !strings.Contains(logs.String(), "limits.grpc_connection_timeout") || !strings.Contains(logs.String(), "peer=127.0.0.1:") {
		t.Errorf("no WARN naming the limit and the peer: %q", logs.String())
	}
	if got := slow.counts[slowREST][slowHeaders].Load(); got != 0 {
		t.Errorf("%d counted as REST header timeouts on a gRPC listener", got)
	}
}
