package loadtest

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
)

// errBadSchedule is wrapped by every error the schedules' Validate methods
// return.
var errBadSchedule = errors.New("invalid schedule")

// Schedule is a target arrival rate over the offsets of a run.
type Schedule interface {
	// Rate is the target rate in requests/s at offset t; never negative.
	Rate(t time.Duration) float64
	// Peak is an upper bound of Rate over all t, used for thinning. It is
	// > 0 unless the schedule is zero everywhere.
	Peak() float64
	// String describes the schedule for people: "constant 5 req/s",
	// "diurnal 1-12 req/s, period 2m0s, peak at 0.25".
	String() string
}

var (
	_ Schedule = Constant{}
	_ Schedule = Steps{}
	_ Schedule = Diurnal{}
	_ Schedule = Scaled{}
)

// scheduleJumps is implemented by schedules whose rate jumps at known
// offsets. Integration splits its cells there, so a step is integrated
// exactly and no arrival lands before a step from a zero rate.
type scheduleJumps interface {
	jumps() []time.Duration
}

// scheduleCellWidth is implemented by schedules that know how wide the
// integration cells over them may be; 0 means any width, for schedules that
// are constant between their jumps. Others get rateCell.
type scheduleCellWidth interface {
	cellWidth() time.Duration
}

// scheduleValidator is implemented by the schedules of this package; a
// schedule from elsewhere that has no Validate method is taken as valid.
type scheduleValidator interface {
	Validate() error
}

// Constant is the same rate over the whole run.
type Constant struct {
	RPS float64 // requests/s, >= 0
}

// Rate returns RPS (0 if RPS is negative).
func (c Constant) Rate(time.Duration) float64 { return max(c.RPS, 0) }

// Peak returns RPS.
func (c Constant) Peak() float64 { return max(c.RPS, 0) }

func (c Constant) cellWidth() time.Duration { return 0 }

func (c Constant) String() string { return "constant " + scheduleNum(c.RPS) + " req/s" }

// Validate reports a negative or non-finite RPS.
func (c Constant) Validate() error {
	if err := scheduleCheckRate("RPS", c.RPS); err != nil {
		return fmt.Errorf("%w: constant: %v", errBadSchedule, err)
	}
	return nil
}

// Step is one level of a Steps schedule: Rate requests/s from offset At on.
type Step struct {
	At   time.Duration
	Rate float64
}

// Steps is a piecewise-constant schedule: Steps[i].Rate from Steps[i].At
// until the next step's At (the last step lasts to the end of the run), and 0
// before the first step. The Ats are strictly increasing.
type Steps []Step

// Rate returns the rate of the last step at or before t; 0 before the first.
func (s Steps) Rate(t time.Duration) float64 {
	// The first step after t; the one before it is in force.
	i := sort.Search(len(s), func(i int) bool { return s[i].At > t })
	if i == 0 {
		return 0
	}
	return max(s[i-1].Rate, 0)
}

// Peak returns the highest step's rate.
func (s Steps) Peak() float64 {
	var peak float64
	for _, st := range s {
		peak = max(peak, st.Rate)
	}
	return peak
}

// stepsShown is how many steps String lists before it summarises the rest.
const stepsShown = 6

func (s Steps) String() string {
	if len(s) == 0 {
		return "steps (none)"
	}
	var b strings.Builder
	b.WriteString("steps ")
	for i, st := range s {
		if i == stepsShown && len(s) > stepsShown+1 {
			fmt.Fprintf(&b, ", … (%d steps, peak %s req/s)", len(s), scheduleNum(s.Peak()))
			break
		}
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s req/s from %v", scheduleNum(st.Rate), st.At)
	}
	return b.String()
}

// Validate reports an empty list, a negative or non-finite rate, a negative
// At, and Ats that do not strictly increase.
func (s Steps) Validate() error {
	if len(s) == 0 {
		return fmt.Errorf("%w: steps: no steps", errBadSchedule)
	}
	for i, st := range s {
		if st.At < 0 {
			return fmt.Errorf("%w: steps[%d]: At %v is negative", errBadSchedule, i, st.At)
		}
		if i > 0 && st.At <= s[i-1].At {
			return fmt.Errorf("%w: steps[%d]: At %v is not after steps[%d].At %v; steps must be in strictly increasing order",
				errBadSchedule, i, st.At, i-1, s[i-1].At)
		}
		if err := scheduleCheckRate("Rate", st.Rate); err != nil {
			return fmt.Errorf("%w: steps[%d]: %v", errBadSchedule, i, err)
		}
	}
	return nil
}

func (s Steps) cellWidth() time.Duration { return 0 }

func (s Steps) jumps() []time.Duration {
	ats := make([]time.Duration, len(s))
	for i, st := range s {
		ats[i] = st.At
	}
	return ats
}

// diurnalHours is the length Diurnal.Hourly must have.
const diurnalHours = 24

// diurnalCells is how many integration cells a Diurnal period is cut into.
// Within a cell the cosine changes by at most π/4096 of its range, under
// 0.08%, whatever the period.
const diurnalCells = 4096

// Diurnal is a daily rate curve compressed into Period and repeated.
type Diurnal struct {
	Period time.Duration // length of one compressed day, > 0
	// Min and Max are the rates at the trough and at the peak, in requests/s:
	// 0 <= Min <= Max.
	Min, Max float64
	// PeakAt is where in the day the peak comes, as a fraction of Period in
	// [0, 1). Giving models different PeakAts staggers their days.
	PeakAt float64
	// Hourly, when set, is the day's shape as 24 relative levels on any
	// scale (a real service's hourly request counts, say). The curve passes
	// through them at the hours' centres with cosine interpolation between
	// neighbours (wrapping from the last hour to the first), so it is smooth
	// and its extremes are levels themselves; it is rescaled so the lowest
	// level is Min and the highest Max, and shifted so the highest level
	// (the first, if several tie) falls at PeakAt. The shift keeps the shape
	// but not the clock time of the levels.
	//
	// Empty: a raised cosine, Min + (Max-Min)*(1+cos(2π(t/Period-PeakAt)))/2.
	Hourly []float64
}

// Rate returns the curve at t (0 if Period is not positive).
func (d Diurnal) Rate(t time.Duration) float64 {
	if d.Period <= 0 {
		return 0
	}
	if len(d.Hourly) == 0 {
		return d.cosine(t)
	}
	return d.withShape(d.hourlyShape(), t)
}

// Peak returns Max.
func (d Diurnal) Peak() float64 { return max(d.Max, 0) }

func (d Diurnal) String() string {
	s := fmt.Sprintf("diurnal %s-%s req/s, period %v, peak at %s",
		scheduleNum(d.Min), scheduleNum(d.Max), d.Period, scheduleNum(d.PeakAt))
	if len(d.Hourly) > 0 {
		s += ", hourly shape"
	}
	return s
}

// Validate reports a Period that is not positive, negative or non-finite
// rates, Min above Max, PeakAt outside [0, 1) and an Hourly shape that is
// not 24 non-negative levels of which at least two differ.
func (d Diurnal) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: diurnal: %s", errBadSchedule, fmt.Sprintf(format, args...))
	}
	if d.Period <= 0 {
		return bad("Period %v must be > 0", d.Period)
	}
	if err := scheduleCheckRate("Min", d.Min); err != nil {
		return bad("%v", err)
	}
	if err := scheduleCheckRate("Max", d.Max); err != nil {
		return bad("%v", err)
	}
	if d.Min > d.Max {
		return bad("Min %s is above Max %s", scheduleNum(d.Min), scheduleNum(d.Max))
	}
	if !(d.PeakAt >= 0 && d.PeakAt < 1) {
		return bad("PeakAt %v is outside [0, 1): it is a fraction of the period", d.PeakAt)
	}
	if len(d.Hourly) == 0 {
		return nil
	}
	if len(d.Hourly) != diurnalHours {
		return bad("Hourly has %d levels; it needs one per hour, %d", len(d.Hourly), diurnalHours)
	}
	for h, v := range d.Hourly {
		if !(v >= 0) || math.IsInf(v, 0) {
			return bad("Hourly[%d] is %v; levels must be finite and >= 0", h, v)
		}
	}
	if slices.Min(d.Hourly) == slices.Max(d.Hourly) {
		return bad("Hourly levels are all %v: a flat day has no peak to put at PeakAt (leave Hourly empty for a cosine)", d.Hourly[0])
	}
	return nil
}

func (d Diurnal) cellWidth() time.Duration {
	if d.Period <= 0 {
		return rateCell
	}
	return max(d.Period/diurnalCells, 1)
}

// dayFraction is where offset t falls in the day, shifted by the given
// fraction, in [0, 1).
func (d Diurnal) dayFraction(t time.Duration, shift float64) float64 {
	y := float64(t)/float64(d.Period) + shift
	x := y - math.Floor(y) // math.Mod is far slower
	if x >= 1 {            // rounding of a tiny negative y
		x = 0
	}
	return x
}

func (d Diurnal) cosine(t time.Duration) float64 {
	x := d.dayFraction(t, -d.PeakAt)
	r := d.Min + (d.Max-d.Min)*(1+math.Cos(2*math.Pi*x))/2
	return max(r, 0)
}

// diurnalShape is an Hourly shape made ready to evaluate: the levels scaled
// to [0, 1] and the phase shift that puts the highest level at PeakAt.
type diurnalShape struct {
	norm  [diurnalHours]float64
	shift float64
}

// hourlyShape prepares d.Hourly, which must have 24 levels that are not all
// equal (see Validate); otherwise the shape is flat at 1, the peak.
func (d Diurnal) hourlyShape() diurnalShape {
	var sh diurnalShape
	if len(d.Hourly) != diurnalHours {
		for h := range sh.norm {
			sh.norm[h] = 1
		}
		return sh
	}
	lo, hi := slices.Min(d.Hourly), slices.Max(d.Hourly)
	top := slices.Index(d.Hourly, hi)
	for h, v := range d.Hourly {
		if hi > lo {
			sh.norm[h] = (v - lo) / (hi - lo)
		} else {
			sh.norm[h] = 1
		}
	}
	// Hour h's level sits at its centre, (h+0.5)/24 of the day.
	sh.shift = (float64(top)+0.5)/diurnalHours - d.PeakAt
	return sh
}

// at is the shape at day fraction x in [0, 1): cosine interpolation between
// the two hour centres around x.
func (sh *diurnalShape) at(x float64) float64 {
	p := x*diurnalHours - 0.5 // in hour-centre units: hour h's centre is at p = h
	fl := math.Floor(p)
	f := p - fl
	i := int(fl)
	if i < 0 {
		i += diurnalHours
	}
	i %= diurnalHours
	a, b := sh.norm[i], sh.norm[(i+1)%diurnalHours]
	return a + (b-a)*(1-math.Cos(math.Pi*f))/2
}

func (d Diurnal) withShape(sh diurnalShape, t time.Duration) float64 {
	r := d.Min + (d.Max-d.Min)*sh.at(d.dayFraction(t, sh.shift))
	return max(r, 0)
}

// shapedDiurnal is a Diurnal with its Hourly shape prepared once, for
// integration and thinning, which evaluate the rate millions of times.
type shapedDiurnal struct {
	Diurnal
	shape diurnalShape
}

func (d shapedDiurnal) Rate(t time.Duration) float64 {
	if d.Period <= 0 {
		return 0
	}
	return d.withShape(d.shape, t)
}

// Scaled is another schedule with its rate multiplied by Factor; the
// capacity search uses it to try a scenario at several loads.
type Scaled struct {
	Schedule
	Factor float64 // >= 0
}

// Rate returns Factor times the schedule's rate.
func (s Scaled) Rate(t time.Duration) float64 {
	if s.Schedule == nil {
		return 0
	}
	return max(s.Factor*s.Schedule.Rate(t), 0)
}

// Peak returns Factor times the schedule's peak.
func (s Scaled) Peak() float64 {
	if s.Schedule == nil {
		return 0
	}
	return max(s.Factor*s.Schedule.Peak(), 0)
}

func (s Scaled) String() string {
	if s.Schedule == nil {
		return scheduleNum(s.Factor) + " x (no schedule)"
	}
	return scheduleNum(s.Factor) + " x " + s.Schedule.String()
}

// Validate reports a missing schedule, a negative or non-finite Factor, and
// whatever the schedule's own Validate reports.
func (s Scaled) Validate() error {
	if s.Schedule == nil {
		return fmt.Errorf("%w: scaled: no schedule to scale", errBadSchedule)
	}
	if !(s.Factor >= 0) || math.IsInf(s.Factor, 0) {
		return fmt.Errorf("%w: scaled: Factor %v must be finite and >= 0", errBadSchedule, s.Factor)
	}
	if v, ok := s.Schedule.(scheduleValidator); ok {
		if err := v.Validate(); err != nil {
			return fmt.Errorf("scaled: %w", err)
		}
	}
	return nil
}

func (s Scaled) cellWidth() time.Duration {
	if c, ok := s.Schedule.(scheduleCellWidth); ok {
		return c.cellWidth()
	}
	return rateCell
}

func (s Scaled) jumps() []time.Duration {
	if j, ok := s.Schedule.(scheduleJumps); ok {
		return j.jumps()
	}
	return nil
}

// schedulePrepared returns s, or a schedule with the same rates that is
// cheaper to evaluate many times.
func schedulePrepared(s Schedule) Schedule {
	switch v := s.(type) {
	case Diurnal:
		if len(v.Hourly) > 0 {
			return shapedDiurnal{Diurnal: v, shape: v.hourlyShape()}
		}
	case Scaled:
		if v.Schedule != nil {
			return Scaled{Schedule: schedulePrepared(v.Schedule), Factor: v.Factor}
		}
	}
	return s
}

// Mean is the mean rate of s over [0, d), in requests/s; 0 if d <= 0 or s
// is nil. It integrates with two-point Gauss-Legendre quadrature in cells
// (see rateWalk), so it is exact for Constant and Steps and far within 0.1%
// for Diurnal and for smooth schedules from elsewhere.
func Mean(s Schedule, d time.Duration) float64 {
	if s == nil || d <= 0 {
		return 0
	}
	w := newRateWalk(s, d)
	for w.next() {
	}
	return w.lb / d.Seconds()
}

const (
	// rateCell is the widest cell over schedules that do not say
	// (scheduleCellWidth).
	rateCell = time.Millisecond
	// rateMaxCells bounds the number of cells over one run; longer runs get
	// wider cells.
	rateMaxCells = 1 << 22
)

// rateWalk steps through [0, d) in cells, keeping the cumulative rate
// Λ(t) = ∫0^t Rate at each cell's ends: cell [a, b) has Λ(a) = la and
// Λ(b) = lb, in requests. Cells end at every jump of the schedule
// (scheduleJumps) and are no wider than it allows (scheduleCellWidth): for
// Constant and Steps a cell runs from one step to the next, for Diurnal it
// is 1/4096 of the period, for other schedules 1 ms, and never so narrow
// that the run has more than rateMaxCells.
type rateWalk struct {
	s      Schedule
	d      time.Duration
	cell   time.Duration
	jumps  []time.Duration // ascending, in (0, d), not yet passed
	a, b   time.Duration
	la, lb float64
}

func newRateWalk(s Schedule, d time.Duration) *rateWalk {
	cell := rateCell
	if c, ok := s.(scheduleCellWidth); ok {
		cell = c.cellWidth()
	}
	if cell <= 0 {
		cell = d
	}
	w := &rateWalk{s: schedulePrepared(s), d: d, cell: max(cell, d/rateMaxCells+1)}
	if j, ok := s.(scheduleJumps); ok {
		for _, at := range j.jumps() {
			if at > 0 && at < d {
				w.jumps = append(w.jumps, at)
			}
		}
		slices.Sort(w.jumps)
	}
	return w
}

// next moves to the following cell; false when the walk has reached d.
func (w *rateWalk) next() bool {
	if w.b >= w.d {
		return false
	}
	w.a, w.la = w.b, w.lb
	b := min(w.a+w.cell, w.d)
	for len(w.jumps) > 0 && w.jumps[0] <= w.a {
		w.jumps = w.jumps[1:]
	}
	if len(w.jumps) > 0 && w.jumps[0] < b {
		b = w.jumps[0]
	}
	w.b = b
	w.lb = w.la + rateCellIntegral(w.s, w.a, b)
	return true
}

// rateCellIntegral is ∫a^b Rate by two-point Gauss-Legendre quadrature. It
// never evaluates the rate at the cell's ends, where a step may begin.
func rateCellIntegral(s Schedule, a, b time.Duration) float64 {
	width := b - a
	mid := a + width/2
	off := time.Duration(float64(width) / (2 * math.Sqrt(3)))
	r := scheduleRateAt(s, mid-off) + scheduleRateAt(s, mid+off)
	return width.Seconds() * r / 2
}

// scheduleRateAt is s.Rate(t), with negative and NaN rates read as 0.
func scheduleRateAt(s Schedule, t time.Duration) float64 {
	r := s.Rate(t)
	if !(r > 0) {
		return 0
	}
	return r
}

// scheduleCheckRate says what is wrong with a rate, if anything.
func scheduleCheckRate(field string, v float64) error {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return fmt.Errorf("%s is %v; it must be a finite number of requests/s", field, v)
	}
	if v < 0 {
		return fmt.Errorf("%s %v is negative", field, v)
	}
	return nil
}

// scheduleNum formats a number for people: at most four significant digits,
// no exponent.
func scheduleNum(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return strconv.FormatFloat(v, 'g', -1, 64)
	}
	r, err := strconv.ParseFloat(strconv.FormatFloat(v, 'g', 4, 64), 64)
	if err != nil {
		r = v
	}
	return strconv.FormatFloat(r, 'f', -1, 64)
}
