package api

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/dashboard"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/runtime"
)

// fakeBackend serves two models without ONNX Runtime:
//   - "sum": input "x" FP32 [-1, 4], output "y" FP32 [-1] = sum of each row,
//     and output "count" INT64 [-1] = 4 per row;
//   - "echo": every input comes back as an output of the same name+"_out",
//     any datatype and shape (BYTES included).
//
// Unknown models give models.ErrModelNotFound; "unready" exists but is not
// ready. lastReq records the last request passed to Infer.
type fakeBackend struct {
	mu       sync.Mutex
	lastReq  *runtime.InferRequest
	loaded   map[string]bool
	notLive  bool
	notReady bool
	inferErr error // when set, Infer returns it

	preadmitErr   error     // when set, Preadmit returns it
	preadmitCalls int       // Preadmit calls
	preadmitDL    time.Time // the deadline of the last Preadmit

	pins   map[string]*limiter.Share // PinShare calls by model
	events []control.Event
	dash   *dashboard.Recorder // nil: the dashboard is disabled

	reloadResult ReloadResult // what ReloadConfig answers
	reloadErr    error        // when set, ReloadConfig fails with it
	reloads      int          // ReloadConfig calls
	loadConfigs  []string     // the config of each LoadModel call ("" for none)
}

var _ Backend = (*fakeBackend)(nil)

func newFakeBackend() *fakeBackend {
	return &fakeBackend{loaded: map[string]bool{"sum": true, "echo": true, "unready": false}}
}

func (f *fakeBackend) Live() bool            { return !f.notLive }
func (f *fakeBackend) Ready() bool           { return !f.notReady }
func (f *fakeBackend) ServerVersion() string { return "test" }

func (f *fakeBackend) check(name, version string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.loaded[name]; !ok {
		return fmt.Errorf("%w: %q", models.ErrModelNotFound, name)
	}
	if version != "" && version != "1" {
		return fmt.Errorf("%w: %q version %q", models.ErrVersionNotFound, name, version)
	}
	return nil
}

func (f *fakeBackend) Preadmit(ctx context.Context, name, version string, deadline time.Time) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.preadmitCalls++
	f.preadmitDL = deadline
	return f.preadmitErr
}

func (f *fakeBackend) ModelReady(name, version string) (bool, error) {
	if err := f.check(name, version); err != nil {
		return false, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.loaded[name], nil
}

func (f *fakeBackend) Metadata(name, version string) (models.Metadata, error) {
	if err := f.check(name, version); err != nil {
		return models.Metadata{}, err
	}
	md := models.Metadata{Name: name, Versions: []string{"1"}, Platform: "onnxruntime_onnx"}
	if name == "sum" {
		md.Inputs = []runtime.TensorSpec{{Name: "x", DataType: runtime.FP32, Shape: []int64{-1, 4}}}
		md.Outputs = []runtime.TensorSpec{
			{Name: "y", DataType: runtime.FP32, Shape: []int64{-1}},
			{Name: "count", DataType: runtime.Int64, Shape: []int64{-1}},
		}
	}
	return md, nil
}

// ModelConfig answers sum's config (batching, an SLO) from its metadata.
func (f *fakeBackend) ModelConfig(name, version string) (*configs.Model, error) {
	md, err := f.Metadata(name, version)
	if err != nil {
		return nil, err
	}
	m := &configs.Model{
		Name: name, Platform: configs.PlatformONNX, Instances: 1,
		VersionPolicy: configs.VersionPolicy{Latest: &configs.LatestPolicy{NumVersions: 1}},
		Execution:     configs.Execution{Provider: configs.ProviderCPU, GraphOptimization: configs.GraphOptAll},
		SLO:           configs.SLO{Class: configs.ClassBestEffort},
		Resources:     configs.Resources{MaxComputeShare: 1},
	}
	if name == "sum" {
		m.MaxBatchSize = 8
		m.SLO = configs.SLO{LatencyMS: 50, Class: configs.ClassLatencyCritical}
		m.DynamicBatching.PreferredBatchSizes = []int{4}
	}
	for _, t := range md.Inputs {
		m.Inputs = append(m.Inputs, configs.TensorConfig{Name: t.Name, DataType: string(t.DataType), Shape: t.Shape})
	}
	for _, t := range md.Outputs {
		m.Outputs = append(m.Outputs, configs.TensorConfig{Name: t.Name, DataType: string(t.DataType), Shape: t.Shape})
	}
	return m, nil
}

func (f *fakeBackend) Infer(ctx context.Context, name, version string, req *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	if err := f.check(name, version); err != nil {
		return nil, "", err
	}
	f.mu.Lock()
	f.lastReq = req
	ready, inferErr := f.loaded[name], f.inferErr
	f.mu.Unlock()
	if !ready {
		return nil, "", fmt.Errorf("%w: %q", models.ErrNotReady, name)
	}
	if inferErr != nil {
		return nil, "", inferErr
	}
	var outs []runtime.Tensor
	switch name {
	case "sum":
		if len(req.Inputs) != 1 || req.Inputs[0].Name != "x" || req.Inputs[0].DataType != runtime.FP32 ||
			len(req.Inputs[0].Shape) != 2 || req.Inputs[0].Shape[1] != 4 {
			return nil, "", fmt.Errorf("%w: sum wants x FP32 [-1,4]", models.ErrInvalidInput)
		}
		x := req.Inputs[0]
		rows := x.Shape[0]
		y := make([]byte, 0, rows*4)
		c := make([]byte, 0, rows*8)
		for r := range rows {
			var s float32
			for k := range int64(4) {
				s += math.Float32frombits(binary.LittleEndian.Uint32(x.Data[(r*4+k)*4:]))
			}
			y = binary.LittleEndian.AppendUint32(y, math.Float32bits(s))
			c = binary.LittleEndian.AppendUint64(c, 4)
		}
		outs = []runtime.Tensor{
			{Name: "y", DataType: runtime.FP32, Shape: []int64{rows}, Data: y},
			{Name: "count", DataType: runtime.Int64, Shape: []int64{rows}, Data: c},
		}
	case "echo":
		for _, in := range req.Inputs {
			outs = append(outs, runtime.Tensor{Name: in.Name + "_out", DataType: in.DataType, Shape: in.Shape, Data: in.Data})
		}
	}
	if len(req.Outputs) > 0 {
		var kept []runtime.Tensor
		for _, want := range req.Outputs {
			found := false
			for _, o := range outs {
				if o.Name == want {
					kept = append(kept, o)
					found = true
				}
			}
			if !found {
				return nil, "", fmt.Errorf("%w: unknown output %q", models.ErrInvalidInput, want)
			}
		}
		outs = kept
	}
	return &runtime.InferResponse{Outputs: outs}, "1", nil
}

func (f *fakeBackend) Statistics(name, version string) ([]models.Statistics, error) {
	if name != "" {
		if err := f.check(name, version); err != nil {
			return nil, err
		}
		return []models.Statistics{{Name: name, Version: "1", InferenceCount: 3, ExecutionCount: 2}}, nil
	}
	return []models.Statistics{
		{Name: "echo", Version: "1"},
		{Name: "sum", Version: "1", InferenceCount: 3, ExecutionCount: 2},
	}, nil
}

func (f *fakeBackend) RepositoryIndex(ctx context.Context, readyOnly bool) ([]models.IndexEntry, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []models.IndexEntry
	for _, n := range []string{"echo", "sum", "unready"} {
		st := models.StateUnavailable
		if f.loaded[n] {
			st = models.StateReady
		}
		if readyOnly && st != models.StateReady {
			continue
		}
		out = append(out, models.IndexEntry{Name: n, Version: "1", State: st})
	}
	return out, nil
}

func (f *fakeBackend) LoadModel(ctx context.Context, name string, config []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.loaded[name]; !ok {
		return fmt.Errorf("%w: %q", models.ErrModelNotFound, name)
	}
	f.loaded[name] = true
	f.loadConfigs = append(f.loadConfigs, string(config))
	return nil
}

func (f *fakeBackend) UnloadModel(ctx context.Context, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.loaded[name]; !ok {
		return fmt.Errorf("%w: %q", models.ErrModelNotFound, name)
	}
	f.loaded[name] = false
	return nil
}

func (f *fakeBackend) Control() ControlStatus {
	return ControlStatus{Policy: "adaptive", Period: "1s", Devices: []DeviceControl{{
		Device: "cpu", Limiter: "cgroup-v1", LimiterDetail: "test", CPUs: 2,
		Models: []ModelControl{{Model: "sum/1", Class: "latency-critical", SLOms: 100, ComputeShare: 0.25, Source: "adaptive"}},
	}}}
}

func (f *fakeBackend) Limiters() map[string]string { return map[string]string{"cpu": "cgroup-v1"} }

func (f *fakeBackend) ControlEvents(since time.Time, limit int) []control.Event {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []control.Event
	for _, e := range f.events {
		if e.Time.After(since) {
			out = append(out, e)
		}
	}
	if len(out) > limit {
		out = out[len(out)-limit:]
	}
	return out
}

func (f *fakeBackend) PinShare(_ context.Context, name string, pin *limiter.Share) error {
	if err := f.check(name, ""); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.pins == nil {
		f.pins = map[string]*limiter.Share{}
	}
	f.pins[name] = pin
	return nil
}

func (f *fakeBackend) Dashboard() *dashboard.Recorder { return f.dash }
func (f *fakeBackend) ReloadConfig(context.Context) (ReloadResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reloads++
	return f.reloadResult, f.reloadErr
}
