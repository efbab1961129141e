package server

import (
	"context"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/runtime"
)

// dayResult is what one policy's simulated day gave the latency-critical
// model.
type dayResult struct {
	lcSent, lcMet, beDone int64
}

func (r dayResult) attainment() float64 { return float64(r.lcMet) / float64(max(1, r.lcSent)) }

// simulatedDay runs a latency-critical model (a daily curve of Poisson
// arrivals, SLO 30 ms) beside a best-effort model that batches flat out,
// on one simulated GPU under a share policy, for span of simulated time.
func simulatedDay(t *testing.T, policy string, span time.Duration) dayResult {
	var res dayResult
	synctest.Test(t, func(t *testing.T) {
		cfg := configs.DefaultServer()
		cfg.GPU.Simulator.Devices = 1
		cfg.Control.Policy = policy
		cfg.Control.Period = time.Second
		cfg.Control.Profile.Runs = 3
		reg, devs := simulatedServer(t, cfg, map[string]string{
			"lc": `execution: {provider: cuda, simulated: {preset: resnet50, fixed: 8ms, saturation: 0.3}}
slo: {latency_ms: 30, class: latency-critical}
profile: {batch_sizes: [1]}
`,
			"be": `max_batch_size: 8
execution: {provider: cuda, simulated: {preset: bert-base, fixed: 10ms, per_item: 3ms, saturation: 0.5}}
profile: {batch_sizes: [1, 8]}
`,
		})
		// The day starts once both models are loaded and profiled, as a
		// deployment's does: a profile taken under the day's load would
		// measure the other model's kernels too.
		for _, m := range []string{"lc", "be"} {
			for ok, _ := reg.ModelReady(m, ""); !ok; ok, _ = reg.ModelReady(m, "") {
				time.Sleep(100 * time.Millisecond)
			}
		}
		ctx, cancel := context.WithTimeout(t.Context(), span)
		defer cancel()
		var wg sync.WaitGroup
		var sent, met, beDone atomic.Int64

		// Best effort: four closed-loop clients sending batches of 8.
		for range 4 {
			wg.Go(func() {
				req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{8, 16}, Data: make([]byte, 8*64)}}}
				for ctx.Err() == nil {
					if _, _, err := reg.Infer(ctx, "be", "", req); err == nil {
						beDone.Add(1)
					} else {

						time.Sleep(10 * time.Millisecond)
					}
				}
			})
		}
		// Latency-critical: Poisson arrivals, 10 to 40 per second over a
		// sine "day".
		rng := rand.New(rand.NewPCG(1, 2))
		start := time.Now()
		for ctx.Err() == nil {
			phase := 2 * math.Pi * float64(time.Since(start)) / float64(span)
			rate := 25 - 15*math.Cos(phase)
			time.Sleep(time.Duration(rng.ExpFloat64() / rate * float64(time.Second)))
			sent.Add(1)
			wg.Go(func() {
				req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 16}, Data: make([]byte, 64)}}}
				t0 := time.Now()
				_, _, err := reg.Infer(context.WithoutCancel(ctx), "lc", "", req)
				if err == nil && time.Since(t0) <= 30*time.Millisecond {
					met.Add(1)
				}
			})
		}
		wg.Wait()
		lcShare, _ := reg.Share("lc/1")
		beShare, _ := reg.Share("be/1")
		t.Logf("%s: shares at the end: lc %+v, be %+v; lc correction %.2f", policy, lcShare, beShare, devs.pred.Accuracy("lc/1").Correction)
		if testing.Verbose() {
			for _, sh := range []float64{0.1, 0.2, 0.3, 0.5, 0.8, 1} {
				l, _ := devs.pred.Latency("lc/1", 1, sh)
				t.Logf("lc/1 predicted at share %.1f: %s; accuracy %+v", sh, l, devs.pred.Accuracy("lc/1"))
			}
			k, ok := devs.pred.Knee("lc/1", 1)
			t.Logf("lc/1 knee at batch 1: %v %v", k, ok)
			for _, st := range devs.all()[0].sched.Snapshot() {
				t.Logf("%s: arrival SCV %.2f service SCV %.2f", st.Spec.Name, st.ArrivalSCV, st.ServiceSCV)
			}
			for _, d := range devs.all() {
				for _, e := range d.adj.Events(time.Time{}, 0) {
					t.Logf("%s %s %s %.2f->%.2f: %s", e.Time.Format("15:04:05"), e.Model, e.Kind, e.Old.Compute, e.New.Compute, e.Reason)
				}
			}
		}
		res = dayResult{lcSent: sent.Load(), lcMet: met.Load(), beDone: beDone.Load()}
	})
	return res
}

// A simulated stretch of a day per share policy, a latency-critical model
// beside a best-effort one on one simulated GPU. Static slices keep the
// latency-critical model's SLO better than no limits (shared), where the
// best-effort batches oversubscribe the SMs; adaptive keeps it better than
// shared and gives the best-effort model more than static does.
//
// Adaptive does not yet beat static on the latency-critical SLO (96.3%
// against 98.9% here). Before the adjuster knew that MPS has no floors
// (AdjusterOptions.CapsOnly) it starved the model to 0%: a floor is
// predicted at the whole device but MPS enforces it as a cap, the first
// floor (0.05: profiling at shares >= 1/4 does not show the knee at 0.3)
// ran 5x slower than predicted, the online correction rose until
// admission rejected every request, and with no executions it never came
// back down.
func TestSimulatedDayPolicies(t *testing.T) {
	if testing.Short() {
		t.Skip("a simulated stretch of a day per policy")
	}
	span := 10 * time.Minute
	got := map[string]dayResult{}
	for _, p := range []string{configs.SharePolicyShared, configs.SharePolicyStatic, configs.SharePolicyAdaptive} {
		got[p] = simulatedDay(t, p, span)
		t.Logf("%-8s LC %d sent, attainment %.3f; BE %d batches", p, got[p].lcSent, got[p].attainment(), got[p].beDone)
	}
	shared, static, adaptive := got[configs.SharePolicyShared], got[configs.SharePolicyStatic], got[configs.SharePolicyAdaptive]
	if static.attainment() < shared.attainment()+0.02 {
		t.Errorf("LC attainment static %.3f, shared %.3f: want static ahead by 2 points at least", static.attainment(), shared.attainment())
	}
	if adaptive.attainment() < shared.attainment()+0.01 {
		t.Errorf("LC attainment adaptive %.3f, shared %.3f: want adaptive ahead by a point at least", adaptive.attainment(), shared.attainment())
	}
	if adaptive.beDone <= static.beDone {
		t.Errorf("BE batches adaptive %d, static %d: want adaptive ahead (it gives the best-effort model what the other leaves)", adaptive.beDone, static.beDone)
	}
	if shared.beDone <= static.beDone {
		t.Errorf("BE batches shared %d, static %d: want shared ahead (no cap on the best-effort model)", shared.beDone, static.beDone)
	}
}
