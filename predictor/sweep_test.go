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
		want := []string{
			"s=1 b=1", "s=1 b=4", "s=1 b=8",
			"s=0.5 b=1", "s=0.5 b=4", "s=0.5 b=8",
			"s=0.25 b=1", "s=0.25 b=4", "s=0.25 b=8",
		}
		if !slices.Equal(d.calls, want) {
			t.Errorf("calls %q, want %q", d.calls, want)
		}
		if len(pts) != 9 || pts[8] != (Point{Batch: 8, Share: 0.25, Latency: 320 * time.Millisecond}) {
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
		{name: "max batch 1 deduplicates", opts: SweepOptions{MaxBatch: 1, Shares: []float64{1}}, want: []string{"s=1 b=1"}},
		{name: "max batch 0", opts: SweepOptions{Shares: []float64{0.5}}, want: []string{"s=0.5 b=1"}},
		{name: "max batch 3", opts: SweepOptions{MaxBatch: 3, Shares: []float64{1}}, want: []string{"s=1 b=1", "s=1 b=3"}},
		{
			name: "explicit, unsorted, duplicated",
			opts: SweepOptions{Batches: []int{4, 0, 2, 4}, Shares: []float64{0.3, 1, 0.3}},
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

func TestSweepRuns(t *testing.T) {
	var got []int
	_, err := Sweep(t.Context(), SweepOptions{Batches: []int{1}, Shares: []float64{1}, Runs: 7},
		func(_ context.Context, _, _ int, _ float64, runs int) (time.Duration, error) {
			got = append(got, runs)
			return time.Millisecond, nil
		})
	if err != nil || !slices.Equal(got, []int{7}) {
		t.Errorf("runs %v, err %v", got, err)
	}
	got = nil
	Sweep(t.Context(), SweepOptions{Batches: []int{1}, Shares: []float64{1}},
		func(_ context.Context, _, _ int, _ float64, runs int) (time.Duration, error) {
			got = append(got, runs)
			return time.Millisecond, nil
		})
	if !slices.Equal(got, []int{DefaultRuns}) {
		t.Errorf("default runs %v", got)
	}
}

func TestSweepBudget(t *testing.T) {
	// Each call at share s and batch b sleeps 4 runs x 100ms*b/s.
	curve := Curve{K2: 0.1}
	tests := []struct {
		name      string
		budget    time.Duration
		wantCalls int
		wantPts   int
		wantErr   error
	}{
		// Share 1: b=1 0.4s, b=2 0.8s; share 0.5: 0.8s, 1.6s; share 0.25: 1.6s, 3.2s.
		{name: "all", budget: 20 * time.Second, wantCalls: 6, wantPts: 6},
		// 0.4+0.8+0.8+1.6 = 3.6s for 2 shares x 2 batches; the next call starts
		// before 4s, is cut off at 4s and dropped.
		{name: "enough", budget: 4 * time.Second, wantCalls: 5, wantPts: 4},
		// Cut off during share 0.5's second batch.
		{name: "too few", budget: 3 * time.Second, wantCalls: 4, wantPts: 3, wantErr: ErrBudget},
		{name: "default budget", budget: 0, wantCalls: 6, wantPts: 6},
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
		// Calls start at 0, 2 and 4s; the third ends at 6s, past the budget.
		// Three points at one share are too few.
		if !errors.Is(err, ErrBudget) || calls != 3 || len(pts) != 3 {
			t.Errorf("calls %d, points %d, err %v; want 3, 3, ErrBudget", calls, len(pts), err)
		}
	})
}

func TestSweepCancel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		d := &fakeDevice{curve: Curve{K2: 0.1}}
		go func() {
			time.Sleep(time.Second)
			cancel()
		}()
		pts, err := Sweep(ctx, SweepOptions{Batches: []int{1, 2}}, oneShape(d.measure))
		if !errors.Is(err, context.Canceled) || errors.Is(err, ErrBudget) {
			t.Fatalf("err = %v, want context.Canceled", err)
		}
		// 0.4s for the first point; the second is interrupted at 1s.
		if len(pts) != 1 || len(d.calls) != 2 {
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
