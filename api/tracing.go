package api

// Traces of inference requests, and Triton's trace extension.
//
// A ModelInfer call (REST or gRPC) gets a span "infer" from its arrival to
// its answer, whose parent is the client's span when the call carries a
// W3C traceparent (REST header, gRPC metadata), and a child "answer" from
// the backend's result to the response handed to the transport; the
// scheduler and the runner add their spans under it (packages qos and
// runtime). Which requests are traced is decided by Triton's trace
// settings (package tracing), which GET and POST /v2/trace/setting and the
// gRPC TraceSetting call read and change, as tritonclient's
// get_trace_settings and update_trace_settings call them: every value a
// string (trace_level a list of them), null (REST) or an empty list (gRPC)
// setting one back to its value at start.

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	rtrace "runtime/trace"
	"slices"
	"strconv"
	"time"

	"github.com/gin-gonic/gin"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/tracing"
)

const tracerName = "github.com/sloserve/sloserve/api"

// traceContext reads a client's W3C traceparent and tracestate.
var traceContext = propagation.TraceContext{}

// inferTrace is one traced call's spans; its methods do nothing when the
// call is not traced.
type inferTrace struct {
	tr     trace.Tracer
	span   trace.Span
	answer trace.Span
}

// startInferTrace starts the infer span of a call that arrived at arrival,
// its parent the client's span in carrier, and returns ctx with it. With no
// tracer, or when the call is not sampled, ctx is returned as it is.
// goTraceLog notes in a Go execution trace being taken (`serve
// --pprof-addr`, /debug/pprof/trace) that this goroutine serves a request
// of model, with the client's id, from stage on: "infer" as the request
// goes to the scheduler, "answer" as its answer is encoded and handed to
// the connection, so that one request's goroutine can be found in the
// trace and followed to its socket writes (BENCHMARKS.md, the colocation
// day's way back). Nothing when no trace is being taken.
func goTraceLog(ctx context.Context, stage, model, id string) {
	if rtrace.IsEnabled() {
		rtrace.Log(ctx, "sloserve."+stage, model+" "+id)
	}
}

func startInferTrace(ctx context.Context, tp trace.TracerProvider, carrier propagation.TextMapCarrier, arrival time.Time, protocol, model, version string) (context.Context, *inferTrace) {
	if tp == nil {
		return ctx, nil
	}
	ctx = traceContext.Extract(ctx, carrier)
	tr := tp.Tracer(tracerName)
	sctx, span := tr.Start(ctx, "infer", trace.WithSpanKind(trace.SpanKindServer), trace.WithTimestamp(arrival),
		trace.WithAttributes(
			attribute.String("sloserve.protocol", protocol),
			attribute.String("sloserve.model", model),
			attribute.String("sloserve.model_version", version),
		))
	if !span.IsRecording() {
		return ctx, nil
	}
	return sctx, &inferTrace{tr: tr, span: span}
}

// answering starts the answer span: the backend's result is in, the
// response is being encoded and written.
func (t *inferTrace) answering(ctx context.Context, version string) {
	if t == nil {
		return
	}
	t.span.SetAttributes(attribute.String("sloserve.served_version", version))
	_, t.answer = t.tr.Start(ctx, "answer")
}

// end ends the spans; err is how the call failed, nil if it did not.
func (t *inferTrace) end(err error) {
	if t == nil {
		return
	}
	if err != nil {
		t.span.SetStatus(otelcodes.Error, err.Error())
	}
	if t.answer != nil {
		t.answer.End()
	}
	t.span.End()
}

// metadataCarrier reads a gRPC call's metadata as a TextMapCarrier.
type metadataCarrier metadata.MD

var _ propagation.TextMapCarrier = metadataCarrier{}

func (c metadataCarrier) Get(key string) string {
	if v := metadata.MD(c).Get(key); len(v) > 0 {
		return v[0]
	}
	return ""
}

func (c metadataCarrier) Set(key, value string) { metadata.MD(c).Set(key, value) }

func (c metadataCarrier) Keys() []string { return slices.Collect(maps.Keys(c)) }

// grpcTraceCarrier is the incoming metadata of ctx.
func grpcTraceCarrier(ctx context.Context) propagation.TextMapCarrier {
	md, _ := metadata.FromIncomingContext(ctx)
	return metadataCarrier(md)
}

// Triton's trace settings that sloserve cannot change, with the one value
// each has.
var traceFixed = map[string]string{
	"trace_file":    "",
	"log_frequency": "0",
	"trace_mode":    "opentelemetry",
}

// traceSettings are the settings in Triton's shape: every value a list of
// strings.
func traceSettings(v tracing.Values) map[string][]string {
	return map[string][]string{
		"trace_level":   {v.Level},
		"trace_rate":    {strconv.FormatInt(v.Rate, 10)},
		"trace_count":   {strconv.FormatInt(v.Count, 10)},
		"trace_file":    {traceFixed["trace_file"]},
		"log_frequency": {traceFixed["log_frequency"]},
		"trace_mode":    {traceFixed["trace_mode"]},
	}
}

// changeTraceSettings applies settings (name -> values; nil values: back
// to the value at start) to st, all or none of them, and returns the
// settings after it. Unknown names, values that are not Triton's, and
// values sloserve cannot change are errBadRequest.
func changeTraceSettings(st *tracing.Settings, settings map[string][]string) (tracing.Values, error) {
	var c tracing.Change
	for _, k := range slices.Sorted(maps.Keys(settings)) {
		vals := settings[k]
		reset := vals == nil
		one := func() (string, error) {
			if len(vals) != 1 {
				return "", fmt.Errorf("%w: trace setting %q takes one value, got %d", errBadRequest, k, len(vals))
			}
			return vals[0], nil
		}
		switch k {
		case "trace_level":
			if reset {
				c.ResetLevel = true
				continue
			}
			// Triton's levels combine; sloserve records TIMESTAMPS, so a
			// list is on when it names it and OFF is alone.
			level := ""
			for _, l := range vals {
				switch {
				case l == tracing.LevelOff && len(vals) == 1:
					level = tracing.LevelOff
				case l == tracing.LevelTimestamps:
					level = tracing.LevelTimestamps
				default:
					return tracing.Values{}, fmt.Errorf("%w: trace_level %q: sloserve traces %s (or %s, alone)",
						errBadRequest, clipValue(fmt.Sprint(vals)), tracing.LevelTimestamps, tracing.LevelOff)
				}
			}
			if level == "" {
				return tracing.Values{}, fmt.Errorf("%w: trace_level must name %s or %s", errBadRequest, tracing.LevelTimestamps, tracing.LevelOff)
			}
			c.Level = &level
		case "trace_rate", "trace_count":
			if reset {
				if k == "trace_rate" {
					c.ResetRate = true
				} else {
					c.ResetCount = true
				}
				continue
			}
			s, err := one()
			if err != nil {
				return tracing.Values{}, err
			}
			n, err := strconv.ParseInt(s, 10, 64)
			if err != nil {
				return tracing.Values{}, fmt.Errorf("%w: trace setting %q must be an integer, got %q", errBadRequest, k, clipValue(s))
			}
			if k == "trace_rate" {
				c.Rate = &n
			} else {
				c.Count = &n
			}
		case "trace_file", "log_frequency", "trace_mode":
			if reset {
				continue
			}
			s, err := one()
			if err != nil {
				return tracing.Values{}, err
			}
			if s != traceFixed[k] {
				return tracing.Values{}, fmt.Errorf("%w: trace setting %q cannot be changed: spans are exported over OTLP (tracing.endpoint), not written to a file; it is %q, got %q",
					errBadRequest, k, traceFixed[k], clipValue(s))
			}
		default:
			return tracing.Values{}, fmt.Errorf("%w: unknown trace setting %q (Triton's are trace_level, trace_rate, trace_count, trace_file, log_frequency, trace_mode)",
				errBadRequest, clipValue(k))
		}
	}
	v, err := st.Update(c)
	if err != nil {
		return v, fmt.Errorf("%w: %w", errBadRequest, err)
	}
	return v, nil
}

// traceSettingsJSON writes settings as Triton's REST body: trace_level a
// list, the others single strings.
func traceSettingsJSON(v tracing.Values) map[string]any {
	out := map[string]any{}
	for k, vals := range traceSettings(v) {
		if k == "trace_level" {
			out[k] = vals
		} else {
			out[k] = vals[0]
		}
	}
	return out
}

// traceSetting serves GET /v2/trace/setting.
func (s *restServer) traceSetting(c *gin.Context) {
	s.writeValue(c, http.StatusOK, traceSettingsJSON(s.lim.Trace.Get()))
}

// modelTraceSetting refuses the per-model trace settings.
func (s *restServer) modelTraceSetting(c *gin.Context) {
	s.writeError(c, errModelTraceSettings)
}

var errModelTraceSettings = fmt.Errorf("%w: per-model trace settings are not supported: use /v2/trace/setting (gRPC TraceSetting without model_name)", errBadRequest)

// updateTraceSetting serves POST /v2/trace/setting: the settings named
// change (a string each, trace_level a list of strings or one string; null
// sets one back to its value at start), and the answer is all of them.
func (s *restServer) updateTraceSetting(c *gin.Context) {
	body, err := s.readJSONBody(c)
	if err != nil {
		s.writeError(c, err)
		return
	}
	var raw map[string]json.RawMessage
	if err := decodeJSONBody(body, &raw, false); err != nil {
		s.writeError(c, err)
		return
	}
	settings := make(map[string][]string, len(raw))
	for k, r := range raw {
		var v any
		if err := json.Unmarshal(r, &v); err != nil {
			s.writeError(c, restBadRequest("trace setting %q: %v", clipValue(k), err))
			return
		}
		switch v := v.(type) {
		case nil:
			settings[k] = nil
		case string:
			settings[k] = []string{v}
		case float64: // a number where Triton's client sends a string
			settings[k] = []string{string(r)}
		case []any:
			list := make([]string, 0, len(v))
			for _, e := range v {
				str, ok := e.(string)
				if !ok {
					s.writeError(c, restBadRequest("trace setting %q must be a string or a list of strings", clipValue(k)))
					return
				}
				list = append(list, str)
			}
			settings[k] = list
		default:
			s.writeError(c, restBadRequest("trace setting %q must be a string or a list of strings", clipValue(k)))
			return
		}
	}
	v, err := changeTraceSettings(s.lim.Trace, settings)
	if err != nil {
		s.writeError(c, err)
		return
	}
	if len(settings) > 0 {
		s.logger.Info("trace settings changed", "trace_level", v.Level, "trace_rate", v.Rate, "trace_count", v.Count)
	}
	s.writeValue(c, http.StatusOK, traceSettingsJSON(v))
}

// TraceSetting serves Triton's trace extension over gRPC, as
// tritonclient.grpc's get_trace_settings (no settings: a read) and
// update_trace_settings (each value a list of strings; None an empty list,
// back to the value at start) call it.
func (s *grpcService) TraceSetting(ctx context.Context, req *inference.TraceSettingRequest) (*inference.TraceSettingResponse, error) {
	if s.lim.Trace == nil {
		return nil, status.Error(codes.Unimplemented, "the trace extension is off")
	}
	if req.GetModelName() != "" {
		return nil, s.grpcError("TraceSetting", errModelTraceSettings)
	}
	settings := make(map[string][]string, len(req.GetSettings()))
	for k, v := range req.GetSettings() {
		settings[k] = v.GetValue() // none: nil, back to the value at start
		if len(settings[k]) == 0 {
			settings[k] = nil
		}
	}
	v, err := changeTraceSettings(s.lim.Trace, settings)
	if err != nil {
		return nil, s.grpcError("TraceSetting", err)
	}
	if len(settings) > 0 {
		s.logger.Info("trace settings changed", "trace_level", v.Level, "trace_rate", v.Rate, "trace_count", v.Count)
	}
	resp := &inference.TraceSettingResponse{Settings: map[string]*inference.TraceSettingResponse_SettingValue{}}
	for k, vals := range traceSettings(v) {
		resp.Settings[k] = &inference.TraceSettingResponse_SettingValue{Value: vals}
	}
	return resp, nil
}
