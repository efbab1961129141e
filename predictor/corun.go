package predictor

import "math"

// Co-running work on a shared device (a GPU under MPS, where the clients'
// caps may add up to more than the device and every kernel shares its
// memory bandwidth) slows a model by an amount no fixed formula knows:
// it depends on what the others run and how their kernels overlap. The
// Predictor learns it per model from what it is told of the others' use
// (SetCoRunning, once a control period: the device's measured use by
// everything but the model, 0..1 of the device) and the executions it
// observes. The slowdown is
//
//	G(u) = min(exp(slope * u), maxInterference)
//
// and slope is the pooled within-size least-squares slope of
// log(observed / curve) on u: each execution of the period joins the
// regression with the use the period then measured, and each row size
// has its own intercept, so that the curve's error at a size (or a mix
// of sizes that changes with the load) is not taken for interference.
// The sums forget with weight 1/coPeriods a period. Until u has varied
// (a within-size variance of at least coMinVar over coMinSamples
// executions) the slope stays where it was (0 at first): a constant u
// leaves the slowdown to the online correction, as before.
//
// Predictions take G at the use forecast for the next period (see
// forecast); the adjuster's (Predictor.Latency) at the mean use of the
// last periods. The online correction learns observed / (curve x G): what
// is left once the co-runners' slowdown is known, so that when their use
// changes the prediction follows within a control period instead of
// after tens of executions; what a period taught it is rescaled when the
// forecast moves (Predictor.SetCoRunning).
const (
	coPeriods    = 60
	coMinVar     = 0.05 * 0.05
	coMinSamples = 20
	coMaxSlope   = 3
	// coForecastWeight is the weight of a period in the mean, variance
	// and autocovariance of the use that forecast the next period's.
	coForecastWeight = 1.0 / 20
)

// coStats are one row size's sufficient statistics of the regression of
// y = log(observed / curve) on u, exponentially weighted.
type coStats struct {
	w, su, sy, suu, suy float64
}

// coPending is one row size's executions since the latest SetCoRunning.
type coPending struct {
	n  float64
	sy float64
}

// coRun is a model's co-running state. Guarded by model.mu.
type coRun struct {
	util    float64 // the others' use of the device the latest period
	next    float64 // what it is expected to be the next (forecast)
	known   bool    // SetCoRunning was called
	mean    float64 // EWMA of util, weight coForecastWeight
	vari    float64 // its variance about mean
	cov     float64 // lag-1 autocovariance
	slope   float64
	stats   map[int]*coStats
	pending map[int]*coPending
}

// factor is G at the use expected this period; 1 until SetCoRunning was
// called.
func (c *coRun) factor() float64 { return c.factorAt(c.next) }

// meanFactor is G at the mean use of the last periods (weight
// coForecastWeight); 1 until SetCoRunning was called.
func (c *coRun) meanFactor() float64 { return c.factorAt(c.mean) }

// factorAt is G at a use u; 1 until SetCoRunning was called.
func (c *coRun) factorAt(u float64) float64 {
	if !c.known {
		return 1
	}
	return min(math.Exp(c.slope*u), maxInterference)
}

// observe records an execution whose time was ratio times the curve's
// (interference by SetInterference included, G not), at a row size
// bucket.
func (c *coRun) observe(size int, ratio float64) {
	if !(ratio > 0) || math.IsInf(ratio, 0) {
		return
	}
	if c.pending == nil {
		c.pending = map[int]*coPending{}
	}
	p := c.pending[size]
	if p == nil {
		p = &coPending{}
		c.pending[size] = p
	}
	p.n++
	p.sy += math.Log(ratio)
}

// period folds the executions since the last call into the regression
// with the use u measured over their period, updates the slope and makes
// u the use predictions assume.
func (c *coRun) period(u float64) {
	if c.stats == nil {
		c.stats = map[int]*coStats{}
	}
	keep := 1 - 1.0/coPeriods
	for _, s := range c.stats {
		s.w *= keep
		s.su *= keep
		s.sy *= keep
		s.suu *= keep
		s.suy *= keep
	}
	for size, p := range c.pending {
		s := c.stats[size]
		if s == nil {
			s = &coStats{}
			c.stats[size] = s
		}
		s.w += p.n
		s.su += p.n * u
		s.sy += p.sy
		s.suu += p.n * u * u
		s.suy += u * p.sy
	}
	clear(c.pending)
	var w, sxx, sxy float64
	for size, s := range c.stats {
		if s.w < 1e-3 {
			delete(c.stats, size) // forgotten
			continue
		}
		mu, my := s.su/s.w, s.sy/s.w
		w += s.w
		sxx += s.suu - s.w*mu*mu
		sxy += s.suy - s.w*mu*my
	}
	if w >= coMinSamples && sxx >= coMinVar*w {
		c.slope = min(max(sxy/sxx, 0), coMaxSlope)
	}
	c.forecast(u)
}

// forecast takes the use measured over the period that ended and
// expects the next period's as an AR(1) process would: the mean plus
// the lag-1 autocorrelation times the latest deviation. A use that
// holds for periods at a time is expected to hold; one that jumps about
// from one period to the next is expected at its mean (taking the
// latest period's for the next made predictions worse than the online
// correction alone when it jumped every period: 24% MAPE against 13% in
// TestCoRunningSlowdownLearned's jumpy case).
func (c *coRun) forecast(u float64) {
	if !c.known {
		c.mean, c.util, c.next, c.known = u, u, u, true
		return
	}
	const a = coForecastWeight
	d, dPrev := u-c.mean, c.util-c.mean
	c.cov = (1-a)*c.cov + a*d*dPrev
	c.vari = (1-a)*c.vari + a*d*d
	c.mean += a * d
	rho := 0.0
	if c.vari > 1e-9 {
		rho = min(max(c.cov/c.vari, 0), 1)
	}
	c.util = u
	c.next = c.mean + rho*(u-c.mean)
}

// reset forgets the regression's samples (they were taken against
// another curve); the slope, a property of the device's mix, stays.
func (c *coRun) reset() {
	c.stats, c.pending = nil, nil
}
