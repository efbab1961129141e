package models

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// fakeInstance sums the rows of its FP32 input "x" [-1, 4] into "y" [-1].
// gate, when set, blocks each call until it is closed.
type fakeInstance struct {
	f       *fakeFactory
	spec    InstanceSpec
	stopped atomic.Bool
	calls   atomic.Int64
	down    atomic.Bool

	mu      sync.Mutex
	batches []int64 // each call's batch size, in order
}

// batchSizes is each call's batch size so far, in order.
func (fi *fakeInstance) batchSizes() []int64 {
	fi.mu.Lock()
	defer fi.mu.Unlock()
	return slices.Clone(fi.batches)
}

func (fi *fakeInstance) Inputs() []runtime.TensorSpec {
	if in, ok := fi.f.inputs[fi.spec.Model]; ok {
		return in
	}
	return []runtime.TensorSpec{{Name: "x", DataType: runtime.FP32, Shape: []int64{-1, 4}}}
}

func (fi *fakeInstance) Outputs() []runtime.TensorSpec {
	return []runtime.TensorSpec{{Name: "y", DataType: runtime.FP32, Shape: []int64{-1}}}
}

func (fi *fakeInstance) Status() (bool, string) {
	if fi.down.Load() {
		return false, "down"
	}
	return true, ""
}

func (fi *fakeInstance) Stop(context.Context) error {
	fi.stopped.Store(true)
	return nil
}

func (fi *fakeInstance) Infer(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
	fi.calls.Add(1)
	fi.mu.Lock()
	fi.batches = append(fi.batches, req.Inputs[0].Shape[0])
	fi.mu.Unlock()
	if fi.stopped.Load() {
		return nil, errors.New("called after Stop")
	}
	if fi.down.Load() {
		return nil, runtime.ErrUnavailable
	}
	if g := fi.f.gate(); g != nil {
		select {
		case <-g:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	x := req.Inputs[0]
	rows := x.Shape[0]
	y := make([]byte, 0, 4*rows)
	for r := range rows {
		var s float32
		for k := range int64(4) {
			s += math.Float32frombits(binary.LittleEndian.Uint32(x.Data[(r*4+k)*4:]))
		}
		y = binary.LittleEndian.AppendUint32(y, math.Float32bits(s))
	}
	return &runtime.InferResponse{
		Outputs: []runtime.Tensor{{Name: "y", DataType: runtime.FP32, Shape: []int64{rows}, Data: y}},
		Timing:  runtime.Timing{Infer: time.Millisecond},
	}, nil
}

type fakeFactory struct {
	mu        sync.Mutex
	instances []*fakeInstance
	g         chan struct{}
	fail      map[string]error                // model name -> start error
	inputs    map[string][]runtime.TensorSpec // model name -> its file's inputs, when not the sum's
	onStart   func(spec InstanceSpec)         // called first by start, without the lock
	// onStartCtx, when set, is called after onStart with start's ctx; its
	// error fails the start.
	onStartCtx func(ctx context.Context, spec InstanceSpec) error
}

func (f *fakeFactory) gate() chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.g
}

func (f *fakeFactory) start(ctx context.Context, spec InstanceSpec) (Instance, error) {
	f.mu.Lock()
	hook, hookCtx := f.onStart, f.onStartCtx
	f.mu.Unlock()
	if hook != nil {
		hook(spec)
	}
	if hookCtx != nil {
		if err := hookCtx(ctx, spec); err != nil {
			return nil, err
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.fail[spec.Model]; err != nil {
		return nil, err
	}
	fi := &fakeInstance{f: f, spec: spec}
	f.instances = append(f.instances, fi)
	return fi, nil
}

func (f *fakeFactory) of(model string, version int64) []*fakeInstance {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*fakeInstance
	for _, fi := range f.instances {
		if fi.spec.Model == model && fi.spec.Version == version {
			out = append(out, fi)
		}
	}
	return out
}

const sumConfig = `name: %s
platform: onnx
max_batch_size: 4
instances: %d
version_policy: {latest: {num_versions: %d}}
`

// writeModel creates a model folder with a config and empty version files.
func writeModel(t *testing.T, repo, name, config string, versions ...int) {
	t.Helper()
	dir := filepath.Join(repo, name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.yaml"), []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, v := range versions {
		vd := filepath.Join(dir, fmt.Sprint(v))
		if err := os.MkdirAll(vd, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(vd, "model.onnx"), []byte("onnx"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func newTestRegistry(t *testing.T, control string, repo string) (*Registry, *fakeFactory, *prometheus.Registry) {
	t.Helper()
	f := &fakeFactory{fail: map[string]error{}}
	preg := prometheus.NewRegistry()
	r, err := New(Options{
		Repositories:      []string{repo},
		Control:           control,
		MaxTensorElements: 1 << 20,
		DrainTimeout:      5 * time.Second,
		NewInstance:       f.start,
		Registerer:        preg,
	})
	if err != nil {
		t.Fatal(err)
	}
	return r, f, preg
}

func sumRequest(rows ...[4]float32) *runtime.InferRequest {
	var data []byte
	for _, r := range rows {
		for _, v := range r {
			data = binary.LittleEndian.AppendUint32(data, math.Float32bits(v))
		}
	}
	return &runtime.InferRequest{Inputs: []runtime.Tensor{{
		Name: "x", DataType: runtime.FP32, Shape: []int64{int64(len(rows)), 4}, Data: data,
	}}}
}

func floats(b []byte) []float32 {
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[i*4:]))
	}
	return out
}

func TestRegistryLoadsAndServes(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 2, 2), 1, 2, 3)
	writeModel(t, repo, "broken", "name: broken\nslo: {latency_ms: -5}\n", 1)
	r, f, preg := newTestRegistry(t, ControlNone, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })

	idx := r.Index(false)
	want := []string{"broken//UNAVAILABLE", "sum/2/READY", "sum/3/READY"}
	if len(idx) != len(want) {
		t.Fatalf("index = %+v, want %v", idx, want)
	}
	for i, e := range idx {
		if got := e.Name + "/" + e.Version + "/" + string(e.State); got != want[i] {
			t.Errorf("index[%d] = %s, want %s", i, got, want[i])
		}
	}
	if !strings.Contains(idx[0].Reason, "slo.latency_ms") {
		t.Errorf("broken model reason %q does not name the field", idx[0].Reason)
	}
	if got := len(f.of("sum", 3)); got != 2 {
		t.Errorf("version 3 has %d instances, want 2", got)
	}
	if got := len(f.of("sum", 1)); got != 0 {
		t.Errorf("version 1 (outside latest 2) has %d instances", got)
	}

	resp, ver, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 2, 3, 4}, [4]float32{5, 6, 7, 8.5}))
	if err != nil {
		t.Fatal(err)
	}
	if ver != "3" {
		t.Errorf("default version = %s, want the highest, 3", ver)
	}
	if got := floats(resp.Outputs[0].Data); len(got) != 2 || got[0] != 10 || got[1] != 26.5 {
		t.Errorf("y = %v, want [10 26.5]", got)
	}
	if _, _, err := r.Infer(t.Context(), "sum", "2", sumRequest([4]float32{1, 1, 1, 1})); err != nil {
		t.Fatal(err)
	}

	st, err := r.Statistics("sum", "3")
	if err != nil {
		t.Fatal(err)
	}
	if st[0].InferenceCount != 2 || st[0].ExecutionCount != 1 || st[0].Success.Count != 1 || st[0].ComputeInfer.Total != time.Millisecond {
		t.Errorf("stats = %+v, want 2 inferences in 1 execution with 1ms compute", st[0])
	}
	if st[0].SLO == nil || st[0].SLO.Good != 1 || st[0].SLO.Arrived != 1 {
		t.Errorf("SLO statistics = %+v, want the one request good", st[0].SLO)
	}
	// The registry's own scheduler counts the requests, once.
	if n, err := testutil.GatherAndCount(preg, "sloserve_qos_request_duration_seconds"); err != nil || n != 2 {
		t.Errorf("duration histograms = %d (%v), want one per version used", n, err)
	}

	md, err := r.Metadata("sum", "")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(md.Versions, ",") != "2,3" || md.Inputs[0].Name != "x" {
		t.Errorf("metadata = %+v", md)
	}
	for _, tc := range []struct {
		name, model, version string
		want                 error
	}{
		{"unknown model", "nope", "", ErrModelNotFound},
		{"unknown version", "sum", "9", ErrVersionNotFound},
		{"unloaded version", "sum", "1", ErrVersionNotFound},
		{"bad version", "sum", "x", ErrVersionNotFound},
		{"leading zero", "sum", "02", ErrVersionNotFound},
		{"plus sign", "sum", "+2", ErrVersionNotFound},
		{"zero", "sum", "0", ErrVersionNotFound},
		{"failed model", "broken", "", ErrNotReady},
		{"traversal", "../sum", "", ErrModelNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := r.Infer(t.Context(), tc.model, tc.version, sumRequest([4]float32{}))
			if !errors.Is(err, tc.want) {
				t.Errorf("err = %v, want %v", err, tc.want)
			}
			// Every entry point finds a model version the same way.
			_, mdErr := r.Metadata(tc.model, tc.version)
			_, cfgErr := r.ModelConfig(tc.model, tc.version)
			_, _, keyErr := r.VersionKey(tc.model, tc.version)
			ready, readyErr := r.ModelReady(tc.model, tc.version)
			for what, err := range map[string]error{"Metadata": mdErr, "ModelConfig": cfgErr, "VersionKey": keyErr} {
				if !errors.Is(err, tc.want) {
					t.Errorf("%s: %v, want %v", what, err, tc.want)
				}
			}
			if tc.want == ErrNotReady { // not ready is an answer, not an error
				readyErr = fmt.Errorf("%w", ErrNotReady)
			}
			if ready || !errors.Is(readyErr, tc.want) {
				t.Errorf("ModelReady: %v, %v, want false and %v", ready, readyErr, tc.want)
			}
			if tc.version != "" || tc.want == ErrModelNotFound {
				if _, err := r.Statistics(tc.model, tc.version); !errors.Is(err, tc.want) {
					t.Errorf("Statistics: %v, want %v", err, tc.want)
				}
			}
		})
	}
	// Triton's words first, where clients and scripts match them.
	for _, tc := range []struct{ model, version, want string }{
		{"nope", "", `Request for unknown model: 'nope' is not found (model not found: "nope")`},
		{"sum", "9", `Request for unknown model: 'sum' version 9 is not found (model version not found: "sum" version "9")`},
	} {
		_, _, err := r.Infer(t.Context(), tc.model, tc.version, sumRequest([4]float32{}))
		if err == nil || err.Error() != tc.want {
			t.Errorf("%s %s: %v, want %q", tc.model, tc.version, err, tc.want)
		}
		if _, err := r.Metadata(tc.model, tc.version); err == nil || err.Error() != tc.want {
			t.Errorf("metadata %s %s: %v, want %q", tc.model, tc.version, err, tc.want)
		}
	}
}

func TestRegistryValidatesRequests(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
	r, f, _ := newTestRegistry(t, ControlNone, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	good := func() *runtime.InferRequest { return sumRequest([4]float32{1, 2, 3, 4}) }
	for _, tc := range []struct {
		name   string
		mutate func(*runtime.InferRequest)
		want   string
	}{
		{"missing input", func(q *runtime.InferRequest) { q.Inputs = nil }, `missing input "x"`},
		{"unknown input", func(q *runtime.InferRequest) { q.Inputs[0].Name = "z" }, `unknown input "z"`},
		{"duplicate input", func(q *runtime.InferRequest) { q.Inputs = append(q.Inputs, q.Inputs[0]) }, `given twice`},
		{"wrong datatype", func(q *runtime.InferRequest) { q.Inputs[0].DataType = runtime.Int32 }, "datatype INT32, model expects FP32"},
		{"wrong rank", func(q *runtime.InferRequest) { q.Inputs[0].Shape = []int64{4} }, "model expects [-1 4]"},
		{"wrong fixed dim", func(q *runtime.InferRequest) { q.Inputs[0].Shape = []int64{2, 2} }, "model expects [-1 4]"},
		{"short data", func(q *runtime.InferRequest) { q.Inputs[0].Data = q.Inputs[0].Data[:8] }, "needs 16 bytes of data, got 8"},
		{"batch over max", func(q *runtime.InferRequest) {
			q.Inputs[0] = sumRequest(make([][4]float32, 5)...).Inputs[0]
		}, "batch size 5, model sum allows 1 to 4"},
		{"unknown output", func(q *runtime.InferRequest) { q.Outputs = []string{"nope"} }, `unknown output "nope"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := good()
			tc.mutate(q)
			_, _, err := r.Infer(t.Context(), "sum", "", q)
			if !errors.Is(err, ErrInvalidInput) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want ErrInvalidInput containing %q", err, tc.want)
			}
		})
	}
	if n := f.of("sum", 1)[0].calls.Load(); n != 0 {
		t.Errorf("invalid requests reached the instance %d times", n)
	}
	if st, _ := r.Statistics("sum", ""); st[0].Fail.Count != 9 {
		t.Errorf("fail count = %d, want 9", st[0].Fail.Count)
	}
}

func TestRegistryExplicitControl(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
	r, f, _ := newTestRegistry(t, ControlExplicit, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	if ok, err := r.ModelReady("sum", ""); ok || err != nil {
		t.Fatalf("before load: ready=%v err=%v, want not ready", ok, err)
	}
	if err := r.Load(t.Context(), "sum"); err != nil {
		t.Fatal(err)
	}
	if ok, _ := r.ModelReady("sum", ""); !ok {
		t.Fatal("not ready after load")
	}
	// A model folder added after start is found by name.
	writeModel(t, repo, "late", fmt.Sprintf(sumConfig, "late", 1, 1), 1)
	if err := r.Load(t.Context(), "late"); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"../etc", "a/b", "", ".."} {
		if err := r.Load(t.Context(), name); !errors.Is(err, ErrInvalidInput) {
			t.Errorf("Load(%q) = %v, want ErrInvalidInput", name, err)
		}
	}
	if err := r.Load(t.Context(), "missing"); !errors.Is(err, ErrModelNotFound) {
		t.Errorf("Load(missing) = %v, want ErrModelNotFound", err)
	}
	if err := r.Unload(t.Context(), "sum"); err != nil {
		t.Fatal(err)
	}
	if !f.of("sum", 1)[0].stopped.Load() {
		t.Error("instance not stopped by unload")
	}
	if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{})); !errors.Is(err, ErrNotReady) {
		t.Errorf("infer after unload = %v, want ErrNotReady", err)
	}
	idx := r.Index(false)
	if idx[1].Name != "sum" || idx[1].State != StateUnavailable || idx[1].Reason != "unloaded" {
		t.Errorf("index after unload = %+v", idx)
	}

	none, _, _ := newTestRegistry(t, ControlNone, repo)
	if err := none.Load(t.Context(), "sum"); !errors.Is(err, ErrModelControl) {
		t.Errorf("load in none mode = %v, want ErrModelControl", err)
	}
}

func TestUnloadDrainsInflightRequests(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
	r, f, _ := newTestRegistry(t, ControlExplicit, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	if err := r.Load(t.Context(), "sum"); err != nil {
		t.Fatal(err)
	}
	gate := make(chan struct{})
	f.mu.Lock()
	f.g = gate
	f.mu.Unlock()

	done := make(chan error, 1)
	go func() {
		_, _, err := r.Infer(context.Background(), "sum", "", sumRequest([4]float32{1, 1, 1, 1}))
		done <- err
	}()
	inst := f.of("sum", 1)[0]
	for inst.calls.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	unloaded := make(chan error, 1)
	go func() { unloaded <- r.Unload(context.Background(), "sum") }()
	time.Sleep(50 * time.Millisecond)
	if inst.stopped.Load() {
		t.Fatal("instance stopped while a request was in flight")
	}
	close(gate)
	if err := <-done; err != nil {
		t.Fatalf("in-flight request failed during unload: %v", err)
	}
	if err := <-unloaded; err != nil {
		t.Fatal(err)
	}
	if !inst.stopped.Load() {
		t.Fatal("instance not stopped after drain")
	}
}

func TestReloadKeepsServingWhenNewVersionFails(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
	r, f, _ := newTestRegistry(t, ControlPoll, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })

	// A broken config: the old version keeps serving, the index says why.
	writeModel(t, repo, "sum", "name: sum\nmax_batch_size: -1\n")
	r.pollOnce(t.Context())
	if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 1, 1, 1})); err != nil {
		t.Fatalf("old version stopped serving after a bad change: %v", err)
	}
	idx := r.Index(false)
	if idx[0].State != StateReady || !strings.Contains(idx[0].Reason, "max_batch_size") {
		t.Errorf("index = %+v, want READY with the reload error", idx)
	}

	// A good new version: loaded, then the old one drained and stopped.
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 2)
	r.pollOnce(t.Context())
	_, ver, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 1, 1, 1}))
	if err != nil || ver != "2" {
		t.Fatalf("after adding version 2: version %q err %v", ver, err)
	}
	if !f.of("sum", 1)[0].stopped.Load() {
		t.Error("version 1 still running after version 2 replaced it")
	}
	if r.metrics.retries.DeleteLabelValues("sum", "1") {
		t.Error("version 1's series outlived it")
	}
	if !r.metrics.retries.DeleteLabelValues("sum", "2") {
		t.Error("version 2 has no series")
	}

	// A new model folder is loaded; a removed one is unloaded.
	writeModel(t, repo, "other", fmt.Sprintf(sumConfig, "other", 1, 1), 1)
	r.pollOnce(t.Context())
	if ok, _ := r.ModelReady("other", ""); !ok {
		t.Error("new model folder not loaded by poll")
	}
	if err := os.RemoveAll(filepath.Join(repo, "other")); err != nil {
		t.Fatal(err)
	}
	r.pollOnce(t.Context())
	if _, err := r.ModelReady("other", ""); !errors.Is(err, ErrModelNotFound) {
		t.Errorf("removed model: %v, want ErrModelNotFound", err)
	}
	if !f.of("other", 1)[0].stopped.Load() {
		t.Error("removed model's instance not stopped")
	}

	// A model that never loaded leaves the index when its folder goes.
	writeModel(t, repo, "bad", "name: bad\ninstances: 0\n", 1)
	r.pollOnce(t.Context())
	if idx := r.Index(false); len(idx) != 2 || idx[0].Name != "bad" || idx[0].State != StateUnavailable {
		t.Fatalf("index with a bad model = %+v", idx)
	}
	if err := os.RemoveAll(filepath.Join(repo, "bad")); err != nil {
		t.Fatal(err)
	}
	r.pollOnce(t.Context())
	if idx := r.Index(false); len(idx) != 1 || idx[0].Name != "sum" {
		t.Errorf("index after removing the bad model's folder = %+v", idx)
	}
}

func TestRetryOnAnotherInstance(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 2, 1), 1)
	r, f, _ := newTestRegistry(t, ControlNone, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	insts := f.of("sum", 1)
	insts[0].down.Store(true)
	for range 4 {
		if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 2, 3, 4})); err != nil {
			t.Fatalf("request failed although instance 1 was healthy: %v", err)
		}
	}
	insts[1].down.Store(true)
	if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 2, 3, 4})); !errors.Is(err, runtime.ErrUnavailable) {
		t.Errorf("all instances down: err = %v, want ErrUnavailable", err)
	}
	if ok, _ := r.ModelReady("sum", ""); ok {
		t.Error("model ready with every instance down")
	}
}

func TestDeclaredIOMustMatchModelFile(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", `name: sum
max_batch_size: 4
inputs: [{name: x, datatype: FP64, shape: [-1, 4]}]
`, 1)
	r, f, _ := newTestRegistry(t, ControlNone, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	idx := r.Index(false)
	if idx[0].State != StateUnavailable || !strings.Contains(idx[0].Reason, `input "x": config says datatype FP64, the model file has FP32`) {
		t.Errorf("index = %+v", idx)
	}
	if !f.of("sum", 1)[0].stopped.Load() {
		t.Error("instance of a rejected version left running")
	}
}

func TestRegistrySchedulesThroughQoS(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+"slo: {latency_ms: 1000, class: latency-critical}\n", 1)
	sched, err := qos.NewScheduler(qos.Options{DeviceSlots: 2})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- sched.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-ran })

	est := qos.NewEWMAEstimator(0)
	f := &fakeFactory{fail: map[string]error{}}
	var devices []string
	r, err := New(Options{
		Repositories: []string{repo}, Control: ControlPoll, NewInstance: f.start,
		Scheduler: func(device string) (*qos.Scheduler, error) { devices = append(devices, device); return sched, nil },
		Estimator: est,
	})
	if err != nil {
		t.Fatal(err)
	}
	pollCtx, stopPoll := context.WithCancel(t.Context())
	if err := r.Start(pollCtx); err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 2, 3, 4})); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(devices) != "[cpu]" || !sched.HasModel("sum/1") {
		t.Fatalf("devices asked = %v, scheduled = %v", devices, sched.HasModel("sum/1"))
	}
	// The warm-up ran batch sizes 1 and 4 (the maximum) and fed the estimator.
	for _, b := range []int{1, 4} {
		if _, ok := est.Estimate("sum/1", b); !ok {
			t.Errorf("no estimate for batch %d after the warm-up", b)
		}
	}
	st, _ := r.Statistics("sum", "1")
	if st[0].SLO == nil || st[0].SLO.Arrived != 1 || st[0].SLO.Good != 1 || st[0].SLO.Class != "latency-critical" {
		t.Errorf("SLO statistics = %+v", st[0].SLO)
	}
	// Preadmit: an admissible request is not counted, a refused one is,
	// by the scheduler and the registry alike.
	if err := r.Preadmit(t.Context(), "sum", "", time.Time{}); err != nil {
		t.Errorf("Preadmit of an idle model: %v", err)
	}
	if err := r.Preadmit(t.Context(), "sum", "", time.Now().Add(-time.Millisecond)); !errors.Is(err, qos.ErrRejected) ||
		!strings.HasPrefix(err.Error(), "model sum version 1: ") {
		t.Errorf("Preadmit past its deadline: %v, want qos.ErrRejected naming the model as Infer does", err)
	}
	if err := r.Preadmit(t.Context(), "nosuch", "", time.Time{}); err != nil {
		t.Errorf("Preadmit of an unknown model: %v, want nil (Infer reports it)", err)
	}
	st, _ = r.Statistics("sum", "1")
	if st[0].SLO.Arrived != 2 || st[0].SLO.Rejected != 1 || st[0].Fail.Count != 1 {
		t.Errorf("after one refusal: SLO %+v, failures %+v", st[0].SLO, st[0].Fail)
	}

	// A reload of the same version keeps it scheduled, on the new instance.
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+"slo: {latency_ms: 500, class: latency-critical}\n")
	r.pollOnce(t.Context())
	insts := f.of("sum", 1)
	if len(insts) != 2 || !insts[0].stopped.Load() || insts[1].stopped.Load() {
		t.Fatalf("after reload: %d instances, old stopped %v", len(insts), insts[0].stopped.Load())
	}
	if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 2, 3, 4})); err != nil {
		t.Fatal(err)
	}
	if n := insts[1].calls.Load(); n < 2 {
		t.Errorf("the new instance ran %d calls, want the warm-up and the request", n)
	}
	if !sched.HasModel("sum/1") {
		t.Error("reload took the version out of the scheduler")
	}

	// Unloading takes it out.
	if err := os.RemoveAll(filepath.Join(repo, "sum")); err != nil {
		t.Fatal(err)
	}
	r.pollOnce(t.Context())
	if sched.HasModel("sum/1") {
		t.Error("an unloaded version is still scheduled")
	}
	stopPoll()
	r.Stop(context.Background())
}
