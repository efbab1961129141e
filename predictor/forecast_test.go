package predictor

import (
	"math"
	"testing"
	"time"
)

var epoch = time.Date(2025, 6, 2, 0, 0, 0, 0, time.UTC)

// feeder drives a predictor's arrival counter from a rate function of the
// seconds since epoch, one sample a second, counting whole requests.
type feeder struct {
	p     *Predictor
	model string
	rate  func(sec float64) float64
	sec   int
	total float64
}

func (f *feeder) run(seconds int) {
	for range seconds {
		if f.sec > 0 {
			// Integrate over the second with the midpoint rule.
			f.total += f.rate(float64(f.sec) - 0.5)
		}
		f.p.ObserveArrivals(f.model, epoch.Add(time.Duration(f.sec)*time.Second), uint64(f.total))
		f.sec++
	}
}

func TestForecastConstant(t *testing.T) {
	p := newPredictor(t, Options{})
	if got := p.ForecastRate("m", time.Second); got != 0 {
		t.Errorf("unknown model: %g", got)
	}
	f := &feeder{p: p, model: "m", rate: func(float64) float64 { return 40 }}
	f.run(1)
	if got := p.ForecastRate("m", time.Second); got != 0 {
		t.Errorf("one sample: %g", got)
	}
	f.run(60)
	for _, h := range []time.Duration{0, time.Second, 10 * time.Second, time.Minute} {
		if got := p.ForecastRate("m", h); relErr(got, 40) > 0.05 {
			t.Errorf("horizon %v: %g, want 40 within 5%%", h, got)
		}
	}
	if a := p.Accuracy("m"); a.ObservedRate != 40 || relErr(a.ForecastRate, 40) > 0.05 {
		t.Errorf("accuracy %+v", a)
	}
}

func TestForecastRamp(t *testing.T) {
	p := newPredictor(t, Options{})
	// 10 req/s rising by 0.5 req/s every second.
	f := &feeder{p: p, model: "m", rate: func(s float64) float64 { return 10 + 0.5*s }}
	f.run(120)
	last := p.Accuracy("m").ObservedRate
	for _, h := range []time.Duration{time.Second, 10 * time.Second} {
		want := 10 + 0.5*(119.0+h.Seconds()-0.5)
		got := p.ForecastRate("m", h)
		t.Logf("horizon %v: forecast %.2f, true %.2f, last observed %.2f", h, got, want, last)
		if got <= last {
			t.Errorf("horizon %v: forecast %.2f not ahead of the last rate %.2f", h, got, last)
		}
		if relErr(got, want) > 0.02 {
			t.Errorf("horizon %v: forecast %.2f, want %.2f within 2%%", h, got, want)
		}
	}
}

func TestForecastStep(t *testing.T) {
	p := newPredictor(t, Options{})
	f := &feeder{p: p, model: "m", rate: func(s float64) float64 {
		if s < 60 {
			return 10
		}
		return 50
	}}
	f.run(61)
	n := 0
	for ; n < 100; n++ {
		if relErr(p.ForecastRate("m", time.Second), 50) <= 0.05 {
			break
		}
		f.run(1)
	}
	t.Logf("within 5%% of the new rate %d samples after the step", n)
	if n > 15 {
		t.Errorf("took %d samples to converge", n)
	}
	// It stays converged (the trend's overshoot dies down).
	f.run(30)
	if got := p.ForecastRate("m", time.Second); relErr(got, 50) > 0.05 {
		t.Errorf("30 s later: %g", got)
	}
	// A step down never forecasts a negative rate.
	f.rate = func(float64) float64 { return 0 }
	for range 20 {
		f.run(1)
		if got := p.ForecastRate("m", time.Minute); got < 0 {
			t.Fatalf("negative forecast %g", got)
		}
	}
}

func TestForecastIrregularSamples(t *testing.T) {
	p := newPredictor(t, Options{})
	at := epoch
	var total uint64
	p.ObserveArrivals("m", at, 0)
	for i := range 100 {
		dt := time.Duration(500+300*(i%4)) * time.Millisecond // 0.5s .. 1.4s
		at = at.Add(dt)
		total += uint64(20 * dt.Seconds())
		p.ObserveArrivals("m", at, total)
	}
	p.ObserveArrivals("m", at, total+100)                       // same instant: ignored
	p.ObserveArrivals("m", at.Add(time.Millisecond), total+100) // too close: ignored
	p.ObserveArrivals("m", at.Add(-time.Second), total+100)
	if got := p.Accuracy("m").ObservedRate; relErr(got, 20) > 0.1 {
		t.Errorf("last rate %g after ignored samples", got)
	}
	if got := p.ForecastRate("m", time.Second); relErr(got, 20) > 0.05 {
		t.Errorf("forecast %g, want 20", got)
	}
	// A counter reset (the server restarted) starts a new baseline.
	p.ObserveArrivals("m", at.Add(time.Second), 3)
	p.ObserveArrivals("m", at.Add(2*time.Second), 23)
	if got := p.Accuracy("m").ObservedRate; got != 20 {
		t.Errorf("rate after a reset %g, want 20", got)
	}
}

func TestForecastSeasonal(t *testing.T) {
	const period = 60.0 // seconds
	// Peak 150 at 15 s into each minute, trough 50 at 45 s.
	rate := func(s float64) float64 { return 100 + 50*math.Sin(2*math.Pi*s/period) }
	seasonalP := newPredictor(t, Options{Season: time.Minute})
	plainP := newPredictor(t, Options{Season: -1})
	fs := &feeder{p: seasonalP, model: "m", rate: rate}
	fp := &feeder{p: plainP, model: "m", rate: rate}
	// Two and three quarter periods: the last sample is at a trough, the
	// peak is 30 s ahead.
	fs.run(2*60 + 45 + 1)
	fp.run(2*60 + 45 + 1)
	h := 30 * time.Second
	truePeak := rate(float64(fs.sec-1) + h.Seconds())
	s, n := seasonalP.ForecastRate("m", h), plainP.ForecastRate("m", h)
	es, en := math.Abs(s-truePeak), math.Abs(n-truePeak)
	t.Logf("peak %.1f: seasonal forecast %.1f (error %.1f), non-seasonal %.1f (error %.1f)", truePeak, s, es, n, en)
	if es >= en {
		t.Errorf("seasonal error %.1f not below non-seasonal %.1f", es, en)
	}
	if es/truePeak > 0.1 {
		t.Errorf("seasonal forecast %.1f more than 10%% off the peak %.1f", s, truePeak)
	}
	// Over a whole period of horizons the seasonal forecast tracks the curve.
	var sumS, sumN float64
	for k := 1; k <= 60; k++ {
		hk := time.Duration(k) * time.Second
		want := rate(float64(fs.sec-1) + hk.Seconds())
		sumS += math.Abs(seasonalP.ForecastRate("m", hk)-want) / want
		sumN += math.Abs(plainP.ForecastRate("m", hk)-want) / want
	}
	t.Logf("mean abs %% error over the next minute: seasonal %.1f%%, non-seasonal %.1f%%", 100*sumS/60, 100*sumN/60)
	if sumS >= sumN || sumS/60 > 0.1 {
		t.Errorf("seasonal MAPE %.3f, non-seasonal %.3f", sumS/60, sumN/60)
	}
}

func TestForecastSeasonalNeedsTwoPeriods(t *testing.T) {
	rate := func(s float64) float64 { return 100 + 50*math.Sin(2*math.Pi*s/60) }
	p := newPredictor(t, Options{Season: time.Minute})
	q := newPredictor(t, Options{Season: -1})
	for _, pp := range []*Predictor{p, q} {
		(&feeder{p: pp, model: "m", rate: rate}).run(100) // 1.65 periods
	}
	if a, b := p.ForecastRate("m", 30*time.Second), q.ForecastRate("m", 30*time.Second); a != b {
		t.Errorf("with less than two periods the seasonal predictor forecasts %g, the plain one %g", a, b)
	}
}

func TestSeasonalSlots(t *testing.T) {
	for _, tt := range []struct {
		season time.Duration
		slots  int
		width  time.Duration
	}{
		{24 * time.Hour, 288, 5 * time.Minute},
		{time.Minute, 60, time.Second},
		{500 * time.Millisecond, 1, 500 * time.Millisecond},
	} {
		s := newSeasonal(tt.season)
		if len(s.slots) != tt.slots || s.width != tt.width {
			t.Errorf("season %v: %d slots of %v, want %d of %v", tt.season, len(s.slots), s.width, tt.slots, tt.width)
		}
		if k := s.slot(epoch.Add(tt.season - 1)); k != tt.slots-1 {
			t.Errorf("season %v: last instant in slot %d", tt.season, k)
		}
		if k := s.slot(time.Unix(-1, 0)); k < 0 || k >= tt.slots {
			t.Errorf("season %v: slot %d before 1970", tt.season, k)
		}
	}
}
