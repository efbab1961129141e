package models

import (
	"context"
	"math"
	"slices"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/runtime"
)

// This file runs the profiling sweep of a fresh version and builds the
// sample requests that profiling, warm-ups and swaps run.

// warmupRequests returns requests of zeros for the warm-up at batch sizes 1
// and the maximum, or nil when an input has BYTES data or a dynamic
// dimension other than the batch that profile.shapes does not fill, or
// when even batch 1 is over limits.max_tensor_elements. A batch size
// whose request would be over the limit is left out: a client could not
// send it either.
func warmupRequests(v *version) (func(batch int) *runtime.InferRequest, []int) {
	sample, fits := samplesFor(v, v.cfg.Profile.Shapes)
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
	// Measure sets the version's compute share and returns the median
	// execution time of runs executions of a batch, after one unmeasured
	// run.
	Measure func(ctx context.Context, batch int, share float64, runs int) (time.Duration, error)
	// Memory is the peak memory of one instance so far, in bytes (0
	// unknown): read after each point, it gives each batch size's
	// working set (predictor.SweepOptions.Memory).
	Memory func() int64
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
	sample, sizes := profileRequests(v)
	if sample == nil {
		r.log.Info("not profiled: an input has dynamic dimensions and no profile.shapes entry, or its requests would be over limits.max_tensor_elements", "model", v.model, "version", v.label)
		return
	}
	if v.lim == nil || !v.lim.Capabilities().Enforces {
		r.log.Info("not profiled: shares are not enforced on this device (limiter none)", "model", v.model, "version", v.label)
		return
	}
	v.shareMu.Lock()
	defer v.shareMu.Unlock()
	initial := v.share
	run := ProfileRun{
		Key: v.key, Device: v.device, Path: v.path, Config: v.cfg,
		Threads: v.unitOf(v.pool.Members()[0]).threads, MaxShare: v.usefulShare(), BatchSizes: sizes,
		Memory: v.workingSetReader(), Limiter: v.lim.Kind(),
		Measure: func(ctx context.Context, batch int, share float64, runs int) (time.Duration, error) {
			// An instance per share where the limiter cannot resize a
			// running one (MPS): each point is measured at its share.
			ctx, done := v.swapContext(ctx)
			defer done()
			if err := r.setShareLocked(ctx, v, limiter.Share{Compute: share, Memory: initial.Memory}, swapRequired); err != nil {
				return 0, err
			}
			req := sample(batch)
			took := make([]time.Duration, 0, runs)
			for i := range runs + 1 {
				start := time.Now()
				if _, err := v.pool.Execute(ctx, req); err != nil {
					return 0, err
				}
				if i > 0 {
					took = append(took, time.Since(start))
				}
			}
			slices.Sort(took)
			return took[len(took)/2], nil
		},
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

// profileRequests is warmupRequests with the model's profile.shapes filled
// in for dynamic dimensions and its profile.batch_sizes (default 1,
// max/2, max).
func profileRequests(v *version) (func(batch int) *runtime.InferRequest, []int) {
	sample, fits := samplesFor(v, v.cfg.Profile.Shapes)
	if sample == nil {
		return nil, nil
	}
	sizes := slices.Clone(v.cfg.Profile.BatchSizes)
	if len(sizes) == 0 {
		sizes = []int{1}
		if v.maxBatch > 1 {
			sizes = append(sizes, max(1, v.maxBatch/2), v.maxBatch)
		}
	}
	slices.Sort(sizes)
	if sizes = slices.DeleteFunc(slices.Compact(sizes), func(b int) bool { return !fits(b) }); len(sizes) == 0 {
		return nil, nil
	}
	return sample, sizes
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
