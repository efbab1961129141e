package runtime

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// This file carries calls to a runner over one long-lived connection per
// process: a Unix socket pair made when the process starts, the runner's
// end inherited as a descriptor (as the arena is). Requests carry ids, run
// concurrently in the runner and are answered in any order.
//
// The wire is framed protobuf: each message is a 4-byte little-endian
// length followed by a runnerpb.InferRequest (server to runner) or
// runnerpb.InferResponse (runner to server). A frame of length 0 from the
// runner says it is stopping and has answered every call it took; a
// connection that ends without one ended because the runner died. A
// caller writes its own frame, in one write, and the runner's answering
// goroutine its answer: no goroutine stands between a call and the socket
// (gRPC's stream hands each message to a writer goroutine and each received
// one to the stream's reader, at both ends).

// frameHeader is the size of a frame's length prefix.
const frameHeader = 4

// errGoodbye is why a stream ended when the runner said it is stopping;
// it wraps io.EOF, as a stream the runner ended cleanly did.
var errGoodbye = fmt.Errorf("the runner is stopping: %w", io.EOF)

// newCallPair makes the socket pair of a runner's calls: the server's end
// as a connection, the runner's as a file for it to inherit. Both are
// close-on-exec in the server, so no other child inherits either.
func newCallPair() (net.Conn, *os.File, error) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("call socket pair: %w", err)
	}
	mine := os.NewFile(uintptr(fds[0]), "runner-calls")
	defer mine.Close() // FileConn holds a duplicate
	conn, err := net.FileConn(mine)
	if err != nil {
		syscall.Close(fds[1])
		return nil, nil, fmt.Errorf("call socket pair: %w", err)
	}
	return conn, os.NewFile(uintptr(fds[1]), "runner-calls"), nil
}

// frameWriter writes frames to a connection from any goroutine, one at a
// time, reusing one buffer. Its zero value is ready to use.
type frameWriter struct {
	once sync.Once
	// turn holds a token while a frame is being written: a writer waiting
	// for its turn can give up (writeCtx), as one waiting on a mutex
	// could not.
	turn chan struct{}
	conn io.Writer
	buf  []byte
}

// take waits for the writer's turn, or for done to be closed (false).
func (w *frameWriter) take(done <-chan struct{}) bool {
	w.once.Do(func() { w.turn = make(chan struct{}, 1) })
	select {
	case w.turn <- struct{}{}:
		return true
	case <-done:
		return false
	}
}

func (w *frameWriter) release() { <-w.turn }

// write marshals m into one frame and writes it in one call. It sets no
// write deadline and clears none: a writer is used with write (the
// runner's side) or with writeCtx (the server's), never both, since
// writeCtx leaves its last slice's deadline on the connection.
func (w *frameWriter) write(m proto.Message) error {
	w.take(nil)
	defer w.release()
	b, err := w.frame(m)
	if err != nil {
		return err
	}
	_, err = w.conn.Write(b)
	w.keep(b)
	return err
}

// frame marshals m into the writer's buffer as one frame; the caller has
// the turn.
func (w *frameWriter) frame(m proto.Message) ([]byte, error) {
	b, err := proto.MarshalOptions{}.MarshalAppend(append(w.buf[:0], 0, 0, 0, 0), m)
	if err != nil {
		return nil, err
	}
	if n := len(b) - frameHeader; n > maxMessageSize {
		return nil, fmt.Errorf("message of %d bytes is over the limit of %d", n, maxMessageSize)
	}
	binary.LittleEndian.PutUint32(b, uint32(len(b)-frameHeader))
	return b, nil
}

// keep holds on to a frame's buffer for the next one, unless it is large.
func (w *frameWriter) keep(b []byte) {
	if cap(b) <= frameBufferKeep {
		w.buf = b
	}
}

// writeSlice bounds one blocked write of writeCtx, so that a context that
// ends without a deadline (cancelled) is seen within it.
const writeSlice = 20 * time.Millisecond

// writeCtx writes m as one frame, unless ctx ends first. A frame is never
// left half written: a stream that carries one can carry nothing more,
// and a runner that reads slowly (starved of CPU, or stopped for a while)
// is not broken. So ctx is only asked while nothing of the frame is
// written: a frame whose turn or first byte ctx outlasts is not written
// (errWriteExpired: the stream is whole). A frame begun when ctx ends is
// finished by a goroutine of its own, which keeps the turn until the
// frame is whole or the connection fails (the runner died, or was killed
// as hung by its health check, which looks at whether it gets the CPU);
// writeCtx then returns errWriteUnfinished: the call is sent, and its
// answer will come, or the stream's end. Any other error is the
// connection's.
func (w *frameWriter) writeCtx(ctx context.Context, m proto.Message) error {
	if !w.take(ctx.Done()) {
		return errWriteExpired
	}
	if ctx.Err() != nil {
		// Its turn and the context's end came together.
		w.release()
		return errWriteExpired
	}
	b, err := w.frame(m)
	if err != nil {
		w.release()
		return err
	}
	w.keep(b)
	d, ok := w.conn.(interface{ SetWriteDeadline(time.Time) error })
	if !ok {
		_, err = w.conn.Write(b)
		w.release()
		return err
	}
	deadline, bounded := ctx.Deadline()
	for off := 0; ; {
		until := time.Now().Add(writeSlice)
		if bounded && deadline.Before(until) {
			until = deadline
		}
		_ = d.SetWriteDeadline(until)
		n, err := w.conn.Write(b[off:])
		off += n
		if err == nil {
			w.release()
			return nil
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			w.release()
			return err
		}
		if ctx.Err() == nil && !(bounded && !time.Now().Before(deadline)) {
			continue // the runner reads slowly; ctx lasts
		}
		if off == 0 {
			w.release()
			return errWriteExpired
		}
		go w.finish(d, b[off:])
		return errWriteUnfinished
	}
}

// finish writes the rest of a frame whose caller has gone, with no
// deadline, then gives up the turn; a connection that fails under it is
// closed, so that the stream ends (its receiver fails the calls).
func (w *frameWriter) finish(d interface{ SetWriteDeadline(time.Time) error }, rest []byte) {
	defer w.release()
	_ = d.SetWriteDeadline(time.Time{})
	if _, err := w.conn.Write(rest); err != nil {
		if c, ok := w.conn.(io.Closer); ok {
			c.Close()
		}
	}
}

// errWriteExpired is a frame not written because its call's context ended
// before its turn to write came or before the runner took any of it.
var errWriteExpired = errors.New("the call's deadline passed before its request was written")

// errWriteUnfinished is a frame begun when its call's context ended: it
// is finished without the call (frameWriter.writeCtx).
var errWriteUnfinished = errors.New("the call's deadline passed while its request was written; the rest follows without it")

// writeGoodbye writes the empty frame that ends a runner's answers.
func (w *frameWriter) writeGoodbye() error {
	w.take(nil)
	defer w.release()
	_, err := w.conn.Write(make([]byte, frameHeader))
	return err
}

// frameBufferKeep is the largest frame buffer kept for the next message:
// a message with its tensors inline (no room in the arena) may be
// megabytes, and is not worth holding on to.
const frameBufferKeep = 64 << 10

// frameReader reads frames from one goroutine.
type frameReader struct {
	r   *bufio.Reader
	buf []byte
}

func newFrameReader(r io.Reader) *frameReader {
	return &frameReader{r: bufio.NewReaderSize(r, 64<<10)}
}

// next reads the next frame into m; it returns errGoodbye for an empty
// frame. The frame's buffer is reused: proto.Unmarshal copies what it keeps.
func (f *frameReader) next(m proto.Message) error {
	var h [frameHeader]byte
	if _, err := io.ReadFull(f.r, h[:]); err != nil {
		return err
	}
	n := binary.LittleEndian.Uint32(h[:])
	if n == 0 {
		return errGoodbye
	}
	if n > maxMessageSize {
		return fmt.Errorf("a frame of %d bytes is over the limit of %d", n, maxMessageSize)
	}
	b, err := f.body(int(n))
	if err != nil {
		return err
	}
	if n > frameBufferKeep {
		f.buf = nil
	}
	return proto.Unmarshal(b, m)
}

// frameGrowStep is the least a frame's buffer grows by while its body
// arrives.
const frameGrowStep = 1 << 20

// body reads a frame's n bytes. The buffer grows with what has arrived (it
// doubles, from frameGrowStep), not with what the header says: a broken
// runner whose header claims a gigabyte and which sends a few bytes costs
// the server a few megabytes, not the gigabyte.
func (f *frameReader) body(n int) ([]byte, error) {
	b := f.buf[:0]
	for len(b) < n {
		next := min(n, max(2*len(b), frameGrowStep, cap(b)))
		if cap(b) < next {
			b = append(make([]byte, 0, next), b...)
		}
		got := len(b)
		b = b[:next]
		if _, err := io.ReadFull(f.r, b[got:]); err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
	f.buf = b
	return b[:n], nil
}

// callStream is the server's end of a runner process's calls. One
// goroutine receives the answers and hands each to its caller.
type callStream struct {
	conn net.Conn
	w    frameWriter
	// onAbandoned is called from the receiving goroutine for an answer
	// whose caller has gone (its context ended), to free what the call
	// held.
	onAbandoned func(*pendingCall)
	// onBroken is called once when the stream ends, with why, before the
	// callers waiting on it are failed. io.EOF means the runner ended it
	// (it is stopping).
	onBroken func(error)

	// box is the runner's mailbox (runner_mailbox.go); nil: every call
	// goes on the socket.
	box *mailbox
	// dead is set when the stream ends, before the mailbox's waits end.
	dead atomic.Bool

	mu      sync.Mutex
	next    uint64
	pending map[uint64]*pendingCall
	err     error // why the stream ended; nil while it is open
	// protocolErr is why a caller found the runner breaking the protocol
	// and closed the connection.
	protocolErr error
	done        chan struct{}
}

// pendingCall is a call sent and not yet answered.
type pendingCall struct {
	reply chan *runnerpb.InferResponse // buffered; nil is sent when the stream ends
	// abandoned: the caller's context ended before the answer; the
	// receiving goroutine disposes of the answer.
	abandoned bool
	// slot is the arena slot the call holds, for onAbandoned.
	slot    uint64
	hasSlot bool
}

// openStream starts receiving answers on conn, the server's end of a ready
// runner's call pair, and sends calls through box when there is one and
// they fit. close ends it.
func openStream(conn net.Conn, box *mailbox, onAbandoned func(*pendingCall), onBroken func(error)) *callStream {
	c := &callStream{
		conn:        conn,
		box:         box,
		w:           frameWriter{conn: conn},
		onAbandoned: onAbandoned,
		onBroken:    onBroken,
		pending:     make(map[uint64]*pendingCall),
		done:        make(chan struct{}),
	}
	go c.receive()
	return c
}

func (c *callStream) receive() {
	defer close(c.done)
	fr := newFrameReader(c.conn)
	for {
		resp := &runnerpb.InferResponse{}
		if err := fr.next(resp); err != nil {
			if err == io.EOF {
				err = errors.New("the runner's connection closed without its goodbye")
			}
			c.mu.Lock()
			if c.protocolErr != nil {
				err = c.protocolErr
			}
			c.mu.Unlock()
			c.broken(err)
			c.conn.Close()
			return
		}
		c.mu.Lock()
		call, ok := c.pending[resp.GetId()]
		delete(c.pending, resp.GetId())
		c.mu.Unlock()
		switch {
		case !ok:
			// An id the server never sent or already answered: a runner
			// that breaks the protocol is not trusted with more calls.
			c.broken(fmt.Errorf("runner answered unknown call %d", resp.GetId()))
			c.conn.Close()
			return
		case call.abandoned:
			if c.onAbandoned != nil {
				c.onAbandoned(call)
			}
		default:
			call.reply <- resp
		}
	}
}

// broken fails every pending call after the stream ended.
func (c *callStream) broken(err error) {
	if c.onBroken != nil {
		c.onBroken(err)
	}
	if errors.Is(err, io.EOF) {
		err = errors.New("the runner closed its stream")
	}
	c.dead.Store(true)
	if c.box != nil {
		c.box.drop()
	}
	c.mu.Lock()
	if c.err == nil {
		c.err = err
	}
	calls := c.pending
	c.pending = map[uint64]*pendingCall{}
	c.mu.Unlock()
	for _, call := range calls {
		if !call.abandoned {
			call.reply <- nil
		}
	}
}

// brokenError is the error a call sees when the stream is gone, in the
// status shape inferError decodes.
func (c *callStream) brokenError() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return status.Error(codes.Unavailable, fmt.Sprint(c.err))
}

// call sends req and waits for its answer or for ctx to end. call.hasSlot
// and call.slot say what the request holds in the arena: when ctx ends
// first, the answer is left to onAbandoned. The request's id is set here.
func (c *callStream) call(ctx context.Context, req *runnerpb.InferRequest, call *pendingCall) (*runnerpb.InferResponse, error) {
	call.reply = replyChans.Get().(chan *runnerpb.InferResponse)
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return nil, c.brokenError()
	}
	c.next++
	req.Id = c.next
	c.pending[req.Id] = call
	c.mu.Unlock()

	if c.box != nil && c.box.acquire() {
		defer c.box.release()
		if i, ok := c.box.get(); ok {
			if size := proto.Size(req); size <= mailboxArea {
				return c.callMailbox(ctx, req, call, i, size)
			}
			c.box.put(i)
		}
	}

	err := c.w.writeCtx(ctx, req)
	switch {
	case errors.Is(err, errWriteExpired):
		// Nothing was written: only this call ends.
		c.mu.Lock()
		delete(c.pending, req.Id)
		c.mu.Unlock()
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		return nil, context.DeadlineExceeded
	case errors.Is(err, errWriteUnfinished):
		// The call ends at its context, as one waiting for its answer
		// does; the frame is finished without it, and its answer is left
		// to onAbandoned. Whether the runner is slow or hung is for its
		// health check to say, not for the write.
		return c.awaitReply(ctx, req, call)
	case err != nil:
		// The connection failed under the write: the runner died. The
		// receiver then fails the pending calls, this one with them
		// unless its answer came.
		c.conn.Close()
		<-c.done
		if resp := <-call.reply; resp != nil {
			return resp, nil
		}
		return nil, c.brokenError()
	}
	return c.awaitReply(ctx, req, call)
}

// replyChans are pendingCall.reply channels to reuse: a call answered in
// the mailbox gives its channel back.
var replyChans = sync.Pool{New: func() any { return make(chan *runnerpb.InferResponse, 1) }}

// awaitReply waits for the answer to a call sent on the socket, or for ctx
// to end.
func (c *callStream) awaitReply(ctx context.Context, req *runnerpb.InferRequest, call *pendingCall) (*runnerpb.InferResponse, error) {
	select {
	case resp := <-call.reply:
		if resp == nil {
			return nil, c.brokenError()
		}
		return resp, nil
	case <-ctx.Done():
	}
	c.mu.Lock()
	if _, ok := c.pending[req.Id]; ok {
		call.abandoned = true
		c.mu.Unlock()
		return nil, ctx.Err()
	}
	c.mu.Unlock()
	// The answer came as the context ended: take it, so that the caller
	// frees what the call held.
	resp := <-call.reply
	if resp == nil {
		return nil, c.brokenError()
	}
	return resp, nil
}

// callMailbox sends req, of size bytes, through slot i of the mailbox and
// waits for its answer there (or on the socket, when it did not fit), for
// the stream to break or for ctx to end.
func (c *callStream) callMailbox(ctx context.Context, req *runnerpb.InferRequest, call *pendingCall, i, size int) (*runnerpb.InferResponse, error) {
	alone := mailboxCalls.Add(1) == 1
	defer mailboxCalls.Add(-1)
	posted, err := c.box.post(i, req, size)
	if err != nil {
		c.box.put(i)
		c.mu.Lock()
		delete(c.pending, req.Id)
		c.mu.Unlock()
		return nil, err
	}
	// A short answer is polled for; a longer one slept on.
	s, ok := c.box.poll(i, &c.dead, alone)
	if !ok {
		stop := context.AfterFunc(ctx, func() { c.box.wake(i) })
		s = c.box.await(i, &c.dead, func() bool { return ctx.Err() != nil })
		stop()
	}
	if s != slotAnswered && s != slotOnSocket && !c.dead.Load() && s != slotDropped {
		// The context ended: the answer is left to reap, unless it came
		// just then.
		c.mu.Lock()
		s = atomic.LoadUint32(c.box.state(i))
		_, pending := c.pending[req.Id]
		if s != slotAnswered && pending {
			call.abandoned = true
		}
		c.mu.Unlock()
		if call.abandoned {
			if c.box.acquire() {
				go c.reap(i, req.Id, call)
			}
			return nil, ctx.Err()
		}
	}
	switch {
	case s == slotAnswered:
		resp, err := c.box.answer(i, req.Id)
		c.mu.Lock()
		_, mine := c.pending[req.Id]
		delete(c.pending, req.Id)
		c.mu.Unlock()
		if err == nil {
			c.box.learn(i, posted)
			c.box.put(i)
			if mine {
				// Taken out of pending here, not by a broken stream: the
				// call's channel is no one else's, and empty. The next
				// call takes it.
				replyChans.Put(call.reply)
				call.reply = nil
			}
		}
		if err != nil {
			// A runner that breaks the protocol is not trusted with more
			// calls: the stream ends, as for an unknown id on the socket.
			c.mu.Lock()
			if c.protocolErr == nil {
				c.protocolErr = err
			}
			c.mu.Unlock()
			c.conn.Close()
			<-c.done
			return nil, c.brokenError()
		}
		return resp, nil
	case s == slotOnSocket:
		// The runner no longer touches the slot; the answer comes on the
		// socket.
		c.box.put(i)
		return c.awaitReply(ctx, req, call)
	}
	// The stream broke: the receiver fails the call (or hands it an
	// answer that came on the socket first). The slot is not reused.
	if resp := <-call.reply; resp != nil {
		return resp, nil
	}
	return nil, c.brokenError()
}

// reap waits for the answer to an abandoned call in slot i, then frees
// what the call held. The caller acquired the mailbox for it.
func (c *callStream) reap(i int, id uint64, call *pendingCall) {
	defer c.box.release()
	switch c.box.await(i, &c.dead, func() bool { return false }) {
	case slotAnswered:
		c.mu.Lock()
		_, pending := c.pending[id]
		delete(c.pending, id)
		c.mu.Unlock()
		c.box.put(i)
		if pending && c.onAbandoned != nil {
			c.onAbandoned(call)
		}
	case slotOnSocket:
		// The receiver disposes of the answer.
		c.box.put(i)
	}
	// A broken stream: nothing is reused.
}

// close ends the stream; calls in flight fail with codes.Unavailable.
func (c *callStream) close() {
	c.conn.Close()
	<-c.done
}

// replyStatus turns a failed answer into the status error inferError
// decodes; nil when the call succeeded.
func replyStatus(resp *runnerpb.InferResponse) error {
	if resp.GetCode() == 0 {
		return nil
	}
	return status.Error(codes.Code(resp.GetCode()), resp.GetMessage())
}
