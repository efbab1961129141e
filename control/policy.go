package control

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/qos"
)

// rateEpsilon is the forecast rate, in requests per second, below which a
// model counts as having no traffic.
const rateEpsilon = 1e-6

// decideAdaptive is the adaptive policy: pins first, then the
// latency-critical models' targets (scaled down when they do not fit), then
// the best-effort models split what the latency-critical models hold after
// the hysteresis.
func (a *Adjuster) decideAdaptive(now time.Time, states []qos.ModelState, p *plan) {
	rank := ranker(states)
	available := a.opts.Capacity
	var lcs, bes []qos.ModelState
	for _, st := range states {
		name := st.Spec.Name
		if t := a.models[name]; t.pin != nil {
			d := pinDecision(t)
			d.rate = a.forecast(name)
			a.settle(now, name, d, p)
			available -= limitedCompute(t.pin.Compute)
			continue
		}
		if st.Spec.Class == qos.ClassLatencyCritical {
			lcs = append(lcs, st)
		} else {
			bes = append(bes, st)
		}
	}
	available = max(available, 0)
	// The best-effort minimums are kept out of the latency-critical
	// models' reach, so that the shares do not oversubscribe the device.
	var floors float64
	for _, st := range bes {
		lo, _ := a.bounds(st.Spec)
		floors += lo
	}

	ds := make(map[string]decision, len(lcs))
	var demand float64
	for _, st := range lcs {
		d := a.latencyCritical(st)
		if a.opts.CapsOnly {
			a.holdTarget(now, st.Spec.Name, &d)
		}
		d.rank = rank(st.Spec.Priority)
		ds[st.Spec.Name] = d
		demand += d.share.Compute
	}
	// Where every share is a cap (CapsOnly) the latency-critical caps are
	// not scaled to fit the device: a cap is a ceiling, a model's kernels
	// take no more than they can use, and MPS splits oversubscribed SMs
	// among the clients running at once, so caps past the device cost
	// only while the models' large batches run together, and scaled caps
	// would cost on every batch. (On the GPU day in simulated time, 10
	// seeds: LC attainment 96.2% unscaled, 93.8% scaled; best-effort
	// throughput 6.7 against 8.7 requests/s.)
	if lcAvailable := max(available-floors, 0); !a.opts.CapsOnly && demand > lcAvailable+shareEpsilon {
		a.fitCapacity(lcs, ds, demand, lcAvailable)
	}
	// A floor is a weight, not a partition: what the latency-critical
	// models keep from the best-effort caps is what they are expected to
	// use with a burst margin (all of the floor while they miss their
	// SLO); they take the rest of their floor back from the background
	// at once when a burst needs it.
	held := available
	for _, st := range lcs {
		name := st.Spec.Name
		a.settle(now, name, ds[name], p)
		if a.opts.CapsOnly {
			// A cap the hysteresis holds is still a cap: what the
			// model may use until it shrinks.
			held -= min(limiter.LimitedOrWhole(p.next[name].Compute), p.ds[name].reserve)
			continue
		}
		held -= min(p.next[name].Compute, p.ds[name].reserve)
	}
	if a.opts.CapsOnly && a.opts.Background {
		for name, d := range a.fill(bes, rank) {
			a.settle(now, name, d, p)
		}
		return
	}
	for name, d := range a.bestEffort(bes, max(held, 0), rank) {
		a.settle(now, name, d, p)
	}
}

// fill is the best-effort shares where every share is a cap and a
// best-effort share is a background one (CapsOnly and Background: MPS
// clients below normal priority): priority, not partitions. A busy model
// gets its largest share, so that its kernels fill whatever SMs the
// latency-critical clients leave, and gives them back as its running
// blocks end; an idle one its minimum. Its cap then changes only when it
// goes idle or busy, and every change is a new MPS client.
func (a *Adjuster) fill(bes []qos.ModelState, rank func(int) int) map[string]decision {
	ds := make(map[string]decision, len(bes))
	for _, st := range bes {
		lo, hi := a.bounds(st.Spec)
		d := decision{
			source: SharePolicyAdaptive, class: st.Spec.Class, rank: rank(st.Spec.Priority),
			rate: a.forecast(st.Spec.Name), share: limiter.Share{Memory: st.Spec.Memory, Mode: limiter.ModeBackground},
		}
		if d.rate < rateEpsilon && st.QueueDepth == 0 && st.Running == 0 {
			d.share.Compute = lo
			d.reason = fmt.Sprintf("best-effort, idle: minimum share %.2f", lo)
		} else {
			d.share.Compute = hi
			d.reason = fmt.Sprintf("best-effort below normal priority: cap %.2f, filling what the latency-critical clients leave", hi)
		}
		if p, ok := a.predict(st, d.rate, d.share.Compute); ok {
			d.predicted = p.latency
		}
		ds[st.Spec.Name] = d
	}
	return ds
}

// decideStatic gives every model an equal share of the capacity, and of
// the memory budget when there is one.
func (a *Adjuster) decideStatic(now time.Time, states []qos.ModelState, p *plan) {
	n := len(states)
	for _, st := range states {
		t := a.models[st.Spec.Name]
		if t.pin != nil {
			a.settle(now, st.Spec.Name, pinDecision(t), p)
			continue
		}
		share := limiter.Share{Compute: floorShare(a.opts.Capacity / float64(n)), Memory: st.Spec.Memory}
		if a.opts.MemoryBudget > 0 {
			share.Memory = a.opts.MemoryBudget / int64(n)
		}
		a.settle(now, st.Spec.Name, decision{
			share: share, source: SharePolicyStatic, exact: true, class: st.Spec.Class,
			reason: fmt.Sprintf("static: %.2f of the device split among %d models", a.opts.Capacity, n),
		}, p)
	}
}

// decideShared sets no limits.
func (a *Adjuster) decideShared(now time.Time, states []qos.ModelState, p *plan) {
	for _, st := range states {
		t := a.models[st.Spec.Name]
		if t.pin != nil {
			a.settle(now, st.Spec.Name, pinDecision(t), p)
			continue
		}
		a.settle(now, st.Spec.Name, decision{source: SharePolicyShared, exact: true, class: st.Spec.Class, reason: "shared: no limits"}, p)
	}
}

func pinDecision(t *tracked) decision {
	reason := "pinned by operator"
	if t.pinSource == SourceConfig {
		reason = "pinned in config"
	}
	return decision{share: *t.pin, source: t.pinSource, exact: true, reason: reason}
}

// ranker returns the priority rank of a priority: itself from 1 up, and
// for 0 one past the lowest priority on the device.
func ranker(states []qos.ModelState) func(priority int) int {
	lowest := 1
	for _, st := range states {
		lowest = max(lowest, st.Spec.Priority+1)
	}
	return func(p int) int {
		if p > 0 {
			return p
		}
		return lowest
	}
}

// bounds are the compute shares the adaptive policy may give a model.
func (a *Adjuster) bounds(spec qos.ModelSpec) (lo, hi float64) {
	hi = spec.MaxShare
	if hi == 0 {
		hi = 1
	}
	hi = min(hi, a.opts.Capacity)
	lo = min(max(a.opts.MinShare, spec.MinShare), hi)
	return lo, hi
}

// forecastAhead is the arrival rate expected one actuation lag ahead: a
// share decided now is in force from the next pass until the one after,
// so a latency-critical model is sized for the rate two periods out and
// grows ahead of a rise instead of after it.
//
// Where every share is a cap (CapsOnly) a resize is a new MPS client, which
// costs a context, a weight copy and a warm-up: the share is sized for the
// peak of the rate over the time a share is kept at least (ScaleDownAfter:
// no shrink comes sooner), so that a rising rate is met by one resize
// instead of one a pass.
func (a *Adjuster) forecastAhead(name string) float64 {
	r := a.opts.Predictor.ForecastRate(name, 2*a.opts.Period)
	if a.opts.CapsOnly {
		if far := a.opts.Predictor.ForecastRate(name, max(a.opts.ScaleDownAfter, 2*a.opts.Period)); far > r {
			r = far
		}
	}
	if !(r > 0) || math.IsInf(r, 0) {
		return 0
	}
	return r
}

// forecast is the model's expected arrival rate over the next period.
func (a *Adjuster) forecast(name string) float64 {
	r := a.opts.Predictor.ForecastRate(name, a.opts.Period)
	if !(r > 0) || math.IsInf(r, 0) { // NaN, negative or absurd
		return 0
	}
	return r
}

// latencyCritical chooses a latency-critical model's target: the smallest
// share on the Step grid predicted to meet its SLO with headroom at the
// target quantile at the forecast rate, as a floor (ModeFloor: the model
// takes idle compute beyond it at once). While the observed attainment is
// below the quantile the floor grows a step a cooldown whatever the
// prediction says.
func (a *Adjuster) latencyCritical(st qos.ModelState) (d decision) {
	spec := st.Spec
	lo, hi := a.bounds(spec)
	rate := a.forecastAhead(spec.Name)
	d = decision{source: SharePolicyAdaptive, class: spec.Class, rate: rate, share: limiter.Share{Memory: spec.Memory, Mode: a.latencyCriticalMode()}}
	if rate < rateEpsilon && st.QueueDepth == 0 && st.Running == 0 {
		d.share.Compute, d.reserve = lo, lo
		d.reason = fmt.Sprintf("no traffic: minimum share %.2f", lo)
		return d
	}
	defer func() { d.reserve = a.reserve(st, d, rate, lo) }()
	goal := fmt.Sprintf("meet %s at p%s", spec.SLO, quantileName(a.opts.Quantile))
	if spec.SLO == 0 {
		goal = fmt.Sprintf("stay under %.2f utilisation", a.opts.MaxUtilization)
	}
	chosen := false
	step := a.opts.Step
	for k := math.Ceil(lo/step - shareEpsilon); ; k++ {
		share := roundShare(k * step)
		if share > hi+shareEpsilon {
			break
		}
		p, known := a.predict(st, rate, share)
		if !known {
			return a.keep(spec.Name, d, hi)
		}
		if p.meets {
			d.share.Compute, d.predicted = share, p.latency
			d.reason = fmt.Sprintf("forecast %.1f req/s needs %.2f to %s (predicted %s at batch %d)", rate, share, goal, millis(p.latency), p.batch)
			chosen = true
			break
		}
	}
	if !chosen {
		p, known := a.predict(st, rate, hi)
		if !known {
			return a.keep(spec.Name, d, hi)
		}
		d.share.Compute, d.predicted = hi, p.latency
		if p.batch > 0 {
			d.reason = fmt.Sprintf("forecast %.1f req/s: cannot %s even at the maximum share %.2f (predicted %s at batch %d)", rate, goal, hi, millis(p.latency), p.batch)
			pick := a.saturating
			if a.opts.CapsOnly {
				pick = a.knee
			}
			if s, q := pick(st, rate, lo, hi, p); s < hi-shareEpsilon {
				d.share.Compute, d.predicted = s, q.latency
				d.reason = fmt.Sprintf("forecast %.1f req/s: cannot %s at any share; %.2f is as fast as the maximum %.2f (predicted %s at batch %d)", rate, goal, s, hi, millis(q.latency), q.batch)
			}
		} else {
			d.reason = fmt.Sprintf("forecast %.1f req/s: cannot %s even at the maximum share %.2f (utilisation over %.2f at every batch size)", rate, goal, hi, a.opts.MaxUtilization)
		}
	}
	a.overrule(st, &d, rate, hi)
	return d
}

// saturationTolerance: a share predicted within this fraction of the
// latency at the maximum share is as good as the maximum.
const saturationTolerance = 0.01

// saturating is the smallest share on the Step grid predicted to be as
// fast as the maximum (within saturationTolerance), and its prediction:
// where no share meets the SLO, a share past the model's knee (the
// predictor clamps there) would only take compute from the others.
func (a *Adjuster) saturating(st qos.ModelState, rate, lo, hi float64, atHi prediction) (float64, prediction) {
	step := a.opts.Step
	for k := math.Ceil(lo/step - shareEpsilon); ; k++ {
		share := roundShare(k * step)
		if share > hi-shareEpsilon {
			break
		}
		if p, ok := a.predict(st, rate, share); ok && p.batch > 0 && float64(p.latency) <= float64(atHi.latency)*(1+saturationTolerance) {
			return share, p
		}
	}
	return hi, atHi
}

// capsOnlyTargetWindow is how many ScaleDownAfter a latency-critical
// target is held for where every share is a cap (CapsOnly).
const capsOnlyTargetWindow = 3

// holdTarget replaces a latency-critical target, where every share is a
// cap (CapsOnly), by the largest target of the last capsOnlyTargetWindow
// ScaleDownAfter. The targets move with the forecast and the queueing
// model's choice of batch size, from pass to pass; fitting the device's
// capacity to them moved every model on the device with each one (one
// model's growth is the others' shrink), and on MPS each move is a new
// client: 470 of them in six minutes on the GPU day. Held, the targets
// change when the day's load does.
func (a *Adjuster) holdTarget(now time.Time, name string, d *decision) {
	t := a.models[name]
	if t == nil {
		return
	}
	from := now.Add(-capsOnlyTargetWindow * a.opts.ScaleDownAfter)
	t.targets = slices.DeleteFunc(t.targets, func(s slackSample) bool { return s.at.Before(from) })
	t.targets = append(t.targets, slackSample{now, d.share.Compute})
	if held := maxTarget(t.targets); held > d.share.Compute+shareEpsilon {
		d.reason = fmt.Sprintf("target %.2f, the largest of the last %s; %s", held, shortDuration(capsOnlyTargetWindow*a.opts.ScaleDownAfter), d.reason)
		d.share.Compute = held
	}
}

// knee is, where every share is a cap (CapsOnly), the saturating share of
// a model that cannot meet its SLO: the smallest share on the Step grid at
// which a batch of the model's largest size runs as fast as at the
// maximum, whatever the rate. saturating's answer follows the batch size
// the queueing model prefers at the forecast rate, which flips between
// sizes (and their knees) as the forecast moves, and on MPS every flip is
// a new client; dynamic batching runs the largest batches in the bursts
// that make a model miss, so their knee is the share it can use.
func (a *Adjuster) knee(st qos.ModelState, rate, lo, hi float64, atHi prediction) (float64, prediction) {
	share, ok := a.kneeAt(st.Spec.Name, max(st.Spec.MaxBatchSize, 1), lo, hi)
	if !ok {
		return a.saturating(st, rate, lo, hi, atHi)
	}
	if share >= hi-shareEpsilon {
		return hi, atHi
	}
	p, _ := a.predict(st, rate, share)
	return share, p
}

// kneeAt is the smallest share on the Step grid in [lo, hi] at which a
// batch of b runs as fast as at hi (within saturationTolerance); false
// when the predictor does not know the model.
func (a *Adjuster) kneeAt(name string, b int, lo, hi float64) (float64, bool) {
	top, ok := a.opts.Predictor.Latency(name, b, hi)
	if !ok {
		return hi, false
	}
	step := a.opts.Step
	for k := math.Ceil(lo/step - shareEpsilon); ; k++ {
		share := roundShare(k * step)
		if share > hi-shareEpsilon {
			break
		}
		if t, ok := a.opts.Predictor.Latency(name, b, share); ok && float64(t) <= float64(top)*(1+saturationTolerance) {
			return share, true
		}
	}
	return hi, true
}

// latencyCriticalMode is a floor, or a cap where the limiter has no floors
// (CapsOnly).
func (a *Adjuster) latencyCriticalMode() limiter.Mode {
	if a.opts.CapsOnly {
		return limiter.ModeCap
	}
	return limiter.ModeFloor
}

// reserveMargin is how many times its expected busy fraction a
// latency-critical model keeps from the best-effort caps.
const reserveMargin = 2

// reserve is the part of a latency-critical floor kept from the
// best-effort caps: reserveMargin times the fraction of the device the
// model keeps busy, as telemetry measured it (Usage) or, unknown, as
// predicted at its forecast rate running at full speed (as a floor does
// while the background yields); at least its minimum, at most the floor;
// the whole floor while observed misses overrule the prediction or
// nothing is known.
//
// Where every share is a cap (CapsOnly, MPS) what is kept is the SMs a
// single request's kernels can use: the knee at batch 1, at most the cap.
// An MPS client's kernels take no more of the device than they can use,
// so a cap above that knee is idle until a burst runs larger batches;
// then the caps oversubscribe the device, MPS splits the SMs in
// proportion to what each client's kernels ask for, and the burst runs
// somewhat slower. Keeping whole caps instead left the GPU day's batch
// jobs 0.05 of a device (3 requests/s against static's 19) for no
// latency-critical attainment we could measure.
func (a *Adjuster) reserve(st qos.ModelState, d decision, rate, lo float64) float64 {
	t := a.models[st.Spec.Name]
	if a.opts.CapsOnly {
		_, hi := a.bounds(st.Spec)
		if knee, ok := a.kneeAt(st.Spec.Name, 1, lo, hi); ok {
			return knee // the cap bounds it where it is used
		}
		return d.share.Compute
	}
	if t != nil && t.boost > 0 {
		return d.share.Compute
	}
	busy, known := 0.0, false
	if a.opts.Usage != nil {
		busy, known = a.opts.Usage(st.Spec.Name)
	}
	if !known {
		p, ok := a.predict(st, rate, 1)
		if !ok || p.batch == 0 {
			return d.share.Compute
		}
		full, _ := a.opts.Predictor.Latency(st.Spec.Name, p.batch, 1)
		busy = rate * full.Seconds() / float64(p.batch)
	}
	return min(d.share.Compute, max(reserveMargin*busy, lo))
}

// minSettled is how many requests the window must have settled before the
// observed attainment overrules the prediction.
const minSettled = 20

// significantMiss reports whether n settled requests with attainment att
// missed more than a model meeting quantile q would by chance: more than
// n(1-q) plus two binomial standard deviations plus one. At q = 0.99 that
// is attainment under 96% of 100 requests, 94% of 50; a window of a few
// unlucky requests does not take the background work's compute away.
func significantMiss(n uint64, att, q float64) bool {
	if n < minSettled {
		return false
	}
	fn := float64(n)
	misses := fn * (1 - att)
	return misses > fn*(1-q)+2*math.Sqrt(fn*q*(1-q))+1
}

// overrule grows a latency-critical floor past the prediction while the
// model's observed attainment is below the quantile: by a step above the
// largest of the applied floor, the prediction and the boost of the last
// pass, at most one step a cooldown. The boost stays until attainment is back, and then
// leaves through the usual hysteresis.
//
// Where every share is a cap (CapsOnly) the boost stops where the model
// stops getting faster (the predictor's knee): SMs past it would sit idle
// in the model's cap while the best-effort models lose them.
func (a *Adjuster) overrule(st qos.ModelState, d *decision, rate, hi float64) {
	t := a.models[st.Spec.Name]
	if t == nil {
		return
	}
	if !significantMiss(st.Settled, st.Attainment, a.opts.Quantile) {
		t.boost = 0
		return
	}
	base := max(t.boost, d.share.Compute) // nothing applied yet: above the prediction
	if t.hasApplied && t.applied.Mode == limiter.ModeFloor {
		base = max(base, limiter.LimitedOrWhole(t.applied.Compute))
	}
	if t.boost == 0 || !t.boostAt.After(st.Read.Add(-a.opts.Cooldown)) {
		if next := min(roundShare(base+a.opts.Step), hi); next > t.boost && a.faster(st, rate, next, base) {
			t.boost, t.boostAt = next, st.Read
		}
	}
	if t.boost > d.share.Compute+shareEpsilon {
		d.reason = fmt.Sprintf("observed attainment %.1f%% is under %s%%: floor %.2f over the predicted %.2f; %s",
			100*st.Attainment, quantileName(a.opts.Quantile), t.boost, d.share.Compute, d.reason)
		d.share.Compute = t.boost
	}
}

// faster reports whether a share is predicted to run the model faster
// than a smaller one; always true unless every share is a cap (CapsOnly),
// where a share past the model's knee is predicted no faster.
func (a *Adjuster) faster(st qos.ModelState, rate, share, than float64) bool {
	if !a.opts.CapsOnly {
		return true
	}
	p, ok1 := a.predict(st, rate, share)
	q, ok2 := a.predict(st, rate, than)
	if !ok1 || !ok2 || p.batch == 0 || q.batch == 0 {
		return true // over the utilisation bound, or unknown: let observation decide
	}
	return float64(p.latency) < float64(q.latency)*(1-saturationTolerance)
}

// quantileName is 0.99 as "99".
func quantileName(q float64) string {
	return strconv.FormatFloat(100*q, 'f', -1, 64)
}

// keep is the decision for a model whose latency is not predicted yet: the
// share it has, or the maximum.
func (a *Adjuster) keep(name string, d decision, hi float64) decision {
	t := a.models[name]
	d.share.Compute = hi
	if t != nil && t.hasApplied && t.applied.Compute > 0 {
		d.share.Compute = t.applied.Compute
	}
	d.reason = fmt.Sprintf("no prediction yet: keeping %.2f", d.share.Compute)
	return d
}

// prediction is the best batch size of a model at one share.
type prediction struct {
	latency time.Duration // at the quantile, end to end: batch fill, queueing, execution
	batch   int           // 0: every batch size is over MaxUtilization
	meets   bool          // within SLO × (1 - Headroom), utilisation bounded
}

// Variability assumed until the scheduler has measured it: Poisson
// arrivals, and executions within about a third of their prediction.
const (
	defaultArrivalSCV = 1
	defaultServiceSCV = 0.1
	maxSCV            = 16
)

// predict plays the model at a share and rate over its batch sizes and
// returns the one with the lowest latency at the quantile. For batch b
// with execution time t on c slots the utilisation is ρ = rate·t/(b·c).
// Batches arrive with squared coefficient of variation ca²/b (ca² measured
// on the model's requests), executions vary with cs² (measured against
// their predictions). The wait is G/G/c after Allen and Cunneen: waiting
// at all has the Erlang C probability Pw, the mean wait is
// Pw·(ca²+cs²)/2·t/(c(1-ρ)), and its tail is exponential, so the wait at
// quantile q is (Wq/Pw)·ln(Pw/(1-q)). The latency at q adds the time the
// batch takes to fill, (b-1)/rate, and the execution's own quantile,
// t·(1+z_q·cs). false when the predictor does not know the model.
func (a *Adjuster) predict(st qos.ModelState, rate, share float64) (prediction, bool) {
	spec := st.Spec
	best := prediction{latency: math.MaxInt64}
	c := max(spec.Slots, 1)
	ca2, cs2 := st.ArrivalSCV, st.ServiceSCV
	if ca2 == 0 {
		ca2 = defaultArrivalSCV
	}
	if cs2 == 0 {
		cs2 = defaultServiceSCV
	}
	ca2, cs2 = min(ca2, maxSCV), min(cs2, maxSCV)
	q := a.opts.Quantile
	z := math.Sqrt2 * math.Erfinv(2*q-1)
	for b := 1; b <= max(spec.MaxBatchSize, 1); b++ {
		t, ok := a.opts.Predictor.Latency(spec.Name, b, share)
		if !ok {
			return prediction{}, false
		}
		ts := t.Seconds()
		rho := rate * ts / (float64(b) * float64(c))
		if rho >= a.opts.MaxUtilization {
			continue
		}
		var fill, wait float64
		if rate > 0 {
			fill = float64(b-1) / rate
			pw := erlangC(c, rho)
			mean := pw * (ca2/float64(b) + cs2) / 2 * ts / (float64(c) * (1 - rho))
			if pw > 1-q && mean > 0 {
				wait = mean / pw * math.Log(pw/(1-q))
			}
		}
		lat := time.Duration((fill + wait + ts*(1+z*math.Sqrt(cs2))) * float64(time.Second))
		if lat < best.latency {
			best.latency, best.batch = lat, b
		}
	}
	if best.batch == 0 {
		return prediction{}, true
	}
	budget := time.Duration(float64(spec.SLO) * (1 - a.opts.Headroom))
	best.meets = spec.SLO == 0 || best.latency <= budget
	return best, true
}

// erlangC is the probability that an arrival waits in an M/M/c queue at
// utilisation rho < 1: ρ for one server.
func erlangC(c int, rho float64) float64 {
	offered := rho * float64(c)
	sum, term := 0.0, 1.0 // term is offered^k / k!
	for k := range c {
		sum += term
		term *= offered / float64(k+1)
	}
	last := term / (1 - rho)
	return last / (sum + last)
}

// fitCapacity scales the latency-critical targets down to what is
// available. Each gives up in proportion to its target times its priority
// rank, so priority 1 keeps most; none goes below its minimum.
func (a *Adjuster) fitCapacity(lcs []qos.ModelState, ds map[string]decision, demand, available float64) {
	type claim struct{ target, lo, weight float64 }
	claims := make([]claim, len(lcs))
	var floor float64
	for i, st := range lcs {
		d := ds[st.Spec.Name]
		lo, _ := a.bounds(st.Spec)
		lo = min(lo, d.share.Compute)
		claims[i] = claim{d.share.Compute, lo, d.share.Compute * float64(d.rank)}
		floor += lo
	}
	cut := func(theta float64, c claim) float64 {
		return c.target - min(max(c.target-theta*c.weight, c.lo), c.target)
	}
	theta := math.Inf(1) // every one at its minimum
	if floor < available {
		theta = bisect(func(theta float64) float64 {
			var sum float64
			for _, c := range claims {
				sum += cut(theta, c)
			}
			return sum
		}, demand-available, 1)
	}
	for i, st := range lcs {
		d, c := ds[st.Spec.Name], claims[i]
		share := c.lo
		if !math.IsInf(theta, 1) {
			share = floorShare(c.target - cut(theta, c))
		}
		d.reason += fmt.Sprintf("; scaled from %.2f to %.2f: latency-critical demand %.2f over the %.2f available (priority rank %d)", c.target, share, demand, available, d.rank)
		d.share.Compute = share
		ds[st.Spec.Name] = d
	}
}

// bestEffort splits what the latency-critical models leave among the
// best-effort ones with demand, weighted by priority (weight 1/rank),
// within their bounds; idle ones get their minimum. Where telemetry says
// how much of the device a model uses, its claim is first bounded by
// twice that plus a step (a model held at its cap doubles each pass; one
// that cannot use its cap does not keep it from the others), and what
// the bounded claims leave is then shared out by weight up to the bounds.
func (a *Adjuster) bestEffort(bes []qos.ModelState, rest float64, rank func(int) int) map[string]decision {
	ds := make(map[string]decision, len(bes))
	var busy []qos.ModelState
	var claims []waterClaim
	var demands []float64
	left := rest
	for _, st := range bes {
		lo, hi := a.bounds(st.Spec)
		d := decision{
			source: SharePolicyAdaptive, class: st.Spec.Class, rank: rank(st.Spec.Priority),
			rate: a.forecast(st.Spec.Name), share: limiter.Share{Memory: st.Spec.Memory, Mode: limiter.ModeBackground},
		}
		if d.rate < rateEpsilon && st.QueueDepth == 0 && st.Running == 0 {
			d.share.Compute = lo
			d.reason = fmt.Sprintf("best-effort, idle: minimum share %.2f", lo)
			left -= lo
		} else {
			busy = append(busy, st)
			claims = append(claims, waterClaim{1 / float64(d.rank), lo, hi})
			demand := hi
			// Where every share is a cap (CapsOnly) a cap the model
			// does not use keeps nothing from the others, and a batch
			// job's measured use is what the latency-critical clients'
			// oversubscription left it, not its demand: bounding its
			// claim by it would move its cap (a new client) with their
			// bursts.
			if a.opts.Usage != nil && !a.opts.CapsOnly {
				if u, ok := a.opts.Usage(st.Spec.Name); ok {
					demand = min(max(2*u+a.opts.Step, lo), hi)
				}
			}
			demands = append(demands, demand)
		}
		ds[st.Spec.Name] = d
	}
	left = max(left, 0)
	bounded := make([]waterClaim, len(claims))
	for i, c := range claims {
		bounded[i] = waterClaim{c.weight, c.lo, demands[i]}
	}
	shares := waterFill(bounded, left)
	if spare := left - sum(shares); spare > shareEpsilon {
		// Room the demands leave: share it by weight up to the bounds.
		room := make([]waterClaim, len(claims))
		for i, c := range claims {
			room[i] = waterClaim{c.weight, 0, max(c.hi-shares[i], 0)}
		}
		for i, extra := range waterFill(room, spare) {
			shares[i] += extra
		}
	}
	for i, st := range busy {
		c, d := claims[i], ds[st.Spec.Name]
		d.share.Compute = max(floorShare(shares[i]), c.lo)
		d.reason = fmt.Sprintf("best-effort: %.2f of the %.2f left (priority rank %d)", d.share.Compute, left, d.rank)
		if demands[i] < c.hi {
			d.reason += fmt.Sprintf("; it uses %.2f", max(demands[i]-a.opts.Step, 0)/2)
		}
		if p, ok := a.predict(st, d.rate, d.share.Compute); ok {
			d.predicted = p.latency
		}
		ds[st.Spec.Name] = d
	}
	return ds
}

// waterClaim is one model's claim on a split: its weight and bounds.
type waterClaim struct{ weight, lo, hi float64 }

// waterFill splits total among the claims in proportion to their weights
// within their bounds: each gets min(max(θ·weight, lo), hi) for the θ at
// which they add up to total (all at lo when even that is too much, all
// at hi when even that is too little).
func waterFill(claims []waterClaim, total float64) []float64 {
	var floor, ceiling, top float64
	for _, c := range claims {
		floor += c.lo
		ceiling += c.hi
		top = max(top, c.hi/c.weight)
	}
	theta := 0.0
	switch {
	case floor >= total:
	case ceiling <= total:
		theta = top
	default:
		theta = bisect(func(theta float64) float64 {
			var sum float64
			for _, c := range claims {
				sum += min(max(theta*c.weight, c.lo), c.hi)
			}
			return sum
		}, total, top)
	}
	out := make([]float64, len(claims))
	for i, c := range claims {
		out[i] = min(max(theta*c.weight, c.lo), c.hi)
	}
	return out
}

func sum(xs []float64) float64 {
	var s float64
	for _, x := range xs {
		s += x
	}
	return s
}

// bisect finds θ in [0, hi] where the nondecreasing f reaches want.
func bisect(f func(float64) float64, want, hi float64) float64 {
	lo := 0.0
	for range 100 {
		mid := (lo + hi) / 2
		if f(mid) < want {
			lo = mid
		} else {
			hi = mid
		}
	}
	return hi
}

// roundShare removes floating-point noise from a grid share.
func roundShare(x float64) float64 { return math.Round(x*1e9) / 1e9 }

// floorShare rounds a computed share down to 1e-4, so that the shares
// split from a total do not exceed it by noise.
func floorShare(x float64) float64 { return math.Floor(x*1e4+1e-6) / 1e4 }

// millis formats a duration in milliseconds, as the events state them.
func millis(d time.Duration) string {
	return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
}
