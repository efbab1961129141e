package api

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/qos"
)

// What the server's CPU pays to receive a gRPC message it refuses, against
// what receiving the same bytes costs at all.
//
// The floor is a reader that takes 1.2 MB units off a loopback TCP
// connection into one reused buffer (a kernel copy per byte, a few large
// reads). The server is NewGRPC, as sloserve serves it, on a
// LimitedListener with a memory budget, for a model that refuses every
// call from the name at the start of its message (as a model does at 10x
// overload). The senders run in a process of their own (this test binary,
// TestGRPCReceiveSenderProcess), so that getrusage of this process counts
// the receiving side alone.

// recvMessageBytes is the PP-OCRv4 detector's 320x320 request tensor, as
// the overload benchmark sends it.
const recvMessageBytes = 3 * 320 * 320 * 4

// recvSendersPerConn are the calls each connection of the gRPC sender
// keeps in flight.
const recvSendersPerConn = 8

// recvSenderEnv tells the test binary, started again, to send: "raw" or
// "grpc", the address and the number of connections.
const recvSenderEnv = "SLOSERVE_RECV_SENDER"

// recvCounter counts messages received, and wakes a waiter at a target.
type recvCounter struct {
	n      atomic.Int64
	mu     sync.Mutex
	target int64
	done   chan struct{}
}

func (c *recvCounter) add() {
	n := c.n.Add(1)
	c.mu.Lock()
	if c.done != nil && n >= c.target {
		close(c.done)
		c.done = nil
	}
	c.mu.Unlock()
}

// wait returns once k more messages have been received, or false after a
// minute.
func (c *recvCounter) wait(k int64) bool {
	done := make(chan struct{})
	c.mu.Lock()
	c.target, c.done = c.n.Load()+k, done
	c.mu.Unlock()
	select {
	case <-done:
		return true
	case <-time.After(time.Minute):
		return false
	}
}

// processCPU is the CPU this process has used.
func processCPU(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// startRecvSender starts this test binary again as a sender of mode to
// addr over conns connections; it stops when stop is called (once or
// more), after which output holds what it printed.
func startRecvSender(tb testing.TB, mode, addr string, conns int) (stop func(), output *bytes.Buffer) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestGRPCReceiveSenderProcess$", "-test.v")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s %s %d", recvSenderEnv, mode, addr, conns))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	stdin, err := cmd.StdinPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			stdin.Close() // the sender stops at its end
			done := make(chan struct{})
			go func() { cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				cmd.Process.Kill()
				<-done
			}
		})
	}, &out
}

// measureRecv runs a sender of mode to addr and returns this process's CPU
// per message over window messages counted by c, after a warm-up.
func measureRecv(b *testing.B, c *recvCounter, mode, addr string, conns int, window int64) time.Duration {
	stop, out := startRecvSender(b, mode, addr, conns)
	defer stop()
	if !c.wait(window / 10) {
		stop()
		b.Fatalf("%s sender: no messages within a minute; its output:\n%s", mode, out)
	}
	cpu0 := processCPU(b)
	if !c.wait(window) {
		stop()
		b.Fatalf("%s sender: %d messages not received within a minute; its output:\n%s", mode, window, out)
	}
	return (processCPU(b) - cpu0) / time.Duration(window)
}

// floorReceiver reads recvMessageBytes units off every connection it
// accepts into a buffer of its own, counting them.
func floorReceiver(b *testing.B, c *recvCounter) (addr string, stop func()) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var open []net.Conn
	wg.Go(func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			open = append(open, conn)
			mu.Unlock()
			wg.Go(func() {
				buf := make([]byte, recvMessageBytes)
				for {
					if _, err := io.ReadFull(conn, buf); err != nil {
						return
					}
					c.add()
				}
			})
		}
	})
	return ln.Addr().String(), func() {
		ln.Close()
		mu.Lock()
		for _, conn := range open {
			conn.Close()
		}
		mu.Unlock()
		wg.Wait()
	}
}

// refusingBackend refuses every ModelInfer call from its model name, and
// counts the refusals.
type refusingBackend struct {
	*fakeBackend
	refused *recvCounter
}

func (r refusingBackend) Preadmit(context.Context, string, string, time.Time) error {
	r.refused.add()
	return fmt.Errorf("%w: the model holds 256 requests", qos.ErrQueueFull)
}

// grpcReceiver is NewGRPC with opts, as sloserve serves it (a
// LimitedListener, a 4 GiB budget, 64 MiB messages), for a backend that
// refuses every ModelInfer call.
func grpcReceiver(b *testing.B, c *recvCounter, opts ...grpc.ServerOption) (addr string, stop func()) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	lim := Limits{MaxRequestBytes: 64 << 20, MaxTensorElements: 1 << 26, Memory: NewMemoryBudget(4 << 30)}
	srv := NewGRPC(refusingBackend{fakeBackend: newFakeBackend(), refused: c}, lim, slog.New(slog.DiscardHandler), opts...)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(NewLimitedListener(ln, 1024, 0)) }()
	return ln.Addr().String(), func() {
		srv.Stop()
		if err := <-done; err != nil {
			b.Errorf("Serve: %v", err)
		}
	}
}

// BenchmarkGRPCRefusedReceive reports the server's CPU per refused 1.2 MB
// ModelInfer message received (server-µs/msg), the floor's per 1.2 MB
// read off a loopback socket (floor-µs/msg) and their ratio (x-floor),
// measured one after the other in each sub-benchmark, over 1 and 4
// connections. opts=sloserve is the server as sloserve sets it up
// (NewGRPC with GRPCTransportOptions); the other variants override its
// read buffer, to compare. With
// -cpuprofile the profile is the receiving side's alone.
//
//	go test -run '^$' -bench GRPCRefusedReceive -benchtime 1x -count 3 ./api
func BenchmarkGRPCRefusedReceive(b *testing.B) {
	window := int64(300)
	if v := os.Getenv("SLOSERVE_RECV_WINDOW"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 10 {
			b.Fatalf("SLOSERVE_RECV_WINDOW=%q: want a message count >= 10", v)
		}
		window = n
	}
	type variant struct {
		name string
		opts []grpc.ServerOption
	}
	variants := []variant{
		{"sloserve", nil},
		// Read buffers of other sizes (0: frames read straight off
		// the connection, their headers and payloads a read each);
		// 32 KiB is grpc-go's own, which sloserve had before.
		{"read0", []grpc.ServerOption{grpc.ReadBufferSize(0)}},
		{"read32KiB", []grpc.ServerOption{grpc.ReadBufferSize(32 << 10)}},
		{"read256KiB", []grpc.ServerOption{grpc.ReadBufferSize(256 << 10)}},
		{"read1MiB", []grpc.ServerOption{grpc.ReadBufferSize(1 << 20)}},
		// Frame buffers from a pool that does not clear them, to
		// measure what grpc-go's clearing costs (not safe to serve
		// with: see dirtyPool).
		{"dirtyPool", []grpc.ServerOption{experimental.BufferPool(newDirtyPool())}},
	}
	if v := os.Getenv("SLOSERVE_RECV_VARIANTS"); v != "" {
		keep := strings.Split(v, ",")
		variants = slices.DeleteFunc(variants, func(vr variant) bool { return !slices.Contains(keep, vr.name) })
		if len(variants) == 0 {
			b.Fatalf("SLOSERVE_RECV_VARIANTS=%q names no variant", v)
		}
	}
	for _, conns := range []int{1, 4} {
		for _, v := range variants {
			b.Run(fmt.Sprintf("conns=%d/opts=%s", conns, v.name), func(b *testing.B) {
				var floor, server time.Duration
				for b.Loop() {
					var fc recvCounter
					addr, stop := floorReceiver(b, &fc)
					floor += measureRecv(b, &fc, "raw", addr, conns, window)
					stop()
					var gc recvCounter
					addr, stop = grpcReceiver(b, &gc, append(GRPCTransportOptions(), v.opts...)...)
					server += measureRecv(b, &gc, "grpc", addr, conns, window)
					stop()
				}
				us := func(d time.Duration) float64 { return float64(d) / float64(b.N) / 1e3 }
				b.ReportMetric(us(floor), "floor-µs/msg")
				b.ReportMetric(us(server), "server-µs/msg")
				b.ReportMetric(float64(server)/float64(floor), "x-floor")
			})
		}
	}
}

// TestGRPCReceiveSenderProcess is BenchmarkGRPCRefusedReceive's sender,
// when this binary is started as one (recvSenderEnv); otherwise it skips.
// It sends until its standard input ends: raw 1.2 MB units, or ModelInfer
// calls of a 1.2 MB tensor, recvSendersPerConn at once on each connection.
func TestGRPCReceiveSenderProcess(t *testing.T) {
	spec := os.Getenv(recvSenderEnv)
	if spec == "" {
		t.Skip("the receive benchmark's sender, run by BenchmarkGRPCRefusedReceive")
	}
	var mode, addr string
	var conns int
	if _, err := fmt.Sscanf(spec, "%s %s %d", &mode, &addr, &conns); err != nil {
		t.Fatalf("%s=%q: %v", recvSenderEnv, spec, err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	go func() {
		io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	payload := make([]byte, recvMessageBytes)
	var wg sync.WaitGroup
	for range conns {
		switch mode {
		case "raw":
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			context.AfterFunc(ctx, func() { conn.Close() })
			wg.Go(func() {
				for ctx.Err() == nil {
					if _, err := conn.Write(payload); err != nil {
						return
					}
				}
			})
		case "grpc":
			conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
				grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(1<<30)))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			client := inference.NewGRPCInferenceServiceClient(conn)
			req := &inference.ModelInferRequest{ModelName: "busy",
				Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1, 3, 320, 320}}},
				RawInputContents: [][]byte{payload}}
			for range recvSendersPerConn {
				wg.Go(func() {
					for ctx.Err() == nil {
						if _, err := client.ModelInfer(ctx, req); err == nil {
							t.Error("a call the server refuses every call of was served")
							return
						}
					}
				})
			}
		default:
			t.Fatalf("%s=%q: mode %q, want raw or grpc", recvSenderEnv, spec, mode)
		}
	}
	wg.Wait()
	if err := ctx.Err(); !errors.Is(err, context.Canceled) {
		t.Fatalf("senders ended before their input did: %v", err)
	}
}

// largestReadListener records the largest read asked of its connections.
type largestReadListener struct {
	net.Listener
	largest *atomic.Int64
}

func (l largestReadListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return largestReadConn{Conn: c, largest: l.largest}, nil
}

type largestReadConn struct {
	net.Conn
	largest *atomic.Int64
}

func (c largestReadConn) Read(p []byte) (int, error) {
	for n := int64(len(p)); ; {
		old := c.largest.Load()
		if n <= old || c.largest.CompareAndSwap(old, n) {
			break
		}
	}
	return c.Conn.Read(p)
}

// The server reads a connection through grpcReadBufferSize at a time, not
// grpc-go's 32 KiB: a 1.2 MB message took 38 reads or more, and the
// server's CPU per refused message on one connection fell from 1.36-1.56
// ms to 0.91-1.24 ms when they were 128 KiB (BenchmarkGRPCRefusedReceive).
func TestGRPCServerReadsInLargePieces(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var largest atomic.Int64
	var refused recvCounter
	srv := NewGRPC(refusingBackend{fakeBackend: newFakeBackend(), refused: &refused},
		Limits{MaxRequestBytes: 64 << 20, MaxTensorElements: 1 << 26}, slog.New(slog.DiscardHandler), GRPCTransportOptions()...)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(largestReadListener{Listener: lis, largest: &largest}) }()
	t.Cleanup(func() {
		srv.Stop()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(1<<30)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	req := &inference.ModelInferRequest{ModelName: "busy",
		Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1, 3, 320, 320}}},
		RawInputContents: [][]byte{make([]byte, recvMessageBytes)}}
	_, err = inference.NewGRPCInferenceServiceClient(conn).ModelInfer(t.Context(), req)
	if status.Code(err) != codes.ResourceExhausted || refused.n.Load() != 1 {
		t.Fatalf("ModelInfer: %v after %d refusals, want RESOURCE_EXHAUSTED after 1", err, refused.n.Load())
	}
	if got := largest.Load(); got < grpcReadBufferSize {
		t.Errorf("the server read its connection %d bytes at a time at most, want %d", got, grpcReadBufferSize)
	}
}

// dirtyPool is a mem.BufferPool of power-of-two classes that hands out
// buffers as they were put back, for the benchmark alone: grpc-go's
// default pool clears every buffer it hands out, and whether every Get in
// grpc-go writes all of its buffer before anyone reads it (else one
// client's bytes reach another) has not been shown.
type dirtyPool struct {
	classes [21]sync.Pool // class c holds buffers of 1<<c bytes
}

func newDirtyPool() *dirtyPool { return &dirtyPool{} }

func (p *dirtyPool) class(n int) int {
	c := 0
	for 1<<c < n {
		c++
	}
	return c
}

func (p *dirtyPool) Get(n int) *[]byte {
	c := p.class(n)
	if c >= len(p.classes) {
		b := make([]byte, n)
		return &b
	}
	if b, ok := p.classes[c].Get().(*[]byte); ok {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<c)
	return &b
}

func (p *dirtyPool) Put(b *[]byte) {
	c := p.class(cap(*b))
	if c < len(p.classes) && cap(*b) == 1<<c {
		p.classes[c].Put(b)
	}
}

var _ mem.BufferPool = (*dirtyPool)(nil)
