// Package rawgrpc is a gRPC client for tests written frame by frame over
// one HTTP/2 connection, so that a test can leave messages unfinished, or
// send what a client library would not, as a slow or hostile client does.
package rawgrpc

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// Client is a gRPC client written frame by frame over one HTTP/2
// connection, so that a test can leave messages unfinished as a slow or
// hostile client does. It keeps to the server's connection window.
type Client struct {
	tb   testing.TB
	conn net.Conn

	wmu    sync.Mutex // one frame written at a time
	fr     *http2.Framer
	hbuf   bytes.Buffer
	henc   *hpack.Encoder
	nextID uint32

	mu      sync.Mutex
	cond    *sync.Cond
	window  int64             // the connection's send window
	ended   map[uint32]string // streams the server ended: their grpc-status and message
	data    map[uint32][]byte // what the server sent on each stream, length prefixes included
	readErr error
}

// Dial connects to addr, closed when the test ends.
func Dial(tb testing.TB, addr string) *Client {
	tb.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		tb.Fatal(err)
	}
	return Over(tb, c)
}

// Over speaks gRPC over c (a TLS connection, say), closed when the test
// ends.
func Over(tb testing.TB, c net.Conn) *Client {
	tb.Helper()
	r := &Client{tb: tb, conn: c, nextID: 1, window: 65535, ended: map[uint32]string{}, data: map[uint32][]byte{}}
	r.cond = sync.NewCond(&r.mu)
	r.fr = http2.NewFramer(c, c)
	r.henc = hpack.NewEncoder(&r.hbuf)
	if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
		tb.Fatal(err)
	}
	if err := r.fr.WriteSettings(); err != nil {
		tb.Fatal(err)
	}
	go r.readLoop()
	tb.Cleanup(func() { c.Close() })
	return r
}

// readLoop follows the server's frames: window updates, settings to
// acknowledge, and the ends of streams.
func (r *Client) readLoop() {
	fr := http2.NewFramer(io.Discard, r.conn)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			r.mu.Lock()
			r.readErr = err
			r.cond.Broadcast()
			r.mu.Unlock()
			return
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				r.wmu.Lock()
				r.fr.WriteSettingsAck()
				r.wmu.Unlock()
			}
		case *http2.WindowUpdateFrame:
			if f.StreamID == 0 {
				r.mu.Lock()
				r.window += int64(f.Increment)
				r.cond.Broadcast()
				r.mu.Unlock()
			}
		case *http2.MetaHeadersFrame:
			if st := f.PseudoValue("status"); f.StreamEnded() || st != "200" {
				msg := ""
				for _, hf := range f.Fields {
					if hf.Name == "grpc-status" {
						msg = hf.Value
					}
					if hf.Name == "grpc-message" {
						msg += " " + hf.Value
					}
				}
				r.mu.Lock()
				r.ended[f.StreamID] = strings.TrimSpace(msg)
				r.cond.Broadcast()
				r.mu.Unlock()
			}
		case *http2.DataFrame:
			r.mu.Lock()
			r.data[f.StreamID] = append(r.data[f.StreamID], f.Data()...)
			r.mu.Unlock()
		case *http2.RSTStreamFrame:
			r.mu.Lock()
			if _, ok := r.ended[f.StreamID]; !ok {
				r.ended[f.StreamID] = "reset " + f.ErrCode.String()
			}
			r.cond.Broadcast()
			r.mu.Unlock()
		case *http2.PingFrame:
			if !f.IsAck() {
				r.wmu.Lock()
				r.fr.WritePing(true, f.Data)
				r.wmu.Unlock()
			}
		}
	}
}

// Start opens a call to method, with header's name, value pairs added to
// its headers, and returns its stream ID.
func (r *Client) Start(method string, header ...string) uint32 {
	r.wmu.Lock()
	defer r.wmu.Unlock()
	id := r.nextID
	r.nextID += 2
	r.hbuf.Reset()
	for _, kv := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", method}, {":authority", "test"},
		{"content-type", "application/grpc"}, {"te", "trailers"}} {
		r.henc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
	}
	for i := 0; i+1 < len(header); i += 2 {
		r.henc.WriteField(hpack.HeaderField{Name: header[i], Value: header[i+1]})
	}
	if err := r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: r.hbuf.Bytes(), EndHeaders: true}); err != nil {
		r.tb.Fatal(err)
	}
	return id
}

// Send writes data on stream id within the connection's window, ending the
// stream with end. It returns the error that stopped it (the connection
// closed), if any.
func (r *Client) Send(id uint32, data []byte, end bool) error {
	for first := true; first || len(data) > 0; first = false {
		n := min(len(data), 16<<10)
		r.mu.Lock()
		for r.window < int64(n) && r.readErr == nil {
			r.cond.Wait()
		}
		err := r.readErr
		r.window -= int64(n)
		r.mu.Unlock()
		if err != nil {
			return err
		}
		r.wmu.Lock()
		err = r.fr.WriteData(id, end && n == len(data), data[:n])
		r.wmu.Unlock()
		if err != nil {
			return err
		}
		data = data[n:]
	}
	return nil
}

// Wait waits until stream id has ended and returns its grpc-status and
// message, or "" when the connection ended first.
func (r *Client) Wait(id uint32) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		if s, ok := r.ended[id]; ok {
			return s
		}
		if r.readErr != nil {
			return ""
		}
		r.cond.Wait()
	}
}

// GiveUpAfter ends the connection's reading after d: a test's guard
// against waiting for ever on a server that does not answer.
func (r *Client) GiveUpAfter(d time.Duration) { r.conn.SetReadDeadline(time.Now().Add(d)) }

// ClosedByServer reports whether the server closed the connection (not a
// deadline of giveUpAfter).
func (r *Client) ClosedByServer() (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ne net.Error
	return r.readErr != nil && !(errors.As(r.readErr, &ne) && ne.Timeout()), r.readErr
}

// Ended reports whether the server has ended stream id, and with what
// grpc-status and message.
func (r *Client) Ended(id uint32) (string, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s, ok := r.ended[id]
	return s, ok
}

// Received is what the server has sent on stream id so far: its messages,
// each with its length prefix. (Keep them small: the client grants no
// flow-control window beyond the initial 64 KiB.)
func (r *Client) Received(id uint32) []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return bytes.Clone(r.data[id])
}

// serverLive is the Open Inference Protocol's ServerLive method.
const serverLive = "/inference.GRPCInferenceService/ServerLive"

// Live sends a ServerLive call on a new stream and waits for its end. It
// is answered once the server has read every frame sent before it, so it
// also marks that point. It returns the call's grpc-status and message,
// or "" when the connection ended first.
func (r *Client) Live() (string, error) {
	id := r.Start(serverLive)
	if err := r.Send(id, Prefix(0), true); err != nil {
		return "", err
	}
	return r.Wait(id), nil
}

// Ping sends a PING frame.
func (r *Client) Ping() error {
	r.wmu.Lock()
	defer r.wmu.Unlock()
	return r.fr.WritePing(false, [8]byte{1})
}

// Close closes the connection.
func (r *Client) Close() error { return r.conn.Close() }

// Prefix is a gRPC message's length prefix for n bytes.
func Prefix(n int) []byte {
	b := make([]byte, 5)
	binary.BigEndian.PutUint32(b[1:], uint32(n))
	return b
}
