package models

import (
	"github.com/sloserve/sloserve/runtime"
	"sync"
	"time"
)

// versionStats accumulates one version's statistics since it was loaded.
type versionStats struct {
	mu sync.Mutex
	s  Statistics
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
	vs.s.ExecutionCount++
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

func (vs *versionStats) snapshot() Statistics {
	vs.mu.Lock()
	defer vs.mu.Unlock()
	return vs.s
}
