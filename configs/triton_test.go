package configs

import (
	"errors"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/prototext"
)

// tritonGood is a Triton config.pbtxt as Triton's docs write them: every
// field sloserve reads, comments, list and block syntax.
const tritonGood = `
# A Triton model repository's config, unchanged.
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { latest: { num_versions: 2 } }
input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 3, -1 ]
  },
  {
    name: "TEXT"
    data_type: TYPE_STRING
    dims: [ 1 ]
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_INT64
    dims: [ 4 ]
  }
]
instance_group [ { count: 2, kind: KIND_CPU }, { kind: KIND_CPU } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 1500
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy {
    timeout_action: REJECT
    default_timeout_microseconds: 250000
    allow_timeout_override: true
    max_queue_size: 32
  }
}
optimization { graph { level: 1 } }
parameters { key: "slo.latency_ms" value: { string_value: "40" } }
parameters { key: "resources.max_compute_share" value: { string_value: "0.5" } }
parameters { key: "resources.memory_limit" value: { string_value: "256MiB" } }
parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
`

func writeTritonModel(t *testing.T, name, pbtxt string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), name)
	writeFile(t, filepath.Join(dir, ModelConfigPbtxt), pbtxt)
	return dir
}

func TestTritonConfigGood(t *testing.T) {
	dir := writeTritonModel(t, "resnet", tritonGood)
	m, err := LoadModel(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := &Model{
		Name:          "resnet", // from the folder: the file gives none
		Platform:      PlatformONNX,
		VersionPolicy: VersionPolicy{Latest: &LatestPolicy{NumVersions: 2}},
		MaxBatchSize:  8,
		Inputs: []TensorConfig{
			{Name: "INPUT0", DataType: "FP32", Shape: []int64{-1, 3, -1}},
			{Name: "TEXT", DataType: "BYTES", Shape: []int64{-1, 1}},
		},
		Outputs:   []TensorConfig{{Name: "OUTPUT0", DataType: "INT64", Shape: []int64{-1, 4}}},
		Instances: 3,
		Execution: Execution{Provider: ProviderCPU, IntraOpThreads: 2, GraphOptimization: GraphOptExtended, Isolation: IsolationProcess},
		// A latency target without a class makes the model latency-critical.
		SLO: SLO{LatencyMS: 40, Class: ClassLatencyCritical, Priority: 2},
		DynamicBatching: DynamicBatching{
			MaxQueueDelay: 1500 * time.Microsecond, PreferredBatchSizes: []int{4, 8},
			PriorityLevels: 3, DefaultTimeout: 250 * time.Millisecond,
		},
		MaxQueueSize: 32,
		Resources:    Resources{MaxComputeShare: 0.5, MemoryLimit: 256 << 20},
		Dir:          dir,
		File:         filepath.Join(dir, ModelConfigPbtxt),
	}
	if !reflect.DeepEqual(m, want) {
		t.Errorf("got  %+v\nwant %+v", m, want)
	}
}

func TestTritonConfigBad(t *testing.T) {
	tests := []struct {
		name, pbtxt string
		want        []string
	}{
		{"not protobuf text", "max_batch_size: eight\n", []string{"config.pbtxt: not a valid Triton model config"}},
		{"unsupported field", "max_batch_size: 0\nsequence_batching { }\n",
			[]string{"config.pbtxt: sequence_batching: not supported by sloserve (or not a Triton model config field) (line 2)"}},
		{"ensemble", `platform: "ensemble"` + "\nensemble_scheduling { }\n", []string{"ensemble_scheduling.step: an ensemble needs at least one step"}},
		{"other platform", `platform: "tensorflow_savedmodel"`, []string{`platform: sloserve serves only "onnxruntime_onnx" models, got "tensorflow_savedmodel"`}},
		{"other backend", `backend: "python"`, []string{`backend: sloserve serves only the "onnxruntime" backend, got "python"`}},
		{"runtime", `runtime: "libtriton_onnxruntime.so"`, []string{"runtime: a backend library cannot be chosen"}},
		{"name not the folder", `name: "other"`, []string{`name: must equal the folder name "m", got "other"`}},
		{"no data type", `input { name: "x" dims: [1] }`, []string{"input[0].data_type: required"}},
		{"reshape losing elements", `input { name: "x" data_type: TYPE_FP32 dims: [4] reshape { shape: [2, 3] } }`, []string{"input[0].reshape: [2 3] holds 6 elements, shape [4] holds 4"}},
		{"reshape of a dynamic dim", `max_batch_size: 2 input { name: "x" data_type: TYPE_FP32 dims: [-1, 2] reshape { shape: [2, 2] } }`, []string{"input[0].shape[1]: must be fixed (>= 1) when the tensor is reshaped, got -1"}},
		{"ragged", `max_batch_size: 4 input { name: "x" data_type: TYPE_FP32 dims: [-1] allow_ragged_batch: true }`, []string{"input[0].allow_ragged_batch: not supported"}},
		{"optional input", `input { name: "x" data_type: TYPE_FP32 dims: [4] optional: true }`, []string{"input[0].optional: not supported: every input is required"}},
		{"bad dim", `input { name: "x" data_type: TYPE_FP32 dims: [0] }`, []string{"input[0].shape[0]: must be -1 (dynamic) or >= 1, got 0"}},
		{"two gpus", `instance_group { kind: KIND_GPU gpus: [0, 1] }`, []string{"instance_group[0].gpus: a model runs on one GPU, got [0 1]"}},
		{"cpu and gpu", `instance_group { kind: KIND_CPU } instance_group { kind: KIND_GPU }`, []string{"instance_group[1].kind: all instance groups must run on the same kind of device"}},
		{"auto with gpus", `instance_group { gpus: [0] }`, []string{"instance_group[0].gpus: not allowed with KIND_AUTO"}},
		{"kind model", `instance_group { kind: KIND_MODEL }`, []string{"instance_group[0].kind: must be KIND_CPU, KIND_GPU or KIND_AUTO, got KIND_MODEL"}},
		{"too many instances", `instance_group { count: 65 }`, []string{"instance_group.count: must be between 1 and 64, got 65"}},
		{"passive", `instance_group { passive: true }`, []string{"instance_group[0].passive: not supported"}},
		{"rate limiter", `instance_group { rate_limiter { } }`, []string{"rate_limiter: not supported by sloserve"}},
		{"delay action", `dynamic_batching { default_queue_policy { timeout_action: DELAY } }`, []string{"dynamic_batching.default_queue_policy.timeout_action: DELAY is not supported"}},
		{"per level policy", `dynamic_batching { priority_levels: 2 priority_queue_policy { key: 1 value: { max_queue_size: 4 } } }`, []string{"dynamic_batching.priority_queue_policy: not supported"}},
		{"default level beyond levels", `dynamic_batching { priority_levels: 2 default_priority_level: 3 }`, []string{"dynamic_batching.default_priority_level: must be between 1 and priority_levels (2), got 3"}},
		{"default level without levels", `dynamic_batching { default_priority_level: 1 }`, []string{"dynamic_batching.default_priority_level: needs priority_levels"}},
		{"preferred without batching", `dynamic_batching { preferred_batch_size: [2] }`, []string{"dynamic_batching.preferred_batch_size: needs max_batch_size > 0"}},
		{"queue delay", `max_batch_size: 2 dynamic_batching { max_queue_delay_microseconds: 120000000 }`, []string{"dynamic_batching.max_queue_delay_microseconds: must be between 0 and 1m, got 2m0s"}},
		{"accelerator", `optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" } ] } }`, []string{"optimization.execution_accelerators: not supported"}},
		{"model file", `default_model_filename: "model.plan"`, []string{`default_model_filename: must be "model.onnx" (the file a version folder holds), got "model.plan"`}},
		{"cc files", `cc_model_filenames { key: "7.5" value: "a.onnx" }`, []string{"cc_model_filenames: not supported"}},
		{"custom ops", `model_operations { op_library_filename: "libops.so" }`, []string{"model_operations.op_library_filename: not supported"}},
		{"decoupled", `model_transaction_policy { decoupled: true }`, []string{"model_transaction_policy.decoupled: not supported: a request gets exactly one response"}},
		{"warmup without inputs", `model_warmup [ { name: "w" } ]`, []string{"model_warmup[0].inputs: must name at least one input"}},
		{"not a number", `parameters { key: "slo.latency_ms" value: { string_value: "fast" } }`, []string{`parameters["slo.latency_ms"]: must be a number, got "fast"`}},
		{"bad class", `parameters { key: "slo.class" value: { string_value: "gold" } }`, []string{`parameters["slo.class"]: must be one of latency-critical, best-effort; got "gold"`}},
		{"typo in our parameter", `parameters { key: "slo.latency" value: { string_value: "5" } }`, []string{`parameters["slo.latency"]: unknown sloserve parameter`}},
		{"threads twice", `parameters { key: "intra_op_thread_count" value: { string_value: "2" } } parameters { key: "execution.intra_op_threads" value: { string_value: "2" } }`, []string{"parameters: give the thread counts once"}},
		{"priority twice", `parameters { key: "slo.priority" value: { string_value: "1" } } dynamic_batching { priority_levels: 2 default_priority_level: 2 }`, []string{"dynamic_batching.default_priority_level: is 2 but parameter slo.priority is 1; give one"}},
		{"bad memory", `parameters { key: "resources.memory_limit" value: { string_value: "lots" } }`, []string{`parameters["resources.memory_limit"]: must be a byte size`}},
		{"share range", `parameters { key: "resources.max_compute_share" value: { string_value: "2" } }`, []string{`parameters["resources.max_compute_share"]: must be > 0 and <= 1, got 2`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := writeTritonModel(t, "m", tc.pbtxt)
			_, err := LoadModel(dir)
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("err = %v, want ErrInvalid", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\nwant it to contain %q", err, w)
				}
			}
			if !strings.Contains(err.Error(), filepath.Join(dir, ModelConfigPbtxt)) {
				t.Errorf("error %q does not name the file", err)
			}
		})
	}
}

// Fields sloserve accepts without honouring them are warnings, each naming
// the file and the field.
func TestTritonConfigWarnings(t *testing.T) {
	pbtxt := `
max_batch_size: 4
input { name: "x" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [3, 8, 8] }
output { name: "y" data_type: TYPE_FP32 dims: [10] label_filename: "labels.txt" }
instance_group { name: "g" count: 1 kind: KIND_AUTO host_policy: "numa0" }
metric_tags { key: "team" value: "vision" }
response_cache { enable: true }
optimization { input_pinned_memory { enable: true } priority: PRIORITY_MAX }
parameters { key: "enable_mem_arena" value: { string_value: "1" } }
`
	dir := writeTritonModel(t, "m", pbtxt)
	m, err := LoadModel(dir)
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, ModelConfigPbtxt)
	for _, field := range []string{
		"input[0].format", "output[0].label_filename", "instance_group[0].name", "instance_group[0].host_policy",
		"metric_tags", "response_cache.enable", "optimization.input_pinned_memory", "optimization.priority",
		`parameters["enable_mem_arena"]`, "dynamic_batching: not given",
	} {
		if !slices.ContainsFunc(m.Warnings, func(w string) bool { return strings.HasPrefix(w, file+": "+field) }) {
			t.Errorf("no warning for %s in %q", field, m.Warnings)
		}
	}
	if len(m.Warnings) != 10 {
		t.Errorf("%d warnings, want 10: %q", len(m.Warnings), m.Warnings)
	}
}

// A folder with both files is read from config.yaml, with a warning; the
// config.pbtxt alone is read when there is no config.yaml.
func TestLoadModelBothFormats(t *testing.T) {
	dir := writeTritonModel(t, "m", `max_batch_size: 2 instance_group { count: 3 }`)
	m, err := LoadModel(dir)
	if err != nil || m.Instances != 3 || m.MaxBatchSize != 2 || len(m.Warnings) != 1 {
		t.Fatalf("config.pbtxt alone: %+v, %v", m, err)
	}
	writeFile(t, filepath.Join(dir, ModelConfigFile), "name: m\ninstances: 2\n")
	m, err = LoadModel(dir)
	if err != nil {
		t.Fatal(err)
	}
	if m.Instances != 2 || m.File != filepath.Join(dir, ModelConfigFile) {
		t.Errorf("both: read %s with %d instances, want config.yaml's 2", m.File, m.Instances)
	}
	want := filepath.Join(dir, ModelConfigPbtxt) + ": ignored: config.yaml is read instead"
	if !slices.Equal(m.Warnings, []string{want}) {
		t.Errorf("warnings %q, want %q", m.Warnings, want)
	}
	// A broken config.pbtxt beside a config.yaml does not matter.
	writeFile(t, filepath.Join(dir, ModelConfigPbtxt), "{{{")
	if _, err := LoadModel(dir); err != nil {
		t.Errorf("a broken config.pbtxt shadowed by config.yaml: %v", err)
	}
	// Size-limited and regular files only, as config.yaml.
	big := writeTritonModel(t, "big", "")
	writeFile(t, filepath.Join(big, ModelConfigPbtxt), strings.Repeat("#", MaxConfigFile+1))
	if _, err := LoadModel(big); err == nil || !strings.Contains(err.Error(), "config.pbtxt") {
		t.Errorf("an oversized config.pbtxt: %v", err)
	}
}

// TritonConfig and the config.pbtxt reader are inverses: a model written
// out in Triton's shape reads back equal, so a repository served through
// either format describes itself the same.
func TestTritonConfigRoundTrip(t *testing.T) {
	example, err := ParseModel("examples/model.yaml", readFile(t, "examples/model.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	variants := map[string]*Model{"example": example}
	v := *example
	v.DynamicBatching.PriorityLevels, v.DynamicBatching.DefaultTimeout = 4, time.Second
	v.VersionPolicy = VersionPolicy{Specific: &SpecificPolicy{Versions: []int64{1, 3}}}
	v.Execution.GraphOptimization = GraphOptDisable
	v.Execution.AllowSpinning, v.Execution.InterOpThreads, v.Execution.Concurrency = true, 2, 3
	v.Resources.ComputeShare = 0.3
	variants["everything"] = &v
	plain := Model{Name: "plain", Platform: PlatformONNX, Instances: 1, MaxQueueSize: 9,
		VersionPolicy: VersionPolicy{All: &AllPolicy{}},
		Inputs:        []TensorConfig{{Name: "s", DataType: "BYTES", Shape: []int64{2}}},
		Execution:     Execution{Provider: ProviderCPU, GraphOptimization: GraphOptBasic},
		SLO:           SLO{Class: ClassBestEffort, Priority: 2}, Resources: Resources{MaxComputeShare: 1}}
	variants["unbatched"] = &plain
	for name, m := range variants {
		t.Run(name, func(t *testing.T) {
			text, err := prototext.MarshalOptions{Multiline: true}.Marshal(TritonConfig(m))
			if err != nil {
				t.Fatal(err)
			}
			back, err := ParseTritonModel("config.pbtxt", text)
			if err != nil {
				t.Fatalf("%v\n%s", err, text)
			}
			want := *m
			// Profile shapes travel as model_warmup; Triton has no field
			// for the profiled batch sizes.
			want.Profile.BatchSizes, want.File, want.Dir = nil, "config.pbtxt", ""
			if want.Execution.Isolation == "" {
				want.Execution.Isolation = IsolationProcess // the default, as parsing sets it
			}
			back.Warnings = nil
			if !reflect.DeepEqual(back, &want) {
				t.Errorf("read back %+v\nwant      %+v\n%s", back, &want, text)
			}
		})
	}
}

// TestParseTritonModelJSON: the config override of a load request, a
// Triton ModelConfig in JSON (proto field names, enums by name, int64 as
// numbers or strings), maps as a config.pbtxt does; a name of another
// model, unknown fields and invalid values are refused.
func TestParseTritonModelJSON(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "dyn")
	m, err := ParseTritonModelJSON("override", []byte(`{"name": "dyn", "max_batch_size": 4,
		"input": [{"name": "input_vectors", "data_type": "TYPE_FP32", "dims": ["10"]}],
		"instance_group": [{"count": 2, "kind": "KIND_CPU"}],
		"parameters": {"slo.latency_ms": {"string_value": "250"}}}`), dir)
	if err != nil {
		t.Fatal(err)
	}
	if m.Name != "dyn" || m.MaxBatchSize != 4 || m.Instances != 2 || len(m.Inputs) != 1 || m.Inputs[0].DataType != "FP32" ||
		m.SLO.LatencyMS != 250 {
		t.Fatalf("mapped %+v", m)
	}
	if m, err := ParseTritonModelJSON("override", []byte(`{}`), dir); err != nil || m.Name != "dyn" {
		t.Fatalf("an empty config: %v %v, want the folder's name", m, err)
	}
	for _, tc := range []struct{ json, msg string }{
		{`{"name": "other"}`, `names model "other", not "dyn"`},
		{`{"max_batch_size": 4, "bogus": 1}`, "not a valid Triton model config in JSON"},
		{`{"max_batch_size": -1}`, "max_batch_size"},
		{`not json`, "not a valid Triton model config in JSON"},
	} {
		_, err := ParseTritonModelJSON("override", []byte(tc.json), dir)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: %v, want ErrInvalid naming %q", tc.json, err, tc.msg)
		}
	}
}

// model_warmup samples are profile shapes: one set per sample, the batch
// dimension put in front when the model batches; bad shapes are refused
// as profile.shapes are, and a data file is a warning.
func TestTritonModelWarmup(t *testing.T) {
	const head = `name: "m"
max_batch_size: 4
input { name: "x" data_type: TYPE_FP32 dims: [3, -1, -1] }
`
	m, err := ParseTritonModel("config.pbtxt", []byte(head+`
model_warmup { name: "small" batch_size: 1 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [3, 256, 256] zero_data: true } } }
model_warmup { name: "large" batch_size: 2 count: 3 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [3, 640, 640] input_data_file: "img" } } }
`))
	if err != nil {
		t.Fatal(err)
	}
	want := ProfileShapes{{"x": {1, 3, 256, 256}}, {"x": {1, 3, 640, 640}}}
	if !reflect.DeepEqual(m.Profile.Shapes, want) {
		t.Errorf("profile shapes %v, want %v", m.Profile.Shapes, want)
	}
	if !slices.ContainsFunc(m.Warnings, func(w string) bool { return strings.Contains(w, "model_warmup[1].inputs.x.input_data_file: ignored") }) {
		t.Errorf("warnings %q, want one about the data file", m.Warnings)
	}
	for pbtxt, msg := range map[string]string{
		`model_warmup { name: "w" inputs { key: "y" value: { data_type: TYPE_FP32 dims: [3, 8, 8] zero_data: true } } }`: `model_warmup[0].inputs.y: no input named "y"`,
		`model_warmup { name: "w" inputs { key: "x" value: { data_type: TYPE_FP32 dims: [3, 0, 8] zero_data: true } } }`: "model_warmup[0].inputs.x: dimensions must be between 1 and 1048576, got [1 3 0 8]",
		`model_warmup { name: "w" }`: "model_warmup[0].inputs: must name at least one input",
	} {
		_, err := ParseTritonModel("config.pbtxt", []byte(head+pbtxt))
		if err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("%s: error %v, want %q", pbtxt, err, msg)
		}
	}
}
