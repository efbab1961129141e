package models

import (
	"cmp"
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
