package predictor

import (
	"math"
	"testing"
	"time"
)

// Past the largest profiled work a curve grows linearly, along the
// tangent of its fitted square: a detector profiled at 64x64 and 256x256
// (16x the elements) and asked about 1600x1600 (625x) once predicted 27 s
// for a detection that takes about one, and admission refused every
// request queued behind it.
func TestCurveExtrapolatesLinearlyPastProfiledWork(t *testing.T) {
	const small, large = 3 * 64 * 64, 3 * 256 * 256
	// A surface with a clear square in the work: t = (1e-4 w^2 + 1e-3 w + 2e-3)/s.
	truth := func(b int, s float64, n int64) time.Duration {
		w := float64(b) * float64(n) / small
		return time.Duration((1e-4*w*w + 1e-3*w + 2e-3) / s * float64(time.Second))
	}
	var pts []Point
	for _, n := range []int64{small, large} {
		for _, b := range []int{1, 2, 4} {
			for _, s := range []float64{0.25, 0.5, 1} {
				pts = append(pts, Point{Batch: b, Share: s, Elements: n, Latency: truth(b, s, n)})
			}
		}
	}
	c, err := Fit(pts)
	if err != nil {
		t.Fatal(err)
	}
	if c.MaxWork != 4*16 {
		t.Fatalf("MaxWork = %v, want 64 (batch 4 at 16x the reference size)", c.MaxWork)
	}
	// Inside the profile the fit is the surface.
	for _, pt := range pts {
		if got, want := c.PredictSize(pt.Batch, pt.Share, pt.Elements), pt.Latency; math.Abs(float64(got-want)) > 0.02*float64(want) {
			t.Errorf("b=%d s=%g n=%d: %v, want %v", pt.Batch, pt.Share, pt.Elements, got, want)
		}
	}
	// Past it: the tangent at w=64, t(64) + t'(64)(w-64).
	const huge = 3 * 1600 * 1600
	w := float64(huge) / small // 625
	tan := (c.K1*64*(2*w-64) + c.K2*w + c.K6 + c.K3) / (1 + c.K4)
	got := c.PredictSize(1, 1, huge).Seconds()
	if math.Abs(got-(tan+c.K5)) > 1e-9 {
		t.Errorf("at 625x the work: %.4fs, want the tangent's %.4fs", got, tan+c.K5)
	}
	square := truth(1, 1, huge).Seconds()
	if got > square/3 {
		t.Errorf("at 625x the work: %.2fs, the square's %.2fs: not linear past the profile", got, square)
	}
	// Monotone across MaxWork: no step down where the tangent takes over.
	prev := 0.0
	for w := 60.0; w <= 70; w += 0.5 {
		v := c.PredictSize(1, 1, int64(w*small)).Seconds()
		if v < prev {
			t.Errorf("prediction falls at w=%.1f: %.5f after %.5f", w, v, prev)
		}
		prev = v
	}
}
