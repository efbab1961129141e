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
	pts, err := Sweep(t.Context(), SweepOptions{Batches: []int{1}, Shares: []float64{0.25, 0.5, 1}}, oneShape(measure))
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
			pts, err := Sweep(t.Context(), SweepOptions{Batches: []int{1, 4, 8}, Shares: []float64{0.25, 0.5, 1}}, oneShape(measure))
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
