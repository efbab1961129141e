package predictor

import (
	"context"
	"fmt"
	"testing"
	"time"
)

func TestFindKnees(t *testing.T) {
	pt := func(b int, s float64, ms float64) Point {
		return Point{Batch: b, Share: s, Latency: time.Duration(ms * float64(time.Millisecond))}
	}
	for _, tc := range []struct {
		name   string
		points []Point
		batch  int
		share  float64
		want   float64
	}{
		{"flat from half", []Point{pt(1, 1, 8.7), pt(1, 0.5, 8.9), pt(1, 0.25, 10.4)}, 1, 0.8, 0.5},
		{"below the knee unclamped", []Point{pt(1, 1, 8.7), pt(1, 0.5, 8.9), pt(1, 0.25, 10.4)}, 1, 0.3, 0.3},
		{"no knee: faster up to the whole device", []Point{pt(1, 1, 8), pt(1, 0.5, 16), pt(1, 0.25, 32)}, 1, 0.8, 0.8},
		{"one share: nothing known", []Point{pt(1, 1, 8)}, 1, 0.8, 0.8},
		{"a batch between takes the next larger knee", []Point{pt(1, 1, 5), pt(1, 0.25, 5), pt(8, 1, 20), pt(8, 0.5, 20), pt(8, 0.25, 40)}, 4, 0.9, 0.5},
		{"a batch past the largest profiled is not clamped", []Point{pt(1, 1, 5), pt(1, 0.25, 5)}, 8, 0.9, 0.9},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := findKnees(tc.points).clamp(tc.batch, tc.share); got != tc.want {
				t.Errorf("clamp(%d, %v) = %v, want %v", tc.batch, tc.share, got, tc.want)
			}
		})
	}
}

// Predictions past the knee are the knee's: more share is not predicted
// faster than the profile measured.
func TestPredictorClampsAtTheKnee(t *testing.T) {
	points := []Point{
		{Batch: 1, Share: 1, Latency: 8700 * time.Microsecond},
		{Batch: 1, Share: 0.5, Latency: 8700 * time.Microsecond},
		{Batch: 1, Share: 0.25, Latency: 10380 * time.Microsecond},
	}
	prof, err := NewProfile("k", points, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	p, _ := New(Options{})
	p.SetProfile("m", prof)
	at := func(s float64) time.Duration { d, _ := p.Latency("m", 1, s); return d }
	if at(1) != at(0.5) || at(0.75) != at(0.5) {
		t.Errorf("latency at 0.5, 0.75, 1 = %v, %v, %v: want the same past the knee", at(0.5), at(0.75), at(1))
	}
	if at(0.25) <= at(0.5) {
		t.Errorf("latency at 0.25 %v not above 0.5's %v", at(0.25), at(0.5))
	}
	if k, ok := p.Knee("m", 1); !ok || k != 0.5 {
		t.Errorf("Knee = %v, %v; want 0.5", k, ok)
	}
}

// A model whose sweep stopped at half the device (one intra-op thread on
// two CPUs: the sweep's shares are 1/8, 1/4 and 1/2, and a whole-device
// floor runs it as fast as half) is predicted at a share of 1 as at 1/2,
// not twice as fast. Served at 1, its executions then teach the online
// correction nothing, and the adjuster's prediction at a quarter stays
// the profile's. Predicted past the profile from the curve, share 1
// promised 2x the speed, the correction learnt 2x, and the prediction at a
// quarter came out twice the truth.
func TestPredictorClampsAtTheLargestProfiledShare(t *testing.T) {
	const half = 8 * time.Millisecond // batch 1 at share 1/2, the model's speed on one CPU
	truth := func(b int, s float64) time.Duration {
		return time.Duration(float64(b) * float64(half) * 0.5 / min(s, 0.5))
	}
	var points []Point
	for _, s := range []float64{0.125, 0.25, 0.5} {
		for _, b := range []int{1, 4} {
			points = append(points, Point{Batch: b, Share: s, Latency: truth(b, s)})
		}
	}
	prof, err := NewProfile("k", points, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	p, _ := New(Options{})
	p.SetProfile("m", prof)
	p.SetShare("m", 1)
	if d, _ := p.Estimate("m", 1); relErr(d.Seconds(), half.Seconds()) > 0.05 {
		t.Errorf("batch 1 at share 1 predicted %v, want %v (the speed at 1/2) within 5%%", d, half)
	}
	for range 100 {
		p.Observe("m", 1, truth(1, 1))
		p.Observe("m", 4, truth(4, 1))
	}
	if c := p.Accuracy("m").Correction; c < 0.95 || c > 1.05 {
		t.Errorf("correction %.2f after executions at share 1 that ran as profiled at 1/2, want 1 within 5%%", c)
	}
	for _, s := range []float64{0.25, 0.5, 1} {
		if d, _ := p.Latency("m", 4, s); relErr(d.Seconds(), truth(4, s).Seconds()) > 0.05 {
			t.Errorf("batch 4 at share %v predicted %v, want %v within 5%%", s, d, truth(4, s))
		}
	}
}

// A point slower than the same batch at a smaller share was disturbed: the
// sweep measures it again and keeps the faster time.
func TestSweepRemeasuresDisturbedPoints(t *testing.T) {
	var calls []string
	disturbed := true
	measure := func(_ context.Context, b int, s float64, _ int) (time.Duration, error) {
		calls = append(calls, fmt.Sprintf("s=%g", s))
		switch {
		case s == 0.5 && disturbed:
			disturbed = false
			return 14 * time.Millisecond, nil // another model's warm-up ran beside it
		case s >= 0.5:
			return 8700 * time.Microsecond, nil
		}
		return 10400 * time.Microsecond, nil
	}
	pts, err := Sweep(t.Context(), SweepOptions{Batches: []int{1}, Shares: []float64{0.25, 0.5, 1}, Runs: 1}, oneShape(measure))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := fmt.Sprint(calls), "[s=1 s=0.5 s=0.25 s=0.5]"; got != want {
		t.Errorf("calls %s, want %s", got, want)
	}
	if pts[1].Share != 0.5 || pts[1].Latency != 8700*time.Microsecond {
		t.Errorf("point at 0.5 = %+v, want the second measurement, 8.7ms", pts[1])
	}
	if k := findKnees(pts).clamp(1, 1); k != 0.5 {
		t.Errorf("knee %v, want 0.5", k)
	}
}

// A point a burst of other work slowed, though no point at a smaller
// share shows it, is far off the curve fitted to the others: the sweep
// measures it again and keeps the faster time. A point that is really
// that slow measures so again and stays.
func TestSweepRemeasuresOutliers(t *testing.T) {
	truth := Curve{K2: 0.002, K3: 0.001, K5: 0.0002}
	for _, tc := range []struct {
		name      string
		second    float64 // the second measurement of the disturbed point, over the truth
		wantRatio float64 // the point kept, over the truth
		wantCalls int
	}{
		{"disturbed once", 1, 1, 10},
		{"really slow", 1.6, 1.6, 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			calls := 0
			seen := false
			measure := func(_ context.Context, b int, s float64, _ int) (time.Duration, error) {
				calls++
				d := truth.Predict(b, s)
				// A build ran beside the first measurement at the smallest
				// share, where no smaller share shows it up.
				if b == 4 && s == 0.25 {
					f := 1.6
					if seen {
						f = tc.second
					}
					seen = true
					d = time.Duration(float64(d) * f)
				}
				return d, nil
			}
			pts, err := Sweep(t.Context(), SweepOptions{Batches: []int{1, 4, 8}, Shares: []float64{0.25, 0.5, 1}, Runs: 1}, oneShape(measure))
			if err != nil {
				t.Fatal(err)
			}
			if calls != tc.wantCalls {
				t.Errorf("%d measurements, want %d: each point once and the disturbed one again", calls, tc.wantCalls)
			}
			for _, pt := range pts {
				want := truth.Predict(pt.Batch, pt.Share)
				if pt.Batch == 4 && pt.Share == 0.25 {
					want = time.Duration(float64(want) * tc.wantRatio)
				}
				if pt.Latency != want {
					t.Errorf("point b=%d s=%g: %v, want %v", pt.Batch, pt.Share, pt.Latency, want)
				}
			}
		})
	}
}
