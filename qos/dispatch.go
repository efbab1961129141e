package qos

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

// admitLocked decides at arrival whether r can still meet its deadline.
// It plays the slots forward: every running execution holds a device slot
// (and a slot of its model) until its predicted end; the work that goes
// before r then takes the earliest free slots in turn: for a
// latency-critical request the queued latency-critical work of other models
// ordered before it, for a best-effort request all queued latency-critical
// work; then the batches the requests of r's own model queued ahead of it
// will run in, as the dispatcher will form them (playOwnLocked), r's among
// them. r's batch starts when both a device slot and a slot of its model
// are free, and must end by its deadline. Best-effort work that is merely running delays r only when
// it holds the slots r needs. Unknown estimates admit.
func (s *Scheduler) admitLocked(m *model, r *request, now time.Time) error {
	if r.deadline.IsZero() {
		return nil
	}
	device := s.scratch[0].reset(s.opts.DeviceSlots, now)
	mine := s.scratch[1].reset(m.spec.Slots, now)
	s.scratch[0], s.scratch[1] = device, mine
	// With separate classes a latency-critical request's slots are held
	// by latency-critical executions only.
	lcOnly := s.separate && m.spec.Class == ClassLatencyCritical
	for _, other := range s.models {
		if lcOnly && other.spec.Class != ClassLatencyCritical {
			continue
		}
		for e := range other.execs {
			end := now
			if e.predicted > 0 {
				end = laterOf(e.start.Add(e.predicted), now)
			}
			device.hold(end)
			if other == m {
				mine.hold(end)
			}
		}
	}
	for _, other := range s.models {
		if other == m || other.spec.Class != ClassLatencyCritical {
			continue
		}
		for _, d := range s.queuedBatchesLocked(other, r, m.spec.Class == ClassBestEffort) {
			device.run(device.earliest(), d)
		}
	}
	begin, own, full, known, played := s.playOwnLocked(m, r, device, mine)
	if !played {
		begin, own, full, known = s.ownBacklogLocked(m, r, device, mine)
	}
	if !known {
		return nil
	}
	wait := begin.Sub(now)
	r.plan = plan{wait: wait, own: own}
	if miss := begin.Add(own).Sub(r.deadline); miss > 0 {
		return fmt.Errorf("%w: predicted completion misses the deadline by %s (queue ahead %s, execution %s)",
			ErrRejected, millis(miss), millis(wait), millis(own))
	}
	if m.spec.Class != ClassLatencyCritical {
		return nil
	}
	// The queue ahead drains on the model's slots at once: it holds
	// about slots times wait of the model's predicted executions, and
	// r's own runs on one of them.
	work := time.Duration(s.parallelLocked(m))*wait + own
	if m.log.Enabled(context.Background(), slog.LevelDebug) { // read for the finish line only
		r.plan.risk, r.plan.risky = m.tail.risk(wait+own, work, r.deadline.Sub(begin.Add(own))), true
	}
	if full == 0 {
		// Away from the margin: the deviations learned there relax, and
		// an idle model forgets them (relaxAdmissions).
		if wait <= 0 {
			m.tail.forget()
		} else {
			m.tail.relax()
		}
	}
	if full > 0 {
		// A backlog: at least a whole batch of the model's own requests
		// waits ahead. Under overload a request admitted with no room
		// left is late whenever the executions run slower than
		// predicted, and every admitted request would have none. Room
		// for the predictions' error keeps the admitted ones on time;
		// the backlog keeps the device busy meanwhile. Without a backlog
		// a refusal for room would only turn a likely success into a
		// sure miss (measured: 0.954 attainment against 0.964 on the
		// simulated GPU day), so the mean decides. Best-effort work has
		// loose targets and runs in the gaps, where predictions say
		// little: it is admitted on the mean.
		room := m.sharedRoom(wait+own, work)
		r.plan.room, r.plan.z = room, m.tail.z()
		// The outcomes of requests admitted at the margin teach the room
		// (tail.learn); the others relax what it learned.
		if r.plan.atMargin = m.tail.atMargin(r.deadline.Sub(begin.Add(own)), room); !r.plan.atMargin {
			m.tail.relax()
		}
		if miss := begin.Add(own + room).Sub(r.deadline); miss > 0 {
			return fmt.Errorf("%w: completion with %s of room for the predictions' error misses the deadline by %s (queue ahead %s, execution %s)",
				ErrRejected, millis(room), millis(miss), millis(wait), millis(own))
		}
	}
	return nil
}

// playOwnLocked plays the requests of m queued before r, and r, forward
// as planLocked will batch them when m's slots free up: a batch takes the
// head and grows in queue order while the next request fits the batch
// maximum (and the instances' memory) and the grown batch, started then,
// still ends by the head's deadline (for best-effort work, within
// MaxBestEffortExecution). It returns when r's batch begins, its
// predicted execution, how many of m's batches run before it, and whether
// that execution is known. played is false when it cannot tell how the
// dispatcher will batch them (requests of several shapes, preferred batch
// sizes, a request larger than the memory holds): ownBacklogLocked then
// counts in typical batches.
//
// Typical batches (the recent mean size) under-predicted batching in a
// burst: a model whose traffic mostly runs alone (batches of 1) counted
// each request queued ahead as an execution of its own, while the
// dispatcher runs them, and r, in one batch when the running one ends. A
// 15 ms model of 5 ms executions refused the second request of a burst
// that arrived behind a running batch, which a batch of two would have
// answered in 10 ms.
func (s *Scheduler) playOwnLocked(m *model, r *request, device, mine slots) (begin time.Time, own time.Duration, ahead int, known, played bool) {
	maxBatch := m.spec.MaxBatchSize
	if maxBatch <= 0 || len(m.spec.PreferredBatchSizes) > 0 {
		return time.Time{}, 0, 0, false, false
	}
	if fit, bounded := memoryBatch(m); bounded {
		maxBatch = min(maxBatch, fit)
	}
	// The requests ahead of r; Preadmit's r (no body yet) is taken to be
	// of their shape.
	n, key := 0, r.key
	if r.req == nil && len(m.q.items) > 0 {
		key = m.q.items[0].key
	}
	for _, x := range m.q.items {
		if !before(x, r) {
			break
		}
		if x.key != key || x.batch > maxBatch {
			return time.Time{}, 0, 0, false, false
		}
		n++
	}
	if r.batch > maxBatch {
		return time.Time{}, 0, 0, false, false
	}
	at := func(i int) *request { // the queue ahead, then r
		if i < n {
			return m.q.items[i]
		}
		return r
	}
	bound := time.Duration(0)
	if m.spec.Class != ClassLatencyCritical {
		bound = s.opts.MaxBestEffortExecution
	}
	// Estimates by batch size, asked once each: a long queue of one-row
	// requests would otherwise ask the estimator once a request under
	// the lock. (Rows of one shape have one size; Preadmit's r, of
	// unknown size, is asked afresh.)
	cache := s.estCache.reset(maxBatch)
	s.estCache = cache
	rowSize := key0Elements(m, n)
	estimate := func(b int, elements int64) (time.Duration, bool) {
		if elements != rowSize {
			return s.est.EstimateSize(m.spec.Name, b, elements)
		}
		return cache.get(b, func() (time.Duration, bool) { return s.est.EstimateSize(m.spec.Name, b, elements) })
	}
	for i := 0; ; {
		start := laterOf(device.earliest(), mine.earliest())
		head := at(i)
		size := head.batch
		for i++; i <= n; i++ {
			x := at(i)
			if size+x.batch > maxBatch {
				break
			}
			if e, ok := estimate(size+x.batch, head.elements); ok &&
				(!head.deadline.IsZero() && !grownInTime(m, head, start, e) || bound > 0 && e > bound) {
				break
			}
			size += x.batch
		}
		e, ok := estimate(size, head.elements)
		if i > n { // r's batch
			return start, e, ahead, ok, true
		}
		device.run(start, e) // 0 when unknown
		mine.run(start, e)
		ahead++
	}
}

// grownInTime reports whether a batch of m grown past its head, predicted
// to take e from start, still ends by the head's deadline: for a
// latency-critical model, with room for the error of that execution
// (m.room), as admission leaves behind a backlog. The head runs in any
// case; what the room decides is only whether requests behind it join its
// batch. Grown on the mean alone, a batch filled the head's slack to the
// brim, and one execution slower than predicted made the head and every
// request that joined it late at once: on the colocation day the late
// admitted requests had been dispatched with a median of 33 ms of
// predicted slack (the ones on time 83 ms) in batches of two and three
// that ran 1.9x their prediction (issue 29, BENCHMARKS.md).
func grownInTime(m *model, head *request, start time.Time, e time.Duration) bool {
	end := start.Add(e)
	if m.spec.Class == ClassLatencyCritical {
		end = end.Add(m.room(e))
	}
	return !end.After(head.deadline)
}

// key0Elements is the row size of the first of the n requests ahead
// (0 when none): the size playOwnLocked caches estimates for.
func key0Elements(m *model, n int) int64 {
	if n == 0 {
		return 0
	}
	return m.q.items[0].elements
}

// estimates caches one model's estimates by batch size for one admission.
type estimates []struct {
	d     time.Duration
	state int8 // 0 not asked, 1 known, -1 unknown
}

// reset makes room for batch sizes 1..n, none asked, reusing the array.
func (c estimates) reset(n int) estimates {
	c = slices.Grow(c[:0], n+1)[:n+1]
	clear(c)
	return c
}

// get returns the estimate of a batch of b, asking ask once.
func (c estimates) get(b int, ask func() (time.Duration, bool)) (time.Duration, bool) {
	if b <= 0 || b >= len(c) {
		return ask()
	}
	if c[b].state == 0 {
		d, ok := ask()
		c[b].d, c[b].state = d, 1
		if !ok {
			c[b].state = -1
		}
	}
	return c[b].d, c[b].state > 0
}

// ownBacklogLocked is playOwnLocked for queues it cannot play: the
// requests of m queued before r run in batches of m's typical size, r's
// rows in the last.
func (s *Scheduler) ownBacklogLocked(m *model, r *request, device, mine slots) (begin time.Time, own time.Duration, full int, known bool) {
	per := m.typicalBatch()
	rows := r.batch
	work := float64(r.batch) * float64(r.elements)
	for _, x := range m.q.items {
		if !before(x, r) {
			break
		}
		rows += x.batch
		work += float64(x.batch) * float64(x.elements)
	}
	full = (rows - 1) / per // batches of r's model that run before r's
	own, known = s.est.EstimateSize(m.spec.Name, rows-full*per, r.elements)
	if !known {
		return time.Time{}, 0, 0, false
	}
	if full > 0 {
		// The batches ahead, of whatever shapes, at their rows' mean size.
		e, _ := s.est.EstimateSize(m.spec.Name, per, int64(work/float64(rows)))
		for range full {
			at := laterOf(device.earliest(), mine.earliest())
			device.run(at, e)
			mine.run(at, e)
		}
	}
	return laterOf(device.earliest(), mine.earliest()), own, full, true
}

// slots tracks when each of a set of execution slots is next free.
type slots []time.Time

func newSlots(n int, now time.Time) slots {
	s := make(slots, max(n, 1))
	for i := range s {
		s[i] = now
	}
	return s
}

// reset makes s n slots free at now, reusing its array.
func (s slots) reset(n int, now time.Time) slots {
	s = slices.Grow(s[:0], max(n, 1))[:max(n, 1)]
	for i := range s {
		s[i] = now
	}
	return s
}

// hold marks the earliest-free slot busy until end (a running execution).
func (s slots) hold(end time.Time) {
	i := s.earliestIndex()
	s[i] = laterOf(s[i], end)
}

// run puts work of duration d on the earliest-free slot, starting no
// sooner than at.
func (s slots) run(at time.Time, d time.Duration) {
	i := s.earliestIndex()
	s[i] = laterOf(s[i], at).Add(d)
}

func (s slots) earliest() time.Time { return s[s.earliestIndex()] }

func (s slots) earliestIndex() int {
	best := 0
	for i := range s {
		if s[i].Before(s[best]) {
			best = i
		}
	}
	return best
}

func laterOf(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// queuedBatchesLocked is the predicted execution time of each batch m's
// queued requests would run in, counting the requests ordered before r
// (all of them when all is set), in batches of the size m's executions
// have recently had.
func (s *Scheduler) queuedBatchesLocked(m *model, r *request, all bool) []time.Duration {
	rows, work := 0, 0.0
	for _, x := range m.q.items {
		if !all && !before(x, r) {
			break
		}
		rows += x.batch
		work += float64(x.batch) * float64(x.elements)
	}
	if rows == 0 {
		return nil
	}
	// Requests of several shapes run in batches of one shape each; their
	// time is about that of batches of the rows' mean size, the work
	// being about linear in the elements.
	elements := int64(work / float64(rows))
	per := m.typicalBatch()
	var out []time.Duration
	if full := rows / per; full > 0 {
		if e, ok := s.est.EstimateSize(m.spec.Name, per, elements); ok {
			for range full {
				out = append(out, e)
			}
		}
	}
	if rest := rows % per; rest > 0 {
		if e, ok := s.est.EstimateSize(m.spec.Name, rest, elements); ok {
			out = append(out, e)
		}
	}
	return out
}

// millis formats a duration in milliseconds, as error messages state them.
func millis(d time.Duration) string {
	return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
}

// dispatchLocked starts batches while device slots are free and returns
// when the loop must look again without being kicked (zero: no need).
func (s *Scheduler) dispatchLocked(now time.Time) time.Time {
	var wake time.Time
	if !s.fifo {
		wake = s.dropLocked(now)
	}
	wake = earliest(wake, s.refuseOverMemoryLocked(now))
	for {
		batch, hold := s.pickLocked(now)
		wake = earliest(wake, hold)
		if batch == nil {
			break
		}
		s.startLocked(batch, now)
	}
	return wake
}

// dropLocked fails the queued requests that can no longer finish by their
// deadline, even alone and started now, and returns when the next one will
// become hopeless.
func (s *Scheduler) dropLocked(now time.Time) time.Time {
	var wake time.Time
	for _, m := range s.models {
		dropped := false
		for _, r := range m.q.items {
			if r.deadline.IsZero() || r.probe {
				continue
			}
			e, _ := s.est.EstimateSize(m.spec.Name, r.batch, r.elements) // 0 when unknown
			hopeless := r.deadline.Add(-e)
			if !now.After(hopeless) {
				wake = earliest(wake, hopeless.Add(time.Nanosecond))
				continue
			}
			var err error
			if now.After(r.deadline) {
				err = fmt.Errorf("%w: deadline passed %s ago", ErrDropped, millis(now.Sub(r.deadline)))
			} else {
				err = fmt.Errorf("%w: %s left, execution takes %s", ErrDropped, millis(r.deadline.Sub(now)), millis(e))
			}
			s.logLocked(m.log, "request dropped", "error", err, "queued", now.Sub(r.arrival))
			m.refused++
			s.finishLocked(r, outcomeDropped, now, result{err: err})
			dropped = true
		}
		if dropped {
			m.q.removeDispatched()
			s.finalizeLocked(m)
		}
	}
	return wake
}

// pickLocked chooses the next batch to start, or nil and when a held batch
// is due. Under fifo the model whose head arrived first goes. Under qos
// latency-critical models go first, the one whose head has the earliest
// deadline (then priority). Best-effort models go by priority, and among
// equal priorities the one with the least virtual time (fair queueing on
// predicted work), and only when no latency-critical request waits for
// their slot: in one pool (the default), best-effort work waiting while
// latency-critical work runs earns BestEffortFloor of an execution per
// latency-critical one, and runs when that credit makes up one of its
// own; with SeparateClasses each class has its own slots.
func (s *Scheduler) pickLocked(now time.Time) ([]*request, time.Time) {
	lcFree, beFree := s.freeSlotsLocked()
	if !lcFree && !beFree {
		return nil, time.Time{}
	}
	var lc, be []*model
	for _, m := range s.models {
		if m.q.len() == 0 || m.running >= m.spec.Slots {
			continue
		}
		if !s.fifo && m.spec.Class == ClassLatencyCritical {
			if lcFree {
				lc = append(lc, m)
			}
		} else if beFree {
			be = append(be, m)
		}
	}
	slices.SortFunc(lc, func(a, b *model) int { return order(before(a.q.head(), b.q.head())) })
	slices.SortFunc(be, func(a, b *model) int {
		if s.fifo {
			return order(a.q.head().seq < b.q.head().seq)
		}
		if ra, rb := a.q.head().rank, b.q.head().rank; ra != rb {
			return order(ra < rb)
		}
		if a.vtime != b.vtime {
			return order(a.vtime < b.vtime)
		}
		return order(before(a.q.head(), b.q.head()))
	})

	var wake time.Time
	first := func(ms []*model) []*request {
		for _, m := range ms {
			batch, hold := s.planLocked(m, now)
			if batch != nil {
				if until, yield := s.yieldLocked(m, batch, now); yield {
					wake = earliest(wake, until)
					continue
				}
				return batch
			}
			wake = earliest(wake, hold)
		}
		return nil
	}
	lcBatch := first(lc)
	if s.separate {
		if lcBatch != nil {
			return lcBatch, wake
		}
		return first(be), wake
	}
	if lcBatch == nil && slices.ContainsFunc(lc, func(m *model) bool { return !m.memHeld }) {
		return nil, wake // latency-critical work is filling a batch; keep the device for it
	}
	beBatch := first(be)
	if lcBatch == nil {
		return beBatch, wake
	}
	if beBatch != nil && s.floor > 0 {
		due := 1 - s.floor
		if s.beCredit >= due-1e-9 {
			s.beCredit -= due
			return beBatch, wake
		}
		s.beCredit = min(s.beCredit+s.floor, due)
	}
	return lcBatch, wake
}

// freeSlotsLocked reports whether a latency-critical and a best-effort
// execution could start now.
func (s *Scheduler) freeSlotsLocked() (lc, be bool) {
	if !s.separate {
		free := s.running < s.opts.DeviceSlots
		return free, free
	}
	return s.running-s.runningBE < s.opts.DeviceSlots, s.runningBE < s.opts.DeviceSlots
}

// order turns a less-than into a comparison for slices.SortFunc.
func order(less bool) int {
	if less {
		return -1
	}
	return 1
}

// planLocked builds the batch m would run now from its queue, or returns
// nil and the time until which it waits for the batch to fill.
func (s *Scheduler) planLocked(m *model, now time.Time) ([]*request, time.Time) {
	head := m.q.head()
	maxBatch := m.spec.MaxBatchSize
	m.memHeld = false
	if maxBatch <= 0 {
		return []*request{head}, time.Time{}
	}
	if fit, ok := memoryBatch(m); ok {
		if head.batch > fit {
			// It waits for the memory to grow, or MemoryWait
			// (refuseOverMemoryLocked); nothing is run past it.
			m.memHeld = true
			return nil, now.Add(memoryPoll)
		}
		maxBatch = min(maxBatch, fit)
	}
	batch, size := []*request{head}, head.batch
	complete := size >= maxBatch
	for _, r := range m.q.items[1:] {
		if complete {
			break
		}
		if r.key != head.key {
			if s.fifo {
				complete = true // fifo does not reach past a request
			}
			continue
		}
		if size+r.batch > maxBatch {
			complete = true
			break
		}
		if !s.fifo && !head.deadline.IsZero() {
			// The head has the batch's earliest deadline: queue order.
			if e, ok := s.est.EstimateSize(m.spec.Name, size+r.batch, head.elements); ok && !grownInTime(m, head, now, e) {
				complete = true
				break
			}
		}
		if bound := s.opts.MaxBestEffortExecution; !s.fifo && bound > 0 && m.spec.Class != ClassLatencyCritical {
			if e, ok := s.est.EstimateSize(m.spec.Name, size+r.batch, head.elements); ok && e > bound {
				complete = true
				break
			}
		}
		batch, size = append(batch, r), size+r.batch
		complete = size >= maxBatch
	}
	if pref := m.spec.PreferredBatchSizes; !s.fifo && len(pref) > 0 {
		// Cut to the largest preferred size a prefix of the batch makes.
		cut, sum := -1, 0
		for i, r := range batch {
			if sum += r.batch; slices.Contains(pref, sum) {
				cut = i + 1
			}
		}
		if cut > 0 {
			batch, complete = batch[:cut], true
		}
	}
	if !complete && m.spec.MaxQueueDelay > 0 {
		until := head.arrival.Add(m.spec.MaxQueueDelay)
		if !s.fifo && !head.deadline.IsZero() {
			// Wait no longer than the batch we have could still start.
			e, _ := s.est.EstimateSize(m.spec.Name, size, head.elements)
			until = earliest(until, head.deadline.Add(-e))
		}
		if now.Before(until) {
			return nil, until
		}
	}
	return batch, time.Time{}
}

// startLocked takes a batch out of its queue and starts executing it.
func (s *Scheduler) startLocked(batch []*request, now time.Time) {
	e, ctx := s.beginLocked(batch, now)
	go s.execute(ctx, e)
}

// startInlineLocked starts r, just queued for m, as an execution the
// caller runs on its own goroutine (executeInline), when the dispatcher
// would start it at once as a batch of its own: Run is dispatching,
// nothing else waits in any queue, a slot is free and the batch is not
// held to fill. Otherwise, or when r is already hopeless (dropLocked's
// business), it returns nil and r waits for the dispatcher. Waking the
// dispatcher and a goroutine for the execution costs two goroutine
// handoffs on the request's path.
func (s *Scheduler) startInlineLocked(m *model, r *request, now time.Time) (*execution, context.Context) {
	if !s.started || s.stopped || m.q.len() != 1 {
		return nil, nil
	}
	for _, o := range s.models {
		if o != m && o.q.len() > 0 {
			return nil, nil
		}
	}
	if !s.fifo && !r.deadline.IsZero() && !r.probe {
		if e, _ := s.est.EstimateSize(m.spec.Name, r.batch, r.elements); now.After(r.deadline.Add(-e)) {
			return nil, nil
		}
	}
	batch, _ := s.pickLocked(now)
	if len(batch) != 1 || batch[0] != r {
		return nil, nil
	}
	return s.beginLocked(batch, now)
}

// executeInline runs an execution of r alone (startInlineLocked) on the
// caller's goroutine and returns r's result. Ending ctx while it runs
// settles r as canceled and cancels the execution, as Submit does for a
// request whose execution runs elsewhere.
func (s *Scheduler) executeInline(ctx, ectx context.Context, e *execution, r *request) (*runtime.InferResponse, error) {
	stop := context.AfterFunc(ctx, func() {
		s.mu.Lock()
		defer s.unlock()
		if r.state != stateRunning {
			return
		}
		s.finishLocked(r, outcomeCanceled, time.Now(), result{err: ctx.Err()})
		if e.live--; e.live == 0 {
			e.cancel()
		}
	})
	s.execute(ectx, e)
	stop()
	res := <-r.done
	return res.resp, res.err
}

// beginLocked takes a batch out of its queue and returns its execution
// and the execution's context, for execute.
func (s *Scheduler) beginLocked(batch []*request, now time.Time) (*execution, context.Context) {
	m := batch[0].m
	e := &execution{m: m, name: m.spec.Name, exec: m.spec.Executor, reqs: batch, start: now, live: len(batch), elements: batch[0].elements}
	for _, r := range batch {
		e.size += r.batch
		e.deadline = earliest(e.deadline, r.deadline)
		r.state, r.exec, r.started = stateRunning, e, now
		delay := now.Sub(r.arrival)
		m.win.recordDelay(now, delay)
		m.mm.queueDelay.Observe(delay.Seconds())
	}
	m.q.removeDispatched()
	m.lastStart, m.refused = now, 0
	if m.recentBatch == 0 {
		m.recentBatch = float64(e.size)
	} else {
		m.recentBatch = m.recentBatch*(1-batchSizeWeight) + float64(e.size)*batchSizeWeight
	}
	e.predicted, _ = s.est.EstimateSize(m.spec.Name, e.size, e.elements)
	m.mm.batchSize.Observe(float64(e.size))
	m.running++
	s.running++
	if m.spec.Class != ClassLatencyCritical || s.fifo {
		s.runningBE++
		s.chargeLocked(m, e)
	}
	m.execs[e] = struct{}{}
	ctx, cancel := context.WithCancel(s.runCtx)
	e.cancel = cancel
	s.execs.Add(1)
	return e, traceDispatchLocked(ctx, e, now)
}

// chargeLocked advances a best-effort model's virtual time by the
// execution's predicted seconds. Priority ranks order best-effort models
// before virtual time does, so within a rank the weights are equal.
func (s *Scheduler) chargeLocked(m *model, e *execution) {
	cost := e.predicted.Seconds()
	if cost <= 0 {
		cost = 1e-3 // unknown: a token, so that turns still rotate
	}
	m.vtime += cost
}

// wakeLocked brings a best-effort model that had nothing queued or
// running up to the least virtual time of the best-effort models that kept
// working, so that idleness is not saved up into a burst that shuts the
// others out.
func (s *Scheduler) wakeLocked(m *model) {
	if s.fifo || m.spec.Class == ClassLatencyCritical || m.q.len() > 0 || m.running > 0 {
		return
	}
	least := math.Inf(1)
	for _, o := range s.models {
		if o != m && o.spec.Class != ClassLatencyCritical && (o.q.len() > 0 || o.running > 0) {
			least = min(least, o.vtime)
		}
	}
	if !math.IsInf(least, 1) {
		m.vtime = max(m.vtime, least)
	}
}

// execute runs a batch, feeds the estimator and hands each request its part
// of the response.
func (s *Scheduler) execute(ctx context.Context, e *execution) {
	defer s.execs.Done()
	defer e.cancel()
	m := e.m
	parts, timing, faults, err := s.run(ctx, e)
	if err != nil {
		m.log.Debug("execution failed", "batch", e.size, "requests", len(e.reqs), "error", err)
	}

	s.mu.Lock()
	now := time.Now()
	if err == nil {
		m.recordExecution(e.size, timing)
		if e.predicted > 0 {
			ratio := now.Sub(e.start).Seconds() / e.predicted.Seconds()
			m.service.observe(ratio)
			m.tail.setSlots(s.parallelLocked(m))
			m.tail.observe(e.predicted.Seconds(), now.Sub(e.start).Seconds())
		}
	}
	m.running--
	s.running--
	if m.spec.Class != ClassLatencyCritical || s.fifo {
		s.runningBE--
	}
	delete(m.execs, e)
	for i, r := range e.reqs {
		switch {
		case r.state != stateRunning: // its client gave up
		case err != nil && errors.Is(err, context.DeadlineExceeded) && !r.deadline.IsZero() && !now.Before(r.deadline):
			// The instance gave up at the request's own deadline (the
			// pool bounds a call by it): the request was dropped at its
			// deadline, as the client is told (504), not failed.
			s.finishLocked(r, outcomeDropped, now, result{err: err})
		case err != nil:
			s.finishLocked(r, outcomeFailed, now, result{err: err})
		case faults != nil && faults[i] != nil:
			s.finishLocked(r, outcomeFailed, now, result{err: faults[i]})
		case !r.deadline.IsZero() && now.After(r.deadline):
			s.finishLocked(r, outcomeLate, now, result{resp: parts[i]})
		default:
			s.finishLocked(r, outcomeGood, now, result{resp: parts[i]})
		}
	}
	s.finalizeLocked(m)
	queued := s.anyQueuedLocked()
	s.unlock()
	if queued {
		// The slot is free for what waits; with nothing queued the
		// dispatcher would find nothing to do.
		s.kick()
	}
}

// anyQueuedLocked reports whether a request of any model waits.
func (s *Scheduler) anyQueuedLocked() bool {
	for _, m := range s.models {
		if m.q.len() > 0 {
			return true
		}
	}
	return false
}

// run merges the batch's requests, executes them and splits the response;
// it returns the execution's timing in the instance. faults, when not nil,
// holds the error of each request whose shared memory faulted while the
// batch was merged (mergeRequests): those fail alone.
func (s *Scheduler) run(ctx context.Context, e *execution) (parts []*runtime.InferResponse, timing runtime.Timing, faults []error, err error) {
	if len(e.reqs) == 1 {
		start := time.Now()
		resp, err := e.exec.Execute(ctx, e.reqs[0].req)
		if err != nil {
			return nil, runtime.Timing{}, nil, err
		}
		s.est.ObserveSize(e.name, e.size, e.elements, time.Since(start))
		return []*runtime.InferResponse{resp}, resp.Timing, nil, nil
	}
	reqs := make([]*runtime.InferRequest, len(e.reqs))
	for i, r := range e.reqs {
		reqs[i] = r.req
	}
	merged, sizes, faults, err := mergeRequests(reqs)
	if err != nil {
		return nil, runtime.Timing{}, nil, fmt.Errorf("qos: merging a batch of %d requests: %w", len(reqs), err)
	}
	start := time.Now()
	resp, err := e.exec.Execute(ctx, merged)
	if err != nil {
		return nil, runtime.Timing{}, nil, err
	}
	s.est.ObserveSize(e.name, e.size, e.elements, time.Since(start))
	parts, err = splitResponse(resp, sizes)
	if err != nil {
		return nil, runtime.Timing{}, nil, fmt.Errorf("qos: splitting the response of a batch of %d: %w", e.size, err)
	}
	return parts, resp.Timing, faults, nil
}
