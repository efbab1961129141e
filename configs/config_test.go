package configs

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"
)

// badServerConfigs maps each testdata/*.bad.yaml to substrings its error
// must contain; each names the field path.
var badServerConfigs = map[string][]string{
	"unknown_field":     {"listen.htttp: unknown field (line 2)"},
	"unknown_top":       {"repository: unknown field"},
	"go_field_name":     {"File: unknown field"},
	"listen_same":       {`listen.grpc: ":8000" conflicts with listen.http ":8000" (line 3)`},
	"listen_wildcard":   {`listen.metrics: ":9000" conflicts with listen.http "127.0.0.1:9000"`},
	"listen_both_empty": {"listen: http and grpc cannot both be empty"},
	"listen_no_port":    {`listen.http: want host:port such as ":8000"`, `got "8000"`},
	"listen_bad_port":   {`listen.grpc: port must be a number from 0 to 65535, got "99999"`},
	"listen_list":       {"listen: want a mapping, got a list"},
	"repos_empty":       {"repositories: must list at least one model repository"},
	"repos_dup":         {`repositories[1]: duplicate of repositories[0] ("models")`},
	"repos_blank":       {"repositories[1]: must not be empty"},
	"model_control":     {`model_control: must be one of none, explicit, poll; got "auto"`},
	"control": {`control.policy: must be one of adaptive, static, shared; got "greedy"`, "control.period: must be > 0, got 0s",
		"control.headroom: must be in [0, 1), got 1", "control.quantile: must be in [0.5, 1), got 1", "control.max_utilization: must be > 0 and <= 1, got 0",
		"control.step: must be in (0, 1), got 0", "control.min_share: must be in [0, 1), got -0.1",
		"control.cooldown: must be >= 0, got -1s", "control.memory_budget: want a byte size such as 1024",
		`control.limiter: must be one of auto, cgroup, unprivileged, none; got "mps"`, "control.cfs_period: must be between 1ms and 1s",
		"control.profile.budget: must be > 0, got 0s", "control.profile.runs: must be >= 1, got 0"},
	"gpu_simulator":          {"gpu.simulator: 0 SMs, want 1..1024"},
	"gpu_simulator_negative": {"gpu.simulator.devices: must be >= 0 (0 = off), got -1"},
	"qos":                    {`qos.policy: must be one of qos, fifo; got "edf"`, "qos.best_effort_floor: must be between 0 and 1, got 1.5", "qos.device_slots: must be >= 0, got -1", "qos.window: must be > 0, got 0s", "qos.max_best_effort_execution: must be >= 0 (0: no bound), got -1s", "qos.overlap_slowdown: must be between 0 and 100 (0 or 1: off), got -2"},
	"dashboard": {"dashboard.retention: must be >= dashboard.resolution (2s), got 1s",
		"dashboard.window: must be between dashboard.resolution (2s) and 10m, got 1h0m0s",
		"dashboard.attainment_target: must be in (0, 1], got 0"},
	"tracing": {`tracing.endpoint: must be an http:// or https:// URL with a host (the OTLP/HTTP collector), got "ftp://x"`,
		"tracing.rate: must be >= 1 (one request in rate is traced), got 0", "tracing.count: must be >= 0, or -1 for no limit, got -2",
		"tracing.service_name: must not be empty"},
	"tls_key_no_cert":         {"tls.cert_file: required when tls.key_file is set (line 1)"},
	"tls_cert_no_key":         {"tls.key_file: required when tls.cert_file is set (line 1)"},
	"tls_missing":             {"tls.cert_file: cannot read the certificate: open testdata/missing.crt: no such file or directory (line 2)", "tls.client_ca_file: cannot read the CA certificates: open testdata/missing-ca.crt: no such file or directory (line 4)"},
	"tls_values":              {`tls.client_auth: must be one of none, request, require; got "always" (line 2)`, `tls.min_version: must be one of 1.2, 1.3; got "1.1" (line 3)`},
	"tls_without_cert":        {"tls.client_ca_file: needs tls.cert_file and tls.key_file (the listeners do not speak TLS) (line 2)", "tls.client_auth: needs tls.cert_file", "tls.metrics: needs tls.cert_file"},
	"auth_missing":            {"auth.inference_token_file: cannot read the token: open testdata/auth/missing.token: no such file or directory (line 2)"},
	"auth_empty":              {"auth.admin_token_file: testdata/auth/empty.token is empty (line 2)", "auth.inference_token_file: testdata/auth/blank.token is empty (line 3)"},
	"auth_allowed_hosts":      {`auth.allowed_hosts[1]: want a host name such as sloserve.internal, without scheme or port; got "http://evil.example" (line 2)`, `auth.allowed_hosts[2]: want a host name such as sloserve.internal, without scheme or port; got "box:8000" (line 2)`},
	"auth_short":              {"auth.inference_token_file: the token has 11 characters; use at least 16"},
	"auth_both":               {"auth.admin_token: set either auth.admin_token_file or auth.admin_token, not both (line 3)"},
	"auth_require":            {"auth.require_token_for_health: needs an inference token (auth.inference_token_file) (line 2)", "auth.require_token_for_metrics: needs an inference token"},
	"poll_interval_zero":      {"poll_interval: must be > 0, got 0s"},
	"poll_interval_int":       {`poll_interval: want a duration such as "500ms" or "2s", got 5`},
	"startup_models_mode":     {`startup_models: only allowed with model_control explicit (model_control is "poll")`},
	"startup_star_mixed":      {`startup_models[0]: "*" (all models) must be the only entry`},
	"startup_dup":             {`startup_models[1]: duplicate model "a"`},
	"backoff":                 {"runtime.restart_backoff_max: must be >= runtime.restart_backoff_initial (1s), got 500ms (line 3)"},
	"ready_timeout":           {"runtime.ready_timeout: must be > 0, got -1s"},
	"health_interval":         {"runtime.health_interval: must be > 0, got 0s"},
	"max_restarts":            {"runtime.max_restarts: must be >= 0, got -1"},
	"request_bytes_zero":      {"limits.max_request_bytes: must be > 0, got 0"},
	"request_bytes_unit":      {`limits.max_request_bytes: want a byte size`, `got "64XB": unknown unit "XB"`},
	"request_bytes_negative":  {"limits.max_request_bytes: want a byte size", "got -1: must not be negative"},
	"request_bytes_fraction":  {"limits.max_request_bytes: want a byte size", "got 1.5: not a whole number of bytes"},
	"tensor_elements_float":   {"limits.max_tensor_elements: want an integer, got 1.5"},
	"inflight_string":         {`limits.max_inflight_requests: want an integer, got "lots"`},
	"shutdown_delay_negative": {"limits.shutdown_delay: must be >= 0, got -2s"},
	"call_timeout_zero":       {"runtime.call_timeout: must be > 0, got 0s"},
	"arena_big":               {"runtime.arena_size: must be between 0 and 68719476736 (64GiB), got 137438953472 (line 1)"},
	"grace_negative":          {"limits.grace_period: must be >= 0, got -1s"},
	"connections": {"limits.max_connections: must be > 0, got 0 (line 2)", "limits.header_timeout: must be > 0, got 0s (line 3)",
		"limits.idle_timeout: must be > 0, got -1s (line 4)", "limits.max_header_bytes: must be between 4KiB and 16MiB, got 1024 (line 5)",
		"limits.grpc_max_streams: must be > 0 and at most 2147483647, got 0 (line 6)",
		"limits.grpc_connection_timeout: must be > 0, got 0s (line 7)", "limits.grpc_keepalive_min_time: must be > 0, got -1s (line 8)",
		"limits.grpc_stream_inflight: must be > 0 and at most 4096, got 4097 (line 9)"},
	"body_timeout": {"limits.body_timeout: must be > 0, got -5s (line 3)",
		"limits.max_header_bytes: must be between 4KiB and 16MiB, got 1073741824 (line 4)"},
	"tensor_limits": {"limits.max_tensor_elements: must be > 0 and at most 1152921504606846975 (its bytes must fit in int64), got 2305843009213693952 (line 2)",
		"limits.max_batch_size: must be > 0, got 0 (line 3)", "limits.grpc_max_streams: must be > 0 and at most 2147483647, got 4294967296 (line 4)"},
	"shared_memory": {"limits.max_shared_memory_regions: must be between 0 (off) and 4096, got -1 (line 2)",
		"limits.max_shared_memory_bytes: must be > 0, got 0 (line 3)"},
	"memory_limits": {"limits.max_memory: must be at least 4 x limits.max_request_bytes (268435456), got 267386880 (line 3)",
		"limits.write_timeout: must be > 0, got 0s (line 4)"},
	"gc_percent_low":  {"limits.gc_percent: must be 0 (Go's own) or between 50 and 10000, got 10 (line 2)"},
	"gc_percent_high": {"limits.gc_percent: must be 0 (Go's own) or between 50 and 10000, got 20000 (line 2)"},
	"log_format":      {`log.format: must be one of text, json; got "xml"`},
	"log_level":       {`log.level: must be one of debug, info, warn, error; got "verbose"`},
	"duplicate_key":   {"log.level: duplicate key (first at line 2) (line 3)"},
	"not_mapping":     {"want a mapping, got a list"},
	"syntax":          {"invalid YAML: "},
	"two_docs":        {"must hold a single YAML document"},
	"many": {
		`listen.grpc: ":8000" conflicts with listen.http ":8000" (line 3)`,
		`listen.metrics: want host:port such as ":8000" or "127.0.0.1:8000", got "nope" (line 4)`,
		`model_control: must be one of none, explicit, poll; got "sometimes" (line 5)`,
		"runtime.ready_timeout: must be > 0, got 0s (line 7)",
		"runtime.max_restart: unknown field (line 8)",
		`limits.max_request_bytes: want a byte size such as 1024, "64MiB" or "1GiB", got "lots"`,
		"limits.max_inflight_requests: must be > 0, got 0 (line 11)",
		`log.level: must be one of debug, info, warn, error; got "loud" (line 13)`,
	},
}

// badModelConfigs does the same for testdata/models/*.bad.yaml.
var badModelConfigs = map[string][]string{
	"name_missing":           {"name: required"},
	"name_bad":               {`name: must start with a letter or digit`, `got "ocr/det"`},
	"platform":               {`platform: must be one of onnx, onnxruntime_onnx; got "tensorflow"`},
	"policy_two":             {"version_policy: exactly one of latest, all, specific may be set; got latest, all"},
	"latest_zero":            {"version_policy.latest.num_versions: must be between 1 and 16, got 0"},
	"latest_empty":           {"version_policy.latest.num_versions: must be between 1 and 16, got 0"},
	"latest_many":            {"version_policy.latest.num_versions: must be between 1 and 16, got 30"},
	"specific_many":          {"version_policy.specific.versions: may list at most 16 versions, got 17"},
	"specific_empty":         {"version_policy.specific.versions: must list at least one version"},
	"specific_dup":           {"version_policy.specific.versions[2]: duplicate version 3"},
	"specific_zero":          {"version_policy.specific.versions[0]: must be >= 1, got 0"},
	"policy_unknown":         {"version_policy.newest: unknown field"},
	"batch_negative":         {"max_batch_size: must be >= 0, got -1"},
	"batch_dim":              {"inputs[0].shape[0]: must be -1 (the batch dimension) when max_batch_size > 0, got 1 (line 4)"},
	"batch_scalar":           {"outputs[0].shape: must start with the batch dimension -1 when max_batch_size > 0"},
	"tensor_dup":             {`inputs[1].name: duplicate name "x" (also inputs[0]) (line 4)`},
	"tensor_noname":          {"inputs[0].name: required"},
	"datatype_bad":           {"inputs[0].datatype: must be one of BOOL, UINT8", `got "FLOAT"`},
	"datatype_missing":       {"outputs[0].datatype: required"},
	"dim_zero":               {"inputs[0].shape[2]: must be -1 (dynamic) or >= 1, got 0"},
	"dim_negative":           {"outputs[0].shape[0]: must be -1 (dynamic) or >= 1, got -2"},
	"dim_float":              {"inputs[0].shape[1]: want an integer, got 2.5"},
	"tensor_unknown":         {"inputs[0].dims: unknown field"},
	"instances_zero":         {"instances: must be between 1 and 64, got 0"},
	"instances_big":          {"instances: must be between 1 and 64, got 65"},
	"instances_float":        {"instances: want an integer, got 1.5"},
	"provider_bad":           {`execution.provider: must be one of cpu, cuda; got "gpu"`},
	"device_cpu":             {"execution.device_id: only allowed with provider cuda, got 1 with provider cpu"},
	"device_negative":        {"execution.device_id: must be >= 0, got -1"},
	"intra_negative":         {"execution.intra_op_threads: must be between 0 and ", "(4 × the CPUs, at least 16), got -2"},
	"intra_big":              {"execution.intra_op_threads: must be between 0 and ", "got 20000"},
	"inter_big":              {"execution.inter_op_threads: must be between 0 and ", "got 20000"},
	"batching":               {"dynamic_batching.max_queue_delay: must be between 0 and 1m, got -1ms", "dynamic_batching.preferred_batch_sizes[1]: must be between 1 and max_batch_size (4), got 8", "max_queue_size: must be >= 0, got -3"},
	"concurrency_big":        {"execution.concurrency: must be between 0 and 64, got 65"},
	"concurrency_negative":   {"execution.concurrency: must be between 0 and 64, got -1"},
	"inter_negative":         {"execution.inter_op_threads: must be between 0 and ", "got -1"},
	"isolation_bad":          {`execution.isolation: must be one of process, in-process; got "thread" (line 3)`},
	"isolation_memory":       {"resources.memory_limit: cannot be enforced with execution.isolation in-process"},
	"graph_opt":              {`execution.graph_optimization: must be one of disable, basic, extended, all; got "max"`},
	"simulated_on_cpu":       {"execution.simulated: only allowed when execution.provider is cuda"},
	"simulated_preset":       {`execution.simulated: preset: must be one of bert-base, mobilenet, resnet50, got "vgg"`},
	"simulated_saturation":   {"execution.simulated: model \"bert-base\": saturation 1.5 is not in (0, 1]"},
	"cuda_on_cpu":            {"execution.cuda: only allowed when execution.provider is cuda (line 3)"},
	"cuda_arena":             {`execution.cuda.arena_extend_strategy: must be one of next_power_of_two, same_as_requested; got "grow"`},
	"cuda_cudnn":             {`execution.cuda.cudnn_conv_algo_search: must be one of exhaustive, heuristic, default; got "fast"`},
	"cuda_mem":               {`execution.cuda.gpu_mem_limit: want a byte size`, `got "2 gigs": unknown unit "gigs"`},
	"slo_negative":           {"slo_negative.bad.yaml: slo.latency_ms: must be > 0, got -5 (line 3)"},
	"slo_missing_latency":    {"slo.latency_ms: required when slo is given"},
	"slo_zero":               {"slo.latency_ms: must be > 0, got 0"},
	"slo_critical_no_target": {"slo.latency_ms: required for class latency-critical"},
	"slo_too_big":            {"slo.latency_ms: must be <= 3600000 (one hour)"},
	"slo_nan":                {"slo.latency_ms: must be > 0, got NaN"},
	"slo_string":             {`slo.latency_ms: want a number, got "fast"`},
	"slo_class":              {`slo.class: must be one of latency-critical, best-effort; got "realtime"`},
	"slo_priority":           {"slo.priority: must be >= 0, got -1"},
	"slo_unknown":            {"slo.latency: unknown field", "slo.latency_ms: required when slo is given"},
	"memory_unit":            {`resources.memory_limit: want a byte size`, `got "512 MiBs": unknown unit "MiBs"`},
	"min_gt_max":             {"resources.min_compute_share: must be <= max_compute_share (0.2), got 0.5"},
	"max_zero":               {"resources.max_compute_share: must be > 0 and <= 1, got 0"},
	"profile": {"resources.compute_share: must be between 0 and 1, got 1.5",
		"profile.batch_sizes[0]: must be between 1 and max_batch_size (4), got 0", "profile.batch_sizes[1]: must be between 1 and max_batch_size (4), got 8",
		"profile.shapes.x: dimensions must be between 1 and 1048576, got [1 3 0 320]", `profile.shapes.z: no input named "z"`},
	"min_negative":  {"resources.min_compute_share: must be between 0 and 1, got -0.1"},
	"max_over":      {"resources.max_compute_share: must be > 0 and <= 1, got 1.5"},
	"duplicate_key": {"slo.latency_ms: duplicate key (first at line 3) (line 4)"},
	"go_field_name": {"Dir: unknown field"},
	"not_mapping":   {`want a mapping, got "just a string"`},
	"syntax":        {"invalid YAML: "},
	"many": {
		`platform: must be one of onnx, onnxruntime_onnx; got "tf" (line 2)`,
		"inputs[0].shape[0]: must be -1 (the batch dimension) when max_batch_size > 0, got 1 (line 5)",
		`inputs[1].name: duplicate name "x" (also inputs[0]) (line 6)`,
		`inputs[1].datatype: must be one of BOOL`,
		"instances: must be between 1 and 64, got 100 (line 7)",
		"execution.device_id: only allowed with provider cuda, got 2 with provider cpu (line 10)",
		"execution.intra_threads: unknown field (line 11)",
		"slo.latency_ms: must be > 0, got -5 (line 13)",
		`slo.class: must be one of latency-critical, best-effort; got "urgent" (line 14)`,
		"resources.min_compute_share: must be between 0 and 1, got 2 (line 16)",
	},
}

// testFiles returns the files matching pattern, keyed by the name before
// the .good.yaml/.bad.yaml suffix.
func testFiles(t *testing.T, pattern, suffix string) map[string]string {
	t.Helper()
	paths, err := filepath.Glob(pattern)
	if err != nil {
		t.Fatal(err)
	}
	if len(paths) == 0 {
		t.Fatalf("no files match %s", pattern)
	}
	files := map[string]string{}
	for _, p := range paths {
		files[strings.TrimSuffix(filepath.Base(p), suffix)] = p
	}
	return files
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// checkBad checks that err reports every want, that every line of it names
// the file, and that it wraps ErrInvalid.
func checkBad(t *testing.T, file string, err error, want []string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: no error, want %q", file, want)
	}
	if !errors.Is(err, ErrInvalid) {
		t.Errorf("error does not wrap ErrInvalid: %v", err)
	}
	msg := err.Error()
	for _, w := range want {
		if !strings.Contains(msg, w) {
			t.Errorf("error lacks %q; got:\n%s", w, msg)
		}
	}
	lines := strings.Split(msg, "\n")
	for _, l := range lines {
		if !strings.HasPrefix(l, file+": ") {
			t.Errorf("error line does not start with the file name %q: %q", file, l)
		}
	}
	if strings.HasSuffix(file, "many.bad.yaml") && len(lines) != len(want) {
		t.Errorf("got %d problems, want %d:\n%s", len(lines), len(want), msg)
	}
}

func TestGoodServerConfigs(t *testing.T) {
	for name, path := range testFiles(t, "testdata/*.good.yaml", ".good.yaml") {
		t.Run(name, func(t *testing.T) {
			s, err := ParseServer(path, readFile(t, path))
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Validate(); err != nil {
				t.Errorf("parsed config does not validate: %v", err)
			}
			if s.File != path {
				t.Errorf("File = %q, want %q", s.File, path)
			}
		})
	}
}

func TestBadServerConfigs(t *testing.T) {
	files := testFiles(t, "testdata/*.bad.yaml", ".bad.yaml")
	for name := range badServerConfigs {
		if _, ok := files[name]; !ok {
			t.Errorf("badServerConfigs has %q but testdata/%s.bad.yaml does not exist", name, name)
		}
	}
	for name, path := range files {
		t.Run(name, func(t *testing.T) {
			want, ok := badServerConfigs[name]
			if !ok {
				t.Fatalf("no expected errors for %s in badServerConfigs", path)
			}
			s, err := ParseServer(path, readFile(t, path))
			if s != nil {
				t.Errorf("got a config along with the error")
			}
			checkBad(t, path, err, want)
		})
	}
}

func TestGoodModelConfigs(t *testing.T) {
	for name, path := range testFiles(t, "testdata/models/*.good.yaml", ".good.yaml") {
		t.Run(name, func(t *testing.T) {
			m, err := ParseModel(path, readFile(t, path))
			if err != nil {
				t.Fatal(err)
			}
			if err := m.Validate(); err != nil {
				t.Errorf("parsed config does not validate: %v", err)
			}
			if m.Platform != PlatformONNX {
				t.Errorf("Platform = %q, want %q", m.Platform, PlatformONNX)
			}
			if (m.Execution.CUDA != nil) != (m.Execution.Provider == ProviderCUDA) {
				t.Errorf("CUDA = %+v with provider %q", m.Execution.CUDA, m.Execution.Provider)
			}
		})
	}
}

func TestBadModelConfigs(t *testing.T) {
	files := testFiles(t, "testdata/models/*.bad.yaml", ".bad.yaml")
	for name := range badModelConfigs {
		if _, ok := files[name]; !ok {
			t.Errorf("badModelConfigs has %q but testdata/models/%s.bad.yaml does not exist", name, name)
		}
	}
	for name, path := range files {
		t.Run(name, func(t *testing.T) {
			want, ok := badModelConfigs[name]
			if !ok {
				t.Fatalf("no expected errors for %s in badModelConfigs", path)
			}
			m, err := ParseModel(path, readFile(t, path))
			if m != nil {
				t.Errorf("got a config along with the error")
			}
			checkBad(t, path, err, want)
		})
	}
}

func TestModelDefaults(t *testing.T) {
	m, err := ParseModel("tiny.yaml", []byte("name: tiny\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := &Model{
		Name:          "tiny",
		Platform:      PlatformONNX,
		VersionPolicy: VersionPolicy{Latest: &LatestPolicy{NumVersions: 1}},
		Instances:     1,
		Execution:     Execution{Provider: ProviderCPU, GraphOptimization: GraphOptAll, Isolation: IsolationProcess},
		SLO:           SLO{Class: ClassBestEffort},
		Resources:     Resources{MaxComputeShare: 1},
		File:          "tiny.yaml",
	}
	if !reflect.DeepEqual(m, want) {
		t.Errorf("defaults:\n got %+v\nwant %+v", m, want)
	}
	if got := m.LatencyTarget(); got != 0 {
		t.Errorf("LatencyTarget = %v without an slo, want 0", got)
	}
}

func TestModelFields(t *testing.T) {
	t.Run("example", func(t *testing.T) {
		m, err := ParseModel("examples/model.yaml", readFile(t, "examples/model.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		want := &Model{
			Name:            "ocr-det",
			Platform:        PlatformONNX,
			VersionPolicy:   VersionPolicy{Latest: &LatestPolicy{NumVersions: 1}},
			MaxBatchSize:    4,
			Inputs:          []TensorConfig{{Name: "x", DataType: "FP32", Shape: []int64{-1, 3, -1, -1}}},
			Outputs:         []TensorConfig{{Name: "sigmoid_0.tmp_0", DataType: "FP32", Shape: []int64{-1, 1, -1, -1}}},
			Instances:       1,
			Execution:       Execution{Provider: ProviderCPU, IntraOpThreads: 1, GraphOptimization: GraphOptAll, Concurrency: 1, Isolation: IsolationProcess},
			DynamicBatching: DynamicBatching{MaxQueueDelay: 2 * time.Millisecond, PreferredBatchSizes: []int{2, 4}},
			MaxQueueSize:    256,
			SLO:             SLO{LatencyMS: 500, Class: ClassLatencyCritical, Priority: 1},
			Resources:       Resources{MemoryLimit: 512 * MiB, MinComputeShare: 0.2, MaxComputeShare: 1},
			Profile:         ModelProfile{Shapes: ProfileShapes{{"x": {1, 3, 640, 640}}}, BatchSizes: []int{1, 2, 4}},
			File:            "examples/model.yaml",
		}
		if !reflect.DeepEqual(m, want) {
			t.Errorf("\n got %+v\nwant %+v", m, want)
		}
		if got := m.LatencyTarget(); got != 500*time.Millisecond {
			t.Errorf("LatencyTarget = %v, want 500ms", got)
		}
	})
	t.Run("cuda", func(t *testing.T) {
		m, err := ParseModel("cuda.yaml", readFile(t, "testdata/models/cuda.good.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		want := &CUDA{GPUMemLimit: 2 * GiB, ArenaExtendStrategy: ArenaSameAsRequested, CuDNNConvAlgoSearch: ConvAlgoHeuristic}
		if !reflect.DeepEqual(m.Execution.CUDA, want) || m.Execution.DeviceID != 1 {
			t.Errorf("execution = %+v, cuda %+v; want device 1, cuda %+v", m.Execution, m.Execution.CUDA, want)
		}
	})
	t.Run("cuda defaults", func(t *testing.T) {
		m, err := ParseModel("cuda.yaml", []byte("name: m\nexecution:\n  provider: cuda\n  cuda: {gpu_mem_limit: 1GiB}\n"))
		if err != nil {
			t.Fatal(err)
		}
		want := &CUDA{GPUMemLimit: GiB, ArenaExtendStrategy: ArenaNextPowerOfTwo, CuDNNConvAlgoSearch: ConvAlgoExhaustive}
		if !reflect.DeepEqual(m.Execution.CUDA, want) {
			t.Errorf("cuda = %+v, want %+v", m.Execution.CUDA, want)
		}
	})
	t.Run("policies", func(t *testing.T) {
		for file, want := range map[string]VersionPolicy{
			"specific": {Specific: &SpecificPolicy{Versions: []int64{1, 3}}},
			"all":      {All: &AllPolicy{}},
			"all_null": {All: &AllPolicy{}},
		} {
			path := "testdata/models/" + file + ".good.yaml"
			m, err := ParseModel(path, readFile(t, path))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(m.VersionPolicy, want) {
				t.Errorf("%s: policy = %+v, want %+v", file, m.VersionPolicy, want)
			}
		}
	})
	t.Run("fractional latency", func(t *testing.T) {
		m, err := ParseModel("m.yaml", []byte("name: m\nslo: {latency_ms: 12.5}\n"))
		if err != nil {
			t.Fatal(err)
		}
		if got := m.LatencyTarget(); got != 12500*time.Microsecond {
			t.Errorf("LatencyTarget = %v, want 12.5ms", got)
		}
	})
}

// TestValidateCodeBuilt checks Validate on models built in code, without
// a file: the zero version policy is the default, and messages have no file.
func TestValidateCodeBuilt(t *testing.T) {
	m := &Model{Name: "m", Platform: PlatformONNX, Instances: 1,
		Execution: Execution{Provider: ProviderCPU, GraphOptimization: GraphOptAll},
		SLO:       SLO{Class: ClassBestEffort}, Resources: Resources{MaxComputeShare: 1}}
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	m.SLO.Class = ClassLatencyCritical
	m.Instances = 0
	err := m.Validate()
	checkBadNoFile(t, err, "slo.latency_ms: required for class latency-critical", "instances: must be between 1 and 64, got 0")
}

func checkBadNoFile(t *testing.T, err error, want ...string) {
	t.Helper()
	if err == nil || !errors.Is(err, ErrInvalid) {
		t.Fatalf("err = %v, want an ErrInvalid", err)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error lacks %q; got:\n%v", w, err)
		}
	}
}

func TestFieldErrors(t *testing.T) {
	_, err := ParseModel("m.yaml", []byte("name: m\ninstances: 0\nslo: {latency_ms: -1}\n"))
	var fe *FieldError
	if !errors.As(err, &fe) {
		t.Fatalf("no FieldError in %v", err)
	}
	if *fe != (FieldError{File: "m.yaml", Path: "instances", Line: 2, Msg: "must be between 1 and 64, got 0"}) {
		t.Errorf("first FieldError = %+v", *fe)
	}
	var all interface{ Unwrap() []error }
	if !errors.As(err, &all) || len(all.Unwrap()) != 2 {
		t.Errorf("want 2 joined problems, got %v", err)
	}
}

func TestLoadModel(t *testing.T) {
	t.Run("config.yaml", func(t *testing.T) {
		m, err := LoadModel("testdata/repo/ocr-det")
		if err != nil {
			t.Fatal(err)
		}
		if m.Name != "ocr-det" || m.Dir != "testdata/repo/ocr-det" || m.File != filepath.Join("testdata/repo/ocr-det", "config.yaml") {
			t.Errorf("got name %q dir %q file %q", m.Name, m.Dir, m.File)
		}
		if m.LatencyTarget() != 500*time.Millisecond || m.SLO.Class != ClassLatencyCritical {
			t.Errorf("slo = %+v", m.SLO)
		}
	})
	t.Run("config.yml", func(t *testing.T) {
		m, err := LoadModel("testdata/repo/yml-model/")
		if err != nil {
			t.Fatal(err)
		}
		if m.File != filepath.Join("testdata/repo/yml-model", "config.yml") {
			t.Errorf("File = %q", m.File)
		}
	})
	t.Run("name differs from folder", func(t *testing.T) {
		_, err := LoadModel("testdata/repo/misnamed")
		checkBad(t, filepath.Join("testdata/repo/misnamed", "config.yaml"), err,
			[]string{`name: must equal the folder name "misnamed", got "other" (line 2)`})
	})
	t.Run("current dir", func(t *testing.T) {
		t.Chdir("testdata/repo/ocr-det")
		if _, err := LoadModel("."); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("no config", func(t *testing.T) {
		_, err := LoadModel(t.TempDir())
		if !errors.Is(err, fs.ErrNotExist) || errors.Is(err, ErrInvalid) {
			t.Errorf("err = %v, want fs.ErrNotExist", err)
		}
	})
	t.Run("both names", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "m")
		writeFile(t, filepath.Join(dir, "config.yaml"), "name: m\n")
		writeFile(t, filepath.Join(dir, "config.yml"), "name: m\n")
		_, err := LoadModel(dir)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "both config.yaml and config.yml") {
			t.Errorf("err = %v", err)
		}
	})
}

// TestDemoRepository loads the demo model configs shipped with the project,
// so a change here cannot silently break them.
func TestDemoRepository(t *testing.T) {
	dirs, _ := filepath.Glob("../demo-repository/*/config.yaml")
	if len(dirs) == 0 {
		t.Skip("no demo-repository")
	}
	for _, f := range dirs {
		t.Run(filepath.Base(filepath.Dir(f)), func(t *testing.T) {
			if _, err := LoadModel(filepath.Dir(f)); err != nil {
				t.Error(err)
			}
		})
	}
}

func writeFile(t *testing.T, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestSelectVersions(t *testing.T) {
	onDisk := []int64{3, 1, 7, 2, 3}
	tests := []struct {
		name   string
		policy VersionPolicy
		in     []int64
		want   []int64
	}{
		{"default", VersionPolicy{}, onDisk, []int64{7}},
		{"latest 1", VersionPolicy{Latest: &LatestPolicy{1}}, onDisk, []int64{7}},
		{"latest 2", VersionPolicy{Latest: &LatestPolicy{2}}, onDisk, []int64{3, 7}},
		{"latest more than there are", VersionPolicy{Latest: &LatestPolicy{10}}, onDisk, []int64{1, 2, 3, 7}},
		{"all", VersionPolicy{All: &AllPolicy{}}, onDisk, []int64{1, 2, 3, 7}},
		{"specific", VersionPolicy{Specific: &SpecificPolicy{[]int64{7, 1}}}, onDisk, []int64{1, 7}},
		{"specific missing", VersionPolicy{Specific: &SpecificPolicy{[]int64{4, 2}}}, onDisk, []int64{2}},
		{"specific none exist", VersionPolicy{Specific: &SpecificPolicy{[]int64{9}}}, onDisk, nil},
		{"nothing on disk", VersionPolicy{Latest: &LatestPolicy{2}}, nil, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := slices.Clone(tt.in)
			m := &Model{VersionPolicy: tt.policy}
			got := m.SelectVersions(in)
			if !slices.Equal(got, tt.want) {
				t.Errorf("SelectVersions(%v) = %v, want %v", tt.in, got, tt.want)
			}
			if !slices.Equal(in, tt.in) {
				t.Errorf("SelectVersions changed its argument to %v", in)
			}
		})
	}
}

func TestListVersions(t *testing.T) {
	dir := t.TempDir()
	for _, v := range []string{"1", "10", "2/model.onnx/", "007", "0", "-1", "abc", "99999999999999999999"} {
		writeFile(t, filepath.Join(dir, v, "model.onnx"), "onnx")
	}
	if err := os.MkdirAll(filepath.Join(dir, "3"), 0o755); err != nil { // no model.onnx
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "4"), "a file, not a folder")
	writeFile(t, filepath.Join(dir, "4.onnx"), "")
	other := t.TempDir()
	writeFile(t, filepath.Join(other, "model.onnx"), "onnx")
	if err := os.Symlink(other, filepath.Join(dir, "5")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(dir, "4"), filepath.Join(dir, "6")); err != nil {
		t.Fatal(err)
	}

	got, err := ListVersions(dir)
	if err != nil {
		t.Fatal(err)
	}
	if want := []int64{1, 5, 10}; !slices.Equal(got, want) {
		t.Errorf("ListVersions = %v, want %v", got, want)
	}

	if got, err := ListVersions(t.TempDir()); err != nil || got == nil || len(got) != 0 {
		t.Errorf("empty folder: got %v, %v; want an empty list", got, err)
	}
	if _, err := ListVersions(filepath.Join(dir, "missing")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing folder: err = %v, want fs.ErrNotExist", err)
	}
}

func TestDefaultServer(t *testing.T) {
	s, err := LoadServer("")
	if err != nil {
		t.Fatalf("embedded default.yaml: %v", err)
	}
	if s.File != DefaultServerFile {
		t.Errorf("File = %q", s.File)
	}
	s.File = ""
	if want := DefaultServer(); !reflect.DeepEqual(s, want) {
		t.Errorf("default.yaml and DefaultServer differ:\n%+v\n%+v", s, want)
	}
	if err := DefaultServer().Validate(); err != nil {
		t.Errorf("DefaultServer does not validate: %v", err)
	}
	if !reflect.DeepEqual(DefaultServerYAML(), readFile(t, "default.yaml")) {
		t.Error("DefaultServerYAML is not default.yaml")
	}
}

func TestLoadServer(t *testing.T) {
	s, err := LoadServer("examples/server.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if s.ModelControl != ModelControlPoll || s.PollInterval != 10*time.Second ||
		!slices.Equal(s.Repositories, []string{"demo-repository", "/srv/models"}) ||
		s.Limits.MaxRequestBytes != 256*MiB || s.Runtime.ReadyTimeout != 2*time.Minute ||
		s.Limits.MaxConnections != 10000 || s.Limits.HeaderTimeout != 5*time.Second || s.Limits.MaxHeaderBytes != 32*KiB ||
		s.Limits.GRPCMaxStreams != 100 || s.Limits.GRPCKeepaliveMinTime != 30*time.Second || s.Limits.MaxBatchSize != 64 ||
		s.Log.SlogLevel().String() != "DEBUG" {
		t.Errorf("examples/server.yaml read as %+v", s)
	}
	if _, err := LoadServer(filepath.Join(t.TempDir(), "missing.yaml")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing file: err = %v", err)
	}
}

// TestPartialSections checks that a section given in part keeps the
// defaults of the fields it leaves out.
func TestPartialSections(t *testing.T) {
	s, err := ParseServer("s.yaml", []byte("listen: {http: \":9000\"}\nruntime: {max_restarts: 0}\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := DefaultServer()
	want.Listen.HTTP = ":9000"
	want.Runtime.MaxRestarts = 0
	want.File = "s.yaml"
	if !reflect.DeepEqual(s, want) {
		t.Errorf("\n got %+v\nwant %+v", s, want)
	}
}

// TestMarshalRoundTrip checks that a config written out reads back equal.
func TestMarshalRoundTrip(t *testing.T) {
	s := DefaultServer()
	s.Limits.MaxRequestBytes = 1000
	data, err := yaml.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	back, err := ParseServer("out.yaml", data)
	if err != nil {
		t.Fatalf("%v\n%s", err, data)
	}
	back.File = ""
	if !reflect.DeepEqual(back, s) {
		t.Errorf("round trip:\n got %+v\nwant %+v\n%s", back, s, data)
	}

	m, err := ParseModel("m.yaml", readFile(t, "testdata/models/cuda.good.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	data, err = yaml.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	mb, err := ParseModel("m.yaml", data)
	if err != nil {
		t.Fatalf("%v\n%s", err, data)
	}
	if !reflect.DeepEqual(mb, m) {
		t.Errorf("round trip:\n got %+v\nwant %+v\n%s", mb, m, data)
	}

	// A reshape to a scalar ([]) is not the absence of one (nil).
	m.Inputs = append(m.Inputs, TensorConfig{Name: "scale", DataType: "FP32", Shape: []int64{1}, Reshape: []int64{}})
	if data, err = yaml.Marshal(m); err != nil {
		t.Fatal(err)
	}
	if mb, err = ParseModel("m.yaml", data); err != nil {
		t.Fatalf("%v\n%s", err, data)
	}
	if r := mb.Inputs[len(mb.Inputs)-1].Reshape; r == nil || len(r) != 0 {
		t.Errorf("a scalar reshape reads back as %#v, want []int64{}\n%s", r, data)
	}
}

func TestLogLevel(t *testing.T) {
	for level, want := range map[string]string{"debug": "DEBUG", "info": "INFO", "warn": "WARN", "error": "ERROR", "bogus": "INFO"} {
		if got := (Log{Level: level}).SlogLevel().String(); got != want {
			t.Errorf("SlogLevel(%q) = %s, want %s", level, got, want)
		}
	}
}
