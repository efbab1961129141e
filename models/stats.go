package models

import (
	"cmp"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

// versionStats accumulates one version's statistics since it was loaded:
// per request (record) and per execution of a batch on an instance
// (recordExecution), the one place both are counted.
type versionStats struct {
	mu      sync.Mutex
	s       Statistics
	batches map[int]*BatchStatistics // by batch size
}

// outcome of one request, as counted in statistics and metrics.
type outcome string

const (
	outcomeSuccess     outcome = "success"
	outcomeInvalid     outcome = "invalid"
	outcomeUnavailable outcome = "unavailable"
	outcomeCanceled    outcome = "canceled"
	outcomeFailed      outcome = "failed"
	outcomeRejected    outcome = "rejected" // refused by admission or a full queue
	outcomeDropped     outcome = "dropped"  // deadline passed while queued
)

func (vs *versionStats) record(o outcome, batch int, total, queue time.Duration, t *runtime.Timing) {
	vs.mu.Lock()
	defer vs.mu.Unlock()
	if o != outcomeSuccess {
		vs.s.Fail.Count++
		vs.s.Fail.Total += total
		return
	}
	vs.s.LastInference = time.Now()
	vs.s.InferenceCount += uint64(batch)
	vs.s.Success.Count++
	vs.s.Success.Total += total
	vs.s.Queue.Count++
	vs.s.Queue.Total += queue
	if t != nil {
		vs.s.ComputeInput.Count++
		vs.s.ComputeInput.Total += t.Input
		vs.s.ComputeInfer.Count++
		vs.s.ComputeInfer.Total += t.Infer
		vs.s.ComputeOutput.Count++
		vs.s.ComputeOutput.Total += t.Output
	}
}

// recordExecution counts one execution of a batch of size batch (the
// merged requests' batch elements) and its times in the runner. Warm-up
// runs are not counted: only executions of clients' requests.
func (vs *versionStats) recordExecution(batch int, t runtime.Timing) {
	vs.mu.Lock()
	defer vs.mu.Unlock()
	vs.s.ExecutionCount++
	if vs.batches == nil {
		vs.batches = map[int]*BatchStatistics{}
	}
	b, ok := vs.batches[batch]
	if !ok {
		b = &BatchStatistics{BatchSize: batch}
		vs.batches[batch] = b
	}
	b.ComputeInput.add(t.Input)
	b.ComputeInfer.add(t.Infer)
	b.ComputeOutput.add(t.Output)
}

func (d *Duration) add(t time.Duration) {
	d.Count++
	d.Total += t
}

func (vs *versionStats) snapshot() Statistics {
	vs.mu.Lock()
	defer vs.mu.Unlock()
	s := vs.s
	s.Batches = make([]BatchStatistics, 0, len(vs.batches))
	for _, b := range vs.batches {
		s.Batches = append(s.Batches, *b)
	}
	slices.SortFunc(s.Batches, func(a, b BatchStatistics) int { return cmp.Compare(a.BatchSize, b.BatchSize) })
	return s
}

// Statistics returns per-version statistics of loaded versions: all models
// when name is "", all versions of the model when ver is "".
func (r *Registry) Statistics(name, ver string) ([]Statistics, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	var ms []*model
	if name == "" {
		for _, m := range r.models {
			ms = append(ms, m)
		}
	} else {
		m, ok := r.models[name]
		if !ok {
			return nil, fmt.Errorf("%w: %q", ErrModelNotFound, name)
		}
		ms = []*model{m}
		if ver != "" {
			v, err := m.resolve(ver)
			if err != nil {
				return nil, err
			}
			return []Statistics{v.statistics()}, nil
		}
	}
	var out []Statistics
	for _, m := range ms {
		for _, v := range m.serving {
			out = append(out, v.statistics())
		}
	}
	slices.SortFunc(out, func(a, b Statistics) int {
		return cmp.Or(cmp.Compare(a.Name, b.Name), cmp.Compare(len(a.Version), len(b.Version)), cmp.Compare(a.Version, b.Version))
	})
	return out, nil
}

// statistics is the version's statistics, with its scheduler's SLO
// accounting when it has one.
func (v *version) statistics() Statistics {
	s := v.stats.snapshot()
	s.Name, s.Version = v.model, v.label
	if v.sched == nil {
		return s
	}
	if q, ok := v.sched.Stats(v.key); ok {
		s.ExecutionCount = q.Executions
		s.Batches = make([]BatchStatistics, len(q.Batches))
		for i, b := range q.Batches {
			s.Batches[i] = BatchStatistics{
				BatchSize:     b.Size,
				ComputeInput:  Duration{Count: b.Count, Total: b.Input},
				ComputeInfer:  Duration{Count: b.Count, Total: b.Infer},
				ComputeOutput: Duration{Count: b.Count, Total: b.Output},
			}
		}
		s.SLO = &SLOStatistics{
			Class: string(q.Class), LatencyTarget: v.cfg.LatencyTarget(),
			Arrived: q.Arrived, Good: q.Good, Late: q.Late, Rejected: q.Rejected,
			Dropped: q.Dropped, Failed: q.Failed, Canceled: q.Canceled,
			QueueDepth: q.QueueDepth, Goodput: q.Goodput, Attainment: q.Attainment,
			MeanQueueDelay: q.MeanQueueDelay,
		}
	}
	return s
}
