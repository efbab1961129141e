package server

import (
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/predictor"
	"github.com/sloserve/sloserve/runtime"
)

// On a simulated GPU under MPS the measured use of the device by the work
// co-running with a model reaches its predictions (device loop ->
// Predictor.SetCoRunning): the predictor learns how much the co-runners
// slow the model and predicts each execution at the use expected.
//
// A latency-critical model (kernels fill 0.3 of the SMs) is sent 5
// requests a second, one at a time, beside a best-effort model whose
// closed-loop batches come and go in phases of 8 s (static policy: half
// of the device each, so the SMs do not oversubscribe, and the batches'
// memory bandwidth slows the other's kernels, by up to 1.25x). Each
// latency-critical execution is predicted by the server's predictor and
// by one beside it that has the same profile and sees the same
// executions but not the others' use: its online correction alone learns
// each phase's slowdown after the fact. Measured: MAPE 3.4% against 5.3%,
// the learnt factor 1.19 mid-phase while the batches run and 1.03 while
// they do not. (The shared policy, where the SMs would oversubscribe,
// enforces nothing and so profiles nothing: no curve to compare.)
func TestSimulatedCoRunningEntersPrediction(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := configs.DefaultServer()
		cfg.GPU.Simulator.Devices = 1
		cfg.Control.Policy = control.SharePolicyStatic
		cfg.Control.Period = time.Second
		cfg.Control.Profile.Runs = 2
		reg, devs := simulatedServer(t, cfg, map[string]string{
			"lc": `execution: {provider: cuda, simulated: {preset: resnet50, fixed: 8ms, saturation: 0.3}}
slo: {latency_ms: 1000, class: latency-critical}
profile: {batch_sizes: [1]}
`,
			"be": `max_batch_size: 8
execution: {provider: cuda, simulated: {preset: bert-base, fixed: 10ms, per_item: 3ms, saturation: 1}}
slo: {latency_ms: 10000, class: best-effort}
profile: {batch_sizes: [1, 8]}
`,
		})
		for _, name := range []string{"lc", "be"} {
			for ok, _ := reg.ModelReady(name, ""); !ok; ok, _ = reg.ModelReady(name, "") {
				time.Sleep(100 * time.Millisecond)
			}
		}
		// Profiled (the sweep runs after the model is ready).
		for i := 0; !devs.pred.Accuracy("lc/1").HasCurve; i++ {
			if i == 600 {
				t.Fatalf("lc/1 not profiled after 60 s: %+v", devs.pred.Accuracy("lc/1"))
			}
			time.Sleep(100 * time.Millisecond)
		}
		// The blind predictor: the latency-critical model's profile (the
		// one of batch 1 only) from the server's cache.
		blind, err := predictor.New(predictor.Options{})
		if err != nil {
			t.Fatal(err)
		}
		files, _ := filepath.Glob(filepath.Join(cfg.Control.Profile.CacheDir, "*.json"))
		for _, f := range files {
			var p predictor.Profile
			if data, err := os.ReadFile(f); err != nil || json.Unmarshal(data, &p) != nil {
				t.Fatalf("profile %s: %v", f, err)
			}
			if !slices.ContainsFunc(p.Points, func(pt predictor.Point) bool { return pt.Batch != 1 }) {
				blind.SetProfile("lc/1", p)
			}
		}
		if !blind.Accuracy("lc/1").HasCurve {
			t.Fatalf("no profile of lc among %v", files)
		}
		share, _ := reg.Share("lc/1")
		blind.SetShare("lc/1", share.Compute)

		const phase, phases = 8 * time.Second, 12
		ctx, cancel := context.WithTimeout(t.Context(), phases*phase)
		defer cancel()
		var wg sync.WaitGroup
		wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				on, stop := context.WithTimeout(ctx, phase)
				if i%2 == 1 {
					<-on.Done() // an idle phase
					stop()
					continue
				}
				var clients sync.WaitGroup
				for range 4 {
					clients.Go(func() {
						req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{8, 16}, Data: make([]byte, 8*64)}}}
						for on.Err() == nil {
							if _, _, err := reg.Infer(on, "be", "", req); err != nil {
								time.Sleep(10 * time.Millisecond)
							}
						}
					})
				}
				clients.Wait()
				stop()
			}
		})
		var withErr, blindErr []float64
		var busyInterference, idleInterference []float64
		start := time.Now()
		for ctx.Err() == nil {
			const elements = 16
			pw, ok1 := devs.pred.EstimateSize("lc/1", 1, elements)
			pb, ok2 := blind.EstimateSize("lc/1", 1, elements)
			took := infer(t, reg, "lc")
			blind.ObserveSize("lc/1", 1, elements, took)
			// The first two phases teach both; then the error counts.
			if time.Since(start) > 2*phase && ok1 && ok2 {
				withErr = append(withErr, math.Abs(pw.Seconds()-took.Seconds())/took.Seconds())
				blindErr = append(blindErr, math.Abs(pb.Seconds()-took.Seconds())/took.Seconds())
				// Mid-phase, the factor in force.
				if in := time.Since(start) % (2 * phase); in > phase/2 && in < phase-time.Second {
					busyInterference = append(busyInterference, devs.pred.Accuracy("lc/1").Interference)
				} else if in > phase+phase/2 && in < 2*phase-time.Second {
					idleInterference = append(idleInterference, devs.pred.Accuracy("lc/1").Interference)
				}
			}
			time.Sleep(200*time.Millisecond - took)
		}
		cancel()
		wg.Wait()
		mean := func(xs []float64) float64 {
			var s float64
			for _, x := range xs {
				s += x
			}
			return s / float64(max(1, len(xs)))
		}
		a := devs.pred.Accuracy("lc/1")
		with, without := mean(withErr), mean(blindErr)
		t.Logf("lc: %d executions; MAPE %.1f%% with the co-runners' use, %.1f%% without; slope %.3f; interference x%.2f mid-busy, x%.2f mid-idle",
			len(withErr), 100*with, 100*without, a.CoRunSlope, mean(busyInterference), mean(idleInterference))
		if len(withErr) < 200 {
			t.Fatalf("%d executions measured, want 200 or more", len(withErr))
		}
		if with > 0.8*without {
			t.Errorf("MAPE %.1f%% with the co-runners' use, over 0.8 times the %.1f%% without", 100*with, 100*without)
		}
		// With a kernel's bandwidth following its SMs, the batch job below
		// normal priority slows lc by about a tenth (x1.10 against x1.02
		// idle); without the device loop's signal both read x1.00.
		if b, i := mean(busyInterference), mean(idleInterference); b < 1.05 || b-i < 0.05 {
			t.Errorf("interference factor x%.2f while the best-effort model runs, x%.2f while it is idle; want over 1.05 and 0.05 above idle", b, i)
		}
	})
}
