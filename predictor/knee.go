package predictor

import (
	"slices"
)

// KneeTolerance is how close to its best profiled time a batch size must
// run at a share for that share to count as its knee: beyond the knee more
// share buys nothing measurable. 5% is an assumption above the spread of
// the median of a few profiling runs.
const KneeTolerance = 0.05

// knees holds, per profiled batch size, the knee of its profile: the
// smallest profiled share whose time is within KneeTolerance of the
// fastest profiled time at that batch, when a larger share was profiled
// too (the flat part was seen). A model whose kernels cannot fill the
// device (a GPU model at a small batch: Gpulet and GSLICE measured such
// knees under MPS) runs no faster past its knee, while the fitted curve,
// smooth in the share, keeps falling; predictions clamp the share at the
// knee so that no share past it looks useful.
//
// Past the largest profiled share (top) nothing was measured either, and
// a profile stops below the whole device only where the sweep was told
// that no larger share is of use (models' usefulShare: a CPU model of one
// intra-op thread on two CPUs runs no faster than on one), so every batch
// is clamped there too. Predicted past it from the curve, a share of 1
// (what a latency-critical floor is predicted at) promised such a model
// twice the speed of half the device; the online correction learnt the
// 2x and then carried it to every share the adjuster asked about.
type knees struct {
	batches []int     // ascending
	at      []float64 // the knee of batches[i]
	top     float64   // the largest profiled share; 0 none
}

// findKnees reads the knees from a profile's points. A profile at several
// input sizes has a knee per batch and size; a batch's knee is the largest
// of its sizes' (a larger input fills more of the device), and none when
// one of its sizes showed none.
func findKnees(points []Point) knees {
	type group struct {
		batch    int
		elements int64
	}
	byGroup := map[group][]Point{}
	for _, pt := range points {
		if pt.usable() {
			g := group{pt.Batch, pt.Elements}
			byGroup[g] = append(byGroup[g], pt)
		}
	}
	knee := map[int]float64{} // per batch; 2 means one of its sizes has none
	var top float64
	for g, pts := range byGroup {
		for _, pt := range pts {
			top = max(top, pt.Share)
		}
		slices.SortFunc(pts, func(x, y Point) int {
			switch {
			case x.Share < y.Share:
				return -1
			case x.Share > y.Share:
				return 1
			}
			return 0
		})
		best := pts[0].Latency
		for _, pt := range pts {
			best = min(best, pt.Latency)
		}
		at := 2.0
		for i, pt := range pts {
			if float64(pt.Latency) <= float64(best)*(1+KneeTolerance) {
				if i < len(pts)-1 { // a larger share was measured no faster
					at = pt.Share
				}
				break
			}
		}
		knee[g.batch] = max(knee[g.batch], at)
	}
	var k knees
	for b, at := range knee {
		if at <= 1 {
			k.batches = append(k.batches, b)
			k.at = append(k.at, at)
		}
	}
	// Sort the pairs by batch.
	idx := make([]int, len(k.batches))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(x, y int) int { return k.batches[x] - k.batches[y] })
	sorted := knees{batches: make([]int, len(idx)), at: make([]float64, len(idx)), top: top}
	for i, j := range idx {
		sorted.batches[i], sorted.at[i] = k.batches[j], k.at[j]
	}
	return sorted
}

// clamp is the share a batch's prediction is made at: share, or the knee
// when share is past it. A batch size between profiled ones takes the knee
// of the next larger one (a larger batch fills more of the device, so its
// knee is not smaller); one past the largest profiled batch is not
// clamped, and neither is a batch whose profile showed no knee. Every
// batch is clamped at the largest profiled share.
func (k knees) clamp(batch int, share float64) float64 {
	if k.top > 0 {
		share = min(share, k.top)
	}
	i, _ := slices.BinarySearch(k.batches, batch)
	if i == len(k.batches) {
		return share
	}
	return min(share, k.at[i])
}

// Knee is the share past which the model's profile at a batch size ran no
// faster (see KneeTolerance), and false when the profile did not show one.
func (p *Predictor) Knee(name string, batch int) (float64, bool) {
	m := p.get(name)
	if m == nil {
		return 0, false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	i, _ := slices.BinarySearch(m.knees.batches, batch)
	if i == len(m.knees.batches) {
		return 0, false
	}
	return m.knees.at[i], true
}
