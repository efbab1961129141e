package e2e

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The real binary serves cuda models on simulated GPUs (gpu.simulator):
// each instance is an MPS client of the simulator, its executions take
// the simulated time, and the answers have the model's output shapes
// (zeros, not the model's outputs). Profiling runs one client per share.
func TestSimulatedGPUServes(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo,
		repoModel{name: "cls", file: demoModel(t, "ocr-cls"), config: `max_batch_size: 8
execution:
  provider: cuda
  device_id: 1
  simulated: {preset: mobilenet, fixed: 20ms, saturation: 0.5, saturation_growth: 0.5}
slo: {latency_ms: 200, class: latency-critical}
resources: {memory_limit: 2GiB, min_compute_share: 0.1}
profile: {shapes: {x: [1, 3, 48, 192]}, batch_sizes: [1, 8]}
`},
		repoModel{name: "wake", file: demoModel(t, "wakeword-hello"), config: `execution:
  provider: cuda
  simulated: {preset: resnet50}
`},
		repoModel{name: "dyn", file: testModel(t, "example_dynamic_axes.onnx"), config: `max_batch_size: 4
execution: {provider: cuda, simulated: {preset: resnet50}}
resources: {memory_limit: 2GiB}
profile: {batch_sizes: [1, 4]}
`}) // dyn's batches stop at 4: the batch-8 points below are cls's
	cache := t.TempDir()
	s := startServer(t, repo, `gpu:
  simulator: {devices: 2, sms: 80, memory: 16GiB}
control:
  period: 200ms
  profile: {cache_dir: `+cache+`, budget: 60s, runs: 3}
`, withSet("control.profile.cache_dir="+cache)) // over the test environment's shared cache: this test must profile
	for _, m := range []string{"cls", "wake"} {
		if code, body, _ := s.do(t, http.MethodGet, "/v2/models/"+m+"/ready", nil); code != http.StatusOK {
			t.Fatalf("%s not ready: %d %s", m, code, body)
		}
	}

	var resp struct {
		Outputs []struct {
			Name     string    `json:"name"`
			Datatype string    `json:"datatype"`
			Shape    []int64   `json:"shape"`
			Data     []float64 `json:"data"`
		} `json:"outputs"`
	}
	in := make([]float64, 2*3*48*192)
	start := time.Now()
	code := s.json(t, http.MethodPost, "/v2/models/cls/infer", map[string]any{
		"inputs": []map[string]any{{"name": "x", "datatype": "FP32", "shape": []int{2, 3, 48, 192}, "data": in}},
	}, &resp)
	took := time.Since(start)
	if code != http.StatusOK || len(resp.Outputs) != 1 {
		t.Fatalf("infer: %d %+v", code, resp)
	}
	if o := resp.Outputs[0]; o.Name != "softmax_0.tmp_0" || o.Datatype != "FP32" || len(o.Shape) != 2 || o.Shape[0] != 2 || o.Shape[1] != 2 || len(o.Data) != 4 {
		t.Errorf("output %+v, want softmax_0.tmp_0 FP32 [2 2]", o)
	}
	// The simulated execution waits: at least the curve's fixed time.
	if took < 20*time.Millisecond {
		t.Errorf("infer took %v, less than the simulated kernel time", took)
	}

	// Profiling measured each share in its own MPS client, started at the
	// share's percentage (the limiter's placement). Before, every point
	// ran in the first client, at the initial share.
	log := s.log.String()
	for _, pct := range []string{"25", "50", "100"} {
		found := false
		for line := range strings.Lines(log) {
			if strings.Contains(line, "simulated instance started") && strings.Contains(line, "percentage="+pct+" ") && strings.Contains(line, "cls/1#0") {
				found = true
			}
		}
		if !found {
			t.Errorf("no simulated client of cls started at %s%% while profiling", pct)
		}
	}
	// And the points differ by share: at batch 8 cls needs the whole
	// device (saturation 0.5*sqrt(8) > 1), so a quarter of it is about 4x
	// slower. Timing on a shared machine is noisy: only the sign is
	// checked, on the fastest batch-8 point of each share.
	files, _ := filepath.Glob(filepath.Join(cache, "*"))
	var at = map[float64]time.Duration{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var prof struct {
			Points []struct {
				Batch   int
				Share   float64
				Latency time.Duration
			}
		}
		if err := json.Unmarshal(b, &prof); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		for _, p := range prof.Points {
			if p.Batch == 8 {
				at[p.Share] = p.Latency
			}
		}
	}
	if q, full := at[0.25], at[1]; q == 0 || full == 0 || q < 60*time.Millisecond {
		t.Errorf("cls at batch 8: %v at share 0.25, %v at 1; want the quarter share to take at least 60ms (the curve: 83ms)", q, full)
	}
	if !strings.Contains(log, "simulated GPUs") || !strings.Contains(log, "instance replaced at a new share") {
		t.Errorf("the log does not show simulated GPUs and a client per profiled share:\n%s", log)
	}

	// Under the adaptive policy dyn's memory share (its client's pinned
	// limit) follows its load, sized from the profile's working sets, not
	// its 2 GiB memory_limit: idle, batch 1's (a context and resnet50's
	// weights: 425 MiB, plus 25%). Its largest batch, 4, needs 500 MiB,
	// which that holds, so a batch of 4 runs there and the share does not
	// grow for it: it grows only for a batch it cannot hold. (cls is not
	// sized: its input is dynamic beyond the batch.)
	var share, target int64
	var reason string
	waitFor(t, "dyn's memory share sized from its working set", 60*time.Second, func() bool {
		share, target, reason = s.memoryShare(t, "dyn/1")
		return share > 0 && share < 2<<30 && target == share
	})
	if share != 532<<20 || !strings.Contains(reason, "batch 1") {
		t.Errorf("idle dyn's memory share %d MiB, target %d MiB (%q); want 532 MiB, batch 1's working set + 25%%", share>>20, target>>20, reason)
	}
	rows := make([][]float64, 4)
	for i := range rows {
		rows[i] = make([]float64, 10)
	}
	if code := s.json(t, http.MethodPost, "/v2/models/dyn/infer", map[string]any{
		"inputs": []map[string]any{{"name": "input_vectors", "datatype": "FP32", "shape": []int{4, 10}, "data": rows}},
	}, &resp); code != http.StatusOK {
		t.Errorf("a batch of 4 within the idle share: %d %+v", code, resp)
	}
	if share, target, reason = s.memoryShare(t, "dyn/1"); share != 532<<20 {
		t.Errorf("after a batch of 4 dyn's memory share is %d MiB, target %d MiB (%q); want it still 532 MiB, which holds batch 4's 500 MiB", share>>20, target>>20, reason)
	}
}
