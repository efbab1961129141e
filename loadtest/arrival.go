package loadtest

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/sloserve/sloserve/internal/randdist"
)

// errBadProcess is wrapped by every error Process.Validate returns.
var errBadProcess = errors.New("invalid arrival process")

// Process kinds.
const (
	processPoisson = "poisson"
	processGamma   = "gamma"
)

// processMaxCV bounds a gamma process's CV. Beyond it the gaps are almost
// all near zero with a rare enormous one (shape 1/CV² below 0.01), so a run
// is decided by a handful of draws and says little about the server.
const processMaxCV = 10

// arrivalStream is the PCG stream of Arrivals, so that the same seed gives
// other users of math/rand/v2 in this package different numbers.
const arrivalStream = 0x61727269_76616c73 // "arrivals"

// Process is the shape of inter-arrival times.
type Process struct {
	// Kind is "poisson" (exponential gaps, coefficient of variation 1) or
	// "gamma" (gamma-distributed gaps with coefficient of variation CV).
	Kind string
	// CV is the gamma process's coefficient of variation of the gaps, in
	// (0, 10]: below 1 smoother than Poisson, above 1 burstier. Ignored for
	// poisson.
	CV float64
}

// Validate reports an unknown Kind and, for gamma, a CV outside (0, 10].
func (p Process) Validate() error {
	switch p.Kind {
	case processPoisson:
		return nil
	case processGamma:
		if !(p.CV > 0 && p.CV <= processMaxCV) {
			return fmt.Errorf("%w: gamma CV %v is outside (0, %d]", errBadProcess, p.CV, processMaxCV)
		}
		return nil
	case "":
		return fmt.Errorf("%w: no kind: want %s or %s", errBadProcess, processPoisson, processGamma)
	}
	return fmt.Errorf("%w: unknown kind %q: want %s or %s", errBadProcess, p.Kind, processPoisson, processGamma)
}

// String is "poisson" or "gamma cv 1.5".
func (p Process) String() string {
	if p.Kind == processGamma {
		return "gamma cv " + scheduleNum(p.CV)
	}
	return p.Kind
}

// Arrivals returns the send offsets in [0, d), ascending, of process p
// driven by schedule s. The same seed gives the same offsets.
//
// It is a non-homogeneous renewal process made by time rescaling: gaps with
// mean 1 and p's shape are drawn in operational time u, and each cumulative
// u becomes the offset t where Λ(t) = ∫0^t s.Rate = u. So the expected
// number of arrivals in any window is the integral of the rate over it,
// stretches where the rate is zero get none, and at a constant rate the gaps
// have p's coefficient of variation. The process starts in equilibrium (the
// first gap is a forward recurrence time, not a whole gap), so the count has
// that mean from offset 0 on, not only after the first arrival. Λ is built in
// the cells Mean uses and taken as linear within each: exact for Constant
// and Steps, and for Diurnal an arrival moves by a small part of a cell,
// 1/4096 of the period.
//
// It returns nil if s is nil or d <= 0, and panics if p is invalid (see
// Process.Validate).
func Arrivals(p Process, s Schedule, d time.Duration, seed uint64) []time.Duration {
	if err := p.Validate(); err != nil {
		panic("loadtest.Arrivals: " + err.Error())
	}
	if s == nil || d <= 0 {
		return nil
	}
	g := newArrivalGaps(p, rand.New(rand.NewPCG(seed, arrivalStream)))
	var out []time.Duration
	u := g.first()
	w := newRateWalk(s, d)
	for w.next() {
		for u < w.lb {
			// Λ is linear in the cell: place u proportionally.
			t := w.a + time.Duration(float64(w.b-w.a)*(u-w.la)/(w.lb-w.la))
			out = append(out, min(max(t, w.a), w.b-1))
			u += g.next()
		}
	}
	return out
}

// arrivalGaps draws unit-mean gaps in operational time.
type arrivalGaps struct {
	rng   *rand.Rand
	gamma bool
	k     float64 // gamma shape, 1/CV²; the scale is 1/k for mean 1
}

func newArrivalGaps(p Process, rng *rand.Rand) *arrivalGaps {
	g := &arrivalGaps{rng: rng}
	if p.Kind == processGamma {
		g.gamma = true
		g.k = 1 / (p.CV * p.CV)
	}
	return g
}

// next is one gap.
func (g *arrivalGaps) next() float64 {
	if !g.gamma {
		return g.rng.ExpFloat64()
	}
	return randdist.Gamma(g.rng, g.k) / g.k
}

// first is the time from offset 0 to the first arrival of a renewal process
// in equilibrium: the gap that covers 0 is drawn length-biased, a Gamma(k+1)
// in place of a Gamma(k), and 0 falls uniformly within it. For exponential
// gaps this is again exponential.
func (g *arrivalGaps) first() float64 {
	if !g.gamma {
		return g.rng.ExpFloat64()
	}
	return g.rng.Float64() * randdist.Gamma(g.rng, g.k+1) / g.k
}
