package api

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http/httptest"
	rtrace "runtime/trace"
	"slices"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/tracing"
)

const (
	testTraceID    = "4bf92f3577b34da6a3ce929d0e0e4736"
	testClientSpan = "00f067aa0ba902b7"
)

// newTraceLimits are restLimits with tracing: settings at rate 1 and a
// provider that records the spans.
func newTraceLimits(t *testing.T) (Limits, *tracing.Settings, *tracetest.SpanRecorder) {
	t.Helper()
	st, err := tracing.NewSettings(tracing.Values{Level: tracing.LevelTimestamps, Rate: 1, Count: -1})
	if err != nil {
		t.Fatal(err)
	}
	rec := tracetest.NewSpanRecorder()
	lim := restLimits
	lim.Trace = st
	lim.Tracer = sdktrace.NewTracerProvider(sdktrace.WithSampler(st.Sampler()), sdktrace.WithSpanProcessor(rec))
	return lim, st, rec
}

// wantInferTrace checks the spans of one traced call: infer, the client's
// span its parent, and answer under it.
func wantInferTrace(t *testing.T, spans []sdktrace.ReadOnlySpan, protocol string) {
	t.Helper()
	if len(spans) != 2 {
		t.Fatalf("%d spans, want infer and answer", len(spans))
	}
	by := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range spans {
		by[s.Name()] = s
	}
	infer, answer := by["infer"], by["answer"]
	if infer == nil || answer == nil {
		t.Fatalf("spans %v", spans)
	}
	if infer.Parent().SpanID().String() != testClientSpan || infer.SpanContext().TraceID().String() != testTraceID || !infer.Parent().IsRemote() {
		t.Errorf("infer's parent %v, want the client's span %s in trace %s", infer.Parent(), testClientSpan, testTraceID)
	}
	if answer.Parent().SpanID() != infer.SpanContext().SpanID() {
		t.Errorf("answer's parent %v, want infer", answer.Parent())
	}
	if infer.SpanKind() != trace.SpanKindServer || !slices.ContainsFunc(infer.Attributes(), func(a attribute.KeyValue) bool {
		return string(a.Key) == "sloserve.protocol" && a.Value.AsString() == protocol
	}) {
		t.Errorf("infer: kind %v, attributes %v", infer.SpanKind(), infer.Attributes())
	}
	if answer.StartTime().Before(infer.StartTime()) || answer.EndTime().After(infer.EndTime()) {
		t.Errorf("answer [%v, %v] outside infer [%v, %v]", answer.StartTime(), answer.EndTime(), infer.StartTime(), infer.EndTime())
	}
}

// A call with a client's traceparent (REST header, gRPC metadata) is
// traced under the client's span; at OFF it is not.
func TestInferTraced(t *testing.T) {
	lim, st, rec := newTraceLimits(t)
	h := NewREST(newFakeBackend(), lim, nil)
	traceparent := "00-" + testTraceID + "-" + testClientSpan + "-01"
	post := func() {
		t.Helper()
		req := httptest.NewRequest("POST", "/v2/models/sum/infer", strings.NewReader(`{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("traceparent", traceparent)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code != 200 {
			t.Fatalf("infer: %d %s", w.Code, w.Body)
		}
	}
	post()
	wantInferTrace(t, rec.Ended(), "rest")

	client := inference.NewGRPCInferenceServiceClient(serveGRPC(t, NewGRPC(newFakeBackend(), lim, nil)))
	rec2 := tracetest.NewSpanRecorder()
	lim.Tracer.(*sdktrace.TracerProvider).RegisterSpanProcessor(rec2)
	ctx := metadata.AppendToOutgoingContext(t.Context(), "traceparent", traceparent)
	if _, err := client.ModelInfer(ctx, grpcSumRequest(true)); err != nil {
		t.Fatal(err)
	}
	wantInferTrace(t, rec2.Ended(), "grpc")

	off := tracing.LevelOff
	if _, err := st.Update(tracing.Change{Level: &off}); err != nil {
		t.Fatal(err)
	}
	n := len(rec.Ended())
	post()
	if _, err := client.ModelInfer(ctx, grpcSumRequest(true)); err != nil {
		t.Fatal(err)
	}
	if len(rec.Ended()) != n {
		t.Errorf("%d spans at OFF", len(rec.Ended())-n)
	}
}

// TestTraceSettings: tritonclient's get_trace_settings and
// update_trace_settings over REST (values as strings, trace_level a list,
// null back to the start) and gRPC (lists; an empty one back to the
// start) read and change the same settings; bad ones change nothing.
func TestTraceSettings(t *testing.T) {
	lim, st, _ := newTraceLimits(t)
	h := NewREST(newFakeBackend(), lim, nil)
	client := inference.NewGRPCInferenceServiceClient(serveGRPC(t, NewGRPC(newFakeBackend(), lim, nil)))
	call := func(method, path, body string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(method, path, strings.NewReader(body))
		req.RemoteAddr, req.Host = loopbackPeer, "127.0.0.1:8000"
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		return w
	}
	restSettings := func(w *httptest.ResponseRecorder) string {
		t.Helper()
		if w.Code != 200 {
			t.Fatalf("%d %s", w.Code, w.Body)
		}
		return w.Body.String()
	}
	grpcSettings := func(settings map[string][]string) (string, error) {
		req := &inference.TraceSettingRequest{Settings: map[string]*inference.TraceSettingRequest_SettingValue{}}
		for k, v := range settings {
			req.Settings[k] = &inference.TraceSettingRequest_SettingValue{Value: v}
		}
		resp, err := client.TraceSetting(t.Context(), req)
		if err != nil {
			return "", err
		}
		out := map[string]any{}
		for k, v := range resp.GetSettings() {
			if k == "trace_level" {
				out[k] = v.GetValue()
			} else if len(v.GetValue()) == 1 {
				out[k] = v.GetValue()[0]
			} else {
				out[k] = v.GetValue()
			}
		}
		b, _ := json.Marshal(out)
		return string(b), nil
	}
	const start = `{"log_frequency":"0","trace_count":"-1","trace_file":"","trace_level":["TIMESTAMPS"],"trace_mode":"opentelemetry","trace_rate":"1"}`
	if got := restSettings(call("GET", "/v2/trace/setting", "")); got != start {
		t.Fatalf("GET %s, want %s", got, start)
	}
	if got := restSettings(call("POST", "/v2/trace/setting", `{"trace_rate": "10", "trace_count": "5", "trace_level": ["OFF"]}`)); !strings.Contains(got, `"trace_rate":"10"`) ||
		!strings.Contains(got, `"trace_count":"5"`) || !strings.Contains(got, `"trace_level":["OFF"]`) {
		t.Fatalf("POST answered %s", got)
	}
	if got, err := grpcSettings(nil); err != nil || got != restSettings(call("GET", "/v2/trace/setting", "")) {
		t.Fatalf("gRPC reads %s (%v), REST %s", got, err, restSettings(call("GET", "/v2/trace/setting", "")))
	}
	if got, err := grpcSettings(map[string][]string{"trace_level": {"TIMESTAMPS", "TENSORS"}}); err == nil {
		t.Errorf("TENSORS accepted: %s", got)
	}
	if got, err := grpcSettings(map[string][]string{"trace_level": {}, "trace_rate": {"3"}, "trace_count": nil}); err != nil ||
		st.Get() != (tracing.Values{Level: tracing.LevelTimestamps, Rate: 3, Count: -1}) {
		t.Fatalf("gRPC reset: %s %v, settings %+v", got, err, st.Get())
	}
	if got := restSettings(call("POST", "/v2/trace/setting", `{"trace_rate": null, "trace_count": 7}`)); !strings.Contains(got, `"trace_rate":"1"`) || !strings.Contains(got, `"trace_count":"7"`) {
		t.Errorf("REST null rate, numeric count: %s", got)
	}
	before := st.Get()
	for _, tc := range []struct{ body, msg string }{
		{`{"trace_rate": "0"}`, "trace_rate must be >= 1"},
		{`{"trace_rate": "x", "trace_count": "3"}`, `"trace_rate" must be an integer`},
		{`{"trace_count": "-5"}`, "trace_count must be >= 0"},
		{`{"trace_level": ["DETAILED"]}`, "trace_level"},
		{`{"trace_file": "/tmp/t.json", "trace_rate": "9"}`, `"trace_file" cannot be changed`},
		{`{"trace_mode": "triton"}`, `"trace_mode" cannot be changed`},
		{`{"trace_config": ["x"]}`, `unknown trace setting "trace_config"`},
		{`{"trace_rate": {"a": 1}}`, "must be a string or a list of strings"},
	} {
		wantREST(t, call("POST", "/v2/trace/setting", tc.body), 400, tc.msg)
	}
	if _, err := grpcSettings(map[string][]string{"trace_rate": {"1", "2"}}); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "takes one value") {
		t.Errorf("two rates: %v", err)
	}
	if st.Get() != before {
		t.Errorf("refused settings changed %+v to %+v", before, st.Get())
	}
	// Per-model settings are refused, over both protocols.
	wantREST(t, call("GET", "/v2/models/sum/trace/setting", ""), 400, "per-model trace settings are not supported")
	_, err := client.TraceSetting(t.Context(), &inference.TraceSettingRequest{ModelName: "sum"})
	wantGRPCCode(t, err, codes.InvalidArgument, "per-model trace settings are not supported")

	// Off without settings: 404 and UNIMPLEMENTED.
	if w := call("GET", "/v2/trace/setting", ""); w.Code != 200 {
		t.Fatal(w.Code)
	}
	offREST := NewREST(newFakeBackend(), restLimits, nil)
	w := httptest.NewRecorder()
	offREST.ServeHTTP(w, httptest.NewRequest("GET", "/v2/trace/setting", nil))
	if w.Code != 404 {
		t.Errorf("without settings: %d", w.Code)
	}
	off := inference.NewGRPCInferenceServiceClient(startGRPC(t, newFakeBackend(), restLimits))
	_, err = off.TraceSetting(t.Context(), &inference.TraceSettingRequest{})
	wantGRPCCode(t, err, codes.Unimplemented, "trace extension is off")
}

// Changing trace settings is an admin call; reading them is not.
func TestTraceSettingsAuth(t *testing.T) {
	a, _ := newTestAuth(t, AuthOptions{InferenceToken: testInferenceToken})
	lim, _, _ := newTraceLimits(t)
	h := NewREST(newFakeBackend(), lim, nil, a.REST())
	for _, tc := range []struct {
		method string
		code   int
	}{{"GET", 200}, {"POST", 403}} {
		req := httptest.NewRequest(tc.method, "/v2/trace/setting", strings.NewReader(`{"trace_rate": "2"}`))
		req.RemoteAddr, req.Host = "192.0.2.7:40000", "127.0.0.1:8000"
		req.Header.Set("Authorization", "Bearer "+testInferenceToken)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code != tc.code {
			t.Errorf("%s from the network: %d %s, want %d", tc.method, w.Code, w.Body, tc.code)
		}
	}
	remote := peer.NewContext(t.Context(), &peer.Peer{Addr: &net.TCPAddr{IP: net.ParseIP("192.0.2.7"), Port: 40000}})
	remote = metadata.NewIncomingContext(remote, metadata.Pairs("authorization", "Bearer "+testInferenceToken))
	for _, tc := range []struct {
		req  *inference.TraceSettingRequest
		code codes.Code
	}{
		{&inference.TraceSettingRequest{}, codes.OK},
		{&inference.TraceSettingRequest{Settings: map[string]*inference.TraceSettingRequest_SettingValue{"trace_rate": {Value: []string{"2"}}}}, codes.PermissionDenied},
	} {
		_, err := a.UnaryInterceptor()(remote, tc.req, &grpc.UnaryServerInfo{FullMethod: inference.GRPCInferenceService_TraceSetting_FullMethodName},
			func(context.Context, any) (any, error) { return "ok", nil })
		if status.Code(err) != tc.code {
			t.Errorf("%v: %v, want %v", tc.req, err, tc.code)
		}
	}
}

// While a Go execution trace is being taken, the goroutine serving an
// inference request logs its model and the client's id into it as the
// request goes to the scheduler and as its answer is handed on, on both
// protocols, so that one request can be followed in the trace.
func TestGoTraceNamesTheRequest(t *testing.T) {
	fb := newFakeBackend()
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, fb, grpcTestLimits))
	h, _ := newRESTTest(restLimits)
	for _, tc := range []struct {
		protocol, id string
		call         func() error
	}{
		{"grpc", "grpc-req-42", func() error {
			req := grpcSumRequest(true)
			req.Id = "grpc-req-42"
			_, err := c.ModelInfer(t.Context(), req)
			return err
		}},
		{"rest", "rest-req-43", func() error {
			body := `{"id":"rest-req-43",` + strings.TrimPrefix(restSumBody(""), "{")
			if rec := (restCall{path: "/v2/models/sum/infer", body: body}).do(t, t.Context(), h); rec.Code != 200 {
				return fmt.Errorf("status %d: %s", rec.Code, rec.Body)
			}
			return nil
		}},
	} {
		var buf bytes.Buffer
		if err := rtrace.Start(&buf); err != nil {
			t.Skipf("a Go trace is already being taken: %v", err)
		}
		err := tc.call()
		rtrace.Stop()
		if err != nil {
			t.Fatalf("%s: %v", tc.protocol, err)
		}
		// The trace keeps each string once, in its table.
		for _, s := range []string{"sloserve.infer", "sloserve.answer", "sum " + tc.id} {
			if !bytes.Contains(buf.Bytes(), []byte(s)) {
				t.Errorf("%s: the trace (%d bytes) has no %q", tc.protocol, buf.Len(), s)
			}
		}
	}
}
