package predictor

import (
	"math"
	"slices"
)

// workingSets holds a model's working set per profiled batch size: the
// peak memory of one instance once it had run batches up to that size.
//
// The sweep reads the instance's peak after each point, shares from the
// largest down and batch sizes from the smallest up, and a peak never
// falls: the first share's readings are each batch's own working set,
// while a later share's reading at a small batch still holds the largest
// batch's peak (ONNX Runtime's arena keeps what it grew to). The smallest
// reading of a batch over the shares is therefore its working set; a
// larger batch is taken to need at least what a smaller one did. With
// several input shapes, each batch size is measured at every shape before
// the next size: a batch's reading is its own at the first
// shape or more (the smaller batches at every shape ran before it), and
// at most the largest of its own over the shapes.
type workingSets struct {
	batches []int   // ascending
	bytes   []int64 // bytes[i] is the working set of batches[i], nondecreasing
}

// findWorkingSets reads the working sets from a profile's points; empty
// when no point has a memory reading (profiles cached before memory was
// measured).
func findWorkingSets(points []Point) workingSets {
	least := map[int]int64{}
	for _, pt := range points {
		if pt.Batch < 1 || pt.Memory <= 0 {
			continue
		}
		if cur, ok := least[pt.Batch]; !ok || pt.Memory < cur {
			least[pt.Batch] = pt.Memory
		}
	}
	var w workingSets
	for b := range least {
		w.batches = append(w.batches, b)
	}
	slices.Sort(w.batches)
	var top int64
	for _, b := range w.batches {
		top = max(top, least[b])
		w.bytes = append(w.bytes, top)
	}
	return w
}

// at is the working set of a batch size: a profiled one's own, linear
// between two profiled sizes, the smallest one's below them, and past the
// largest the line through the last two carried on (the activations grow
// with the batch; the weights do not). false when nothing was profiled.
func (w workingSets) at(batch int) (int64, bool) {
	n := len(w.batches)
	if n == 0 {
		return 0, false
	}
	batch = max(batch, 1)
	i, exact := slices.BinarySearch(w.batches, batch)
	switch {
	case exact:
		return w.bytes[i], true
	case i == 0:
		return w.bytes[0], true
	case i == n:
		if n == 1 {
			return w.bytes[0], true
		}
		i = n - 1 // extrapolate along the last segment
	}
	b0, b1 := float64(w.batches[i-1]), float64(w.batches[i])
	m0, m1 := float64(w.bytes[i-1]), float64(w.bytes[i])
	v := m0 + (m1-m0)*(float64(batch)-b0)/(b1-b0)
	if v >= math.MaxInt64 {
		return math.MaxInt64, true
	}
	return int64(math.Ceil(v)), true
}

// WorkingSet is the memory, in bytes, one instance of the model needs to
// run batches up to the given size, from the peak memory its profile
// measured at each batch size (see workingSets.at); false when the profile
// holds no memory readings.
func (p *Predictor) WorkingSet(name string, batch int) (int64, bool) {
	m := p.get(name)
	if m == nil {
		return 0, false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.memory.at(batch)
}
