package e2e

import (
	"net/http"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
)

// The real binary at limits.max_inflight_requests refuses a gRPC inference
// call from its headers, before its 8 MiB message is read: the answer is
// RESOURCE_EXHAUSTED, the refusal is counted in
// sloserve_requests_refused_unread_total (no model's count: the model is
// named in the message), and once the request in flight has finished the
// server serves gRPC calls again. The request in flight is a 3-second
// execution on a simulated GPU, so that it is surely in flight.
func TestE2EGRPCRefusedBeforeItsMessageIsRead(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), `execution: {provider: cuda, simulated: {preset: mobilenet, fixed: 3s}}
`})
	s := startServer(t, repo, "gpu:\n  simulator: {devices: 1}\n",
		withSet("limits.max_inflight_requests=1"), withSet("control.policy=static"), withSet("control.profile.enabled=false"))
	metric := func(series string) float64 {
		v, _ := s.metricValue(t, series)
		return v
	}
	if v := metric("sloserve_requests_refused_unread_total"); v != 0 {
		t.Fatalf("refused unread at start: %v", v)
	}
	slow := make(chan int, 1)
	go func() {
		code, _, _ := s.do(t, http.MethodPost, "/v2/models/dyn/infer", dynBody)
		slow <- code
	}()
	waitFor(t, "the slow request in flight", 10*time.Second, func() bool {
		return metric(`sloserve_qos_inflight_requests{class="best-effort",device="cuda:0",model="dyn/1"}`) == 1
	})

	conn, err := grpc.NewClient(s.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(64<<20)))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := inference.NewGRPCInferenceServiceClient(conn)
	const rows = 8 << 20 / 40 // 8 MiB of [rows, 10] FP32
	big := &inference.ModelInferRequest{ModelName: "dyn", Inputs: []*inference.ModelInferRequest_InferInputTensor{{
		Name: "input_vectors", Datatype: "FP32", Shape: []int64{rows, 10}}},
		RawInputContents: [][]byte{make([]byte, rows*40)}}
	start := time.Now()
	_, err = c.ModelInfer(t.Context(), big)
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a call while the server holds its one request: %v, want RESOURCE_EXHAUSTED", err)
	}
	t.Logf("refused in %v: %v", time.Since(start), err)
	if v := metric("sloserve_requests_refused_unread_total"); v != 1 {
		t.Errorf("sloserve_requests_refused_unread_total = %v, want 1", v)
	}
	if code := <-slow; code != http.StatusOK {
		t.Fatalf("the request in flight: %d", code)
	}
	if _, err := c.ModelInfer(t.Context(), grpcDynRequest()); err != nil {
		t.Fatalf("a call once the server has room: %v", err)
	}
}
