package control

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/qos"
)

// This file sizes the adaptive policy's memory shares: each model's memory
// share follows the working set of the largest batch it is expected to run
// over the next period, with headroom, within [MemoryFloor, its memory
// limit]; it grows at once, before the batch comes, and shrinks only after
// ScaleDownAfter of smaller targets, never below what the instance holds.
//
// Where every share is a cap (CapsOnly: MPS) a client's pinned memory is
// fixed at its start and an arena cannot grow past it (the batch would
// fail), and a change is a new client that takes seconds to start. There
// the share follows load, as on the CPU, for a model whose instances bound
// their batches by their memory (MemoryBatchBounder: the scheduler forms
// batches within what an instance holds, so a burst after idleness runs in
// smaller batches until the share has grown, and fails none): the working
// set of the largest batch expected next period, and never below the
// largest request of late. What the instance holds now is no floor there:
// a new share is a new client, whose arena starts empty. For other models
// the share follows the working set of the largest batch the model may run
// (max_batch_size), so it grows only when the instance holds more than was
// measured. Either way a shrink rides along with a compute resize (which
// starts a new client anyway) unless it gives back at least half of the
// share: it frees that room for the neighbours and their shadows at the
// cost of one swap.

// WorkingSetPredictor is the part of a Predictor that knows each model's
// memory: the bytes one instance needs to run batches up to a size, false
// when its profile measured none. The adaptive policy moves memory shares
// only when the Predictor implements it (predictor.Predictor does).
type WorkingSetPredictor interface {
	WorkingSet(model string, batch int) (int64, bool)
}

// InstanceMemoryReader is the part of an Actuator that reads what the
// largest instance of a model holds now, in bytes, as its memory limit
// counts it (0 unknown). Without it the adaptive policy leaves memory at
// the model's limit: a share under what an instance holds would have the
// kernel kill it. (The server's per-device actuator once lacked it, and the
// first share asked for was under what the runner held.)
type InstanceMemoryReader interface {
	InstanceMemory(model string) int64
}

// MemoryBatchBounder is the part of an Actuator that says whether a
// model's instances bound their batches by their memory: the scheduler
// forms each batch within what every instance holds now, and refuses a
// request larger than that once it has waited for growth (qos.MemoryBound,
// runtime.BatchCapacity). Where every share is a cap (MPS) the adaptive
// policy sizes such a model's memory from its load; any other model keeps
// the working set of its largest batch, which a smaller share would fail.
type MemoryBatchBounder interface {
	BoundsBatchesByMemory(model string) bool
}

// Defaults of the memory sizing.
const (
	// DefaultMemoryHeadroom is the fraction added to the working set:
	// measured peaks vary between runs and inputs, and a batch a little
	// larger than expected must not find the limit.
	DefaultMemoryHeadroom = 0.25
	// DefaultMemoryFloor is the least memory share the adaptive policy
	// sets: a runner process and its ONNX Runtime session hold this much
	// before any model. An assumption, above the smallest runner measured
	// on the demo models.
	DefaultMemoryFloor = 64 << 20
	// residentMargin is the part (1/residentMargin) added to what an
	// instance holds now before a share may go below it: its next
	// allocation must not be its last.
	residentMargin = 16
	// memoryAlign rounds memory shares up, so that a few pages more or
	// less do not make a new share.
	memoryAlign = 1 << 20
)

// memorySample is one pass's memory target, kept for the hysteresis.
type memorySample struct {
	at     time.Time
	target int64
}

// sizeMemory sets the memory of the adaptive policy's shares in p (not
// pinned ones). Without working sets (WorkingSetPredictor), or without
// reading what instances hold (InstanceMemoryReader), memory stays at the
// model's limit.
func (a *Adjuster) sizeMemory(now time.Time, states []qos.ModelState, p *plan) {
	ws, ok := a.opts.Predictor.(WorkingSetPredictor)
	if !ok {
		return
	}
	reader, ok := a.opts.Actuator.(InstanceMemoryReader)
	if !ok {
		return // a share could go under what an instance holds
	}
	for _, st := range states {
		name := st.Spec.Name
		t := a.models[name]
		if t.pin != nil {
			continue
		}
		d, next := p.ds[name], p.next[name]
		target, need, why, ok := a.memoryTarget(st, next.Compute, d, ws, reader)
		if !ok {
			continue
		}
		if a.opts.CapsOnly && !t.firstMemory() && target > t.applied.Memory && need <= t.applied.Memory &&
			!computeMoves(t, next) && a.boundsBatches(name) {
			// The batch fits the share in effect, within its headroom:
			// growth for the headroom alone would be a new client.
			target, why = t.applied.Memory, ""
		}
		mem, reason := a.settleMemory(now, t, target, why)
		if a.opts.CapsOnly && !shrinkNow(t, next, mem) {
			mem, reason = t.applied.Memory, ""
		}
		next.Memory, d.share.Memory = mem, mem
		d.memTarget, d.memReason = target, reason
		p.next[name], p.ds[name] = next, d
	}
}

// memoryTarget is the memory share a model should have for the next
// period, the working set of the batch it is sized for (without headroom),
// and why; false when its working set is not known or it has no memory
// limit to move within (no memory_limit and no MemoryBudget: it stays
// unlimited).
func (a *Adjuster) memoryTarget(st qos.ModelState, compute float64, d decision, ws WorkingSetPredictor, reader InstanceMemoryReader) (target, need int64, why string, ok bool) {
	spec := st.Spec
	hi := spec.Memory
	if hi == 0 {
		hi = a.opts.MemoryBudget
	}
	if hi <= 0 {
		return 0, 0, "", false
	}
	batch, because := max(spec.MaxBatchSize, 1), "the largest: a client's pinned memory is fixed at its start"
	byLoad := !a.opts.CapsOnly || a.boundsBatches(spec.Name)
	if byLoad {
		batch, because = a.nextBatch(st, compute, d.rate)
	}
	set, ok := ws.WorkingSet(spec.Name, batch)
	if !ok || set <= 0 {
		return 0, 0, "", false
	}
	target = int64(math.Ceil(float64(set) * (1 + a.opts.MemoryHeadroom)))
	why = fmt.Sprintf("batch %d (%s) needs %s + %.0f%%", batch, because, formatBytes(set), 100*a.opts.MemoryHeadroom)
	if reader != nil && !(a.opts.CapsOnly && byLoad) { // there a new share is a new client, its arena empty
		if held := reader.InstanceMemory(spec.Name); held > 0 {
			if floor := held + (held+residentMargin-1)/residentMargin; floor > target {
				target = floor
				why = fmt.Sprintf("%s; the instance holds %s", why, formatBytes(held))
			}
		}
	}
	lo := min(a.opts.MemoryFloor, hi)
	target = min(max(alignUp(target), lo), hi)
	if target == hi {
		why += fmt.Sprintf("; at most the limit %s", formatBytes(hi))
	}
	return target, set, why, true
}

// boundsBatches reports whether the model's instances bound their batches
// by their memory (MemoryBatchBounder).
func (a *Adjuster) boundsBatches(model string) bool {
	b, ok := a.opts.Actuator.(MemoryBatchBounder)
	return ok && b.BoundsBatchesByMemory(model)
}

// shrinkNow reports whether a memory share mem may apply now where every
// change starts a new client (CapsOnly): growth, the first share, and a
// shrink that rides along with a compute resize or gives back at least
// half of the share do; a smaller shrink waits for the next compute resize.
func shrinkNow(t *tracked, next limiter.Share, mem int64) bool {
	cur := t.applied.Memory
	if t.firstMemory() || mem >= cur || computeMoves(t, next) {
		return true
	}
	return mem <= cur/2
}

// computeMoves reports whether next changes the model's compute share (on
// MPS: a new client whatever its memory).
func computeMoves(t *tracked, next limiter.Share) bool {
	return math.Abs(limiter.LimitedOrWhole(next.Compute)-limiter.LimitedOrWhole(t.applied.Compute)) > shareEpsilon
}

// nextBatch is the largest batch the model is expected to run over the
// next period, and why: the rows queued now (one dispatch takes them as
// one batch), the largest request of late (it is one batch at least) or,
// from the forecast, the batch the queue holds at the Quantile when an
// instance frees up, whichever is largest; 1 for an idle model.
//
// Arrivals over one execution of a batch b at the forecast rate are
// taken as Poisson with mean n = rate·t(b)/slots; b is enough when their
// quantile, about n + z·√n + 1, is within it.
func (a *Adjuster) nextBatch(st qos.ModelState, compute, rate float64) (int, string) {
	top := max(st.Spec.MaxBatchSize, 1)
	rows := max(st.QueueDepth, st.QueuedRows)
	queued := min(rows, top)
	why := fmt.Sprintf("%d queued", rows)
	if big := min(st.LargestRequest, top); big > queued {
		queued, why = big, fmt.Sprintf("a request of %d", st.LargestRequest)
	}
	if rate < rateEpsilon {
		if queued > 1 {
			return queued, why
		}
		return 1, "idle"
	}
	share := limiter.LimitedOrWhole(compute)
	z := math.Sqrt2 * math.Erfinv(2*a.opts.Quantile-1)
	slots := float64(max(st.Spec.Slots, 1))
	fromRate := top
	for b := 1; b <= top; b++ {
		t, ok := a.opts.Predictor.Latency(st.Spec.Name, b, share)
		if !ok {
			break // unknown: the largest
		}
		n := rate * t.Seconds() / slots
		if n+z*math.Sqrt(n)+1 <= float64(b) {
			fromRate = b
			break
		}
	}
	if queued > fromRate {
		return queued, why
	}
	return fromRate, fmt.Sprintf("forecast %.1f req/s", rate)
}

// settleMemory turns a memory target into the share to apply: growth at
// once, a shrink only once every target of the last ScaleDownAfter has
// been below the applied share and Cooldown has passed since its last
// change, to the largest of those targets. Changes within memoryBand are
// not made. The first share applies at once.
func (a *Adjuster) settleMemory(now time.Time, t *tracked, target int64, why string) (int64, string) {
	cur := t.applied.Memory
	if t.firstMemory() {
		t.memSlackSince, t.memSlack = time.Time{}, nil
		return target, fmt.Sprintf("memory %s: %s", formatBytes(target), why)
	}
	band := memoryBand(cur)
	if target > cur {
		t.memSlackSince, t.memSlack = time.Time{}, nil
		if target-cur <= band {
			return cur, ""
		}
		return target, fmt.Sprintf("memory %s -> %s: %s", formatBytes(cur), formatBytes(target), why)
	}
	if t.memSlackSince.IsZero() {
		t.memSlackSince = now
	}
	from := now.Add(-a.opts.ScaleDownAfter)
	t.memSlack = append(t.memSlack, memorySample{now, target})
	t.memSlack = slices.DeleteFunc(t.memSlack, func(s memorySample) bool { return s.at.Before(from) })
	if cur-target <= band || t.memSlackSince.After(from) || t.memChange.After(now.Add(-a.opts.Cooldown)) {
		return cur, ""
	}
	to := target
	for _, s := range t.memSlack {
		to = max(to, s.target)
	}
	if cur-to <= band {
		return cur, ""
	}
	return to, fmt.Sprintf("memory %s -> %s after %s under it: %s", formatBytes(cur), formatBytes(to), shortDuration(a.opts.ScaleDownAfter), why)
}

// firstMemory reports whether the model's next memory share is its first
// (nothing applied yet, or no memory share, or a pin just ended): it
// applies at once.
func (t *tracked) firstMemory() bool {
	return !t.hasApplied || t.applied.Memory == 0 || t.fresh
}

// memoryBand is the least change of a memory share worth making: 1/32 of
// it, at least memoryAlign.
func memoryBand(cur int64) int64 { return max(cur/32, memoryAlign) }

// alignUp rounds bytes up to memoryAlign.
func alignUp(n int64) int64 {
	if r := n % memoryAlign; r != 0 {
		return n + memoryAlign - r
	}
	return n
}

// memoryShareSum is what a model counts against the memory budget: what
// it uses, or its planned memory share where the policy sized one from
// its working set and that is more.
func memoryShareSum(p *plan, name string, usage int64) int64 {
	if m := p.next[name].Memory; m > 0 && p.ds[name].memTarget > 0 {
		return max(m, usage)
	}
	return usage
}
