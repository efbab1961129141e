package e2e

// OpenTelemetry traces of inference requests, exported over OTLP to a real
// Jaeger (v2, built from the Go module proxy by `make test-tools` into
// .tools/bin) and read back through its query API; Triton's trace
// extension changing what is traced while the server runs.

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	"github.com/sloserve/sloserve/api/inference"
)

// needJaeger finds the jaeger binary in .tools/bin, or skips;
// SLOSERVE_REQUIRE_JAEGER=1 (set by `make test`) fails instead.
func needJaeger(t *testing.T) string {
	t.Helper()
	bin, err := filepath.Abs("../.tools/bin/jaeger")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(bin); err != nil {
		skipUnless(t, "SLOSERVE_REQUIRE_JAEGER", "jaeger not installed in .tools/bin; `make test-tools` (scripts/install-test-tools.sh) builds it")
	}
	return bin
}

// jaegerServer is a Jaeger all-in-one with in-memory storage started for
// one test: OTLP/HTTP in, the query API out.
type jaegerServer struct {
	otlp, query string // base URLs
	log         *syncBuffer
}

func startJaeger(t *testing.T, bin string) *jaegerServer {
	t.Helper()
	ports := freePorts(t, 3)
	j := &jaegerServer{otlp: "http://" + ports[0], query: "http://" + ports[1], log: &syncBuffer{}}
	cfg := fmt.Sprintf(`service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 10000
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: %q
    grpc:
      endpoint: %q
receivers:
  otlp:
    protocols:
      http:
        endpoint: %q
processors:
  batch:
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
`, ports[1], ports[2], ports[0])
	path := filepath.Join(t.TempDir(), "jaeger.yaml")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config", path)
	cmd.Stdout, cmd.Stderr = j.log, j.log
	exited, exitErr := startTool(t, "jaeger", cmd, j.log)
	deadline := time.Now().Add(60 * time.Second)
	for {
		if code, _ := j.get("/api/services"); code == 200 {
			return j
		}
		select {
		case <-exited:
			err := *exitErr
			t.Fatalf("jaeger exited before ready: %v\n%s", err, j.log.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("jaeger's query API not up in 60s\n%s", j.log.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (j *jaegerServer) get(path string) (int, []byte) {
	resp, err := http.Get(j.query + path)
	if err != nil {
		return 0, nil
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// jaegerSpan is a span as Jaeger's query API returns it (times in µs).
type jaegerSpan struct {
	SpanID        string `json:"spanID"`
	OperationName string `json:"operationName"`
	References    []struct {
		RefType string `json:"refType"`
		TraceID string `json:"traceID"`
		SpanID  string `json:"spanID"`
	} `json:"references"`
	StartTime int64 `json:"startTime"`
	Duration  int64 `json:"duration"`
	Tags      []struct {
		Key   string `json:"key"`
		Value any    `json:"value"`
	} `json:"tags"`
	ProcessID string `json:"processID"`
}

func (s jaegerSpan) parent() string {
	for _, r := range s.References {
		if r.RefType == "CHILD_OF" {
			return r.SpanID
		}
	}
	return ""
}

func (s jaegerSpan) tag(key string) any {
	for _, t := range s.Tags {
		if t.Key == key {
			return t.Value
		}
	}
	return nil
}

// trace returns a trace's spans and its processes' service names; ok is
// false when Jaeger does not have the trace.
func (j *jaegerServer) trace(t *testing.T, traceID string) (spans []jaegerSpan, services []string, ok bool) {
	t.Helper()
	code, b := j.get("/api/traces/" + traceID)
	if code == http.StatusNotFound {
		return nil, nil, false
	}
	var body struct {
		Data []struct {
			Spans     []jaegerSpan `json:"spans"`
			Processes map[string]struct {
				ServiceName string `json:"serviceName"`
			} `json:"processes"`
		} `json:"data"`
	}
	if code != 200 || json.Unmarshal(b, &body) != nil || len(body.Data) != 1 {
		t.Fatalf("trace %s: %d %s", traceID, code, b)
	}
	for _, p := range body.Data[0].Processes {
		services = append(services, p.ServiceName)
	}
	return body.Data[0].Spans, services, true
}

// The spans of one traced request, by name, nested as the request went:
// infer (the client's span its parent) holds queue, batch and answer, and
// batch holds runner; each stage follows the one before it.
func checkRequestTrace(t *testing.T, j *jaegerServer, traceID, clientSpan, protocol, service string) {
	t.Helper()
	spans, services, ok := j.trace(t, traceID)
	if !ok {
		t.Fatalf("trace %s (%s) is not in Jaeger", traceID, protocol)
	}
	by := map[string]jaegerSpan{}
	for _, s := range spans {
		if _, dup := by[s.OperationName]; dup {
			t.Errorf("trace %s: two %s spans", traceID, s.OperationName)
		}
		by[s.OperationName] = s
	}
	var names []string
	for n := range by {
		names = append(names, n)
	}
	slices.Sort(names)
	if want := []string{"answer", "batch", "infer", "queue", "runner"}; !slices.Equal(names, want) {
		t.Fatalf("trace %s (%s): spans %v, want %v", traceID, protocol, names, want)
	}
	if len(services) != 1 || services[0] != service {
		t.Errorf("trace %s: services %v, want %s", traceID, services, service)
	}
	infer, queue, batch, runner, answer := by["infer"], by["queue"], by["batch"], by["runner"], by["answer"]
	if infer.parent() != clientSpan {
		t.Errorf("%s: infer's parent %q, want the client's span %s", protocol, infer.parent(), clientSpan)
	}
	for _, s := range []jaegerSpan{queue, batch, answer} {
		if s.parent() != infer.SpanID {
			t.Errorf("%s: %s's parent %q, want infer %s", protocol, s.OperationName, s.parent(), infer.SpanID)
		}
	}
	if runner.parent() != batch.SpanID {
		t.Errorf("%s: runner's parent %q, want batch %s", protocol, runner.parent(), batch.SpanID)
	}
	end := func(s jaegerSpan) int64 { return s.StartTime + s.Duration }
	// Received, queued, batched, run, answered: in that order, in infer.
	// Jaeger keeps whole microseconds of start and duration, so an end
	// may read 1 µs late.
	const slack = 1
	if queue.StartTime != infer.StartTime || end(queue) > batch.StartTime+slack || runner.StartTime < batch.StartTime ||
		end(runner) > end(batch)+slack || answer.StartTime+slack < end(batch) || end(answer) > end(infer)+slack {
		t.Errorf("%s: stages out of order (start, end µs): infer %d %d, queue %d %d, batch %d %d, runner %d %d, answer %d %d", protocol,
			infer.StartTime, end(infer), queue.StartTime, end(queue), batch.StartTime, end(batch),
			runner.StartTime, end(runner), answer.StartTime, end(answer))
	}
	if infer.tag("sloserve.protocol") != protocol || infer.tag("sloserve.model") != "dyn" || infer.tag("span.kind") != "server" {
		t.Errorf("%s: infer's tags %v", protocol, infer.Tags)
	}
	if batch.tag("sloserve.batch.size") != 2.0 || batch.tag("sloserve.outcome") != "good" {
		t.Errorf("%s: batch's tags %v", protocol, batch.Tags)
	}
	if _, ok := runner.tag("sloserve.compute_infer_us").(float64); !ok {
		t.Errorf("%s: runner's tags %v: no compute_infer_us", protocol, runner.Tags)
	}
}

// TestE2ETracing sends requests with W3C traceparents from REST and gRPC
// clients to a server exporting to a real Jaeger, changes Triton's trace
// settings over both protocols between them, and reads the traces back:
// the traced requests' spans, their nesting under the client's span, and
// no trace of the requests the settings left out.
func TestE2ETracing(t *testing.T) {
	j := startJaeger(t, needJaeger(t))
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
	const service = "sloserve-e2e"
	s := startServer(t, repo, fmt.Sprintf("tracing: {endpoint: %q, rate: 1, service_name: %s}\n", j.otlp, service))

	// Triton's settings at start.
	var st map[string]any
	if code := s.json(t, "GET", "/v2/trace/setting", nil, &st); code != 200 ||
		fmt.Sprint(st["trace_level"]) != "[TIMESTAMPS]" || st["trace_rate"] != "1" || st["trace_count"] != "-1" || st["trace_mode"] != "opentelemetry" {
		t.Fatalf("GET /v2/trace/setting: %d %v", code, st)
	}

	// Trace ids and client span ids, one per request.
	ids := func(i int) (traceID, spanID string) {
		return fmt.Sprintf("4bf92f3577b34da6a3ce929d0e0e47%02d", i), fmt.Sprintf("00f067aa0ba902%02d", i)
	}
	traceparent := func(i int) string {
		tid, sid := ids(i)
		return "00-" + tid + "-" + sid + "-01"
	}
	body := []byte(`{"inputs":[{"name":"input_vectors","datatype":"FP32","shape":[2,10],"data":[1,2,3,4,5,6,7,8,9,10,1,2,3,4,5,6,7,8,9,10]}]}`)
	rest := func(i int) {
		t.Helper()
		if code, b, _ := s.do(t, "POST", "/v2/models/dyn/infer", body, "traceparent", traceparent(i)); code != 200 {
			t.Fatalf("REST infer %d: %d %s", i, code, b)
		}
	}
	grpcInfer := func(i int) {
		t.Helper()
		ctx := metadata.AppendToOutgoingContext(t.Context(), "traceparent", traceparent(i))
		if _, err := s.grpc.ModelInfer(ctx, grpcDyn("dyn", 2)); err != nil {
			t.Fatalf("gRPC infer %d: %v", i, err)
		}
	}
	rest(1)
	grpcInfer(2)

	// Off over gRPC (as tritonclient's update_trace_settings): not traced.
	resp, err := s.grpc.TraceSetting(t.Context(), &inference.TraceSettingRequest{Settings: map[string]*inference.TraceSettingRequest_SettingValue{
		"trace_level": {Value: []string{"OFF"}},
	}})
	if err != nil || fmt.Sprint(resp.GetSettings()["trace_level"].GetValue()) != "[OFF]" {
		t.Fatalf("TraceSetting OFF: %v %v", resp, err)
	}
	rest(3)
	grpcInfer(4)

	// Back on (null: the level at start) with a count of 1, over REST: the
	// next request is traced, the one after it is not.
	if code := s.json(t, "POST", "/v2/trace/setting", map[string]any{"trace_level": nil, "trace_count": "1"}, &st); code != 200 ||
		fmt.Sprint(st["trace_level"]) != "[TIMESTAMPS]" || st["trace_count"] != "1" {
		t.Fatalf("POST /v2/trace/setting: %d %v", code, st)
	}
	grpcInfer(5)
	rest(6)
	resp, err = s.grpc.TraceSetting(t.Context(), &inference.TraceSettingRequest{})
	if err != nil || fmt.Sprint(resp.GetSettings()["trace_count"].GetValue()) != "[0]" {
		t.Errorf("TraceSetting read after the count ran out: %v %v", resp, err)
	}
	// Refused settings change nothing.
	if code, b, _ := s.do(t, "POST", "/v2/trace/setting", []byte(`{"trace_rate": "0", "trace_count": "5"}`)); code != 400 || !strings.Contains(string(b), "trace_rate must be >= 1") {
		t.Errorf("trace_rate 0: %d %s", code, b)
	}
	if code, b, _ := s.do(t, "POST", "/v2/trace/setting", []byte(`{"trace_file": "/tmp/trace.json"}`)); code != 400 || !strings.Contains(string(b), "cannot be changed") {
		t.Errorf("trace_file: %d %s", code, b)
	}

	// The server exports what it holds as it stops.
	if err := s.stop(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		i        int
		protocol string
	}{{1, "rest"}, {2, "grpc"}, {5, "grpc"}} {
		tid, sid := ids(c.i)
		waitFor(t, "trace "+tid+" in Jaeger", 30*time.Second, func() bool { _, _, ok := j.trace(t, tid); return ok })
		checkRequestTrace(t, j, tid, sid, c.protocol, service)
	}
	for _, i := range []int{3, 4, 6} {
		tid, _ := ids(i)
		if spans, _, ok := j.trace(t, tid); ok {
			t.Errorf("request %d was traced (%d spans); the settings left it out", i, len(spans))
		}
	}
	var services struct {
		Data []string `json:"data"`
	}
	if code, b := j.get("/api/services"); code != 200 || json.Unmarshal(b, &services) != nil || !slices.Contains(services.Data, service) {
		t.Errorf("services %d %s", code, b)
	}
}
