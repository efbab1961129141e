package predictor

import (
	"math"
	"time"
)

// Rate forecasting parameters.
const (
	holtAlpha     = 0.3 // level smoothing
	holtBeta      = 0.1 // trend smoothing
	seasonGamma   = 0.5 // weight of the latest period in a slot's average
	maxSlots      = 288 // a day in 5-minute slots
	minSlotLength = time.Second
	// minInterval is the shortest interval a rate is computed over; a
	// sample closer than that to the previous one is skipped (the next
	// interval covers its arrivals), so that jitter cannot blow up a rate.
	minInterval = 500 * time.Millisecond
)

// holt is Holt's linear exponential smoothing over irregular intervals: the
// trend is kept per second, so a longer gap moves the level further.
type holt struct {
	level, trend float64 // requests/s, requests/s per second
	started      bool
}

func (h *holt) update(x, dt float64) {
	if !h.started {
		h.level, h.started = x, true
		return
	}
	prev := h.level
	h.level = holtAlpha*x + (1-holtAlpha)*(prev+h.trend*dt)
	h.trend = holtBeta*(h.level-prev)/dt + (1-holtBeta)*h.trend
}

func (h *holt) at(horizon float64) float64 { return h.level + h.trend*horizon }

// seasonal keeps the average rate of each slot of the season (a day by
// default), each slot an exponentially weighted average over the periods
// seen, so memory is bounded by the slot count.
type seasonal struct {
	period, width time.Duration
	slots         []float64
	filled        []bool
	sum           float64 // of the filled slots
	nFilled       int

	cur      int // slot being visited, -1 before the first sample
	curSum   float64
	curCount int
}

func newSeasonal(period time.Duration) *seasonal {
	n := int(min(max(period/minSlotLength, 1), maxSlots))
	return &seasonal{
		period: period,
		width:  period / time.Duration(n),
		slots:  make([]float64, n),
		filled: make([]bool, n),
		cur:    -1,
	}
}

func (s *seasonal) slot(at time.Time) int {
	ns := at.UnixNano() % int64(s.period)
	if ns < 0 {
		ns += int64(s.period)
	}
	return min(int(ns/int64(s.width)), len(s.slots)-1)
}

// add records a rate measured at a time; a slot's visit is folded into its
// average when the samples move on to another slot.
func (s *seasonal) add(at time.Time, x float64) {
	k := s.slot(at)
	if k != s.cur {
		s.fold()
		s.cur = k
	}
	s.curSum += x
	s.curCount++
}

func (s *seasonal) fold() {
	if s.cur < 0 || s.curCount == 0 {
		return
	}
	v := s.curSum / float64(s.curCount)
	k := s.cur
	if s.filled[k] {
		s.sum -= s.slots[k]
		s.slots[k] = seasonGamma*v + (1-seasonGamma)*s.slots[k]
	} else {
		s.slots[k], s.filled[k] = v, true
		s.nFilled++
	}
	s.sum += s.slots[k]
	s.curSum, s.curCount = 0, 0
}

// index is the additive seasonal component at a time: the slot's average
// minus the average over all slots; 0 while nothing is known. An unfilled
// slot borrows from the nearest filled one.
func (s *seasonal) index(at time.Time) float64 {
	if s.nFilled == 0 {
		return 0
	}
	k, n := s.slot(at), len(s.slots)
	for d := range n/2 + 1 {
		for _, j := range [2]int{(k + d) % n, (k - d + n) % n} {
			if s.filled[j] {
				return s.slots[j] - s.sum/float64(s.nFilled)
			}
		}
	}
	return 0
}

// rateModel forecasts one model's arrival rate from samples of its
// cumulative arrival counter.
//
// Each interval between two samples gives a rate. Holt's method (level plus
// trend) smooths the raw rates. With a season, a second Holt smoother runs
// on the deseasonalised rates (rate minus the slot's seasonal index), and
// once at least two full seasons of history exist the forecast is that
// smoother's value at the horizon plus the seasonal index of the slot the
// horizon falls in: additive seasonality, which copes with slots whose rate
// is zero (a night with no traffic) where a multiplicative index would not.
type rateModel struct {
	raw, deseason holt
	season        *seasonal // nil: no seasonality

	first, last time.Time
	lastCount   uint64
	samples     int
	lastRate    float64
	haveRate    bool
}

func newRateModel(season time.Duration) *rateModel {
	r := &rateModel{}
	if season > 0 {
		r.season = newSeasonal(season)
	}
	return r
}

// observe takes one sample of the cumulative counter. A sample less than
// minInterval after the previous one is ignored; a counter that went
// backwards (a restart) starts a new baseline.
func (r *rateModel) observe(at time.Time, count uint64) {
	if r.samples == 0 {
		r.first, r.last, r.lastCount, r.samples = at, at, count, 1
		return
	}
	if at.Sub(r.last) < minInterval {
		return
	}
	dt := at.Sub(r.last).Seconds()
	if count < r.lastCount {
		r.last, r.lastCount = at, count
		return
	}
	x := float64(count-r.lastCount) / dt
	r.last, r.lastCount = at, count
	r.samples++
	r.lastRate, r.haveRate = x, true
	r.raw.update(x, dt)
	if r.season != nil {
		// The interval's rate belongs to its midpoint.
		mid := at.Add(-time.Duration(dt * float64(time.Second) / 2))
		r.deseason.update(x-r.season.index(mid), dt)
		r.season.add(mid, x)
	}
}

// seasonalActive reports whether two full seasons of history exist.
func (r *rateModel) seasonalActive() bool {
	return r.season != nil && r.samples > 1 && r.last.Sub(r.first) >= 2*r.season.period
}

// forecast returns the rate expected at horizon after the last sample,
// never negative and never below the rate of the last interval: a load
// step is acted on at the next sample, not after the smoother has caught up
// with it (the control loop grows shares at once and shrinks them slowly,
// so a forecast that errs high costs little); 0 before two samples.
func (r *rateModel) forecast(horizon time.Duration) float64 {
	if !r.haveRate {
		return 0
	}
	h := max(horizon.Seconds(), 0)
	var v float64
	if r.seasonalActive() {
		v = r.deseason.at(h) + r.season.index(r.last.Add(horizon))
	} else {
		v = r.raw.at(h)
	}
	if math.IsNaN(v) || math.IsInf(v, 0) {
		v = 0
	}
	return max(v, r.lastRate, 0)
}
