package configs

import (
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/prototext"
)

// ensembleGood is a three-step ensemble as Triton's docs write one: a
// step feeding two, which run side by side, listed out of order.
const ensembleGood = `
name: "pipe"
platform: "ensemble"
max_batch_size: 4
input [ { name: "RAW", data_type: TYPE_FP32, dims: [ 10 ] } ]
output [
  { name: "OUT", data_type: TYPE_FP32, dims: [ ] },
  { name: "SCORE", data_type: TYPE_FP32, dims: [ ] }
]
ensemble_scheduling {
  step [
    {
      model_name: "add"
      model_version: -1
      input_map { key: "x" value: "score" }
      input_map { key: "y" value: "score" }
      output_map { key: "z" value: "OUT" }
    },
    {
      model_name: "dyn"
      model_version: 2
      input_map { key: "input_vectors" value: "RAW" }
      output_map { key: "output_scalars" value: "score" }
    },
    {
      model_name: "copy"
      input_map { key: "x" value: "score" }
      output_map { key: "y" value: "SCORE" }
    }
  ]
}
`

func TestTritonEnsembleGood(t *testing.T) {
	m, err := ParseTritonModel("config.pbtxt", []byte(ensembleGood))
	if err != nil {
		t.Fatal(err)
	}
	if m.Platform != PlatformEnsemble || m.Name != "pipe" || m.MaxBatchSize != 4 {
		t.Errorf("platform %q name %q max_batch_size %d", m.Platform, m.Name, m.MaxBatchSize)
	}
	wantIn := []TensorConfig{{Name: "RAW", DataType: "FP32", Shape: []int64{-1, 10}}}
	if !reflect.DeepEqual(m.Inputs, wantIn) {
		t.Errorf("inputs %+v, want %+v", m.Inputs, wantIn)
	}
	if len(m.Outputs) != 2 || !slices.Equal(m.Outputs[0].Shape, []int64{-1}) {
		t.Errorf("outputs %+v", m.Outputs)
	}
	e := m.Ensemble
	if e == nil || len(e.Steps) != 3 {
		t.Fatalf("ensemble %+v", e)
	}
	if s := e.Steps[1]; s.Model != "dyn" || s.Version != "2" || s.Inputs["input_vectors"] != "RAW" || s.Outputs["output_scalars"] != "score" {
		t.Errorf("step 1 = %+v", s)
	}
	if e.Steps[0].Version != "" || e.Steps[2].Version != "" {
		t.Errorf("versions -1 and unset should be the default version, got %q and %q", e.Steps[0].Version, e.Steps[2].Version)
	}
	// dyn first; add and copy after it.
	if len(e.Order) != 3 || e.Order[0] != 1 || !slices.Contains(e.Order, 0) || !slices.Contains(e.Order, 2) {
		t.Errorf("order %v, want dyn (1) first, then 0 and 2", e.Order)
	}
	if got := e.Producers(); !reflect.DeepEqual(got, map[string]int{"OUT": 0, "score": 1, "SCORE": 2}) {
		t.Errorf("producers %v", got)
	}

	// ModelConfig answers it as Triton would, and that reads back equal.
	tc := TritonConfig(m)
	if tc.GetPlatform() != PlatformEnsemble || len(tc.GetInstanceGroup()) != 0 || len(tc.GetEnsembleScheduling().GetStep()) != 3 {
		t.Fatalf("TritonConfig = %v", tc)
	}
	if v := tc.GetEnsembleScheduling().GetStep()[0].GetModelVersion(); v != -1 {
		t.Errorf("default version answered as %d, want -1", v)
	}
	text, err := prototext.Marshal(tc)
	if err != nil {
		t.Fatal(err)
	}
	back, err := ParseTritonModel("answered", text)
	if err != nil {
		t.Fatalf("answered config does not parse: %v\n%s", err, text)
	}
	if !reflect.DeepEqual(back.Ensemble, m.Ensemble) || !reflect.DeepEqual(back.Inputs, m.Inputs) || !reflect.DeepEqual(back.Outputs, m.Outputs) {
		t.Errorf("round trip: %+v, want %+v", back.Ensemble, m.Ensemble)
	}
}

func TestTritonEnsembleBad(t *testing.T) {
	const io = `platform: "ensemble"
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 2 ] } ]
`
	step := func(model, in, inT, out, outT string) string {
		return `{ model_name: "` + model + `" input_map { key: "` + in + `" value: "` + inT + `" } output_map { key: "` + out + `" value: "` + outT + `" } }`
	}
	steps := func(s ...string) string { return "ensemble_scheduling { step [ " + strings.Join(s, ", ") + " ] }\n" }
	for _, tt := range []struct {
		name, cfg string
		want      []string
	}{
		{"consumed not produced", io + steps(step("a", "x", "IN", "y", "t1"), step("b", "x", "t9", "y", "OUT")),
			[]string{`ensemble_scheduling.step[1].input_map: ensemble tensor "t9" (for input "x" of model "b") is not an ensemble input and no step produces it`}},
		{"output not produced", io + steps(step("a", "x", "IN", "y", "t1")),
			[]string{`output[0]: ensemble output "OUT" is produced by no step`}},
		{"cycle", io + steps(step("a", "x", "IN", "y", "OUT"), step("b", "x", "t2", "y", "t1"), step("c", "x", "t1", "y", "t2")),
			[]string{`ensemble_scheduling.step: the steps form a cycle: each of step[1] (b), step[2] (c) waits for a tensor another of them produces`}},
		{"self loop", io + steps(step("a", "x", "IN", "y", "OUT"), step("b", "x", "t1", "y", "t1")),
			[]string{`the steps form a cycle: each of step[1] (b)`}},
		{"produced twice", io + steps(step("a", "x", "IN", "y", "OUT"), step("b", "x", "IN", "y", "OUT")),
			[]string{`ensemble_scheduling.step[1].output_map: ensemble tensor "OUT" is produced twice (also by step[0], model "a")`}},
		{"produces an input", io + steps(step("a", "x", "IN", "y", "OUT"), step("b", "x", "OUT", "y", "IN")),
			[]string{`ensemble tensor "IN" is an ensemble input; a step cannot produce it too`}},
		{"no steps", io + "ensemble_scheduling { }\n", []string{"ensemble_scheduling.step: an ensemble needs at least one step"}},
		{"no step model", io + steps(step("", "x", "IN", "y", "OUT")), []string{"ensemble_scheduling.step[0].model_name: required"}},
		{"bad version", io + `ensemble_scheduling { step [ { model_name: "a" model_version: -3 input_map { key: "x" value: "IN" } output_map { key: "y" value: "OUT" } } ] }`,
			[]string{"ensemble_scheduling.step[0].model_version: must be -1"}},
		{"no input map", io + `ensemble_scheduling { step [ { model_name: "a" output_map { key: "y" value: "OUT" } } ] }`,
			[]string{"ensemble_scheduling.step[0].input_map: required"}},
		{"no output map", io + `ensemble_scheduling { step [ { model_name: "a" input_map { key: "x" value: "IN" } } ] }`,
			[]string{"ensemble_scheduling.step[0].output_map: required"}},
		{"no scheduling", io, []string{`ensemble_scheduling: required with platform "ensemble"`}},
		{"scheduling on onnx", strings.Replace(io, `"ensemble"`, `"onnxruntime_onnx"`, 1) + steps(step("a", "x", "IN", "y", "OUT")),
			[]string{`platform: must be "ensemble" for a config with ensemble_scheduling, got "onnxruntime_onnx"`}},
		{"instance group", io + "instance_group [ { kind: KIND_CPU } ]\n" + steps(step("a", "x", "IN", "y", "OUT")),
			[]string{"instance_group: not allowed in an ensemble"}},
		{"no inputs", "platform: \"ensemble\"\noutput [ { name: \"OUT\", data_type: TYPE_FP32, dims: [ 2 ] } ]\n" + steps(step("a", "x", "t", "y", "OUT")),
			[]string{"input: an ensemble needs at least one input"}},
		{"bad tensor", strings.Replace(io, "dims: [ 2 ] } ]\noutput", "dims: [ 0 ] } ]\noutput", 1) + steps(step("a", "x", "IN", "y", "OUT")),
			[]string{"input[0].shape[0]: must be -1 (dynamic) or >= 1, got 0"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseTritonModel("e/config.pbtxt", []byte("name: \"e\"\n"+tt.cfg))
			if err == nil {
				t.Fatal("parsed")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\nlacks %q", err, w)
				}
			}
			if !strings.HasPrefix(err.Error(), "e/config.pbtxt: ") {
				t.Errorf("error %q does not name the file", err)
			}
		})
	}
}

func TestTritonEnsembleFolder(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pipe")
	if err := os.MkdirAll(filepath.Join(dir, "3"), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := strings.Replace(ensembleGood, `name: "pipe"`, "", 1) + "parameters { key: \"slo.latency_ms\" value: { string_value: \"5\" } }\n"
	if err := os.WriteFile(filepath.Join(dir, "config.pbtxt"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	m, err := LoadModel(dir)
	if err != nil {
		t.Fatal(err)
	}
	if m.Name != "pipe" || m.Ensemble == nil {
		t.Fatalf("name %q ensemble %v", m.Name, m.Ensemble)
	}
	if len(m.Warnings) != 1 || !strings.Contains(m.Warnings[0], "parameters: ignored on an ensemble") {
		t.Errorf("warnings %q", m.Warnings)
	}
	vs, err := EnsembleVersions(dir)
	if err != nil || !slices.Equal(vs, []int64{3}) {
		t.Errorf("EnsembleVersions = %v, %v; want [3]", vs, err)
	}
	if err := os.Remove(filepath.Join(dir, "3")); err != nil {
		t.Fatal(err)
	}
	if vs, err := EnsembleVersions(dir); err != nil || !slices.Equal(vs, []int64{1}) {
		t.Errorf("without a version folder: %v, %v; want [1]", vs, err)
	}
}
