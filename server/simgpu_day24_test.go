package server

import (
	"context"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/runtime"
)

// dayCurve is the latency-critical arrival rate (requests per second) at
// an hour of the day: 3/s at 04:00 rising to 27/s at 16:00, 15/s on
// average.
func dayCurve(hour float64) float64 {
	return 15 - 12*math.Cos(2*math.Pi*(hour-4)/24)
}

// batchJobs are the best-effort batch jobs of the day, [start, end) in
// hours: a night job, one at the afternoon peak and one in the evening.
var batchJobs = [][2]float64{{1, 3}, {13, 14}, {19, 20}}

func inBatchJob(hour float64) (bool, float64) {
	for _, j := range batchJobs {
		if hour >= j[0] && hour < j[1] {
			return true, 0
		}
		if hour < j[0] {
			return false, j[0] - hour
		}
	}
	return false, 24 - hour
}

// simulatedDay24 runs a 24-hour day on one simulated GPU under a share
// policy: the latency-critical model's arrivals follow dayCurve (Poisson,
// SLO 30 ms) and the best-effort model's batch jobs (four closed loops of
// batches of 8) run in batchJobs. The clients are a generator and a pool
// of workers, not a goroutine per request, and each latency-critical
// request's latency counts from its arrival, so a request the workers
// could not take at once still counts its wait.
func simulatedDay24(t *testing.T, policy string) dayResult {
	var res dayResult
	synctest.Test(t, func(t *testing.T) {
		cfg := configs.DefaultServer()
		cfg.GPU.Simulator.Devices = 1
		cfg.Control.Policy = policy
		cfg.Control.Period = time.Second
		cfg.Control.Profile.Runs = 2
		reg, _ := simulatedServer(t, cfg, map[string]string{
			"lc": `execution: {provider: cuda, simulated: {preset: resnet50, fixed: 8ms, saturation: 0.3}}
slo: {latency_ms: 30, class: latency-critical}
profile: {batch_sizes: [1]}
`,
			"be": `max_batch_size: 8
execution: {provider: cuda, simulated: {preset: bert-base, fixed: 10ms, per_item: 3ms, saturation: 0.5}}
profile: {batch_sizes: [1, 8]}
`,
		})
		const day = 24 * time.Hour
		start := time.Now()
		hour := func() float64 { return time.Since(start).Hours() }
		ctx, cancel := context.WithTimeout(t.Context(), day)
		defer cancel()
		var wg sync.WaitGroup
		var sent, met, beDone atomic.Int64

		for range 4 {
			wg.Go(func() {
				req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{8, 16}, Data: make([]byte, 8*64)}}}
				for ctx.Err() == nil {
					if on, wait := inBatchJob(hour()); !on {
						sleepCtx(ctx, time.Duration(wait*float64(time.Hour))+time.Millisecond)
						continue
					}
					if _, _, err := reg.Infer(ctx, "be", "", req); err == nil {
						beDone.Add(1)
					} else {
						time.Sleep(10 * time.Millisecond)
					}
				}
			})
		}

		arrivals := make(chan time.Time, 1<<12)
		data := make([]byte, 64) // read only: shared by the requests
		var workers sync.WaitGroup
		for range 32 {
			workers.Go(func() {
				for t0 := range arrivals {
					req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 16}, Data: data}}}
					_, _, err := reg.Infer(context.WithoutCancel(ctx), "lc", "", req)
					if err == nil && time.Since(t0) <= 30*time.Millisecond {
						met.Add(1)
					}
				}
			})
		}
		rng := rand.New(rand.NewPCG(1, 2))
		for ctx.Err() == nil {
			time.Sleep(time.Duration(rng.ExpFloat64() / dayCurve(hour()) * float64(time.Second)))
			sent.Add(1)
			select {
			case arrivals <- time.Now():
			default: // the client is overwhelmed: a miss
			}
		}
		close(arrivals)
		workers.Wait()
		wg.Wait()
		res = dayResult{lcSent: sent.Load(), lcMet: met.Load(), beDone: beDone.Load()}
	})
	return res
}

// TestSimulatedDay24h runs a whole simulated day (dayCurve, batchJobs) per
// policy named in SLOSERVE_SIMULATED_DAY ("adaptive", "static,adaptive",
// "all") and logs each day's wall time and the latency-critical model's
// attainment. It is skipped without the variable: a day is tens of
// seconds of two cores (minutes under -race), for measuring, not for
// every run. The aim (issue 18) is a day in under 60 s per policy.
func TestSimulatedDay24h(t *testing.T) {
	env := os.Getenv("SLOSERVE_SIMULATED_DAY")
	if env == "" {
		t.Skip("set SLOSERVE_SIMULATED_DAY=adaptive (or static, shared, all, a comma list) to run a 24-hour simulated day")
	}
	policies := strings.Split(env, ",")
	if env == "all" {
		policies = []string{control.SharePolicyShared, control.SharePolicyStatic, control.SharePolicyAdaptive}
	}
	// The expected arrivals: dayCurve's mean (15/s) over a day.
	want := 15.0 * 24 * 3600
	for _, p := range policies {
		t.Run(p, func(t *testing.T) {
			wall := time.Now()
			r := simulatedDay24(t, p)
			took := time.Since(wall)
			t.Logf("%s: 24h simulated in %.1fs of wall time; LC %d sent, attainment %.4f; BE %d batches; %.1fus of wall time per simulated request",
				p, took.Seconds(), r.lcSent, r.attainment(), r.beDone, float64(took.Microseconds())/float64(max(1, r.lcSent+r.beDone)))
			if math.Abs(float64(r.lcSent)-want) > 0.02*want {
				t.Errorf("%d LC requests sent, want %.0f within 2%%: the day did not run whole", r.lcSent, want)
			}
			if r.beDone == 0 {
				t.Error("no best-effort batch ran")
			}
			if p != control.SharePolicyShared && r.attainment() < 0.9 {
				t.Errorf("LC attainment %.3f under %s", r.attainment(), p)
			}
		})
	}
}

func sleepCtx(ctx context.Context, d time.Duration) {
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
	case <-ctx.Done():
	}
}
