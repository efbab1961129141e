package configs

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"google.golang.org/protobuf/encoding/prototext"

	"github.com/sloserve/sloserve/configs/tritonpb"
)

// Triton ensembles: a config.pbtxt with platform "ensemble" and
// ensemble_scheduling names no model file; an inference runs its steps,
// each one a request to another model, passing tensors between them by
// name. This file reads and checks what a config alone can tell (every
// tensor consumed is produced exactly once, no cycle, every output
// produced); the registry checks the step models themselves when it loads
// the ensemble, since only it knows them.

// PlatformEnsemble is the platform of an ensemble (Triton's name).
const PlatformEnsemble = "ensemble"

// Ensemble is the pipeline of an ensemble model.
type Ensemble struct {
	// Steps in the config's order.
	Steps []EnsembleStep
	// Order is Steps' indexes in an order where every step comes after
	// the steps producing its inputs.
	Order []int
}

// EnsembleStep runs one model on ensemble tensors.
type EnsembleStep struct {
	Model string
	// Version is the step model's version; "" is its default version.
	Version string
	// Inputs maps each input of the step model to the ensemble tensor it
	// is given; Outputs maps outputs of the step model to the ensemble
	// tensors they become (outputs not listed are not kept).
	Inputs  map[string]string
	Outputs map[string]string
}

// Producers maps every ensemble tensor a step produces to that step's index.
func (e *Ensemble) Producers() map[string]int {
	out := map[string]int{}
	for i, s := range e.Steps {
		for _, t := range s.Outputs {
			out[t] = i
		}
	}
	return out
}

// isTritonEnsemble reports whether a Triton config describes an ensemble.
func isTritonEnsemble(tc *tritonpb.ModelConfig) bool {
	return tc.GetPlatform() == PlatformEnsemble || tc.GetEnsembleScheduling() != nil
}

// mapTritonEnsemble maps a Triton ensemble config onto a validated Model.
// Only the fields that describe an ensemble may be set: its name, version
// policy, max_batch_size, inputs, outputs and steps. An ensemble has no
// instances, batching or SLO of its own; each step is scheduled as its
// model is.
func mapTritonEnsemble(tc *tritonpb.ModelConfig, file, dir string) (*Model, error) {
	m := defaultModel()
	m.File, m.Dir = file, dir
	m.Platform = PlatformEnsemble
	m.Execution.CUDA = nil
	t := tritonReader{file: file}
	m.Name = tc.GetName()
	if m.Name == "" && dir != "" {
		m.Name = folderName(dir)
	}
	switch {
	case tc.GetPlatform() != PlatformEnsemble:
		t.fail("platform", "must be %q for a config with ensemble_scheduling, got %q", PlatformEnsemble, tc.GetPlatform())
	case tc.GetEnsembleScheduling() == nil:
		t.fail("ensemble_scheduling", "required with platform %q", PlatformEnsemble)
	}
	if b := tc.GetBackend(); b != "" {
		t.fail("backend", "must be empty for an ensemble, got %q", b)
	}
	t.readVersionPolicy(tc.GetVersionPolicy(), &m)
	if mb := tc.GetMaxBatchSize(); mb < 0 {
		t.fail("max_batch_size", "must be >= 0, got %d", mb)
	} else {
		m.MaxBatchSize = int(mb)
	}
	for i, in := range tc.GetInput() {
		path := fmt.Sprintf("input[%d]", i)
		m.Inputs = append(m.Inputs, t.tensor(path, in.GetName(), in.GetDataType(), in.GetDims(), m.MaxBatchSize))
		if in.GetReshape() != nil || in.GetIsShapeTensor() || in.GetAllowRaggedBatch() || in.GetOptional() {
			t.fail(path, "reshape, is_shape_tensor, allow_ragged_batch and optional are not supported on an ensemble's tensors")
		}
	}
	for i, out := range tc.GetOutput() {
		path := fmt.Sprintf("output[%d]", i)
		m.Outputs = append(m.Outputs, t.tensor(path, out.GetName(), out.GetDataType(), out.GetDims(), m.MaxBatchSize))
		if out.GetReshape() != nil || out.GetIsShapeTensor() {
			t.fail(path, "reshape and is_shape_tensor are not supported on an ensemble's tensors")
		}
	}
	if len(m.Inputs) == 0 {
		t.fail("input", "an ensemble needs at least one input")
	}
	if len(m.Outputs) == 0 {
		t.fail("output", "an ensemble needs at least one output")
	}
	// What an ensemble cannot have: it runs no model file of its own.
	for field, set := range map[string]bool{
		"instance_group":                     len(tc.GetInstanceGroup()) > 0,
		"model_warmup":                       len(tc.GetModelWarmup()) > 0,
		"optimization":                       tc.GetOptimization() != nil,
		"default_model_filename":             tc.GetDefaultModelFilename() != "",
		"cc_model_filenames":                 len(tc.GetCcModelFilenames()) > 0,
		"model_operations":                   len(tc.GetModelOperations().GetOpLibraryFilename()) > 0,
		"model_transaction_policy.decoupled": tc.GetModelTransactionPolicy().GetDecoupled(),
		"runtime":                            tc.GetRuntime() != "",
	} {
		if set {
			t.fail(field, "not allowed in an ensemble: it runs no model of its own (set it on the step models)")
		}
	}
	if len(tc.GetParameters()) > 0 {
		t.warn("parameters", "ignored on an ensemble: each step is scheduled under its own model's SLO and settings")
	}
	if len(tc.GetMetricTags()) > 0 {
		t.warn("metric_tags", "ignored: metrics are labelled by model and version only")
	}
	if tc.GetResponseCache().GetEnable() {
		t.warn("response_cache.enable", "ignored: sloserve has no response cache; every request is executed")
	}
	m.Ensemble = t.readEnsemble(tc.GetEnsembleScheduling())

	var p problems
	switch {
	case m.Name == "":
		p.add("name", "required")
	case !modelNameRE.MatchString(m.Name):
		p.add("name", "must start with a letter or digit and hold only letters, digits, '.', '_' and '-'; got %q", m.Name)
	case dir != "" && m.Name != folderName(dir):
		p.add("name", "must equal the folder name %q, got %q", folderName(dir), m.Name)
	}
	m.VersionPolicy.validate(&p)
	validateTensors(&p, "input", m.Inputs, m.MaxBatchSize)
	validateTensors(&p, "output", m.Outputs, m.MaxBatchSize)
	if len(t.errs) == 0 && len(p) == 0 && m.Ensemble != nil {
		m.Ensemble.Order = validateEnsemble(&p, &m)
	}
	t.errs = append(t.errs, p...)
	if len(t.errs) > 0 {
		for _, e := range t.errs {
			e.File = file
		}
		return nil, t.errs.join()
	}
	m.Warnings = t.warnings
	return &m, nil
}

// readEnsemble reads the steps; nil without ensemble_scheduling.
func (t *tritonReader) readEnsemble(es *tritonpb.ModelEnsembling) *Ensemble {
	if es == nil {
		return nil
	}
	e := &Ensemble{}
	if len(es.GetStep()) == 0 {
		t.fail("ensemble_scheduling.step", "an ensemble needs at least one step")
	}
	if es.GetMaxInflightResponses() != 0 {
		t.warn("ensemble_scheduling.max_inflight_responses", "ignored: a step gives exactly one response")
	}
	for i, s := range es.GetStep() {
		path := fmt.Sprintf("ensemble_scheduling.step[%d]", i)
		st := EnsembleStep{Model: s.GetModelName(), Inputs: maps.Clone(s.GetInputMap()), Outputs: maps.Clone(s.GetOutputMap())}
		switch v := s.GetModelVersion(); {
		case st.Model == "":
			t.fail(path+".model_name", "required")
		case !modelNameRE.MatchString(st.Model):
			t.fail(path+".model_name", "not a model name: %q", st.Model)
		case v < -1:
			t.fail(path+".model_version", "must be -1 (the model's default version) or a version, got %d", v)
		case v > 0:
			st.Version = strconv.FormatInt(v, 10)
		}
		if s.GetModelNamespace() != "" {
			t.fail(path+".model_namespace", "reserved by Triton, must be empty")
		}
		if len(st.Inputs) == 0 {
			t.fail(path+".input_map", "required: every input of model %q takes an ensemble tensor", st.Model)
		}
		if len(st.Outputs) == 0 {
			t.fail(path+".output_map", "required: a step whose outputs no one takes does nothing")
		}
		for k, v := range st.Inputs {
			if k == "" || v == "" {
				t.fail(path+".input_map", "empty tensor name in %q: %q", k, v)
			}
		}
		for k, v := range st.Outputs {
			if k == "" || v == "" {
				t.fail(path+".output_map", "empty tensor name in %q: %q", k, v)
			}
		}
		e.Steps = append(e.Steps, st)
	}
	return e
}

// validateEnsemble checks the flow of tensors through the steps and
// returns an order to run them in: every ensemble tensor has one
// producer (an ensemble input or one step's output), every tensor a step
// takes is produced, every ensemble output is produced by a step, and no
// step depends on itself through others.
func validateEnsemble(p *problems, m *Model) []int {
	e := m.Ensemble
	producer := map[string]int{} // tensor -> step index, -1 for an ensemble input
	for _, in := range m.Inputs {
		producer[in.Name] = -1
	}
	for i, s := range e.Steps {
		path := fmt.Sprintf("ensemble_scheduling.step[%d].output_map", i)
		for _, out := range slices.Sorted(maps.Keys(s.Outputs)) {
			tensor := s.Outputs[out]
			switch j, dup := producer[tensor]; {
			case dup && j < 0:
				p.add(path, "ensemble tensor %q is an ensemble input; a step cannot produce it too", tensor)
			case dup:
				p.add(path, "ensemble tensor %q is produced twice (also by step[%d], model %q)", tensor, j, e.Steps[j].Model)
			default:
				producer[tensor] = i
			}
		}
	}
	for i, s := range e.Steps {
		path := fmt.Sprintf("ensemble_scheduling.step[%d].input_map", i)
		for _, in := range slices.Sorted(maps.Keys(s.Inputs)) {
			if _, ok := producer[s.Inputs[in]]; !ok {
				p.add(path, "ensemble tensor %q (for input %q of model %q) is not an ensemble input and no step produces it", s.Inputs[in], in, s.Model)
			}
		}
	}
	for i, out := range m.Outputs {
		switch j, ok := producer[out.Name]; {
		case !ok:
			p.add(fmt.Sprintf("output[%d]", i), "ensemble output %q is produced by no step", out.Name)
		case j < 0:
			p.add(fmt.Sprintf("output[%d]", i), "ensemble output %q is an ensemble input; a step must produce it", out.Name)
		}
	}
	if len(*p) > 0 {
		return nil
	}
	// Kahn's algorithm over the steps; what is left over is in a cycle.
	deps := make([]map[int]bool, len(e.Steps))
	for i, s := range e.Steps {
		deps[i] = map[int]bool{}
		for _, tensor := range s.Inputs {
			if j := producer[tensor]; j >= 0 {
				deps[i][j] = true
			}
		}
	}
	var order []int
	done := make([]bool, len(e.Steps))
	for len(order) < len(e.Steps) {
		progress := false
		for i := range e.Steps {
			if done[i] || slices.ContainsFunc(slices.Collect(maps.Keys(deps[i])), func(j int) bool { return !done[j] }) {
				continue
			}
			done[i], progress = true, true
			order = append(order, i)
		}
		if !progress {
			var cycle []string
			for i, d := range done {
				if !d {
					cycle = append(cycle, fmt.Sprintf("step[%d] (%s)", i, e.Steps[i].Model))
				}
			}
			p.add("ensemble_scheduling.step", "the steps form a cycle: each of %s waits for a tensor another of them produces", strings.Join(cycle, ", "))
			return nil
		}
	}
	return order
}

// EnsembleVersions are the versions of an ensemble's folder: its
// subfolders named by a positive integer, which hold no model file (a
// Triton ensemble's version folder is empty). A folder without one is
// served as version 1.
func EnsembleVersions(dir string) ([]int64, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var versions []int64
	for _, e := range entries {
		v, err := strconv.ParseInt(e.Name(), 10, 64)
		if err != nil || v < 1 || strconv.FormatInt(v, 10) != e.Name() || !e.IsDir() {
			continue
		}
		versions = append(versions, v)
	}
	if len(versions) == 0 {
		return []int64{1}, nil
	}
	slices.Sort(versions)
	return versions, nil
}

// tritonEnsembleConfig is an ensemble in Triton's ModelConfig shape.
func tritonEnsembleConfig(m *Model) *tritonpb.ModelConfig {
	tc := &tritonpb.ModelConfig{Name: m.Name, Platform: PlatformEnsemble, MaxBatchSize: int32(min(m.MaxBatchSize, 1<<31-1))}
	tc.VersionPolicy = tritonVersionPolicy(m.VersionPolicy)
	for _, in := range m.Inputs {
		tc.Input = append(tc.Input, &tritonpb.ModelInput{Name: in.Name, DataType: tritonDataType(in.DataType), Dims: tritonDims(in.Shape, m.MaxBatchSize)})
	}
	for _, out := range m.Outputs {
		tc.Output = append(tc.Output, &tritonpb.ModelOutput{Name: out.Name, DataType: tritonDataType(out.DataType), Dims: tritonDims(out.Shape, m.MaxBatchSize)})
	}
	es := &tritonpb.ModelEnsembling{}
	for _, s := range m.Ensemble.Steps {
		v := int64(-1)
		if s.Version != "" {
			v, _ = strconv.ParseInt(s.Version, 10, 64)
		}
		es.Step = append(es.Step, &tritonpb.ModelEnsembling_Step{ModelName: s.Model, ModelVersion: v, InputMap: maps.Clone(s.Inputs), OutputMap: maps.Clone(s.Outputs)})
	}
	tc.SchedulingChoice = &tritonpb.ModelConfig_EnsembleScheduling{EnsembleScheduling: es}
	return tc
}

// IsEnsembleFolder tells, cheaply, whether the model folder dir holds an
// ensemble: a config.pbtxt (and no config.yaml) that says so. A config
// that does not parse is not an ensemble here; its load reports it.
func IsEnsembleFolder(dir string) bool {
	for _, name := range []string{ModelConfigFile, ModelConfigFileAlt} {
		if _, err := os.Lstat(filepath.Join(dir, name)); err == nil {
			return false
		}
	}
	b, err := ReadFile(filepath.Join(dir, ModelConfigPbtxt))
	if err != nil {
		return false
	}
	var tc tritonpb.ModelConfig
	if prototext.Unmarshal(b, &tc) != nil {
		return false
	}
	return isTritonEnsemble(&tc)
}
