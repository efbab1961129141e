package e2e

// End-to-end tests of the gRPC messages being read (issue 30's last two
// reading gaps): a call whose message never finishes is cut by
// limits.body_timeout, and the frames of calls refused at their headers
// are not counted against their connection.

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/internal/rawgrpc"
)

// TestE2EGRPCUnfinishedMessageTimesOut: beside a ModelStreamInfer stream
// idle from its start and a health Watch, clients each open a call on a
// connection of their own and send its headers and 1 MiB of a 60 MiB
// message, and stall. A unary call holds the largest message (64 MiB, on
// a fresh connection): with three of them, another client's call is
// refused, the budget full. A stream holds what it was sent (1 MiB each
// for two of them). With limits.body_timeout short, the stalled
// connections are closed by the server (logged at WARN with each peer),
// the memory they held comes back and another client's call is then
// served. So for unary ModelInfer calls and for ModelStreamInfer streams
// whose message began and did not finish; a stream idle between messages
// and a health Watch, opened before them, are left open.
func TestE2EGRPCUnfinishedMessageTimesOut(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), pinnedDyn(1)})
	const timeout = 2 * time.Second
	s := startServer(t, repo, strings.Replace(memoryLimits, "body_timeout: 30s", "body_timeout: "+timeout.String(), 1))
	start := time.Now()
	if _, err := s.grpc.ModelInfer(t.Context(), grpcDynRequest()); err != nil {
		t.Fatal(err)
	}
	guard := max(20*timeout, 1000*time.Since(start))

	for _, method := range []string{inference.GRPCInferenceService_ModelInfer_FullMethodName, inference.GRPCInferenceService_ModelStreamInfer_FullMethodName} {
		t.Run(method[strings.LastIndex(method, "/")+1:], func(t *testing.T) {
			// The idle stream holds its buffers for its life; the Watch
			// gives its reservation back once it has its message.
			idle := rawgrpc.Dial(t, s.grpcAddr)
			idle.GiveUpAfter(guard)
			idleID := idle.Start(inference.GRPCInferenceService_ModelStreamInfer_FullMethodName)
			// A health Watch sends its one message and is answered for
			// as long as it lasts.
			watchID := idle.Start("/grpc.health.v1.Health/Watch")
			if err := idle.Send(watchID, rawgrpc.Prefix(0), true); err != nil {
				t.Fatal(err)
			}
			var base float64
			waitFor(t, "the idle stream and the Watch reserved", guard, func() bool {
				// Once the Watch has answered, its handler has started
				// and given its message's reservation back.
				base, _ = s.metricValue(t, "sloserve_memory_reserved_bytes")
				return len(idle.Received(watchID)) > 0 && base == float64(api.GRPCStreamBytes(64<<10))
			})

			const declared, sent = 60 << 20, 1 << 20
			unary := method == inference.GRPCInferenceService_ModelInfer_FullMethodName
			stalled := 2
			if unary {
				stalled = 3
			}
			closesBefore, _ := s.metricValue(t, slowClients("grpc", "body_timeout"))
			clients := make([]*rawgrpc.Client, stalled)
			ids := make([]uint32, stalled)
			for i := range clients {
				clients[i] = rawgrpc.Dial(t, s.grpcAddr)
				clients[i].GiveUpAfter(guard)
				ids[i] = clients[i].Start(method)
				if err := clients[i].Send(ids[i], append(rawgrpc.Prefix(declared), make([]byte, sent-5)...), false); err != nil {
					t.Fatal(err)
				}
			}
			// The stalled unary calls hold the budget: a call on a fresh
			// connection is refused, unless the server already cut them
			// (a host slower than the body timeout). The stalled streams
			// hold what they were sent.
			var (
				held                   float64
				err                    error
				refusedFirst, cutFirst bool
			)
			if unary {
				held, _ = s.metricValue(t, "sloserve_memory_reserved_bytes")
				_, err = inference.NewGRPCInferenceServiceClient(s.grpcConn(t)).ModelInfer(t.Context(), grpcDynRequest())
				refusedFirst = status.Code(err) == codes.ResourceExhausted
			} else {
				// Unless the server already cut them.
				waitFor(t, "the stalled streams' bytes counted", guard, func() bool {
					held, _ = s.metricValue(t, "sloserve_memory_reserved_bytes")
					if held >= base+float64(stalled*sent) {
						return true
					}
					for _, c := range clients {
						if closed, _ := c.ClosedByServer(); closed {
							return true
						}
					}
					return false
				})
			}
			for _, c := range clients {
				if closed, _ := c.ClosedByServer(); closed {
					cutFirst = true
				}
			}
			if unary && !refusedFirst && !cutFirst {
				t.Fatalf("a call on a fresh connection while %d stalled calls and an idle stream hold %.0f MiB: %v, want RESOURCE_EXHAUSTED", stalled, held/(1<<20), err)
			}

			for i, c := range clients {
				if got := c.Wait(ids[i]); got != "" {
					t.Errorf("stalled call %d ended %q, want its connection closed", i, got)
				}
				if closed, err := c.ClosedByServer(); !closed {
					t.Errorf("stalled call %d: its connection was not closed by the server (%v)", i, err)
				}
			}
			// Each close is counted before it is made.
			if closes, _ := s.metricValue(t, slowClients("grpc", "body_timeout")); closes-closesBefore != float64(stalled) {
				t.Errorf("%s counted %.0f closes, want the %d stalled connections'", slowClients("grpc", "body_timeout"), closes-closesBefore, stalled)
			}
			waitFor(t, "the stalled connections' memory given back", guard, func() bool {
				v, _ := s.metricValue(t, "sloserve_memory_reserved_bytes")
				return v == base
			})
			if _, err := inference.NewGRPCInferenceServiceClient(s.grpcConn(t)).ModelInfer(t.Context(), grpcDynRequest()); err != nil {
				t.Errorf("a call on a fresh connection once the stalled ones were cut: %v", err)
			}
			if closed, err := idle.ClosedByServer(); closed {
				t.Errorf("a stream idle between messages was closed by the server (%v)", err)
			}
			if _, ended := idle.Ended(idleID); ended {
				t.Error("a stream idle between messages was ended by the server")
			}
			if end, ended := idle.Ended(watchID); ended {
				t.Errorf("a health Watch was ended by the server: %q", end)
			}
			if !s.logHas("WARN", "limits.body_timeout", "peer=127.0.0.1:", method) {
				t.Errorf("no WARN naming limits.body_timeout, the peer and %s in the server's log", method)
			}
			t.Logf("%d stalled calls and an idle stream held %.1f MiB; a call meanwhile: %v (refused first: %v, cut first: %v)", stalled, held/(1<<20), err, refusedFirst, cutFirst)
			idle.Close()
		})
	}
	s.stillServing(t)
}

// TestE2EGRPCRefusedFramesNotCounted: a client opens two calls on a fresh
// connection (each may take the largest message, 64 MiB: the connection's
// share), sends 1 MiB of each, then opens fifty more, refused at their
// headers for the share, and sends 4 MiB on each before it hears (200
// MiB, which grpc-go drops as it arrives). The connection holds what its
// two calls reserved, not the frames of the refused ones: a call on
// another fresh connection, which needs 64 MiB of the budget's 246, is
// served. (Counting everything read since the oldest call being read
// began, the connection held over 200 MiB and that call was refused.)
//
// The two admitted calls stay unfinished while the refused ones are sent:
// limits.body_timeout is 10m here, as a -race client beside two CPU
// burners took over 30 s to send the refused calls' 200 MiB, and the
// server, right to do so, closed the connection at the 30 s of the other
// memory tests.
func TestE2EGRPCRefusedFramesNotCounted(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), pinnedDyn(1)})
	s := startServer(t, repo, strings.Replace(memoryLimits, "body_timeout: 30s", "body_timeout: 10m", 1))
	s.stillServing(t)
	start := time.Now()
	if _, err := s.grpc.ModelInfer(t.Context(), grpcDynRequest()); err != nil {
		t.Fatal(err)
	}
	guard := max(time.Minute, 5000*time.Since(start))

	r := rawgrpc.Dial(t, s.grpcAddr)
	r.GiveUpAfter(guard)
	const admitted, refused, declared = 2, 50, 60 << 20
	var ids []uint32
	for range admitted + refused {
		ids = append(ids, r.Start(inference.GRPCInferenceService_ModelInfer_FullMethodName))
	}
	for i, id := range ids {
		n := 1 << 20
		if i >= admitted {
			n = 4 << 20
		}
		if err := r.Send(id, append(rawgrpc.Prefix(declared), make([]byte, n-5)...), false); err != nil {
			t.Fatalf("sending on stream %d: %v", id, err)
		}
	}
	// A last call is answered once the server has read every frame
	// before it (refused too, for the share).
	if got, err := r.Live(); err != nil {
		t.Fatal(err)
	} else if got == "" {
		t.Fatal("the connection ended before its last call was answered")
	}
	for i, id := range ids {
		end, ok := r.Ended(id)
		switch {
		case i < admitted && ok:
			t.Fatalf("admitted call %d ended %q: its message was never finished", i, end)
		case i >= admitted && !(strings.HasPrefix(end, "8 ") && strings.Contains(end, "limits.max_memory")):
			t.Fatalf("call %d: %q, want refused at its headers naming limits.max_memory", i, end)
		}
	}
	held, _ := s.metricValue(t, "sloserve_memory_reserved_bytes")
	_, err := inference.NewGRPCInferenceServiceClient(s.grpcConn(t)).ModelInfer(t.Context(), grpcDynRequest())
	t.Logf("2 calls with 1 MiB of their messages and %d refused with 4 MiB sent each hold %.1f MiB of the %d MiB budget; a call on another connection: %v",
		refused, held/(1<<20), memoryBudget>>20, err)
	if err != nil {
		t.Errorf("a call on another connection: %v, want it served", err)
	}
	if closed, err := r.ClosedByServer(); closed {
		t.Errorf("the connection was closed by the server (%v)", err)
	}
	r.Close()
	waitFor(t, "the connection's memory given back", guard, func() bool {
		v, _ := s.metricValue(t, "sloserve_memory_reserved_bytes")
		return v == 0
	})
	s.stillServing(t)
}
