package server

import (
	"math"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
)

// On a simulated GPU under MPS the use of the device the adjuster sees for
// a model (usageBoard, AdjusterOptions.Usage) is what NVML measured for its
// runner's process, not the estimate from its execution time and cap.
//
// The model's kernels can use a fifth of the SMs (saturation 0.2) under a
// cap of half: it uses 0.2 of the device while its kernels run, and the
// load keeps them running about half the time, so its true use is about
// 0.1. The estimate (busy x cap) would say about 0.25. The truth is worked
// out from the requests the test sent: saturation x kernel time x
// requests / time.
//
// Tolerance 0.015: NVML reads whole percent (±0.005); a control period
// cuts at most one request of the ~25 it holds (0.2 x 20 ms per second,
// ±0.004); the board's smoothing (weight 0.3 per period) leaves 0.7^9 of
// the first period's difference after ten (< 0.004).
func TestSimulatedGPUUsageFromNVML(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := configs.DefaultServer()
		cfg.GPU.Simulator.Devices = 1
		cfg.Control.Policy = control.SharePolicyStatic
		cfg.Control.Profile.Enabled = false
		sm := configs.SimulatedModel{Preset: "mobilenet", Fixed: 20 * time.Millisecond, Saturation: 0.2}
		model := "execution: {provider: cuda, simulated: {preset: mobilenet, fixed: 20ms, saturation: 0.2}}\nresources: {compute_share: 0.5}\n"
		reg, devs := simulatedServer(t, cfg, map[string]string{"a": model})
		infer(t, reg, "a") // warm-up

		m, err := sm.Model()
		if err != nil {
			t.Fatal(err)
		}
		kernel := m.Time(1, 1) - m.Launch // alone, under a cap above its saturation
		const busyFor = 10 * time.Second
		start := time.Now()
		n := 0
		for time.Since(start) < busyFor {
			infer(t, reg, "a")
			n++
			time.Sleep(kernel) // idle as long as busy
		}
		elapsed := time.Since(start)
		truth := m.Saturation * kernel.Seconds() * float64(n) / elapsed.Seconds()

		d := devs.loops.Lookup("cuda:0")
		if d == nil {
			t.Fatal("no device cuda:0")
		}
		got, ok := d.Usage("a/1")
		if !ok {
			t.Fatal("the adjuster sees no use for a/1")
		}
		busy := float64(n) * (kernel + m.Launch).Seconds() / elapsed.Seconds()
		estimate := busy * 0.5
		if math.Abs(got-truth) > 0.015 {
			t.Errorf("use of a/1 %.4f, want the measured %.4f ± 0.015 (the busy x cap estimate is %.4f)", got, truth, estimate)
		}
		if math.Abs(got-estimate) < 0.1 {
			t.Errorf("use of a/1 %.4f is the busy x cap estimate %.4f, not NVML's reading", got, estimate)
		}
		// The metric says where the reading came from.
		if g, err := devs.use.GetMetricWithLabelValues("a/1", "cuda:0", "measured"); err != nil || math.Abs(testutil.ToFloat64(g)-truth) > 0.03 {
			t.Errorf("sloserve_device_use{source=measured} of a/1 %v (%v), want about %.3f", testutil.ToFloat64(g), err, truth)
		}
		if n := testutil.CollectAndCount(devs.use); n != 1 {
			t.Errorf("sloserve_device_use has %d series, want 1 (a/1 measured)", n)
		}
		t.Logf("a/1: %d requests in %v; use %.4f, truth %.4f, estimate %.4f", n, elapsed, got, truth, estimate)
	})
}
