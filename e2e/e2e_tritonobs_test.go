package e2e

// Triton's observability where Triton users look for it: the nv_inference_*
// metrics beside sloserve's own, scraped by a real Prometheus, and the
// logging extension over gRPC.

import (
	"io"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
)

// tritonMetricLint is what Prometheus's naming lint says of Triton's metric
// names as Triton exports them (counters without _total, durations in
// microseconds, a gauge named _count); nothing else may be flagged.
var tritonMetricLint = []string{
	`counter metrics should have "_total" suffix`,
	`metric names should not contain abbreviated units`,
	`non-histogram and non-summary metrics should not have "_count" suffix`,
}

// TestE2ETritonMetrics sends a known mix of requests (answered over REST
// and gRPC, invalid, past their timeout) and checks Triton's nv_inference_*
// series: the counts sent, the statistics extension's numbers, Triton's
// types, a lint-clean exposition but for Triton's own names, and a real
// Prometheus reading them.
func TestE2ETritonMetrics(t *testing.T) {
	promBin, promtool := needPrometheus(t)
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
	s := startServer(t, repo, "")
	rules, err := filepath.Abs(promRulesPath)
	if err != nil {
		t.Fatal(err)
	}
	prom := startPrometheus(t, promBin, promtool, strings.TrimPrefix(s.metrics, "http://"), rules)

	const restOK, grpcOK, grpcRows, invalid, late = 7, 4, 3, 3, 2
	for range restOK {
		if code, b, _ := s.do(t, "POST", "/v2/models/dyn/infer", dynBody); code != 200 {
			t.Fatalf("infer: %d %s", code, b)
		}
	}
	for range grpcOK {
		if _, err := s.grpc.ModelInfer(t.Context(), grpcDyn("dyn", grpcRows)); err != nil {
			t.Fatal(err)
		}
	}
	for range invalid { // 9 values where the model takes 10
		body := `{"inputs":[{"name":"input_vectors","datatype":"FP32","shape":[1,9],"data":[1,2,3,4,5,6,7,8,9]}]}`
		if code, b, _ := s.do(t, "POST", "/v2/models/dyn/infer", []byte(body)); code != 400 {
			t.Fatalf("invalid request: %d %s, want 400", code, b)
		}
	}
	for range late { // a 1 µs timeout, shorter than any execution
		req := grpcDyn("dyn", 1)
		req.Parameters = map[string]*inference.InferParameter{"timeout": {ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: 1}}}
		if _, err := s.grpc.ModelInfer(t.Context(), req); err == nil {
			t.Fatal("a request with a 1 µs timeout was answered")
		}
	}

	var stats struct {
		ModelStats []struct {
			Version        string `json:"version"`
			InferenceCount uint64 `json:"inference_count"`
			ExecutionCount uint64 `json:"execution_count"`
			InferenceStats map[string]struct {
				Count uint64 `json:"count"`
				NS    uint64 `json:"ns"`
			} `json:"inference_stats"`
		} `json:"model_stats"`
	}
	if code := s.json(t, "GET", "/v2/models/dyn/stats", nil, &stats); code != 200 || len(stats.ModelStats) != 1 {
		t.Fatalf("stats: %d %+v", code, stats)
	}
	st := stats.ModelStats[0]
	resp, err := s.client.Get(s.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	exposition, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	series := parseExposition(t, string(exposition))

	const l = `{model="dyn",version="1"}`
	failure := func(reason string) string {
		return `nv_inference_request_failure{model="dyn",reason="` + reason + `",version="1"}`
	}
	is := st.InferenceStats
	want := map[string]float64{
		// What was sent.
		"nv_inference_request_success" + l:       restOK + grpcOK,
		failure("OTHER"):                         invalid,
		failure("REJECTED"):                      late,
		failure("CANCELED"):                      0,
		failure("BACKEND"):                       0,
		"nv_inference_count" + l:                 restOK + grpcOK*grpcRows,
		"nv_inference_exec_count" + l:            restOK + grpcOK, // one at a time: nothing to merge
		"nv_inference_pending_request_count" + l: 0,
		// The statistics extension's numbers, in microseconds.
		"nv_inference_request_duration_us" + l:        float64(is["success"].NS / 1000),
		"nv_inference_queue_duration_us" + l:          float64(is["queue"].NS / 1000),
		"nv_inference_compute_input_duration_us" + l:  float64(is["compute_input"].NS / 1000),
		"nv_inference_compute_infer_duration_us" + l:  float64(is["compute_infer"].NS / 1000),
		"nv_inference_compute_output_duration_us" + l: float64(is["compute_output"].NS / 1000),
	}
	for k, v := range want {
		if got, ok := series[k]; !ok || got != v {
			t.Errorf("%s = %v (present %v), want %v", k, got, ok, v)
		}
	}
	if st.Version != "1" || st.InferenceCount != restOK+grpcOK*grpcRows || st.ExecutionCount != restOK+grpcOK ||
		is["success"].Count != restOK+grpcOK || is["fail"].Count != invalid+late || is["queue"].Count != restOK+grpcOK {
		t.Errorf("statistics extension %+v", st)
	}
	if is["compute_infer"].NS < 1000*(restOK+grpcOK) {
		t.Errorf("compute_infer %d ns for %d executions: under 1 µs each", is["compute_infer"].NS, restOK+grpcOK)
	}
	if series["nv_inference_request_duration_us"+l] < series["nv_inference_compute_infer_duration_us"+l] {
		t.Errorf("request duration under its compute: %v", series)
	}

	// Triton's types.
	for _, name := range []string{"nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
		"nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
		"nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us", "nv_inference_compute_output_duration_us"} {
		if !strings.Contains(string(exposition), "\n# TYPE "+name+" counter\n") {
			t.Errorf("%s is not exposed as a counter", name)
		}
	}
	if !strings.Contains(string(exposition), "\n# TYPE nv_inference_pending_request_count gauge\n") {
		t.Error("nv_inference_pending_request_count is not exposed as a gauge")
	}

	// promtool's lint: Triton's names draw only the complaints its naming
	// does; everything else is clean.
	lint := exec.Command(promtool, "check", "metrics")
	lint.Stdin = strings.NewReader(string(exposition))
	out, _ := lint.CombinedOutput()
	var triton int
	for line := range strings.SplitSeq(strings.TrimSpace(string(out)), "\n") {
		if line == "" {
			continue
		}
		name, problem, _ := strings.Cut(line, " ")
		if !strings.HasPrefix(name, "nv_inference_") || !slices.ContainsFunc(tritonMetricLint, func(p string) bool { return strings.Contains(problem, p) }) {
			t.Errorf("promtool check metrics: %s", line)
			continue
		}
		triton++
	}
	if triton == 0 {
		t.Errorf("promtool flagged none of Triton's names; did it read the exposition?\n%s", out)
	}

	// A real Prometheus reads them under Triton's names.
	waitFor(t, "Prometheus to scrape the counts", 60*time.Second, func() bool {
		v := prom.byModel(t, `nv_inference_request_success{version="1"}`, time.Now())
		return v["dyn"] == restOK+grpcOK
	})
	now := time.Now()
	byReason, err := prom.query(`sum by (reason) (nv_inference_request_failure{model="dyn"})`, now)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, r := range byReason {
		got[r.Metric["reason"]] = sampleValue(r.Value)
	}
	if len(got) != 4 || got["OTHER"] != invalid || got["REJECTED"] != late || got["CANCELED"] != 0 || got["BACKEND"] != 0 {
		t.Errorf("failures by reason in Prometheus: %v", got)
	}
	// Triton's dashboards divide the cumulative microseconds by the
	// requests: the mean queue time per request, here.
	mean := prom.byModel(t, `nv_inference_queue_duration_us / nv_inference_request_success`, now)
	if wantMean := want["nv_inference_queue_duration_us"+l] / (restOK + grpcOK); mean["dyn"] != wantMean {
		t.Errorf("mean queue time in Prometheus %v µs, want %v", mean, wantMean)
	}
}

// parseExposition reads a text exposition into its series, keyed by name
// and labels as written.
func parseExposition(t *testing.T, text string) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for line := range strings.SplitSeq(text, "\n") {
		i := strings.LastIndexByte(line, ' ')
		if strings.HasPrefix(line, "#") || i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("series %q: %v", line, err)
		}
		out[line[:i]] = v
	}
	return out
}

// TestE2ETritonClientLogSettingsGRPC changes the real server's log level
// over gRPC as tritonclient.grpc's update_log_settings does (log_info as
// bool_param, log_verbose_level as uint32_param): a debug line (a request
// rejected at admission) stops and starts again, and REST's /v2/logging
// reads what gRPC set.
func TestE2ETritonClientLogSettingsGRPC(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
	s := startServer(t, repo, "") // at debug
	rejected := func() int { return strings.Count(s.log.String(), `msg="request rejected"`) }
	reject := func() {
		t.Helper()
		req := grpcDyn("dyn", 1)
		req.Parameters = map[string]*inference.InferParameter{"timeout": {ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: 1}}}
		if _, err := s.grpc.ModelInfer(t.Context(), req); err == nil {
			t.Fatal("a request with a 1 µs timeout was answered")
		}
	}
	set := func(settings map[string]*inference.LogSettingsRequest_SettingValue) map[string]*inference.LogSettingsResponse_SettingValue {
		t.Helper()
		resp, err := s.grpc.LogSettings(t.Context(), &inference.LogSettingsRequest{Settings: settings})
		if err != nil {
			t.Fatal(err)
		}
		return resp.GetSettings()
	}
	restSettings := func() map[string]any {
		t.Helper()
		var st map[string]any
		if code := s.json(t, "GET", "/v2/logging", nil, &st); code != 200 {
			t.Fatalf("GET /v2/logging: %d", code)
		}
		return st
	}
	boolParam := func(v bool) *inference.LogSettingsRequest_SettingValue {
		return &inference.LogSettingsRequest_SettingValue{ParameterChoice: &inference.LogSettingsRequest_SettingValue_BoolParam{BoolParam: v}}
	}
	verbose := func(v uint32) *inference.LogSettingsRequest_SettingValue {
		return &inference.LogSettingsRequest_SettingValue{ParameterChoice: &inference.LogSettingsRequest_SettingValue_Uint32Param{Uint32Param: v}}
	}

	// Read as get_log_settings does: an empty request.
	if st := set(nil); st["log_verbose_level"].GetUint32Param() != 1 || !st["log_info"].GetBoolParam() || st["log_format"].GetStringParam() != "default" {
		t.Fatalf("settings at start %v", st)
	}
	reject()
	waitFor(t, "the debug line of a rejection", 30*time.Second, func() bool { return rejected() == 1 })

	// Off debug: at warn, rejections are not logged.
	st := set(map[string]*inference.LogSettingsRequest_SettingValue{"log_verbose_level": verbose(0), "log_info": boolParam(false)})
	if st["log_verbose_level"].GetUint32Param() != 0 || st["log_info"].GetBoolParam() || !st["log_warning"].GetBoolParam() {
		t.Fatalf("after the change %v", st)
	}
	if r := restSettings(); r["log_verbose_level"] != 0.0 || r["log_info"] != false || r["log_warning"] != true {
		t.Errorf("REST reads %v after gRPC set warn", r)
	}
	for range 3 {
		reject()
	}
	// Back to debug, and the next rejection is logged; the three before it
	// were not.
	set(map[string]*inference.LogSettingsRequest_SettingValue{"log_verbose_level": verbose(1)})
	if r := restSettings(); r["log_verbose_level"] != 1.0 || r["log_info"] != true {
		t.Errorf("REST reads %v after gRPC set debug", r)
	}
	reject()
	waitFor(t, "the debug line of the last rejection", 30*time.Second, func() bool { return rejected() >= 2 })
	if n := rejected(); n != 2 {
		t.Errorf("%d rejections logged, want 2: the 3 sent at warn were logged", n)
	}
	if v, _ := s.metricValue(t, `nv_inference_request_failure{model="dyn",reason="REJECTED",version="1"}`); v != 5 {
		t.Errorf("%v rejections counted, want all 5", v)
	}
	if !s.logHas(`msg="log settings changed" component=grpc`, "log_level=DEBUG") {
		t.Error("the change back to debug is not logged")
	}
	if !s.logHas(`msg="admin call"`, `method=/inference.GRPCInferenceService/LogSettings`) {
		t.Error("the change was not logged as an admin call")
	}

	// A setting Triton's client sends with the wrong type is refused.
	_, err := s.grpc.LogSettings(t.Context(), &inference.LogSettingsRequest{Settings: map[string]*inference.LogSettingsRequest_SettingValue{"log_info": verbose(1)}})
	if st, _ := status.FromError(err); st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "must be a bool_param") {
		t.Errorf("log_info as uint32_param: %v", err)
	}
}
