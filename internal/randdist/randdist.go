// Package randdist draws from the distributions that the load generator
// and the scheduler's tests both need, from a caller's *rand.Rand so that
// runs repeat. It owns the sampling algorithms only: no clocks, no state.
package randdist

import (
	"math"
	"math/rand/v2"
)

// Gamma samples a gamma distribution with shape k > 0 and scale 1 by
// Marsaglia and Tsang's method ("A simple method for generating gamma
// variables", 2000). For k < 1 it draws shape k+1 and multiplies by
// U^(1/k).
func Gamma(rng *rand.Rand, k float64) float64 {
	if k < 1 {
		u := 1 - rng.Float64() // (0, 1]
		return Gamma(rng, k+1) * math.Pow(u, 1/k)
	}
	d := k - 1.0/3
	c := 1 / math.Sqrt(9*d)
	for {
		x := rng.NormFloat64()
		v := 1 + c*x
		if v <= 0 {
			continue
		}
		v = v * v * v
		u := 1 - rng.Float64() // (0, 1]
		x2 := x * x
		if u < 1-0.0331*x2*x2 {
			return d * v
		}
		if math.Log(u) < 0.5*x2+d*(1-v+math.Log(v)) {
			return d * v
		}
	}
}
