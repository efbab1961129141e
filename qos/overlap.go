package qos

import "time"

// Two executions that run at once on a device share it: on a CPU of C
// cores, two models of T intra-op threads each that both fill the cores
// run at about C/2T of their speed while they overlap. The predictions
// are of an execution alone (or of the mix the online correction saw),
// so an execution started beside a running one slows that one past what
// admission planned. On the colocation day (two latency-critical OCR
// models of two threads each on two cores, docs/control-loop.md), an
// execution that another latency-critical execution started beside ran
// 1.15-1.22x its prediction at the median and 3.2-3.3x at p99, and most
// of the requests still late at the server had such a neighbour start
// during them.
//
// yieldLocked holds a latency-critical batch back instead of starting it
// beside a running latency-critical execution that the overlap would
// make late, when the batch can wait for that execution's predicted end
// and still meet its own deadline. The running execution, of R predicted
// left, is taken to run OverlapSlowdown (k) times slower while the two
// overlap, so that it ends R + (k-1) x min(R, the batch's prediction)
// from now. It is not held for:
//   - an execution already past its predicted end (how long it still runs
//     is unknown, and holding would only guess), or predicted to end past
//     its deadline alone (holding would not save it);
//   - a batch that could not wait for the running one's predicted end and
//     still end by its deadline: a sure miss is not traded for a likely
//     one.
//
// The hold ends when the running execution ends (its end dispatches
// again) or, if it runs past its prediction, at its predicted end: it is
// then no longer predicted, and the batch starts. Holding never makes
// the held batch late by prediction, and best-effort work does not take
// the held slot in one pool (pickLocked keeps the device for
// latency-critical work that waits).
//
// Replayed over the colocation day's executions (three runs, 487
// starts beside a running latency-critical execution): with k = 3 the
// rule holds 37 starts, in 7 of which the running execution was late,
// and in none of which the held batch was predicted late; k = 2 holds 6
// (3 late), k = 4 77 (7 late). Live, at k = 3, it held 6-14 batches a
// run and the requests late at the server fell from 1.04% to 0.73%
// (pooled over six alternated runs each); always holding
// (qos.device_slots=1) cost more in waiting than the overlap did
// (BENCHMARKS.md).
func (s *Scheduler) yieldLocked(m *model, batch []*request, now time.Time) (until time.Time, yield bool) {
	k := s.opts.OverlapSlowdown
	// Under the qos policy, running less runningBE is the latency-critical
	// executions: with none running (a request that finds the device
	// idle) there is nothing to hold for, and nothing to estimate.
	if s.fifo || k <= 1 || m.spec.Class != ClassLatencyCritical || s.running == s.runningBE {
		return time.Time{}, false
	}
	head := batch[0]
	var deadline time.Time
	size := 0
	for _, r := range batch {
		size += r.batch
		deadline = earliest(deadline, r.deadline)
	}
	if deadline.IsZero() {
		return time.Time{}, false
	}
	own, ok := s.est.EstimateSize(m.spec.Name, size, head.elements)
	if !ok {
		return time.Time{}, false
	}
	var wait time.Time // the latest predicted end of a running execution at risk
	for _, o := range s.models {
		if o.spec.Class != ClassLatencyCritical {
			continue
		}
		for e := range o.execs {
			if e.predicted <= 0 || e.deadline.IsZero() {
				continue
			}
			end := e.start.Add(e.predicted)
			if !end.After(now) || end.After(e.deadline) {
				continue
			}
			left := end.Sub(now)
			slowed := end.Add(time.Duration((k - 1) * float64(min(left, own))))
			if slowed.After(e.deadline) {
				wait = laterOf(wait, end)
			}
		}
	}
	if wait.IsZero() || wait.Add(own).After(deadline) {
		return time.Time{}, false
	}
	if m.overlapHeld != head.seq {
		m.overlapHeld = head.seq
		m.mm.holds.Inc()
		s.logLocked(m.log, "held beside a running execution", "batch", size,
			"wait_ms", logMillis(wait.Sub(now)), "slack_ms", logMillis(deadline.Sub(wait.Add(own))))
	}
	return wait, true
}
