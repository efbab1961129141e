package loadtest

import (
	"errors"
	"fmt"
	"math"
	goruntime "runtime"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"
)

func TestProcessValidate(t *testing.T) {
	tests := []struct {
		p    Process
		want string // substring of the error; "" for valid
	}{
		{Process{Kind: "poisson"}, ""},
		{Process{Kind: "poisson", CV: -3}, ""}, // CV is ignored
		{Process{Kind: "gamma", CV: 0.5}, ""},
		{Process{Kind: "gamma", CV: 10}, ""},
		{Process{Kind: "gamma"}, "gamma CV 0 is outside (0, 10]"},
		{Process{Kind: "gamma", CV: -1}, "gamma CV -1 is outside"},
		{Process{Kind: "gamma", CV: 10.5}, "gamma CV 10.5 is outside"},
		{Process{Kind: "gamma", CV: math.NaN()}, "gamma CV NaN is outside"},
		{Process{Kind: "gamma", CV: math.Inf(1)}, "gamma CV +Inf is outside"},
		{Process{Kind: "weibull", CV: 1}, `unknown kind "weibull"`},
		{Process{Kind: "Poisson"}, `unknown kind "Poisson"`},
		{Process{}, "no kind"},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%s/%v", tt.p.Kind, tt.p.CV), func(t *testing.T) {
			err := tt.p.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil || !errors.Is(err, errBadProcess) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate() = %v, want errBadProcess containing %q", err, tt.want)
			}
		})
	}

	t.Run("Arrivals panics", func(t *testing.T) {
		defer func() {
			if recover() == nil {
				t.Error("Arrivals with an invalid process did not panic")
			}
		}()
		Arrivals(Process{Kind: "gamma"}, Constant{RPS: 1}, time.Second, 1)
	})
}

func TestProcessString(t *testing.T) {
	for _, tt := range []struct {
		p    Process
		want string
	}{
		{Process{Kind: "poisson", CV: 3}, "poisson"},
		{Process{Kind: "gamma", CV: 1.5}, "gamma cv 1.5"},
	} {
		if got := tt.p.String(); got != tt.want {
			t.Errorf("%#v.String() = %q, want %q", tt.p, got, tt.want)
		}
	}
}

// arrivalGapStats returns the mean, coefficient of variation and lag-1
// autocorrelation of the gaps between offsets.
func arrivalGapStats(offs []time.Duration) (mean, cv, lag1 float64) {
	gaps := make([]float64, len(offs)-1)
	for i := range gaps {
		gaps[i] = (offs[i+1] - offs[i]).Seconds()
	}
	for _, g := range gaps {
		mean += g
	}
	mean /= float64(len(gaps))
	var ss, cross float64
	for i, g := range gaps {
		ss += (g - mean) * (g - mean)
		if i > 0 {
			cross += (g - mean) * (gaps[i-1] - mean)
		}
	}
	return mean, math.Sqrt(ss/float64(len(gaps)-1)) / mean, cross / ss
}

// arrivalCount is the number of offsets in [a, b); offs ascending.
func arrivalCount(offs []time.Duration, a, b time.Duration) int {
	lo := sort.Search(len(offs), func(i int) bool { return offs[i] >= a })
	hi := sort.Search(len(offs), func(i int) bool { return offs[i] >= b })
	return hi - lo
}

// arrivalCheckOrder fails unless offs are ascending and within [0, d).
func arrivalCheckOrder(t *testing.T, offs []time.Duration, d time.Duration) {
	t.Helper()
	if !slices.IsSorted(offs) {
		t.Error("offsets are not ascending")
	}
	if len(offs) > 0 && (offs[0] < 0 || offs[len(offs)-1] >= d) {
		t.Errorf("offsets span [%v, %v], want within [0, %v)", offs[0], offs[len(offs)-1], d)
	}
}

// TestArrivalsConstantRate checks the count and the gaps' shape at a
// constant rate.
//
// Tolerances: a renewal process with gap CV c run for an expected m
// arrivals has a count with variance about c²m, so the count must be within
// 4c√m. The sample CV of n gamma gaps has, by the delta method, relative
// standard error √((1+c²)/(2n)): Var(s²)/σ⁴ = (2+6c²)/n from the gamma's
// kurtosis, Var(mean)/μ² = c²/n, and their covariance, from the skewness,
// takes off 2c²/n. The CV must be within 5 of those standard errors
// (±0.011 for Poisson over 200,000 gaps, far inside ±0.05). Gaps of a
// renewal process are independent, so the lag-1 autocorrelation must be
// within 5/√n of 0.
func TestArrivalsConstantRate(t *testing.T) {
	const (
		rate = 500.0
		d    = 400 * time.Second
	)
	for _, p := range []Process{
		{Kind: "poisson"},
		{Kind: "gamma", CV: 0.2},
		{Kind: "gamma", CV: 0.5},
		{Kind: "gamma", CV: 1},
		{Kind: "gamma", CV: 2},
		{Kind: "gamma", CV: 4},
	} {
		t.Run(p.String(), func(t *testing.T) {
			offs := Arrivals(p, Constant{RPS: rate}, d, 42)
			arrivalCheckOrder(t, offs, d)
			c := 1.0
			if p.Kind == "gamma" {
				c = p.CV
			}
			m := rate * d.Seconds()
			if dev := math.Abs(float64(len(offs)) - m); dev > 4*c*math.Sqrt(m) {
				t.Errorf("%d arrivals, want %v ± %.0f", len(offs), m, 4*c*math.Sqrt(m))
			}
			n := float64(len(offs) - 1)
			mean, cv, lag1 := arrivalGapStats(offs)
			if tol := 5 * c / math.Sqrt(n); math.Abs(mean*rate-1) > tol {
				t.Errorf("mean gap %v s, want %v ± %.2g%%", mean, 1/rate, 100*tol)
			}
			if tol := 5 * c * math.Sqrt((1+c*c)/(2*n)); math.Abs(cv-c) > tol {
				t.Errorf("gap CV %.4f, want %v ± %.4f", cv, c, tol)
			}
			if tol := 5 / math.Sqrt(n); math.Abs(lag1) > tol {
				t.Errorf("lag-1 autocorrelation of gaps %.4f, want 0 ± %.4f", lag1, tol)
			}
		})
	}
}

func TestArrivalsSeed(t *testing.T) {
	s := Diurnal{Period: 10 * time.Second, Min: 5, Max: 50, PeakAt: 0.3}
	for _, p := range []Process{{Kind: "poisson"}, {Kind: "gamma", CV: 0.7}, {Kind: "gamma", CV: 3}} {
		t.Run(p.String(), func(t *testing.T) {
			a := Arrivals(p, s, 30*time.Second, 7)
			b := Arrivals(p, s, 30*time.Second, 7)
			c := Arrivals(p, s, 30*time.Second, 8)
			if len(a) == 0 {
				t.Fatal("no arrivals")
			}
			if !slices.Equal(a, b) {
				t.Error("the same seed gave different arrivals")
			}
			if slices.Equal(a, c) {
				t.Error("different seeds gave the same arrivals")
			}
		})
	}
}

// TestArrivalsFollowSchedule checks counts in windows against the integral
// of the rate over them. Each window's count is within 4.5 standard
// deviations (√(c²·expected)), and the windows together pass a chi-square
// test: the sum of squared standardised deviations of W windows is within
// 5√(2W) of W.
func TestArrivalsFollowSchedule(t *testing.T) {
	const (
		minR, maxR = 20.0, 300.0
		phase      = 0.7
	)
	period := 50 * time.Second
	cosine := Diurnal{Period: period, Min: minR, Max: maxR, PeakAt: phase}
	// cosineIntegral is ∫0^t of the cosine schedule, in closed form.
	cosineIntegral := func(t time.Duration) float64 {
		x, p := t.Seconds(), period.Seconds()
		return minR*x + (maxR-minR)/2*(x+p/(2*math.Pi)*(math.Sin(2*math.Pi*(x/p-phase))+math.Sin(2*math.Pi*phase)))
	}
	steps := Steps{
		{1 * time.Second, 200},
		{4*time.Second + 500*time.Microsecond, 0},
		{7 * time.Second, 1000},
		{8 * time.Second, 50},
		{20 * time.Second, 0},
		{22 * time.Second, 400},
	}
	stepsIntegral := func(t time.Duration) float64 {
		var sum float64
		for i, st := range steps {
			end := t
			if i+1 < len(steps) {
				end = min(end, steps[i+1].At)
			}
			if end > st.At {
				sum += st.Rate * (end - st.At).Seconds()
			}
		}
		return sum
	}

	tests := []struct {
		name     string
		s        Schedule
		integral func(time.Duration) float64
		d        time.Duration
		window   time.Duration
	}{
		{"cosine", cosine, cosineIntegral, 3 * period, period / 25},
		{"scaled cosine", Scaled{cosine, 0.5}, func(t time.Duration) float64 { return cosineIntegral(t) / 2 }, 3 * period, period / 25},
		{"steps", steps, stepsIntegral, 30 * time.Second, 500 * time.Millisecond},
		{"ramp from elsewhere", scheduleTestRamp{Slope: 20}, func(t time.Duration) float64 { return 10 * t.Seconds() * t.Seconds() }, 20 * time.Second, 250 * time.Millisecond},
	}
	for _, tt := range tests {
		for _, p := range []Process{{Kind: "poisson"}, {Kind: "gamma", CV: 0.5}, {Kind: "gamma", CV: 2}} {
			t.Run(tt.name+"/"+p.String(), func(t *testing.T) {
				offs := Arrivals(p, tt.s, tt.d, 2024)
				arrivalCheckOrder(t, offs, tt.d)
				c := 1.0
				if p.Kind == "gamma" {
					c = p.CV
				}
				var chi2 float64
				var windows int
				for a := time.Duration(0); a < tt.d; a += tt.window {
					b := a + tt.window
					want := tt.integral(b) - tt.integral(a)
					got := arrivalCount(offs, a, b)
					if want == 0 {
						if got != 0 {
							t.Errorf("[%v, %v): %d arrivals where the rate is 0", a, b, got)
						}
						continue
					}
					sd := c * math.Sqrt(want)
					z := (float64(got) - want) / sd
					if math.Abs(z) > 4.5 {
						t.Errorf("[%v, %v): %d arrivals, want %.1f ± %.1f", a, b, got, want, 4.5*sd)
					}
					chi2 += z * z
					windows++
				}
				if w := float64(windows); math.Abs(chi2-w) > 5*math.Sqrt(2*w) {
					t.Errorf("chi-square %.1f over %d windows, want %d ± %.1f", chi2, windows, windows, 5*math.Sqrt(2*w))
				}
			})
		}
	}
}

// TestArrivalsZeroRate checks that stretches of zero rate get no arrivals,
// to the nanosecond at the steps' edges.
func TestArrivalsZeroRate(t *testing.T) {
	steps := Steps{{time.Second, 1000}, {2*time.Second + 1, 0}, {3*time.Second + 500*time.Microsecond, 1000}, {4 * time.Second, 0}}
	for _, p := range []Process{{Kind: "poisson"}, {Kind: "gamma", CV: 3}} {
		t.Run(p.String(), func(t *testing.T) {
			offs := Arrivals(p, steps, 5*time.Second, 3)
			for _, z := range [][2]time.Duration{{0, time.Second}, {2*time.Second + 1, 3*time.Second + 500*time.Microsecond}, {4 * time.Second, 5 * time.Second}} {
				if n := arrivalCount(offs, z[0], z[1]); n != 0 {
					t.Errorf("%d arrivals in [%v, %v), where the rate is 0", n, z[0], z[1])
				}
			}
			if n := arrivalCount(offs, time.Second, 2*time.Second+1); n < 800 {
				t.Errorf("%d arrivals in the first busy second, want about 1000", n)
			}
		})
	}
	t.Run("steps inside cells", func(t *testing.T) {
		// 300 bursts of 4 ms at 100,000 req/s, each starting and ending
		// part of the way through a millisecond, with nothing between.
		var steps Steps
		for k := range 300 {
			on := time.Duration(k)*10*time.Millisecond + 370*time.Microsecond + time.Duration(k)*time.Microsecond
			steps = append(steps, Step{on, 1e5}, Step{on + 4*time.Millisecond, 0})
		}
		offs := Arrivals(Process{Kind: "gamma", CV: 0.3}, steps, 3*time.Second, 4)
		if len(offs) < 100_000 {
			t.Fatalf("%d arrivals, want about 120,000", len(offs))
		}
		for _, o := range offs {
			if steps.Rate(o) == 0 {
				t.Fatalf("an arrival at %v, where the rate is 0", o)
			}
		}
	})
	for _, s := range []Schedule{Constant{}, Diurnal{Period: time.Second}, Scaled{Constant{RPS: 10}, 0}} {
		if offs := Arrivals(Process{Kind: "poisson"}, s, time.Minute, 1); len(offs) != 0 {
			t.Errorf("%v: %d arrivals, want none", s, len(offs))
		}
	}
	if offs := Arrivals(Process{Kind: "poisson"}, nil, time.Minute, 1); offs != nil {
		t.Errorf("nil schedule: %d arrivals", len(offs))
	}
	if offs := Arrivals(Process{Kind: "poisson"}, Constant{RPS: 5}, 0, 1); offs != nil {
		t.Errorf("zero duration: %d arrivals", len(offs))
	}
}

// TestArrivalsEquilibrium checks that the count has its mean from offset 0
// on: averaged over many seeds, the number of arrivals in the first half gap
// is 1/2. A process that started with a whole gap would have almost none
// there when its gaps are regular (CV 0.2), and about 0.39 for Poisson-like
// ones. The mean of 4000 counts must be within 5 standard errors of 1/2.
func TestArrivalsEquilibrium(t *testing.T) {
	const (
		rate  = 100.0
		seeds = 4000
	)
	window := time.Duration(0.5 / rate * float64(time.Second))
	for _, p := range []Process{{Kind: "poisson"}, {Kind: "gamma", CV: 0.2}, {Kind: "gamma", CV: 3}} {
		t.Run(p.String(), func(t *testing.T) {
			var sum, sumsq float64
			for seed := range uint64(seeds) {
				c := float64(len(Arrivals(p, Constant{RPS: rate}, window, seed)))
				sum += c
				sumsq += c * c
			}
			mean := sum / seeds
			se := math.Sqrt((sumsq/seeds - mean*mean) / seeds)
			if math.Abs(mean-0.5) > 5*se {
				t.Errorf("mean count in the first half gap %.3f, want 0.5 ± %.3f", mean, 5*se)
			}
		})
	}
}

// arrivalFoldedBins counts offsets by where they fall in the day, in bins
// equal fractions of the period.
func arrivalFoldedBins(offs []time.Duration, period time.Duration, bins int) []int {
	counts := make([]int, bins)
	for _, o := range offs {
		counts[int(int64(o%period)*int64(bins)/int64(period))]++
	}
	return counts
}

// arrivalBinDistance is how many bins apart i and j are on a circle of n.
func arrivalBinDistance(i, j, n int) int {
	d := (i - j + n) % n
	return min(d, n-d)
}

// TestDiurnalPeak checks that the arrivals peak at PeakAt: for the cosine by
// the phase of the arrivals' first Fourier component, which for a raised
// cosine is exactly PeakAt, and for both by the busiest of 24 bins of the
// folded day.
func TestDiurnalPeak(t *testing.T) {
	const bins = 24
	period := 40 * time.Second
	for _, hourly := range []bool{false, true} {
		for _, peakAt := range []float64{0, 0.25, 0.6, 0.95} {
			d := Diurnal{Period: period, Min: 5, Max: 200, PeakAt: peakAt}
			if hourly {
				d.Hourly = scheduleTestHourly
			}
			t.Run(fmt.Sprintf("hourly=%v/%v", hourly, peakAt), func(t *testing.T) {
				offs := Arrivals(Process{Kind: "gamma", CV: 1.5}, d, 10*period, 99)
				if !hourly {
					var sx, sy float64
					for _, o := range offs {
						a := 2 * math.Pi * float64(o%period) / float64(period)
						sx += math.Cos(a)
						sy += math.Sin(a)
					}
					got := math.Atan2(sy, sx) / (2 * math.Pi)
					diff := math.Abs(got - peakAt)
					diff = math.Min(diff, 1-diff)
					if diff > 0.005 {
						t.Errorf("phase of the arrivals %.4f, want %v", got, peakAt)
					}
				}
				counts := arrivalFoldedBins(offs, period, bins)
				busiest := slices.Index(counts, slices.Max(counts))
				want := int(peakAt*bins) % bins
				if arrivalBinDistance(busiest, want, bins) > 1 {
					t.Errorf("busiest bin %d (%v), want %d ± 1 (counts %v)", busiest, counts[busiest], want, counts)
				}
				if hourly {
					// The quietest hour, 4, is ten hours before the top, 14.
					quietest := slices.Index(counts, slices.Min(counts))
					wantQ := (want - 10 + bins) % bins
					if arrivalBinDistance(quietest, wantQ, bins) > 1 {
						t.Errorf("quietest bin %d, want %d ± 1 (counts %v)", quietest, wantQ, counts)
					}
				}
			})
		}
	}
}

// TestArrivalsMillion checks that a million arrivals come out with a bounded
// cost per arrival. Time on a shared machine varies tenfold from run to run,
// so the test bounds what does not vary: the bytes allocated per arrival (the
// result itself is 8). BenchmarkArrivals measures the speed.
func TestArrivalsMillion(t *testing.T) {
	for _, p := range []Process{{Kind: "poisson"}, {Kind: "gamma", CV: 2}} {
		t.Run(p.String(), func(t *testing.T) {
			s := Diurnal{Period: 20 * time.Second, Min: 5000, Max: 15000}
			var before, after goruntime.MemStats
			goruntime.ReadMemStats(&before)
			start := time.Now()
			offs := Arrivals(p, s, 100*time.Second, 1)
			took := time.Since(start)
			goruntime.ReadMemStats(&after)
			perArrival := float64(after.TotalAlloc-before.TotalAlloc) / float64(len(offs))
			t.Logf("%d arrivals in %v, %.1f bytes allocated each", len(offs), took, perArrival)
			if len(offs) < 950_000 || len(offs) > 1_050_000 {
				t.Errorf("%d arrivals, want about a million", len(offs))
			}
			if perArrival > 64 {
				t.Errorf("%.1f bytes allocated per arrival, want at most 64", perArrival)
			}
		})
	}
}

func BenchmarkArrivals(b *testing.B) {
	s := Diurnal{Period: 20 * time.Second, Min: 5000, Max: 15000}
	for _, p := range []Process{{Kind: "poisson"}, {Kind: "gamma", CV: 0.5}, {Kind: "gamma", CV: 2}} {
		b.Run(p.String()+"/1e6", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				Arrivals(p, s, 100*time.Second, 1)
			}
		})
	}
}
