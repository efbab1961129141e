package randdist

import (
	"math"
	"math/rand/v2"
	"strconv"
	"testing"
)

// TestGamma checks the sampler's mean and variance for shapes on both
// sides of 1: the mean of n draws is within 5√(k/n) of k, the sample
// variance within 5k√((2+6/k)/n) of k.
func TestGamma(t *testing.T) {
	const n = 200_000
	for _, k := range []float64{0.01, 0.04, 0.25, 0.7, 1, 2.5, 30, 1e4} {
		t.Run(strconv.FormatFloat(k, 'g', -1, 64), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(5, uint64(k*1000)))
			var sum, sumsq float64
			xs := make([]float64, n)
			for i := range xs {
				xs[i] = Gamma(rng, k)
				if xs[i] < 0 || math.IsNaN(xs[i]) {
					t.Fatalf("draw %v", xs[i])
				}
				sum += xs[i]
			}
			mean := sum / n
			for _, x := range xs {
				sumsq += (x - mean) * (x - mean)
			}
			variance := sumsq / (n - 1)
			if tol := 5 * math.Sqrt(k/n); math.Abs(mean-k) > tol {
				t.Errorf("mean %.5g, want %v ± %.3g", mean, k, tol)
			}
			if tol := 5 * k * math.Sqrt((2+6/k)/n); math.Abs(variance-k) > tol {
				t.Errorf("variance %.5g, want %v ± %.3g", variance, k, tol)
			}
		})
	}
}
