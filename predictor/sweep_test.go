package predictor

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"testing/synctest"
	"time"
)

// fakeDevice measures by sleeping, inside a synctest bubble, for the
// curve's time of every run (the warm-up included), and records the calls.
type fakeDevice struct {
	curve Curve
	calls []string
	err   map[string]error // by call
}

func (d *fakeDevice) measure(ctx context.Context, b int, s float64, runs int) (time.Duration, error) {
	call := fmt.Sprintf("s=%g b=%d", s, b)
	d.calls = append(d.calls, call)
	if err := d.err[call]; err != nil {
		return 0, err
	}
	t := d.curve.Predict(b, s)
	select {
	case <-time.After(t * time.Duration(runs+1)):
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	return t, nil
}

func TestSweepOrderAndDefaults(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := &fakeDevice{curve: Curve{K2: 0.01}}
		pts, err := Sweep(t.Context(), SweepOptions{MaxBatch: 8}, oneShape(d.measure))
		if err != nil {
			t.Fatal(err)
		}
		// DefaultRuns rounds a point (of its shapes: here one).
		var want []string
		for _, s := range []string{"1", "0.5", "0.25"} {
			for _, b := range []string{"1", "4", "8"} {
				want = append(want, "s="+s+" b="+b, "s="+s+" b="+b, "s="+s+" b="+b)
			}
		}
		if !slices.Equal(d.calls, want) {
			t.Errorf("calls %q, want %q", d.calls, want)
		}
		last := Point{Batch: 8, Share: 0.25, Latency: 320 * time.Millisecond}
		if len(pts) != 9 || pts[8].Batch != last.Batch || pts[8].Share != last.Share || pts[8].Latency != last.Latency ||
			!slices.Equal(pts[8].Windows, []time.Duration{320 * time.Millisecond, 320 * time.Millisecond, 320 * time.Millisecond}) {
			t.Errorf("points %v", pts)
		}
	})
}

func TestSweepOptions(t *testing.T) {
	tests := []struct {
		name    string
		opts    SweepOptions
		want    []string
		wantErr bool
	}{
		{name: "max batch 1 deduplicates", opts: SweepOptions{MaxBatch: 1, Shares: []float64{1}, Runs: 1}, want: []string{"s=1 b=1"}},
		{name: "max batch 0", opts: SweepOptions{Shares: []float64{0.5}, Runs: 1}, want: []string{"s=0.5 b=1"}},
		{name: "max batch 3", opts: SweepOptions{MaxBatch: 3, Shares: []float64{1}, Runs: 1}, want: []string{"s=1 b=1", "s=1 b=3"}},
		{
			name: "explicit, unsorted, duplicated",
			opts: SweepOptions{Batches: []int{4, 0, 2, 4}, Shares: []float64{0.3, 1, 0.3}, Runs: 1},
			want: []string{"s=1 b=2", "s=1 b=4", "s=0.3 b=2", "s=0.3 b=4"},
		},
		{name: "share above 1", opts: SweepOptions{Shares: []float64{1.5}}, wantErr: true},
		{name: "share 0", opts: SweepOptions{Shares: []float64{0}}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				d := &fakeDevice{curve: Curve{K2: 0.01}}
				_, err := Sweep(t.Context(), tt.opts, oneShape(d.measure))
				if (err != nil) != tt.wantErr {
					t.Fatalf("err = %v", err)
				}
				if !slices.Equal(d.calls, tt.want) {
					t.Errorf("calls %q, want %q", d.calls, tt.want)
				}
			})
		})
	}
}

// Runs is the rounds a point is measured in, one window each; the point's
// time is the median of its windows.
func TestSweepRuns(t *testing.T) {
	var got []int
	var n time.Duration
	pts, err := Sweep(t.Context(), SweepOptions{Batches: []int{1}, Shares: []float64{1}, Runs: 7},
		func(_ context.Context, _, _ int, _ float64, runs int) (time.Duration, error) {
			got = append(got, runs)
			n++
			return n * time.Millisecond, nil
		})
	if err != nil || !slices.Equal(got, []int{1, 1, 1, 1, 1, 1, 1}) {
		t.Errorf("runs %v, err %v", got, err)
	}
	if len(pts) != 1 || pts[0].Latency != 4*time.Millisecond || len(pts[0].Windows) != 7 {
		t.Errorf("points %+v, want one at the median of 1 to 7 ms", pts)
	}
	got = nil
	Sweep(t.Context(), SweepOptions{Batches: []int{1}, Shares: []float64{1}},
		func(_ context.Context, _, _ int, _ float64, runs int) (time.Duration, error) {
			got = append(got, runs)
			return time.Millisecond, nil
		})
	if len(got) != DefaultRuns {
		t.Errorf("default runs %v", got)
	}
}

func TestSweepBudget(t *testing.T) {
	// Each call at share s and batch b sleeps 2 runs x 100ms*b/s (the
	// fake's unmeasured run and one window), 3 rounds a point.
	curve := Curve{K2: 0.1}
	tests := []struct {
		name      string
		budget    time.Duration
		wantCalls int
		wantPts   int
		wantErr   error
	}{
		// Share 1: b=1 3x0.2s, b=2 3x0.4s, 1.8s a share; share 0.5: 3.6s;
		// share 0.25: 7.2s.
		{name: "all", budget: 20 * time.Second, wantCalls: 18, wantPts: 6},
		// 1.8+1.2+0.8 = 3.8s for 2 shares x 2 batches, the last with one
		// window; its second starts then, is cut off at 3.9s and dropped.
		{name: "enough", budget: 3900 * time.Millisecond, wantCalls: 11, wantPts: 4},
		// Cut off during share 0.5's batch 1 rounds.
		{name: "too few", budget: 2500 * time.Millisecond, wantCalls: 8, wantPts: 3, wantErr: ErrBudget},
		{name: "default budget", budget: 0, wantCalls: 18, wantPts: 6},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				d := &fakeDevice{curve: curve}
				start := time.Now()
				pts, err := Sweep(t.Context(), SweepOptions{Batches: []int{1, 2}, Budget: tt.budget}, oneShape(d.measure))
				if !errors.Is(err, tt.wantErr) || (tt.wantErr == nil && err != nil) {
					t.Fatalf("err = %v, want %v", err, tt.wantErr)
				}
				if len(d.calls) != tt.wantCalls || len(pts) != tt.wantPts {
					t.Errorf("%d calls, %d points (%v), want %d, %d", len(d.calls), len(pts), pts, tt.wantCalls, tt.wantPts)
				}
				if tt.budget > 0 && time.Since(start) > tt.budget {
					t.Errorf("sweep took %v, over its budget", time.Since(start))
				}
			})
		})
	}
}

func TestSweepBudgetChecksBeforeEachCall(t *testing.T) {
	// A measure that ignores its context: Sweep cannot interrupt it, but
	// starts nothing new once the budget is gone.
	synctest.Test(t, func(t *testing.T) {
		calls := 0
		pts, err := Sweep(t.Context(), SweepOptions{Batches: []int{1, 2, 3}, Budget: 5 * time.Second},
			func(_ context.Context, _, _ int, _ float64, _ int) (time.Duration, error) {
				calls++
				time.Sleep(2 * time.Second)
				return time.Millisecond, nil
			})
		// Calls start at 0, 2 and 4s, batch 1's three rounds; the third
		// ends at 6s, past the budget. One point is too few.
		if !errors.Is(err, ErrBudget) || calls != 3 || len(pts) != 1 {
			t.Errorf("calls %d, points %d, err %v; want 3, 1, ErrBudget", calls, len(pts), err)
		}
	})
}

func TestSweepCancel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		d := &fakeDevice{curve: Curve{K2: 0.1}}
		go func() {
			time.Sleep(900 * time.Millisecond)
			cancel()
		}()
		pts, err := Sweep(ctx, SweepOptions{Batches: []int{1, 2}}, oneShape(d.measure))
		if !errors.Is(err, context.Canceled) || errors.Is(err, ErrBudget) {
			t.Fatalf("err = %v, want context.Canceled", err)
		}
		// 3 x 0.2s for batch 1; batch 2's first window is interrupted at
		// 0.9s.
		if len(pts) != 1 || len(d.calls) != 4 || pts[0].Latency != 100*time.Millisecond || len(pts[0].Windows) != 3 {
			t.Errorf("points %v, calls %v", pts, d.calls)
		}
	})
}

func TestSweepMeasureError(t *testing.T) {
	boom := errors.New("runner crashed")
	synctest.Test(t, func(t *testing.T) {
		d := &fakeDevice{curve: Curve{K2: 0.1}, err: map[string]error{"s=0.5 b=2": boom}}
		pts, err := Sweep(t.Context(), SweepOptions{Batches: []int{1, 2}}, oneShape(d.measure))
		if !errors.Is(err, boom) {
			t.Fatalf("err = %v, want %v", err, boom)
		}
		if len(pts) != 3 {
			t.Errorf("points %v, want the 3 before the failure", pts)
		}
	})
	pts, err := Sweep(t.Context(), SweepOptions{Batches: []int{1}}, func(context.Context, int, int, float64, int) (time.Duration, error) {
		return 0, nil
	})
	if err == nil || len(pts) != 0 {
		t.Errorf("a zero measurement: points %v, err %v", pts, err)
	}
}

// TestSweepFitCacheEstimate runs the load-time path end to end on a fake
// device: sweep, fit, cache, restart, install.
func TestSweepFitCacheEstimate(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := &fakeDevice{curve: truth}
		pts, err := Sweep(t.Context(), SweepOptions{MaxBatch: 16}, oneShape(d.measure))
		if err != nil {
			t.Fatal(err)
		}
		prof, err := NewProfile("model-key", pts, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		cache := Cache{Dir: t.TempDir()}
		if err := cache.Store(prof); err != nil {
			t.Fatal(err)
		}
		// After a restart.
		loaded, ok, err := cache.Load("model-key")
		if !ok || err != nil {
			t.Fatalf("ok %v, err %v", ok, err)
		}
		p := newPredictor(t, Options{})
		p.SetProfile("det/1", loaded)
		p.SetShare("det/1", 0.4)
		for _, b := range []int{1, 3, 12} {
			got, _ := p.Estimate("det/1", b)
			if want := truth.Predict(b, 0.4); relErr(got.Seconds(), want.Seconds()) > 0.02 {
				t.Errorf("Estimate(%d) at share 0.4 = %v, want %v", b, got, want)
			}
		}
		if a := p.Accuracy("det/1"); a.ProfileMAPE > 0.01 || !a.HasCurve {
			t.Errorf("accuracy %+v", a)
		}
	})
}

// oneShape adapts a measure of batch and share to Sweep's Measure, for
// sweeps at one shape.
func oneShape(f func(ctx context.Context, batch int, share float64, runs int) (time.Duration, error)) Measure {
	return func(ctx context.Context, _, batch int, share float64, runs int) (time.Duration, error) {
		return f(ctx, batch, share, runs)
	}
}

// TestSweepDriftMovesShapesAlike plays a machine that gets steadily
// slower while a model is profiled (5% a second: other work starting),
// profiled at two training shapes and two held-out ones listed after
// them, as the held-out benchmark does. A curve fitted on the training
// shapes' points predicts the held-out shapes' points about as well as
// it fits its own (2.3% against 1.9%): each batch's shapes are measured
// moments apart, every round, so the drift moves them alike. Measured
// shape after shape, the held-out points were seconds later than the
// training ones and the drift read as their error (3.4% against a fit
// of 0.4%: the drift, fitted as the training shapes' cost of size).
func TestSweepDriftMovesShapesAlike(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		elements := []int64{1000, 4000, 2000, 8000} // training, then held out
		start := time.Now()
		warm := map[string]bool{}
		measure := func(ctx context.Context, shape, b int, s float64, runs int) (time.Duration, error) {
			slower := 1 + 0.05*time.Since(start).Seconds()
			d := time.Duration(float64(sizedTruth.PredictSize(b, s, elements[shape])) * slower)
			n := runs // windows of one run each
			if k := fmt.Sprint(shape, b, s); !warm[k] {
				warm[k] = true
				n++ // the unmeasured run
			}
			time.Sleep(d * time.Duration(n))
			return d, nil
		}
		pts, err := Sweep(t.Context(), SweepOptions{Batches: []int{1, 4, 8}, Elements: elements, Budget: time.Hour}, measure)
		if err != nil {
			t.Fatal(err)
		}
		var train, held []Point
		for _, pt := range pts {
			if pt.Elements == 1000 || pt.Elements == 4000 {
				train = append(train, pt)
			} else {
				held = append(held, pt)
			}
		}
		c, err := Fit(train)
		if err != nil {
			t.Fatal(err)
		}
		fit, out := MAPE(c, train), MAPE(c, held)
		t.Logf("sweep of %v: fit MAPE %.2f%%, held-out MAPE %.2f%%", time.Since(start), 100*fit, 100*out)
		if out > fit+0.01 {
			t.Errorf("held-out MAPE %.2f%% over the fit's %.2f%% plus a point: the drift reads as the held-out shapes' error", 100*out, 100*fit)
		}
	})
}
