package server

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/loadtest"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// gpuDayScenario is the GPU-scale day that `make bench-gpu-day` runs on the
// real binary; simulatedGPUDay replays it here in simulated time.
const gpuDayScenario = "../loadtest/scenarios/gpu-day.yaml"

// gpuDayModel is one model's outcome over the measured window of a
// simulated GPU day, counted as the load generator counts them.
type gpuDayModel struct {
	name, class                  string
	slo                          time.Duration
	sent, good, late             int
	rejected, dropped, failed    int
	firstFailure                 string
	latencies                    []time.Duration // of the answered requests
	resizes, moves               int
	shareSum, shareMin, shareMax float64
	shareSamples                 int
	device                       string
}

func (m *gpuDayModel) attainment() float64 { return float64(m.good) / float64(max(1, m.sent)) }

func (m *gpuDayModel) p99() time.Duration {
	if len(m.latencies) == 0 {
		return 0
	}
	l := slices.Clone(m.latencies)
	slices.Sort(l)
	return l[min(len(l)-1, len(l)*99/100)]
}

// gpuDayResult sums a policy's day.
type gpuDayResult struct {
	policy string
	models []*gpuDayModel
	window time.Duration
	events map[string]int // control and placement events by kind
	// smUtil is the mean SM utilisation of the devices over the window:
	// the fraction of their SMs running kernels held (simgpu.SMSeconds).
	smUtil float64
	// memPeak and memMean are the device memory in use (contexts, weights,
	// arenas, shadows), sampled once a second over the window: the largest
	// on any device and the mean over devices and samples; pinPeak and
	// pinMean the same of the clients' pinned limits (simgpu.MemoryPinned:
	// what the limiter counts when it places a client); memTotal is one
	// device's capacity.
	memPeak, memMean, pinPeak, pinMean, memTotal int64
	// warmPinPeak is the largest pinned memory on one device from the
	// models' load to the window (the loop's first shares after load,
	// each a new client beside the one load started), sampled ten times
	// a second.
	warmPinPeak int64
	// notReady says why the day did not run: a model did not load.
	notReady string
}

// lc sums the latency-critical models: requests sent and met.
func (r gpuDayResult) lc() (sent, good int) {
	for _, m := range r.models {
		if m.class == configs.ClassLatencyCritical {
			sent += m.sent
			good += m.good
		}
	}
	return sent, good
}

// be is the best-effort models' completed requests in the window.
func (r gpuDayResult) be() (done int) {
	for _, m := range r.models {
		if m.class != configs.ClassLatencyCritical {
			done += m.good + m.late
		}
	}
	return done
}

// gpuDayAlone is not a policy but the day's bound: every model with a
// simulated GPU of its own and nothing beside it, under the static policy,
// which gives a model alone on its device the whole device (an MPS client
// at 100%) and profiles it at load like the other policies, so that
// admission and batching predict from its curve. What a model misses
// there its arrivals and its curve make it miss under any policy. (Under
// the shared policy, as it was until 2026-11-29, no limiter runs, so no
// model is profiled and admission and batching learn from executions
// alone: 98.2% against 99.6% with the same devices, seed 18; that was the
// bound adaptive seemed to beat.)
const gpuDayAlone = "alone"

// gpuDayNoBE is not a policy but a bound too: adaptive with the
// best-effort jobs loaded and sending nothing, so that only the
// latency-critical models share the devices. What the latency-critical
// models miss there, sharing the devices with each other costs them under
// any amount of best-effort work.
const gpuDayNoBE = "adaptive-no-be"

// simulatedGPUDay runs gpu-day.yaml (its repository, server settings,
// arrivals and closed loops) against the server's registry, control loops
// and placement on simulated GPUs under testing/synctest: the same day as
// the benchmark with no CPU in the way, so what it measures is what the
// policy and the simulated devices allow.
func simulatedGPUDay(t *testing.T, policy string, seed uint64) gpuDayResult {
	return simulatedGPUDayMix(t, policy, seed, gpuDayMix{})
}

// gpuDayMix scales the GPU day: Copies times its models (copy k of a model
// is named "<model>-<k>" from the second on, with arrivals of its own and
// no pinned device), on Devices simulated GPUs (0: the scenario's).
type gpuDayMix struct {
	Copies, Devices int
	// ProfileCache, when set, is the profile cache the day's server
	// reads and fills (else one of its own, empty): a server started
	// again on a machine that profiled the model files before.
	ProfileCache string
	// HostLateness, when set, gives each simulated device (by index) how
	// late its timer fires (simgpu.Device.SetHostLateness): a busy host.
	HostLateness func(device int) func() time.Duration
}

// simulatedGPUDayMix is simulatedGPUDay on a scaled mix. A day whose models
// do not all load within five simulated minutes (no device with room for
// them) is not run: its result says why in notReady.
func simulatedGPUDayMix(t *testing.T, policy string, seed uint64, mix gpuDayMix) gpuDayResult {
	sc, err := loadtest.LoadScenario(gpuDayScenario)
	if err != nil {
		t.Fatal(err)
	}
	if seed != 0 {
		sc.Seed = seed
	}
	base := map[string]string{}
	for _, m := range sc.Models {
		base[m.Model] = m.Model
	}
	if mix.Copies > 1 {
		models := sc.Models
		for k := 2; k <= mix.Copies; k++ {
			for _, m := range models {
				c := m
				c.Model = m.Model + "-" + strconv.Itoa(k)
				base[c.Model] = m.Model
				sc.Models = append(sc.Models, c)
			}
		}
	}
	repo := sc.Path(sc.Server.Repository)
	configsByName := map[string]string{}
	for i, m := range sc.Models {
		b, err := os.ReadFile(filepath.Join(repo, base[m.Model], "config.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		var kept []string
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "name:") {
				continue
			}
			if mix.Copies > 1 || policy == gpuDayAlone {
				line = strings.Replace(line, " device_id: 0,", "", 1) // placed, not pinned
			}
			if policy == gpuDayAlone { // a device each
				line = strings.Replace(line, "provider: cuda,", fmt.Sprintf("provider: cuda, device_id: %d,", i), 1)
			}
			kept = append(kept, line)
		}
		configsByName[m.Model] = strings.Join(kept, "\n")
	}
	arrivals := make([][]time.Duration, len(sc.Models))
	for i, m := range sc.Models {
		if m.Concurrency == 0 {
			if arrivals[i], err = sc.Arrivals(i); err != nil {
				t.Fatal(err)
			}
		}
	}

	res := gpuDayResult{policy: policy, window: sc.Duration, events: map[string]int{}}
	synctest.Test(t, func(t *testing.T) {
		cfg := configs.DefaultServer()
		for _, kv := range sc.Server.Set {
			k, v, _ := strings.Cut(kv, "=")
			if err := cfg.Set(k, v); err != nil {
				t.Fatal(err)
			}
		}
		// SLOSERVE_SIMULATED_GPU_DAY_SET: more settings, "key=value,...",
		// for measuring one change against the day.
		if extra := os.Getenv("SLOSERVE_SIMULATED_GPU_DAY_SET"); extra != "" {
			for kv := range strings.SplitSeq(extra, ",") {
				k, v, _ := strings.Cut(kv, "=")
				if err := cfg.Set(k, v); err != nil {
					t.Fatal(err)
				}
			}
		}
		cfg.Control.Policy = policy
		if policy == gpuDayAlone {
			cfg.GPU.Simulator.Devices = len(sc.Models)
			cfg.Control.Policy = control.SharePolicyStatic
		}
		if policy == gpuDayNoBE {
			cfg.Control.Policy = control.SharePolicyAdaptive
		}
		if mix.Devices > 0 {
			cfg.GPU.Simulator.Devices = mix.Devices
		}
		cfg.Control.Profile.CacheDir = mix.ProfileCache
		reg, devs, place := placedServer(t, cfg, configsByName)
		if mix.HostLateness != nil {
			for i, d := range devs.sim.Devices() {
				d.SetHostLateness(mix.HostLateness(i))
			}
		}
		loading := time.Now()
		for _, m := range sc.Models {
			for ok, _ := reg.ModelReady(m.Model, ""); !ok; ok, _ = reg.ModelReady(m.Model, "") {
				if time.Since(loading) > 5*time.Minute {
					why := ""
					for _, e := range reg.IndexKnown(false) {
						if e.Name == m.Model {
							why = e.Reason
						}
					}
					res.notReady = fmt.Sprintf("%s did not load on %d devices: %s", m.Model, cfg.GPU.Simulator.Devices, why)
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		}

		// The run starts at -warmup; the window is [0, Duration).
		origin := time.Now().Add(sc.Warmup)
		end := origin.Add(sc.Duration)
		var mu sync.Mutex
		var wg sync.WaitGroup
		record := func(dm *gpuDayModel, sent time.Time, err error) {
			if sent.Before(origin) {
				return
			}
			took := time.Since(sent)
			mu.Lock()
			defer mu.Unlock()
			dm.sent++
			switch {
			case err == nil && took <= dm.slo:
				dm.good++
			case err == nil:
				dm.late++
			case errors.Is(err, qos.ErrRejected), errors.Is(err, qos.ErrQueueFull), errors.Is(err, qos.ErrOverloaded):
				dm.rejected++
			case errors.Is(err, qos.ErrDropped), errors.Is(err, context.DeadlineExceeded):
				dm.dropped++
			default:
				dm.failed++
				if dm.firstFailure == "" {
					dm.firstFailure = err.Error()
				}
			}
			if err == nil {
				dm.latencies = append(dm.latencies, took)
			}
		}
		for i, m := range sc.Models {
			mc, err := reg.ModelConfig(m.Model, "")
			if err != nil {
				t.Fatal(err)
			}
			dm := &gpuDayModel{name: m.Model, class: mc.SLO.Class, slo: time.Duration(mc.SLO.LatencyMS) * time.Millisecond, shareMin: 1}
			res.models = append(res.models, dm)
			timeout := max(4*dm.slo, time.Second)
			rows := 1
			if s, ok := m.Inputs["x"]; ok && len(s.Shape) > 0 {
				rows = int(s.Shape[0])
			}
			newReq := func() *runtime.InferRequest {
				return &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{int64(rows), 16}, Data: make([]byte, rows*64)}}}
			}
			send := func() error {
				ctx, cancel := context.WithTimeout(context.Background(), timeout)
				defer cancel()
				_, _, err := reg.Infer(ctx, m.Model, "", newReq())
				return err
			}
			if m.Concurrency > 0 && policy == gpuDayNoBE {
				continue
			}
			if m.Concurrency > 0 {
				for range m.Concurrency {
					wg.Go(func() {
						for time.Now().Before(end) {
							sent := time.Now()
							err := send()
							record(dm, sent, err)
							if err != nil {
								time.Sleep(10 * time.Millisecond)
							}
						}
					})
				}
				continue
			}
			wg.Go(func() {
				for _, off := range arrivals[i] {
					at := origin.Add(off)
					time.Sleep(time.Until(at))
					wg.Go(func() { record(dm, at, send()) })
				}
			})
		}
		// The devices' SM utilisation over the window.
		wg.Go(func() {
			smSeconds := func() float64 {
				var sum float64
				for _, d := range devs.sim.Devices() {
					sum += d.SMSeconds()
				}
				return sum
			}
			time.Sleep(time.Until(origin))
			from := smSeconds()
			time.Sleep(time.Until(end))
			res.smUtil = (smSeconds() - from) / sc.Duration.Seconds() / float64(len(devs.sim.Devices()))
		})
		// Sample each model's share and device, and the devices' memory,
		// once a second.
		res.memTotal = devs.sim.Devices()[0].MemoryTotal()
		wg.Go(func() {
			var memSum, pinSum, memSamples int64
			defer func() { res.memMean, res.pinMean = memSum/max(memSamples, 1), pinSum/max(memSamples, 1) }()
			for time.Now().Before(origin) {
				time.Sleep(100 * time.Millisecond)
				for _, d := range devs.sim.Devices() {
					res.warmPinPeak = max(res.warmPinPeak, d.MemoryPinned())
				}
			}
			for time.Now().Before(end) {
				time.Sleep(time.Second)
				for _, d := range devs.sim.Devices() {
					used, pinned := d.MemoryUsed(), d.MemoryPinned()
					memSum += used
					pinSum += pinned
					memSamples++
					res.memPeak = max(res.memPeak, used)
					res.pinPeak = max(res.pinPeak, pinned)
				}
				for _, dm := range res.models {
					s, err := reg.Share(dm.name + "/1")
					if err != nil {
						continue
					}
					mu.Lock()
					dm.shareSum += s.Compute
					dm.shareMin = min(dm.shareMin, s.Compute)
					dm.shareMax = max(dm.shareMax, s.Compute)
					dm.shareSamples++
					mu.Unlock()
				}
			}
		})
		wg.Wait()
		byName := map[string]*gpuDayModel{}
		onDevice := map[string]string{}
		for _, dm := range res.models {
			byName[dm.name] = dm
			_, dm.device, _ = reg.VersionKey(dm.name, "")
			if other, ok := onDevice[dm.device]; ok && policy == gpuDayAlone {
				t.Errorf("alone: %s and %s share %s, want a device each", other, dm.name, dm.device)
			}
			onDevice[dm.device] = dm.name
		}
		// Placement's moves (and failed moves) since load, warm-up
		// included: a move then is paid for in the window.
		for _, e := range place.Events(time.Time{}, 0) {
			if e.Kind != control.EventPlace {
				res.events[e.Kind]++
			}
		}
		for _, d := range devs.loops.All() {
			for _, e := range d.Adjuster().Events(origin, 0) {
				res.events[e.Kind]++
				if os.Getenv("SLOSERVE_SIMULATED_GPU_DAY_EVENTS") != "" {
					t.Logf("%s %s %s %s %.2f->%.2f: %s", e.Time.Sub(origin).Round(time.Second), d.Device().Name(), e.Model, e.Kind, e.Old.Compute, e.New.Compute, e.Reason)
				}
				name, _, _ := strings.Cut(e.Model, "/")
				if dm := byName[name]; dm != nil && e.Kind == "resize" {
					dm.resizes++
				}
			}
		}
	})
	return res
}

// gib is bytes in GiB.
func gib(n int64) float64 { return float64(n) / (1 << 30) }

func (r gpuDayResult) log(t *testing.T) {
	for _, m := range r.models {
		share := 0.0
		if m.shareSamples > 0 {
			share = m.shareSum / float64(m.shareSamples)
		}
		t.Logf("%-8s %-16s sent %5d good %5d late %4d rejected %4d dropped %4d failed %d att %.3f p99 %6.1fms share %.2f [%.2f, %.2f] resizes %3d on %s %s",
			r.policy, m.name, m.sent, m.good, m.late, m.rejected, m.dropped, m.failed, m.attainment(), float64(m.p99().Microseconds())/1000,
			share, m.shareMin, m.shareMax, m.resizes, m.device, m.firstFailure)
	}
	sent, good := r.lc()
	t.Logf("%-8s LC attainment %.4f, goodput %.1f/s; BE %.2f requests/s; mean SM utilisation %.3f; events %v", r.policy,
		float64(good)/float64(max(1, sent)), float64(good)/r.window.Seconds(), float64(r.be())/r.window.Seconds(), r.smUtil, r.events)
}

// TestSimulatedGPUDay replays the benchmark's GPU day (gpu-day.yaml) per
// policy in simulated time and compares them as `loadtest --compare` does.
// It is skipped without SLOSERVE_SIMULATED_GPU_DAY (a policy, "alone" for
// the bound of a device per model, "adaptive-no-be" for adaptive without
// best-effort work, a comma list, or "all"): a day is about a minute of two cores, for measuring.
func TestSimulatedGPUDay(t *testing.T) {
	env := os.Getenv("SLOSERVE_SIMULATED_GPU_DAY")
	if env == "" {
		t.Skip("set SLOSERVE_SIMULATED_GPU_DAY=all (or a comma list of policies) to replay the GPU day in simulated time")
	}
	policies := strings.Split(env, ",")
	if env == "all" {
		policies = []string{gpuDayAlone, control.SharePolicyStatic, control.SharePolicyShared, control.SharePolicyAdaptive}
	}
	// The scenario's seed, then the next ones: SLOSERVE_SIMULATED_GPU_DAY_RUNS
	// days per policy, each with other arrivals, and the medians.
	runs := 1
	if n, err := strconv.Atoi(os.Getenv("SLOSERVE_SIMULATED_GPU_DAY_RUNS")); err == nil && n > 1 {
		runs = n
	}
	sc, err := loadtest.LoadScenario(gpuDayScenario)
	if err != nil {
		t.Fatal(err)
	}
	ratios := map[string][]float64{}
	attainments := map[string][]float64{}
	beRates := map[string][]float64{}
	smUtils := map[string][]float64{}
	failed := map[string]int{}
	for run := range runs {
		seed := sc.Seed + uint64(run)
		got := map[string]gpuDayResult{}
		for _, p := range policies {
			wall := time.Now()
			got[p] = simulatedGPUDay(t, p, seed)
			got[p].log(t)
			sent, good := got[p].lc()
			attainments[p] = append(attainments[p], float64(good)/float64(max(1, sent)))
			beRates[p] = append(beRates[p], float64(got[p].be())/got[p].window.Seconds())
			smUtils[p] = append(smUtils[p], got[p].smUtil)
			for _, m := range got[p].models {
				failed[p] += m.failed
			}
			t.Logf("%s, seed %d: day replayed in %.1fs of wall time", p, seed, time.Since(wall).Seconds())
		}
		a, ok := got[control.SharePolicyAdaptive]
		if !ok {
			continue
		}
		_, ag := a.lc()
		for _, p := range []string{control.SharePolicyStatic, control.SharePolicyShared, gpuDayAlone} {
			if o, ok := got[p]; ok {
				_, og := o.lc()
				lc, be := float64(ag)/float64(max(1, og)), float64(a.be())/float64(max(1, o.be()))
				ratios["LC goodput adaptive/"+p] = append(ratios["LC goodput adaptive/"+p], lc)
				ratios["BE throughput adaptive/"+p] = append(ratios["BE throughput adaptive/"+p], be)
				t.Logf("seed %d: adaptive/%s: LC goodput %.3fx, BE throughput %.3fx", seed, p, lc, be)
			}
		}
	}
	for _, p := range policies {
		t.Logf("median of %d: %s LC attainment %.4f %v", runs, p, median(attainments[p]), attainments[p])
		t.Logf("median of %d: %s BE %.1f requests/s, mean SM utilisation %.3f, failed requests %d in all", runs, p, median(beRates[p]), median(smUtils[p]), failed[p])
	}
	for _, k := range slices.Sorted(maps.Keys(ratios)) {
		t.Logf("median of %d: %s %.3fx %v", runs, k, median(ratios[k]), ratios[k])
	}
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if n := len(s); n%2 == 0 {
		return (s[n/2-1] + s[n/2]) / 2
	}
	return s[len(s)/2]
}

// The GPU day in simulated time, on the scenario's own arrivals and two
// more seeds (medians: a day's placement, and with it static's slices,
// varies from run to run): under adaptive the latency-critical models keep
// their SLOs better than with no limits (shared) and at least as well as
// static slices, with few enough resizes on MPS. Before the targets were
// held and capped at the knee, adaptive met 75.9% of the latency-critical
// requests on seed 18 (static 94.8%, shared 84.7%) with 587 resizes; before
// placement saw measured use and memory shares on MPS (not caps and
// memory_limits), 93-95% over ten seeds, 97% after. The best-effort jobs,
// below normal priority, do at least 0.8x shared's work and keep the SMs
// at least 70% busy.
func TestSimulatedGPUDayAdaptive(t *testing.T) {
	if testing.Short() {
		t.Skip("nine simulated GPU days")
	}
	sc, err := loadtest.LoadScenario(gpuDayScenario)
	if err != nil {
		t.Fatal(err)
	}
	const seeds = 3
	attainment := map[string][]float64{}
	goodput := map[string][]float64{}
	beDone := map[string][]float64{}
	var resizes, smUtil []float64
	for run := range seeds {
		for _, p := range []string{control.SharePolicyStatic, control.SharePolicyShared, control.SharePolicyAdaptive} {
			r := simulatedGPUDay(t, p, sc.Seed+uint64(run))
			r.log(t)
			sent, good := r.lc()
			attainment[p] = append(attainment[p], float64(good)/float64(max(1, sent)))
			goodput[p] = append(goodput[p], float64(good))
			beDone[p] = append(beDone[p], float64(r.be()))
			if p == control.SharePolicyAdaptive {
				resizes = append(resizes, float64(r.events[control.EventResize]))
				smUtil = append(smUtil, r.smUtil)
			}
			for _, m := range r.models {
				if m.failed > 0 {
					t.Errorf("%s: %s: %d requests failed (%s)", p, m.name, m.failed, m.firstFailure)
				}
			}
		}
	}
	a := median(attainment[control.SharePolicyAdaptive])
	ag, sg, shg := median(goodput[control.SharePolicyAdaptive]), median(goodput[control.SharePolicyStatic]), median(goodput[control.SharePolicyShared])
	t.Logf("medians of %d: LC attainment adaptive %.4f, static %.4f, shared %.4f; resizes %v", seeds, a,
		median(attainment[control.SharePolicyStatic]), median(attainment[control.SharePolicyShared]), resizes)
	// Within a point of the bound, a device per model (alone, 99.96% on
	// ten seeds since admission plays a model's own queue forward as the
	// dispatcher will batch it: 2026-11-29). Before, admission counted
	// the requests queued ahead in the model's typical batches (1 for
	// services that mostly run alone), refused the second and third of
	// a burst that one batch would have answered in time, and adaptive
	// met 98.3-98.6% (these seeds), alone 99.7%.
	if a < 0.99 {
		t.Errorf("LC attainment under adaptive %.4f (median of %d), want 0.99 at least", a, seeds)
	}
	// Shared met 87% here (adaptive 1.10-1.15x its LC goodput) while a
	// load warmed one instance of a model at two batch sizes: its other
	// instances and sizes paid a 600 ms warm-up at their first batch, and
	// shared, which never replaces an instance, kept them all day. Since a
	// GPU model's load warms each instance at every size a replacement
	// would be (2026-11-29), shared meets about 99.6% on these seeds and
	// adaptive's edge is the batch jobs' work beside it, not the LC goodput.
	if ag < shg {
		t.Errorf("LC goodput adaptive %.0f, shared %.0f (medians): want adaptive at least shared's", ag, shg)
	}
	// Since a kernel's bandwidth follows its SMs in the simulator, static's
	// partitions cost the latency-critical models little (10 seeds: 97.5%
	// against adaptive's 98.4%, LC goodput 1.01x) and the two are within a
	// seed's noise of each other over 3 seeds (63,387 against 63,487 once).
	// What adaptive gains over static is the batch jobs' work, at the
	// same LC goodput.
	if ag < 0.98*sg {
		t.Errorf("LC goodput adaptive %.0f, static %.0f (medians): want adaptive 0.98x static's at least", ag, sg)
	}
	if abe, sbe := median(beDone[control.SharePolicyAdaptive]), median(beDone[control.SharePolicyStatic]); abe < 1.5*sbe {
		t.Errorf("BE throughput adaptive %.0f, static %.0f (medians): want adaptive 1.5x static's at least", abe, sbe)
	}
	if n := median(resizes); n > 60 {
		t.Errorf("adaptive resized %.0f times (median) in the 6-minute window: each is a new MPS client; want 60 at most", n)
	}
	// Best-effort clients below normal priority fill what the
	// latency-critical ones leave: before, with caps that left each
	// latency-critical model its single-request knee, the batch jobs did
	// 0.30x shared's work (10 seeds) and the devices' SMs sat idle.
	abe, shbe := median(beDone[control.SharePolicyAdaptive]), median(beDone[control.SharePolicyShared])
	t.Logf("medians of %d: BE requests adaptive %.0f, shared %.0f; mean SM utilisation under adaptive %.3f", seeds, abe, shbe, median(smUtil))
	if abe < 0.8*shbe {
		t.Errorf("BE throughput adaptive %.0f, shared %.0f (medians): want adaptive 0.8x shared at least", abe, shbe)
	}
	if u := median(smUtil); u < 0.7 {
		t.Errorf("mean SM utilisation under adaptive %.3f (median), want 0.70 at least", u)
	}
}

// gpusNeededCopies scales the GPU day to 36 models for the GPUs-needed
// sweep: three copies of its twelve.
const gpusNeededCopies = 3

// gpusNeededPolicies are the sweep's policies: exclusive is one model per
// GPU (what a cluster does without sharing: the alone bound's devices).
var gpusNeededPolicies = []string{"exclusive", control.SharePolicyStatic, control.SharePolicyShared, control.SharePolicyAdaptive}

// TestSimulatedGPUsNeeded sweeps the number of simulated GPUs for the GPU
// day scaled to 36 models (three copies of its twelve, each with arrivals
// of its own, placement on) and prints, per policy, the fewest GPUs that
// keep LC attainment at 95% or more with no failed request:
// `gpus-needed <policy> <N>`, with the mean SM utilisation of the devices
// on that day. Exclusive needs a GPU per model by definition, checked at
// that count. It is skipped without SLOSERVE_SIMULATED_GPUS_NEEDED (a
// comma list of policies, or "all"); a day of 36 models is a few tens of
// seconds of two cores, and a policy's search a handful of days.
func TestSimulatedGPUsNeeded(t *testing.T) {
	env := os.Getenv("SLOSERVE_SIMULATED_GPUS_NEEDED")
	if env == "" {
		t.Skip("set SLOSERVE_SIMULATED_GPUS_NEEDED=all (or a comma list of exclusive, static, shared, adaptive) to sweep the GPUs the scaled GPU day needs")
	}
	policies := strings.Split(env, ",")
	if env == "all" {
		policies = gpusNeededPolicies
	}
	sc, err := loadtest.LoadScenario(gpuDayScenario)
	if err != nil {
		t.Fatal(err)
	}
	models := gpusNeededCopies * len(sc.Models)
	type day struct {
		ok       bool
		att, sm  float64
		failed   int
		notReady string
	}
	// One profile cache for the sweep, as on a machine that serves the
	// day again: from the second day on every model's working sets are
	// known at load, and a model starts at them (firstmemory.go).
	cache := t.TempDir()
	run := func(policy string, n int) day {
		mix := gpuDayMix{Copies: gpusNeededCopies, Devices: n, ProfileCache: cache}
		p := policy
		if policy == "exclusive" {
			p, mix.Devices = gpuDayAlone, 0 // alone: a device per model
		}
		r := simulatedGPUDayMix(t, p, sc.Seed, mix)
		if r.notReady != "" {
			t.Logf("%s on %d GPUs: %s", policy, n, r.notReady)
			return day{notReady: r.notReady}
		}
		if os.Getenv("SLOSERVE_SIMULATED_GPUS_NEEDED_LOG") != "" {
			r.log(t)
		}
		sent, good := r.lc()
		d := day{att: float64(good) / float64(max(1, sent)), sm: r.smUtil}
		for _, m := range r.models {
			d.failed += m.failed
		}
		d.ok = d.att >= 0.95 && d.failed == 0
		t.Logf("%s on %d GPUs: LC attainment %.4f, BE %.1f requests/s, failed %d, mean SM utilisation %.3f, device memory in use mean %.2f GiB, peak %.2f GiB, pinned mean %.2f GiB, peak %.2f GiB (%.2f GiB before the window), of %.0f GiB",
			policy, n, d.att, float64(r.be())/r.window.Seconds(), d.failed, d.sm, gib(r.memMean), gib(r.memPeak), gib(r.pinMean), gib(r.pinPeak), gib(r.warmPinPeak), gib(r.memTotal))
		return d
	}
	// SLOSERVE_SIMULATED_GPUS_NEEDED_AT=N runs each policy's day on N GPUs
	// only, with every model's outcome (for looking into one count).
	// The cache is warmed first by a day on a GPU per model, as the
	// sweep's first probe warms it.
	if n, err := strconv.Atoi(os.Getenv("SLOSERVE_SIMULATED_GPUS_NEEDED_AT")); err == nil {
		for _, policy := range policies {
			run(policy, models)
			t.Setenv("SLOSERVE_SIMULATED_GPUS_NEEDED_LOG", "1")
			run(policy, n)
			t.Setenv("SLOSERVE_SIMULATED_GPUS_NEEDED_LOG", "")
		}
		return
	}
	for _, policy := range policies {
		if policy == "exclusive" {
			d := run(policy, models)
			if !d.ok {
				t.Errorf("exclusive: LC attainment %.4f with %d failed on %d GPUs", d.att, d.failed, models)
			}
			t.Logf("gpus-needed exclusive %d (mean SM utilisation %.3f)", models, d.sm)
			continue
		}
		// The fewest N in [1, models] with an ok day, by bisection
		// (more GPUs never hurt a policy here by much; each probe is a
		// day).
		lo, hi := 0, models // lo fails (or is 0), hi is ok or the top
		var best day
		best = run(policy, hi)
		if !best.ok {
			t.Logf("gpus-needed %s >%d (not met with a GPU per model)", policy, models)
			continue
		}
		for hi-lo > 1 {
			mid := (lo + hi) / 2
			if d := run(policy, mid); d.ok {
				hi, best = mid, d
			} else {
				lo = mid
			}
		}
		t.Logf("gpus-needed %s %d (LC attainment %.4f, mean SM utilisation %.3f)", policy, hi, best.att, best.sm)
	}
}

// The GPU day on a busy host: every simulated device's timer fires late,
// by an exponentially distributed delay with a mean of 1 ms (a Go timer
// of 1-5 ms on the development machine at load 9 fired 0.3 ms late at the
// median, 1.1 ms at p90, 8.7 ms at p99), as on the real binary, where the
// devices' timers run on two shared cores. There adaptive met less than
// static (0.67-0.88x its LC attainment on shortened days, 90.4% against
// 93.1% on the whole day alone): each event on a device (a launch's end,
// a below-normal kernel's yield at its block boundary, a kernel's end)
// waited for the host, and adaptive's services, which wait for the batch
// jobs' blocks, had one such wait more than static's; and every resize
// left the new client cold at the batch sizes between 1 and the largest,
// whose first live batch paid a new shape's warm-up (200-600 ms against
// SLOs of 15-60 ms). The devices now play their events at their own times
// and a service's replacements are warmed at every size: adaptive meets
// static's attainment on a busy host too (within static's own spread from
// run to run), with 1.5x its best-effort work and more.
func TestSimulatedGPUDayBusyHost(t *testing.T) {
	if testing.Short() {
		t.Skip("two simulated GPU days")
	}
	busy := gpuDayMix{HostLateness: func(device int) func() time.Duration {
		rng := rand.New(rand.NewPCG(18, uint64(device)))
		return func() time.Duration { return time.Duration(rng.ExpFloat64() * float64(time.Millisecond)) }
	}}
	got := map[string]gpuDayResult{}
	for _, p := range []string{control.SharePolicyStatic, control.SharePolicyAdaptive} {
		got[p] = simulatedGPUDayMix(t, p, 0, busy)
		got[p].log(t)
		for _, m := range got[p].models {
			if m.failed > 0 {
				t.Errorf("%s: %s: %d requests failed (%s)", p, m.name, m.failed, m.firstFailure)
			}
		}
	}
	att := func(p string) float64 {
		sent, good := got[p].lc()
		return float64(good) / float64(max(1, sent))
	}
	a, s := att(control.SharePolicyAdaptive), att(control.SharePolicyStatic)
	abe, sbe := got[control.SharePolicyAdaptive].be(), got[control.SharePolicyStatic].be()
	t.Logf("busy host: LC attainment adaptive %.4f, static %.4f; BE adaptive %d, static %d (%.2fx)", a, s, abe, sbe, float64(abe)/float64(max(1, sbe)))
	// Static's attainment on this day moves by half a point from run to
	// run (99.18-99.63% in seven runs: its placement and resizes follow
	// the goroutines' order), adaptive's by a tenth (99.55-99.65%); in
	// one run of seven static was 0.04 points over adaptive. Before the
	// fixes adaptive was 1.2 points under static (97.36% against 98.58%).
	if a < 0.99 || a < s-0.002 {
		t.Errorf("LC attainment on a busy host: adaptive %.4f, static %.4f: want adaptive at least 0.99 and no more than 0.2 points under static", a, s)
	}
	if float64(abe) < 1.5*float64(sbe) {
		t.Errorf("best-effort work on a busy host: adaptive %d, static %d, want 1.5x at least", abe, sbe)
	}
}
