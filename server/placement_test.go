package server

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/device"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// placedServer is simulatedServer with gpu.placement wired as Run wires
// it: the registry places cuda models without a device_id and the placer
// re-places them every period.
func placedServer(t *testing.T, cfg *configs.Server, modelConfigs map[string]string) (*models.Registry, *house, *device.Placement) {
	t.Helper()
	cfg.Repositories = []string{tinyRepo(t, modelConfigs)}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	h := assembledServer(t, cfg)
	if h.place == nil {
		t.Fatal("no placement")
	}
	return h.reg, h, h.place
}

func deviceOfModel(t *testing.T, reg *models.Registry, model string) string {
	t.Helper()
	_, dev, err := reg.VersionKey(model, "")
	if err != nil {
		t.Fatal(err)
	}
	return dev
}

// Three latency-critical models that name no device load on two simulated
// GPUs, two on one and one on the other. Then the two that share a device
// get busy while the lone one idles: the placer moves one of the busy pair
// to the other device by a warm shadow, while every model takes traffic,
// and not one request fails. The move is an event with its reason.
//
// Under the static policy with an SLO of a second admission refuses
// nothing, so every failure would be the move's. Under the adaptive policy
// admission refuses some requests while it sizes the models (its start on
// MPS, not placement's): those are counted apart, and every other error
// fails the test.
func TestPlacementMovesADriftingModelWithoutFailures(t *testing.T) {
	for _, policy := range []string{control.SharePolicyStatic, control.SharePolicyAdaptive} {
		t.Run(policy, func(t *testing.T) { placementMove(t, policy) })
	}
}

func placementMove(t *testing.T, policy string) {
	synctest.Test(t, func(t *testing.T) {
		cfg := configs.DefaultServer()
		cfg.GPU.Simulator.Devices = 2
		cfg.GPU.Placement = configs.GPUPlacement{Enabled: true, Period: 10 * time.Second, MinGain: 0.1, MinResidence: 30 * time.Second}
		cfg.Control.Period = time.Second
		cfg.Control.Profile.Runs = 2
		cfg.Control.Policy = policy
		model := `execution: {provider: cuda, simulated: {preset: resnet50, fixed: 8ms, saturation: 0.5}}
slo: {latency_ms: 1000, class: latency-critical}
resources: {memory_limit: 2GiB}
profile: {batch_sizes: [1]}
`
		reg, devs, place := placedServer(t, cfg, map[string]string{"a": model, "b": model, "c": model})

		at := map[string][]string{}
		for _, m := range []string{"a", "b", "c"} {
			d := deviceOfModel(t, reg, m)
			at[d] = append(at[d], m)
		}
		if len(at["cuda:0"])+len(at["cuda:1"]) != 3 || len(at["cuda:0"]) == 0 || len(at["cuda:1"]) == 0 {
			t.Fatalf("placed at load: %v, want the three models over both devices", at)
		}
		pair, lone := at["cuda:0"], at["cuda:1"]
		if len(pair) == 1 {
			pair, lone = lone, pair
		}
		placeEvents := 0
		for _, e := range place.Events(time.Time{}, 0) {
			if e.Kind == control.EventPlace {
				placeEvents++
			}
		}
		if placeEvents != 3 {
			t.Errorf("%d place events, want 3", placeEvents)
		}

		ctx, stop := context.WithTimeout(t.Context(), 3*time.Minute)
		defer stop()
		var (
			wg           sync.WaitGroup
			sent, failed atomic.Int64
			firstErr     atomic.Pointer[error]
		)
		rng := rand.New(rand.NewPCG(3, 4))
		var refused atomic.Int64
		count := func(err error) {
			if policy == control.SharePolicyAdaptive && (errors.Is(err, qos.ErrRejected) || errors.Is(err, qos.ErrDropped)) {
				refused.Add(1)
				return
			}
			failed.Add(1)
			firstErr.CompareAndSwap(nil, &err)
		}
		rates := map[string]float64{pair[0]: 45, pair[1]: 45, lone[0]: 2}
		for m, rate := range rates {
			seed := rng.Uint64()
			wg.Go(func() {
				r := rand.New(rand.NewPCG(seed, 1))
				for ctx.Err() == nil {
					time.Sleep(time.Duration(r.ExpFloat64() / rate * float64(time.Second)))
					wg.Go(func() {
						req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 16}, Data: make([]byte, 64)}}}
						sent.Add(1)
						if _, _, err := reg.Infer(context.WithoutCancel(ctx), m, "", req); err != nil {
							count(err)
						}
					})
				}
			})
		}
		// Closed-loop clients keep the busy pair's queues non-empty, so a
		// move always finds requests queued on the old device.
		for _, m := range pair {
			for range 3 {
				wg.Go(func() {
					for ctx.Err() == nil {
						req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 16}, Data: make([]byte, 64)}}}
						sent.Add(1)
						if _, _, err := reg.Infer(context.WithoutCancel(ctx), m, "", req); err != nil {
							count(err)
							time.Sleep(10 * time.Millisecond) // a refusal is immediate: back off
						}
					}
				})
			}
		}
		wg.Wait()

		var moves []control.Event
		for _, e := range place.Events(time.Time{}, 0) {
			switch e.Kind {
			case control.EventMove:
				moves = append(moves, e)
			case control.EventError:
				t.Errorf("placement error: %s", e.Reason)
			}
		}
		if len(moves) == 0 {
			t.Fatalf("no move in 3 minutes; events %+v", place.Events(time.Time{}, 0))
		}
		for _, e := range moves {
			t.Logf("move of %s to %s: %s", e.Model, e.Device, e.Reason)
			if !strings.Contains(e.Reason, "warm shadow") || !strings.Contains(e.Reason, "cost lower by") {
				t.Errorf("move event without its reason: %+v", e)
			}
		}
		if d0, d1 := deviceOfModel(t, reg, pair[0]), deviceOfModel(t, reg, pair[1]); d0 == d1 {
			t.Errorf("the busy pair %v still shares %s", pair, d0)
		}
		moved := moves[0].Model
		if moved != pair[0] && moved != pair[1] {
			t.Errorf("moved %s, want one of the busy pair %v", moved, pair)
		}
		// The moved model serves from its new device, and only the
		// scheduler of each model's device has it.
		infer(t, reg, moved)
		for _, m := range []string{"a", "b", "c"} {
			at := deviceOfModel(t, reg, m)
			for _, d := range devs.loops.All() {
				if has := d.Device().Scheduler().HasModel(m + "/1"); has != (d.Device().Name() == at) {
					t.Errorf("%s runs on %s, but %s's scheduler has it: %v", m, at, d.Device().Name(), has)
				}
			}
		}
		if n := failed.Load(); n > 0 {
			t.Errorf("%d of %d requests failed across the moves; first: %v", n, sent.Load(), *firstErr.Load())
		}
		t.Logf("%d requests, %d failed, %d refused by admission; placement at the end: a %s, b %s, c %s", sent.Load(), failed.Load(), refused.Load(),
			deviceOfModel(t, reg, "a"), deviceOfModel(t, reg, "b"), deviceOfModel(t, reg, "c"))
	})
}

// A model whose config names its device is pinned: placement leaves it
// there however busy its device, and places the others around it.
func TestPlacementKeepsPinnedModels(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := configs.DefaultServer()
		cfg.GPU.Simulator.Devices = 2
		cfg.GPU.Placement = configs.GPUPlacement{Enabled: true, Period: 10 * time.Second, MinGain: 0.1, MinResidence: 10 * time.Second}
		cfg.Control.Profile.Enabled = false
		pinned := "execution: {provider: cuda, device_id: 1, simulated: {preset: mobilenet}}\nslo: {latency_ms: 50, class: latency-critical}\n"
		free := "execution: {provider: cuda, simulated: {preset: mobilenet}}\nslo: {latency_ms: 50, class: latency-critical}\n"
		reg, _, place := placedServer(t, cfg, map[string]string{"p": pinned, "q": pinned, "f": free})
		if d := deviceOfModel(t, reg, "f"); d != "cuda:0" {
			t.Errorf("f placed on %s, want cuda:0 (cuda:1 holds the two pinned models)", d)
		}
		time.Sleep(time.Minute)
		for _, m := range []string{"p", "q"} {
			if d := deviceOfModel(t, reg, m); d != "cuda:1" {
				t.Errorf("pinned %s on %s, want cuda:1", m, d)
			}
		}
		if err := reg.Move(t.Context(), "p/1", "cuda:0"); err == nil || !strings.Contains(err.Error(), "names device 1") {
			t.Errorf("moving a pinned model: %v, want a refusal", err)
		}
		for _, e := range place.Events(time.Time{}, 0) {
			if e.Model == "p" || e.Model == "q" {
				t.Errorf("event for a pinned model: %+v", e)
			}
		}
	})
}

// Under the adaptive policy on MPS placement sees a latency-critical model
// as it runs, not as its cap: its demand is the SM use NVML measured over
// the utilisation bound (its cap is a ceiling at a knee, and keeps nothing
// from the others), and its memory is the memory share the policy sized
// from its working set, not its memory_limit.
func TestPlacementSeesUseAndMemoryShareOnMPS(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := configs.DefaultServer()
		cfg.GPU.Simulator.Devices = 1
		cfg.GPU.Placement.Enabled = true
		cfg.Control.Policy = control.SharePolicyAdaptive
		model := "max_batch_size: 4\nslo: {latency_ms: 30, class: latency-critical}\n" +
			"execution: {provider: cuda, simulated: {preset: resnet50, fixed: 6ms, saturation: 0.3}}\nresources: {memory_limit: 4GiB}\n"
		reg, devs, place := placedServer(t, cfg, map[string]string{"m": model})
		ctx, stop := context.WithCancel(t.Context())
		var traffic sync.WaitGroup
		traffic.Go(func() {
			req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 16}, Data: make([]byte, 64)}}}
			for ctx.Err() == nil {
				reg.Infer(ctx, "m", "", req)
				time.Sleep(50 * time.Millisecond) // about 18 requests a second
			}
		})
		time.Sleep(40 * time.Second)
		synctest.Wait()
		_, ms := place.Snapshot()
		stop()
		traffic.Wait()
		if len(ms) != 1 {
			t.Fatalf("snapshot %+v, want m", ms)
		}
		d := devs.loops.Lookup("cuda:0")
		var target float64
		for _, s := range d.Adjuster().Shares() {
			if s.Model == "m/1" {
				target = s.Target
			}
		}
		use, ok := d.Usage("m/1")
		if !ok || target <= 0 {
			t.Fatalf("no measured use (%v) or no target (%.2f) after 40s of traffic", ok, target)
		}
		want := min(use/cfg.Control.MaxUtilization, target)
		if got := ms[0].Demand; got < want-1e-9 || got > want+1e-9 || got >= target {
			t.Errorf("demand %.3f, want the measured use %.3f over the bound %.2f (%.3f), under the cap %.2f", got, use, cfg.Control.MaxUtilization, want, target)
		}
		sh, err := reg.Share("m/1")
		if err != nil {
			t.Fatal(err)
		}
		if ms[0].Memory != sh.Memory || sh.Memory <= 0 || sh.Memory >= 4<<30 {
			t.Errorf("placement memory %dMiB, want the memory share %dMiB (under the 4GiB limit)", ms[0].Memory>>20, sh.Memory>>20)
		}
		t.Logf("demand %.3f (use %.3f, cap %.2f), memory %dMiB", ms[0].Demand, use, target, ms[0].Memory>>20)
	})
}
