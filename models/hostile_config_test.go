package models

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// hostileConfig replaces a model folder's config.yaml with something a
// reader must refuse at once: reading it would block for ever or without
// bound.
var hostileConfigs = []struct {
	name string
	make func(t *testing.T, path string)
}{
	{"symlink to /dev/zero", func(t *testing.T, path string) {
		if err := os.Symlink("/dev/zero", path); err != nil {
			t.Fatal(err)
		}
	}},
	{"FIFO", func(t *testing.T, path string) {
		if err := syscall.Mkfifo(path, 0o644); err != nil {
			t.Fatal(err)
		}
	}},
	{"oversized", func(t *testing.T, path string) {
		data := "name: bad\n#" + strings.Repeat("x", configs.MaxConfigFile) + "\n"
		if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}},
}

func writeHostileModel(t *testing.T, repo string, make func(*testing.T, string)) string {
	t.Helper()
	writeModel(t, repo, "bad", "name: bad\n", 1)
	path := filepath.Join(repo, "bad", configs.ModelConfigFile)
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	make(t, path)
	return path
}

// inTime fails the test when f takes more than a few seconds.
func inTime(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s hung", what)
	}
}

// TestHostileConfigInPoll: a model folder whose config is a device, a FIFO
// or too large is refused by the poll loop at once, with a reason that
// names the file, and the other models still load.
func TestHostileConfigInPoll(t *testing.T) {
	for _, h := range hostileConfigs {
		t.Run(h.name, func(t *testing.T) {
			repo := t.TempDir()
			path := writeHostileModel(t, repo, h.make)
			r, _, _ := newTestRegistry(t, ControlPoll, repo)
			inTime(t, "start", func() {
				if err := r.Start(t.Context()); err != nil {
					t.Error(err)
				}
			})
			t.Cleanup(func() { r.Stop(t.Context()) })
			// A model added later is loaded by the next pass.
			writeModel(t, repo, "zz", fmt.Sprintf(sumConfig, "zz", 1, 1), 1)
			inTime(t, "poll", func() { r.pollOnce(t.Context()) })
			if ok, err := r.ModelReady("zz", ""); !ok {
				t.Errorf("a model next to the hostile one did not load: %v", err)
			}
			idx := r.Index(false)
			if len(idx) != 2 || idx[0].Name != "bad" || idx[0].State != StateUnavailable || !strings.Contains(idx[0].Reason, path) {
				t.Errorf("index = %+v, want bad UNAVAILABLE naming %s", idx, path)
			}
			// An unchanged hostile folder is not retried on every pass.
			failures := testutil.ToFloat64(r.metrics.loadFailures.WithLabelValues("bad"))
			inTime(t, "second poll", func() { r.pollOnce(t.Context()) })
			if got := testutil.ToFloat64(r.metrics.loadFailures.WithLabelValues("bad")); got != failures || failures != 1 {
				t.Errorf("load failures = %v then %v, want 1 then 1", failures, got)
			}
		})
	}
}

// TestHostileConfigInLoad: an explicit load of such a folder fails at once
// with ErrBadConfig naming the file, and an unload afterwards works.
func TestHostileConfigInLoad(t *testing.T) {
	for _, h := range hostileConfigs {
		t.Run(h.name, func(t *testing.T) {
			repo := t.TempDir()
			path := writeHostileModel(t, repo, h.make)
			r, _, _ := newTestRegistry(t, ControlExplicit, repo)
			if err := r.Start(t.Context()); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { r.Stop(t.Context()) })
			var err error
			inTime(t, "load", func() { err = r.Load(t.Context(), "bad") })
			if !errors.Is(err, ErrBadConfig) || !strings.Contains(err.Error(), path) {
				t.Errorf("Load = %v, want ErrBadConfig naming %s", err, path)
			}
			if !strings.HasPrefix(err.Error(), "failed to load 'bad': ") {
				t.Errorf("Load = %v, want Triton's words first", err)
			}
			inTime(t, "unload", func() { err = r.Unload(t.Context(), "bad") })
			if err != nil {
				t.Errorf("Unload = %v", err)
			}
		})
	}
}

// TestHostileShapesFailOneModel: a model config whose declared input
// shape or profile shape is over limits.max_tensor_elements fails that
// model alone, with a reason naming the field, before any runner starts
// or any sample request is built; the model beside it loads and serves.
// Without the check the declared shape [-1,3,1e8,1e8] panicked the server
// in the warm-up (makeslice), and the profile shape loaded as if it fit.
func TestHostileShapesFailOneModel(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
	writeModel(t, repo, "declared", `name: declared
max_batch_size: 4
inputs: [{name: x, datatype: FP32, shape: [-1, 3, 100000000, 100000000]}]
`, 1)
	writeModel(t, repo, "profiled", `name: profiled
max_batch_size: 4
profile: {shapes: {x: [1, 3, 1000, 1000]}}
`, 1)
	image := []runtime.TensorSpec{{Name: "x", DataType: runtime.FP32, Shape: []int64{-1, 3, -1, -1}}}
	f := &fakeFactory{fail: map[string]error{}, inputs: map[string][]runtime.TensorSpec{"declared": image, "profiled": image}}
	r, err := New(Options{
		Repositories: []string{repo}, Control: ControlNone, NewInstance: f.start,
		MaxTensorElements: 1 << 20, Estimator: qos.NewEWMAEstimator(0),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(t.Context()) })
	want := map[string]string{
		"declared": "inputs[0].shape: [-1 3 100000000 100000000] has more than limits.max_tensor_elements (1048576) elements at batch size 1",
		"profiled": "profile.shapes.x: [1 3 1000 1000] has more than limits.max_tensor_elements (1048576) elements at batch size 1",
	}
	for _, e := range r.Index(false) {
		switch e.Name {
		case "sum":
			if e.State != StateReady {
				t.Errorf("sum: %+v, want READY", e)
			}
		default:
			if e.State != StateUnavailable || !strings.Contains(e.Reason, want[e.Name]) || !strings.Contains(e.Reason, filepath.Join(repo, e.Name, "config.yaml")) {
				t.Errorf("%s: %+v, want UNAVAILABLE naming the file and %q", e.Name, e, want[e.Name])
			}
			if n := len(f.of(e.Name, 1)); n != 0 {
				t.Errorf("%s: %d instances started, want none", e.Name, n)
			}
		}
	}
	resp, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 2, 3, 4}))
	if err != nil || len(resp.Outputs) != 1 || math.Float32frombits(binary.LittleEndian.Uint32(resp.Outputs[0].Data)) != 10 {
		t.Fatalf("sum beside the bad models: %+v, %v; want 10", resp, err)
	}
}

// TestSamplesWithinElementLimit: warm-up and profiling requests are built
// only at the batch sizes whose request is within the element limit, and
// not at all when batch 1 is over it (a model file's own static shape).
func TestSamplesWithinElementLimit(t *testing.T) {
	cfg := &configs.Model{Profile: configs.ModelProfile{Shapes: configs.ProfileShapes{{"x": {1, 3, 10, 10}}}}}
	v := &version{cfg: cfg, maxBatch: 4, maxElements: 1000,
		inputs: []runtime.TensorSpec{{Name: "x", DataType: runtime.FP32, Shape: []int64{-1, 3, -1, -1}}}}
	sample, sizes := warmupRequests(v) // 300 elements a row: batch 4 is 1200
	if sample == nil || fmt.Sprint(sizes) != "[1]" {
		t.Fatalf("warm-up sizes = %v, want [1]", sizes)
	}
	if req := sample(1); len(req.Inputs[0].Data) != 300*4 {
		t.Errorf("sample at batch 1 has %d bytes, want 1200", len(req.Inputs[0].Data))
	}
	cfg.Profile.BatchSizes = []int{1, 2, 3, 4}
	if _, _, sizes := profileRequests(v); fmt.Sprint(sizes) != "[1 2 3]" {
		t.Errorf("profile sizes = %v, want [1 2 3]", sizes)
	}
	huge := &version{cfg: &configs.Model{}, maxBatch: 4, maxElements: 1000,
		inputs: []runtime.TensorSpec{{Name: "x", DataType: runtime.FP32, Shape: []int64{-1, 3, 100000000, 100000000}}}}
	if sample, _ := warmupRequests(huge); sample != nil {
		t.Error("a sample is built for a static shape over the limit")
	}
}

// TestVersionLimit: a version policy that would serve more than
// configs.MaxVersions versions, or more runners than
// configs.MaxRunnersPerModel, fails that model before any instance
// starts, naming the field; others load.
func TestVersionLimit(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
	many := make([]int, 30)
	for i := range many {
		many[i] = i + 1
	}
	writeModel(t, repo, "all", "name: all\nmax_batch_size: 4\nversion_policy: {all: {}}\n", many...)
	writeModel(t, repo, "wide", fmt.Sprintf(sumConfig, "wide", 8, 9), many[:9]...)
	r, f, _ := newTestRegistry(t, ControlNone, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(t.Context()) })
	want := map[string]string{
		"all":  "version_policy: selects 30 versions, at most 16 may be served at once",
		"wide": "instances: 8 instances of each of 9 versions are 72 runners, at most 64 per model",
	}
	for _, e := range r.Index(false) {
		if e.Name == "sum" {
			if e.State != StateReady {
				t.Errorf("sum: %+v, want READY", e)
			}
			continue
		}
		if e.State != StateUnavailable || !strings.Contains(e.Reason, want[e.Name]) {
			t.Errorf("%s: %+v, want UNAVAILABLE with %q", e.Name, e, want[e.Name])
		}
	}
	f.mu.Lock()
	started := len(f.instances)
	f.mu.Unlock()
	if started != 1 {
		t.Errorf("%d instances started, want 1 (sum's)", started)
	}
}
