package qos

import "math"

// tailWindow is how many recent executions the room for error is read
// from: enough for a 95th percentile to rest on thirteen of them, so that
// stalls of one execution in fifty, clustered by chance, seldom reach it
// (at 128, seven in a window did, and refused requests for a while).
const tailWindow = 256

// tailRefresh is how many executions pass between two readings of the
// window's quantiles: sorting the window on every execution would cost
// the hot path more than the quantiles change.
const tailRefresh = 32

// tailQuantile is the quantile of the ratios the spread is read at, and
// tailZ how many of the spreads so read admission leaves as room: the
// 95th percentile is 1.645 standard deviations above the median of
// normal errors, so the room is that of two standard deviations (about
// the 98th percentile) where errors are normal, and holds where they are
// not.
const (
	tailQuantile = 0.95
	tailZ        = 2 / 1.645
)

// minTail is how many ratios the room needs: at 50, two stalls in the
// first executions do not yet make the 95th percentile.
const minTail = 50

// tail keeps the recent ratios of execution time over prediction and
// reads a low and a high quantile of them. Quantiles, not moments: on a
// busy host executions are heavy-tailed (a runner descheduled for 20 ms
// now and then), and one such stall in fifty raises the standard
// deviation past any useful room while the other 49 executions run as
// predicted. The median and the 95th percentile move only when the
// stalls are common enough to matter.
type tail struct {
	ring    [tailWindow]float64
	n       int // ratios seen, up to the first refresh past tailWindow
	next    int // where the next ratio goes
	pending int // ratios since the last refresh
	// mid and high are the median and the tailQuantile of the window at
	// the last refresh; 0 before minTail ratios.
	mid, high float64
	scratch   []float64
}

// observe adds one execution's ratio of actual over predicted time.
func (t *tail) observe(x float64) {
	if !(x >= 0) || math.IsInf(x, 0) {
		return
	}
	t.ring[t.next] = x
	t.next = (t.next + 1) % tailWindow
	t.n = min(t.n+1, tailWindow)
	t.pending++
	if t.n < minTail {
		return
	}
	if t.n == minTail || t.pending >= tailRefresh {
		t.refresh()
	}
}

// refresh reads the quantiles of the window. It selects them rather than
// sort the window: a sort of 256 ratios every tailRefresh executions cost
// about 500 ns an execution under the scheduler's lock.
func (t *tail) refresh() {
	t.pending = 0
	t.scratch = append(t.scratch[:0], t.ring[:t.n]...)
	hi := rankIndex(len(t.scratch), tailQuantile)
	t.high = selectNth(t.scratch, hi)
	// selectNth left everything below index hi before it.
	t.mid = selectNth(t.scratch[:hi+1], rankIndex(len(t.scratch), 0.5))
}

// rankIndex is the index of quantile q among n sorted values: the
// ceil(q*n)-th smallest (nearest rank).
func rankIndex(n int, q float64) int {
	return min(max(int(math.Ceil(q*float64(n)))-1, 0), n-1)
}

// selectNth reorders xs so that xs[k] is the value a sort would put there,
// with no larger value before it and no smaller one after, and returns
// it (Hoare's selection, the middle element as pivot).
func selectNth(xs []float64, k int) float64 {
	lo, hi := 0, len(xs)-1
	for lo < hi {
		pivot := xs[lo+(hi-lo)/2]
		i, j := lo, hi
		for i <= j {
			for xs[i] < pivot {
				i++
			}
			for xs[j] > pivot {
				j--
			}
			if i <= j {
				xs[i], xs[j] = xs[j], xs[i]
				i++
				j--
			}
		}
		switch {
		case k <= j:
			hi = j
		case k >= i:
			lo = i
		default:
			return xs[k]
		}
	}
	return xs[k]
}

// ratio is the room for the error of n executions in a row: the median
// ratio plus tailZ spreads (tailQuantile less the median) over sqrt(n)
// (the errors of n executions partly cancel), at least 1 and at most
// maxTailRatio; 1 until minTail executions were seen.
func (t *tail) ratio(n int) float64 {
	if t.n < minTail || t.high <= 0 {
		return 1
	}
	f := t.mid + tailZ*(t.high-t.mid)/math.Sqrt(float64(max(n, 1)))
	return min(max(f, 1), maxTailRatio)
}
