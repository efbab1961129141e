package models

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// fanOut is an ensemble of two sum models side by side on one input; its
// name sorts before theirs, so a pass in name order would load it first.
const fanOut = `name: "%s"
platform: "ensemble"
max_batch_size: 4
input [ { name: "IN", data_type: %s, dims: [ 4 ] } ]
output [ { name: "A", data_type: TYPE_FP32, dims: [ ] }, { name: "B", data_type: TYPE_FP32, dims: [ ] } ]
ensemble_scheduling { step [
  { model_name: "sum_a" input_map { key: "x" value: "IN" } output_map { key: "y" value: "A" } },
  { model_name: "sum_b" model_version: 1 input_map { key: "x" value: "IN" } output_map { key: "y" value: "B" } }
] }
`

func writeEnsemble(t *testing.T, repo, name, pbtxt string) {
	t.Helper()
	dir := filepath.Join(repo, name)
	if err := os.MkdirAll(filepath.Join(dir, "1"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, configs.ModelConfigPbtxt), []byte(pbtxt), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestEnsembleServes(t *testing.T) {
	repo := t.TempDir()
	r, _, _ := newTestRegistry(t, ControlPoll, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	// All three appear in one pass: the ensemble loads after its steps.
	writeEnsemble(t, repo, "ens", fmt.Sprintf(fanOut, "ens", "TYPE_FP32"))
	writeModel(t, repo, "sum_a", fmt.Sprintf(sumConfig, "sum_a", 1, 1), 1)
	writeModel(t, repo, "sum_b", fmt.Sprintf(sumConfig, "sum_b", 1, 1), 1)
	r.pollOnce(t.Context())

	if ready, err := r.ModelReady("ens", ""); err != nil || !ready {
		t.Fatalf("ensemble ready = %v, %v; index %+v", ready, err, r.IndexKnown(false))
	}
	req := sumRequest([4]float32{1, 2, 3, 4}, [4]float32{10, 20, 30, 40})
	req.Inputs[0].Name = "IN"
	resp, label, err := r.Infer(t.Context(), "ens", "", req)
	if err != nil {
		t.Fatal(err)
	}
	if label != "1" || len(resp.Outputs) != 2 || resp.Outputs[0].Name != "A" || resp.Outputs[1].Name != "B" {
		t.Fatalf("label %q outputs %+v", label, resp.Outputs)
	}
	for _, o := range resp.Outputs {
		if got := floats(o.Data); !slices.Equal(got, []float32{10, 100}) || !slices.Equal(o.Shape, []int64{2}) {
			t.Errorf("%s = %v shape %v, want [10 100] shape [2]", o.Name, got, o.Shape)
		}
	}
	// Requested outputs only, in the order asked.
	req.Outputs = []string{"B"}
	if resp, _, err := r.Infer(t.Context(), "ens", "1", req); err != nil || len(resp.Outputs) != 1 || resp.Outputs[0].Name != "B" {
		t.Errorf("asking for B: %+v, %v", resp, err)
	}
	// Each step went through its own model's scheduler.
	for _, name := range []string{"sum_a", "sum_b", "ens"} {
		st, err := r.Statistics(name, "")
		if err != nil || len(st) != 1 || st[0].InferenceCount != 4 {
			t.Errorf("%s statistics %+v, %v; want 4 inferences (two requests of two rows)", name, st, err)
		}
	}
	md, err := r.Metadata("ens", "")
	if err != nil || md.Platform != "ensemble" || len(md.Inputs) != 1 || fmt.Sprint(md.Inputs[0].Shape) != "[-1 4]" || len(md.Outputs) != 2 {
		t.Errorf("metadata %+v, %v", md, err)
	}
	if cfg, err := r.ModelConfig("ens", ""); err != nil || cfg.Ensemble == nil || len(cfg.Ensemble.Steps) != 2 {
		t.Errorf("config %+v, %v", cfg, err)
	}
	if _, _, err := r.Infer(t.Context(), "ens", "2", req); !errors.Is(err, ErrVersionNotFound) {
		t.Errorf("version 2: %v", err)
	}
	bad := sumRequest([4]float32{1, 2, 3, 4})
	bad.Inputs[0].Name = "x"
	if _, _, err := r.Infer(t.Context(), "ens", "", bad); !errors.Is(err, ErrInvalidInput) || !strings.Contains(err.Error(), `unknown input "x" for model ens`) {
		t.Errorf("a step model's input name: %v", err)
	}

	// A step model unloaded: the ensemble is not ready and says why; a
	// request fails naming the step.
	if err := r.unload(t.Context(), "sum_b", "unloaded", true); err != nil {
		t.Fatal(err)
	}
	if ready, err := r.ModelReady("ens", ""); err != nil || ready {
		t.Errorf("ensemble ready = %v, %v with a step model unloaded", ready, err)
	}
	i := slices.IndexFunc(r.IndexKnown(false), func(e IndexEntry) bool { return e.Name == "ens" })
	if e := r.IndexKnown(false)[i]; e.State != StateUnavailable || !strings.Contains(e.Reason, "step 1 (model sum_b)") {
		t.Errorf("index entry %+v", e)
	}
	req.Outputs = nil
	_, _, err = r.Infer(t.Context(), "ens", "", req)
	if !errors.Is(err, ErrNotReady) || !strings.Contains(err.Error(), "ensemble ens step 1 (model sum_b)") {
		t.Errorf("with a step unloaded: %v", err)
	}
	if st, _ := r.Statistics("ens", ""); st[0].Fail.Count != 2 { // the invalid request and this one
		t.Errorf("ensemble failures %+v, want 2", st[0].Fail)
	}

	// Unloading the ensemble takes it out of service; its steps stay.
	if err := r.unload(t.Context(), "ens", "unloaded", true); err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.Infer(t.Context(), "ens", "", req); !errors.Is(err, ErrNotReady) {
		t.Errorf("unloaded ensemble: %v", err)
	}
	if _, _, err := r.Infer(t.Context(), "sum_a", "", sumRequest([4]float32{1, 1, 1, 1})); err != nil {
		t.Errorf("step model after the ensemble's unload: %v", err)
	}
}

func TestEnsembleLoadErrors(t *testing.T) {
	for _, tt := range []struct {
		name, pbtxt string
		want        string
	}{
		{"missing step model", strings.Replace(fmt.Sprintf(fanOut, "ens", "TYPE_FP32"), `"sum_b"`, `"nope"`, 1),
			`ensemble_scheduling.step[1] (model nope): the step model must be loaded first: Request for unknown model: 'nope' is not found`},
		{"missing step version", strings.Replace(fmt.Sprintf(fanOut, "ens", "TYPE_FP32"), "model_version: 1", "model_version: 7", 1),
			`ensemble_scheduling.step[1] (model sum_b): the step model must be loaded first: Request for unknown model: 'sum_b' version 7 is not found`},
		{"datatype", fmt.Sprintf(fanOut, "ens", "TYPE_INT32"),
			`ensemble_scheduling.step[0] (model sum_a): input "x" takes ensemble tensor "IN", which is INT32 [-1 4]; the model expects FP32 [-1 4]`},
		{"shape", strings.Replace(fmt.Sprintf(fanOut, "ens", "TYPE_FP32"), "dims: [ 4 ]", "dims: [ 5 ]", 1),
			`input "x" takes ensemble tensor "IN", which is FP32 [-1 5]; the model expects FP32 [-1 4]`},
		{"output shape", strings.Replace(fmt.Sprintf(fanOut, "ens", "TYPE_FP32"), `name: "A", data_type: TYPE_FP32, dims: [ ]`, `name: "A", data_type: TYPE_FP32, dims: [ 2 ]`, 1),
			`output "A": the ensemble declares FP32 [-1 2], step[0] (model sum_a) produces FP32 [-1]`},
		{"unknown step input", strings.Replace(fmt.Sprintf(fanOut, "ens", "TYPE_FP32"), `key: "x" value: "IN" } output_map { key: "y" value: "A"`, `key: "z" value: "IN" } output_map { key: "y" value: "A"`, 1),
			`input_map names input "z", which the model does not have (it has "x")`},
		{"unknown step output", strings.Replace(fmt.Sprintf(fanOut, "ens", "TYPE_FP32"), `key: "y" value: "A"`, `key: "w" value: "A"`, 1),
			`output_map names output "w", which the model does not have (it has "y")`},
		{"batch too large", strings.Replace(fmt.Sprintf(fanOut, "ens", "TYPE_FP32"), "max_batch_size: 4", "max_batch_size: 8", 1),
			`the ensemble's max_batch_size 8 is larger than the model's 4`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			repo := t.TempDir()
			writeModel(t, repo, "sum_a", fmt.Sprintf(sumConfig, "sum_a", 1, 1), 1)
			writeModel(t, repo, "sum_b", fmt.Sprintf(sumConfig, "sum_b", 1, 1), 1)
			writeEnsemble(t, repo, "ens", tt.pbtxt)
			r, _, _ := newTestRegistry(t, ControlExplicit, repo)
			if err := r.Start(t.Context()); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { r.Stop(context.Background()) })
			for _, m := range []string{"sum_a", "sum_b"} {
				if err := r.Load(t.Context(), m); err != nil {
					t.Fatal(err)
				}
			}
			err := r.Load(t.Context(), "ens")
			if !errors.Is(err, ErrBadConfig) || !strings.Contains(err.Error(), tt.want) || !strings.HasPrefix(err.Error(), "failed to load 'ens'") {
				t.Fatalf("load: %v\nwant it to contain %q", err, tt.want)
			}
			i := slices.IndexFunc(r.IndexKnown(false), func(e IndexEntry) bool { return e.Name == "ens" })
			if e := r.IndexKnown(false)[i]; e.State != StateUnavailable || !strings.Contains(e.Reason, tt.want) {
				t.Errorf("index entry %+v", e)
			}
		})
	}
}

// sloserve check reads an ensemble's folder, which holds no model file.
func TestEnsembleCheckFolder(t *testing.T) {
	repo := t.TempDir()
	writeEnsemble(t, repo, "ens", fmt.Sprintf(fanOut, "ens", "TYPE_FP32"))
	cfg, versions, err := CheckFolder(filepath.Join(repo, "ens"), CheckOptions{MaxTensorElements: 1 << 20})
	if err != nil || cfg.Ensemble == nil || !slices.Equal(versions, []int64{1}) {
		t.Errorf("CheckFolder = %v, %v, %v", cfg, versions, err)
	}
}

// Every step carries the request's deadline: one that has passed refuses
// the first step, named, and the ensemble counts a failure.
func TestEnsembleDeadlineCoversSteps(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum_a", fmt.Sprintf(sumConfig, "sum_a", 1, 1), 1)
	writeModel(t, repo, "sum_b", fmt.Sprintf(sumConfig, "sum_b", 1, 1), 1)
	writeEnsemble(t, repo, "ens", fmt.Sprintf(fanOut, "ens", "TYPE_FP32"))
	r, _, _ := newTestRegistry(t, ControlNone, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	req := sumRequest([4]float32{1, 2, 3, 4})
	req.Inputs[0].Name = "IN"
	if _, _, err := r.Infer(t.Context(), "ens", "", req); err != nil {
		t.Fatalf("without a deadline: %v", err)
	}
	req.Deadline = time.Now().Add(-time.Millisecond)
	_, _, err := r.Infer(t.Context(), "ens", "", req)
	if err == nil || !strings.Contains(err.Error(), "ensemble ens step ") {
		t.Fatalf("with a deadline passed: %v", err)
	}
	if !errors.Is(err, qos.ErrRejected) && !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("with a deadline passed: %v, want a rejection or a deadline error", err)
	}
}

// At start an ensemble loads once the models it runs have, however slow
// their instances are to start.
func TestEnsembleLoadsAfterItsSteps(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum_a", fmt.Sprintf(sumConfig, "sum_a", 1, 1), 1)
	writeModel(t, repo, "sum_b", fmt.Sprintf(sumConfig, "sum_b", 1, 1), 1)
	writeEnsemble(t, repo, "ens", fmt.Sprintf(fanOut, "ens", "TYPE_FP32"))
	r, f, _ := newTestRegistry(t, ControlNone, repo)
	f.onStart = func(InstanceSpec) { time.Sleep(50 * time.Millisecond) }
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	if ready, err := r.ModelReady("ens", ""); err != nil || !ready {
		t.Errorf("ensemble ready after Start = %v, %v; index %+v", ready, err, r.IndexKnown(false))
	}
}

// In poll mode an ensemble that failed for want of a step model loads
// once a later pass brings the model, without its own folder changing.
func TestEnsembleRetriedWhenStepsArrive(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum_a", fmt.Sprintf(sumConfig, "sum_a", 1, 1), 1)
	writeEnsemble(t, repo, "ens", fmt.Sprintf(fanOut, "ens", "TYPE_FP32"))
	r, _, _ := newTestRegistry(t, ControlPoll, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	if ready, _ := r.ModelReady("ens", ""); ready {
		t.Fatal("ensemble ready without sum_b")
	}
	writeModel(t, repo, "sum_b", fmt.Sprintf(sumConfig, "sum_b", 1, 1), 1)
	r.pollOnce(t.Context())
	if ready, err := r.ModelReady("ens", ""); err != nil || !ready {
		t.Errorf("ensemble ready = %v, %v once sum_b is there; index %+v", ready, err, r.IndexKnown(false))
	}
	r.pollOnce(t.Context()) // nothing changed: nothing loads again
}

// TestEnsembleRecheckedWhenAStepReloads: a step model reloaded with
// tensors the ensemble cannot pass it takes the ensemble out of service,
// saying which step no longer fits, instead of failing each request
// inside that step; the step model reloaded as it was restores it.
func TestEnsembleRecheckedWhenAStepReloads(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum_a", fmt.Sprintf(sumConfig, "sum_a", 1, 1), 1)
	writeModel(t, repo, "sum_b", fmt.Sprintf(sumConfig, "sum_b", 1, 1), 1)
	writeEnsemble(t, repo, "ens", fmt.Sprintf(fanOut, "ens", "TYPE_FP32"))
	r, f, _ := newTestRegistry(t, ControlPoll, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	req := sumRequest([4]float32{1, 2, 3, 4})
	req.Inputs[0].Name = "IN"
	if _, _, err := r.Infer(t.Context(), "ens", "", req); err != nil {
		t.Fatal(err)
	}
	entry := func() IndexEntry {
		idx := r.IndexKnown(false)
		return idx[slices.IndexFunc(idx, func(e IndexEntry) bool { return e.Name == "ens" })]
	}

	// sum_b's file now takes FP64: its config changes, so the poll reloads it.
	f.mu.Lock()
	f.inputs = map[string][]runtime.TensorSpec{"sum_b": {{Name: "x", DataType: runtime.FP64, Shape: []int64{-1, 4}}}}
	f.mu.Unlock()
	writeModel(t, repo, "sum_b", fmt.Sprintf(sumConfig, "sum_b", 2, 1), 1)
	r.pollOnce(t.Context())
	if ready, _ := r.ModelReady("sum_b", ""); !ready {
		t.Fatalf("sum_b not ready after its reload; index %+v", r.IndexKnown(false))
	}
	if ready, err := r.ModelReady("ens", ""); err != nil || ready {
		t.Errorf("ensemble ready = %v, %v with a step that takes FP64 where it passes FP32", ready, err)
	}
	const why = `step[1] (model sum_b): input "x" takes ensemble tensor "IN", which is FP32`
	if e := entry(); e.State != StateUnavailable || !strings.Contains(e.Reason, why) {
		t.Errorf("index entry %+v, want UNAVAILABLE naming %q", e, why)
	}
	if _, _, err := r.Infer(t.Context(), "ens", "", req); !errors.Is(err, ErrNotReady) || !strings.Contains(err.Error(), why) {
		t.Errorf("a request with the step changed: %v, want not ready naming %q", err, why)
	}
	if n := f.of("sum_a", 1)[0].calls.Load(); n != 1 {
		t.Errorf("sum_a ran %d times, want 1: a request the ensemble cannot serve starts no step", n)
	}

	// sum_b as it was: the ensemble serves again.
	f.mu.Lock()
	f.inputs = nil
	f.mu.Unlock()
	writeModel(t, repo, "sum_b", fmt.Sprintf(sumConfig, "sum_b", 1, 1), 1)
	r.pollOnce(t.Context())
	if ready, err := r.ModelReady("ens", ""); err != nil || !ready {
		t.Errorf("ensemble ready = %v, %v with sum_b as it was; index %+v", ready, err, entry())
	}
	if _, _, err := r.Infer(t.Context(), "ens", "", req); err != nil {
		t.Errorf("after sum_b's second reload: %v", err)
	}
}

// TestEnsembleVersionFolderReloads: an ensemble's versions are empty
// numbered folders, so a new one is seen by the poll and served; an empty
// numbered folder beside an ordinary model (a version being staged, its
// model file not yet there) reloads nothing.
func TestEnsembleVersionFolderReloads(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum_a", fmt.Sprintf(sumConfig, "sum_a", 1, 1), 1)
	writeModel(t, repo, "sum_b", fmt.Sprintf(sumConfig, "sum_b", 1, 1), 1)
	writeEnsemble(t, repo, "ens", fmt.Sprintf(fanOut, "ens", "TYPE_FP32"))
	r, _, preg := newTestRegistry(t, ControlPoll, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	req := sumRequest([4]float32{1, 2, 3, 4})
	req.Inputs[0].Name = "IN"
	if _, label, err := r.Infer(t.Context(), "ens", "", req); err != nil || label != "1" {
		t.Fatalf("version %q, %v; want 1", label, err)
	}
	for _, dir := range []string{"ens/2", "sum_a/2"} {
		if err := os.MkdirAll(filepath.Join(repo, dir), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	r.pollOnce(t.Context())
	if _, label, err := r.Infer(t.Context(), "ens", "", req); err != nil || label != "2" {
		t.Errorf("after folder ens/2 appeared: version %q, %v; want 2", label, err)
	}
	loads := series(t, preg)
	if n := loads[`sloserve_model_loads_total{model="sum_a"}`]; n != 1 {
		t.Errorf("sum_a loaded %v times, want 1: an empty version folder is no version", n)
	}
	if n := loads[`sloserve_model_loads_total{model="ens"}`]; n != 2 {
		t.Errorf("ens loaded %v times, want 2", n)
	}
	r.pollOnce(t.Context()) // nothing changed: nothing loads again
	if n := series(t, preg)[`sloserve_model_loads_total{model="ens"}`]; n != 2 {
		t.Errorf("ens loaded %v times after a poll with no change, want 2", n)
	}
}
