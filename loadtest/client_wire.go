package loadtest

// The REST protocols' own HTTP/1.1 connections. A REST client sends one
// request over and over, so everything about it is fixed: its request line
// and headers are written once by net/http itself (Request.Write, the code
// its Transport writes with) and kept as bytes, and each send writes those
// bytes and the encoded body with one writev, without copying either.
// net/http's Transport would copy a body of known length through a fresh
// 32 KiB buffer (it reads it through an io.LimitReader, which hides the
// bytes.Reader), a megabyte body in forty write calls, and build and
// clone a request and its headers each time.
//
// Responses are parsed by net/http's own ReadResponse. A connection goes
// back to the pool only when its response was read to its end, the server
// did not ask to close it and the request was written whole; a server that
// answers before reading the body (sloserve refusing an overloaded model
// from the headers) closes the connection, and the write still under way
// ends with it. A kept-alive connection the server has closed meanwhile is
// noticed before it is used (a peek at the socket, as net/http's read loop
// notices it while the connection is idle).

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// wireMaxIdle is how many kept-alive connections a client holds between
// requests, as many as the net/http client it replaces kept per host.
const wireMaxIdle = 1024

// wireWriteWait is how long a response the server kept its connection open
// after waits for the request's own write to end before the connection is
// given up; net/http waits as long.
const wireWriteWait = 50 * time.Millisecond

// wirePast is a deadline in the past: set on a connection, it ends the
// reads and writes under way at once.
var wirePast = time.Unix(1, 0)

// restWire sends one prepared request over connections of its own.
type restWire struct {
	addr       string      // host:port
	tlsConf    *tls.Config // nil: plain TCP
	head, body []byte      // the request line and headers; the body
	// lens are where head gives the body's lengths (Content-Length, and
	// rest-binary's Inference-Header-Content-Length), in head's order: a
	// request with an id writes a head of its own with both grown by the
	// id's prefix (headWith).
	lens   []wireLen
	dialer net.Dialer

	mu     sync.Mutex
	idle   []*wireConn // kept-alive connections, the most recent last
	closed bool

	dials atomic.Int64 // connections opened
}

// wireConn is one connection and what reads it.
type wireConn struct {
	conn  net.Conn
	br    *bufio.Reader
	wrote chan error // the request's write, one result per request
}

// newRESTWire prepares req (a request without a body whose headers are
// final) to be sent with body. tlsConf is used for an https URL.
func newRESTWire(req *http.Request, body []byte, tlsConf *tls.Config) (*restWire, error) {
	r := req.Clone(context.Background())
	r.Body, r.ContentLength = clientNewBody(body), int64(len(body))
	var buf bytes.Buffer
	if err := r.Write(&buf); err != nil {
		return nil, fmt.Errorf("client: writing the request: %w", err)
	}
	if !bytes.HasSuffix(buf.Bytes(), body) {
		return nil, errors.New("client: net/http did not write the body as it is")
	}
	w := &restWire{head: bytes.Clone(buf.Bytes()[:buf.Len()-len(body)]), body: body}
	names := map[string]int64{"Content-Length": int64(len(body))}
	if v := req.Header.Get(clientHeaderInferenceLength); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("client: %s %q: %w", clientHeaderInferenceLength, v, err)
		}
		names[clientHeaderInferenceLength] = n
	}
	lens, err := findLens(w.head, names)
	if err != nil {
		return nil, err
	}
	if len(lens) != len(names) || len(body) == 0 || body[0] != '{' {
		return nil, errors.New("client: the prepared request's lengths or body are not where a request id can be given")
	}
	w.lens = lens
	port := req.URL.Port()
	switch {
	case port != "":
	case req.URL.Scheme == "https":
		port = "443"
	default:
		port = "80"
	}
	w.addr = net.JoinHostPort(req.URL.Hostname(), port)
	if req.URL.Scheme == "https" {
		w.tlsConf = &tls.Config{}
		if tlsConf != nil {
			w.tlsConf = tlsConf.Clone()
		}
		if w.tlsConf.ServerName == "" {
			w.tlsConf.ServerName = req.URL.Hostname()
		}
		w.tlsConf.NextProtos = []string{"http/1.1"}
	}
	return w, nil
}

// wireLen is a length header's decimal value in a prepared head.
type wireLen struct {
	at, end int   // the value's bytes, head[at:end]
	value   int64 // as written for the body without an id
}

// findLens finds the values of the length headers named in head, each
// once; a header not in head is skipped.
func findLens(head []byte, names map[string]int64) ([]wireLen, error) {
	var lens []wireLen
	for name, v := range names {
		field := "\r\n" + name + ": " + strconv.FormatInt(v, 10) + "\r\n"
		i := bytes.Index(head, []byte(field))
		if i < 0 {
			continue
		}
		if bytes.Count(head, []byte(field)) != 1 {
			return nil, fmt.Errorf("client: header %s written more than once", name)
		}
		at := i + len("\r\n"+name+": ")
		lens = append(lens, wireLen{at: at, end: i + len(field) - 2, value: v})
	}
	slices.SortFunc(lens, func(a, b wireLen) int { return a.at - b.at })
	return lens, nil
}

// headWith is the head for a body grown by extra bytes.
func (w *restWire) headWith(extra int) []byte {
	h := make([]byte, 0, len(w.head)+8)
	from := 0
	for _, l := range w.lens {
		h = append(h, w.head[from:l.at]...)
		h = strconv.AppendInt(h, l.value+int64(extra), 10)
		from = l.end
	}
	return append(h, w.head[from:]...)
}

// get takes a kept-alive connection that is still open, or dials one.
func (w *restWire) get(ctx context.Context) (*wireConn, error) {
	for {
		w.mu.Lock()
		n := len(w.idle)
		if n == 0 {
			w.mu.Unlock()
			break
		}
		wc := w.idle[n-1]
		w.idle[n-1] = nil
		w.idle = w.idle[:n-1]
		w.mu.Unlock()
		if wc.open() {
			return wc, nil
		}
		wc.conn.Close()
	}
	var c net.Conn
	var err error
	if w.tlsConf != nil {
		d := tls.Dialer{NetDialer: &w.dialer, Config: w.tlsConf}
		c, err = d.DialContext(ctx, "tcp", w.addr)
	} else {
		c, err = w.dialer.DialContext(ctx, "tcp", w.addr)
	}
	if err != nil {
		return nil, err
	}
	w.dials.Add(1)
	return &wireConn{conn: c, br: bufio.NewReader(c), wrote: make(chan error, 1)}, nil
}

// put keeps wc for another request, or closes it.
func (w *restWire) put(wc *wireConn) {
	w.mu.Lock()
	if !w.closed && len(w.idle) < wireMaxIdle {
		w.idle = append(w.idle, wc)
		w.mu.Unlock()
		return
	}
	w.mu.Unlock()
	wc.conn.Close()
}

// close closes the kept-alive connections; those in use close when their
// requests end.
func (w *restWire) close() {
	w.mu.Lock()
	idle := w.idle
	w.idle, w.closed = nil, true
	w.mu.Unlock()
	for _, wc := range idle {
		wc.conn.Close()
	}
}

// write sends the request; its result goes to wc.wrote.
func (wc *wireConn) write(bufs net.Buffers) {
	_, err := bufs.WriteTo(wc.conn)
	wc.wrote <- err
}

// written waits a little for the request's write to end and reports
// whether it ended well.
func (wc *wireConn) written() bool {
	select {
	case err := <-wc.wrote:
		return err == nil
	default:
	}
	t := time.NewTimer(wireWriteWait)
	defer t.Stop()
	select {
	case err := <-wc.wrote:
		return err == nil
	case <-t.C:
		return false
	}
}

// open reports whether a kept-alive connection can carry a request: nothing
// has arrived on it since its last response, neither data nor the server's
// close.
func (wc *wireConn) open() bool {
	if wc.br.Buffered() > 0 {
		return false
	}
	c := wc.conn
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return true
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	open := false
	var b [1]byte
	err = raw.Read(func(fd uintptr) bool {
		_, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		open = err == syscall.EAGAIN || err == syscall.EWOULDBLOCK
		return true // never wait for it to become readable
	})
	return err == nil && open
}

// readResponse reads the response's status line and headers, past any
// informational (1xx) responses.
func (wc *wireConn) readResponse() (*http.Response, error) {
	for {
		resp, err := http.ReadResponse(wc.br, nil)
		if err != nil {
			return nil, err
		}
		if resp.StatusCode < 100 || resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols {
			return resp, nil
		}
	}
}

// inferWire sends one request over the client's own connections and
// classifies its response as readREST does.
func (c *Client) inferWire(ctx context.Context, id string) (Outcome, string) {
	w := c.wire
	wc, err := w.get(ctx)
	if err != nil {
		return clientErrOutcome(ctx, err)
	}
	stop := context.AfterFunc(ctx, func() { wc.conn.SetDeadline(wirePast) })
	bufs := net.Buffers{w.head, w.body}
	if prefix := clientIDPrefix(id); prefix != nil {
		// The id replaces the body's opening brace (clientIDPrefix).
		bufs = net.Buffers{w.headWith(len(prefix) - 1), prefix, w.body[1:]}
	}
	go wc.write(bufs)
	resp, err := wc.readResponse()
	if err != nil {
		stop()
		wc.conn.Close()
		return clientErrOutcome(ctx, err)
	}
	o, detail, err := c.readREST(resp, id)
	interrupted := !stop()
	if err != nil || interrupted || resp.Close || !wc.written() {
		wc.conn.Close()
	} else {
		w.put(wc)
	}
	if err != nil {
		return clientErrOutcome(ctx, err)
	}
	return o, detail
}
