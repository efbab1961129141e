package models

import (
	"context"
	"errors"
	"time"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// This file hands versions to their device's scheduler and takes them out,
// and seeds the scheduler's estimates with warm-up runs.

// warmUp seeds the latency estimates of a started version, when its input
// shapes are known, before it takes traffic.
func (r *Registry) warmUp(ctx context.Context, v *version) {
	if r.opts.Estimator == nil {
		return
	}
	sample, sizes := warmupRequests(v)
	if sample == nil {
		return
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	// Warm-up runs go straight to the instances: they are not clients'
	// executions, so the statistics do not count them.
	if err := qos.Warmup(wctx, v.key, v.pool, r.opts.Estimator, sizes, 3, sample); err != nil {
		r.log.Warn("warm-up failed; latency estimates start empty", "model", v.model, "version", v.label, "err", err)
	}
}

// The scheduler executes on a version's pool directly.
var _ qos.Executor = (*runtime.Pool)(nil)

// schedule hands a started version to its device's QoS scheduler, or, when
// the same version is already scheduled (a reload), gives the scheduler the
// new instances: queued requests stay and run on them.
func (r *Registry) schedule(ctx context.Context, v *version) error {
	sched, err := r.opts.Scheduler(v.device)
	if err != nil {
		return err
	}
	spec := qos.ModelSpec{
		Name:                v.key,
		Class:               qos.Class(v.cfg.SLO.Class),
		Priority:            v.cfg.SLO.Priority,
		SLO:                 v.cfg.LatencyTarget(),
		MaxBatchSize:        v.cfg.MaxBatchSize,
		MaxQueueDelay:       v.cfg.DynamicBatching.MaxQueueDelay,
		PreferredBatchSizes: v.cfg.DynamicBatching.PreferredBatchSizes,
		QueueCapacity:       v.cfg.MaxQueueSize,
		Slots:               v.pool.Slots(),
		Executor:            v.pool,
		MinShare:            min(v.cfg.Resources.MinComputeShare, v.usefulShare()),
		MaxShare:            v.usefulShare(),
		Memory:              int64(v.cfg.Resources.MemoryLimit),
	}
	if c := v.cfg.Resources.ComputeShare; c > 0 {
		spec.Pin = &limiter.Share{Compute: c, Memory: spec.Memory}
	}
	if sched.HasModel(v.key) {
		err = sched.UpdateModel(spec)
	} else {
		err = sched.AddModel(spec)
	}
	if err != nil {
		return err
	}
	v.sched = sched
	return nil
}

// unschedule removes a version from its scheduler once no request can reach
// it, unless a version in next (a reload of the same version) took over its
// place there.
func (r *Registry) unschedule(ctx context.Context, v *version, next map[int64]*version) {
	if v.sched == nil {
		return
	}
	if n, ok := next[v.number]; ok && n.sched == v.sched {
		return
	}
	if err := v.sched.RemoveModel(ctx, v.key); err != nil && !errors.Is(err, qos.ErrUnknownModel) {
		r.log.Warn("removing from the scheduler", "model", v.model, "version", v.label, "err", err)
	}
}
