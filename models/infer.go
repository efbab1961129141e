package models

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// This file is the registry's part of the request path: it resolves the
// version a request names, validates the request and hands it to the
// version's scheduler.

// evictedError is the not-ready error of a model that was evicted and not
// loaded since, or that a request is loading on demand: a request that
// gets it loads the model itself, or waits for the load under way. It is
// decided under the same lock as the version lookup, so a load finishing
// in between cannot make a request fail.
type evictedError struct{ error }

func (e evictedError) Unwrap() error { return e.error }

// resolve finds the serving version a request names ("" = the highest).
// The caller holds r.mu.
func (m *model) resolve(ver string) (*version, error) {
	if m.removed {
		return nil, fmt.Errorf("%w: %q (removed from the repository)", ErrModelNotFound, m.name)
	}
	if ver == "" {
		var best *version
		for _, v := range m.serving {
			if best == nil || v.number > best.number {
				best = v
			}
		}
		if best == nil {
			return nil, m.notReady()
		}
		return best, nil
	}
	// Versions are written as their folders are: "01" and "+1" name no
	// version.
	n, err := strconv.ParseInt(ver, 10, 64)
	if err != nil || n < 1 || strconv.FormatInt(n, 10) != ver {
		return nil, fmt.Errorf("%w: %q version %q", ErrVersionNotFound, m.name, ver)
	}
	if v, ok := m.serving[n]; ok {
		return v, nil
	}
	if _, ok := m.states[n]; ok {
		return nil, m.notReady()
	}
	return nil, fmt.Errorf("%w: %q version %q", ErrVersionNotFound, m.name, ver)
}

func (m *model) notReady() error {
	err := fmt.Errorf("%w: %q is not loaded", ErrNotReady, m.name)
	if m.reason != "" {
		err = fmt.Errorf("%w: %q: %s", ErrNotReady, m.name, m.reason)
	}
	if m.evicted || m.reviving.Load() > 0 {
		return evictedError{err}
	}
	return err
}

// acquire finds a serving version and counts a request in flight on it, so
// that an unload waits for the request.
func (r *Registry) acquire(name, ver string) (*version, error) {
	if err := validName(name); err != nil {
		return nil, fmt.Errorf("%w: %q", ErrModelNotFound, name)
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	m, ok := r.models[name]
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrModelNotFound, name)
	}
	v, err := m.resolve(ver)
	if err != nil {
		return nil, err
	}
	v.inflight.Add(1)
	return v, nil
}

// Preadmit tells, before a request's body is read, whether a request for
// the model version would be refused now: the server has as many requests
// in flight as allowed (ErrOverloaded), or the model's scheduler would
// refuse even one row (qos.ErrQueueFull, qos.ErrRejected; counted as the
// request's outcome, as Infer counts it). nil promises nothing: Infer
// decides on the request itself, and reports unknown models and the like.
func (r *Registry) Preadmit(ctx context.Context, name, ver string, deadline time.Time) error {
	start := time.Now()
	if limit := r.maxInflight.Load(); limit > 0 && r.inflight.Load() >= limit {
		return fmt.Errorf("%w: limit %d", ErrOverloaded, limit)
	}
	v, err := r.acquire(name, ver)
	if err != nil {
		return nil
	}
	defer v.inflight.Done()
	if v.sched == nil {
		return nil
	}
	err = v.sched.Preadmit(ctx, v.key, qos.RequestOptions{Deadline: deadline})
	if errors.Is(err, qos.ErrRejected) || errors.Is(err, qos.ErrQueueFull) {
		v.finish(outcomeRejected, 1, start, 0, nil)
		return err
	}
	return nil
}

// Infer runs one request on a version of a model ("" = the highest ready
// version) and returns the version that served it.
func (r *Registry) Infer(ctx context.Context, name, ver string, req *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	start := time.Now()
	if limit := r.maxInflight.Load(); limit > 0 {
		if n := r.inflight.Add(1); n > limit {
			r.inflight.Add(-1)
			return nil, "", fmt.Errorf("%w: limit %d", ErrOverloaded, limit)
		}
		defer r.inflight.Add(-1)
	}
	if limit := r.maxInflightBytes.Load(); limit > 0 {
		var size int64
		for _, t := range req.Inputs {
			size += int64(len(t.Data))
		}
		if n := r.inflightBytes.Add(size); n > limit && n != size {
			r.inflightBytes.Add(-size)
			return nil, "", fmt.Errorf("%w: the requests in flight hold %s of inputs, over limits.max_inflight_bytes (%s)",
				ErrOverloaded, configs.ByteSize(n-size), configs.ByteSize(limit))
		}
		defer r.inflightBytes.Add(-size)
	}
	v, err := r.acquire(name, ver)
	if errors.As(err, new(evictedError)) {
		if err := r.revive(ctx, name); err != nil {
			return nil, "", fmt.Errorf("%w: %q: loading the evicted model on demand: %w", ErrNotReady, name, err)
		}
		v, err = r.acquire(name, ver)
	}
	if err != nil {
		return nil, "", err
	}
	defer v.inflight.Done()
	v.obs.inflight.Inc()
	defer v.obs.inflight.Dec()

	batch, err := v.validate(req, r.opts.MaxTensorElements)
	if err != nil {
		v.finish(outcomeInvalid, 1, start, 0, nil)
		return nil, v.label, err
	}
	if lv := v.cfg.DynamicBatching.PriorityLevels; lv > 0 && req.Priority > lv {
		req.Priority = 0 // beyond the model's levels: its default, as Triton does
	}
	if d := v.cfg.DynamicBatching.DefaultTimeout; d > 0 {
		if dl := start.Add(d); req.Deadline.IsZero() || dl.Before(req.Deadline) {
			req.Deadline = dl
		}
	}
	var (
		resp  *runtime.InferResponse
		queue time.Duration
	)
	if v.sched != nil {
		resp, err = v.sched.Submit(ctx, v.key, req, qos.RequestOptions{Deadline: req.Deadline, Priority: req.Priority})
		if err == nil {
			// The scheduler's queue plus the transport to the runner.
			queue = max(0, time.Since(start)-resp.Timing.Input-resp.Timing.Infer-resp.Timing.Output)
		}
	} else {
		resp, err = v.pool.Execute(ctx, req)
		if err == nil {
			queue = max(0, time.Since(start)-resp.Timing.Input-resp.Timing.Infer-resp.Timing.Output)
			v.stats.recordExecution(batch, resp.Timing)
		}
	}
	if err != nil {
		o := outcomeFailed
		switch {
		case errors.Is(err, qos.ErrRejected), errors.Is(err, qos.ErrQueueFull):
			o = outcomeRejected
		case errors.Is(err, qos.ErrDropped):
			o = outcomeDropped
		case errors.Is(err, runtime.ErrUnavailable):
			o = outcomeUnavailable
		case ctx.Err() != nil:
			o = outcomeCanceled
		case errors.Is(err, runtime.ErrInvalidTensor), errors.Is(err, qos.ErrInvalidRequest):
			o = outcomeInvalid
		}
		v.finish(o, batch, start, queue, nil)
		return nil, v.label, fmt.Errorf("model %s version %s: %w", v.model, v.label, err)
	}
	v.finish(outcomeSuccess, batch, start, queue, &resp.Timing)
	return resp, v.label, nil
}

func (v *version) finish(o outcome, batch int, start time.Time, queue time.Duration, t *runtime.Timing) {
	total := time.Since(start)
	v.stats.record(o, batch, total, queue, t)
	v.obs.observe(o, total, queue, t)
}
