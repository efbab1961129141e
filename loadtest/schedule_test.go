package loadtest

import (
	"errors"
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

// scheduleTestHourly is a day shaped like a web service's: quiet at night,
// a morning rise, the top at hour 14 and an evening tail.
var scheduleTestHourly = []float64{
	30, 22, 18, 15, 14, 16, 25, 45, 70, 90, 100, 110,
	115, 118, 120, 117, 112, 105, 95, 85, 75, 62, 50, 40,
}

func TestScheduleValidate(t *testing.T) {
	flat := slices.Repeat([]float64{7}, 24)
	negLevel := slices.Clone(scheduleTestHourly)
	negLevel[3] = -1
	tests := []struct {
		name string
		s    interface{ Validate() error }
		want string // substring of the error; "" for valid
	}{
		{"constant", Constant{RPS: 5}, ""},
		{"constant zero", Constant{}, ""},
		{"constant negative", Constant{RPS: -1}, "RPS -1 is negative"},
		{"constant NaN", Constant{RPS: math.NaN()}, "RPS is NaN"},
		{"constant infinite", Constant{RPS: math.Inf(1)}, "RPS is +Inf"},

		{"steps", Steps{{0, 1}, {time.Second, 0}, {2 * time.Second, 3}}, ""},
		{"steps late start", Steps{{5 * time.Second, 1}}, ""},
		{"steps empty", Steps{}, "no steps"},
		{"steps negative rate", Steps{{0, 1}, {time.Second, -2}}, "steps[1]: Rate -2 is negative"},
		{"steps negative at", Steps{{-time.Second, 1}}, "steps[0]: At -1s is negative"},
		{"steps equal ats", Steps{{0, 1}, {time.Second, 2}, {time.Second, 3}}, "steps[2]: At 1s is not after steps[1].At 1s"},
		{"steps decreasing ats", Steps{{2 * time.Second, 1}, {time.Second, 2}}, "steps[1]: At 1s is not after"},

		{"diurnal", Diurnal{Period: time.Minute, Min: 1, Max: 10, PeakAt: 0.25}, ""},
		{"diurnal flat", Diurnal{Period: time.Minute, Min: 4, Max: 4}, ""},
		{"diurnal hourly", Diurnal{Period: time.Minute, Min: 1, Max: 10, Hourly: scheduleTestHourly}, ""},
		{"diurnal zero period", Diurnal{Min: 1, Max: 10}, "Period 0s must be > 0"},
		{"diurnal negative period", Diurnal{Period: -time.Second, Max: 10}, "Period -1s must be > 0"},
		{"diurnal min above max", Diurnal{Period: time.Minute, Min: 12, Max: 10}, "Min 12 is above Max 10"},
		{"diurnal negative min", Diurnal{Period: time.Minute, Min: -1, Max: 10}, "Min -1 is negative"},
		{"diurnal peak at 1", Diurnal{Period: time.Minute, Max: 10, PeakAt: 1}, "PeakAt 1 is outside [0, 1)"},
		{"diurnal peak at negative", Diurnal{Period: time.Minute, Max: 10, PeakAt: -0.1}, "PeakAt -0.1 is outside [0, 1)"},
		{"diurnal peak at NaN", Diurnal{Period: time.Minute, Max: 10, PeakAt: math.NaN()}, "PeakAt NaN is outside"},
		{"diurnal short hourly", Diurnal{Period: time.Minute, Max: 10, Hourly: []float64{1, 2, 3}}, "Hourly has 3 levels"},
		{"diurnal negative level", Diurnal{Period: time.Minute, Max: 10, Hourly: negLevel}, "Hourly[3] is -1"},
		{"diurnal flat hourly", Diurnal{Period: time.Minute, Max: 10, Hourly: flat}, "Hourly levels are all 7"},

		{"scaled", Scaled{Constant{RPS: 2}, 1.5}, ""},
		{"scaled zero", Scaled{Constant{RPS: 2}, 0}, ""},
		{"scaled negative factor", Scaled{Constant{RPS: 2}, -1}, "Factor -1 must be finite"},
		{"scaled nothing", Scaled{nil, 1}, "no schedule"},
		{"scaled bad inner", Scaled{Diurnal{Period: time.Minute, Min: 3, Max: 1}, 2}, "scaled: invalid schedule: diurnal: Min 3 is above Max 1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.s.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate() = nil, want an error containing %q", tt.want)
			}
			if !errors.Is(err, errBadSchedule) {
				t.Errorf("Validate() = %v, does not wrap errBadSchedule", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Validate() = %q, want it to contain %q", err, tt.want)
			}
		})
	}
}

func TestScheduleString(t *testing.T) {
	tests := []struct {
		s    Schedule
		want string
	}{
		{Constant{RPS: 5}, "constant 5 req/s"},
		{Constant{RPS: 1.0 / 3}, "constant 0.3333 req/s"},
		{Constant{RPS: 12000}, "constant 12000 req/s"},
		{Diurnal{Period: 2 * time.Minute, Min: 1, Max: 12, PeakAt: 0.25}, "diurnal 1-12 req/s, period 2m0s, peak at 0.25"},
		{Diurnal{Period: time.Hour, Min: 0, Max: 3.5, PeakAt: 0.5, Hourly: scheduleTestHourly}, "diurnal 0-3.5 req/s, period 1h0m0s, peak at 0.5, hourly shape"},
		{Steps{{0, 2}, {30 * time.Second, 5}}, "steps 2 req/s from 0s, 5 req/s from 30s"},
		{Scaled{Constant{RPS: 4}, 1.5}, "1.5 x constant 4 req/s"},
	}
	for _, tt := range tests {
		t.Run(tt.want, func(t *testing.T) {
			if got := tt.s.String(); got != tt.want {
				t.Errorf("String() = %q, want %q", got, tt.want)
			}
		})
	}

	t.Run("many steps", func(t *testing.T) {
		var s Steps
		for i := range 20 {
			s = append(s, Step{At: time.Duration(i) * time.Second, Rate: float64(i)})
		}
		got := s.String()
		if !strings.HasSuffix(got, ", … (20 steps, peak 19 req/s)") || strings.Contains(got, "from 6s") {
			t.Errorf("String() = %q, want the first 6 steps and a summary", got)
		}
	})
}

func TestScheduleRate(t *testing.T) {
	steps := Steps{{2 * time.Second, 4}, {5 * time.Second, 0}, {7 * time.Second, 9}}
	cosine := Diurnal{Period: 100 * time.Second, Min: 2, Max: 10, PeakAt: 0.25}
	tests := []struct {
		name string
		s    Schedule
		at   time.Duration
		want float64
	}{
		{"constant", Constant{RPS: 3}, time.Hour, 3},
		{"steps before the first", steps, 2*time.Second - 1, 0},
		{"steps at the first", steps, 2 * time.Second, 4},
		{"steps inside", steps, 4 * time.Second, 4},
		{"steps zero stretch", steps, 6 * time.Second, 0},
		{"steps last lasts", steps, time.Hour, 9},
		{"cosine peak", cosine, 25 * time.Second, 10},
		{"cosine trough", cosine, 75 * time.Second, 2},
		{"cosine halfway", cosine, 50 * time.Second, 6},
		{"cosine next day", cosine, 125 * time.Second, 10},
		{"cosine before 0", cosine, -75 * time.Second, 10},
		{"scaled", Scaled{cosine, 0.5}, 25 * time.Second, 5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.s.Rate(tt.at); math.Abs(got-tt.want) > 1e-9 {
				t.Errorf("Rate(%v) = %v, want %v", tt.at, got, tt.want)
			}
		})
	}

	peaks := []struct {
		s    Schedule
		want float64
	}{
		{Constant{RPS: 3}, 3},
		{steps, 9},
		{cosine, 10},
		{Scaled{steps, 2}, 18},
	}
	for _, p := range peaks {
		if got := p.s.Peak(); got != p.want {
			t.Errorf("%v: Peak() = %v, want %v", p.s, got, p.want)
		}
	}
}

// TestDiurnalHourly checks that an hourly shape reaches exactly Min and Max,
// peaks at PeakAt, and passes through every level at its hour's centre once
// shifted.
func TestDiurnalHourly(t *testing.T) {
	const period = 240 * time.Second
	for _, peakAt := range []float64{0, 0.1, 0.5, 0.9} {
		d := Diurnal{Period: period, Min: 2, Max: 30, PeakAt: peakAt, Hourly: scheduleTestHourly}
		t.Run(scheduleNum(peakAt), func(t *testing.T) {
			const samples = 24_000 // every 10 ms; the extremes fall on multiples of it
			lo, hi, argmax := math.Inf(1), math.Inf(-1), time.Duration(0)
			for i := range samples {
				at := time.Duration(i) * period / samples
				r := d.Rate(at)
				if r < lo {
					lo = r
				}
				if r > hi {
					hi, argmax = r, at
				}
			}
			if math.Abs(lo-d.Min) > 1e-6 || math.Abs(hi-d.Max) > 1e-6 {
				t.Errorf("range [%v, %v], want [%v, %v]", lo, hi, d.Min, d.Max)
			}
			want := time.Duration(peakAt * float64(period))
			if diff := (argmax - want).Abs(); diff > 10*time.Millisecond && period-diff > 10*time.Millisecond {
				t.Errorf("peak at %v, want %v", argmax, want)
			}
			if got := d.Rate(want); math.Abs(got-d.Max) > 1e-9 {
				t.Errorf("Rate(PeakAt) = %v, want Max %v", got, d.Max)
			}
			// Hour h's level sits (h-14) hours of a compressed day after the
			// peak, hour 14 being the top.
			for h, level := range scheduleTestHourly {
				at := want + time.Duration(float64(h-14)/24*float64(period))
				wantRate := d.Min + (d.Max-d.Min)*(level-14)/(120-14)
				if got := d.Rate(at); math.Abs(got-wantRate) > 1e-6 {
					t.Errorf("hour %d: Rate(%v) = %v, want %v", h, at, got, wantRate)
				}
			}
			// The prepared form used for integration agrees.
			prep := schedulePrepared(d)
			if _, ok := prep.(shapedDiurnal); !ok {
				t.Fatalf("schedulePrepared gave %T", prep)
			}
			for i := range 1000 {
				at := time.Duration(i) * 977 * time.Millisecond
				if a, b := d.Rate(at), prep.Rate(at); a != b {
					t.Fatalf("Rate(%v): %v unprepared, %v prepared", at, a, b)
				}
			}
		})
	}
}

// scheduleTestRamp is a schedule from outside the package, which gives no
// hints about its integration: the rate rises by Slope req/s every second.
type scheduleTestRamp struct{ Slope float64 }

func (r scheduleTestRamp) Rate(t time.Duration) float64 { return r.Slope * max(t.Seconds(), 0) }
func (r scheduleTestRamp) Peak() float64                { return math.Inf(1) }
func (r scheduleTestRamp) String() string               { return "ramp" }

func TestMean(t *testing.T) {
	const (
		minR, maxR = 2.0, 14.0
		phase      = 0.3
	)
	period := 90 * time.Second
	cosine := Diurnal{Period: period, Min: minR, Max: maxR, PeakAt: phase}
	// cosineMean is the closed form of the raised cosine's mean over [0, d).
	cosineMean := func(d time.Duration) float64 {
		x := d.Seconds() / period.Seconds()
		p := period.Seconds()
		integral := minR*d.Seconds() + (maxR-minR)/2*(d.Seconds()+
			p/(2*math.Pi)*(math.Sin(2*math.Pi*(x-phase))-math.Sin(-2*math.Pi*phase)))
		return integral / d.Seconds()
	}
	// The cosine interpolation spends half of each hour-to-hour stretch on
	// either side of the midpoint, so over a whole day the mean is the mean
	// of the rescaled levels.
	hourly := Diurnal{Period: period, Min: minR, Max: maxR, PeakAt: phase, Hourly: scheduleTestHourly}
	var levels float64
	for _, v := range scheduleTestHourly {
		levels += (v - 14) / (120 - 14)
	}
	hourlyMean := minR + (maxR-minR)*levels/24

	steps := Steps{{10 * time.Second, 2}, {25*time.Second + 300*time.Microsecond, 5}, {40 * time.Second, 0}, {50 * time.Second, 1}}
	tests := []struct {
		name string
		s    Schedule
		d    time.Duration
		want float64
	}{
		{"constant", Constant{RPS: 7.5}, time.Minute, 7.5},
		{"constant short", Constant{RPS: 7.5}, 1500 * time.Microsecond, 7.5},
		{"steps", steps, time.Minute, (2*15.0003 + 5*14.9997 + 0*10 + 1*10) / 60},
		{"steps ending inside one", steps, 30 * time.Second, (2*15.0003 + 5*4.9997) / 30},
		{"steps before the first", steps, 10 * time.Second, 0},
		{"cosine one day", cosine, period, (minR + maxR) / 2},
		{"cosine three days", cosine, 3 * period, (minR + maxR) / 2},
		{"cosine part of a day", cosine, 37 * time.Second, cosineMean(37 * time.Second)},
		{"cosine two and a bit days", cosine, 200*time.Second + 123*time.Millisecond, cosineMean(200*time.Second + 123*time.Millisecond)},
		{"hourly one day", hourly, period, hourlyMean},
		{"hourly four days", hourly, 4 * period, hourlyMean},
		{"scaled cosine", Scaled{cosine, 2.5}, 2 * period, 2.5 * (minR + maxR) / 2},
		{"scaled steps", Scaled{steps, 3}, time.Minute, 3 * (2*15.0003 + 5*14.9997 + 10) / 60},
		{"long run", cosine, 3 * time.Hour, cosineMean(3 * time.Hour)},
		{"a schedule from elsewhere", scheduleTestRamp{Slope: 3}, 20*time.Second + 250*time.Microsecond, 1.5 * 20.00025},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Mean(tt.s, tt.d)
			// Steps and constants are exact up to rounding; the smooth
			// curves must be well within the 0.1% promised.
			tol := 1e-4 * math.Max(tt.want, 1e-9)
			if math.Abs(got-tt.want) > tol {
				t.Errorf("Mean(%v, %v) = %.9g, want %.9g (off by %.3g%%)", tt.s, tt.d, got, tt.want, 100*math.Abs(got-tt.want)/tt.want)
			}
		})
	}

	t.Run("empty window", func(t *testing.T) {
		if got := Mean(Constant{RPS: 3}, 0); got != 0 {
			t.Errorf("Mean over 0s = %v, want 0", got)
		}
		if got := Mean(nil, time.Second); got != 0 {
			t.Errorf("Mean(nil) = %v, want 0", got)
		}
	})
}
