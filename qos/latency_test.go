package qos

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// Quantiles read from the buckets err high by at most 5%, never low, at
// every scale, against the exact quantiles of the same samples.
func TestLatencyHistogramQuantiles(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, scale := range []time.Duration{200 * time.Microsecond, 3 * time.Millisecond, 80 * time.Millisecond, 2 * time.Second} {
		var h LatencyHistogram
		samples := make([]time.Duration, 5000)
		for i := range samples {
			samples[i] = time.Duration(rng.ExpFloat64() * float64(scale))
			h.Observe(samples[i])
		}
		slices.Sort(samples)
		for _, q := range []float64{0.5, 0.9, 0.99, 0.999} {
			exact := samples[int(q*float64(len(samples))+0.999999)-1]
			got := h.Quantile(q)
			floor := max(exact, latencyMin)
			if got < floor || float64(got) > 1.05*float64(floor)+1 {
				t.Errorf("scale %s q%.3f = %s, exact %s", scale, q, got, exact)
			}
		}
	}
}

func TestLatencyHistogramEdges(t *testing.T) {
	var h LatencyHistogram
	if h.Quantile(0.99) != 0 || h.Count() != 0 {
		t.Errorf("empty: %s, %d", h.Quantile(0.99), h.Count())
	}
	h.Observe(0)
	h.Observe(-time.Second) // a clock step; counted in the first bucket
	h.Observe(time.Hour)    // beyond the last bound; counted in the last
	if h.Count() != 3 {
		t.Errorf("count = %d", h.Count())
	}
	if got := h.Quantile(0.5); got != latencyMin {
		t.Errorf("median = %s, want the first bound %s", got, latencyMin)
	}
	if got := h.Quantile(1); got != latencyBound(latencyBuckets-1) || got < 2*time.Minute {
		t.Errorf("max = %s, want the last bound (over two minutes)", got)
	}
	snap := h
	h.Observe(5 * time.Millisecond)
	d := h.Sub(&snap)
	if d.Count() != 1 || d.Quantile(0) < 5*time.Millisecond || d.Quantile(0) > 5250*time.Microsecond {
		t.Errorf("difference: count %d, value %s; want one of 5ms", d.Count(), d.Quantile(0))
	}
}
