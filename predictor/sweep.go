package predictor

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
)

// ErrBudget is wrapped by Sweep's error when the time budget ran out before
// two batch sizes at each of two shares were measured, too few for Fit's
// full model.
var ErrBudget = errors.New("predictor: profiling budget exhausted")

// Measure measures one point of a sweep: the execution time of a batch at
// a share and at the input shape of index shape, the median of runs
// windows (see Sweep).
type Measure func(ctx context.Context, shape, batch int, share float64, runs int) (time.Duration, error)

// Sweep defaults.
const (
	DefaultRuns   = 3
	DefaultBudget = 20 * time.Second
)

// DefaultShares are the shares Sweep measures when SweepOptions.Shares is
// empty.
var DefaultShares = []float64{0.25, 0.5, 1.0}

// SweepOptions say what Sweep measures.
type SweepOptions struct {
	Batches  []int     // default {1, MaxBatch/2, MaxBatch} deduplicated
	MaxBatch int       // used when Batches is empty; below 1 means 1
	Shares   []float64 // default DefaultShares; each in (0, 1]
	// Elements are the row sizes (Point.Elements) of the input shapes to
	// measure, one per shape, in the order measure's shape index counts;
	// empty means one shape of unknown size.
	Elements []int64
	Runs     int           // rounds (timed windows) per point, default DefaultRuns
	Budget   time.Duration // for the whole sweep, default DefaultBudget
	// Memory, when set, is read after each point's first window: the
	// peak memory of the instance in bytes (0 unknown), kept as the
	// point's Memory.
	Memory func() int64
}

// withDefaults returns the options with defaults filled in, batches sorted
// ascending and shares descending, both deduplicated.
func (o SweepOptions) withDefaults() (SweepOptions, error) {
	if len(o.Batches) == 0 {
		m := max(o.MaxBatch, 1)
		o.Batches = []int{1, m / 2, m}
	} else {
		o.Batches = slices.Clone(o.Batches)
	}
	o.Batches = slices.DeleteFunc(o.Batches, func(b int) bool { return b < 1 })
	slices.Sort(o.Batches)
	o.Batches = slices.Compact(o.Batches)
	if len(o.Shares) == 0 {
		o.Shares = DefaultShares
	}
	o.Shares = slices.Clone(o.Shares)
	for _, s := range o.Shares {
		if !(s > 0 && s <= 1) {
			return o, fmt.Errorf("predictor: sweep share %v outside (0, 1]", s)
		}
	}
	slices.SortFunc(o.Shares, func(a, b float64) int { return cmp.Compare(b, a) })
	o.Shares = slices.Compact(o.Shares)
	if o.Runs < 1 {
		o.Runs = DefaultRuns
	}
	if o.Budget <= 0 {
		o.Budget = DefaultBudget
	}
	return o, nil
}

// Sweep profiles a model. For each share and batch size it measures every
// input shape (an index into opts.Elements; 0 when it is empty), opts.Runs
// times in rounds, and a point's time is the median of its rounds:
// measure sets the share, runs the batch once unmeasured the first time
// it is asked for that shape and batch at that share, and then returns
// the mean time of the batch run back to back over a window (the median
// of runs windows when runs is above 1). Calls go share-major, shares
// from the largest down (the share changes as rarely as possible: on a
// GPU each change restarts a runner), then batch sizes from the smallest
// up (when the budget runs short the fast points are the ones already
// measured); for each batch size each round measures the shapes in the
// order given, every other round in reverse. So the shapes of a batch are
// measured moments apart and alike (a machine slowing down moves them
// all, where shape after shape the held-out shapes of a benchmark, listed
// after the training ones, were measured seconds after them and the
// drift read as the cost of their size), and with several shapes a
// point's windows are not back to back, so a short burst of other work
// is in one of them rather than in all.
//
// Then it measures again, once, each point slower than the same batch at a
// smaller share (remeasureDisturbed) and each point more than
// OutlierRatio slower than the curve fitted to them all
// (remeasureOutliers), and keeps the faster measurement.
//
// measure gets a context that ends when ctx does or the budget is used up.
// Sweep starts no new measurement once the budget is used up and returns the
// points it has (a point measured in fewer rounds has the median of
// those); the error then wraps ErrBudget only if fewer than two shares
// with two batch sizes each were measured. A measurement error or the end of
// ctx stops the sweep and is returned, wrapped, with the points so far.
func Sweep(ctx context.Context, opts SweepOptions, measure Measure) ([]Point, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	bctx, cancel := context.WithTimeoutCause(ctx, opts.Budget, ErrBudget)
	defer cancel()
	var points []Point
	short := func() error {
		if enough(points) {
			return nil
		}
		return fmt.Errorf("%w after %v with %d points", ErrBudget, opts.Budget, len(points))
	}
	elements := opts.Elements
	if len(elements) == 0 {
		elements = []int64{0}
	}
	for _, s := range opts.Shares {
		for _, b := range opts.Batches {
			first := len(points) // this batch's points start here, a shape each
			for round := range opts.Runs {
				for i := range elements {
					shape := i
					if round%2 == 1 {
						shape = len(elements) - 1 - i
					}
					if err := ctx.Err(); err != nil {
						return finish(points), fmt.Errorf("predictor: sweep: %w", err)
					}
					if bctx.Err() != nil {
						return finish(points), short()
					}
					t, err := measure(bctx, shape, b, s, 1)
					if err != nil {
						if ctx.Err() == nil && errors.Is(context.Cause(bctx), ErrBudget) {
							return finish(points), short()
						}
						return finish(points), fmt.Errorf("predictor: measuring batch %d at share %g, shape %d: %w", b, s, shape, err)
					}
					if t <= 0 {
						return finish(points), fmt.Errorf("predictor: measuring batch %d at share %g, shape %d: non-positive time %v", b, s, shape, t)
					}
					if round == 0 {
						pt := Point{Batch: b, Share: s, Elements: max(elements[shape], 0), shape: shape}
						if opts.Memory != nil {
							pt.Memory = max(opts.Memory(), 0)
						}
						points = append(points, pt)
					}
					pt := &points[first+shape]
					pt.Windows = append(pt.Windows, t)
				}
			}
		}
	}
	points = finish(points)
	remeasureDisturbed(bctx, points, opts.Runs, measure)
	remeasureOutliers(bctx, points, opts.Runs, measure)
	return points, nil
}

// finish sets each point's latency to the median of its windows (the
// mean of the middle two of an even count) and returns points.
func finish(points []Point) []Point {
	for i := range points {
		w := slices.Clone(points[i].Windows)
		slices.Sort(w)
		if n := len(w); n > 0 {
			points[i].Latency = (w[(n-1)/2] + w[n/2]) / 2
		}
	}
	return points
}

// OutlierRatio is how much slower than the curve fitted to all of a
// sweep's points a point must have run for the sweep to measure it
// again: a burst of other work on the machine (a build, another model's
// load) slows a point by more than the spread of its runs, and the fit
// then bends towards it and is wrong at every point around it.
const OutlierRatio = 1.25

// remeasureOutliers fits the points and measures again, once, each point
// that ran more than OutlierRatio slower than the fit says (the slowest
// first), keeping the faster of the two measurements. A point that was
// really that slow measures so again and stays. It stops, keeping what
// it has, when the budget runs out or a measurement fails.
func remeasureOutliers(ctx context.Context, points []Point, runs int, measure Measure) {
	c, err := Fit(points)
	if err != nil {
		return
	}
	type outlier struct {
		i     int
		ratio float64
	}
	var out []outlier
	for i, pt := range points {
		if r := float64(pt.Latency) / float64(c.PredictSize(pt.Batch, pt.Share, pt.Elements)); r > OutlierRatio {
			out = append(out, outlier{i, r})
		}
	}
	slices.SortFunc(out, func(a, b outlier) int { return cmp.Compare(b.ratio, a.ratio) })
	for _, o := range out {
		if ctx.Err() != nil {
			return
		}
		pt := &points[o.i]
		t, err := measure(ctx, pt.shape, pt.Batch, pt.Share, runs)
		if err != nil {
			return
		}
		if t > 0 && t < pt.Latency {
			pt.Latency = t
		}
	}
}

// remeasureDisturbed measures again, once, each point that ran slower than
// the same batch at a smaller share: more compute never slows a batch, so
// such a point was disturbed (another model's load or warm-up ran beside
// it), and a disturbed point hides where the model stops getting faster
// (its knee). The faster of the two measurements is kept. It stops, keeping
// what it has, when the budget runs out or a measurement fails: the first
// pass's points stand.
func remeasureDisturbed(ctx context.Context, points []Point, runs int, measure Measure) {
	for i := range points {
		pt := &points[i]
		disturbed := false
		for _, o := range points {
			if o.Batch == pt.Batch && o.shape == pt.shape && o.Share < pt.Share && float64(pt.Latency) > float64(o.Latency)*(1+KneeTolerance) {
				disturbed = true
			}
		}
		if !disturbed {
			continue
		}
		if ctx.Err() != nil {
			return
		}
		t, err := measure(ctx, pt.shape, pt.Batch, pt.Share, runs)
		if err != nil {
			return
		}
		if t > 0 && t < pt.Latency {
			pt.Latency = t
		}
	}
}

// enough reports whether points hold two shares with two batch sizes (or
// two shapes) each.
func enough(points []Point) bool {
	type at struct {
		batch int
		shape int
	}
	perShare := map[float64]map[at]bool{}
	for _, pt := range points {
		if perShare[pt.Share] == nil {
			perShare[pt.Share] = map[at]bool{}
		}
		perShare[pt.Share][at{pt.Batch, pt.shape}] = true
	}
	n := 0
	for _, bs := range perShare {
		if len(bs) >= 2 {
			n++
		}
	}
	return n >= 2
}
