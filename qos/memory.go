package qos

import (
	"errors"
	"fmt"
	"time"
)

// This file keeps batches within the memory of the instances that run them.
// An MPS client's pinned memory is fixed when it starts, and the adaptive
// policy sizes it from the model's load (an idle model's shrinks), so a
// batch formed for the model's maximum could fail with out-of-memory after
// idleness. The scheduler forms each batch within what the executor's
// instances hold now (MemoryBound); a request that alone is larger waits
// for the memory to grow (the control loop sees it queued) and is refused
// with ErrNoMemory when it has waited MemoryWait.

// MemoryBound is implemented by executors whose instances' memory bounds
// the batch they run (runtime.Pool over simulated MPS clients).
type MemoryBound interface {
	// MaxBatch is the largest batch every instance's memory holds now;
	// bounded is false when memory sets no bound.
	MaxBatch() (n int, bounded bool)
}

// ErrNoMemory: the request alone is a larger batch than the model's
// instances hold, and their memory did not grow for it within MemoryWait
// (HTTP 503, RESOURCE_EXHAUSTED).
var ErrNoMemory = errors.New("request refused: the model's instance memory holds no batch this large")

const (
	// MemoryWait is how long a request larger than its model's instances
	// hold waits for their memory to grow before it is refused: a control
	// period and a replacement's start and warm-up on a simulated GPU, with
	// room. An assumption.
	MemoryWait = 10 * time.Second
	// memoryPoll is how often a request waiting for memory looks again:
	// the executor's bound changes without a kick.
	memoryPoll = 50 * time.Millisecond
)

// memoryBatch is the largest batch m's instances hold now, or false when
// their memory sets no bound (or m does not batch).
func memoryBatch(m *model) (int, bool) {
	if m.spec.MaxBatchSize <= 0 {
		return 0, false
	}
	b, ok := m.spec.Executor.(MemoryBound)
	if !ok {
		return 0, false
	}
	return b.MaxBatch()
}

// refuseOverMemoryLocked refuses the queued requests that alone are larger
// than their model's instances hold and have waited MemoryWait for them to
// grow, and returns when the next one will have waited that long.
func (s *Scheduler) refuseOverMemoryLocked(now time.Time) time.Time {
	var wake time.Time
	for _, m := range s.models {
		if m.q.len() == 0 {
			continue
		}
		fit, ok := memoryBatch(m)
		if !ok {
			continue
		}
		refused := false
		for _, r := range m.q.items {
			if r.batch <= fit {
				continue
			}
			if due := r.arrival.Add(MemoryWait); now.Before(due) {
				wake = earliest(wake, due)
				continue
			}
			err := fmt.Errorf("%w: a batch of %d waited %s, the instances hold %d", ErrNoMemory, r.batch, millis(now.Sub(r.arrival)), fit)
			s.logLocked(m.log, "request refused", "error", err)
			s.finishLocked(r, outcomeRejected, now, result{err: err})
			refused = true
		}
		if refused {
			m.q.removeDispatched()
			s.finalizeLocked(m)
		}
	}
	return wake
}

// queuedRows is the rows m's queue holds.
func (m *model) queuedRows() int {
	n := 0
	for _, r := range m.q.items {
		n += r.batch
	}
	return n
}

// requestRowsWindow is how long the largest request a model saw counts in
// ModelState.LargestRequest after it arrived.
const requestRowsWindow = time.Minute

// observeRows keeps the largest request of the last requestRowsWindow
// (roughly: a smaller one takes its place once it is that old).
func (m *model) observeRows(rows int, now time.Time) {
	if rows >= m.bigRows || now.Sub(m.bigRowsAt) > requestRowsWindow {
		m.bigRows, m.bigRowsAt = rows, now
	}
}

// largestRequest is the rows of the largest request of the last
// requestRowsWindow, 0 when none arrived.
func (m *model) largestRequest(now time.Time) int {
	if m.bigRowsAt.IsZero() || now.Sub(m.bigRowsAt) > requestRowsWindow {
		return 0
	}
	return m.bigRows
}
