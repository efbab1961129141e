package qos

import (
	"math"
	"slices"
	"time"
)

// tailWindow is how many recent executions the room for error is read
// from: enough for the 98th percentile of runs up to half of it long to
// rest on a few of them.
const tailWindow = 256

// tailRefresh is how many executions pass between two readings of the
// window: reading it on every execution would cost the hot path more than
// the readings change.
const tailRefresh = 32

// tailZ is how many standard deviations of a queue's excess admission
// leaves room for: about the 98th percentile where errors are normal.
// It is the least: outcomes at the margin raise it (tail.learn).
const tailZ = 2

// marginRoom says which admitted requests teach the room (tail.learn): a
// request admitted behind a backlog with a slack of at most marginRoom
// times its room is at the margin, where an overloaded queue sits.
// Requests with more slack than that (a closed loop's queue after a
// stall: its late requests come together, after one stall that was
// already in the window) would teach it the wrong lesson: learning from
// every request admitted behind a backlog raised the refusals of
// TestNoisyHostAdmissionBound's closed loop from 5,956 to 8,631, with a
// margin of 1.5 to 7,406, of 1.2 to 6,723, of 1.1 to 5,959.
const marginRoom = 1.1

// marginLateAim is the share of the requests admitted at the margin the
// room aims to leave late or dropped, and zStep how far one of their
// outcomes moves its deviations: a late one up by zStep*(1-aim), one on
// time down by zStep*aim, so that they settle where aim of them are late.
const (
	marginLateAim = 0.005
	zStep         = 0.05
)

// maxTailZ bounds the deviations the outcomes can raise the room to.
const maxTailZ = 6

// relaxAdmissions is how many admissions away from the margin (a request
// with slack to spare, or none queued ahead) take the deviations learned
// at the margin back towards tailZ by a factor e: overload the
// deviations were learned in has passed when requests stop queueing at
// the margin. A request that finds the model idle (nothing ahead, a slot
// free) forgets them at once: no queue is overloaded that empties.
const relaxAdmissions = 256

// stallQuantile is the quantile of one execution's excess read as one
// stall.
const stallQuantile = 0.95

// maxTailSlots bounds the slots the window grows for (tail.setSlots):
// past it the window of a model of many instances would cost the hot
// path more than its readings gain.
const maxTailSlots = 8

// minTail is how many executions the room needs: with fewer, a few
// stalls in the first executions would decide it.
const minTail = 50

// coldRoom is the room admission leaves behind a backlog, as a share of
// the plan, before minTail executions a slot were seen (tail.shared): a
// prior that the plan's error is normal with a standard deviation of
// coldRoom/tailZ of the plan. Admitted on the mean meanwhile, a model's
// first executions behind a backlog were the largest single cause of
// admitted-then-late under overload in the scheduler's simulations
// (TestAdmissionRiskCalibration). With the whole plan as room, a fresh
// model's burst at 4x its capacity had 5.9% (two slots) and 7.4% (one)
// of its admitted late instead of 33% and 31%, with more answers on time
// (TestColdWindowRoom); 3 s at 4x, 3.1% and 4.9% instead of 4.6% and
// 6.3%; the closed loop, whose first executions never queue past half
// the SLO, saw no change.
const coldRoom = 1.0

// tail keeps the recent executions' predicted and observed times, in
// the order they ran, and reads from them the room a queue needs for
// their error, in time.
//
// A queue's error is the excess over the predictions of the executions
// it holds, one after another, in seconds. Counted in time, not as a
// ratio per execution: on a busy host an execution's error is mostly a
// stall (the runner descheduled for a few milliseconds while other work
// has the core), and a stall delays the whole queue behind it once, not
// once per execution. A ratio per execution (its 95th percentile, over
// sqrt(n)) charged a queue a share of every execution's tail: sixteen
// requests of about a millisecond queued on a busy host (95th percentile
// ratios of 5 to 50) were held at the 3x cap and refused against a 40 ms
// SLO although they finished in a third of it (issue 33).
//
// The room for a queue predicted to take P seconds is the larger of two
// readings of the window:
//   - runs: the excess of the window's runs of consecutive executions
//     predicted to take P, per second predicted, its mean plus z
//     standard deviations (tailZ, and what outcomes at the margin
//     added: learn); read for spans of one mean execution, two,
//     four, ... up to half the window, interpolated between them in log
//     time, and past them shrinking towards the drift as 1/sqrt(P). Runs
//     count stalls as they came: once per turn where the host stalls the
//     runner in turns, as often as they fell together where executions
//     stall independently.
//   - one stall: the drift (the window's excess per second predicted)
//     times P, plus one stall (the stallQuantile of one execution's
//     excess over the drift) and one standard deviation of the excess of
//     P seconds of independent executions (sqrt(spread*P), spread the
//     variance of the excess per second predicted), at most z such
//     deviations. Overlapping runs of a window of 256 see a long queue's
//     spread less often than it comes: under overload on a busy host the
//     runs alone left 2.2% of the admitted late or dropped
//     (TestBusyHostOverloadAdmittedOnTime), this reading 0.4%.
//
// On a model of c slots the room for a plan of P is the room of the c*P
// of executions it holds, over c (shared), read from a window of
// tailWindow executions a slot (setSlots): see shared for why.
//
// The room is at most (maxTailRatio-1) times P, the drift too: on a
// machine busier than its burners the predictions swing with the
// runner's share, executions were measured at 6x the predictions at
// their start while the queues admission predicted higher finished in
// half the SLO, and an uncapped drift refused them. The window is read
// again every tailRefresh executions.
type tail struct {
	pred, took []float64 // seconds, a ring of tailWindow per slot (setSlots)
	slots      int       // the slots the window is sized for; 0 is 1
	n          int       // executions seen, up to the window
	next       int       // where the next one goes
	pending    int       // executions since the last refresh
	// At the last refresh (see tail): drift, spread and stall; spans,
	// run lengths in predicted seconds (doubling), and runMean and runSD,
	// the mean and the standard deviation of the excess per second
	// predicted of the window's runs that long (runsAt). Empty before
	// minTail executions.
	drift, spread, stall  float64
	spans, runMean, runSD []float64
	// learnedZ is what the outcomes at the margin added to tailZ (learn),
	// in standard deviations: the room leaves tailZ+learnedZ.
	learnedZ   float64
	cumP, cumE []float64 // scratch: prefix sums in time order
	scratch    []float64
}

// setSlots sizes the window for a model of c slots (at most
// maxTailSlots): tailWindow executions a slot, read every tailRefresh
// executions a slot, keeping the most recent executions. On c slots
// the executions come c times as fast and a queue holds c times as many
// (see shared): a window of tailWindow held half as many stalls of a
// two-instance model's host per queue read as of a single instance's,
// and the room swung with how many the window happened to hold.
func (t *tail) setSlots(c int) {
	c = min(max(c, 1), maxTailSlots)
	if c == max(t.slots, 1) && t.pred != nil {
		return
	}
	size := c * tailWindow
	pred, took := make([]float64, size), make([]float64, size)
	n := min(t.n, size)
	for k := range n { // the oldest kept first
		i := (t.next - n + k + 2*len(t.pred)) % max(len(t.pred), 1)
		pred[k], took[k] = t.pred[i], t.took[i]
	}
	t.pred, t.took, t.slots, t.n, t.next = pred, took, c, n, n%size
}

// observe adds one execution: its predicted and its observed time, in
// seconds.
func (t *tail) observe(predicted, took float64) {
	if !(predicted > 0) || !(took >= 0) || math.IsInf(predicted, 0) || math.IsInf(took, 0) {
		return
	}
	if t.pred == nil {
		t.setSlots(1)
	}
	size := len(t.pred)
	t.pred[t.next], t.took[t.next] = predicted, took
	t.next = (t.next + 1) % size
	t.n = min(t.n+1, size)
	t.pending++
	c := max(t.slots, 1)
	if t.n < minTail*c {
		return
	}
	if t.n == minTail*c || t.pending >= tailRefresh*c {
		t.refresh()
	}
}

// refresh reads drift, spread, stall and the runs from the window, with
// prefix sums and selection: a few thousand steps every tailRefresh
// executions.
func (t *tail) refresh() {
	t.pending = 0
	n, size := t.n, len(t.pred)
	first := (t.next - n + size) % size // the oldest
	t.cumP, t.cumE = append(t.cumP[:0], 0), append(t.cumE[:0], 0)
	for k := range n {
		i := (first + k) % size
		t.cumP = append(t.cumP, t.cumP[k]+t.pred[i])
		t.cumE = append(t.cumE, t.cumE[k]+t.took[i]-t.pred[i])
	}
	t.drift = t.cumE[n] / t.cumP[n]
	t.scratch = t.scratch[:0]
	var v float64
	for k := range n {
		i := (first + k) % size
		d := t.took[i] - t.pred[i]*(1+t.drift)
		v += d * d
		t.scratch = append(t.scratch, d)
	}
	t.spread = v / t.cumP[n]
	t.stall = max(selectNth(t.scratch, rankIndex(n, stallQuantile)), 0)
	t.spans, t.runMean, t.runSD = t.spans[:0], t.runMean[:0], t.runSD[:0]
	for span := t.cumP[n] / float64(n); ; span *= 2 {
		t.scratch = t.scratch[:0]
		j := 0
		for i := range n {
			// The shortest run from i predicted to take span.
			for j = max(j, i+1); j <= n && t.cumP[j]-t.cumP[i] < span*(1-1e-9); j++ {
			}
			if j > n {
				break
			}
			t.scratch = append(t.scratch, (t.cumE[j]-t.cumE[i])/(t.cumP[j]-t.cumP[i]))
		}
		if len(t.scratch) < n/2 {
			break
		}
		var sum, sq float64
		for _, x := range t.scratch {
			sum += x
		}
		mean := sum / float64(len(t.scratch))
		for _, x := range t.scratch {
			sq += (x - mean) * (x - mean)
		}
		t.spans = append(t.spans, span)
		t.runMean, t.runSD = append(t.runMean, mean), append(t.runSD, math.Sqrt(sq/float64(len(t.scratch))))
	}
}

// room is the time to leave for the error of a queue predicted to take
// queue (see tail); 0 until minTail executions were seen, and never below
// 0.
func (t *tail) room(queue time.Duration) time.Duration {
	if len(t.spans) == 0 || queue <= 0 {
		return 0
	}
	p := queue.Seconds()
	mean, runSD := t.runsAt(p)
	sd := math.Sqrt(t.spread * p)
	z := t.z()
	room := max((mean+z*runSD)*p, t.drift*p+min(z*sd, t.stall+sd))
	room = min(room, (maxTailRatio-1)*p)
	return time.Duration(max(room, 0) * float64(time.Second))
}

// warm reports whether the room is read from the window (minTail
// executions seen), not from the cold prior.
func (t *tail) warm() bool { return len(t.spans) > 0 }

// z is how many standard deviations the room leaves: tailZ and what the
// outcomes at the margin added.
func (t *tail) z() float64 { return tailZ + t.learnedZ }

// atMargin reports whether a request admitted behind a backlog with
// slack past its plan and room for error is at the margin (marginRoom),
// with the room read from the window: the requests whose outcomes teach
// the room (learn).
func (t *tail) atMargin(slack, room time.Duration) bool {
	return t.warm() && room > 0 && float64(slack) <= marginRoom*float64(room)
}

// learn moves the room's deviations by the outcome of a request admitted
// at the margin, late (or dropped) or on time, so that marginLateAim of
// them are late: the window's normal reading of a queue's error is short
// where a host's stalls are rarer and longer than a normal tail (in the
// scheduler's simulations of a noisy host at 4x its capacity, requests
// read at about 2% were late 3.1% of the time on two slots, 4.9% on one;
// TestNoisyHostOverloadRefused). The deviations stay within tailZ and
// maxTailZ.
func (t *tail) learn(late bool) {
	if late {
		t.learnedZ += zStep * (1 - marginLateAim)
	} else {
		t.learnedZ -= zStep * marginLateAim
	}
	t.learnedZ = min(max(t.learnedZ, 0), maxTailZ-tailZ)
}

// relax takes the learned deviations towards tailZ for an admission away
// from the margin (relaxAdmissions).
func (t *tail) relax() { t.learnedZ *= 1 - 1.0/relaxAdmissions }

// forget drops the learned deviations: a request found the model idle.
func (t *tail) forget() { t.learnedZ = 0 }

// risk is the chance that a plan of queue (wall time), holding work of
// the model's predicted executions spread over its slots (as shared
// reads them), ends more than slack after its prediction, as the room's
// readings tell it: the room is what they leave for the error at t.z()
// standard deviations, and risk is the normal tail at the deviations z
// where the room for z first reaches slack. The runs' reading reaches
// it where their mean plus z deviations, per second predicted, times the
// work, reaches slack scaled to the work (as shared scales the room);
// the one-stall reading where the drift and z deviations of independent
// errors do, if one stall and one deviation reach it at all. So a plan
// whose room is exactly its slack has a risk of about 2.3% while the
// room is at tailZ (2) deviations, normalTail(t.z()) once outcomes at the
// margin raised them: admission refuses at that risk. The reading is the
// window's, under a normal tail; learn corrects the room, not it.
//
// Until minTail executions were seen it is the cold prior's (coldRoom):
// the normal tail at tailZ times slack over the prior's room. It is 0
// where slack is at least the most room admission ever leaves
// ((maxTailRatio-1) times the plan); 1 where slack is negative. Like
// the room it is read from the window as it is: a window that holds a
// stall of one execution in a hundred a few times reads its chance only
// roughly.
func (t *tail) risk(queue, work, slack time.Duration) float64 {
	if slack < 0 {
		return 1
	}
	if queue <= 0 || slack >= (maxTailRatio-1)*queue {
		return 0
	}
	if len(t.spans) == 0 { // the prior's room is at tailZ deviations
		return normalTail(tailZ * slack.Seconds() / t.shared(queue, work).Seconds())
	}
	w := max(work, queue).Seconds()
	s := slack.Seconds() * w / queue.Seconds() // slack, scaled to the work
	mean, sd := t.runsAt(w)
	z := deviations(s/w-mean, sd)
	// One stall: drift*w + min(z*sdi, stall+sdi) reaches s where z*sdi
	// does, if stall+sdi does.
	if sdi, left := math.Sqrt(t.spread*w), s-t.drift*w; left <= t.stall+sdi {
		z = min(z, deviations(left, sdi))
	}
	return normalTail(z)
}

// normalTail is the chance that a standard normal variable is above z.
func normalTail(z float64) float64 { return 0.5 * math.Erfc(z/math.Sqrt2) }

// deviations is how many standard deviations sd a distance d is: +Inf
// where d is beyond a spread of none, -Inf where d is none or less.
func deviations(d, sd float64) float64 {
	switch {
	case d <= 0 && sd == 0:
		return math.Inf(-1)
	case sd == 0:
		return math.Inf(1)
	}
	return d / sd
}

// runsAt is the mean and the standard deviation of the excess per second
// predicted of runs of p seconds predicted, as room reads the runs:
// interpolated between the spans in log time, and past the longest
// shrinking towards the drift as 1/sqrt(p).
func (t *tail) runsAt(p float64) (mean, sd float64) {
	last := len(t.spans) - 1
	switch i, _ := slices.BinarySearch(t.spans, p); {
	case i == 0:
		return t.runMean[0], t.runSD[0]
	case i > last:
		f := math.Sqrt(t.spans[last] / p)
		return t.drift + (t.runMean[last]-t.drift)*f, t.runSD[last] * f
	default:
		w := math.Log(p/t.spans[i-1]) / math.Log(t.spans[i]/t.spans[i-1])
		return t.runMean[i-1] + w*(t.runMean[i]-t.runMean[i-1]), t.runSD[i-1] + w*(t.runSD[i]-t.runSD[i-1])
	}
}

// shared is the room for a plan of queue (wall time) that holds work of
// the model's predicted executions spread over its slots: on c slots a
// queue planned at P holds about c*P of them (work >= queue; on one slot
// the two are equal and shared is room). A queue drains on every slot at
// once and each takes the next execution when it frees, so the work's
// error delays the plan by about its share: room(work) times queue/work.
// A stall on one slot holds that slot's execution while the others serve
// the queue, and delays the plan by its share, a c-th; a stall of the host
// that holds every slot at once comes c times into the work's runs and
// delays the plan by itself, as it should.
//
// Before minTail executions were seen it is the cold prior's room,
// coldRoom times the plan. Only admission asks for shared: a batch grows
// by room, which is 0 meanwhile, since its head runs anyway and a batch
// held small by a prior would cost the throughput the burst needs.
func (t *tail) shared(queue, work time.Duration) time.Duration {
	if len(t.spans) == 0 && queue > 0 {
		return time.Duration(coldRoom * float64(queue))
	}
	if work <= queue || queue <= 0 {
		return t.room(queue)
	}
	return time.Duration(float64(t.room(work)) * queue.Seconds() / work.Seconds())
}

// rankIndex is the index of quantile q among n sorted values: the
// ceil(q*n)-th smallest (nearest rank).
func rankIndex(n int, q float64) int {
	return min(max(int(math.Ceil(q*float64(n)))-1, 0), n-1)
}

// selectNth reorders xs so that xs[k] is the value a sort would put there,
// with no larger value before it and no smaller one after, and returns
// it (Hoare's selection, the middle element as pivot).
func selectNth(xs []float64, k int) float64 {
	lo, hi := 0, len(xs)-1
	for lo < hi {
		pivot := xs[lo+(hi-lo)/2]
		i, j := lo, hi
		for i <= j {
			for xs[i] < pivot {
				i++
			}
			for xs[j] > pivot {
				j--
			}
			if i <= j {
				xs[i], xs[j] = xs[j], xs[i]
				i++
				j--
			}
		}
		switch {
		case k <= j:
			hi = j
		case k >= i:
			lo = i
		default:
			return xs[k]
		}
	}
	return xs[k]
}
