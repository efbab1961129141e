package control

import (
	"sync"
	"testing"
	"testing/synctest"

	"github.com/sloserve/sloserve/qos"
)

// Telemetry decides what a latency-critical floor keeps from the
// best-effort caps: twice the measured use, not the prediction; unknown,
// the prediction stands in.
func TestAdjusterReserveFollowsUsage(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		usage := map[string]float64{"lc": 0.1}
		ah := newAdjHarness(t, AdjusterOptions{Usage: func(m string) (float64, bool) {
			mu.Lock()
			defer mu.Unlock()
			u, ok := usage[m]
			return u, ok
		}},
			qos.ModelSpec{Name: "lc", Class: lc, SLO: 100 * ms},
			qos.ModelSpec{Name: "be", Class: be},
		)
		ah.pred.setRate("lc", 30) // floor 0.65, predicted busy 0.3
		ah.pred.setRate("be", 5)
		ah.start()
		// 1 - 2 · 0.1 = 0.8 for the background cap.
		if got := ah.act.computes(); got["lc"] != 0.65 || got["be"] != 0.8 {
			t.Errorf("shares with lc using 0.1: %v, want lc 0.65, be 0.8", got)
		}
		mu.Lock()
		delete(usage, "lc")
		mu.Unlock()
		ah.tick()
		// Unknown: 1 - 2 · 0.3 (predicted) = 0.4; the cap shrinks at once.
		if got := ah.act.computes(); got["be"] != 0.4 {
			t.Errorf("shares with lc's use unknown: %v, want be 0.4", got)
		}
	})
}

// A best-effort model that cannot use its half of the background caps
// does not keep it from one that can: claims are bounded by twice the
// measured use plus a step, and the rest goes by weight.
func TestBestEffortCapsFollowUse(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		usage := map[string]float64{"small": 0.02, "big": 0.2}
		ah := newAdjHarness(t, AdjusterOptions{Usage: func(m string) (float64, bool) {
			mu.Lock()
			defer mu.Unlock()
			u, ok := usage[m]
			return u, ok
		}},
			qos.ModelSpec{Name: "small", Class: be},
			qos.ModelSpec{Name: "big", Class: be},
		)
		ah.pred.setRate("small", 50)
		ah.pred.setRate("big", 50)
		ah.start()
		// small claims 2 · 0.02 + 0.05 = 0.09, big 0.45; the 0.46 left
		// over goes half to each, within 1: small 0.09 + 0.23, big 0.45 + 0.23.
		if got := ah.act.computes(); got["small"] != 0.32 || got["big"] != 0.68 {
			t.Errorf("shares %v, want small 0.32, big 0.68", got)
		}
		mu.Lock()
		usage["big"] = 0.6 // held at its cap: it wants more
		usage["small"] = 0.3
		mu.Unlock()
		ah.tick()
		// Claims 0.65 and 1 (capped): by weight, half each of 1.
		if got := ah.act.computes(); got["small"] != 0.5 || got["big"] != 0.5 {
			t.Errorf("shares %v, want 0.5 each", got)
		}
	})
}

func TestSignificantMiss(t *testing.T) {
	for _, tc := range []struct {
		n    uint64
		att  float64
		want bool
	}{
		{19, 0, false},     // too few to tell
		{100, 0.97, false}, // 3 misses: within chance for 99%
		{100, 0.95, true},  // 5
		{50, 0.95, false},
		{50, 0.92, true},
		{1000, 0.98, true},
	} {
		if got := significantMiss(tc.n, tc.att, 0.99); got != tc.want {
			t.Errorf("significantMiss(%d, %v, 0.99) = %v, want %v", tc.n, tc.att, got, tc.want)
		}
	}
}
