package predictor

import (
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

const ms = time.Millisecond

func newPredictor(t testing.TB, opts Options) *Predictor {
	t.Helper()
	p, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// flat is a curve of 10 ms per image at the whole device, ∝ 1/share.
var flat = Curve{K2: 0.01}

func TestEstimateFallbackThenCurve(t *testing.T) {
	p := newPredictor(t, Options{})
	if _, ok := p.Estimate("m/1", 1); ok {
		t.Fatal("estimate for an unknown model")
	}
	if _, ok := p.Latency("m/1", 1, 0.5); ok {
		t.Fatal("latency for an unknown model")
	}
	p.SetShare("m/1", 0.5)
	p.Observe("m/1", 2, 30*ms)
	p.Observe("m/1", 2, 40*ms) // EWMA 0.2: 32 ms
	for _, tt := range []struct {
		batch int
		want  time.Duration
	}{{2, 32 * ms}, {4, 64 * ms}, {1, 32 * ms}} {
		if got, ok := p.Estimate("m/1", tt.batch); !ok || got != tt.want {
			t.Errorf("fallback Estimate(%d) = %v, %v; want %v", tt.batch, got, ok, tt.want)
		}
	}
	// At another share the fallback scales by current/share.
	if got, _ := p.Latency("m/1", 2, 1); got != 16*ms {
		t.Errorf("fallback Latency at share 1 = %v, want 16ms", got)
	}
	p.SetProfile("m/1", Profile{Curve: flat})
	if got, _ := p.Estimate("m/1", 2); got != 40*ms {
		t.Errorf("curve Estimate(2) at share 0.5 = %v, want 40ms", got)
	}
	if got, _ := p.Latency("m/1", 4, 0.25); got != 160*ms {
		t.Errorf("Latency(4, 0.25) = %v, want 160ms", got)
	}
	// A whole-device share.
	for _, s := range []float64{0, 1, 3} {
		p.SetShare("m/1", s)
		if got, _ := p.Estimate("m/1", 1); got != 10*ms {
			t.Errorf("share %g: Estimate(1) = %v, want 10ms", s, got)
		}
	}
	p.Forget("m/1")
	if _, ok := p.Estimate("m/1", 1); ok {
		t.Error("estimate after Forget")
	}
}

func TestSetProfileRefitsUnusableCurve(t *testing.T) {
	p := newPredictor(t, Options{})
	pts := synth(truth, []int{1, 4, 8}, []float64{0.25, 0.5, 1}, 0, 0)
	p.SetProfile("m", Profile{Points: pts})
	got, ok := p.Estimate("m", 4)
	if want := truth.Predict(4, 1); !ok || relErr(got.Seconds(), want.Seconds()) > 0.01 {
		t.Errorf("Estimate(4) = %v, %v; want about %v", got, ok, want)
	}
	p.SetProfile("n", Profile{Curve: Curve{K2: math.NaN()}}) // nothing to fit: ignored
	if _, ok := p.Estimate("n", 1); ok {
		t.Error("an unusable profile was installed")
	}
}

func TestCorrectionConvergesAndClamps(t *testing.T) {
	p := newPredictor(t, Options{})
	p.SetProfile("m", Profile{Curve: flat})
	p.SetShare("m", 0.5) // 20 ms per image
	// The model runs 1.5x slower than profiled.
	n := 0
	for ; n < 200; n++ {
		if c := p.Accuracy("m").Correction; math.Abs(c-1.5) < 0.015 {
			break
		}
		b := 1 + n%4
		p.Observe("m", b, time.Duration(1.5*float64(b)*20*float64(ms)))
	}
	t.Logf("correction within 1%% of 1.5 after %d executions", n)
	if n > 50 { // (0.9)^n * 0.5 < 0.015 at n = 34
		t.Errorf("correction took %d executions to converge", n)
	}
	if got, _ := p.Estimate("m", 2); relErr(got.Seconds(), 0.060) > 0.01 {
		t.Errorf("Estimate(2) = %v, want about 60ms", got)
	}
	// One 100x outlier moves the factor by at most 4^alpha (the EWMA runs on
	// the ratios' logarithms).
	before := p.Accuracy("m").Correction
	p.Observe("m", 1, 2*time.Second)
	after := p.Accuracy("m").Correction
	if want := before * math.Pow(4, 0.1); math.Abs(after-want) > 1e-9 {
		t.Errorf("after an outlier: correction %g, want %g (ratio clamped to 4x the correction)", after, want)
	}
	p.Observe("m", 1, time.Nanosecond)
	if want := after / math.Pow(4, 0.1); math.Abs(p.Accuracy("m").Correction-want) > 1e-9 {
		t.Errorf("after a fast outlier: correction %g, want %g (ratio clamped to a quarter of the correction)", p.Accuracy("m").Correction, want)
	}
	// Invalid observations are ignored; a new profile resets.
	c := p.Accuracy("m").Correction
	p.Observe("m", 0, ms)
	p.Observe("m", 1, 0)
	if p.Accuracy("m").Correction != c {
		t.Error("an invalid observation moved the correction")
	}
	p.SetProfile("m", Profile{Curve: flat})
	if c := p.Accuracy("m").Correction; c != 1 {
		t.Errorf("correction after SetProfile = %g", c)
	}
}

// A model served at inputs ten times the profiled size: the correction
// learns the 10x within tens of executions (a fixed clamp at 4 would hold
// estimates 2.5x too low for good), and Drift raises the alarm.
func TestCorrectionLearnsPersistentError(t *testing.T) {
	p := newPredictor(t, Options{})
	p.SetProfile("m", Profile{Curve: flat})
	p.SetShare("m", 0.5) // 20 ms per image
	if p.Accuracy("m").Drift {
		t.Error("drift before any execution")
	}
	n := 0
	for ; n < 200; n++ {
		if c := p.Accuracy("m").Correction; math.Abs(c-10) < 0.1 {
			break
		}
		p.Observe("m", 1, 200*ms)
	}
	t.Logf("correction within 1%% of 10 after %d executions", n)
	if n > 80 {
		t.Errorf("correction took %d executions to learn a 10x error", n)
	}
	if got, _ := p.Estimate("m", 1); relErr(got.Seconds(), 0.2) > 0.02 {
		t.Errorf("Estimate(1) = %v, want about 200ms", got)
	}
	if !p.Accuracy("m").Drift {
		t.Error("a 10x correction does not raise Drift")
	}
	for range 200 {
		p.Observe("m", 1, 100*time.Microsecond) // 200x faster than profiled
	}
	if c := p.Accuracy("m").Correction; c < minCorrection || c > minCorrection*1.01 {
		t.Errorf("correction %g, want it held at the floor %g", c, minCorrection)
	}
}

func TestCustomAlpha(t *testing.T) {
	p := newPredictor(t, Options{Alpha: 1})
	p.SetProfile("m", Profile{Curve: flat})
	p.Observe("m", 1, 20*ms)
	if c := p.Accuracy("m").Correction; c != 2 {
		t.Errorf("alpha 1: correction %g, want 2", c)
	}
}

func TestInterference(t *testing.T) {
	p := newPredictor(t, Options{})
	p.SetProfile("m", Profile{Curve: flat})
	p.SetShare("m", 0.5)
	tests := []struct {
		others float64
		factor float64
	}{
		{0, 1}, {0.5, 1}, {-1, 1}, {math.NaN(), 1}, // fits on the device
		{1, 1.5}, {2.5, 3}, // oversubscribed
		{10, 4}, {math.Inf(1), 1}, // clamped; nonsense ignored
	}
	for _, tt := range tests {
		p.SetInterference("m", tt.others)
		a := p.Accuracy("m")
		if a.Interference != tt.factor {
			t.Errorf("others %g: factor %g, want %g", tt.others, a.Interference, tt.factor)
		}
		want := time.Duration(float64(20*ms) * tt.factor)
		if got, _ := p.Estimate("m", 1); got != want {
			t.Errorf("others %g: Estimate %v, want %v", tt.others, got, want)
		}
	}
	// Latency uses the factor at the share asked about.
	p.SetInterference("m", 0.5)
	if got, _ := p.Latency("m", 1, 1); got != 15*ms {
		t.Errorf("Latency at share 1 with others at 0.5: %v, want 10ms x 1.5", got)
	}
	// Observations are compared with the interfered prediction: a model
	// that is as slow as the interference explains needs no correction.
	p.SetInterference("m", 1.5) // factor 2 at share 0.5
	for range 20 {
		p.Observe("m", 1, 40*ms)
	}
	if c := p.Accuracy("m").Correction; c != 1 {
		t.Errorf("correction %g, want 1", c)
	}
}

func TestAccuracy(t *testing.T) {
	p := newPredictor(t, Options{Alpha: 0.5})
	if a := p.Accuracy("none"); a != (Accuracy{Correction: 1, Interference: 1}) {
		t.Errorf("unknown model: %+v", a)
	}
	pts := []Point{{Batch: 1, Share: 1, Latency: 10 * ms}, {Batch: 2, Share: 1, Latency: 25 * ms}}
	p.SetProfile("m", Profile{Curve: flat, Points: pts, MAPE: MAPE(flat, pts)})
	// Predicted 10, 10*2^0.5, 10*2^0.25 ms (correction 1, then a geometric
	// EWMA at alpha 0.5 of the ratios 2, 1, 1); observed 20, 10, 10 ms.
	p.Observe("m", 1, 20*ms)
	p.Observe("m", 1, 10*ms)
	p.Observe("m", 1, 10*ms)
	a := p.Accuracy("m")
	want := Accuracy{
		Predicted:    seconds((0.010 + 0.010*math.Sqrt2 + 0.010*math.Pow(2, 0.25)) / 3),
		Observed:     seconds(0.040 / 3),
		MAPE:         (0.5 + (math.Sqrt2 - 1) + (math.Pow(2, 0.25) - 1)) / 3,
		ProfileMAPE:  0.1,
		Correction:   math.Pow(2, 0.125),
		Buckets:      1,
		Interference: 1,
		Samples:      3,
		HasCurve:     true,
		MAPEFloor:    0.5 / 3, // 10 ms, in hindsight: 20 ms off by half
	}
	// Predictions are whole nanoseconds: 1e-6 of a 10 ms one is 10 ns.
	if math.Abs(a.MAPE-want.MAPE) > 1e-6 || math.Abs(a.ProfileMAPE-want.ProfileMAPE) > 1e-9 {
		t.Errorf("MAPE %g, profile MAPE %g; want %g, %g", a.MAPE, a.ProfileMAPE, want.MAPE, want.ProfileMAPE)
	}
	if d := a.Predicted - want.Predicted; d < -2 || d > 2 || math.Abs(a.Correction-want.Correction) > 1e-9 {
		t.Errorf("predicted %v, correction %g; want %v, %g", a.Predicted, a.Correction, want.Predicted, want.Correction)
	}
	a.MAPE, a.ProfileMAPE, a.Predicted, a.Correction = want.MAPE, want.ProfileMAPE, want.Predicted, want.Correction
	if a != want {
		t.Errorf("accuracy\n%+v\nwant\n%+v", a, want)
	}
	// The window keeps the last Window executions.
	for range 2 * Window {
		p.Observe("m", 1, 10*ms)
	}
	if a := p.Accuracy("m"); a.Samples != Window || a.Observed != 10*ms || a.MAPE > 1e-3 {
		t.Errorf("after %d more: %+v", 2*Window, a)
	}
}

func TestAccuracyFallback(t *testing.T) {
	p := newPredictor(t, Options{})
	p.Observe("m", 1, 10*ms) // nothing predicted yet: not in the window
	p.Observe("m", 1, 20*ms) // predicted 10
	a := p.Accuracy("m")
	if a.Samples != 1 || a.Predicted != 10*ms || a.Observed != 20*ms || a.MAPE != 0.5 || a.HasCurve {
		t.Errorf("%+v", a)
	}
}

func TestMetrics(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	p := newPredictor(t, Options{Registerer: reg, Device: "cpu"})
	pts := []Point{{Batch: 1, Share: 1, Latency: 10 * ms}, {Batch: 2, Share: 1, Latency: 25 * ms}}
	p.SetProfile("det/1", Profile{Curve: flat, Points: pts, MAPE: MAPE(flat, pts)})
	p.Observe("det/1", 1, 20*ms)
	base := time.Unix(1_700_000_000, 0)
	p.ObserveArrivals("det/1", base, 0)
	p.ObserveArrivals("det/1", base.Add(time.Second), 5)
	p.ObserveArrivals("rec/1", base, 0)
	want := `
# HELP sloserve_predictor_correction Online correction factor: observed/predicted execution time, smoothed as a geometric mean.
# TYPE sloserve_predictor_correction gauge
sloserve_predictor_correction{device="cpu",model="det/1"} 1.0717734625362931
sloserve_predictor_correction{device="cpu",model="rec/1"} 1
# HELP sloserve_predictor_forecast_rate Forecast arrival rate one second ahead, requests/s.
# TYPE sloserve_predictor_forecast_rate gauge
sloserve_predictor_forecast_rate{device="cpu",model="det/1"} 5
sloserve_predictor_forecast_rate{device="cpu",model="rec/1"} 0
# HELP sloserve_predictor_latency_observed_seconds Mean observed execution time over the recent executions.
# TYPE sloserve_predictor_latency_observed_seconds gauge
sloserve_predictor_latency_observed_seconds{device="cpu",model="det/1"} 0.02
# HELP sloserve_predictor_latency_predicted_seconds Mean predicted execution time over the recent executions.
# TYPE sloserve_predictor_latency_predicted_seconds gauge
sloserve_predictor_latency_predicted_seconds{device="cpu",model="det/1"} 0.01
# HELP sloserve_predictor_mape Mean absolute percentage error of the recent executions' predictions (0.07 is 7%).
# TYPE sloserve_predictor_mape gauge
sloserve_predictor_mape{device="cpu",model="det/1"} 0.5
# HELP sloserve_predictor_observed_rate Arrival rate over the latest counter interval, requests/s.
# TYPE sloserve_predictor_observed_rate gauge
sloserve_predictor_observed_rate{device="cpu",model="det/1"} 5
sloserve_predictor_observed_rate{device="cpu",model="rec/1"} 0
# HELP sloserve_predictor_profile_mape Mean absolute percentage error of the fitted curve on its profile points.
# TYPE sloserve_predictor_profile_mape gauge
sloserve_predictor_profile_mape{device="cpu",model="det/1"} 0.10000000000000002
`
	names := []string{
		"sloserve_predictor_correction", "sloserve_predictor_forecast_rate",
		"sloserve_predictor_latency_observed_seconds", "sloserve_predictor_latency_predicted_seconds",
		"sloserve_predictor_mape", "sloserve_predictor_observed_rate", "sloserve_predictor_profile_mape",
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), names...); err != nil {
		t.Error(err)
	}
	p.Forget("det/1")
	if n, err := testutil.GatherAndCount(reg, names...); err != nil || n != 3 {
		t.Errorf("after Forget: %d series (want rec/1's 3), %v", n, err)
	}
	// A second predictor on the same registry is refused.
	if _, err := New(Options{Registerer: reg, Device: "cpu"}); err == nil {
		t.Error("duplicate registration accepted")
	}
}

func TestConcurrent(t *testing.T) {
	reg := prometheus.NewRegistry()
	p := newPredictor(t, Options{Registerer: reg})
	base := time.Unix(1_700_000_000, 0)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			name := fmt.Sprintf("m%d", g%3)
			for i := range 500 {
				switch i % 10 {
				case 0:
					p.SetProfile(name, Profile{Curve: flat})
				case 1:
					p.SetShare(name, float64(1+i%4)/4)
				case 2:
					p.SetInterference(name, float64(i%3)/2)
				case 3:
					p.ObserveArrivals(name, base.Add(time.Duration(i)*time.Second), uint64(i*10))
				case 4:
					p.ForecastRate(name, time.Second)
				case 5:
					p.Accuracy(name)
				case 6:
					if i%100 == 6 {
						p.Forget(name)
					}
				case 7:
					if _, err := reg.Gather(); err != nil {
						t.Error(err)
					}
				default:
					p.Observe(name, 1+i%8, time.Duration(1+i%7)*ms)
					if d, ok := p.Estimate(name, 1+i%8); ok && d <= 0 {
						t.Errorf("estimate %v", d)
					}
					p.Latency(name, 2, 0.5)
				}
			}
		})
	}
	wg.Wait()
}

func BenchmarkEstimate(b *testing.B) {
	p := newPredictor(b, Options{Registerer: prometheus.NewRegistry()})
	for i := range 50 {
		name := fmt.Sprintf("model-%d/1", i)
		p.SetProfile(name, Profile{Curve: truth})
		p.SetShare(name, 0.5)
		p.SetInterference(name, 0.8)
	}
	b.Run("curve", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			p.Estimate("model-17/1", 4)
		}
	})
	p.Observe("fallback/1", 2, ms)
	p.Observe("fallback/1", 8, 3*ms)
	b.Run("fallback", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			p.Estimate("fallback/1", 4)
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				p.Estimate("model-17/1", 4)
			}
		})
	})
}

// Busy sums the observed execution time of a model, with or without a curve.
func TestPredictorBusy(t *testing.T) {
	p, _ := New(Options{})
	if p.Busy("m") != 0 {
		t.Errorf("unknown model busy %v", p.Busy("m"))
	}
	p.Observe("m", 1, 10*time.Millisecond)
	p.Observe("m", 4, 30*time.Millisecond)
	p.Observe("m", 0, time.Second) // not an execution
	if got := p.Busy("m"); math.Abs(got-0.04) > 1e-12 {
		t.Errorf("busy %v, want 0.04 s", got)
	}
}

// Accuracy reports beside the MAPE its floor in the same window: each
// execution against the best one time for its own bucket in hindsight.
// Size 100 alternates 10 and 30 ms: 10 ms is the best (errors 0 and
// 66.7%: 33.3% on average; 20 ms, their mean, has 100% and 33.3%, 66.7%
// on average), size 1600 takes 80 ms every time (error 0): a floor of
// 16.7%. The curve predicts 10 ms and 160 ms, so the MAPE is above it by
// the size 1600 predictions' 100%, what the predictor itself gets wrong.
func TestAccuracyMAPEFloor(t *testing.T) {
	p := newPredictor(t, Options{Alpha: 1e-9}) // no correction learnt: predictions stay the curve's
	p.SetProfile("m", Profile{Curve: Curve{K2: 0.01, Elements: 100}})
	for i := range Window {
		if i%2 == 0 {
			p.ObserveSize("m", 1, 100, time.Duration(10+20*(i/2%2))*time.Millisecond)
		} else {
			p.ObserveSize("m", 1, 1600, 80*time.Millisecond)
		}
	}
	a := p.Accuracy("m")
	if a.Samples != Window {
		t.Fatalf("%d samples", a.Samples)
	}
	if want := (2.0 / 3) / 4; math.Abs(a.MAPEFloor-want) > 1e-6 {
		t.Errorf("MAPE floor %.4f, want %.4f", a.MAPEFloor, want)
	}
	// Predicted 10 ms for size 100 (errors 0 and 66.7%), 160 ms for size
	// 1600 (100%).
	if want := (2.0/3/2 + 1) / 2; math.Abs(a.MAPE-want) > 1e-3 {
		t.Errorf("MAPE %.4f, want %.4f", a.MAPE, want)
	}
	// The same executions at one share but two batch sizes are two
	// buckets: 40 ms at batch 2 is no jitter of 10 ms at batch 1.
	q := newPredictor(t, Options{})
	q.SetProfile("m", Profile{Curve: Curve{K2: 0.01}})
	for i := range Window {
		q.Observe("m", 1+i%2, time.Duration(10+30*(i%2))*time.Millisecond)
	}
	if f := q.Accuracy("m").MAPEFloor; f != 0 {
		t.Errorf("MAPE floor %.4f of two buckets each steady, want 0", f)
	}
}

// A busy host stalls one execution in five for ten times its time: the
// correction follows the typical execution (the error quantile is for the
// tail), where an EWMA of the ratios themselves, each step clamped to 4x
// the correction in force, ratchets up to 3.04 here (1.50 as it is).
func TestCorrectionIgnoresStalls(t *testing.T) {
	p := newPredictor(t, Options{})
	p.SetProfile("m", Profile{Curve: flat})
	p.SetShare("m", 1) // 10 ms per image
	var top float64
	for i := range 2000 {
		took := 10 * ms
		if i%5 == 4 {
			took = 100 * ms
		}
		p.Observe("m", 1, took)
		if i >= 1000 {
			top = max(top, p.Accuracy("m").Correction)
		}
	}
	t.Logf("highest correction over the last 1000 executions: %.2f", top)
	if top > 1.6 {
		t.Errorf("correction reached %.2f with four executions in five on the curve", top)
	}
}
