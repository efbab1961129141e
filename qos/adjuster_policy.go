package qos

import (
	"fmt"
	"math"
	"time"

	"github.com/sloserve/sloserve/limiter"
)

// rateEpsilon is the forecast rate, in requests per second, below which a
// model counts as having no traffic.
const rateEpsilon = 1e-6

// decideAdaptive is the adaptive policy: pins first, then the
// latency-critical models' targets (scaled down when they do not fit), then
// the best-effort models split what the latency-critical models hold after
// the hysteresis.
func (a *Adjuster) decideAdaptive(now time.Time, states []modelState, p *plan) {
	rank := ranker(states)
	available := a.opts.Capacity
	var lcs, bes []modelState
	for _, st := range states {
		name := st.Spec.Name
		if t := a.models[name]; t.pin != nil {
			d := pinDecision(t)
			d.rate = a.forecast(name)
			a.settle(now, name, d, p)
			available -= limitedCompute(t.pin.Compute)
			continue
		}
		if st.Spec.Class == ClassLatencyCritical {
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
		d.rank = rank(st.Spec.Priority)
		ds[st.Spec.Name] = d
		demand += d.share.Compute
	}
	if lcAvailable := max(available-floors, 0); demand > lcAvailable+shareEpsilon {
		a.fitCapacity(lcs, ds, demand, lcAvailable)
	}
	held := available
	for _, st := range lcs {
		a.settle(now, st.Spec.Name, ds[st.Spec.Name], p)
		held -= p.next[st.Spec.Name].Compute
	}
	for name, d := range a.bestEffort(bes, max(held, 0), rank) {
		a.settle(now, name, d, p)
	}
}

// decideStatic gives every model an equal share of the capacity, and of
// the memory budget when there is one.
func (a *Adjuster) decideStatic(now time.Time, states []modelState, p *plan) {
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
func (a *Adjuster) decideShared(now time.Time, states []modelState, p *plan) {
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
func ranker(states []modelState) func(priority int) int {
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
func (a *Adjuster) bounds(spec ModelSpec) (lo, hi float64) {
	hi = spec.MaxShare
	if hi == 0 {
		hi = 1
	}
	hi = min(hi, a.opts.Capacity)
	lo = min(max(a.opts.MinShare, spec.MinShare), hi)
	return lo, hi
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
// forecast rate.
func (a *Adjuster) latencyCritical(st modelState) decision {
	spec := st.Spec
	lo, hi := a.bounds(spec)
	rate := a.forecast(spec.Name)
	d := decision{source: SharePolicyAdaptive, class: spec.Class, rate: rate, share: limiter.Share{Memory: spec.Memory}}
	if rate < rateEpsilon && st.QueueDepth == 0 && st.Running == 0 {
		d.share.Compute = lo
		d.reason = fmt.Sprintf("no traffic: minimum share %.2f", lo)
		return d
	}
	goal := fmt.Sprintf("meet %s", spec.SLO)
	if spec.SLO == 0 {
		goal = fmt.Sprintf("stay under %.2f utilisation", a.opts.MaxUtilization)
	}
	step := a.opts.Step
	for k := math.Ceil(lo/step - shareEpsilon); ; k++ {
		share := roundShare(k * step)
		if share > hi+shareEpsilon {
			break
		}
		p, known := a.predict(spec, rate, share)
		if !known {
			return a.keep(spec.Name, d, hi)
		}
		if p.meets {
			d.share.Compute, d.predicted = share, p.latency
			d.reason = fmt.Sprintf("forecast %.1f req/s needs %.2f to %s (predicted %s at batch %d)", rate, share, goal, millis(p.latency), p.batch)
			return d
		}
	}
	p, known := a.predict(spec, rate, hi)
	if !known {
		return a.keep(spec.Name, d, hi)
	}
	d.share.Compute, d.predicted = hi, p.latency
	if p.batch > 0 {
		d.reason = fmt.Sprintf("forecast %.1f req/s: cannot %s even at the maximum share %.2f (predicted %s at batch %d)", rate, goal, hi, millis(p.latency), p.batch)
	} else {
		d.reason = fmt.Sprintf("forecast %.1f req/s: cannot %s even at the maximum share %.2f (utilisation over %.2f at every batch size)", rate, goal, hi, a.opts.MaxUtilization)
	}
	return d
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
	latency time.Duration // end to end: batch fill, queueing, execution
	batch   int           // 0: every batch size is over MaxUtilization
	meets   bool          // within SLO × (1 - Headroom), utilisation bounded
}

// predict plays the model at a share and rate over its batch sizes and
// returns the one with the lowest latency. For batch b with execution time
// t and s slots, utilisation is ρ = rate·t/(b·s); the latency is the wait
// for the batch to fill, (b-1)/rate, plus M/D/1-style queueing,
// ρ·t/(2(1-ρ)), plus t. false when the predictor does not know the model.
func (a *Adjuster) predict(spec ModelSpec, rate, share float64) (prediction, bool) {
	best := prediction{latency: math.MaxInt64}
	slots := float64(max(spec.Slots, 1))
	for b := 1; b <= max(spec.MaxBatchSize, 1); b++ {
		t, ok := a.opts.Predictor.Latency(spec.Name, b, share)
		if !ok {
			return prediction{}, false
		}
		ts := t.Seconds()
		rho := rate * ts / (float64(b) * slots)
		if rho >= a.opts.MaxUtilization {
			continue
		}
		var fill float64
		if rate > 0 {
			fill = float64(b-1) / rate
		}
		queueing := rho * ts / (2 * (1 - rho))
		lat := time.Duration((fill + queueing + ts) * float64(time.Second))
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

// fitCapacity scales the latency-critical targets down to what is
// available. Each gives up in proportion to its target times its priority
// rank, so priority 1 keeps most; none goes below its minimum.
func (a *Adjuster) fitCapacity(lcs []modelState, ds map[string]decision, demand, available float64) {
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
// within their bounds; idle ones get their minimum.
func (a *Adjuster) bestEffort(bes []modelState, rest float64, rank func(int) int) map[string]decision {
	ds := make(map[string]decision, len(bes))
	type claim struct{ weight, lo, hi float64 }
	var busy []modelState
	var claims []claim
	left := rest
	for _, st := range bes {
		lo, hi := a.bounds(st.Spec)
		d := decision{
			source: SharePolicyAdaptive, class: st.Spec.Class, rank: rank(st.Spec.Priority),
			rate: a.forecast(st.Spec.Name), share: limiter.Share{Memory: st.Spec.Memory},
		}
		if d.rate < rateEpsilon && st.QueueDepth == 0 && st.Running == 0 {
			d.share.Compute = lo
			d.reason = fmt.Sprintf("best-effort, idle: minimum share %.2f", lo)
			left -= lo
		} else {
			busy = append(busy, st)
			claims = append(claims, claim{1 / float64(d.rank), lo, hi})
		}
		ds[st.Spec.Name] = d
	}
	left = max(left, 0)
	var floor, ceiling, top float64
	for _, c := range claims {
		floor += c.lo
		ceiling += c.hi
		top = max(top, c.hi/c.weight)
	}
	theta := 0.0
	switch {
	case floor >= left:
	case ceiling <= left:
		theta = top
	default:
		theta = bisect(func(theta float64) float64 {
			var sum float64
			for _, c := range claims {
				sum += min(max(theta*c.weight, c.lo), c.hi)
			}
			return sum
		}, left, top)
	}
	for i, st := range busy {
		c, d := claims[i], ds[st.Spec.Name]
		d.share.Compute = max(floorShare(min(max(theta*c.weight, c.lo), c.hi)), c.lo)
		d.reason = fmt.Sprintf("best-effort: %.2f of the %.2f left (priority rank %d)", d.share.Compute, left, d.rank)
		if p, ok := a.predict(st.Spec, d.rate, d.share.Compute); ok {
			d.predicted = p.latency
		}
		ds[st.Spec.Name] = d
	}
	return ds
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
