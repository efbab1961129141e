package predictor

import (
	"context"
	"testing"
	"testing/synctest"
	"time"
)

// TestSweepRecordsWorkingSets plays an instance whose arena grows to the
// largest batch it has run and never shrinks, as ONNX Runtime's does: the
// sweep's readings at the second and third shares all hold the largest
// batch's peak, and WorkingSet still answers each batch's own.
func TestSweepRecordsWorkingSets(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const weights, perRow = 100 << 20, 10 << 20
		d := &fakeDevice{curve: Curve{K2: 0.01, K3: 0.001}}
		var peak int64
		measure := func(ctx context.Context, b int, s float64, runs int) (time.Duration, error) {
			peak = max(peak, weights+int64(b)*perRow)
			return d.measure(ctx, b, s, runs)
		}
		pts, err := Sweep(t.Context(), SweepOptions{Batches: []int{1, 4, 8}, Memory: func() int64 { return peak }}, oneShape(measure))
		if err != nil {
			t.Fatal(err)
		}
		for _, pt := range pts {
			if pt.Memory <= 0 {
				t.Fatalf("point %+v has no memory reading", pt)
			}
		}
		if pts[3].Batch != 1 || pts[3].Memory != weights+8*perRow {
			t.Fatalf("second share's batch 1 read %d, want the peak of batch 8", pts[3].Memory)
		}
		prof, err := NewProfile("k", pts, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		p, err := New(Options{})
		if err != nil {
			t.Fatal(err)
		}
		p.SetProfile("m/1", prof)
		for _, c := range []struct {
			batch int
			want  int64
		}{
			{1, weights + perRow},
			{4, weights + 4*perRow},
			{8, weights + 8*perRow},
			{2, weights + 2*perRow},   // between 1 and 4
			{16, weights + 16*perRow}, // past the largest: the last segment's line
			{0, weights + perRow},
		} {
			got, ok := p.WorkingSet("m/1", c.batch)
			if !ok || got != c.want {
				t.Errorf("WorkingSet(batch %d) = %d, %v; want %d", c.batch, got, ok, c.want)
			}
		}
	})
}

func TestWorkingSetUnknown(t *testing.T) {
	p, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := p.WorkingSet("nobody/1", 1); ok {
		t.Error("an unknown model has a working set")
	}
	// A profile cached before memory was measured has none.
	p.SetProfile("old/1", Profile{Points: []Point{
		{Batch: 1, Share: 1, Latency: time.Millisecond}, {Batch: 4, Share: 1, Latency: 3 * time.Millisecond},
		{Batch: 1, Share: 0.5, Latency: 2 * time.Millisecond}, {Batch: 4, Share: 0.5, Latency: 6 * time.Millisecond},
	}})
	if ws, ok := p.WorkingSet("old/1", 1); ok {
		t.Errorf("a profile without memory readings answers %d", ws)
	}
}

// A reading that fell at a larger batch (reclaimed page cache) does not
// make the larger batch look smaller than a smaller one.
func TestWorkingSetsNondecreasing(t *testing.T) {
	w := findWorkingSets([]Point{{Batch: 1, Memory: 300}, {Batch: 2, Memory: 250}, {Batch: 4, Memory: 500}})
	for _, c := range []struct {
		batch int
		want  int64
	}{{1, 300}, {2, 300}, {3, 400}, {4, 500}} {
		if got, _ := w.at(c.batch); got != c.want {
			t.Errorf("at(%d) = %d, want %d", c.batch, got, c.want)
		}
	}
}
