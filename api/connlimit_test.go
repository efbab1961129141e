package api

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/sloserve/sloserve/runtime"
)

// serveLimited serves h on a loopback listener limited to max connections plus
// overflow health-only ones, and returns the listener. Each set-up runs on
// the listener before it serves (ReserveMemory must come before Accept).
func serveLimited(t *testing.T, h http.Handler, max, overflow int, overflowTimeout time.Duration, setup ...func(*LimitedListener)) *LimitedListener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := NewLimitedListener(ln, max, overflow)
	l.overflowTimeout = overflowTimeout
	for _, f := range setup {
		f(l)
	}
	srv := &http.Server{Handler: h, ConnContext: l.ConnContext, ReadHeaderTimeout: 10 * time.Second, MaxHeaderBytes: 4096}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return l
}

// rawResponse is an HTTP response read off a raw connection.
type rawResponse struct {
	status int
	header http.Header
	close  bool // Connection: close
	body   string
}

// rawRequest writes req on a new connection to l and reads one response.
func rawRequest(t *testing.T, l net.Listener, req string) (rawResponse, net.Conn) {
	t.Helper()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatal(err)
	}
	return readRawResponse(t, c), c
}

func readRawResponse(t *testing.T, c net.Conn) rawResponse {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("reading the response: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return rawResponse{resp.StatusCode, resp.Header, resp.Close, string(b)}
}

// closedByPeer reports whether the server closes c within timeout without
// sending anything.
func closedByPeer(c net.Conn, timeout time.Duration) bool {
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	n, err := c.Read(make([]byte, 1))
	return n == 0 && err != nil && !isTimeout(err)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestLimitedListener fills a REST listener's two connections: a third
// still answers health probes (and closes), refuses inference with 503, a
// fourth is closed at once while the third is open, and when the held
// connections close, requests are served again.
func TestLimitedListener(t *testing.T) {
	h, _ := newRESTTest(restLimits)
	l := serveLimited(t, h, 2, 1, 500*time.Millisecond)

	var held []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	waitUntil(t, "two connections open", func() bool { return l.Open() == 2 })

	resp, c := rawRequest(t, l, "GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
	if resp.status != 200 || !resp.close {
		t.Errorf("health over the limit: %d %v", resp.status, resp.header)
	}
	if !closedByPeer(c, 5*time.Second) {
		t.Error("the overflow connection stayed open after its answer")
	}
	waitUntil(t, "the overflow slot back", func() bool { return l.Open() == 2 })

	body := `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}`
	resp, _ = rawRequest(t, l, "POST /v2/models/sum/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "+
		strconv.Itoa(len(body))+"\r\n\r\n"+body)
	var e struct{ Error string }
	if err := json.Unmarshal([]byte(resp.body), &e); err != nil || resp.status != 503 ||
		e.Error != "too many connections: the server has its 2 connections open; retry later" ||
		resp.header.Get("Retry-After") != "1" || !resp.close {
		t.Errorf("inference over the limit: %d %v %s", resp.status, resp.header, resp.body)
	}
	waitUntil(t, "the overflow slot back", func() bool { return l.Open() == 2 })

	// An overflow connection that says nothing holds the only spare slot
	// until its deadline; meanwhile a new connection is closed at once.
	idle, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	waitUntil(t, "the overflow slot taken", func() bool { return l.Open() == 3 })
	refused, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer refused.Close()
	if !closedByPeer(refused, 5*time.Second) {
		t.Error("a connection past the overflow was not closed")
	}
	if n := l.Refused(); n != 1 {
		t.Errorf("Refused() = %d, want 1", n)
	}
	// A watchdog, not a timing: an idle connection that is not cut off
	// at its deadline stays open until the test ends.
	start := time.Now()
	if !closedByPeer(idle, 5*time.Second) {
		t.Error("an idle overflow connection outlived its deadline")
	} else if d := time.Since(start); d > 3*time.Second {
		t.Errorf("the idle overflow connection closed after %v, its deadline was 500ms", d)
	}

	for _, c := range held {
		c.Close()
	}
	waitUntil(t, "every slot back", func() bool { return l.Open() == 0 })
	resp, _ = rawRequest(t, l, "POST /v2/models/sum/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: "+
		strconv.Itoa(len(body))+"\r\n\r\n"+body)
	if resp.status != 200 || !strings.Contains(resp.body, `"data":[10]`) {
		t.Errorf("inference after the limit: %d %s", resp.status, resp.body)
	}
}

// slowBackend answers inference after delay, or fails with the context's
// error if the request's context ends first.
type slowBackend struct {
	*fakeBackend
	delay time.Duration
}

func (s slowBackend) Infer(ctx context.Context, name, version string, req *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	select {
	case <-time.After(s.delay):
	case <-ctx.Done():
		return nil, "", ctx.Err()
	}
	return s.fakeBackend.Infer(ctx, name, version, req)
}

// TestLimitedListenerHalfClose: a request whose headers are over the limit
// gets http.Server's 431, which the client can read because the limited
// connection passes on the half-close before the server hangs up.
func TestLimitedListenerHalfClose(t *testing.T) {
	h, _ := newRESTTest(restLimits)
	l := serveLimited(t, h, 4, 0, OverflowTimeout)
	// The baseline: a request the server answers with a length, on a new
	// connection that it closes, the slowest of three on this machine now.
	var baseline time.Duration
	for range 3 {
		start := time.Now()
		if resp, _ := rawRequest(t, l, "GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"); resp.status != 200 {
			t.Fatalf("health: %d %q", resp.status, resp.body)
		}
		baseline = max(baseline, time.Since(start))
	}
	start := time.Now()
	resp, _ := rawRequest(t, l, "GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Pad: "+strings.Repeat("a", 64<<10)+"\r\n\r\n")
	if resp.status != http.StatusRequestHeaderFieldsTooLarge || resp.body != "431 Request Header Fields Too Large" {
		t.Errorf("got %d %q", resp.status, resp.body)
	}
	// The answer has no length: it ends with the half-close, at once.
	// Without one it would end only when the server hangs up, a fixed
	// 500ms later (http.Server's delay against resets), or in a reset:
	// the bound is the baseline and most of that delay.
	const hangUpDelay = 500 * time.Millisecond
	if d := time.Since(start); d > baseline+hangUpDelay*4/5 {
		t.Errorf("the answer ended after %v (a plain request %v): no half-close", d, baseline)
	}
}

// TestRESTBodyTimeout: a body that stops arriving gets 408 once
// limits.body_timeout has passed, and its connection closes; a request whose
// body is in is not cut off by that deadline however long it runs.
func TestRESTBodyTimeout(t *testing.T) {
	lim := restLimits
	lim.BodyTimeout = 300 * time.Millisecond
	h := NewREST(slowBackend{newFakeBackend(), time.Second}, lim, slog.New(slog.DiscardHandler))
	l := serveLimited(t, h, 8, 0, OverflowTimeout)

	start := time.Now()
	resp, c := rawRequest(t, l, "POST /v2/models/sum/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"inputs\":")
	elapsed := time.Since(start)
	var e struct{ Error string }
	if err := json.Unmarshal([]byte(resp.body), &e); err != nil || resp.status != http.StatusRequestTimeout ||
		e.Error != "request timeout: the body did not arrive within 300ms (limits.body_timeout); 10 bytes came" {
		t.Errorf("slow body: %d %s", resp.status, resp.body)
	}
	// Not before the body timeout; the upper bound is a watchdog (a body
	// that is not cut off waits for the test's end).
	if elapsed < 250*time.Millisecond || elapsed > 5*time.Second {
		t.Errorf("answered after %v, want about 300ms", elapsed)
	}
	if !closedByPeer(c, 5*time.Second) {
		t.Error("the connection stayed open after 408")
	}

	body := `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}`
	resp, _ = rawRequest(t, l, "POST /v2/models/sum/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "+
		strconv.Itoa(len(body))+"\r\n\r\n"+body)
	if resp.status != 200 || !strings.Contains(resp.body, `"data":[10]`) {
		t.Errorf("a request running longer than body_timeout: %d %s", resp.status, resp.body)
	}
}

// TestClipMessage: messages that quote huge client input are cut at a rune
// boundary, saying how much was cut; short ones are left alone.
func TestClipMessage(t *testing.T) {
	if got := clipMessage("short"); got != "short" {
		t.Errorf("clipMessage(short) = %q", got)
	}
	long := strings.Repeat("é", 1<<20) // 2 MiB
	got := clipMessage("model " + long)
	if len(got) > maxErrorMessage || !utf8.ValidString(got) || !strings.HasSuffix(got, " more bytes)") ||
		!strings.HasPrefix(got, "model éé") {
		t.Errorf("clipMessage(2 MiB) = %d bytes, %q...%q", len(got), got[:20], got[len(got)-30:])
	}

	// A REST error quoting a 100 KB model name stays small.
	h, _ := newRESTTest(restLimits)
	rec := restCall{method: "GET", path: "/v2/models/" + strings.Repeat("n", 100_000)}.do(t, t.Context(), h)
	if msg := restErrorBody(t, rec); rec.Code != 404 || len(msg) > maxErrorMessage || !strings.Contains(msg, "more bytes)") {
		t.Errorf("GET long name: %d, %d-byte message", rec.Code, len(msg))
	}
}
