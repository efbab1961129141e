package predictor

import (
	"math"
	"testing"
	"time"
)

// coRunDay runs executions of model "m" (curve flat, share 0.5) at two row
// sizes whose true times are 1x and 3x the curve's, slowed by co-running
// work as 1 + 0.5u, where the others' use u holds for runLen(i) control
// periods at its i-th level. Each period runs perPeriod executions, alternating
// the sizes; with tell, the predictor is told each period's u at its end
// (SetCoRunning), as the device loop does. It returns the MAPE of the
// predictions made for the executions after the first 20 periods, and the
// predictor.
func coRunDay(t *testing.T, tell bool, runLen func(int) int, perPeriod int) (float64, *Predictor) {
	t.Helper()
	p := newPredictor(t, Options{})
	p.SetProfile("m", Profile{Curve: flat})
	p.SetShare("m", 0.5)
	// u by period: runs at levels between 0.05 and 0.95.
	levels := []float64{0.05, 0.9, 0.4, 0.95, 0.1, 0.7, 0.3, 0.85, 0.05, 0.6}
	var us []float64
	for i := 0; len(us) < 160; i++ {
		for range runLen(i) {
			us = append(us, levels[i%len(levels)])
		}
	}
	var sum float64
	var n int
	for k, u := range us {
		for i := range perPeriod {
			elements, shapeErr := int64(1000), 1.0
			if i%2 == 1 {
				elements, shapeErr = 8000, 3.0
			}
			// ±3% of noise, deterministic.
			noise := 1 + 0.03*math.Sin(float64(7*k+13*i))
			truth := 0.020 * shapeErr * (1 + 0.5*u) * noise // flat at share 0.5: 20 ms
			pred, _ := p.EstimateSize("m", 1, elements)
			if k >= 20 {
				sum += math.Abs(pred.Seconds()-truth) / truth
				n++
			}
			p.ObserveSize("m", 1, elements, time.Duration(truth*float64(time.Second)))
		}
		if tell {
			p.SetCoRunning("m", u)
		}
	}
	return sum / float64(n), p
}

// The slowdown co-running work causes is learned from the others' measured
// use and enters the predictions. Where the use holds for a few periods
// at a time, the MAPE is well under the one of the online correction
// alone, which learns each change of the use after the fact (measured:
// 7.8% against 12.2% at 4 executions a period, 6.2% against 8.6% at 10,
// the same 3.8% at 40, where the correction catches up within the
// period). Where the use jumps from one period to the next, the latest
// period's says little about the next, and the forecast of it (AR(1))
// keeps the MAPE at the correction's (13.7% against 13.4%; predicting at
// the latest period's use measured 24.3%). The learnt slope is the one of
// log(1 + 0.5u) over the levels used, whatever the sizes' own errors.
func TestCoRunningSlowdownLearned(t *testing.T) {
	for _, tt := range []struct {
		name      string
		runLen    func(int) int
		perPeriod int
		maxRatio  float64 // MAPE with the use / without
	}{
		{"holds 3-7 periods, 4 executions a period", func(i int) int { return 3 + i%5 }, 4, 0.75},
		{"holds 3-7 periods, 10 executions a period", func(i int) int { return 3 + i%5 }, 10, 0.8},
		{"holds 3-7 periods, 40 executions a period", func(i int) int { return 3 + i%5 }, 40, 1.05},
		{"jumps every period", func(int) int { return 1 }, 4, 1.1},
		{"holds 1-4 periods", func(i int) int { return 1 + i%4 }, 10, 1.0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			without, _ := coRunDay(t, false, tt.runLen, tt.perPeriod)
			with, p := coRunDay(t, true, tt.runLen, tt.perPeriod)
			a := p.Accuracy("m")
			t.Logf("MAPE %.1f%% without the co-runners' use, %.1f%% with it; slope %.3f, interference x%.2f at u %.2f",
				100*without, 100*with, a.CoRunSlope, a.Interference, a.CoRunning)
			if with > tt.maxRatio*without {
				t.Errorf("MAPE %.1f%% with the co-runners' use, over %.2f times the %.1f%% without", 100*with, tt.maxRatio, 100*without)
			}
			// log(1+0.5u) is near linear over 0.05..0.95: slope about 0.40.
			if a.CoRunSlope < 0.33 || a.CoRunSlope > 0.46 {
				t.Errorf("slope %.3f, want about 0.40", a.CoRunSlope)
			}
		})
	}
	// The corrections hold the sizes' own errors, not the slowdown: at a
	// use held for periods (0.9 from period 103 on, after levels that
	// taught the slope), each size is predicted at its error times the
	// slowdown at that use.
	_, p := coRunDay(t, true, func(i int) int {
		if i < 21 {
			return 3 + i%5
		}
		return 100
	}, 10)
	a := p.Accuracy("m")
	if a.CoRunning != 0.9 || a.CoRunSlope < 0.33 {
		t.Fatalf("use %g, slope %g; want 0.9 and about 0.40", a.CoRunning, a.CoRunSlope)
	}
	if want := math.Exp(a.CoRunSlope * a.CoRunning); math.Abs(a.Interference-want) > 0.02 {
		t.Errorf("interference %g at a use held, want exp(slope x use) = %g", a.Interference, want)
	}
	for elements, shapeErr := range map[int64]float64{1000: 1, 8000: 3} {
		got, _ := p.EstimateSize("m", 1, elements)
		want := 0.020 * shapeErr * (1 + 0.5*a.CoRunning)
		if e := math.Abs(got.Seconds()-want) / want; e > 0.05 {
			t.Errorf("size %d predicted %v at use %.2f, want %.1fms ± 5%%", elements, got, a.CoRunning, 1000*want)
		}
	}
}

// Without variation in the others' use nothing is learned: the slowdown
// stays 1 and the correction holds all of it, as before.
func TestCoRunningConstantUseLearnsNothing(t *testing.T) {
	p := newPredictor(t, Options{})
	p.SetProfile("m", Profile{Curve: flat})
	for range 50 {
		for range 10 {
			p.Observe("m", 1, 15*ms) // 1.5x the curve
		}
		p.SetCoRunning("m", 0.6)
	}
	a := p.Accuracy("m")
	if a.CoRunSlope != 0 || a.Interference != 1 {
		t.Errorf("slope %g, interference %g; want 0 and 1 under a constant use", a.CoRunSlope, a.Interference)
	}
	if math.Abs(a.Correction-1.5) > 0.01 {
		t.Errorf("correction %g, want 1.5", a.Correction)
	}
	// Nonsense readings count as no use.
	for _, u := range []float64{math.NaN(), math.Inf(1), -2} {
		p.SetCoRunning("m", u)
		if a := p.Accuracy("m"); a.CoRunning != 0 {
			t.Errorf("SetCoRunning(%g): use %g, want 0", u, a.CoRunning)
		}
	}
}

// The adjuster's Latency, which sizes a share for longer than a period,
// takes the co-runners' slowdown at their mean use of the last periods;
// the QoS scheduler's estimate, for the next executions, at the use
// forecast for the next period. One period of a high use after many of a
// low one moves the estimate (x1.30), the Latency less (x1.15: the
// corrections keep what the period taught them, scaled to the forecast).
func TestCoRunningLatencyAtMeanUse(t *testing.T) {
	_, p := coRunDay(t, true, func(i int) int { return 3 + i%5 }, 10)
	period := func(u float64) {
		for range 10 {
			p.ObserveSize("m", 1, 1000, time.Duration(0.020*(1+0.5*u)*float64(time.Second)))
		}
		p.SetCoRunning("m", u)
	}
	for range 40 {
		period(0.1)
	}
	est0, _ := p.EstimateSize("m", 1, 1000)
	lat0, _ := p.Latency("m", 1, 0.5)
	period(0.9)
	est1, _ := p.EstimateSize("m", 1, 1000)
	lat1, _ := p.Latency("m", 1, 0.5)
	a := p.Accuracy("m")
	e, l := est1.Seconds()/est0.Seconds(), lat1.Seconds()/lat0.Seconds()
	t.Logf("slope %.3f; after a step of the use from 0.1 to 0.9: estimate x%.3f (factor %.2f at the forecast), latency x%.3f", a.CoRunSlope, e, a.Interference, l)
	if a.CoRunSlope < 0.33 {
		t.Fatalf("slope %.3f, want about 0.40", a.CoRunSlope)
	}
	if e < 1.2 || l > e-0.1 {
		t.Errorf("estimate moved x%.3f, Latency x%.3f: want the estimate to follow the forecast (over x1.2) and the Latency less (0.1 under it)", e, l)
	}
}
