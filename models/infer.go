package models

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

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
		return nil, modelNotFound(m.name, "removed from the repository")
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
		return nil, versionNotFound(m.name, ver)
	}
	if v, ok := m.serving[n]; ok {
		return v, nil
	}
	if _, ok := m.states[n]; ok {
		return nil, m.notReady()
	}
	return nil, versionNotFound(m.name, ver)
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
// that an unload waits for the request; request says it is an inference
// (counted in v.requests too), not a Preadmit. Under the lock that marks a
// model removed: the drain's count holds every request that found it.
func (r *Registry) acquire(name, ver string, request bool) (*version, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	_, v, err := r.findLocked(name, ver)
	if err != nil {
		return nil, err
	}
	v.inflight.Add(1)
	if request {
		v.requests.Add(1)
	}
	return v, nil
}

// Preadmit tells, before a request's body is read, whether a request for
// the model version would be refused now: the version's scheduler would
// refuse even one row (qos.ErrOverloaded, qos.ErrQueueFull,
// qos.ErrRejected; it counts the refusal as the request's outcome). nil
// promises nothing: Infer decides on the request itself, and reports
// unknown models and the like.
func (r *Registry) Preadmit(ctx context.Context, name, ver string, deadline time.Time) error {
	v, err := r.acquire(name, ver, false)
	if err != nil {
		return nil
	}
	defer v.inflight.Done()
	err = v.sched.Preadmit(ctx, v.key, qos.RequestOptions{Deadline: deadline})
	if errors.Is(err, qos.ErrRejected) || errors.Is(err, qos.ErrQueueFull) || errors.Is(err, qos.ErrOverloaded) {
		// Named as Infer names its refusals: the client cannot tell
		// which of the two refused it.
		return fmt.Errorf("model %s version %s: %w", v.model, v.label, err)
	}
	return nil
}

// Infer runs one request on a version of a model ("" = the highest ready
// version) and returns the version that served it. The version's scheduler
// admits, runs and counts it; a request that does not match the model's
// metadata is counted there as invalid.
func (r *Registry) Infer(ctx context.Context, name, ver string, req *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	if e, ok, err := r.ensemble(name, ver); ok {
		if err != nil {
			return nil, "", err
		}
		r.mu.RLock()
		err = r.stepsMatchLocked(e)
		r.mu.RUnlock()
		if err != nil {
			err = fmt.Errorf("%w: ensemble %s: %w", ErrNotReady, name, err)
			e.record(cmp.Or(req.Arrival, time.Now()), 0, err)
			return nil, e.label, err
		}
		return r.inferEnsemble(ctx, e, req)
	}
	start := time.Now()
	v, err := r.acquire(name, ver, true)
	if err != nil && errors.As(err, new(evictedError)) { // not asked on success: new() escapes, an allocation a call
		if err := r.revive(ctx, name); err != nil {
			return nil, "", fmt.Errorf("%w: %q: loading the evicted model on demand: %w", ErrNotReady, name, err)
		}
		v, err = r.acquire(name, ver, true)
	}
	if err != nil {
		return nil, "", err
	}
	defer v.inflight.Done()
	defer v.requests.Add(-1)

	if _, err := v.validate(req, r.opts.MaxTensorElements); err != nil {
		v.sched.CountInvalid(v.key, cmp.Or(req.Arrival, start))
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
	v.toModelShapes(req)
	resp, err := v.sched.Submit(ctx, v.key, req, qos.RequestOptions{Deadline: req.Deadline, Priority: req.Priority})
	if err != nil {
		return nil, v.label, fmt.Errorf("model %s version %s: %w", v.model, v.label, err)
	}
	v.toWireShapes(resp)
	return resp, v.label, nil
}
