package server

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/runtime"
)

// tinyONNX is a model file with one FP32 input x[1,16] and one output
// y[1,4] (the first dimension dynamic when batched) and no nodes: enough for a simulated instance, which reads only
// the signature.
func tinyONNX(batched bool) []byte {
	msg := func(num protowire.Number, parts ...[]byte) []byte {
		var body []byte
		for _, p := range parts {
			body = append(body, p...)
		}
		return protowire.AppendBytes(protowire.AppendTag(nil, num, protowire.BytesType), body)
	}
	varint := func(num protowire.Number, v uint64) []byte {
		return protowire.AppendVarint(protowire.AppendTag(nil, num, protowire.VarintType), v)
	}
	str := func(num protowire.Number, s string) []byte {
		return protowire.AppendString(protowire.AppendTag(nil, num, protowire.BytesType), s)
	}
	tensor := func(field protowire.Number, name string, dims ...uint64) []byte {
		var shape [][]byte
		for i, d := range dims {
			if i == 0 && batched {
				shape = append(shape, msg(1, str(2, "batch")))
				continue
			}
			shape = append(shape, msg(1, varint(1, d)))
		}
		return msg(field, str(1, name), msg(2, msg(1, varint(1, 1), msg(2, shape...))))
	}
	return append(varint(1, 8), msg(7, tensor(11, "x", 1, 16), tensor(12, "y", 1, 4))...)
}

// simulatedServer loads the models of a repository on a simulated GPU
// the way Run does (assemble, without listeners) and runs the devices'
// loops. It stops everything when the test ends.
func simulatedServer(t *testing.T, cfg *configs.Server, modelConfigs map[string]string) (*models.Registry, *house) {
	t.Helper()
	cfg.Repositories = []string{tinyRepo(t, modelConfigs)}
	h := assembledServer(t, cfg)
	return h.reg, h
}

// tinyRepo writes a repository of tiny models with the configs given.
func tinyRepo(t *testing.T, modelConfigs map[string]string) string {
	t.Helper()
	repo := t.TempDir()
	for name, c := range modelConfigs {
		dir := filepath.Join(repo, name, "1")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(repo, name, "config.yaml"), []byte("name: "+name+"\n"+c), 0o644)
		os.WriteFile(filepath.Join(dir, "model.onnx"), tinyONNX(strings.Contains(c, "max_batch_size")), 0o644)
	}
	return repo
}

// assembledServer assembles the models and devices of cfg (no
// listeners), runs the devices' loops and placement (when on) and loads
// the models. Everything stops when the test ends, the loops before the
// registry.
func assembledServer(t *testing.T, cfg *configs.Server) *house {
	t.Helper()
	// The simulated instances never load ONNX Runtime: any file will do.
	lib := filepath.Join(t.TempDir(), "libonnxruntime.so")
	os.WriteFile(lib, nil, 0o644)
	cfg.Runtime.ONNXRuntimeLibrary, cfg.Runtime.SocketDir = lib, t.TempDir()
	if cfg.Control.Profile.CacheDir == "" { // else profiles kept across servers
		cfg.Control.Profile.CacheDir = t.TempDir()
	}
	h, err := assemble(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), assembly{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	loopCtx, stopLoops := context.WithCancel(context.Background())
	var loops sync.WaitGroup
	for _, d := range h.devs.Devices() {
		loops.Go(func() { d.Run(loopCtx) })
	}
	for _, l := range h.loops.All() {
		loops.Go(func() { l.Run(loopCtx) })
	}
	placeCtx, stopPlace := context.WithCancel(ctx)
	if h.place != nil {
		loops.Go(func() { h.place.Run(placeCtx) })
	}
	t.Cleanup(func() {
		// The loops stop first: a swap the adjuster is making holds the
		// registry's lock that Stop takes, and a goroutine blocked on a
		// mutex is not durably blocked, so synctest's clock would not
		// move the swap on.
		stopPlace()
		cancel()
		stopLoops()
		h.stopRecovery()
		h.reg.Stop(context.Background())
		loops.Wait()
		h.close()
	})
	if err := h.reg.Start(ctx); err != nil {
		t.Fatal(err)
	}
	return h
}

func infer(t *testing.T, reg *models.Registry, model string) time.Duration {
	t.Helper()
	req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 16}, Data: make([]byte, 64)}}}
	start := time.Now()
	resp, _, err := reg.Infer(t.Context(), model, "", req)
	if err != nil {
		t.Fatalf("%s: %v", model, err)
	}
	if len(resp.Outputs) != 1 || resp.Outputs[0].Name != "y" || len(resp.Outputs[0].Data) != 16 {
		t.Errorf("%s: outputs %+v", model, resp.Outputs)
	}
	return time.Since(start)
}

// Two models on one simulated GPU under MPS run their executions at the
// same time, each within its share (G2 of issue 18: before, a GPU had one
// execution slot across all its models, so MPS clients never ran at once).
func TestSimulatedGPURunsModelsConcurrently(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := configs.DefaultServer()
		cfg.GPU.Simulator.Devices = 1
		cfg.Control.Policy = control.SharePolicyStatic
		cfg.Control.Profile.Enabled = false
		model := "execution: {provider: cuda, simulated: {preset: mobilenet, fixed: 20ms}}\nresources: {compute_share: 0.4}\n"
		reg, _ := simulatedServer(t, cfg, map[string]string{"a": model, "b": model})
		infer(t, reg, "a") // warm-up
		infer(t, reg, "b")
		alone := infer(t, reg, "a")

		var wg sync.WaitGroup
		took := make([]time.Duration, 2)
		for i, m := range []string{"a", "b"} {
			wg.Go(func() { took[i] = infer(t, reg, m) })
		}
		wg.Wait()
		// Side by side each is slowed by interference (x1.1 at these
		// bandwidths), not by waiting for the other (x2).
		for i, d := range took {
			if d > alone*3/2 {
				t.Errorf("model %d took %v beside the other, alone %v: the executions did not overlap", i, d, alone)
			}
		}
	})
}

// A simulated GPU without an MPS daemon, or in MIG mode, is refused with
// the reason, and its models do not load (G5 of issue 18: before, the
// limiter reported MPS shares that nothing enforced).
func TestSimulatedGPUWithoutMPSIsRefused(t *testing.T) {
	for _, tc := range []struct {
		name string
		set  func(*configs.GPUSimulator)
		want string
	}{
		{"no daemon", func(g *configs.GPUSimulator) { g.MPSDaemon = false }, "has no MPS control daemon"},
		{"MIG", func(g *configs.GPUSimulator) { g.MIG = true }, "is in MIG mode"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				cfg := configs.DefaultServer()
				cfg.GPU.Simulator.Devices = 1
				tc.set(&cfg.GPU.Simulator)
				cfg.Control.Profile.Enabled = false
				reg, _ := simulatedServer(t, cfg, map[string]string{"a": "execution: {provider: cuda}\n"})
				var reason string
				for _, e := range reg.Index(false) {
					if e.Name == "a" {
						reason = e.Reason
					}
				}
				if !strings.Contains(reason, tc.want) || !strings.Contains(reason, "control.limiter: none") {
					t.Errorf("model a: %q, want the refusal (%q) and the way out", reason, tc.want)
				}
				if ready, _ := reg.ModelReady("a", ""); ready {
					t.Error("model a is ready on a GPU whose shares nothing enforces")
				}
			})
		})
	}
}

// A profile measured on the simulator is keyed by the simulator's spec and
// the model's curve: changing either, or moving to a real GPU, profiles
// again instead of reusing it.
func TestSimulatedProfileKey(t *testing.T) {
	cfg := configs.DefaultServer()
	cfg.GPU.Simulator.Devices = 2
	sim, err := newSimulator(cfg.GPU, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	m, err := configs.ParseModel("m.yaml", []byte("name: m\nexecution: {provider: cuda, simulated: {preset: bert-base}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	p := &profiler{sim: sim}
	run := models.ProfileRun{Device: "cuda:1", Config: m}
	a := p.simulated(run)
	m.Execution.Simulated.Fixed = time.Millisecond
	b := p.simulated(run)
	run.Device = "cpu"
	if a == "" || a == b || p.simulated(run) != "" || (&profiler{}).simulated(models.ProfileRun{Device: "cuda:1", Config: m}) != "" {
		t.Errorf("keys %q, %q; cpu %q", a, b, p.simulated(run))
	}
}
