package models

import (
	"context"
	"math"
	"slices"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// This file runs the profiling sweep of a fresh version and builds the
// sample requests that profiling, warm-ups and swaps run.

// warmupRequests returns requests of zeros for the warm-up at batch sizes 1
// and the maximum, at the first of the config's profile.shapes, or nil
// when an input has BYTES data or a dynamic dimension other than the batch
// that profile.shapes does not fill (the default profile shapes are not
// used: a model may refuse them, and a failed warm-up fails a resize), or
// when even batch 1 is over limits.max_tensor_elements. A batch size whose
// request would be over the limit is left out: a client could not send it
// either.
func warmupRequests(v *version) (func(batch int) *runtime.InferRequest, []int) {
	var given map[string][]int64
	if len(v.cfg.Profile.Shapes) > 0 {
		given = v.cfg.Profile.Shapes[0]
	}
	sample, fits := samplesFor(v, given)
	if sample == nil {
		return nil, nil
	}
	sizes := []int{1}
	if v.maxBatch > 1 {
		sizes = append(sizes, v.maxBatch)
	}
	return sample, slices.DeleteFunc(sizes, func(b int) bool { return !fits(b) })
}

// samplesFor returns a function building a request of zeros at a batch
// size, with the given shapes for dynamic dimensions, and one telling
// whether a batch size's request is within the version's element limit
// (the builder must only be called for those); nil when no request is
// possible, batch 1 included. Nothing is allocated before the count is
// checked, so a hostile shape in a config or a model file costs nothing.
func samplesFor(v *version, given map[string][]int64) (func(batch int) *runtime.InferRequest, func(batch int) bool) {
	shapes := make([][]int64, len(v.inputs))
	for i, in := range v.inputs {
		shape, ok := sampleShape(in, given, v.maxBatch > 0)
		if !ok || in.DataType == runtime.Bytes {
			return nil, nil
		}
		shapes[i] = shape
	}
	at := func(i, batch int) []int64 {
		shape := slices.Clone(shapes[i])
		if v.maxBatch > 0 {
			shape[0] = int64(batch)
		}
		return shape
	}
	limit := v.maxElements
	if limit <= 0 {
		limit = math.MaxInt64 / 16 // no limit set: still no overflow of the byte count
	}
	fits := func(batch int) bool {
		for i := range shapes {
			if _, err := runtime.ElementCount(at(i, batch), limit); err != nil {
				return false
			}
		}
		return true
	}
	if !fits(1) {
		return nil, nil
	}
	build := func(batch int) *runtime.InferRequest {
		req := &runtime.InferRequest{Inputs: make([]runtime.Tensor, len(v.inputs))}
		for i, in := range v.inputs {
			shape := at(i, batch)
			n, err := runtime.ElementCount(shape, limit)
			if err != nil {
				n = 0 // not reached: callers ask fits first
			}
			req.Inputs[i] = runtime.Tensor{Name: in.Name, DataType: in.DataType, Shape: shape, Data: make([]byte, n*int64(in.DataType.Size()))}
		}
		return req
	}
	return build, fits
}

// ProfileRun is one version's profiling sweep, as Options.Profile gets it.
type ProfileRun struct {
	Key     string // "model/N"
	Device  string
	Path    string // the model file
	Config  *configs.Model
	Threads int // intra-op threads of the instances (0: ONNX Runtime's default)
	// MaxShare is the largest compute share the version can use (see
	// usefulShare); profiling shares above it measures nothing new.
	MaxShare   float64
	BatchSizes []int
	// Limiter is the kind of the limiter that enforces the measured
	// shares ("cgroup-v1", "unprivileged", ...): the same share measures
	// differently under each, so it is part of a cached profile's key.
	Limiter string
	// Elements are the row sizes of the profile shapes (profileShapeSets):
	// the elements of all inputs of a batch-1 request at each.
	Elements []int64
	// MeasureShape sets the version's compute share and returns the
	// execution time of a batch at the profile shape of index shape,
	// after one unmeasured run the first time it measures that shape and
	// batch at that share: the median of runs windows, each the mean
	// time of the runs back to back over at least profileWindow.
	MeasureShape func(ctx context.Context, shape, batch int, share float64, runs int) (time.Duration, error)
	// Measure is MeasureShape at the first shape.
	Measure func(ctx context.Context, batch int, share float64, runs int) (time.Duration, error)
	// Memory is the peak memory of one instance so far, in bytes (0
	// unknown): read after each point, it gives each batch size's
	// working set (predictor.SweepOptions.Memory).
	Memory func() int64
}

// MeasureAt measures a point at a shape: MeasureShape, or Measure when
// only that is set (one shape). It is a predictor.Measure.
func (run ProfileRun) MeasureAt(ctx context.Context, shape, batch int, share float64, runs int) (time.Duration, error) {
	if run.MeasureShape != nil {
		return run.MeasureShape(ctx, shape, batch, share, runs)
	}
	return run.Measure(ctx, batch, share, runs)
}

// profile runs Options.Profile for a fresh version, before it takes
// traffic and before its warm-up, and puts its share back afterwards: an
// instance that has run no batch yet grows its memory batch size by batch
// size through the sweep, so that the peak read after each point is that
// batch size's working set.
func (r *Registry) profile(ctx context.Context, v *version) {
	if r.opts.Profile == nil {
		return
	}
	samples, elements, sizes := profileRequests(v)
	if samples == nil {
		r.log.Info("not profiled: an input has BYTES data, or its requests would be over limits.max_tensor_elements", "model", v.model, "version", v.label)
		return
	}
	if v.lim == nil || !v.lim.Capabilities().Enforces {
		r.log.Info("not profiled: shares are not enforced on this device (limiter none)", "model", v.model, "version", v.label)
		return
	}
	v.shareMu.Lock()
	defer v.shareMu.Unlock()
	initial := v.share
	// The share last set (none yet) and the points run since: the sweep
	// asks for each point once a round, its shapes and batch sizes in
	// turn, and a point's first execution at a share is the unmeasured
	// one (its working set grows, a quota starts afresh); its later
	// rounds find it warm. A shape and batch the instance never ran is
	// warmed for a whole window and warmRuns runs at least, not one run:
	// at the first share the first window of a new point ran 17-25% over
	// the point's median for the classifier (its first runs at a size
	// grow the arena and fault its pages in; up to 3.5x at its largest),
	// 10% for the recogniser. The share is set again only
	// when it changes: under a CPU quota each write of it refills the
	// quota, which the window after it would measure as speed.
	var (
		set    bool
		setTo  float64
		warmed map[[2]int]bool
		seen   = map[[2]int]bool{}
	)
	run := ProfileRun{
		Key: v.key, Device: v.device, Path: v.path, Config: v.cfg,
		Threads: v.unitOf(v.pool.Members()[0]).threads, MaxShare: v.usefulShare(), BatchSizes: sizes,
		Memory: v.workingSetReader(), Limiter: v.lim.Kind(), Elements: elements,
		MeasureShape: func(ctx context.Context, shape, batch int, share float64, runs int) (time.Duration, error) {
			// An instance per share where the limiter cannot resize a
			// running one (MPS): each point is measured at its share.
			ctx, done := v.swapContext(ctx)
			defer done()
			// In the class the version started in: a change of
			// class is a new client on MPS, warmed at every batch
			// size, and the sweep reads each batch size's working set
			// from an instance that has run no larger batch.
			if !set || setTo != share {
				set, setTo, warmed = false, share, map[[2]int]bool{}
				if err := r.setShareLocked(ctx, v, limiter.Share{Compute: share, Memory: initial.Memory, Mode: initial.Mode}, swapRequired); err != nil {
					return 0, err
				}
				set = true
			}
			req := samples[shape](batch)
			at := [2]int{shape, batch}
			warm := warmRun
			switch {
			case !seen[at]:
				warm = warmWindow
			case warmed[at]:
				warm = warmNone
			}
			seen[at], warmed[at] = true, true
			return measurePoint(runs, warm, func() error {
				_, err := v.pool.Execute(ctx, req)
				return err
			})
		},
	}
	run.Measure = func(ctx context.Context, batch int, share float64, runs int) (time.Duration, error) {
		return run.MeasureShape(ctx, 0, batch, share, runs)
	}
	start := time.Now()
	if err := r.opts.Profile(ctx, run); err != nil {
		r.log.Warn("profiling failed; estimates come from observed executions", "model", v.model, "version", v.label, "err", err)
	} else {
		r.log.Info("profiled", "model", v.model, "version", v.label, "took", time.Since(start).Round(time.Millisecond))
	}
	if err := r.setShareLocked(context.WithoutCancel(ctx), v, initial, swapRequired); err != nil {
		r.log.Warn("restoring the share after profiling", "model", v.model, "version", v.label, "err", err)
	}
}

// profileWindow is the least time one measurement of a profile point
// runs its batch for, back to back. A batch shorter than a CPU quota's
// period (control.cfs_period, 10 ms) runs at full speed until the quota
// is spent and then waits for the next period, so one run's time is
// either; the mean over several periods is the speed the share gives.
// (The median of three single runs measured a 1.5 ms classifier batch at
// 1.7 ms or 7.7 ms at the same share, and no curve fitted both.) The mean
// is still off by what a window's first and last period hold of the
// quota, up to the throttled part of a period against the whole window,
// and the batch's phase against the periods decides which way: over 50
// ms up to 7% for a 2.3 ms batch at a quarter of a CPU
// (TestMeasurePointUnderQuotaAnyPhase), near the predictor's aim of 10%;
// over 200 ms (20 default periods) under 3%.
const profileWindow = 200 * time.Millisecond

// maxWindowRuns bounds the runs of one window.
const maxWindowRuns = 200

// How much a profile point is warmed up before it is measured.
const (
	warmNone   = iota // it ran just before
	warmRun           // one unmeasured run
	warmWindow        // the first at its size: a window of unmeasured runs, warmRuns at least
)

// warmRuns is the fewest unmeasured runs of a point never run before: the
// classifier's batch of 8 at 48x1600, 85 ms warm, took 300 ms a run in
// its first windows (one run each) after one unmeasured run.
const warmRuns = 3

// measurePoint measures one profile point: exec warmed up as warm says,
// then the median of runs windows (measureWindow).
func measurePoint(runs int, warm int, exec func() error) (time.Duration, error) {
	switch warm {
	case warmRun:
		if err := exec(); err != nil {
			return 0, err
		}
	case warmWindow:
		start := time.Now()
		for n := 0; n < maxWindowRuns && (n < warmRuns || time.Since(start) < profileWindow); n++ {
			if err := exec(); err != nil {
				return 0, err
			}
		}
	}
	took := make([]time.Duration, 0, max(runs, 1))
	for range max(runs, 1) {
		t, err := measureWindow(exec)
		if err != nil {
			return 0, err
		}
		took = append(took, t)
	}
	slices.Sort(took)
	return took[len(took)/2], nil
}

// measureWindow runs exec back to back until profileWindow has passed
// (once at least, maxWindowRuns at most) and returns the mean time of a
// run.
func measureWindow(exec func() error) (time.Duration, error) {
	start := time.Now()
	n := 0
	for n < maxWindowRuns {
		if err := exec(); err != nil {
			return 0, err
		}
		n++
		if time.Since(start) >= profileWindow {
			break
		}
	}
	return time.Since(start) / time.Duration(n), nil
}

// profileRequests returns a request builder per profile shape that can be
// profiled (profileShapeSets; a shape whose batch-1 request is over
// limits.max_tensor_elements is left out), each shape's row size (see
// qos.RowElements) and the batch sizes, profile.batch_sizes (default 1, max/2,
// max) less those over the limit at some shape; nil when no shape can be.
func profileRequests(v *version) ([]func(batch int) *runtime.InferRequest, []int64, []int) {
	sizes := slices.Clone(v.cfg.Profile.BatchSizes)
	if len(sizes) == 0 {
		sizes = []int{1}
		if v.maxBatch > 1 {
			sizes = append(sizes, max(1, v.maxBatch/2), v.maxBatch)
		}
	}
	slices.Sort(sizes)
	sizes = slices.Compact(sizes)
	var samples []func(batch int) *runtime.InferRequest
	var elements []int64
	for _, set := range profileShapeSets(v) {
		sample, fits := samplesFor(v, set)
		if sample == nil {
			continue
		}
		sizes = slices.DeleteFunc(sizes, func(b int) bool { return !fits(b) })
		samples = append(samples, sample)
		elements = append(elements, qos.RowElements(sample(1), false))
	}
	if len(samples) == 0 || len(sizes) == 0 {
		return nil, nil, nil
	}
	return samples, elements, sizes
}

// DefaultProfileDims are the values a dynamic dimension other than the
// batch takes in the profile shapes of a model whose config lists none:
// one set of shapes per value, every dynamic dimension of every input at
// that value. 64 and 256 are multiples of 32 (what image networks with
// strided convolutions, such as the OCR detector, need), far enough apart
// for the curve to learn how time grows with the input, and small enough
// to profile quickly; list profile.shapes to profile at the sizes served.
var DefaultProfileDims = []int64{64, 256}

// profileShapeSets are the sets of input shapes a version is profiled at:
// the config's profile.shapes, else, when an input has a dynamic dimension
// other than the batch, one set per DefaultProfileDims value, else one
// set of the declared shapes (nil).
func profileShapeSets(v *version) []map[string][]int64 {
	if len(v.cfg.Profile.Shapes) > 0 {
		return v.cfg.Profile.Shapes
	}
	dynamic := false
	for _, in := range v.inputs {
		for d, n := range in.Shape {
			if n < 0 && !(d == 0 && v.maxBatch > 0) {
				dynamic = true
			}
		}
	}
	if !dynamic {
		return []map[string][]int64{nil}
	}
	sets := make([]map[string][]int64, 0, len(DefaultProfileDims))
	for _, dim := range DefaultProfileDims {
		set := map[string][]int64{}
		for _, in := range v.inputs {
			shape := slices.Clone(in.Shape)
			for d, n := range shape {
				if d == 0 && v.maxBatch > 0 {
					shape[d] = 1
				} else if n < 0 {
					shape[d] = dim
				}
			}
			set[in.Name] = shape
		}
		sets = append(sets, set)
	}
	return sets
}

// sampleShape is a tensor's shape for a sample request: the config's
// profile shape when given, else the declared one; false when a dynamic
// dimension other than the batch remains.
func sampleShape(in runtime.TensorSpec, given map[string][]int64, batched bool) ([]int64, bool) {
	shape := slices.Clone(in.Shape)
	if g, ok := given[in.Name]; ok && len(g) == len(shape) {
		shape = slices.Clone(g)
	}
	for d, n := range shape {
		if n < 0 && !(d == 0 && batched) {
			return nil, false
		}
	}
	return shape, true
}
