package e2e

import (
	"context"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
)

// gatedConn is a client's connection whose writes stop once allow bytes
// have gone (allow < 0: no limit): a link that stalls, leaving the
// messages under way unfinished at the server.
type gatedConn struct {
	net.Conn
	mu    sync.Mutex
	cond  *sync.Cond
	allow int64
}

func (c *gatedConn) Write(p []byte) (int, error) {
	written := 0
	for len(p) > 0 {
		c.mu.Lock()
		for c.allow == 0 {
			c.cond.Wait()
		}
		n := len(p)
		if c.allow > 0 {
			n = int(min(int64(n), c.allow))
			c.allow -= int64(n)
		}
		c.mu.Unlock()
		m, err := c.Conn.Write(p[:n])
		written += m
		if err != nil {
			return written, err
		}
		p = p[n:]
	}
	return written, nil
}

// add lets n more bytes through.
func (c *gatedConn) add(n int64) {
	c.mu.Lock()
	c.allow += n
	c.cond.Broadcast()
	c.mu.Unlock()
}

// set lets allow more bytes through (< 0: all).
func (c *gatedConn) set(allow int64) {
	c.mu.Lock()
	c.allow = allow
	c.cond.Broadcast()
	c.mu.Unlock()
}

// TestE2EGRPCSlowCallsLeaveRoom: the real binary, with a 256 MiB budget and
// messages of up to 64 MiB, reads eight 1.2 MB calls stalled unfinished on one
// connection while it serves calls on another: the stalled calls hold
// what has arrived of them and what a message on their connection is
// expected to take, a few MiB, not the largest message each (512 MiB, so
// that half of them were refused and the budget was full: at 10x overload
// over gRPC, the latency-critical calls were refused at their headers).
// Once the link moves again, all eight are read whole and answered by the
// model (whose batches are of at most 8 rows: INVALID_ARGUMENT naming the
// 30000), and the budget is whole.
func TestE2EGRPCSlowCallsLeaveRoom(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), pinnedDyn(1)})
	s := startServer(t, repo, memoryLimits)
	start := time.Now()
	if _, err := s.grpc.ModelInfer(t.Context(), grpcDynRequest()); err != nil {
		t.Fatal(err)
	}
	guard := 200 * time.Since(start)

	var gate *gatedConn
	conn, err := grpc.NewClient(s.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
			if err != nil {
				return nil, err
			}
			gate = &gatedConn{Conn: c, allow: -1}
			gate.cond = sync.NewCond(&gate.mu)
			return gate, nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	slow := inference.NewGRPCInferenceServiceClient(conn)
	// A client's first calls: small ones, as a client's first are.
	for range 6 {
		if _, err := slow.ModelInfer(t.Context(), grpcDynRequest()); err != nil {
			t.Fatal(err)
		}
	}
	// A call's response is given back at its end (stats.End), which the
	// server may reach just after the client has its answer: beside two
	// burners, 8 bytes (a response's) were still held 17-22 ms after, in
	// 4 runs of 10.
	waitFor(t, "nothing reserved with no call under way", guard, func() bool {
		v, _ := s.metricValue(t, "sloserve_memory_reserved_bytes")
		return v == 0
	})

	const calls, rows = 8, 30000 // 1.2 MB each
	big := grpcDynRequest()
	big.Inputs[0].Shape = []int64{rows, 10}
	big.Inputs[0].Contents.Fp32Contents = make([]float32, rows*10)
	// Less than one message gets through, a tenth of one per call: none
	// is finished. Each call is started while the link is stalled, so
	// that its headers go first when it moves again.
	const size, allowed = rows * 10 * 4, calls * rows * 10 * 4 / 10
	gate.set(0)
	defer gate.set(-1)
	ended := make(chan error, calls)
	for range calls {
		go func() {
			// The model takes batches of at most 8 rows: its answer to
			// the whole message, read and decoded, is INVALID_ARGUMENT
			// naming the 30000 rows.
			_, err := slow.ModelInfer(context.WithoutCancel(t.Context()), big)
			if st := status.Convert(err); st.Code() == codes.InvalidArgument && strings.Contains(st.Message(), "batch size 30000") {
				err = nil
			}
			ended <- err
		}()
		time.Sleep(guard / 200) // the call's headers are queued
		gate.add(allowed / calls)
	}
	// After six small messages, a message on the connection is expected
	// to take 64 MiB halved six times: all eight are in when they hold
	// that each.
	// A call's headers can sit in the client's write queue behind the
	// frames of calls before it that used up what the link let through:
	// the link then moves a little at a time until every call holds at
	// the server, never past half of all the messages, so none finishes.
	const expected = 64 << 20 >> 6
	var held float64
	sent := int64(allowed)
	for deadline := time.Now().Add(guard); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if held, _ = s.metricValue(t, "sloserve_memory_reserved_bytes"); held >= calls*expected {
			break
		}
		if sent+16<<10 <= calls*size/2 {
			gate.add(16 << 10)
			sent += 16 << 10
		}
	}
	t.Logf("%d calls of %d KiB, %d KiB of them sent, hold %.0f KiB of the %d MiB budget", calls, size>>10, sent>>10, held/1024, memoryBudget>>20)
	// Each holds what a message on its connection is expected to take
	// (after small ones: little), and its connection what has arrived
	// beyond: under twice their whole messages.
	if held < calls*expected {
		t.Errorf("the stalled calls hold %.0f bytes, want at least %d each: not all of them reached the server", held, expected)
	}
	if held > 2*calls*size {
		t.Errorf("the stalled calls hold %.0f bytes, over twice their whole messages' %d", held, calls*size)
	}
	select {
	case err := <-ended:
		t.Fatalf("a stalled call ended: %v", err)
	default:
	}
	if _, err := s.grpc.ModelInfer(t.Context(), grpcDynRequest()); err != nil {
		t.Fatalf("a call on another connection while %d are stalled: %v", calls, err)
	}

	gate.set(-1)
	for i := range calls {
		select {
		case err := <-ended:
			if err != nil {
				t.Errorf("stalled call %d, once the link moved: %v", i, err)
			}
		case <-time.After(guard):
			t.Fatalf("%d of %d stalled calls unanswered after the link moved", calls-i, calls)
		}
	}
	deadline := time.Now().Add(guard)
	for v, _ := s.metricValue(t, "sloserve_memory_reserved_bytes"); v != 0; v, _ = s.metricValue(t, "sloserve_memory_reserved_bytes") {
		if time.Now().After(deadline) {
			t.Fatalf("sloserve_memory_reserved_bytes = %v after every call ended, want 0", v)
		}
		time.Sleep(10 * time.Millisecond)
	}
	s.stillServing(t)
}

// TestE2EGRPCFreshChannelBurst: a Go service that opens one gRPC channel
// to a server just started with the default limits and sends a burst of
// 20 concurrent calls at once has all of them served. grpc-go writes the
// calls' headers before their messages, so all 20 are being read at once
// on a fresh connection, each reserving the largest message (64 MiB);
// held to its quarter of the budget, the connection took 12 of them and
// refused the rest RESOURCE_EXHAUSTED on a server with gigabytes free.
// Past its quarter a connection's calls are let in while at most half of
// the budget is taken (25 such calls), and the burst leaves nothing
// reserved.
func TestE2EGRPCFreshChannelBurst(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), pinnedDyn(1)})
	s := startServer(t, repo, "")
	const burst = 20
	for round := range 3 {
		conn, err := grpc.NewClient(s.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		client := inference.NewGRPCInferenceServiceClient(conn)
		refusedBefore, ok := s.metricValue(t, "sloserve_memory_refused_total")
		if !ok {
			t.Fatal("no sloserve_memory_refused_total")
		}
		errs := make([]error, burst)
		gate := make(chan struct{})
		var wg sync.WaitGroup
		for i := range burst {
			wg.Go(func() {
				<-gate
				_, errs[i] = client.ModelInfer(t.Context(), grpcDynRequest())
			})
		}
		close(gate)
		wg.Wait()
		conn.Close()
		failed := 0
		for i, err := range errs {
			if err != nil {
				failed++
				t.Errorf("round %d, call %d of a burst of %d on a fresh channel: %v", round, i, burst, err)
			}
		}
		refused, ok := s.metricValue(t, "sloserve_memory_refused_total")
		if !ok {
			t.Fatal("no sloserve_memory_refused_total")
		}
		t.Logf("round %d: a burst of %d calls on a fresh channel: %d failed; sloserve_memory_refused_total +%.0f", round, burst, failed, refused-refusedBefore)
		if refused != refusedBefore {
			t.Errorf("round %d: sloserve_memory_refused_total went from %.0f to %.0f, want no refusal", round, refusedBefore, refused)
		}
	}
	s.noneReserved(t, "after the bursts")
	s.stillServing(t)
}
