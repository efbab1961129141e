package runtime

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	goruntime "runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/internal/syncbuf"
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

// startBigCall starts a call of a 16 MiB frame on c and waits until the
// runner's end has seen its header: the frame is being written. It
// returns the call's outcome and the frame's length; cancel ends the
// call's context.
func startBigCall(t *testing.T, c *callStream, runner net.Conn) (done chan error, n uint32, cancel context.CancelFunc) {
	t.Helper()
	big := &runnerpb.InferRequest{Inputs: []*runnerpb.Tensor{{Name: "x", Data: bytes.Repeat([]byte{7}, 16<<20)}}}
	ctx, cancel := context.WithCancel(t.Context())
	done = make(chan error, 1)
	go func() {
		_, err := c.call(ctx, big, &pendingCall{})
		done <- err
	}()
	var h [frameHeader]byte
	if _, err := io.ReadFull(runner, h[:]); err != nil {
		t.Fatal(err)
	}
	return done, binary.LittleEndian.Uint32(h[:]), cancel
}

// A runner that stops reading its calls (starved, stopped, hung) cannot
// hold a caller past its context in the write, and does not lose its
// stream for it: the call ends with its context, the frame it began is
// finished once the runner reads again, whole, and the next call is
// served on the same stream. A later caller waits for its turn no longer
// than its own deadline (nothing of its frame is written).
func TestCallStreamWriteGivesUpAtDeadline(t *testing.T) {
	c, runner, brokenWith := streamPair(t)
	done, n, cancel := startBigCall(t, c, runner) // then the runner reads no more
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("call: %v, want its context's end", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the call is stuck writing to a runner that does not read")
	}
	// Behind the unfinished frame, a call with a short deadline of its
	// own fails at it, nothing written.
	short, cancelShort := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancelShort()
	if _, err := c.call(short, &runnerpb.InferRequest{}, &pendingCall{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a call behind the unfinished frame: %v, want its deadline", err)
	}
	select {
	case err := <-brokenWith:
		t.Fatalf("the stream ended at the call's end: %v", err)
	default:
	}
	// The runner reads again: the frame is whole, and the next call on the
	// stream is answered.
	body := make([]byte, n)
	if _, err := io.ReadFull(runner, body); err != nil {
		t.Fatal(err)
	}
	got := &runnerpb.InferRequest{}
	if err := proto.Unmarshal(body, got); err != nil {
		t.Fatalf("the finished frame: %v", err)
	}
	if in := got.GetInputs(); len(in) != 1 || !bytes.Equal(in[0].GetData(), bytes.Repeat([]byte{7}, 16<<20)) {
		t.Fatalf("the finished frame has %d inputs, not the 16 MiB of 7s sent", len(in))
	}
	// Its answer, its caller gone, is disposed of; the next call's is
	// taken.
	fr := newFrameReader(runner)
	w := &frameWriter{conn: runner}
	if err := w.write(&runnerpb.InferResponse{Id: got.GetId()}); err != nil {
		t.Fatal(err)
	}
	next := callAsync(t, c)
	req := &runnerpb.InferRequest{}
	if err := fr.next(req); err != nil {
		t.Fatal(err)
	}
	if err := w.write(&runnerpb.InferResponse{Id: req.GetId()}); err != nil {
		t.Fatal(err)
	}
	if err := <-next; err != nil {
		t.Fatalf("the call after the finished frame: %v", err)
	}
	select {
	case err := <-brokenWith:
		t.Fatalf("the stream ended: %v", err)
	default:
	}
}

// A frame being finished for a caller that has gone ends the stream when
// the runner's end closes under it (the runner died or was killed as
// hung): the write does not wait for ever, and the next call fails as
// unavailable.
func TestCallStreamUnfinishedFrameEndsWithTheRunner(t *testing.T) {
	c, runner, brokenWith := streamPair(t)
	done, _, cancel := startBigCall(t, c, runner)
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("call: %v, want its context's end", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the call is stuck writing to a runner that does not read")
	}
	runner.Close()
	select {
	case err := <-brokenWith:
		if errors.Is(err, io.EOF) {
			t.Fatalf("onBroken(%v): a runner gone mid-frame did not say goodbye", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the stream did not end when the runner's end closed under an unfinished frame")
	}
	if _, err := c.call(t.Context(), &runnerpb.InferRequest{}, &pendingCall{}); status.Code(err) != codes.Unavailable {
		t.Fatalf("call after the end: %v, want Unavailable", err)
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

// A runner that stops reading while a large call is written to it (here
// stopped for a moment with SIGSTOP, as a runner of the idle class goes
// without CPU while other work wants it) is not killed for it: the call
// ends at its deadline, the rest of its frame is written once the runner
// reads again, and the same process answers the next call right. One that
// stays stopped (hung) is killed by its health checks and replaced. Before,
// the half-written frame closed the stream and the slow runner was killed
// with the hung one.
func TestRunnerSlowReaderMidWrite(t *testing.T) {
	for _, tc := range []struct {
		name string
		hung bool
	}{{"stopped a while", false}, {"hung", true}} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
			// No arena and no mailbox: the request's tensor is in its
			// frame, megabytes that the socket's buffer cannot hold.
			cfg.ArenaSize, cfg.MailboxSlots = -1, -1
			cfg.HealthInterval = time.Minute // the pause is not a hang
			if tc.hung {
				cfg.HealthInterval = 150 * time.Millisecond
			}
			var log syncbuf.Buffer
			cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(t.Output(), &log), &slog.HandlerOptions{Level: slog.LevelDebug}))
			r := startTestRunner(t, cfg)
			pid := r.Pid()
			rng := rand.New(rand.NewPCG(3, 3))
			big, _ := rowSumsRequest(rng, 1<<17) // 5 MiB of input
			freeze(t, pid)
			ctx, cancel := context.WithTimeout(t.Context(), time.Second)
			_, err := r.Infer(ctx, big)
			cancel()
			// The hung one may be killed before the deadline.
			if !errors.Is(err, context.DeadlineExceeded) && !(tc.hung && errors.Is(err, ErrUnavailable)) {
				t.Fatalf("a call on the stopped runner: %v, want its deadline", err)
			}
			if tc.hung {
				waitFor(t, 30*time.Second, "the hung runner to be replaced", func() bool {
					return r.Pid() != 0 && r.Pid() != pid && r.State() == RunnerReady
				})
				if !strings.Contains(log.String(), "runner hung") || !processGone(pid) {
					t.Errorf("runner %d replaced, but not killed as hung (gone: %v)", pid, processGone(pid))
				}
			} else {
				if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
					t.Fatal(err)
				}
			}
			req, want := rowSumsRequest(rng, 7)
			resp, err := r.Infer(t.Context(), req)
			if err != nil {
				t.Fatalf("the call after: %v (state %s: %s)", err, r.State(), r.Reason())
			}
			checkRowSums(t, resp, want)
			if tc.hung {
				return
			}
			if r.Pid() != pid || r.Restarts() != 0 || strings.Contains(log.String(), "killing") {
				t.Errorf("the runner stopped for a while was replaced: pid %d, was %d; %d restarts", r.Pid(), pid, r.Restarts())
			}
		})
	}
}
