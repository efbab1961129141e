package qos

import (
	"math"
	"time"
)

// Latency buckets grow geometrically from latencyMin by latencyGrowth, so a
// quantile read from them is within latencyGrowth-1 (5%) of the true value
// at every scale from 100µs to two minutes; the last bucket takes anything
// longer.
const (
	latencyMin     = 100 * time.Microsecond
	latencyGrowth  = 1.05
	latencyBuckets = 292 // latencyMin * 1.05^291 ≈ 143 s
)

var logLatencyGrowth = math.Log(latencyGrowth)

// LatencyHistogram counts request latencies, cumulatively. It is a value:
// copying it takes a snapshot, and the difference of two snapshots is the
// histogram of the requests between them.
type LatencyHistogram struct {
	counts [latencyBuckets]uint64
	total  uint64
}

// latencyBucket is the index of the bucket that counts d: the first whose
// upper bound is at least d.
func latencyBucket(d time.Duration) int {
	if d <= latencyMin {
		return 0
	}
	i := int(math.Ceil(math.Log(float64(d)/float64(latencyMin)) / logLatencyGrowth))
	return min(i, latencyBuckets-1)
}

// latencyBound is the upper bound of bucket i.
func latencyBound(i int) time.Duration {
	return time.Duration(float64(latencyMin) * math.Pow(latencyGrowth, float64(i)))
}

// Observe counts one latency.
func (h *LatencyHistogram) Observe(d time.Duration) {
	h.counts[latencyBucket(d)]++
	h.total++
}

// Count is the number of latencies counted.
func (h *LatencyHistogram) Count() uint64 { return h.total }

// Sub returns the histogram of what h counted after prev, an earlier
// snapshot of the same histogram.
func (h *LatencyHistogram) Sub(prev *LatencyHistogram) LatencyHistogram {
	var d LatencyHistogram
	for i := range h.counts {
		d.counts[i] = h.counts[i] - prev.counts[i]
	}
	d.total = h.total - prev.total
	return d
}

// Quantile returns the latency at quantile q (0..1): the upper bound of
// the bucket holding the ceil(q*count)-th smallest latency, so the answer
// errs high by at most 5%. It returns 0 for an empty histogram.
func (h *LatencyHistogram) Quantile(q float64) time.Duration {
	if h.total == 0 {
		return 0
	}
	rank := uint64(math.Ceil(min(max(q, 0), 1) * float64(h.total)))
	rank = max(rank, 1)
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			return latencyBound(i)
		}
	}
	return latencyBound(latencyBuckets - 1)
}
