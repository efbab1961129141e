package runtime

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	goruntime "runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// streamPair is a callStream on one end of a real socket pair and the
// runner's end as a connection the test plays the runner on.
func streamPair(t *testing.T) (*callStream, net.Conn, chan error) {
	t.Helper()
	mine, theirs, err := newCallPair()
	if err != nil {
		t.Fatal(err)
	}
	runner, err := net.FileConn(theirs)
	theirs.Close()
	if err != nil {
		t.Fatal(err)
	}
	brokenWith := make(chan error, 1)
	c := openStream(mine, nil, nil, func(err error) { brokenWith <- err })
	t.Cleanup(func() {
		runner.Close()
		c.close()
	})
	return c, runner, brokenWith
}

// callAsync runs one call in a goroutine and returns its outcome.
func callAsync(t *testing.T, c *callStream) chan error {
	done := make(chan error, 1)
	go func() {
		resp, err := c.call(t.Context(), &runnerpb.InferRequest{}, &pendingCall{})
		if err == nil && resp.GetId() == 0 {
			err = errors.New("answer without id")
		}
		done <- err
	}()
	return done
}

func TestCallStreamAnswersOutOfOrder(t *testing.T) {
	c, runner, _ := streamPair(t)
	a, b := callAsync(t, c), callAsync(t, c)
	fr := newFrameReader(runner)
	w := &frameWriter{conn: runner}
	var ids []uint64
	for range 2 {
		req := &runnerpb.InferRequest{}
		if err := fr.next(req); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, req.GetId())
	}
	// The second call is answered first.
	for _, id := range []uint64{ids[1], ids[0]} {
		if err := w.write(&runnerpb.InferResponse{Id: id}); err != nil {
			t.Fatal(err)
		}
	}
	for _, done := range []chan error{a, b} {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}

// A runner that says goodbye ended its calls cleanly (io.EOF to
// onBroken); one whose connection just closes died, which is not io.EOF.
// Calls left pending fail as unavailable either way.
func TestCallStreamGoodbyeAndDeath(t *testing.T) {
	for _, tc := range []struct {
		name    string
		goodbye bool
	}{{"goodbye", true}, {"died", false}} {
		t.Run(tc.name, func(t *testing.T) {
			c, runner, brokenWith := streamPair(t)
			done := callAsync(t, c)
			if err := newFrameReader(runner).next(&runnerpb.InferRequest{}); err != nil {
				t.Fatal(err)
			}
			if tc.goodbye {
				if err := (&frameWriter{conn: runner}).writeGoodbye(); err != nil {
					t.Fatal(err)
				}
			} else {
				runner.Close()
			}
			err := <-brokenWith
			if got := errors.Is(err, io.EOF); got != tc.goodbye {
				t.Fatalf("onBroken(%v): io.EOF is %v, want %v", err, got, tc.goodbye)
			}
			if err := <-done; status.Code(err) != codes.Unavailable {
				t.Fatalf("pending call: %v, want Unavailable", err)
			}
			// Later calls fail at once.
			if _, err := c.call(t.Context(), &runnerpb.InferRequest{}, &pendingCall{}); status.Code(err) != codes.Unavailable {
				t.Fatalf("call after the end: %v, want Unavailable", err)
			}
		})
	}
}

// A runner that breaks the protocol (an id never sent, a frame over the
// limit) ends the stream; the oversized frame is refused from its header,
// before anything is allocated for it.
func TestCallStreamProtocolBreaks(t *testing.T) {
	for _, tc := range []struct {
		name  string
		frame func() []byte
		want  string
	}{
		{"unknown id", func() []byte {
			var b []byte
			w := &frameWriter{conn: writerFunc(func(p []byte) (int, error) { b = append(b, p...); return len(p), nil })}
			_ = w.write(&runnerpb.InferResponse{Id: 99})
			return b
		}, "unknown call 99"},
		{"oversized", func() []byte {
			return binary.LittleEndian.AppendUint32(nil, maxMessageSize+1)
		}, "over the limit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, runner, brokenWith := streamPair(t)
			if _, err := runner.Write(tc.frame()); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-brokenWith:
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("onBroken(%v), want %q", err, tc.want)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the stream did not end")
			}
		})
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// The call pair's ends are close-on-exec in the server: no other child
// inherits a runner's calls.
func TestCallPairCloseOnExec(t *testing.T) {
	mine, theirs, err := newCallPair()
	if err != nil {
		t.Fatal(err)
	}
	defer mine.Close()
	defer theirs.Close()
	flags, err := fcntlFlags(theirs)
	if err != nil {
		t.Fatal(err)
	}
	if flags&1 == 0 { // FD_CLOEXEC
		t.Fatal("the runner's end is inheritable by every child")
	}
}

func fcntlFlags(f *os.File) (int, error) {
	raw, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var flags int
	var ferr error
	err = raw.Control(func(fd uintptr) {
		flags, ferr = fcntl(fd)
	})
	return flags, errors.Join(err, ferr)
}

func fcntl(fd uintptr) (int, error) {
	r, _, errno := syscall.Syscall(syscall.SYS_FCNTL, fd, syscall.F_GETFD, 0)
	if errno != 0 {
		return 0, errno
	}
	return int(r), nil
}

// A runner that stops reading its calls (hung, stopped) cannot hold a
// caller past its deadline in the write: the half-written frame ends the
// stream, and the call fails as unavailable.
func TestCallStreamWriteGivesUpAtDeadline(t *testing.T) {
	c, _, brokenWith := streamPair(t) // the runner's end is never read
	big := &runnerpb.InferRequest{Inputs: []*runnerpb.Tensor{{Name: "x", Data: make([]byte, 16<<20)}}}
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := c.call(ctx, big, &pendingCall{})
		done <- err
	}()
	select {
	case err := <-done:
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("call: %v, want Unavailable", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the call is stuck writing to a runner that does not read")
	}
	if err := <-brokenWith; errors.Is(err, io.EOF) {
		t.Fatalf("onBroken(%v): a stream cut by the server is not the runner's goodbye", err)
	}
}

// A call whose deadline passes while it waits for its turn to write is not
// written at all: it fails with its deadline, and the stream (and so the
// runner) serves the next call. Under load this was a runner killed for a
// request that expired in the writers' queue.
func TestCallStreamExpiredBeforeWriteKeepsStream(t *testing.T) {
	c, runner, brokenWith := streamPair(t)
	ctx, cancel := context.WithDeadline(t.Context(), time.Now().Add(-time.Millisecond))
	defer cancel()
	if _, err := c.call(ctx, &runnerpb.InferRequest{}, &pendingCall{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("expired call: %v, want its deadline", err)
	}
	done := callAsync(t, c)
	req := &runnerpb.InferRequest{}
	if err := newFrameReader(runner).next(req); err != nil {
		t.Fatal(err)
	}
	if err := (&frameWriter{conn: runner}).write(&runnerpb.InferResponse{Id: req.GetId()}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("the call after an expired one: %v", err)
	}
	select {
	case err := <-brokenWith:
		t.Fatalf("the stream ended: %v", err)
	default:
	}
}

// A frame's buffer grows with its body as it arrives: a header that claims
// a gigabyte followed by a few bytes and the end of the connection costs a
// few megabytes, not the gigabyte; a large frame that does arrive is read
// whole across the growth steps.
func TestFrameReaderAllocatesWhatArrives(t *testing.T) {
	claim := binary.LittleEndian.AppendUint32(nil, maxMessageSize)
	var before, after goruntime.MemStats
	goruntime.ReadMemStats(&before)
	err := newFrameReader(bytes.NewReader(append(claim, "ten bytes!"...))).next(&runnerpb.InferResponse{})
	goruntime.ReadMemStats(&after)
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("a frame cut short: %v, want io.ErrUnexpectedEOF", err)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 8<<20 {
		t.Errorf("reading 10 bytes of a frame that claims %d allocated %d bytes, want a few MiB at most", maxMessageSize, got)
	}

	want := &runnerpb.InferResponse{Id: 7, Message: strings.Repeat("x", 5<<20+3)}
	var wire bytes.Buffer
	w := &frameWriter{conn: &wire}
	if err := w.write(want); err != nil {
		t.Fatal(err)
	}
	r := newFrameReader(&wire)
	var got runnerpb.InferResponse
	if err := r.next(&got); err != nil {
		t.Fatal(err)
	}
	if got.Id != want.Id || got.Message != want.Message {
		t.Errorf("a 5 MiB frame read back as id %d with %d bytes of message, want id 7 with %d", got.Id, len(got.Message), len(want.Message))
	}
}
