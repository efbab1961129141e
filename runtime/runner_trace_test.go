package runtime

import (
	"context"
	"math/rand/v2"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// A call under a recording span gets a runner span, its child, carrying
// the runner's own times; a call without one makes no span.
func TestRunnerTraceSpan(t *testing.T) {
	r := startTestRunner(t, testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx")))
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	rng := rand.New(rand.NewPCG(3, 4))

	req, want := rowSumsRequest(rng, 3)
	if _, err := r.Infer(t.Context(), req); err != nil {
		t.Fatal(err)
	}
	if n := len(rec.Ended()); n != 0 {
		t.Fatalf("%d spans of a call that is not traced", n)
	}

	ctx, parent := tp.Tracer("test").Start(context.Background(), "batch")
	resp, err := r.Infer(ctx, req)
	parent.End()
	if err != nil {
		t.Fatal(err)
	}
	checkRowSums(t, resp, want)
	var runner sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "runner" {
			runner = s
		}
	}
	if runner == nil || runner.Parent().SpanID() != parent.SpanContext().SpanID() {
		t.Fatalf("spans %v: want a runner span under batch", rec.Ended())
	}
	attrs := map[string]int64{}
	for _, a := range runner.Attributes() {
		attrs[string(a.Key)] = a.Value.AsInt64()
	}
	if attrs["sloserve.compute_infer_us"] != resp.Timing.Infer.Microseconds() ||
		attrs["sloserve.compute_input_us"] != resp.Timing.Input.Microseconds() ||
		attrs["sloserve.compute_output_us"] != resp.Timing.Output.Microseconds() {
		t.Errorf("attributes %v, timing %+v", runner.Attributes(), resp.Timing)
	}
	if runner.EndTime().Sub(runner.StartTime()) < resp.Timing.Infer {
		t.Errorf("runner span %v shorter than the session's run %v", runner.EndTime().Sub(runner.StartTime()), resp.Timing.Infer)
	}
}
