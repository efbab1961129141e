package qos

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// A traced request's stages in the scheduler, as spans under the span its
// caller's context carries (the api's infer span): queue, from arrival to
// the start of its execution, and batch, the execution it ran in. The
// execution's context carries the batch span of its first traced request,
// so the runner's span (runtime) nests under it. Requests whose caller's
// span is not recording (tracing off, or not sampled) cost nothing here.

const tracerName = "github.com/sloserve/sloserve/qos"

// traceOf is the caller's span of a request when it is recording.
func traceOf(ctx context.Context) trace.Span {
	if sp := trace.SpanFromContext(ctx); sp.IsRecording() {
		return sp
	}
	return nil
}

// traceDispatchLocked records the queue span of each traced request of e,
// now dispatched at now, and starts its batch span. It returns ctx with the
// batch span of the first traced request, for the execution.
func traceDispatchLocked(ctx context.Context, e *execution, now time.Time) context.Context {
	var first trace.Span
	for _, r := range e.reqs {
		if r.span == nil {
			continue
		}
		parent := trace.ContextWithSpan(context.Background(), r.span)
		tr := r.span.TracerProvider().Tracer(tracerName)
		_, q := tr.Start(parent, "queue", trace.WithTimestamp(r.arrival),
			trace.WithAttributes(attribute.String("sloserve.model", e.name)))
		q.End(trace.WithTimestamp(now))
		_, r.batchSpan = tr.Start(parent, "batch", trace.WithTimestamp(now), trace.WithAttributes(
			attribute.String("sloserve.model", e.name),
			attribute.Int("sloserve.batch.size", e.size),
			attribute.Int("sloserve.batch.requests", len(e.reqs)),
		))
		if first == nil {
			first = r.batchSpan
		}
	}
	if first == nil {
		return ctx
	}
	return trace.ContextWithSpan(ctx, first)
}

// traceFinishLocked ends r's batch span, if it has one, at now with the
// request's outcome; a traced request that ends before it ran (rejected,
// dropped, canceled while queued) gets its queue span, ending now.
func traceFinishLocked(r *request, o outcome, now time.Time, err error) {
	if r.span == nil {
		return
	}
	if r.batchSpan == nil {
		if r.started.IsZero() {
			_, q := r.span.TracerProvider().Tracer(tracerName).Start(trace.ContextWithSpan(context.Background(), r.span), "queue",
				trace.WithTimestamp(r.arrival), trace.WithAttributes(
					attribute.String("sloserve.model", r.m.spec.Name), attribute.String("sloserve.outcome", o.String())))
			if err != nil {
				q.SetStatus(otelcodes.Error, err.Error())
			}
			q.End(trace.WithTimestamp(now))
		}
		return
	}
	r.batchSpan.SetAttributes(attribute.String("sloserve.outcome", o.String()))
	if err != nil {
		r.batchSpan.SetStatus(otelcodes.Error, err.Error())
	}
	r.batchSpan.End(trace.WithTimestamp(now))
	r.batchSpan = nil
}
