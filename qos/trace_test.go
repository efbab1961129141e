package qos

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

func spanAttr(s sdktrace.ReadOnlySpan, key string) attribute.Value {
	for _, a := range s.Attributes() {
		if string(a.Key) == key {
			return a.Value
		}
	}
	return attribute.Value{}
}

// A traced request's stages: queue from its arrival to its batch's start,
// batch from there to its outcome, both under the caller's span; untraced
// requests in the same batch add nothing; a request refused at admission
// gets its queue span with the outcome.
func TestTraceSpans(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := tracetest.NewSpanRecorder()
		tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
		h := newHarness(t, Options{})
		h.model(ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 4}, nil)
		traced := func() (context.Context, trace.Span) { return tp.Tracer("test").Start(t.Context(), "infer") }
		ctx1, root1 := traced()
		ctx2, root2 := traced()
		p1 := h.submit(ctx1, "m", RequestOptions{}, 1)
		time.Sleep(2 * ms)
		p2 := h.submit(ctx2, "m", RequestOptions{}, 2)
		p3 := h.submit(t.Context(), "m", RequestOptions{}, 3)
		dispatched := time.Now()
		h.run()
		mustSucceed(t, p1, p2, p3)
		root1.End()
		root2.End()

		byParent := map[trace.SpanID]map[string]sdktrace.ReadOnlySpan{}
		for _, s := range rec.Ended() {
			if s.Name() == "infer" {
				continue
			}
			if byParent[s.Parent().SpanID()] == nil {
				byParent[s.Parent().SpanID()] = map[string]sdktrace.ReadOnlySpan{}
			}
			byParent[s.Parent().SpanID()][s.Name()] = s
		}
		if len(rec.Ended()) != 6 {
			t.Fatalf("%d spans, want 2 roots with a queue and a batch span each", len(rec.Ended()))
		}
		for i, root := range []trace.Span{root1, root2} {
			spans := byParent[root.SpanContext().SpanID()]
			q, b := spans["queue"], spans["batch"]
			if q == nil || b == nil {
				t.Fatalf("request %d: spans %v", i+1, spans)
			}
			if !q.EndTime().Equal(dispatched) || !b.StartTime().Equal(dispatched) || !b.EndTime().Equal(dispatched.Add(10*ms)) {
				t.Errorf("request %d: queue [%v, %v], batch [%v, %v]; dispatched at %v, 10 ms execution", i+1,
					q.StartTime(), q.EndTime(), b.StartTime(), b.EndTime(), dispatched)
			}
			if size := spanAttr(b, "sloserve.batch.size").AsInt64(); size != 3 || spanAttr(b, "sloserve.outcome").AsString() != "good" {
				t.Errorf("request %d: batch attributes %v", i+1, b.Attributes())
			}
		}
		// Each queue span starts at its own arrival: request 1 waited 2 ms
		// longer than request 2.
		q1, q2 := byParent[root1.SpanContext().SpanID()]["queue"], byParent[root2.SpanContext().SpanID()]["queue"]
		if d1, d2 := q1.EndTime().Sub(q1.StartTime()), q2.EndTime().Sub(q2.StartTime()); d1-d2 != 2*ms {
			t.Errorf("queued %v and %v, want 2 ms apart", d1, d2)
		}

		// Refused at admission: a queue span, with the outcome.
		ctx4, root4 := traced()
		p4 := h.submit(ctx4, "m", RequestOptions{Deadline: time.Now().Add(-ms)}, 4)
		if err := p4.wait(t); !errors.Is(err, ErrRejected) {
			t.Fatalf("late request: %v", err)
		}
		root4.End()
		var q4 sdktrace.ReadOnlySpan
		for _, s := range rec.Ended() {
			if s.Parent().SpanID() == root4.SpanContext().SpanID() {
				if q4 != nil || s.Name() != "queue" {
					t.Fatalf("rejected request: span %s", s.Name())
				}
				q4 = s
			}
		}
		if q4 == nil || spanAttr(q4, "sloserve.outcome").AsString() != "rejected" || q4.Status().Description == "" {
			t.Errorf("rejected request's queue span %v", q4)
		}
	})
}
