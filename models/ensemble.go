package models

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/runtime"
)

// This file serves Triton ensembles (configs.Ensemble): a model with no
// file of its own whose inference runs other models' as steps. A step is
// an ordinary request to its model through Registry.Infer, so the step
// model's own admission, queue, batching, SLO class and counts apply to
// it; the ensemble only moves tensors between steps (by reference: a
// step's output is the next step's input, not a copy) and gives every
// step the request's deadline, which so covers the whole chain. The
// ensemble lives in the registry beside the versions it runs, rather than
// in a package of its own, because it is resolved, made ready and listed
// as a model is; the request path stays models -> qos -> runtime.
//
// An ensemble's steps may not be ensembles themselves; an ensemble is
// ready while every step's model version is.

// ensemble is a loaded ensemble: its one serving version.
type ensemble struct {
	name    string
	number  int64
	label   string
	cfg     *configs.Model
	inputs  []runtime.TensorSpec // as the config declares them
	outputs []runtime.TensorSpec

	checkMu  sync.Mutex // guards checked and mismatch
	checked  []*version // the step versions the steps were last checked against
	mismatch error      // what that check found

	mu    sync.Mutex // guards the counts below
	last  time.Time
	count uint64 // inferences, counting each batch element
	ok    Duration
	fail  Duration
}

// count records one finished ensemble request of batch rows.
func (e *ensemble) record(start time.Time, rows int, err error) {
	now := time.Now()
	e.mu.Lock()
	defer e.mu.Unlock()
	d := &e.ok
	if err != nil {
		d = &e.fail
	} else {
		e.count += uint64(max(rows, 1))
		e.last = now
	}
	d.Count++
	d.Total += now.Sub(start)
}

func (e *ensemble) statistics() Statistics {
	e.mu.Lock()
	defer e.mu.Unlock()
	return Statistics{Name: e.name, Version: e.label, LastInference: e.last, InferenceCount: e.count, Success: e.ok, Fail: e.fail}
}

// ensembleLocked tells whether the model name is a loaded ensemble and, if
// so, returns it for version ver ("" = its version) or why it cannot serve
// that version. ok is false for a model that is not a loaded ensemble, and
// then the caller goes on as for any model. The caller holds r.mu.
func (r *Registry) ensembleLocked(name, ver string) (e *ensemble, ok bool, err error) {
	m, err := r.modelLocked(name)
	if err != nil || m.ens == nil {
		return nil, false, nil
	}
	if m.removed {
		return nil, true, modelNotFound(name, "removed from the repository")
	}
	if ver != "" && ver != m.ens.label {
		return nil, true, versionNotFound(name, ver)
	}
	return m.ens, true, nil
}

// ensemble is ensembleLocked under the registry's lock.
func (r *Registry) ensemble(name, ver string) (*ensemble, bool, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.ensembleLocked(name, ver)
}

// stepsReadyLocked reports whether every step model version of e can
// serve, and when not, why. The caller holds r.mu.
func (r *Registry) stepsReadyLocked(e *ensemble) (bool, string) {
	for i, s := range e.cfg.Ensemble.Steps {
		_, v, err := r.findLocked(s.Model, s.Version)
		if err == nil && !v.ready() {
			err = fmt.Errorf("%w: %q has no instance that can serve", ErrNotReady, s.Model)
		}
		if err != nil {
			return false, fmt.Sprintf("step %d (model %s): %v", i, s.Model, err)
		}
	}
	if err := r.stepsMatchLocked(e); err != nil {
		return false, err.Error()
	}
	return true, ""
}

// stepsMatchLocked checks e's steps again when a step model serves
// another version than the one they were last checked against (a step
// model reloaded, maybe with other tensors), and returns what the last
// check found: nil when the steps fit. A step without a serving version
// is left to its own error. The caller holds r.mu, read or write.
func (r *Registry) stepsMatchLocked(e *ensemble) error {
	current, ok := r.stepVersionsLocked(e)
	if !ok {
		return nil
	}
	e.checkMu.Lock()
	defer e.checkMu.Unlock()
	if slices.Equal(current, e.checked) {
		return e.mismatch
	}
	e.checked, e.mismatch = current, nil
	if err := r.checkStepsLocked(e); err != nil {
		e.mismatch = fmt.Errorf("a step model changed and no longer fits the ensemble: %w", err)
		r.log.Warn("ensemble out of service", "model", e.name, "error", e.mismatch)
	}
	return e.mismatch
}

// stepVersionsLocked returns the versions e's steps are served by now;
// false when a step has none. The caller holds r.mu.
func (r *Registry) stepVersionsLocked(e *ensemble) ([]*version, bool) {
	steps := e.cfg.Ensemble.Steps
	current := make([]*version, len(steps))
	for i, s := range steps {
		_, v, err := r.findLocked(s.Model, s.Version)
		if err != nil {
			return nil, false
		}
		current[i] = v
	}
	return current, true
}

// loadEnsemble loads an ensemble whose config has been read: it checks
// the steps against the models they name, which must be loaded, and
// serves the ensemble's version; versions of a model this folder held
// before are drained and stopped. The caller holds m.op.
func (r *Registry) loadEnsemble(ctx context.Context, m *model, cfg *configs.Model, override []byte, fp string) error {
	available, err := configs.EnsembleVersions(m.dir)
	if err != nil {
		err = fmt.Errorf("%w: %w", ErrBadConfig, err)
		r.setEnsembleFailed(m, nil, err, fp)
		return err
	}
	selected := cfg.SelectVersions(available)
	if len(selected) == 0 {
		err := fmt.Errorf("%w: %s: no version folder matches the version policy (found %v)", ErrBadConfig, m.dir, available)
		r.setEnsembleFailed(m, nil, err, fp)
		return err
	}
	n := slices.Max(selected) // one version: an ensemble's versions are one config
	e := &ensemble{name: m.name, number: n, label: strconv.FormatInt(n, 10), cfg: cfg,
		inputs: toSpecs(cfg.Inputs), outputs: toSpecs(cfg.Outputs)}
	r.mu.RLock()
	err = r.checkStepsLocked(e)
	e.checked, _ = r.stepVersionsLocked(e) // what was checked, not checked again
	r.mu.RUnlock()
	if err != nil {
		err = fmt.Errorf("%w: %s: %w", ErrBadConfig, cfg.File, err)
		r.setEnsembleFailed(m, []int64{n}, err, fp)
		return err
	}

	r.mu.Lock()
	old := m.serveLocked(map[int64]*version{}, e, cfg, override, fp)
	m.states[n] = IndexEntry{Name: m.name, Version: e.label, State: StateReady}
	r.mu.Unlock()
	r.metrics.loads.WithLabelValues(m.name).Inc()
	r.metrics.loadFailures.WithLabelValues(m.name)
	r.log.Info("ensemble ready", "model", m.name, "version", e.label, "steps", len(cfg.Ensemble.Steps))
	for _, v := range old {
		r.drainAndStop(ctx, v, nil)
		r.forget(v)
	}
	return nil
}

// setEnsembleFailed is setFailed for an ensemble: a loaded ensemble keeps
// serving, as versions do.
func (r *Registry) setEnsembleFailed(m *model, versions []int64, err error, fp string) {
	r.mu.RLock()
	prev := m.ens
	r.mu.RUnlock()
	if prev != nil {
		versions = slices.DeleteFunc(versions, func(n int64) bool { return n == prev.number })
	}
	r.setFailed(m, versions, err, fp)
	if prev == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	m.reason = "reload failed, previous version serving: " + err.Error()
	m.states[prev.number] = IndexEntry{Name: m.name, Version: prev.label, State: StateReady, Reason: m.reason}
}

// checkStepsLocked checks an ensemble's steps against the step models'
// serving versions: each is loaded and not an ensemble, every input of it
// takes an ensemble tensor, the maps name its real inputs and outputs,
// and the tensors passed agree in datatype and shape with what the
// models take and the ensemble declares. The caller holds r.mu.
func (r *Registry) checkStepsLocked(e *ensemble) error {
	ens := e.cfg.Ensemble
	tensors := map[string]runtime.TensorSpec{} // the ensemble tensors so far
	for _, in := range e.inputs {
		tensors[in.Name] = in
	}
	producer := ens.Producers()
	var errs []error
	for _, i := range ens.Order {
		s := ens.Steps[i]
		fail := func(format string, args ...any) {
			errs = append(errs, fmt.Errorf("ensemble_scheduling.step[%d] (model %s): %s", i, s.Model, fmt.Sprintf(format, args...)))
		}
		if sm, err := r.modelLocked(s.Model); err == nil && sm.ens != nil || err == nil && sm.cfg != nil && sm.cfg.Ensemble != nil {
			fail("is an ensemble; an ensemble's steps must be models of their own")
			continue
		}
		_, v, err := r.findLocked(s.Model, s.Version)
		if err != nil {
			fail("the step model must be loaded first: %v", err)
			continue
		}
		ins, outs := v.wire()
		if e.cfg.MaxBatchSize > 0 && v.maxBatch > 0 && e.cfg.MaxBatchSize > v.maxBatch {
			fail("the ensemble's max_batch_size %d is larger than the model's %d", e.cfg.MaxBatchSize, v.maxBatch)
		}
		for _, in := range ins {
			if _, ok := s.Inputs[in.Name]; !ok {
				fail("input %q of the model takes no ensemble tensor (input_map)", in.Name)
			}
		}
		for _, name := range slices.Sorted(maps.Keys(s.Inputs)) {
			j := slices.IndexFunc(ins, func(t runtime.TensorSpec) bool { return t.Name == name })
			if j < 0 {
				fail("input_map names input %q, which the model does not have (it has %s)", name, specNames(ins))
				continue
			}
			if t, ok := tensors[s.Inputs[name]]; ok && !compatible(t, ins[j]) {
				fail("input %q takes ensemble tensor %q, which is %s %v; the model expects %s %v", name, s.Inputs[name], t.DataType, t.Shape, ins[j].DataType, ins[j].Shape)
			}
		}
		for _, name := range slices.Sorted(maps.Keys(s.Outputs)) {
			j := slices.IndexFunc(outs, func(t runtime.TensorSpec) bool { return t.Name == name })
			if j < 0 {
				fail("output_map names output %q, which the model does not have (it has %s)", name, specNames(outs))
				continue
			}
			t := outs[j]
			t.Name = s.Outputs[name]
			tensors[t.Name] = t
		}
	}
	for _, out := range e.outputs {
		t, ok := tensors[out.Name]
		if ok && !compatible(t, out) {
			i := producer[out.Name]
			errs = append(errs, fmt.Errorf("output %q: the ensemble declares %s %v, step[%d] (model %s) produces %s %v", out.Name, out.DataType, out.Shape, i, ens.Steps[i].Model, t.DataType, t.Shape))
		}
	}
	return errors.Join(errs...)
}

// compatible reports whether tensors of spec a can be given where spec b
// is expected: the same datatype and rank, and each dimension equal where
// both fix it.
func compatible(a, b runtime.TensorSpec) bool {
	if a.DataType != b.DataType || len(a.Shape) != len(b.Shape) {
		return false
	}
	for i := range a.Shape {
		if a.Shape[i] >= 0 && b.Shape[i] >= 0 && a.Shape[i] != b.Shape[i] {
			return false
		}
	}
	return true
}

func specNames(specs []runtime.TensorSpec) string {
	names := make([]string, len(specs))
	for i, s := range specs {
		names[i] = strconv.Quote(s.Name)
	}
	return strings.Join(names, ", ")
}

// stepDone is a step's answer.
type stepDone struct {
	step int
	resp *runtime.InferResponse
	err  error
}

// inferEnsemble runs one request on an ensemble: each step as soon as
// every tensor it takes exists, independent steps at the same time, each
// through its model's scheduler. The first step to fail ends the request
// (the steps under way are cancelled) with an error that names the step
// and wraps the step's, so that the client gets the step's status.
func (r *Registry) inferEnsemble(ctx context.Context, e *ensemble, req *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	start := cmp.Or(req.Arrival, time.Now())
	check := &version{model: e.name, inputs: e.inputs, outputs: e.outputs, maxBatch: e.cfg.MaxBatchSize}
	rows, err := check.validate(req, r.opts.MaxTensorElements)
	if err != nil {
		e.record(start, 0, err)
		return nil, e.label, err
	}
	ens := e.cfg.Ensemble
	tensors := make(map[string]runtime.Tensor, len(req.Inputs)+len(ens.Steps))
	for _, t := range req.Inputs {
		tensors[t.Name] = t
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan stepDone, len(ens.Steps))
	started := make([]bool, len(ens.Steps))
	running, finished := 0, 0
	var failed error
	for finished < len(ens.Steps) && failed == nil {
		for _, i := range ens.Order {
			s := ens.Steps[i]
			if started[i] || !hasAll(tensors, s.Inputs) {
				continue
			}
			started[i] = true
			sreq := &runtime.InferRequest{
				Inputs:   make([]runtime.Tensor, 0, len(s.Inputs)),
				Outputs:  slices.Sorted(maps.Keys(s.Outputs)),
				Deadline: req.Deadline,
				Priority: req.Priority,
			}
			for _, in := range slices.Sorted(maps.Keys(s.Inputs)) {
				t := tensors[s.Inputs[in]] // the same bytes, under the step's name
				t.Name = in
				sreq.Inputs = append(sreq.Inputs, t)
			}
			running++
			go func() {
				resp, _, err := r.Infer(ctx, s.Model, s.Version, sreq)
				done <- stepDone{i, resp, err}
			}()
		}
		if running == 0 {
			// Validation at load rules this out; a guard, not a path.
			failed = fmt.Errorf("ensemble %s: no step can run: the steps' inputs are never produced", e.name)
			break
		}
		d := <-done
		running--
		finished++
		s := ens.Steps[d.step]
		if d.err != nil {
			failed = fmt.Errorf("ensemble %s step %d (model %s): %w", e.name, d.step, s.Model, d.err)
			break
		}
		for _, out := range d.resp.Outputs {
			name, ok := s.Outputs[out.Name]
			if !ok {
				continue
			}
			out.Name = name
			tensors[name] = out
		}
		for out, name := range s.Outputs {
			if _, ok := tensors[name]; !ok {
				failed = fmt.Errorf("ensemble %s step %d (model %s): %w: the model returned no output %q", e.name, d.step, s.Model, runtime.ErrInference, out)
				break
			}
		}
	}
	if failed != nil {
		cancel()
		for ; running > 0; running-- {
			<-done
		}
		e.record(start, 0, failed)
		return nil, e.label, failed
	}
	names := req.Outputs
	if len(names) == 0 {
		for _, o := range e.outputs {
			names = append(names, o.Name)
		}
	}
	resp := &runtime.InferResponse{Outputs: make([]runtime.Tensor, 0, len(names))}
	for _, name := range names {
		resp.Outputs = append(resp.Outputs, tensors[name])
	}
	e.record(start, rows, nil)
	return resp, e.label, nil
}

// hasAll reports whether every tensor a step's input map names exists.
func hasAll(tensors map[string]runtime.Tensor, inputs map[string]string) bool {
	for _, t := range inputs {
		if _, ok := tensors[t]; !ok {
			return false
		}
	}
	return true
}

// isEnsemble tells whether the folder of the model name holds an
// ensemble (configs.IsEnsembleFolder).
func (r *Registry) isEnsemble(name string) bool {
	r.mu.RLock()
	m, ok := r.models[name]
	r.mu.RUnlock()
	return ok && configs.IsEnsembleFolder(m.dir)
}

// ensemblesLast splits names into the models of their own, then the
// ensembles, which are loaded after the models they run.
func (r *Registry) ensemblesLast(names []string) [2][]string {
	var waves [2][]string
	for _, n := range names {
		if r.isEnsemble(n) {
			waves[1] = append(waves[1], n)
		} else {
			waves[0] = append(waves[0], n)
		}
	}
	return waves
}

// compareBool orders false before true.
func compareBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

// retryEnsembles loads again, after a poll pass loaded models, the
// ensembles whose last load failed and that the pass did not load
// (tried): a step model they missed may be there now.
func (r *Registry) retryEnsembles(ctx context.Context, tried map[string]bool) {
	var retry []string
	r.mu.RLock()
	for name, m := range r.models {
		if _, done := tried[name]; !done && m.loadFailed && !m.removed && len(m.serving) == 0 && m.ens == nil {
			retry = append(retry, name)
		}
	}
	r.mu.RUnlock()
	slices.Sort(retry)
	for _, name := range retry {
		if r.isEnsemble(name) {
			r.log.Info("models loaded; loading an ensemble that failed before again", "model", name)
			_ = r.load(ctx, name)
		}
	}
}
