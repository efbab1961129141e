package loadtest

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// wireTestCapture is a server that keeps the bytes of every request it
// reads, exactly as they came, and answers each with a good response.
type wireTestCapture struct {
	addr           string
	model, version string
	mu             sync.Mutex
	reqs           [][]byte
	conns          atomic.Int64
}

// recordingReader keeps what is read through it.
type recordingReader struct {
	r   io.Reader
	buf bytes.Buffer
}

func (r *recordingReader) Read(p []byte) (int, error) {
	n, err := r.r.Read(p)
	r.buf.Write(p[:n])
	return n, err
}

func wireTestNewCapture(t *testing.T, model, version string) *wireTestCapture {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lis.Close() })
	cp := &wireTestCapture{addr: lis.Addr().String(), model: model, version: version}
	go func() {
		for {
			conn, err := lis.Accept()
			if err != nil {
				return
			}
			cp.conns.Add(1)
			go cp.serve(conn)
		}
	}()
	return cp
}

func (cp *wireTestCapture) serve(conn net.Conn) {
	defer conn.Close()
	rec := &recordingReader{r: conn}
	br := bufio.NewReader(rec)
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if _, err := io.Copy(io.Discard, req.Body); err != nil {
			return
		}
		// One request at a time per connection: nothing of a next one
		// is buffered yet.
		raw := bytes.Clone(rec.buf.Bytes()[:rec.buf.Len()-br.Buffered()])
		rec.buf.Next(len(raw))
		cp.mu.Lock()
		cp.reqs = append(cp.reqs, raw)
		cp.mu.Unlock()
		header := `{"model_name":"` + cp.model + `","model_version":"` + cp.version + `","outputs":[{"name":"scores","datatype":"FP32","shape":[2],"parameters":{"binary_data_size":8}}]}`
		body := header + "\x00\x00\x00\x3f\x00\x00\x80\x3e"
		resp := "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n" + clientHeaderInferenceLength + ": " +
			strconv.Itoa(len(header)) + "\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
		if req.Header.Get(clientHeaderInferenceLength) == "" {
			body = `{"model_name":"` + cp.model + `","model_version":"` + cp.version + `","outputs":[{"name":"scores","datatype":"FP32","shape":[2],"data":[0.5,0.25]}]}`
			resp = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
		}
		if _, err := io.WriteString(conn, resp); err != nil {
			return
		}
	}
}

func (cp *wireTestCapture) taken() [][]byte {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	out := cp.reqs
	cp.reqs = nil
	return out
}

// The client's own connections write, byte for byte, the request net/http
// wrote for it before (the same client given a net/http client tuned as
// its own was): request line, headers in their order, body; and they send
// every request of a client over one kept-alive connection.
func TestClientWireBytes(t *testing.T) {
	inputs := clientTestInputs(t)
	for _, proto := range []string{ProtoREST, ProtoRESTBinary} {
		t.Run("proto="+proto, func(t *testing.T) {
			cp := wireTestNewCapture(t, "ocr-det", "3")
			opts := ClientOptions{Protocol: proto, HTTPBase: "http://" + cp.addr, Model: "ocr-det", Version: "3",
				Inputs: inputs, Timeout: 2 * time.Second,
				Header: http.Header{"Authorization": {"Bearer s3cret"}}}
			optsHTTP := opts
			hc := clientNewHTTP()
			defer hc.CloseIdleConnections()
			optsHTTP.HTTPClient = hc
			var sent [2][]byte
			var clients [2]*Client
			for i, o := range []ClientOptions{optsHTTP, opts} {
				c, err := NewClient(o)
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				clients[i] = c
				clientTestInfer(t, c, clientTestCase{mode: "good", outcome: Good})
				got := cp.taken()
				if len(got) != 1 {
					t.Fatalf("client %d: the server read %d requests, want 1", i, len(got))
				}
				sent[i] = got[0]
			}
			if c := clients[1]; c.wire == nil {
				t.Fatal("the client without an HTTP client does not use its own connections")
			}
			if !bytes.Equal(sent[0], sent[1]) {
				head := func(b []byte) []byte { return b[:bytes.Index(b, []byte("\r\n\r\n"))+4] }
				t.Fatalf("the request differs from net/http's:\n%q\nwant\n%q", head(sent[1]), head(sent[0]))
			}
			// And it is the request meant: its target, headers and body.
			req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(sent[1])))
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(req.Body)
			if req.URL.Path != "/v2/models/ocr-det/versions/3/infer" || req.Header.Get("Authorization") != "Bearer s3cret" ||
				!bytes.Equal(body, clients[1].body) || req.ContentLength != int64(len(clients[1].body)) {
				t.Errorf("request %s %q, Authorization %q, %d bytes of body (%d declared), want the client's %d",
					req.Method, req.URL.Path, req.Header.Get("Authorization"), len(body), req.ContentLength, len(clients[1].body))
			}

			// Kept alive: more requests, sequential and concurrent, take
			// no new connection beyond the concurrency.
			conns := cp.conns.Load()
			for range 20 {
				clientTestInfer(t, clients[1], clientTestCase{mode: "good", outcome: Good})
			}
			if n := cp.conns.Load() - conns; n != 0 {
				t.Errorf("20 sequential requests opened %d new connections, want 0 (the one kept alive)", n)
			}
			var wg sync.WaitGroup
			for range 4 {
				wg.Go(func() {
					for range 10 {
						if o, detail := clients[1].Infer(t.Context()); o != Good {
							t.Errorf("%v %s", o, detail)
						}
					}
				})
			}
			wg.Wait()
			if n := cp.conns.Load() - conns; n > 4 {
				t.Errorf("4 concurrent senders opened %d new connections, want at most 4", n)
			}
			if n := clients[1].wire.dials.Load(); n != cp.conns.Load()-1 {
				t.Errorf("the client counted %d connections, the server %d", n, cp.conns.Load()-1)
			}
			for i, r := range cp.taken() {
				if !bytes.Equal(r, sent[0]) {
					t.Fatalf("request %d on a kept-alive connection differs from the first", i)
				}
			}
		})
	}
}

// A server that refuses from the headers, before reading a body larger than
// the sockets hold, and closes the connection: the request is rejected, its
// unfinished write ends with the connection, and the next request goes out
// on a new one. A server that closes an idle kept-alive connection: the
// next request does not go out on it (net/http notices in its read loop,
// the client before it writes).
func TestClientWireRefusedAndClosed(t *testing.T) {
	big := Tensor{Name: "x", DataType: "FP32", Shape: []int64{1, 3, 640, 640}, Raw: make([]byte, 4*3*640*640)}
	var refuse atomic.Bool
	var conns atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if refuse.Load() {
			w.Header().Set("Connection", "close")
			w.WriteHeader(http.StatusTooManyRequests)
			_, _ = io.WriteString(w, `{"error":"request rejected: overloaded"}`)
			return
		}
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			return
		}
		header := `{"model_name":"m","outputs":[{"name":"y","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":4}}]}`
		w.Header().Set(clientHeaderInferenceLength, strconv.Itoa(len(header)))
		_, _ = io.WriteString(w, header+"\x00\x00\x00\x00")
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Config.IdleTimeout = 100 * time.Millisecond
	srv.Start()
	defer srv.Close()
	c, err := NewClient(ClientOptions{Protocol: ProtoRESTBinary, HTTPBase: srv.URL, Model: "m", Inputs: []Tensor{big}, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	infer := func(want Outcome) {
		t.Helper()
		if o, detail := c.Infer(t.Context()); o != want {
			t.Fatalf("%v %q, want %v", o, detail, want)
		}
	}
	for range 3 {
		infer(Good)
	}
	refuse.Store(true)
	for range 3 {
		infer(Rejected)
	}
	refuse.Store(false)
	for range 3 {
		infer(Good)
	}
	// One connection for the first good ones (the first refusal closes
	// it), one for each later refusal, one for the last good ones.
	if n := conns.Load(); n != 4 {
		t.Errorf("the server saw %d connections, want 4", n)
	}
	// The server closes the idle connection; the next request must not be
	// lost on it.
	deadline := time.Now().Add(10 * time.Second)
	for conns.Load() == 4 && time.Now().Before(deadline) {
		time.Sleep(150 * time.Millisecond)
		infer(Good)
	}
	if n := conns.Load(); n != 5 {
		t.Errorf("the server saw %d connections, want 5 (a new one after its idle timeout)", n)
	}
}

// A client's requests in flight end at its Close only as they end
// themselves; a closed client's kept-alive connections are closed.
func TestClientWireClose(t *testing.T) {
	cp := wireTestNewCapture(t, "m", "1")
	in := Tensor{Name: "x", DataType: "FP32", Shape: []int64{1, 2}, Raw: make([]byte, 8)}
	c, err := NewClient(ClientOptions{Protocol: ProtoRESTBinary, HTTPBase: "http://" + cp.addr, Model: "m", Inputs: []Tensor{in}})
	if err != nil {
		t.Fatal(err)
	}
	if o, detail := c.Infer(context.Background()); o != Good {
		t.Fatalf("%v %s", o, detail)
	}
	c.wire.mu.Lock()
	idle := append([]*wireConn(nil), c.wire.idle...)
	c.wire.mu.Unlock()
	if len(idle) != 1 {
		t.Fatalf("%d idle connections after a request, want 1", len(idle))
	}
	c.Close()
	if _, err := idle[0].conn.Write([]byte("x")); err == nil {
		t.Error("the kept-alive connection is still open after Close")
	}
}
