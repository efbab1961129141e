package api

import (
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// While the server is not ready (draining after SIGTERM), every response
// closes its connection, so that a client with a request in flight moves to
// a new connection rather than leave a keep-alive one for the drain to
// close under its next request; while ready, connections are kept.
func TestRESTClosesConnectionsWhileNotReady(t *testing.T) {
	b := &grpcToggleBackend{fakeBackend: newFakeBackend()}
	srv := httptest.NewUnstartedServer(NewREST(b, restLimits, slog.New(slog.DiscardHandler)))
	var conns atomic.Int64
	srv.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	defer srv.Close()
	client := srv.Client()
	body := `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}`
	send := func(path string) (closed bool) {
		t.Helper()
		var resp *http.Response
		var err error
		if path == "/v2/health/ready" {
			resp, err = client.Get(srv.URL + path)
		} else {
			resp, err = client.Post(srv.URL+path, "application/json", strings.NewReader(body))
		}
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.Close
	}
	const n = 4
	for i := range n {
		if send("/v2/models/sum/infer") {
			t.Errorf("ready: response %d closes its connection", i)
		}
	}
	if got := conns.Load(); got != 1 {
		t.Errorf("ready: %d requests took %d connections, want 1", n, got)
	}
	b.notReady.Store(true)
	for i := range n {
		if !send("/v2/models/sum/infer") {
			t.Errorf("not ready: inference response %d keeps its connection", i)
		}
		if !send("/v2/health/ready") {
			t.Errorf("not ready: readiness response %d keeps its connection", i)
		}
	}
	// The first request not ready went on the kept connection; every
	// later one needed its own.
	if got, want := conns.Load(), int64(1+2*n-1); got != want {
		t.Errorf("not ready: %d connections in all, want %d (one per response)", got, want)
	}
}

// Over HTTP/2 (REST over TLS; the REST listener serves no cleartext
// HTTP/2) a response's "Connection: close" is not sent, since HTTP/2 has
// no such header: net/http's HTTP/2 server takes it as a request to end the
// connection gracefully (GOAWAY after the streams in flight). While not
// ready every response still moves the client to a new connection, and
// the response itself arrives whole; while ready, one connection serves
// every request.
func TestRESTClosesHTTP2ConnectionsWhileNotReady(t *testing.T) {
	b := &grpcToggleBackend{fakeBackend: newFakeBackend()}
	srv := httptest.NewUnstartedServer(NewREST(b, restLimits, slog.New(slog.DiscardHandler)))
	srv.EnableHTTP2 = true
	var conns atomic.Int64
	srv.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			conns.Add(1)
		}
	}
	srv.StartTLS()
	defer srv.Close()
	client := srv.Client()
	body := `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}`
	send := func(path string) {
		t.Helper()
		var resp *http.Response
		var err error
		if path == "/v2/health/ready" {
			resp, err = client.Get(srv.URL + path)
		} else {
			resp, err = client.Post(srv.URL+path, "application/json", strings.NewReader(body))
		}
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.ProtoMajor != 2 {
			t.Fatalf("%s: answered over %s, want HTTP/2", path, resp.Proto)
		}
		if _, ok := resp.Header["Connection"]; ok {
			t.Errorf("%s: an HTTP/2 response carries a Connection header", path)
		}
		switch {
		case path != "/v2/health/ready" && (resp.StatusCode != http.StatusOK || !strings.Contains(string(got), `"data":[10]`)):
			t.Errorf("%s: %d %s, want 200 with the sum 10", path, resp.StatusCode, got)
		case path == "/v2/health/ready" && b.notReady.Load() != (resp.StatusCode == http.StatusServiceUnavailable):
			t.Errorf("%s: %d while ready=%v", path, resp.StatusCode, !b.notReady.Load())
		}
	}
	const n = 4
	for range n {
		send("/v2/models/sum/infer")
	}
	if got := conns.Load(); got != 1 {
		t.Errorf("ready: %d requests took %d connections, want 1", n, got)
	}
	b.notReady.Store(true)
	for range n {
		send("/v2/models/sum/infer")
		send("/v2/health/ready")
	}
	// Every response not ready ended its connection: the first went on
	// the kept one, every later one on a new one.
	if got, want := conns.Load(), int64(1+2*n-1); got != want {
		t.Errorf("not ready: %d connections in all, want %d (one per response)", got, want)
	}
}
