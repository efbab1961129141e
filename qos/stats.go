package qos

import (
	"cmp"
	"math"
	"slices"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

// outcome is how a request ended, as counted in Stats and metrics.
type outcome int

const (
	outcomeGood     outcome = iota // finished by its deadline
	outcomeLate                    // finished after its deadline
	outcomeRejected                // refused at admission (deadline or full queue)
	outcomeDropped                 // deadline passed or became unreachable while queued, or passed while running
	outcomeFailed                  // the execution failed, or the model or scheduler went away
	outcomeCanceled                // the client gave up
	// outcomeInvalid: the request could not be scheduled as it was, or
	// was refused as invalid before it was submitted (CountInvalid). The
	// client is at fault: it is not an arrival and does not count against
	// the SLO.
	outcomeInvalid
	numOutcomes
)

var outcomeNames = [numOutcomes]string{"good", "late", "rejected", "dropped", "failed", "canceled", "invalid"}

func (o outcome) String() string { return outcomeNames[o] }

// Stats are one model's counters since it was added, and rates over the
// scheduler's sliding window (Options.Window).
type Stats struct {
	Model string
	Class Class

	// Counters since AddModel. Every arrived request ends in exactly one
	// of the outcomes, so Arrived = Good + Late + Rejected + Dropped +
	// Failed + Canceled + the requests still queued or running. Invalid
	// requests are counted apart: they never arrived as far as the SLO is
	// concerned.
	Arrived, Good, Late, Rejected, Dropped, Failed, Canceled uint64
	Invalid                                                  uint64
	// QueueFull counts the rejections for a full queue and Overloaded
	// those for the server's limits on requests in flight (Gate); the rest
	// of Rejected were predicted to miss their deadline at admission.
	QueueFull, Overloaded uint64
	// SLO is the model's latency target (0: none).
	SLO time.Duration
	// Latency counts the time from arrival to answer of the good and late
	// requests.
	Latency LatencyHistogram

	QueueDepth int // requests waiting
	Running    int // executions in progress
	InFlight   int // requests waiting or in an execution

	// The Triton statistics of the requests that ended, in the shape of
	// its statistics extension. Success: arrival to answer of the good
	// and late requests, Queue their arrival to execution, Compute* their
	// execution's times in the instance, Inferences their rows;
	// Fail: arrival to outcome of all the others.
	Success, Fail, Queue                      Duration
	ComputeInput, ComputeInfer, ComputeOutput Duration
	Inferences                                uint64
	LastInference                             time.Time // zero: none yet

	// Executions counts the batches that ran and succeeded; Batches splits
	// them by batch size, ascending, with their times in the instance.
	Executions uint64
	Batches    []BatchStats

	// Over the window. A request counts in the window when its outcome is
	// known, so WindowSettled is the window's arrivals as far as they ended.
	WindowGood, WindowSettled uint64
	// Goodput is good requests per second over the window (or since
	// AddModel, when that is shorter).
	Goodput float64
	// Attainment is WindowGood / WindowSettled; 0 when nothing settled.
	Attainment float64
	// MeanQueueDelay is the mean time from arrival to execution of the
	// requests dispatched in the window.
	MeanQueueDelay time.Duration
}

// Duration is a count of events and their total time.
type Duration struct {
	Count uint64
	Total time.Duration
}

func (d *Duration) add(t time.Duration) {
	d.Count++
	d.Total += t
}

// requestStats are a model's Triton statistics (see Stats).
type requestStats struct {
	success, fail, queue                      Duration
	computeInput, computeInfer, computeOutput Duration
	inferences                                uint64
	last                                      time.Time
}

// record counts a request that ended at now with outcome o; res is its
// result.
func (rs *requestStats) record(r *request, o outcome, now time.Time, res result) {
	took := now.Sub(r.arrival)
	if o != outcomeGood && o != outcomeLate {
		rs.fail.add(took)
		return
	}
	rs.success.add(took)
	rs.queue.add(r.started.Sub(r.arrival))
	if res.resp != nil {
		t := res.resp.Timing
		rs.computeInput.add(t.Input)
		rs.computeInfer.add(t.Infer)
		rs.computeOutput.add(t.Output)
	}
	rs.inferences += uint64(r.batch)
	rs.last = now
}

// BatchStats is the successful executions of one batch size and their
// times in the instance.
type BatchStats struct {
	Size                 int
	Count                uint64
	Input, Infer, Output time.Duration // summed
}

// recordExecution counts a successful execution of a batch of size rows.
func (m *model) recordExecution(size int, t runtime.Timing) {
	m.executions++
	if m.batches == nil {
		m.batches = map[int]*BatchStats{}
	}
	b, ok := m.batches[size]
	if !ok {
		b = &BatchStats{Size: size}
		m.batches[size] = b
	}
	b.Count++
	b.Input += t.Input
	b.Infer += t.Infer
	b.Output += t.Output
}

// batchStats lists the model's executions by batch size, ascending.
func (m *model) batchStats() []BatchStats {
	out := make([]BatchStats, 0, len(m.batches))
	for _, b := range m.batches {
		out = append(out, *b)
	}
	slices.SortFunc(out, func(a, b BatchStats) int { return cmp.Compare(a.Size, b.Size) })
	return out
}

// ClassStats aggregates the models of one class.
type ClassStats struct {
	Class          Class
	QueueDepth     int
	MeanQueueDelay time.Duration // over the window, of requests dispatched
}

// windowBuckets is how many buckets a window is cut into; rates are exact
// to Window/windowBuckets.
const windowBuckets = 20

type bucket struct {
	index      int64 // which bucket of time this is; stale when behind
	outcomes   [numOutcomes]uint64
	delaySum   time.Duration
	delayCount uint64
}

// window counts events in time buckets over a sliding window.
type window struct {
	epoch   time.Time
	width   time.Duration
	buckets [windowBuckets]bucket
}

func newWindow(now time.Time, length time.Duration) *window {
	w := &window{epoch: now, width: max(length/windowBuckets, 1)}
	for i := range w.buckets {
		w.buckets[i].index = -1
	}
	return w
}

func (w *window) at(now time.Time) *bucket {
	idx := int64(now.Sub(w.epoch) / w.width)
	b := &w.buckets[idx%windowBuckets]
	if b.index != idx {
		*b = bucket{index: idx}
	}
	return b
}

func (w *window) record(now time.Time, o outcome) { w.at(now).outcomes[o]++ }

func (w *window) recordDelay(now time.Time, d time.Duration) {
	b := w.at(now)
	b.delaySum += d
	b.delayCount++
}

// sum adds the buckets of the window ending at now: the current one and the
// windowBuckets-1 before it.
func (w *window) sum(now time.Time) bucket {
	idx := int64(now.Sub(w.epoch) / w.width)
	var s bucket
	for i := range w.buckets {
		b := &w.buckets[i]
		if b.index < 0 || b.index > idx || b.index <= idx-windowBuckets {
			continue
		}
		for o := range s.outcomes {
			s.outcomes[o] += b.outcomes[o]
		}
		s.delaySum += b.delaySum
		s.delayCount += b.delayCount
	}
	return s
}

// span is the time the window ending at now covers: its full length, or
// less while the window is younger than that.
func (w *window) span(now time.Time) time.Duration {
	return min(w.width*windowBuckets, now.Sub(w.epoch))
}

// ModelState is what the control loop reads of one model at each pass.
type ModelState struct {
	Spec                ModelSpec
	Arrived             uint64 // since AddModel
	QueueDepth, Running int
	// QueuedRows is the rows (batch items) the queue holds; LargestRequest
	// the rows of the largest request of the last minute, 0 when none
	// arrived (a memory share must hold it).
	QueuedRows, LargestRequest int
	// LastActive is the last arrival, or when the model was added if
	// nothing has arrived since.
	LastActive time.Time
	Attainment float64 // over the window; 0 when nothing settled
	Settled    uint64  // requests settled in the window
	// ArrivalSCV and ServiceSCV are the squared coefficients of variation
	// of the inter-arrival times and of the execution times (relative to
	// their predictions); 0 when too few have been seen.
	ArrivalSCV, ServiceSCV float64
	// Read is when the state was read.
	Read time.Time
}

// snapshot returns the state of the models that are not being removed, by
// name.
func (s *Scheduler) Snapshot() []ModelState {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	out := make([]ModelState, 0, len(s.models))
	for _, m := range s.models {
		if m.removing {
			continue
		}
		out = append(out, m.state(now))
	}
	slices.SortFunc(out, func(a, b ModelState) int { return cmp.Compare(a.Spec.Name, b.Spec.Name) })
	return out
}

// ModelState returns one model's state; false if it is unknown or being
// removed.
func (s *Scheduler) ModelState(name string) (ModelState, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	m, ok := s.models[name]
	if !ok || m.removing {
		return ModelState{}, false
	}
	return m.state(time.Now()), true
}

func (m *model) state(now time.Time) ModelState {
	st := ModelState{
		Spec:           m.spec,
		Arrived:        m.arrived,
		QueueDepth:     m.q.len(),
		Running:        m.running,
		QueuedRows:     m.queuedRows(),
		LargestRequest: m.largestRequest(now),
		LastActive:     m.added,
		Read:           now,
	}
	if m.lastArrival.After(st.LastActive) {
		st.LastActive = m.lastArrival
	}
	w := m.win.sum(now)
	var settled uint64
	for _, c := range w.outcomes {
		settled += c
	}
	if settled > 0 {
		st.Attainment = float64(w.outcomes[outcomeGood]) / float64(settled)
	}
	st.Settled = settled
	st.ArrivalSCV = m.gaps.scv()
	st.ServiceSCV = m.service.scv()
	return st
}

// moments is an exponentially weighted mean and mean square of a
// positive quantity, enough for its squared coefficient of variation.
type moments struct {
	n        int
	mean, sq float64
}

// momentsWeight is the weight of a new sample: about the last 50 count.
const momentsWeight = 0.02

// minMoments is how many samples scv needs before it answers.
const minMoments = 20

func (v *moments) observe(x float64) {
	if !(x >= 0) || math.IsInf(x, 0) {
		return
	}
	v.n++
	w := max(momentsWeight, 1/float64(v.n)) // a plain average until the EWMA has enough
	v.mean += w * (x - v.mean)
	v.sq += w * (x*x - v.sq)
}

// scv is variance over the squared mean; 0 until minMoments samples.
func (v *moments) scv() float64 {
	if v.n < minMoments || v.mean <= 0 {
		return 0
	}
	return max(v.sq/(v.mean*v.mean)-1, 0)
}
