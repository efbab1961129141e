package qos

import (
	"math"
	"testing"
)

func TestCalibrationGain(t *testing.T) {
	for _, tc := range []struct {
		name           string
		missed, served int
		want           float64
	}{
		{"fresh: the window's room", 0, 0, 1},
		{"a miss raises it", 1, 0, 1 + calibrationStep*(1-calibrationTarget)},
		{"served requests lower it", 0, 1000, 1 - 1000*calibrationStep*calibrationTarget},
		{"one miss for 499 served holds it", 1, 499, 1},
		{"never below 0", 0, 1e6, 0},
		{"never above the bound", 1000, 0, maxCalibrationGain},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var c calibration
			for range tc.missed {
				c.missed()
			}
			for range tc.served {
				c.served()
			}
			if got := c.gain(); math.Abs(got-tc.want) > 1e-9 {
				t.Errorf("gain %v, want %v", got, tc.want)
			}
		})
	}
}

// A miss counts only when a gain of at most twice the current one, and
// half the window's room more, would have refused the request.
func TestCalibrationNear(t *testing.T) {
	var c calibration
	for range 1_000_000 {
		c.served()
	}
	if !c.near(0.4) || c.near(0.6) {
		t.Errorf("at gain 0: near(0.4) %v near(0.6) %v, want true, false", c.near(0.4), c.near(0.6))
	}
	c = calibration{}
	if !c.near(2.4) || c.near(2.6) {
		t.Errorf("at gain 1: near(2.4) %v near(2.6) %v, want true, false", c.near(2.4), c.near(2.6))
	}
}
