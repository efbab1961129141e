package predictor

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

// truth is a curve shaped like a small CNN on CPU: 2 ms fixed, 1.5 ms per
// image, a little superlinear, 20% of the work not scaling with the share
// and 0.3 ms of launch overhead.
var truth = Curve{K1: 0.00002, K2: 0.0015, K3: 0.002, K4: 0.05, K5: 0.0003}

// synth samples c at every batch and share, with relative noise of up to
// ±noise drawn from a seeded source.
func synth(c Curve, batches []int, shares []float64, noise float64, seed uint64) []Point {
	rng := rand.New(rand.NewPCG(seed, 1))
	var pts []Point
	for _, s := range shares {
		for _, b := range batches {
			t := c.seconds(b, s, 0) * (1 + noise*(2*rng.Float64()-1))
			pts = append(pts, Point{Batch: b, Share: s, Latency: seconds(t)})
		}
	}
	return pts
}

func relErr(got, want float64) float64 { return math.Abs(got-want) / want }

func TestFitRecoversCoefficients(t *testing.T) {
	pts := synth(truth, []int{1, 2, 4, 8, 16, 32}, []float64{0.1, 0.25, 0.5, 0.75, 1}, 0, 1)
	c, err := Fit(pts)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fit %+v, MAPE %.2g", c, MAPE(c, pts))
	for _, k := range []struct {
		name      string
		got, want float64
	}{{"K1", c.K1, truth.K1}, {"K2", c.K2, truth.K2}, {"K3", c.K3, truth.K3}, {"K4", c.K4, truth.K4}, {"K5", c.K5, truth.K5}} {
		if e := relErr(k.got, k.want); e > 0.02 {
			t.Errorf("%s = %g, want %g (off by %.1f%%)", k.name, k.got, k.want, 100*e)
		}
	}
	if m := MAPE(c, pts); m > 0.001 {
		t.Errorf("MAPE on noise-free points = %g", m)
	}
}

func TestFitNoisyHeldOut(t *testing.T) {
	for seed := range uint64(5) {
		train := synth(truth, []int{1, 4, 8, 16}, []float64{0.25, 0.5, 1}, 0.03, seed)
		held := synth(truth, []int{2, 6, 12}, []float64{0.35, 0.75}, 0, 0)
		c, err := Fit(train)
		if err != nil {
			t.Fatal(err)
		}
		m := MAPE(c, held)
		t.Logf("seed %d: fit %+v, train MAPE %.3f, held-out MAPE %.3f", seed, c, MAPE(c, train), m)
		if m > 0.05 {
			t.Errorf("seed %d: held-out MAPE %.3f > 5%%", seed, m)
		}
	}
}

// checkShape asserts the properties callers rely on over the valid range.
func checkShape(t *testing.T, c Curve) {
	t.Helper()
	for _, k := range []float64{c.K1, c.K2, c.K3, c.K4, c.K5} {
		if !(k >= 0) || math.IsInf(k, 0) {
			t.Fatalf("coefficient %g in %+v", k, c)
		}
	}
	shares := []float64{0.01, 0.1, 0.25, 0.33, 0.5, 0.9, 1}
	for _, s := range shares {
		prev := time.Duration(0)
		for b := 1; b <= 256; b *= 2 {
			d := c.Predict(b, s)
			if d <= 0 {
				t.Fatalf("Predict(%d, %g) = %v", b, s, d)
			}
			if d < prev {
				t.Fatalf("Predict decreases in batch at (%d, %g): %v < %v", b, s, d, prev)
			}
			prev = d
		}
	}
	for b := 1; b <= 256; b *= 2 {
		prev := time.Duration(math.MaxInt64)
		for _, s := range shares {
			d := c.Predict(b, s)
			if d > prev {
				t.Fatalf("Predict increases in share at (%d, %g): %v > %v", b, s, d, prev)
			}
			prev = d
		}
	}
}

func TestFitShape(t *testing.T) {
	// A curve decreasing in the batch, which Fit must not reproduce.
	weird := []Point{
		{Batch: 1, Share: 1, Latency: 10 * time.Millisecond}, {Batch: 2, Share: 1, Latency: 8 * time.Millisecond}, {Batch: 4, Share: 1, Latency: 12 * time.Millisecond},
		{Batch: 1, Share: 0.5, Latency: 15 * time.Millisecond}, {Batch: 2, Share: 0.5, Latency: 30 * time.Millisecond}, {Batch: 4, Share: 0.5, Latency: 14 * time.Millisecond},
		{Batch: 1, Share: 0.25, Latency: 9 * time.Millisecond}, {Batch: 2, Share: 0.25, Latency: 50 * time.Millisecond}, {Batch: 4, Share: 0.25, Latency: 20 * time.Millisecond},
	}
	for name, pts := range map[string][]Point{
		"truth": synth(truth, []int{1, 4, 8}, []float64{0.25, 0.5, 1}, 0, 0),
		"noisy": synth(truth, []int{1, 4, 8}, []float64{0.25, 0.5, 1}, 0.3, 7),
		"weird": weird,
	} {
		t.Run(name, func(t *testing.T) {
			c, err := Fit(pts)
			if err != nil {
				t.Fatal(err)
			}
			checkShape(t, c)
		})
	}
}

func TestFitDegenerate(t *testing.T) {
	ms := time.Millisecond
	tests := []struct {
		name    string
		pts     []Point
		wantErr error
		check   func(t *testing.T, c Curve)
	}{
		{name: "empty", wantErr: ErrNoPoints},
		{name: "all unusable", pts: []Point{{Batch: 0, Share: 1, Latency: ms}, {Batch: 1, Share: 0, Latency: ms}, {Batch: 1, Share: 1.5, Latency: ms}, {Batch: 1, Share: 1, Latency: 0}, {Batch: 1, Share: math.NaN(), Latency: ms}, {Batch: 1, Share: 1, Latency: -ms}}, wantErr: ErrNoPoints},
		{
			name: "one point",
			pts:  []Point{{Batch: 4, Share: 0.5, Latency: 8 * ms}},
			check: func(t *testing.T, c Curve) {
				// t = K2*b/s: the point itself, double at twice the batch, half at twice the share.
				expect(t, c, 4, 0.5, 8*ms)
				expect(t, c, 8, 0.5, 16*ms)
				expect(t, c, 4, 1, 4*ms)
			},
		},
		{
			name: "one share",
			pts:  []Point{{Batch: 1, Share: 0.5, Latency: 3 * ms}, {Batch: 4, Share: 0.5, Latency: 6 * ms}, {Batch: 8, Share: 0.5, Latency: 10 * ms}},
			check: func(t *testing.T, c Curve) {
				if c.K4 != 0 || c.K5 != 0 {
					t.Errorf("one share: K4, K5 = %g, %g, want 0 (time ∝ 1/share)", c.K4, c.K5)
				}
				if r := c.Predict(4, 0.25).Seconds() / c.Predict(4, 0.5).Seconds(); relErr(r, 2) > 1e-6 {
					t.Errorf("halving the share multiplies time by %g, want 2", r)
				}
			},
		},
		{
			name: "one batch",
			pts:  []Point{{Batch: 4, Share: 0.25, Latency: 20 * ms}, {Batch: 4, Share: 0.5, Latency: 11 * ms}, {Batch: 4, Share: 1, Latency: 6 * ms}},
			check: func(t *testing.T, c Curve) {
				if c.K1 != 0 || c.K3 != 0 || c.K5 != 0 {
					t.Errorf("one batch: %+v, want only K2 and K4", c)
				}
				if r := c.Predict(8, 0.5).Seconds() / c.Predict(4, 0.5).Seconds(); relErr(r, 2) > 1e-6 {
					t.Errorf("doubling the batch multiplies time by %g, want 2", r)
				}
				if m := MAPE(c, []Point{{Batch: 4, Share: 0.25, Latency: 20 * ms}, {Batch: 4, Share: 0.5, Latency: 11 * ms}, {Batch: 4, Share: 1, Latency: 6 * ms}}); m > 0.05 {
					t.Errorf("MAPE %g", m)
				}
			},
		},
		{
			name: "two batches",
			pts:  synth(Curve{K2: 0.001, K3: 0.002, K4: 0.1}, []int{1, 8}, []float64{0.25, 1}, 0, 0),
			check: func(t *testing.T, c Curve) {
				if m := MAPE(c, synth(Curve{K2: 0.001, K3: 0.002, K4: 0.1}, []int{2, 4, 16}, []float64{0.5}, 0, 0)); m > 0.01 {
					t.Errorf("linear truth from two batch sizes: held-out MAPE %g (fit %+v)", m, c)
				}
			},
		},
		{
			name: "duplicates and outliers",
			pts:  append(synth(truth, []int{1, 8}, []float64{0.5, 1}, 0, 0), Point{Batch: 1, Share: 1, Latency: time.Hour}, Point{Batch: 1, Share: 1, Latency: time.Nanosecond}),
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Fit(tt.pts)
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("err = %v, want %v", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%+v", c)
			checkShape(t, c)
			if tt.check != nil {
				tt.check(t, c)
			}
		})
	}
}

func expect(t *testing.T, c Curve, b int, s float64, want time.Duration) {
	t.Helper()
	if got := c.Predict(b, s); relErr(got.Seconds(), want.Seconds()) > 1e-6 {
		t.Errorf("Predict(%d, %g) = %v, want %v", b, s, got, want)
	}
}

func TestPredictClamps(t *testing.T) {
	c := Curve{K2: 0.001}
	for _, tt := range []struct {
		b    int
		s    float64
		want time.Duration
	}{
		{1, 1, time.Millisecond},
		{0, 1, time.Millisecond},          // batch below 1 is 1
		{-5, 0, time.Millisecond},         // share 0 is the whole device
		{1, 2, time.Millisecond},          // above 1 too
		{1, math.NaN(), time.Millisecond}, // and NaN
		{1, 1e-9, time.Second},            // tiny shares floor at 0.001
	} {
		if got := c.Predict(tt.b, tt.s); got != tt.want {
			t.Errorf("Predict(%d, %g) = %v, want %v", tt.b, tt.s, got, tt.want)
		}
	}
	if got := (Curve{}).Predict(1, 1); got != time.Nanosecond {
		t.Errorf("zero curve predicts %v, want 1ns", got)
	}
	if got := (Curve{K5: 1e300}).Predict(1, 1); got <= 0 || got > 12*24*time.Hour {
		t.Errorf("huge curve predicts %v", got)
	}
}

func TestMAPE(t *testing.T) {
	c := Curve{K2: 0.001}
	pts := []Point{{Batch: 1, Share: 1, Latency: 2 * time.Millisecond}, {Batch: 2, Share: 1, Latency: 2 * time.Millisecond}, {Batch: 0, Share: 1, Latency: time.Second}}
	if got := MAPE(c, pts); relErr(got, 0.25) > 1e-9 {
		t.Errorf("MAPE = %g, want 0.25 (0.5 and 0; the unusable point skipped)", got)
	}
	if got := MAPE(c, nil); got != 0 {
		t.Errorf("MAPE of nothing = %g", got)
	}
}

func FuzzFit(f *testing.F) {
	f.Add([]byte{1, 10, 50, 2, 10, 60, 4, 5, 90, 8, 5, 200})
	f.Add([]byte{1, 1, 1})
	f.Add([]byte{255, 255, 255, 0, 0, 0, 1, 255, 1})
	f.Add([]byte{3, 100, 7, 3, 100, 7, 3, 100, 8})
	f.Fuzz(func(t *testing.T, data []byte) {
		var pts []Point
		for i := 0; i+2 < len(data); i += 3 {
			// Batch 0..255 (0 unusable), share in (0, 1] in steps of 1/100 or
			// beyond, latency spread over 1 µs .. ~30 s logarithmically.
			lat := time.Duration(float64(time.Microsecond) * math.Pow(1.07, float64(data[i+2])))
			pts = append(pts, Point{Batch: int(data[i]), Share: float64(data[i+1]) / 100, Latency: lat})
		}
		c, err := Fit(pts)
		if err != nil {
			if !errors.Is(err, ErrNoPoints) {
				t.Fatal(err)
			}
			return
		}
		checkShape(t, c)
		if m := MAPE(c, pts); math.IsNaN(m) || math.IsInf(m, 0) || m < 0 {
			t.Fatalf("MAPE %g", m)
		}
	})
}

func BenchmarkFit(b *testing.B) {
	for _, n := range []struct{ batches, shares int }{{3, 3}, {6, 5}} {
		bs := []int{1, 2, 4, 8, 16, 32}[:n.batches]
		ss := []float64{0.25, 0.5, 1, 0.1, 0.75}[:n.shares]
		pts := synth(truth, bs, ss, 0.03, 1)
		b.Run(fmt.Sprintf("points=%d", len(pts)), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Fit(pts); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
