package qos

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

// Estimator predicts how long one execution of a model takes at a batch
// size. The scheduler asks it for admission, batching and dropping
// decisions and tells it every execution time it observes. The predictor
// package provides a richer implementation; EWMAEstimator is the default.
// Implementations must be safe for concurrent use.
type Estimator interface {
	// Estimate predicts the execution time of a batch; false means nothing
	// is known about the model yet.
	Estimate(model string, batch int) (time.Duration, bool)
	// Observe reports one execution of a batch that took this long.
	Observe(model string, batch int, took time.Duration)
}

// SizedEstimator is an Estimator that also takes the size of a batch's
// rows (RowElements): a model served at several input shapes runs each at
// its own speed, and the scheduler passes each request's own size. The
// predictor package's Predictor is one. Sizes are per row, so that a batch
// of n rows of size e is EstimateSize(model, n, e); 0 means unknown.
type SizedEstimator interface {
	Estimator
	EstimateSize(model string, batch int, elements int64) (time.Duration, bool)
	ObserveSize(model string, batch int, elements int64, took time.Duration)
}

var _ Estimator = (*EWMAEstimator)(nil)

// sizeBlind adapts an Estimator without sizes: they are ignored.
type sizeBlind struct{ Estimator }

func (b sizeBlind) EstimateSize(model string, batch int, _ int64) (time.Duration, bool) {
	return b.Estimate(model, batch)
}

func (b sizeBlind) ObserveSize(model string, batch int, _ int64, took time.Duration) {
	b.Observe(model, batch, took)
}

// sized returns est as a SizedEstimator.
func sized(est Estimator) SizedEstimator {
	if s, ok := est.(SizedEstimator); ok {
		return s
	}
	return sizeBlind{est}
}

// EWMAEstimator keeps an exponentially weighted moving average of the
// observed execution time per model and batch size. For a batch size it has
// not seen it fits t(b) = a + c*b to the sizes it has (least squares), so
// estimates inter- and extrapolate linearly; with one known size it assumes
// time proportional to the batch, the pessimistic case of no batching gain.
type EWMAEstimator struct {
	alpha float64

	mu     sync.Mutex
	models map[string]map[int]float64 // model -> batch -> seconds
}

// DefaultEWMAAlpha is the weight of a new observation when NewEWMAEstimator
// is given an alpha outside (0, 1].
const DefaultEWMAAlpha = 0.2

// NewEWMAEstimator returns an estimator that weighs each new observation by
// alpha (0 < alpha <= 1; otherwise DefaultEWMAAlpha).
func NewEWMAEstimator(alpha float64) *EWMAEstimator {
	if !(alpha > 0 && alpha <= 1) {
		alpha = DefaultEWMAAlpha
	}
	return &EWMAEstimator{alpha: alpha, models: map[string]map[int]float64{}}
}

// Observe implements Estimator.
func (e *EWMAEstimator) Observe(model string, batch int, took time.Duration) {
	if batch < 1 || took < 0 {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	m := e.models[model]
	if m == nil {
		m = map[int]float64{}
		e.models[model] = m
	}
	x := took.Seconds()
	if v, ok := m[batch]; ok {
		m[batch] = e.alpha*x + (1-e.alpha)*v
	} else {
		m[batch] = x
	}
}

// Estimate implements Estimator. It never returns 0 when anything is known.
func (e *EWMAEstimator) Estimate(model string, batch int) (time.Duration, bool) {
	batch = max(batch, 1)
	e.mu.Lock()
	defer e.mu.Unlock()
	m := e.models[model]
	if len(m) == 0 {
		return 0, false
	}
	if v, ok := m[batch]; ok {
		return positive(v), true
	}
	sizes := make([]int, 0, len(m))
	for b := range m {
		sizes = append(sizes, b)
	}
	slices.Sort(sizes)
	lo, hi := sizes[0], sizes[len(sizes)-1]
	if len(sizes) == 1 {
		return positive(m[lo] * float64(batch) / float64(lo)), true
	}
	// Least-squares fit of t = a + c*b.
	var sb, st, sbb, sbt float64
	for _, b := range sizes {
		x, y := float64(b), m[b]
		sb += x
		st += y
		sbb += x * x
		sbt += x * y
	}
	n := float64(len(sizes))
	c := (n*sbt - sb*st) / (n*sbb - sb*sb)
	a := (st - c*sb) / n
	v := a + c*float64(batch)
	// Keep the fit sane where noise makes it decrease: a larger batch is at
	// least as slow as the largest known one, a smaller one shrinks no more
	// than proportionally, and between known sizes the estimate lies between
	// its neighbours.
	switch {
	case batch > hi:
		v = math.Max(v, m[hi])
	case batch < lo:
		v = math.Max(v, m[lo]*float64(batch)/float64(lo))
		v = math.Min(v, m[lo])
	default:
		i, _ := slices.BinarySearch(sizes, batch)
		below, above := m[sizes[i-1]], m[sizes[i]]
		v = math.Min(math.Max(v, math.Min(below, above)), math.Max(below, above))
	}
	return positive(v), true
}

// RowElements is the size of one row of a request: the elements of all
// its inputs divided by the batch size when the model batches (batched),
// all of them when it does not. A SizedEstimator's sizes are in it (the
// predictor's curves are: predictor.Point.Elements).
func RowElements(req *runtime.InferRequest, batched bool) int64 {
	var n int64
	for _, in := range req.Inputs {
		e := int64(1)
		for d, x := range in.Shape {
			if d == 0 && batched {
				continue
			}
			e *= max(x, 0)
		}
		n += e
	}
	return n
}

// positive converts seconds to a duration of at least a nanosecond.
func positive(seconds float64) time.Duration {
	return max(time.Duration(seconds*float64(time.Second)), time.Nanosecond)
}

// Warmup seeds est with the execution times of a model: for each batch size
// it runs the request sample returns, runs times (the first run of each size
// is not observed: it pays one-off costs such as memory allocation). Batch
// sizes the model cannot run are the caller's to leave out.
func Warmup(ctx context.Context, model string, exec Executor, est Estimator, sizes []int, runs int, sample func(batch int) *runtime.InferRequest) error {
	if len(sizes) == 0 {
		return nil
	}
	// Row size: of a batch-1 request, whether the model batches or not.
	elements := RowElements(sample(1), false)
	sest := sized(est)
	for _, b := range sizes {
		for i := range runs + 1 {
			start := time.Now()
			if _, err := exec.Execute(ctx, sample(b)); err != nil {
				return fmt.Errorf("qos: warming up %s at batch %d: %w", model, b, err)
			}
			if i > 0 {
				sest.ObserveSize(model, b, elements, time.Since(start))
			}
		}
	}
	return nil
}
