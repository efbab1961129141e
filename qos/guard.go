package qos

import "math"

// guard checks admission's promises against what became of them, for one
// model: a request admitted behind a backlog is promised to start within
// a wait (the queue ahead played forward, and the room for its error),
// times the guard's factor, soon enough to finish by its deadline. The
// factor moves up a step of guardQuantile each time such a request is
// dropped at its deadline still waiting or ends late, and down a step of
// 1-guardQuantile each time any request of the model starts, between 1
// and maxGuardFactor: it settles where about 1-guardQuantile of the
// requests are dropped or late, or at 1 where fewer are (the stochastic
// approximation of a quantile).
//
// The room is read from a window of recent executions, and on a busy host
// the runner's share swings faster than the window follows: when the
// server's own work rose with an overload the executions went from 3.5 to
// 14 times their predictions within a second, and the requests admitted
// on the window's 3.5 were dropped with more than 100 ms of their
// promise's slack left (TestE2EAdmissionBusyHost, 14-22% of the admitted
// dropped). The guard follows what became of the promises, not how they
// were made. Requests admitted without a backlog (no room checked) are
// promised nothing and raise nothing, but their starts bring the factor
// down: counted only for promised requests, a burst of drops in a closed
// loop raised it to 2.9, it refused what would have been promised, and
// it stayed there (2,113 of 7,876 requests of sixteen closed-loop clients
// refused).
type guard struct {
	factor float64 // 0 means 1
}

const (
	// guardQuantile is the share of the requests the factor keeps from
	// being dropped or late.
	guardQuantile = 0.98
	// guardStep sets how fast the factor moves: up about 5% a request
	// dropped or late, down 0.1% a request started.
	guardStep = 0.05
	// maxGuardFactor bounds the factor: admission keeps admitting behind
	// a backlog (a third of the SLO's wait at the bound).
	maxGuardFactor = 3
)

// get is the factor admission multiplies a promised wait by.
func (g *guard) get() float64 { return max(g.factor, 1) }

// started moves the factor down for a request that started.
func (g *guard) started() { g.move(-guardStep * (1 - guardQuantile)) }

// missed moves the factor up for a request admitted behind a backlog that
// was dropped at its deadline or ended late.
func (g *guard) missed() { g.move(guardStep * guardQuantile) }

func (g *guard) move(step float64) {
	g.factor = min(max(g.get()*math.Exp(step), 1), maxGuardFactor)
}
