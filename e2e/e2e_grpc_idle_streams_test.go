package e2e

// End-to-end test of idle gRPC streams (issue 30): a streaming call holds,
// while idle, only its stream's buffers, and its messages are counted as
// they arrive.

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/internal/rawgrpc"
)

// TestE2EGRPCIdleStreamsHoldLittle: two clients each open sixteen
// ModelStreamInfer streams and send nothing on them. Each stream reserved
// the largest message (64 MiB) for its life before, so the fourth filled
// the 246 MiB left to requests and every other call was refused
// RESOURCE_EXHAUSTED for as long as the clients kept them. Now they hold
// their streams' buffers only: all thirty-two stay open, another client's
// ModelInfer and another stream's message are served, and a stream that
// then sends a 24 MiB message has it counted while it arrives (the budget
// gauge rises by what was sent), served, and given back.
func TestE2EGRPCIdleStreamsHoldLittle(t *testing.T) {
	s, _ := startMemoryServer(t, "")
	start := time.Now()
	if _, err := s.grpc.ModelInfer(t.Context(), grpcDynRequest()); err != nil {
		t.Fatal(err)
	}
	guard := max(time.Minute, 5000*time.Since(start))

	const clients, perClient = 2, 16
	raws := make([]*rawgrpc.Client, clients)
	var ids [clients][]uint32
	for i := range raws {
		raws[i] = rawgrpc.Dial(t, s.grpcAddr)
		raws[i].GiveUpAfter(guard)
		for range perClient {
			ids[i] = append(ids[i], raws[i].Start(inference.GRPCInferenceService_ModelStreamInfer_FullMethodName))
		}
		// Answered once the server has read (and admitted or refused)
		// every stream opened before it.
		got, err := raws[i].Live()
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(got, "0") {
			t.Fatalf("client %d: ServerLive after its streams: %q", i, got)
		}
	}
	for i, r := range raws {
		for _, id := range ids[i] {
			if end, ended := r.Ended(id); ended {
				t.Fatalf("client %d: idle stream %d ended %q, want it open", i, id, end)
			}
		}
	}
	// Each holds its buffers and headers (limits.max_header_bytes, 64
	// KiB by default).
	idle := float64(clients * perClient * api.GRPCStreamBytes(64<<10))
	waitFor(t, "the idle streams' reservations", guard, func() bool {
		v, _ := s.metricValue(t, "sloserve_memory_reserved_bytes")
		return v == idle
	})
	t.Logf("%d idle streams reserve %.2f MiB of the %d MiB budget", clients*perClient, idle/(1<<20), memoryBudget>>20)

	// Another client's call, and another stream's message, are served.
	conn := s.grpcConn(t)
	client := inference.NewGRPCInferenceServiceClient(conn)
	if _, err := client.ModelInfer(t.Context(), grpcDynRequest()); err != nil {
		t.Errorf("another client's ModelInfer beside %d idle streams: %v", clients*perClient, err)
	}
	stream, err := client.ModelStreamInfer(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(grpcDynRequest()); err != nil {
		t.Fatal(err)
	}
	if resp, err := stream.Recv(); err != nil || resp.GetErrorMessage() != "" {
		t.Errorf("another stream's message beside %d idle streams: %v %q", clients*perClient, err, resp.GetErrorMessage())
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err == nil {
		t.Error("the other stream sent a second answer")
	}

	// An idle stream sends a 24 MiB message (a request to dyn padded with
	// a parameter the server ignores): counted as it arrives, served,
	// and given back.
	big := grpcDynRequest()
	big.Parameters = map[string]*inference.InferParameter{
		"padding": {ParameterChoice: &inference.InferParameter_StringParam{StringParam: strings.Repeat("x", 24<<20)}},
	}
	msg, err := proto.Marshal(big)
	if err != nil {
		t.Fatal(err)
	}
	wire := append(rawgrpc.Prefix(len(msg)), msg...)
	const firstPart = 12 << 20
	r, id := raws[0], ids[0][0]
	if err := r.Send(id, wire[:firstPart], false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the first 12 MiB of a stream's message counted", guard, func() bool {
		v, _ := s.metricValue(t, "sloserve_memory_reserved_bytes")
		return v >= idle+firstPart
	})
	if err := r.Send(id, wire[firstPart:], true); err != nil {
		t.Fatal(err)
	}
	if got := r.Wait(id); !strings.HasPrefix(got, "0") {
		t.Fatalf("the stream with a 24 MiB message ended %q, want OK", got)
	}
	var answer inference.ModelStreamInferResponse
	if got := r.Received(id); len(got) < 5 {
		t.Errorf("the stream with a 24 MiB message got %d bytes of answers", len(got))
	} else if err := proto.Unmarshal(got[5:], &answer); err != nil || answer.GetErrorMessage() != "" || len(answer.GetInferResponse().GetOutputs()) == 0 {
		t.Errorf("the answer to a 24 MiB message: %v %q, %d outputs", err, answer.GetErrorMessage(), len(answer.GetInferResponse().GetOutputs()))
	}
	waitFor(t, "the 24 MiB message's memory given back", guard, func() bool {
		v, _ := s.metricValue(t, "sloserve_memory_reserved_bytes")
		return v < idle
	})
	for i, r := range raws {
		if closed, err := r.ClosedByServer(); closed {
			t.Errorf("client %d: the connection was closed by the server (%v)", i, err)
		}
		r.Close()
	}
	waitFor(t, "the idle streams' memory given back", guard, func() bool {
		v, _ := s.metricValue(t, "sloserve_memory_reserved_bytes")
		return v == 0
	})
	s.stillServing(t)
}
