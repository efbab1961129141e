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
