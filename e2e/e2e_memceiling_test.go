package e2e

// End-to-end tests of the server's one memory ceiling (limits.max_memory):
// what hostile clients send or leave unread is reserved before it is
// allocated, and what does not fit is refused at once, so the server's peak
// resident memory stays within the budget of a baseline taken in the same
// test, whatever the clients do.

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api/inference"
)

// memoryLimits continue the limits section startServer writes: a budget
// of four 64 MiB requests. 32 connections a listener keep the connections'
// share of it (their buffers, 10 MiB) small enough that the requests'
// part (246 MiB) still holds four 60 MiB bodies.
const memoryLimits = `  max_request_bytes: 64MiB
  max_memory: 256MiB
  max_connections: 32
  body_timeout: 30s
model_control: explicit
startup_models: ["*"]
`

const (
	memoryBudget = 256 << 20
	heldBody     = 60 << 20 // each hostile body or message
	// memoryAllowed is what the budget may add to the server's peak
	// resident memory, with room for the garbage Go has not collected
	// yet (at limits.gc_percent 400 the heap may grow to five times what
	// is live, held under the soft limit of the budget + 256 MiB, twice
	// the budget here: server/gc.go) and the goroutines and buffers of the
	// connections.
	memoryAllowed = 2*memoryBudget + 96<<20
)

// startMemoryServer starts a server with memoryLimits, extra limits lines
// before them, serving dyn and models; it checks that it serves, and
// returns it with its pid.
func startMemoryServer(t *testing.T, extra string, models ...repoModel) (*testServer, int) {
	t.Helper()
	repo := t.TempDir()
	writeRepo(t, repo, append([]repoModel{{"dyn", testModel(t, "example_dynamic_axes.onnx"), pinnedDyn(1)}}, models...)...)
	s := startServer(t, repo, extra+memoryLimits)
	s.stillServing(t)
	return s, s.cmd.Process.Pid
}

// withinBudget fails t when the server's peak RSS grew by more than the
// budget allows.
func withinBudget(t *testing.T, grew int64) {
	t.Helper()
	if grew > memoryAllowed {
		t.Errorf("peak RSS grew %d MiB, over the %d MiB the budget allows", grew>>20, memoryAllowed>>20)
	}
}

// noneReserved fails t unless sloserve_memory_reserved_bytes is 0 when
// (a phrase: "after every call ended").
//
// A request's memory comes back as its handler returns, which may follow
// the client's reading of the answer's last byte (42 MB were still held
// just after a 31.8 MB answer was read, in 1 of 10 runs beside `make test`
// and two burners): the gauge is read until it is 0, for at most 10 s, a
// guard against memory that never comes back, not a timing bound.
func (s *testServer) noneReserved(t *testing.T, when string) {
	t.Helper()
	var v float64
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if v, _ = s.metricValue(t, "sloserve_memory_reserved_bytes"); v == 0 || time.Now().After(deadline) {
			break
		}
	}
	if v != 0 {
		t.Errorf("sloserve_memory_reserved_bytes = %v %s, want 0", v, when)
	}
}

// resetPeakRSS makes the server's peak resident memory its current one, and
// returns it: the baseline of a case.
func resetPeakRSS(t *testing.T, pid int) int64 {
	t.Helper()
	if err := os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", pid), []byte("5"), 0); err != nil {
		t.Fatalf("resetting the peak RSS: %v", err)
	}
	return peakRSS(t, pid)
}

// heldRequest is a REST request whose body is sent but for its last byte.
type heldRequest struct {
	c    net.Conn
	resp chan *http.Response // the answer, nil if the connection failed first
	sent error               // why the body could not be sent whole, if so
}

// holdREST sends the headers of a POST to path with a body of len(body)+1
// bytes and then body, and leaves the request one byte short.
func (s *testServer) holdREST(t *testing.T, path string, body []byte) *heldRequest {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(s.http, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(60 * time.Second))
	h := &heldRequest{c: c, resp: make(chan *http.Response, 1)}
	go func() {
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			h.resp <- nil
			return
		}
		h.resp <- resp
	}()
	head := fmt.Sprintf("POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", path, len(body)+1)
	if _, err := c.Write([]byte(head)); err != nil {
		h.sent = err
		return h
	}
	_, h.sent = c.Write(body)
	return h
}

// TestE2EMemoryCeiling: hostile clients that hold large bodies, large gRPC
// messages or bodies that decode into many elements do not take the
// server's memory past limits.max_memory; what does not fit is refused at
// once with 429 or RESOURCE_EXHAUSTED naming the limit, and the server
// serves normally afterwards.
func TestE2EMemoryCeiling(t *testing.T) {
	s, pid := startMemoryServer(t, "")
	zeros := make([]byte, heldBody)

	t.Run("empty BYTES elements", func(t *testing.T) {
		// A 60 MiB binary input of zeros read as 15 million empty BYTES
		// elements: checking it must not build a slice header per element
		// (360 MiB). First, while the server's heap has no room to spare.
		base := resetPeakRSS(t, pid)
		elems := heldBody / 4
		header := fmt.Sprintf(`{"inputs":[{"name":"input_vectors","datatype":"BYTES","shape":[%d],"parameters":{"binary_data_size":%d}}]}`, elems, heldBody)
		body := append([]byte(header), zeros...)
		code, b, _ := s.do(t, "POST", "/v2/models/dyn/infer", body,
			"Inference-Header-Content-Length", fmt.Sprint(len(header)), "Content-Type", "application/octet-stream")
		grew := peakRSS(t, pid) - base
		t.Logf("%d empty BYTES elements: %d %s; peak RSS grew %d MiB", elems, code, clipBody(b), grew>>20)
		if code != http.StatusBadRequest || !strings.Contains(string(b), "BYTES") {
			t.Errorf("got %d %s, want 400 naming the datatype", code, b)
		}
		// The body once, its copy in the runner's request: well under a
		// header per element.
		if limit := int64(3 * heldBody); grew > limit {
			t.Errorf("peak RSS grew %d MiB, want under %d MiB", grew>>20, limit>>20)
		}
		s.stillServing(t)
	})

	t.Run("held REST bodies", func(t *testing.T) {
		// 24 bodies of 60 MiB to an unknown model and to the repository
		// index, all sent but for their last byte: without a budget the
		// server holds all of them (1.4 GiB); with one, four fit.
		base := resetPeakRSS(t, pid)
		const n = 24
		held := make([]*heldRequest, n)
		var wg sync.WaitGroup
		for i := range n {
			path := "/v2/models/nosuch/infer"
			if i%2 == 1 {
				path = "/v2/repository/index"
			}
			wg.Go(func() { held[i] = s.holdREST(t, path, zeros) })
		}
		wg.Wait()
		// Every body that fits is in (the server reads them whole); the
		// others were refused on their headers.
		time.Sleep(500 * time.Millisecond)
		refused, admitted := 0, 0
		for _, h := range held {
			if h.sent == nil {
				admitted++
				_, _ = h.c.Write([]byte{' '})
			}
		}
		// Those admitted may still be refused when decoding them does not
		// fit beside the others.
		if want := memoryBudget / heldBody; admitted != want {
			t.Errorf("%d bodies read whole, want %d: the budget holds %d bodies of %d MiB", admitted, want, want, heldBody>>20)
		}
		for _, h := range held {
			select {
			case resp := <-h.resp:
				if resp == nil {
					t.Errorf("no answer (body sent whole: %v)", h.sent == nil)
					continue
				}
				var b bytes.Buffer
				_, _ = b.ReadFrom(resp.Body)
				resp.Body.Close()
				msg := rawHTTPResponse{body: b.Bytes()}.errorMessage()
				switch resp.StatusCode {
				case http.StatusTooManyRequests:
					refused++
					if !strings.Contains(msg, "limits.max_memory") || resp.Header.Get("Retry-After") != "1" {
						t.Errorf("429 %q, Retry-After %q: want the limit named and Retry-After 1", msg, resp.Header.Get("Retry-After"))
					}
				case http.StatusNotFound, http.StatusBadRequest:
					// The unknown model; the index's body is not JSON.
				default:
					t.Errorf("status %d %q", resp.StatusCode, msg)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("no answer in 30s")
			}
		}
		grew := peakRSS(t, pid) - base
		t.Logf("%d held bodies of %d MiB: %d refused with 429; peak RSS grew %d MiB (budget %d MiB)", n, heldBody>>20, refused, grew>>20, memoryBudget>>20)
		if refused < n-admitted {
			t.Errorf("%d refused with 429, want at least the %d not read", refused, n-admitted)
		}
		withinBudget(t, grew)
		s.stillServing(t)
	})

	t.Run("large gRPC messages at once", func(t *testing.T) {
		// 16 calls on one connection, each sending a 60 MiB message at
		// once: each call being read holds max_request_bytes of the budget,
		// so four are read at a time and the rest are refused on their
		// headers, before a byte of their message is buffered; a message
		// that is in needs its copies and decoded form on top, and is
		// refused when they do not fit.
		base := resetPeakRSS(t, pid)
		msg, err := proto.Marshal(&inference.ModelInferRequest{
			ModelName: "nosuch",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{
				Name: "input_vectors", Datatype: "FP32", Shape: []int64{heldBody / 40, 10},
			}},
			RawInputContents: [][]byte{zeros},
		})
		if err != nil {
			t.Fatal(err)
		}
		conn, err := grpc.NewClient(s.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(64<<20), grpc.ForceCodec(rawCodec{})))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		const n = 16
		codesSeen := make([]codes.Code, n)
		messages := make([]string, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				var out []byte
				err := conn.Invoke(t.Context(), inference.GRPCInferenceService_ModelInfer_FullMethodName, &msg, &out)
				st := status.Convert(err)
				codesSeen[i], messages[i] = st.Code(), st.Message()
			})
		}
		wg.Wait()
		refused := 0
		for i, c := range codesSeen {
			switch c {
			case codes.ResourceExhausted:
				refused++
				if !strings.Contains(messages[i], "limits.max_memory") {
					t.Errorf("RESOURCE_EXHAUSTED %q: want the limit named", messages[i])
				}
			case codes.NotFound, codes.Unavailable: // the unknown model
			default:
				t.Errorf("call %d: %v %q", i, c, messages[i])
			}
		}
		grew := peakRSS(t, pid) - base
		t.Logf("%d gRPC messages of %d MiB at once: %d refused; peak RSS grew %d MiB (budget %d MiB)", n, heldBody>>20, refused, grew>>20, memoryBudget>>20)
		if refused == 0 {
			t.Error("no call refused: 16 messages of 60 MiB do not fit in 256 MiB")
		}
		withinBudget(t, grew)
		s.noneReserved(t, "after every call ended")
		s.stillServing(t)
	})

}

// clipBody shortens a response body for a log line.
func clipBody(b []byte) string {
	if len(b) > 200 {
		return string(b[:200]) + "..."
	}
	return string(b)
}

// TestE2EMetricsConnectionLimit: the metrics listener keeps at most its 64
// connections open, so a flood of idle connections to it cannot take the
// file descriptors the REST listener and the runners need.
func TestE2EMetricsConnectionLimit(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), pinnedDyn(1)})
	s := startServer(t, repo, "")
	pid := s.cmd.Process.Pid
	fds := func() int {
		es, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		if err != nil {
			t.Fatal(err)
		}
		return len(es)
	}
	base := fds()
	const n = 400
	addr := strings.TrimPrefix(s.metrics, "http://")
	conns := dialIdle(t, addr, n)
	// The server has accepted every connection it will keep.
	waitFor(t, "the metrics listener to refuse the excess", 10*time.Second, func() bool {
		closed := 0
		for _, c := range conns[64:] {
			_ = c.SetReadDeadline(time.Now().Add(time.Millisecond))
			var b [1]byte
			if _, err := c.Read(b[:]); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
				closed++
			}
		}
		return closed == n-64
	})
	grew := fds() - base
	t.Logf("%d idle connections to the metrics port: the server holds %d more file descriptors", n, grew)
	if grew > 64+8 {
		t.Errorf("the server holds %d more file descriptors, want at most the 64 the metrics listener keeps", grew)
	}
	code, _, _ := s.do(t, "GET", "/v2/health/ready", nil)
	if code != http.StatusOK {
		t.Errorf("health during the flood: %d", code)
	}
	for _, c := range conns {
		c.Close()
	}
	conns = nil
	waitFor(t, "a scrape after the flood", 10*time.Second, func() bool {
		_, err := s.scrapeMetrics()
		return err == nil
	})
	if v, _ := s.metricValue(t, `sloserve_connections_refused_total{listener="metrics"}`); v < n-64 {
		t.Errorf("sloserve_connections_refused_total{listener=\"metrics\"} = %v, want >= %d", v, n-64)
	}
}

// dialIdle opens n TCP connections to addr that send nothing, closed when
// the test ends (a test may close them before).
func dialIdle(t *testing.T, addr string, n int) []net.Conn {
	t.Helper()
	conns := make([]net.Conn, 0, n)
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for range n {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	return conns
}

// The real binary sets its Go collector from limits.gc_percent, with the
// soft memory limit at limits.max_memory + 256 MiB, and the runtime's own
// metrics show it; the default is 400.
func TestE2EGoCollectorSettings(t *testing.T) {
	for _, tc := range []struct {
		sets          []string
		percent, limt float64
	}{
		{nil, 400, 4<<30 + 256<<20},
		{[]string{"limits.gc_percent=250", "limits.max_memory=1GiB"}, 250, 1<<30 + 256<<20},
	} {
		srv := startServer(t, t.TempDir(), "", withSet(tc.sets...))
		series := srv.scrape(t)
		if got := series["go_gc_gogc_percent"]; got != tc.percent {
			t.Errorf("--set %q: go_gc_gogc_percent %v, want %v", tc.sets, got, tc.percent)
		}
		if got := series["go_gc_gomemlimit_bytes"]; got != tc.limt {
			t.Errorf("--set %q: go_gc_gomemlimit_bytes %v, want %v", tc.sets, got, tc.limt)
		}
	}
}
