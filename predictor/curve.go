package predictor

import (
	"errors"
	"math"
	"slices"
	"time"
)

// ErrNoPoints is returned by Fit when it is given no usable measurement.
var ErrNoPoints = errors.New("predictor: no usable profile points")

// Point is one profiled measurement.
type Point struct {
	Batch   int
	Share   float64       // compute share of the device, (0,1]
	Latency time.Duration // execution time of one batch (median of Windows)
	// Elements is the size of one row of the batch's input: the elements
	// of all inputs of a batch-1 request (of the whole request for a model
	// that does not batch); 0 unknown, which counts as the curve's
	// reference size. See Curve.
	Elements int64 `json:",omitempty"`
	shape    int   // index of the shape in the sweep, for Sweep only
	// Memory is the instance's peak memory in bytes by the end of this
	// point's runs (SweepOptions.Memory); 0 unknown. See WorkingSet.
	Memory int64 `json:",omitempty"`
	// Windows are the times Sweep measured the point at, one a round, in
	// rounds' order (each the mean of runs back to back over a window);
	// Latency is their median, or a faster time measured again
	// (remeasureDisturbed, remeasureOutliers). Their spread is how
	// repeatable the point was; none for points not from Sweep.
	Windows []time.Duration `json:",omitempty"`
}

// usable reports whether a point can take part in a fit.
func (pt Point) usable() bool {
	return pt.Batch >= 1 && pt.Share > 0 && pt.Share <= 1 && pt.Latency > 0
}

// Curve is t(b, s, n) = (K1*w^2 + K2*w + K6*b + K3)/(s + K4) + K5 seconds
// with w = b*n/Elements, the batch's work in rows of the reference size: a
// batch costs a fixed part, a part that grows with its elements (w), a part
// per row whatever its size (K6: per-row launches, pre- and post-processing
// of each row) and, at large batches, a superlinear part (K1); the compute
// part shrinks as the share grows (K4 models the part that does not scale
// with it), and K5 is time no share buys back (launch, copies). Elements is
// the per-row element count w is measured in (the smallest profiled); 0, or
// a request of unknown size (n = 0), means w = b: the curve of a model
// profiled at one shape, as before sizes were known. Curves from Fit have
// all coefficients non-negative, so predictions never decrease with the
// batch or the input size nor increase with the share.
type Curve struct {
	K1, K2, K3, K4, K5 float64
	K6                 float64 `json:",omitempty"`
	Elements           float64 `json:",omitempty"`
	// MaxWork is the largest work (w) the curve was fitted on; 0:
	// unknown. Past it the superlinear part was never measured. Up to
	// squareReach times it the w^2 term goes on as fitted: the demo
	// models' largest batch at twice the largest profiled width ran
	// slower than the square's tangent at MaxWork said (see
	// TestCurveSquarePastProfiledWork). Further out a square
	// extrapolated (a 1600x1600 image against a profile at 64 and 256 is
	// 40x the work) predicted a detection at 27 s that takes one: there
	// the w^2 term goes on along its tangent at squareReach x MaxWork, so
	// time grows linearly.
	MaxWork float64 `json:",omitempty"`
}

// squareReach is how far past the largest profiled work, as a multiple
// of it, a curve's square goes on before its tangent takes over.
const squareReach = 2

// Bounds Predict keeps its arguments and result in.
const (
	minShare   = 1e-3
	maxSeconds = 1e6
)

// Predict returns the execution time of one batch at a share. A batch below
// 1 counts as 1; a share outside (0, 1] (0 and NaN included) counts as the
// whole device, and a share below 0.001 as 0.001. The result is at least a
// nanosecond and at most about 11 days, whatever the coefficients.
func (c Curve) Predict(batch int, share float64) time.Duration {
	return seconds(c.seconds(batch, share, 0))
}

// PredictSize is Predict for a batch whose rows have elements elements
// each (see Point.Elements); 0 or less means the reference size.
func (c Curve) PredictSize(batch int, share float64, elements int64) time.Duration {
	return seconds(c.seconds(batch, share, elements))
}

func (c Curve) seconds(batch int, share float64, elements int64) float64 {
	b := float64(max(batch, 1))
	w := c.work(b, elements)
	s := normShare(share)
	sq := w * w
	if reach := squareReach * c.MaxWork; reach > 0 && w > reach {
		sq = reach * (2*w - reach)
	}
	return (c.K1*sq+c.K2*w+c.K6*b+c.K3)/(max(s+c.K4, minShare)) + c.K5
}

// work is a batch's work in rows of the reference size.
func (c Curve) work(b float64, elements int64) float64 {
	if elements <= 0 || !(c.Elements > 0) {
		return b
	}
	return b * float64(elements) / c.Elements
}

// valid reports whether the curve can predict: finite, non-negative
// coefficients, not all of the latency terms zero.
func (c Curve) valid() bool {
	ks := [...]float64{c.K1, c.K2, c.K3, c.K4, c.K5, c.K6, c.Elements, c.MaxWork}
	for _, k := range ks {
		if !(k >= 0) || math.IsInf(k, 0) {
			return false
		}
	}
	return c.K1 > 0 || c.K2 > 0 || c.K3 > 0 || c.K5 > 0 || c.K6 > 0
}

// normShare maps a share to (0, 1]: outside that range (0 and NaN
// included) means the whole device.
func normShare(s float64) float64 {
	if !(s > 0 && s <= 1) {
		return 1
	}
	return max(s, minShare)
}

// seconds converts seconds to a duration in [1ns, maxSeconds].
func seconds(v float64) time.Duration {
	if !(v > 0) { // NaN too
		return time.Nanosecond
	}
	v = min(v, maxSeconds)
	return max(time.Duration(v*float64(time.Second)), time.Nanosecond)
}

// MAPE returns the mean absolute percentage error of c on points (0.07 is
// 7%). Unusable points are skipped; with none left it is 0.
func MAPE(c Curve, points []Point) float64 {
	var sum float64
	var n int
	for _, pt := range points {
		if !pt.usable() {
			continue
		}
		t := pt.Latency.Seconds()
		sum += math.Abs(c.PredictSize(pt.Batch, pt.Share, pt.Elements).Seconds()-t) / t
		n++
	}
	if n == 0 {
		return 0
	}
	return sum / float64(n)
}

// The fit's columns: the coefficient each multiplies.
const (
	colK1 = iota // w^2/(s+K4)
	colK2        // w/(s+K4)
	colK3        // 1/(s+K4)
	colK5        // 1
	colK6        // b/(s+K4)
	numCols
)

// subsets lists the column subsets Fit tries, smallest first and, among
// equals, those without the quadratic or the per-row term first, so that
// when the data cannot tell two shapes apart the simpler one, linear in
// the work, wins.
var subsets = func() []int {
	var s []int
	for m := 1; m < 1<<numCols; m++ {
		s = append(s, m)
	}
	pop := func(m int) int {
		n := 0
		for ; m != 0; m &= m - 1 {
			n++
		}
		return n
	}
	slices.SortStableFunc(s, func(a, b int) int {
		if d := pop(a) - pop(b); d != 0 {
			return d
		}
		extra := func(m int) int { return m & (1<<colK1 | 1<<colK6) }
		return pop(extra(a)) - pop(extra(b))
	})
	return s
}()

// k4Grid holds the K4 values Fit searches: 0, then log-spaced from 0.001
// to 2. The best one is refined by golden-section search between its
// neighbours.
var k4Grid = func() []float64 {
	const n = 32
	g := []float64{0}
	lo, hi := math.Log(1e-3), math.Log(2)
	for i := range n {
		g = append(g, math.Exp(lo+(hi-lo)*float64(i)/(n-1)))
	}
	return g
}()

// Fit fits a Curve to profile points by least squares on the relative
// error, so that a 1 ms batch counts as much as a 100 ms one. For each K4 on
// a grid the model is linear in K1, K2, K3, K5 and K6; Fit solves that
// non-negative least-squares problem exactly (every subset of the five
// columns, the best feasible one wins) and keeps the K4 with the least
// error, refined between grid points. All coefficients are therefore
// non-negative. The curve's Elements is the smallest positive
// Point.Elements (0 when no point has one): points at several input sizes
// fit one surface in batch, share and size.
//
// Points with a batch below 1, a share outside (0, 1] or a non-positive
// latency are ignored; with none left Fit returns ErrNoPoints. The full
// model needs at least two shares and two work values (batch times size;
// three for the quadratic term), and the per-row term K6 two batch sizes
// and two input sizes. With less, Fit degrades to the pessimistic shapes
// instead of guessing:
//   - one share: K4 = 0 and K5 = 0, so time is inversely proportional to the
//     share (perfect scaling; the only assumption one share allows);
//   - one work value (one batch size at one input size): only K2 (and K4
//     from the shares), so time is proportional to the batch, the case of
//     no batching gain;
//   - one point, or both of the above: t = K2*b/s.
func Fit(points []Point) (Curve, error) {
	c, err := fit(points)
	if err != nil {
		return c, err
	}
	for _, pt := range points {
		if pt.usable() {
			c.MaxWork = max(c.MaxWork, Curve{Elements: c.Elements}.work(float64(pt.Batch), pt.Elements))
		}
	}
	return c, nil
}

func fit(points []Point) (Curve, error) {
	pts := make([]Point, 0, len(points))
	shares := map[float64]bool{}
	batches := map[int]bool{}
	sizes := map[int64]bool{}
	var ref int64
	for _, pt := range points {
		if pt.usable() {
			pts = append(pts, pt)
			shares[pt.Share] = true
			batches[pt.Batch] = true
			if pt.Elements > 0 {
				sizes[pt.Elements] = true
				if ref == 0 || pt.Elements < ref {
					ref = pt.Elements
				}
			}
		}
	}
	if len(pts) == 0 {
		return Curve{}, ErrNoPoints
	}
	ref0 := Curve{Elements: float64(ref)}
	works := map[float64]bool{}
	for _, pt := range pts {
		works[ref0.work(float64(pt.Batch), pt.Elements)] = true
	}
	allowed := 1<<colK1 | 1<<colK2 | 1<<colK3 | 1<<colK5 | 1<<colK6
	if len(works) < 2 {
		allowed = 1 << colK2
	}
	if len(batches) < 2 || len(sizes) < 2 {
		allowed &^= 1 << colK6 // the per-row term is the work term or the fixed one
	}
	f := newFitter(pts, allowed, ref0)
	if len(shares) < 2 {
		allowed &^= 1 << colK5
		f.allowed = allowed
		if c, _, ok := f.solve(0); ok {
			return c, nil
		}
		return proportional(pts, ref0), nil
	}
	best, bestErr, bestI := Curve{}, math.Inf(1), -1
	for i, k4 := range k4Grid {
		if c, e, ok := f.solve(k4); ok && e < bestErr {
			best, bestErr, bestI = c, e, i
		}
	}
	if bestI < 0 {
		return proportional(pts, ref0), nil
	}
	// Golden-section search between the best grid point's neighbours.
	lo := k4Grid[max(bestI-1, 0)]
	hi := k4Grid[min(bestI+1, len(k4Grid)-1)]
	errAt := func(k4 float64) (Curve, float64) {
		c, e, ok := f.solve(k4)
		if !ok {
			return c, math.Inf(1)
		}
		return c, e
	}
	const phi = 0.6180339887498949
	a, b := hi-phi*(hi-lo), lo+phi*(hi-lo)
	ca, ea := errAt(a)
	cb, eb := errAt(b)
	for range 40 {
		if ea < eb {
			hi, b, cb, eb = b, a, ca, ea
			a = hi - phi*(hi-lo)
			ca, ea = errAt(a)
		} else {
			lo, a, ca, ea = a, b, cb, eb
			b = lo + phi*(hi-lo)
			cb, eb = errAt(b)
		}
	}
	if ea < bestErr {
		best, bestErr = ca, ea
	}
	if eb < bestErr {
		best = cb
	}
	return best, nil
}

// proportional is the last resort: t = K2*w/s with K2 the mean of t*s/w.
func proportional(pts []Point, ref Curve) Curve {
	var k float64
	for _, pt := range pts {
		k += pt.Latency.Seconds() * pt.Share / ref.work(float64(pt.Batch), pt.Elements)
	}
	return Curve{K2: k / float64(len(pts)), Elements: ref.Elements}
}

// fitter holds the points of one Fit and scratch space for its solves.
type fitter struct {
	pts     []Point
	t       []float64 // latencies in seconds
	allowed int       // bit mask of the columns that may be used
	ref     Curve     // holds the reference size work is measured in
	x       [][numCols]float64
}

func newFitter(pts []Point, allowed int, ref Curve) *fitter {
	f := &fitter{pts: pts, allowed: allowed, ref: ref, t: make([]float64, len(pts)), x: make([][numCols]float64, len(pts))}
	for i, pt := range pts {
		f.t[i] = pt.Latency.Seconds()
	}
	return f
}

// solve fits the linear coefficients for one K4 and returns the curve, its
// sum of squared relative errors, and false when no subset was feasible.
func (f *fitter) solve(k4 float64) (Curve, float64, bool) {
	// Rows are divided by t so that the target is 1 and the residual is
	// the relative error; columns are scaled to unit norm for conditioning.
	var norm [numCols]float64
	for i, pt := range f.pts {
		u := 1 / (pt.Share + k4)
		b := float64(pt.Batch)
		wk := f.ref.work(b, pt.Elements)
		w := 1 / f.t[i]
		f.x[i] = [numCols]float64{wk * wk * u * w, wk * u * w, u * w, w, b * u * w}
		for j, v := range f.x[i] {
			norm[j] += v * v
		}
	}
	for j := range norm {
		norm[j] = math.Sqrt(norm[j])
		if !(norm[j] > 0) || math.IsInf(norm[j], 0) {
			return Curve{}, 0, false
		}
	}
	var g [numCols][numCols]float64
	var r [numCols]float64
	for i := range f.x {
		for j := range numCols {
			f.x[i][j] /= norm[j]
		}
		for j := range numCols {
			r[j] += f.x[i][j]
			for k := j; k < numCols; k++ {
				g[j][k] += f.x[i][j] * f.x[i][k]
			}
		}
	}
	for j := range numCols {
		for k := range j {
			g[j][k] = g[k][j]
		}
	}
	var best [numCols]float64
	bestErr, found := math.Inf(1), false
	for _, m := range subsets {
		if m&^f.allowed != 0 {
			continue
		}
		beta, ok := solveSubset(&g, &r, m)
		if !ok {
			continue
		}
		var e float64
		for i := range f.x {
			var p float64
			for j := range numCols {
				p += f.x[i][j] * beta[j]
			}
			e += (p - 1) * (p - 1)
		}
		// Ties go to the earlier, simpler subset.
		if e < bestErr*(1-1e-9) || !found {
			best, bestErr, found = beta, e, true
		}
	}
	if !found {
		return Curve{}, 0, false
	}
	c := Curve{
		K1: best[colK1] / norm[colK1],
		K2: best[colK2] / norm[colK2],
		K3: best[colK3] / norm[colK3],
		K4: k4,
		K5: best[colK5] / norm[colK5],
		K6: best[colK6] / norm[colK6],

		Elements: f.ref.Elements,
	}
	if !c.valid() {
		return Curve{}, 0, false
	}
	return c, bestErr, true
}

// solveSubset solves the normal equations restricted to the columns in mask
// by Cholesky decomposition. It fails when the columns are (nearly)
// dependent or when a coefficient comes out negative.
func solveSubset(g *[numCols][numCols]float64, r *[numCols]float64, mask int) ([numCols]float64, bool) {
	var idx [numCols]int
	n := 0
	for j := range numCols {
		if mask&(1<<j) != 0 {
			idx[n] = j
			n++
		}
	}
	var l [numCols][numCols]float64
	for i := range n {
		for k := 0; k <= i; k++ {
			s := g[idx[i]][idx[k]]
			for p := range k {
				s -= l[i][p] * l[k][p]
			}
			if i == k {
				// Columns have unit norm, so a tiny pivot means dependence.
				if s <= 1e-10 {
					return [numCols]float64{}, false
				}
				l[i][i] = math.Sqrt(s)
			} else {
				l[i][k] = s / l[k][k]
			}
		}
	}
	var y, x [numCols]float64
	for i := range n {
		s := r[idx[i]]
		for p := range i {
			s -= l[i][p] * y[p]
		}
		y[i] = s / l[i][i]
	}
	for i := n - 1; i >= 0; i-- {
		s := y[i]
		for p := i + 1; p < n; p++ {
			s -= l[p][i] * x[p]
		}
		x[i] = s / l[i][i]
	}
	var beta [numCols]float64
	for i := range n {
		if !(x[i] > 0) || math.IsInf(x[i], 0) {
			return beta, false
		}
		beta[idx[i]] = x[i]
	}
	return beta, true
}
