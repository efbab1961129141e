package predictor

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// sizedTruth is a surface in batch, share and row size shaped like a
// convolutional net served at several image sizes: 2 ms fixed, 1 ms per
// row of 1000 elements, 0.5 ms per row whatever its size, 20% of the work
// not scaling with the share and 0.3 ms of launch overhead.
var sizedTruth = Curve{K2: 0.001, K3: 0.002, K4: 0.05, K5: 0.0003, K6: 0.0005, Elements: 1000}

// synthSized samples c at every batch, share and row size with relative
// noise of up to ±noise.
func synthSized(c Curve, batches []int, shares []float64, sizes []int64, noise float64, seed uint64) []Point {
	rng := rand.New(rand.NewPCG(seed, 2))
	var pts []Point
	for _, s := range shares {
		for _, n := range sizes {
			for _, b := range batches {
				t := c.seconds(b, s, n) * (1 + noise*(2*rng.Float64()-1))
				pts = append(pts, Point{Batch: b, Share: s, Elements: n, Latency: seconds(t)})
			}
		}
	}
	return pts
}

// A profile over three row sizes recovers the surface, and predicts row
// sizes it never saw (between and beyond the profiled ones) within 5%.
func TestFitSizedRecoversSurfaceAndHeldOutSizes(t *testing.T) {
	batches, shares := []int{1, 4, 8}, []float64{0.25, 0.5, 1}
	pts := synthSized(sizedTruth, batches, shares, []int64{1000, 4000, 16000}, 0.02, 1)
	c, err := Fit(pts)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fitted %+v, MAPE on its points %.2f%%", c, 100*MAPE(c, pts))
	if c.Elements != 1000 {
		t.Errorf("reference size %v, want the smallest profiled, 1000", c.Elements)
	}
	if m := MAPE(c, pts); m > 0.03 {
		t.Errorf("MAPE on the profile %.3f, want under 0.03 (noise 2%%)", m)
	}
	held := synthSized(sizedTruth, []int{1, 2, 3, 6, 8}, []float64{0.3, 0.75, 1}, []int64{500, 2000, 8000, 24000}, 0, 0)
	worst := 0.0
	for _, pt := range held {
		got := c.PredictSize(pt.Batch, pt.Share, pt.Elements).Seconds()
		worst = max(worst, relErr(got, pt.Latency.Seconds()))
	}
	t.Logf("worst error on held-out sizes %.2f%%", 100*worst)
	if worst > 0.05 {
		t.Errorf("worst relative error on held-out sizes %.3f, want under 0.05", worst)
	}
	// The same surface fitted as if the sizes were unknown (the old,
	// size-blind curve) is far off: the check has teeth.
	blind := slices.Clone(pts)
	for i := range blind {
		blind[i].Elements = 0
	}
	cb, err := Fit(blind)
	if err != nil {
		t.Fatal(err)
	}
	if m := MAPE(cb, blind); m < 0.3 {
		t.Errorf("a size-blind fit has MAPE %.3f; the surface was meant to depend on size", m)
	}
}

// One size profiled: the fit is the size-blind curve (no per-row term,
// which the data cannot tell from the work term), and a request of another
// size scales with its elements.
func TestFitOneSizeScalesWithElements(t *testing.T) {
	pts := synthSized(sizedTruth, []int{1, 4, 8}, []float64{0.25, 0.5, 1}, []int64{2000}, 0, 0)
	c, err := Fit(pts)
	if err != nil {
		t.Fatal(err)
	}
	if c.K6 != 0 || c.Elements != 2000 {
		t.Fatalf("one size: %+v, want K6 0 and Elements 2000", c)
	}
	if m := MAPE(c, pts); m > 0.01 {
		t.Errorf("MAPE %.4f on the profiled size", m)
	}
	at1 := c.PredictSize(4, 1, 2000).Seconds()
	at2 := c.PredictSize(4, 1, 4000).Seconds()
	if !(at2 > at1*1.3) {
		t.Errorf("twice the elements: %v then %v; want it to grow", at1, at2)
	}
	if c.PredictSize(4, 1, 0) != c.Predict(4, 1) || c.Predict(4, 1) != c.PredictSize(4, 1, 2000) {
		t.Error("an unknown size is not the reference size")
	}
}

// One batch size (a model that does not batch) at several sizes: the
// fixed part is learnt from the sizes.
func TestFitOneBatchSeveralSizes(t *testing.T) {
	truth := Curve{K2: 0.004, K3: 0.003, K4: 0.1, Elements: 1000}
	pts := synthSized(truth, []int{1}, []float64{0.5, 1}, []int64{1000, 3000, 9000}, 0, 0)
	c, err := Fit(pts)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int64{2000, 6000} {
		want := truth.seconds(1, 0.75, n)
		if e := relErr(c.PredictSize(1, 0.75, n).Seconds(), want); e > 0.02 {
			t.Errorf("size %d: error %.3f (%+v)", n, e, c)
		}
	}
}

// A model served at two sizes in turn, one 2.5x slower than its profile
// says and one 0.6x: each size's correction learns its own factor, and
// the recent executions' MAPE comes down to a few percent, where one
// correction for both (the model's, which Accuracy.Correction still
// reports) sits between them and is off for both.
func TestCorrectionPerSize(t *testing.T) {
	p := newPredictor(t, Options{})
	p.SetProfile("m", Profile{Curve: Curve{K2: 0.01, Elements: 100}})
	factor := map[int64]float64{100: 2.5, 800: 0.6}
	for i := range 200 {
		n := []int64{100, 800}[i%2]
		d, _ := p.EstimateSize("m", 1, n)
		_ = d
		truth := Curve{K2: 0.01, Elements: 100}.seconds(1, 1, n) * factor[n]
		p.ObserveSize("m", 1, n, seconds(truth))
	}
	for n, f := range factor {
		got, _ := p.EstimateSize("m", 1, n)
		want := 0.01 * float64(n) / 100 * f
		if e := relErr(got.Seconds(), want); e > 0.01 {
			t.Errorf("size %d: estimate %v, want %.4fs (error %.3f)", n, got, want, e)
		}
	}
	a := p.Accuracy("m")
	t.Logf("MAPE of the recent window %.2f%%; the model's one correction %.2f", 100*a.MAPE, a.Correction)
	if a.MAPE > 0.02 {
		t.Errorf("recent MAPE %.3f, want under 0.02", a.MAPE)
	}
	for n, f := range factor {
		if e := relErr(a.Correction, f); e < 0.2 {
			t.Errorf("the model-wide correction %.2f fits size %d (factor %v): the test does not need per-size corrections", a.Correction, n, f)
		}
	}
}

// Each (size, batch, share) bucket keeps a correction of its own: batch 8
// running 3x slower than the curve while batch 1 runs as profiled raises
// batch 8's bucket's drift alarm alone. Predictions stay at the size's
// correction (see correctionAt for why).
func TestCorrectionPerBatchBucket(t *testing.T) {
	var alarms []Drift
	p := newPredictor(t, Options{OnDrift: func(d Drift) { alarms = append(alarms, d) }})
	p.SetProfile("m", Profile{Curve: Curve{K2: 0.01, Elements: 100}})
	for i := range 300 {
		b := []int{1, 8}[i%2]
		f := map[int]float64{1: 1, 8: 3}[b]
		p.ObserveSize("m", b, 100, seconds(0.01*float64(b)*f))
	}
	if a := p.Accuracy("m"); a.Buckets != 2 || a.DriftBuckets != 1 {
		t.Errorf("%d buckets, %d in drift; want 2 and 1", a.Buckets, a.DriftBuckets)
	}
	if len(alarms) != 1 || alarms[0].Batch != 8 || !(alarms[0].Correction > 2) {
		t.Errorf("alarms %+v, want one, for batch 8", alarms)
	}
}

// A bucket whose correction leaves [1/2, 2] raises one drift alarm (a
// callback and a count), not one per execution; a bucket that stays within
// raises none; after it comes back within bounds a new excursion raises
// another.
func TestDriftAlarmPerBucket(t *testing.T) {
	var alarms []Drift
	p := newPredictor(t, Options{OnDrift: func(d Drift) { alarms = append(alarms, d) }})
	p.SetProfile("m", Profile{Curve: Curve{K2: 0.01, Elements: 100}})
	for i := range 100 {
		n := []int64{100, 400}[i%2]
		f := map[int64]float64{100: 3, 400: 1.2}[n]
		p.ObserveSize("m", 1, n, seconds(0.01*float64(n)/100*f))
	}
	if len(alarms) != 1 {
		t.Fatalf("alarms %+v, want one", alarms)
	}
	if d := alarms[0]; d.Model != "m" || d.Elements != 100 || d.Batch != 1 || !(d.Correction > 2) {
		t.Errorf("alarm %+v, want model m, 100 elements, batch 1, correction over 2", d)
	}
	a := p.Accuracy("m")
	if !a.Drift || a.DriftBuckets != 1 || a.DriftAlarms != 1 {
		t.Errorf("accuracy %+v, want Drift, one bucket in drift, one alarm", a)
	}
	// Back to the profile: the bucket leaves drift, then a second
	// excursion raises a second alarm.
	for range 100 {
		p.ObserveSize("m", 1, 100, seconds(0.01))
	}
	if a := p.Accuracy("m"); a.DriftBuckets != 0 {
		t.Errorf("after recovering: %d buckets in drift", a.DriftBuckets)
	}
	for range 100 {
		p.ObserveSize("m", 1, 100, seconds(0.001))
	}
	if len(alarms) != 2 || !(alarms[1].Correction < 0.5) {
		t.Errorf("alarms %+v, want a second one under 1/2", alarms)
	}
}

// Without a curve the built-in fallback keeps its averages per size: two
// sizes in turn are each estimated from their own executions, and a size
// never seen scales from the nearest seen one by the ratio of elements.
func TestFallbackPerSize(t *testing.T) {
	p := newPredictor(t, Options{})
	for range 20 {
		p.ObserveSize("m", 1, 100, 10*time.Millisecond)
		p.ObserveSize("m", 1, 1600, 160*time.Millisecond)
	}
	for n, want := range map[int64]float64{100: 0.010, 1600: 0.160, 3200: 0.320} {
		got, ok := p.EstimateSize("m", 1, n)
		if !ok || relErr(got.Seconds(), want) > 0.01 {
			t.Errorf("size %d: %v %v, want %vs", n, got, ok, want)
		}
	}
}

// Sweep measures every shape at every share and batch and labels each
// point with its shape's row size; a Fit of those points is in size.
func TestSweepShapes(t *testing.T) {
	var calls []int
	measure := func(_ context.Context, shape, b int, s float64, _ int) (time.Duration, error) {
		calls = append(calls, shape)
		n := []int64{1000, 4000}[shape]
		return seconds(sizedTruth.seconds(b, s, n)), nil
	}
	pts, err := Sweep(t.Context(), SweepOptions{Batches: []int{1, 8}, Shares: []float64{0.5, 1}, Elements: []int64{1000, 4000}, Runs: 1}, measure)
	if err != nil {
		t.Fatal(err)
	}
	if len(pts) != 8 || !slices.Equal(calls, []int{0, 1, 0, 1, 0, 1, 0, 1}) {
		t.Fatalf("%d points, shapes measured %v", len(pts), calls)
	}
	for _, pt := range pts {
		if want := []int64{1000, 4000}; pt.Elements != want[pt.shape] {
			t.Errorf("point %+v labelled with the wrong size", pt)
		}
	}
	c, err := Fit(pts)
	if err != nil {
		t.Fatal(err)
	}
	if m := MAPE(c, pts); m > 0.02 || math.IsNaN(m) {
		t.Errorf("MAPE %.3f of a fit of a noiseless sweep", m)
	}
}

// A size not seen in the model's last Window executions is stale: what
// it learnt under the conditions of then gives way to the model's current
// correction, for its predictions and as the start of what it learns
// next. Size 800 ran 3x slow once; then only size 100 runs, as
// profiled, and size 800 is predicted as profiled again.
func TestCorrectionStaleSize(t *testing.T) {
	p := newPredictor(t, Options{})
	p.SetProfile("m", Profile{Curve: Curve{K2: 0.01, Elements: 100}})
	for range 60 {
		p.ObserveSize("m", 1, 800, seconds(3*0.08))
	}
	if got, _ := p.EstimateSize("m", 1, 800); relErr(got.Seconds(), 0.24) > 0.05 {
		t.Fatalf("size 800 after its executions: %v, want about 240ms", got)
	}
	for range Window - 1 {
		p.ObserveSize("m", 1, 100, seconds(0.01))
	}
	if got, _ := p.EstimateSize("m", 1, 800); relErr(got.Seconds(), 0.24) > 0.05 {
		t.Errorf("size 800 while still fresh: %v, want about 240ms", got)
	}
	for range 60 {
		p.ObserveSize("m", 1, 100, seconds(0.01))
	}
	if got, _ := p.EstimateSize("m", 1, 800); relErr(got.Seconds(), 0.08) > 0.05 {
		t.Errorf("size 800 when stale: %v, want about 80ms (the model's current correction)", got)
	}
	// When it runs again, as profiled, its correction starts from the
	// model's that predicted it, not from what it had learnt then.
	p.ObserveSize("m", 1, 800, seconds(0.08))
	if got, _ := p.EstimateSize("m", 1, 800); relErr(got.Seconds(), 0.08) > 0.05 {
		t.Errorf("size 800 run again after it was stale: %v, want about 80ms", got)
	}
}
