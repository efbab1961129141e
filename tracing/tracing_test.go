package tracing

import (
	"context"
	"errors"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// newTestProvider samples by s and records the ended spans.
func newTestProvider(s *Settings) (*sdktrace.TracerProvider, *tracetest.SpanRecorder) {
	rec := tracetest.NewSpanRecorder()
	return sdktrace.NewTracerProvider(sdktrace.WithSampler(s.Sampler()), sdktrace.WithSpanProcessor(rec)), rec
}

// request starts and ends a root span with a child, as one request does,
// under parent's span context (none when invalid), and reports whether it
// was traced.
func request(tp trace.TracerProvider, parent trace.SpanContext) bool {
	ctx := context.Background()
	if parent.IsValid() {
		ctx = trace.ContextWithRemoteSpanContext(ctx, parent)
	}
	ctx, root := tp.Tracer("t").Start(ctx, "infer")
	_, child := tp.Tracer("t").Start(ctx, "queue")
	child.End()
	root.End()
	return root.IsRecording() || root.SpanContext().IsSampled()
}

// Triton's trace settings decide: one request in trace_rate, trace_count
// of them, none at OFF; a request's own spans follow its root; a client's
// sampled flag neither forces nor stops a trace.
func TestSettingsSample(t *testing.T) {
	s, err := NewSettings(Values{Level: LevelTimestamps, Rate: 3, Count: -1})
	if err != nil {
		t.Fatal(err)
	}
	tp, rec := newTestProvider(s)
	var traced []int
	for i := range 9 {
		if request(tp, trace.SpanContext{}) {
			traced = append(traced, i)
		}
	}
	if len(traced) != 3 || traced[0] != 0 || traced[1] != 3 || traced[2] != 6 {
		t.Errorf("traced %v, want the 1st, 4th and 7th of 9 at rate 3", traced)
	}
	if n := len(rec.Ended()); n != 6 {
		t.Errorf("%d spans recorded, want 6 (root and child of 3 requests)", n)
	}

	one := int64(1)
	two := int64(2)
	if _, err := s.Update(Change{Rate: &one, Count: &two}); err != nil {
		t.Fatal(err)
	}
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	unsampled := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, Remote: true})
	sampled := unsampled.WithTraceFlags(trace.FlagsSampled)
	if !request(tp, unsampled) || !request(tp, sampled) || request(tp, sampled) {
		t.Error("with a count of 2, want the first two traced whatever the client's flag, then none")
	}
	if got := s.Get(); got.Count != 0 || got.Rate != 1 {
		t.Errorf("settings after the count ran out: %+v", got)
	}
	// The traced request under the client's span is its child, in its trace.
	for _, sp := range rec.Ended() {
		if sp.Name() == "infer" && sp.Parent().SpanID() == sid && sp.SpanContext().TraceID() != tid {
			t.Errorf("a child of the client's span in trace %v, want %v", sp.SpanContext().TraceID(), tid)
		}
	}

	off := LevelOff
	if _, err := s.Update(Change{Level: &off, ResetCount: true}); err != nil {
		t.Fatal(err)
	}
	if got := s.Get(); got.Level != LevelOff || got.Count != -1 {
		t.Errorf("after OFF and a reset count: %+v", got)
	}
	if request(tp, sampled) {
		t.Error("a request traced at OFF")
	}
	if _, err := s.Update(Change{ResetLevel: true, ResetRate: true}); err != nil {
		t.Fatal(err)
	}
	if got := s.Get(); got != (Values{Level: LevelTimestamps, Rate: 3, Count: -1}) {
		t.Errorf("after resetting everything: %+v", got)
	}
}

// An invalid change changes nothing.
func TestSettingsInvalid(t *testing.T) {
	s, err := NewSettings(Values{Level: LevelTimestamps, Rate: 10, Count: 5})
	if err != nil {
		t.Fatal(err)
	}
	zero, neg, bad := int64(0), int64(-2), "DETAILED"
	one := int64(1)
	for _, c := range []Change{{Rate: &zero}, {Count: &neg, Rate: &one}, {Level: &bad, Rate: &one}} {
		if _, err := s.Update(c); !errors.Is(err, ErrInvalid) {
			t.Errorf("%+v: %v, want ErrInvalid", c, err)
		}
	}
	if got := s.Get(); got != (Values{Level: LevelTimestamps, Rate: 10, Count: 5}) {
		t.Errorf("settings changed by invalid changes: %+v", got)
	}
	if _, err := NewSettings(Values{Level: LevelTimestamps, Rate: 0}); !errors.Is(err, ErrInvalid) {
		t.Errorf("NewSettings with rate 0: %v", err)
	}
}
