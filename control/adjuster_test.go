package control

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// The adjuster tests run a real qos.Scheduler and Adjuster in a synctest bubble
// with a fake predictor (latency from a formula, forecasts set by the test)
// and a fake actuator that records what it is asked to do. The default
// latency is t(b, s) = 10ms·b/s, which makes the targets computable by
// hand; see TestAdjusterLatencyCriticalTarget.

const gib = int64(1) << 30

// fakePredictor predicts latency with a formula and forecasts the rates the
// test sets.
type fakePredictor struct {
	mu      sync.Mutex
	latency func(model string, batch int, share float64) (time.Duration, bool)
	rates   map[string]float64
	arrived map[string]uint64
	shares  map[string]float64
	// horizons is the last horizon each model's forecast was asked for.
	horizons map[string]time.Duration
}

var _ Predictor = (*fakePredictor)(nil)

func newFakePredictor() *fakePredictor {
	return &fakePredictor{
		latency: func(_ string, b int, s float64) (time.Duration, bool) {
			return time.Duration(float64(10*ms) * float64(b) / s), true
		},
		rates:    map[string]float64{},
		arrived:  map[string]uint64{},
		shares:   map[string]float64{},
		horizons: map[string]time.Duration{},
	}
}

func (p *fakePredictor) Latency(model string, batch int, share float64) (time.Duration, bool) {
	p.mu.Lock()
	f := p.latency
	p.mu.Unlock()
	return f(model, batch, share)
}

func (p *fakePredictor) ObserveArrivals(model string, _ time.Time, arrived uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.arrived[model] = arrived
}

// ForecastRate returns the rate the test set whatever the horizon, and
// records the horizon.
func (p *fakePredictor) ForecastRate(model string, horizon time.Duration) float64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.horizons[model] = horizon
	return p.rates[model]
}

func (p *fakePredictor) horizon(model string) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.horizons[model]
}

func (p *fakePredictor) SetShare(model string, share float64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.shares[model] = share
}

func (p *fakePredictor) setRate(model string, r float64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rates[model] = r
}

func (p *fakePredictor) share(model string) float64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.shares[model]
}

// fakeActuator records the shares it is given and the evictions; it fails
// as told and reports the memory usage the test sets.
type fakeActuator struct {
	mu      sync.Mutex
	shares  map[string]limiter.Share
	calls   []string // "model=compute/memory@seconds"
	evicted []string
	fail    map[string]int // model: how many more SetShare calls fail
	usage   map[string]int64
	start   time.Time
}

var _ Actuator = (*fakeActuator)(nil)

var errActuator = errors.New("runner did not come up")

func newFakeActuator() *fakeActuator {
	return &fakeActuator{shares: map[string]limiter.Share{}, fail: map[string]int{}, usage: map[string]int64{}, start: time.Now()}
}

func (f *fakeActuator) SetShare(_ context.Context, model string, s limiter.Share) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, fmt.Sprintf("%s=%v/%d@%v", model, s.Compute, s.Memory, time.Since(f.start).Seconds()))
	if f.fail[model] > 0 {
		f.fail[model]--
		return errActuator
	}
	f.shares[model] = s
	return nil
}

func (f *fakeActuator) Evict(_ context.Context, model string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.evicted = append(f.evicted, model)
	f.usage[model] = 0
	return nil
}

func (f *fakeActuator) MemoryUsage(model string) int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.usage[model]
}

func (f *fakeActuator) share(model string) limiter.Share {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.shares[model]
}

func (f *fakeActuator) all() map[string]limiter.Share {
	f.mu.Lock()
	defer f.mu.Unlock()
	return maps.Clone(f.shares)
}

func (f *fakeActuator) computes() map[string]float64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]float64{}
	for m, s := range f.shares {
		out[m] = s.Compute
	}
	return out
}

func (f *fakeActuator) callLog() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

func (f *fakeActuator) evictions() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.evicted)
}

func (f *fakeActuator) set(fn func(f *fakeActuator)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

// adjHarness is a scheduler with fake models and an adjuster beside it.
type adjHarness struct {
	*harness
	pred   *fakePredictor
	act    *fakeActuator
	a      *Adjuster
	period time.Duration
	t0     time.Time // when the adjuster started
}

// newAdjHarness must be called inside a synctest bubble. The models are
// added to the scheduler, which runs; the adjuster does not run until
// start.
func newAdjHarness(t *testing.T, opts AdjusterOptions, specs ...qos.ModelSpec) *adjHarness {
	t.Helper()
	h := newHarness(t, qos.Options{DeviceSlots: 4})
	h.run()
	for _, spec := range specs {
		h.model(spec, nil)
	}
	ah := &adjHarness{harness: h, pred: newFakePredictor(), act: newFakeActuator()}
	if opts.Predictor == nil && opts.Policy != SharePolicyStatic && opts.Policy != SharePolicyShared {
		opts.Predictor = ah.pred
	}
	if opts.Actuator == nil {
		opts.Actuator = ah.act
	}
	if opts.Logger == nil {
		opts.Logger = testLogger(t)
	}
	a, err := NewAdjuster(h.s, opts)
	if err != nil {
		t.Fatal(err)
	}
	ah.a, ah.period = a, a.opts.Period
	return ah
}

// start runs the adjuster until the test ends; its first pass is done when
// start returns.
func (ah *adjHarness) start() {
	ctx, cancel := context.WithCancel(ah.t.Context())
	done := make(chan error, 1)
	ah.t0 = time.Now()
	go func() { done <- ah.a.Run(ctx) }()
	ah.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			ah.t.Errorf("adjuster Run: %v", err)
		}
	})
	synctest.Wait()
}

// tick lets one period pass and the adjuster's pass at its end finish.
func (ah *adjHarness) tick() {
	time.Sleep(ah.period)
	synctest.Wait()
}

// since is the fake time since the adjuster started, in seconds.
func (ah *adjHarness) since(at time.Time) float64 { return at.Sub(ah.t0).Seconds() }

// shareOf returns a model's entry in Shares.
func (ah *adjHarness) shareOf(model string) ModelShare {
	ah.t.Helper()
	for _, s := range ah.a.Shares() {
		if s.Model == model {
			return s
		}
	}
	ah.t.Fatalf("no share for %s in %+v", model, ah.a.Shares())
	return ModelShare{}
}

// kinds lists the events as "kind model" strings.
func kinds(events []Event) []string {
	var out []string
	for _, e := range events {
		out = append(out, e.Kind+" "+e.Model)
	}
	return out
}

func lastEvent(t *testing.T, a *Adjuster, model string) Event {
	t.Helper()
	events := a.Events(time.Time{}, 0)
	for i := len(events) - 1; i >= 0; i-- {
		if events[i].Model == model {
			return events[i]
		}
	}
	t.Fatalf("no event for %s", model)
	return Event{}
}

// The target of a latency-critical model, worked out by hand with
// t(b, s) = 10ms·b/s, SLO 100ms, headroom 0.1 (budget 90ms), quantile 0.99
// (z = 2.326), and the variability assumed before any is measured: arrival
// SCV ca² = 1, service SCV cs² = 0.1. With one slot the utilisation is
// ρ = rate·t/b, which must stay under 0.8; Erlang C is ρ, so the wait at
// p99 is (ca²/b + cs²)/2 · t/(1-ρ) · ln(ρ/0.01), and the latency at p99 is
// that plus the fill (b-1)/rate plus the execution at p99,
// t·(1 + 2.326·√0.1) = 1.736·t. Batching does not help the linear model
// (no fixed cost), so b = 1 wins: 1.736·t + 0.55·t/(1-ρ)·ln(100ρ) <= 90ms.
// Every latency-critical share is a floor, which the predictor is told is
// the whole device.
func TestAdjusterLatencyCriticalTarget(t *testing.T) {
	linear := func(_ string, b int, s float64) (time.Duration, bool) {
		return time.Duration(float64(10*ms) * float64(b) / s), true
	}
	// t(b, s) = (8ms + 2ms·b)/s has a fixed cost that batching amortises.
	fixed := func(_ string, b int, s float64) (time.Duration, bool) {
		return time.Duration(float64(8*ms+2*ms*time.Duration(b)) / s), true
	}
	for _, tc := range []struct {
		name    string
		spec    qos.ModelSpec
		latency func(string, int, float64) (time.Duration, bool)
		rate    float64
		want    float64
		reason  string
	}{
		// ρ = 0.5/s. 0.85 gives t = 11.8ms, ρ = 0.588, wait
		// 0.55·11.8/0.412·ln 58.8 = 64.0ms, execution 20.4ms: 84.4ms.
		// 0.80 gives t = 12.5ms, ρ = 0.625: 75.8 + 21.7 = 97.5ms, over 90.
		{"rate 50", qos.ModelSpec{MaxBatchSize: 4}, linear, 50, 0.85,
			"forecast 50.0 req/s needs 0.85 to meet 100ms at p99 (predicted 84.4ms at batch 1)"},
		// ρ = 0.1/s. 0.45 gives t = 22.2ms, ρ = 0.222, wait
		// 0.55·22.2/0.778·ln 22.2 = 48.7ms, execution 38.6ms: 87.3ms.
		// 0.40 gives t = 25ms, ρ = 0.25: 59.0 + 43.4 = 102.4ms, over 90.
		{"rate 10", qos.ModelSpec{MaxBatchSize: 4}, linear, 10, 0.45,
			"forecast 10.0 req/s needs 0.45 to meet 100ms at p99 (predicted 87.3ms at batch 1)"},
		// The minimum 0.5 is over the 0.45 the rate needs.
		{"rate 10 above the model's minimum", qos.ModelSpec{MaxBatchSize: 4, MinShare: 0.5}, linear, 10, 0.50,
			"forecast 10.0 req/s needs 0.50 to meet 100ms at p99"},
		// ρ = 1/s: over 0.8 at any share.
		{"rate 100 cannot be met", qos.ModelSpec{MaxBatchSize: 4}, linear, 100, 1,
			"forecast 100.0 req/s: cannot meet 100ms at p99 even at the maximum share 1.00 (utilisation over 0.80 at every batch size)"},
		{"rate 100 at the model's maximum", qos.ModelSpec{MaxBatchSize: 4, MaxShare: 0.7}, linear, 100, 0.7,
			"cannot meet 100ms at p99 even at the maximum share 0.70"},
		{"no traffic", qos.ModelSpec{MaxBatchSize: 4}, linear, 0, 0.05, "no traffic: minimum share 0.05"},
		// ρ = (0.8/b + 0.2)/s. At 0.80: b = 3 gives t = 17.5ms, ρ = 0.583,
		// fill 20ms, wait (1/3 + 0.1)/2·17.5/0.417·ln 58.3 = 37.0ms,
		// execution 30.4ms: 87.4ms (b = 2 is 113.7ms, b = 4 92.1ms). At
		// 0.75 the best is b = 3 at 96.6ms, over 90.
		{"batching", qos.ModelSpec{MaxBatchSize: 8}, fixed, 100, 0.80,
			"forecast 100.0 req/s needs 0.80 to meet 100ms at p99 (predicted 87.4ms at batch 3)"},
		// Two slots halve ρ and Erlang C is 2ρ²/(1+ρ). 0.45 gives
		// t = 22.2ms, ρ = 0.556, Pw = 0.397, wait
		// 0.55·22.2/(2·0.444)·ln 39.7 = 50.6ms, execution 38.6ms: 89.2ms;
		// 0.40 gives ρ = 0.625, Pw = 0.481: 71.0 + 43.4 = 114.4ms. One
		// slot needs 0.85 for the same rate.
		{"two slots", qos.ModelSpec{MaxBatchSize: 1, Slots: 2}, linear, 50, 0.45,
			"forecast 50.0 req/s needs 0.45 to meet 100ms at p99 (predicted 89.2ms at batch 1)"},
		{"no prediction yet", qos.ModelSpec{MaxBatchSize: 4}, func(string, int, float64) (time.Duration, bool) { return 0, false }, 50, 1,
			"no prediction yet: keeping 1.00"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				spec := tc.spec
				spec.Name, spec.Class, spec.SLO = "m", lc, 100*ms
				ah := newAdjHarness(t, AdjusterOptions{}, spec)
				ah.pred.latency = tc.latency
				ah.pred.setRate("m", tc.rate)
				ah.start()
				if got := ah.act.share("m"); got.Compute != tc.want || got.Mode != limiter.ModeFloor {
					t.Errorf("share = %+v, want a floor of %v", got, tc.want)
				}
				if got := ah.pred.share("m"); got != 1 {
					t.Errorf("predictor told %v, want 1 (a floor takes idle compute)", got)
				}
				if got := ah.pred.horizon("m"); got != 2*ah.period {
					t.Errorf("forecast asked %s ahead, want two periods", got)
				}
				e := lastEvent(t, ah.a, "m")
				if e.Kind != EventResize || !strings.Contains(e.Reason, tc.reason) {
					t.Errorf("event %s %q, want resize with %q", e.Kind, e.Reason, tc.reason)
				}
			})
		})
	}
}

// A load step raises the share in the very next pass.
func TestAdjusterScalesUpAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{}, qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 4})
		ah.pred.setRate("m", 10)
		ah.start()
		// Targets from TestAdjusterLatencyCriticalTarget: 10 req/s 0.45,
		// 50 req/s 0.85.
		if got := ah.act.share("m").Compute; got != 0.45 {
			t.Fatalf("share at 10 req/s = %v, want 0.45", got)
		}
		ah.pred.setRate("m", 50)
		ah.tick()
		if got := ah.act.share("m").Compute; got != 0.85 {
			t.Errorf("share one period after the step to 50 req/s = %v, want 0.85", got)
		}
		e := lastEvent(t, ah.a, "m")
		want := Event{
			Time: ah.rec.start.Add(time.Second), Model: "m", Kind: EventResize,
			Old: limiter.Share{Compute: 0.45, Mode: limiter.ModeFloor}, New: limiter.Share{Compute: 0.85, Mode: limiter.ModeFloor},
			Reason:       "forecast 50.0 req/s needs 0.85 to meet 100ms at p99 (predicted 84.4ms at batch 1)",
			Predicted:    e.Predicted,
			ForecastRate: 50,
		}
		if e != want {
			t.Errorf("event = %+v\nwant %+v", e, want)
		}
		if e.Predicted.Round(100*time.Microsecond) != 84400*time.Microsecond {
			t.Errorf("predicted %s, want 84.4ms", e.Predicted)
		}
		if got := ah.act.callLog(); !slices.Equal(got, []string{"m=0.45/0@0", "m=0.85/0@1"}) {
			t.Errorf("SetShare calls = %v", got)
		}
	})
}

// A share shrinks only after ScaleDownAfter of slack, and Cooldown after
// its last change, to the largest target of the window.
func TestAdjusterScaleDownHysteresis(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{ScaleDownAfter: 2 * time.Second, Cooldown: 4 * time.Second},
			qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 4})
		// Targets (worked out as in TestAdjusterLatencyCriticalTarget, all
		// at b = 1 and under the capacity): 10 req/s 0.45 (87.3ms), 25
		// req/s 0.60 (87.5ms), 30 req/s 0.65 (86.9ms), 40 req/s 0.75
		// (85.6ms), 60 req/s 0.95 (83.4ms); one step less is over 90ms for
		// each.
		steps := []struct {
			rate float64
			want float64
			why  string
		}{
			{40, 0.75, "first pass"},
			{10, 0.75, "slack for 0s"},
			{60, 0.95, "load is back and more: up at once, slack forgotten"},
			{30, 0.95, "slack for 0s"},
			{25, 0.95, "slack for 1s"},
			{10, 0.95, "slack for 2s, but the last change was 3s ago, under the cooldown"},
			{10, 0.60, "slack for 3s, 4s since the last change: the largest target of the last 2s"},
			{10, 0.60, "slack begins again below 0.60"},
			{10, 0.60, "slack for 1s"},
			{10, 0.60, "slack for 2s, cooldown not over"},
			{10, 0.45, "cooldown over"},
			{10, 0.45, "steady"},
		}
		for i, s := range steps {
			ah.pred.setRate("m", s.rate)
			if i == 0 {
				ah.start()
			} else {
				ah.tick()
			}
			if got := ah.act.share("m").Compute; got != s.want {
				t.Fatalf("t=%ds (%s): share %v, want %v", i, s.why, got, s.want)
			}
		}
		var reasons []string
		for _, e := range ah.a.Events(time.Time{}, 0) {
			reasons = append(reasons, fmt.Sprintf("%.0f %s", ah.since(e.Time), e.Reason))
		}
		want := []string{
			"0 forecast 40.0 req/s needs 0.75 to meet 100ms at p99 (predicted 85.6ms at batch 1)",
			"2 forecast 60.0 req/s needs 0.95 to meet 100ms at p99 (predicted 83.4ms at batch 1)",
			"6 slack for 3s: 0.95 -> 0.60; forecast 10.0 req/s needs 0.45 to meet 100ms at p99 (predicted 87.3ms at batch 1)",
			"10 slack for 3s: 0.60 -> 0.45; forecast 10.0 req/s needs 0.45 to meet 100ms at p99 (predicted 87.3ms at batch 1)",
		}
		if !slices.Equal(reasons, want) {
			t.Errorf("events:\n%s\nwant\n%s", strings.Join(reasons, "\n"), strings.Join(want, "\n"))
		}
		if n := len(ah.act.callLog()); n != 4 {
			t.Errorf("%d SetShare calls, want 4 (one a change)", n)
		}
		if got := ah.shareOf("m"); got.Target != 0.45 || got.Share.Compute != 0.45 {
			t.Errorf("Shares: %+v", got)
		}
	})
}

// Best-effort models with demand split what latency-critical ones leave,
// weighted 1/priority rank; idle ones keep the minimum. When a
// latency-critical model needs what they hold, they give it back at once.
func TestAdjusterBestEffortGetsTheRest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{},
			qos.ModelSpec{Name: "lc", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
			qos.ModelSpec{Name: "be1", Class: be, Priority: 1},
			qos.ModelSpec{Name: "be2", Class: be, Priority: 2},
			qos.ModelSpec{Name: "idle", Class: be},
		)
		ah.pred.setRate("lc", 30) // 0.65, see TestAdjusterScaleDownHysteresis
		ah.pred.setRate("be1", 5)
		ah.pred.setRate("be2", 5)
		ah.start()
		// The floor of 0.65 keeps from the best-effort caps twice what lc
		// keeps busy at full speed: 2 · 30 · 10ms = 0.6. 1 - 0.6 - 0.05
		// (idle) = 0.35: be1 gets twice what be2 gets.
		want := map[string]float64{"lc": 0.65, "be1": 0.2333, "be2": 0.1166, "idle": 0.05}
		if got := ah.act.computes(); !maps.Equal(got, want) {
			t.Errorf("shares = %v\nwant %v", got, want)
		}
		// The latency-critical share is a floor sized for the rate two
		// periods ahead; the best-effort ones run in the background and
		// are sized for the next period.
		for name, want := range map[string]limiter.Mode{"lc": limiter.ModeFloor, "be1": limiter.ModeBackground, "idle": limiter.ModeBackground} {
			if got := ah.act.share(name).Mode; got != want {
				t.Errorf("%s mode %v, want %v", name, got, want)
			}
		}
		if lcH, beH := ah.pred.horizon("lc"), ah.pred.horizon("be1"); lcH != 2*ah.period || beH != ah.period {
			t.Errorf("forecast horizons: lc %s, be1 %s; want %s and %s", lcH, beH, 2*ah.period, ah.period)
		}
		if e := lastEvent(t, ah.a, "be2"); e.Reason != "best-effort: 0.12 of the 0.35 left (priority rank 2)" {
			t.Errorf("be2 reason %q", e.Reason)
		}
		if e := lastEvent(t, ah.a, "idle"); e.Reason != "best-effort, idle: minimum share 0.05" {
			t.Errorf("idle reason %q", e.Reason)
		}

		// 45 req/s needs 0.80: t = 12.5ms, ρ = 0.5625, wait
		// 0.55·12.5/0.4375·ln 56.25 = 63.3ms, execution 21.7ms: 85.0ms;
		// 0.75 gives 75.1 + 23.1 = 98.2ms, over 90.
		ah.pred.setRate("lc", 45)
		ah.tick()
		// Its reserve, 2 · 0.45 = 0.9, is over the floor: all of the 0.80
		// is kept, 0.15 left: be2 is at its minimum.
		want = map[string]float64{"lc": 0.8, "be1": 0.1, "be2": 0.05, "idle": 0.05}
		if got := ah.act.computes(); !maps.Equal(got, want) {
			t.Errorf("after lc grew: shares = %v\nwant %v", got, want)
		}
		if e := lastEvent(t, ah.a, "be1"); e.Reason != "capacity needed by other models: 0.23 -> 0.10; best-effort: 0.10 of the 0.15 left (priority rank 1)" {
			t.Errorf("be1 reason %q", e.Reason)
		}

		// Back down: the latency-critical floor stays through the
		// hysteresis, but what it keeps from the best-effort caps follows
		// the rate at once (its reserve is 0.6 again): the background
		// work gets the idle compute back without waiting.
		ah.pred.setRate("lc", 30)
		ah.tick()
		want = map[string]float64{"lc": 0.8, "be1": 0.2333, "be2": 0.1166, "idle": 0.05}
		if got := ah.act.computes(); !maps.Equal(got, want) {
			t.Errorf("within the hysteresis: shares = %v\nwant %v", got, want)
		}
		for range 9 { // slack from 2s to 11s
			ah.tick()
		}
		ah.tick()
		want["lc"] = 0.65
		if got := ah.act.computes(); !maps.Equal(got, want) {
			t.Errorf("after the hysteresis: shares = %v\nwant %v", got, want)
		}
		calls := ah.act.callLog()
		if got := calls[len(calls)-1]; got != "lc=0.65/0@12" {
			t.Errorf("last call %v, want lc=0.65/0@12", got)
		}
	})
}

// Latency-critical targets over the capacity are scaled down, lower
// priorities more.
func TestAdjusterScalesLatencyCriticalToCapacity(t *testing.T) {
	for _, tc := range []struct {
		name     string
		capacity float64
		prio     [2]int
		want     [2]float64
	}{
		// 30 req/s each: targets 0.65 + 0.65 = 1.30 over 1 (see
		// TestAdjusterScaleDownHysteresis). Each gives up its target ×
		// its rank × θ; 0.65θ + 1.30θ = 0.30: θ = 0.154, cuts 0.10 and
		// 0.20. Equal ranks over 0.8 give up 0.25 each.
		{"priorities", 1, [2]int{1, 2}, [2]float64{0.55, 0.45}},
		{"equal", 0.8, [2]int{0, 0}, [2]float64{0.4, 0.4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ah := newAdjHarness(t, AdjusterOptions{Capacity: tc.capacity},
					qos.ModelSpec{Name: "a", Class: lc, SLO: 100 * ms, MaxBatchSize: 4, Priority: tc.prio[0]},
					qos.ModelSpec{Name: "b", Class: lc, SLO: 100 * ms, MaxBatchSize: 4, Priority: tc.prio[1]},
				)
				ah.pred.setRate("a", 30)
				ah.pred.setRate("b", 30)
				ah.start()
				if got := [2]float64{ah.act.share("a").Compute, ah.act.share("b").Compute}; got != tc.want {
					t.Errorf("shares = %v, want %v", got, tc.want)
				}
				e := lastEvent(t, ah.a, "a")
				if want := fmt.Sprintf("; scaled from 0.65 to %.2f: latency-critical demand 1.30 over the %.2f available", tc.want[0], tc.capacity); !strings.Contains(e.Reason, want) {
					t.Errorf("reason %q lacks %q", e.Reason, want)
				}
			})
		})
	}
}

// Pins from config and from Pin hold, reserve their compute and are
// events; Pin overrides the config pin and Pin(nil) gives the share back to
// the policy at once.
func TestAdjusterPins(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{},
			qos.ModelSpec{Name: "cfg", Class: lc, SLO: 100 * ms, Pin: &limiter.Share{Compute: 0.3, Memory: gib}},
			qos.ModelSpec{Name: "lc", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
			qos.ModelSpec{Name: "be", Class: be},
		)
		ah.pred.setRate("cfg", 50)
		ah.pred.setRate("lc", 10) // 0.45
		ah.pred.setRate("be", 1)
		ah.start()
		// be gets 1 - 0.3 (pinned) - 0.2: lc's floor of 0.45 keeps twice
		// what it keeps busy at full speed, 2 · 10 · 10ms.
		want := map[string]float64{"cfg": 0.3, "lc": 0.45, "be": 0.5}
		if got := ah.act.computes(); !maps.Equal(got, want) {
			t.Errorf("shares = %v, want %v", got, want)
		}
		if got := ah.act.share("cfg"); got.Memory != gib {
			t.Errorf("cfg memory %d, want the pinned 1GiB", got.Memory)
		}
		if s := ah.shareOf("cfg"); !s.Pinned || s.Source != SourceConfig {
			t.Errorf("cfg: %+v", s)
		}
		if e := ah.a.Events(time.Time{}, 0)[0]; e.Kind != EventPin || e.Model != "cfg" || e.Reason != "pinned in config" || e.New.Compute != 0.3 {
			t.Errorf("first event %+v", e)
		}

		// Pin applies at once, without waiting for the period.
		before := time.Now()
		if err := ah.a.Pin("lc", &limiter.Share{Compute: 0.9}); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		if got := ah.act.share("lc").Compute; got != 0.9 || time.Since(before) != 0 {
			t.Errorf("after Pin: lc share %v after %s", got, time.Since(before))
		}
		if s := ah.shareOf("lc"); !s.Pinned || s.Source != SourcePinned {
			t.Errorf("lc: %+v", s)
		}
		// Pins are reserved first: nothing is left, and the best-effort
		// model gives its share back at once, down to its minimum.
		if got := ah.act.share("be").Compute; got != 0.05 {
			t.Errorf("be holds %v, want 0.05", got)
		}
		// Pin overrides config; unpin goes back to the config pin.
		if err := ah.a.Pin("cfg", &limiter.Share{Compute: 0.05}); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		if got := ah.act.share("cfg"); got != (limiter.Share{Compute: 0.05}) {
			t.Errorf("cfg pinned over config: %+v", got)
		}
		if err := ah.a.Pin("cfg", nil); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		if got := ah.act.share("cfg"); got != (limiter.Share{Compute: 0.3, Memory: gib}) {
			t.Errorf("cfg after unpin: %+v, want its config pin", got)
		}
		// Unpinning lc hands it back to the policy at once, though that
		// shrinks it.
		if err := ah.a.Pin("lc", nil); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		if got := ah.act.share("lc"); got != (limiter.Share{Compute: 0.45, Mode: limiter.ModeFloor}) {
			t.Errorf("lc after unpin: %+v, want a floor of 0.45 at once", got)
		}
		if err := ah.a.Pin("lc", nil); err != nil {
			t.Errorf("unpinning twice: %v", err)
		}
		if err := ah.a.Pin("nope", &limiter.Share{Compute: 0.5}); !errors.Is(err, qos.ErrUnknownModel) {
			t.Errorf("Pin of an unknown model: %v", err)
		}
		if err := ah.a.Pin("lc", &limiter.Share{Compute: -1}); err == nil {
			t.Error("Pin of a negative share succeeded")
		}

		var pins []string
		for _, e := range ah.a.Events(time.Time{}, 0) {
			if e.Kind == EventPin || e.Kind == EventUnpin {
				pins = append(pins, e.Kind+" "+e.Model+": "+e.Reason)
			}
		}
		want2 := []string{
			"pin cfg: pinned in config",
			"pin lc: pinned by operator",
			"pin cfg: pinned by operator",
			"unpin cfg: unpinned by operator: the adaptive policy decides again",
			"unpin lc: unpinned by operator: the adaptive policy decides again",
		}
		if !slices.Equal(pins, want2) {
			t.Errorf("pin events:\n%s\nwant\n%s", strings.Join(pins, "\n"), strings.Join(want2, "\n"))
		}

		// A config pin that goes with a reload is an event too.
		if err := ah.s.UpdateModel(qos.ModelSpec{Name: "cfg", Class: lc, SLO: 100 * ms, Executor: &fakeModel{name: "cfg", rec: ah.rec}}); err != nil {
			t.Fatal(err)
		}
		ah.tick()
		if e := lastEvent(t, ah.a, "cfg"); e.Kind != EventResize || ah.shareOf("cfg").Pinned {
			t.Errorf("after the config pin went: %+v", e)
		}
		if !slices.Contains(kinds(ah.a.Events(time.Time{}, 0)), "unpin cfg") {
			t.Error("no unpin event for the config pin")
		}
	})
}

// Static gives equal shares and splits again when the models change;
// shared gives no limits. Pins apply under both.
func TestAdjusterStaticAndShared(t *testing.T) {
	t.Run("static", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			ah := newAdjHarness(t, AdjusterOptions{Policy: SharePolicyStatic, MemoryBudget: 3 * gib},
				qos.ModelSpec{Name: "a", Class: lc, SLO: 100 * ms},
				qos.ModelSpec{Name: "b", Class: be},
				qos.ModelSpec{Name: "c", Class: be},
			)
			ah.start()
			third := limiter.Share{Compute: 0.3333, Memory: gib}
			want := map[string]limiter.Share{"a": third, "b": third, "c": third}
			if got := ah.act.all(); !maps.Equal(got, want) {
				t.Errorf("shares = %v, want %v", got, want)
			}
			ah.model(qos.ModelSpec{Name: "d", Class: be}, nil)
			ah.tick()
			quarter := limiter.Share{Compute: 0.25, Memory: 3 * gib / 4}
			want = map[string]limiter.Share{"a": quarter, "b": quarter, "c": quarter, "d": quarter}
			if got := ah.act.all(); !maps.Equal(got, want) {
				t.Errorf("after adding d: shares = %v, want %v", got, want)
			}
			if err := ah.s.RemoveModel(t.Context(), "d"); err != nil {
				t.Fatal(err)
			}
			if err := ah.a.Pin("c", &limiter.Share{Compute: 0.5}); err != nil {
				t.Fatal(err)
			}
			synctest.Wait()
			want = map[string]limiter.Share{"a": third, "b": third, "c": {Compute: 0.5}, "d": quarter}
			if got := ah.act.all(); !maps.Equal(got, want) {
				t.Errorf("after removing d and pinning c: shares = %v, want %v", got, want)
			}
			if s := ah.a.Shares(); len(s) != 3 || s[0].Source != SharePolicyStatic || s[2].Source != SourcePinned {
				t.Errorf("Shares = %+v", s)
			}
			if ah.a.Policy().Name() != SharePolicyStatic {
				t.Errorf("Policy() = %q", ah.a.Policy().Name())
			}
		})
	})
	t.Run("shared", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			ah := newAdjHarness(t, AdjusterOptions{Policy: SharePolicyShared, MemoryBudget: gib},
				qos.ModelSpec{Name: "a", Class: lc, SLO: 100 * ms, Memory: gib},
				qos.ModelSpec{Name: "b", Class: be},
			)
			ah.start()
			ah.tick()
			want := map[string]limiter.Share{"a": {}, "b": {}}
			if got := ah.act.all(); !maps.Equal(got, want) {
				t.Errorf("shares = %v, want %v", got, want)
			}
			if got := ah.act.callLog(); len(got) != 2 {
				t.Errorf("SetShare calls %v, want one per model", got)
			}
			if err := ah.a.Pin("b", &limiter.Share{Compute: 0.5}); err != nil {
				t.Fatal(err)
			}
			synctest.Wait()
			if got := ah.act.share("b"); got != (limiter.Share{Compute: 0.5}) {
				t.Errorf("pinned b: %+v", got)
			}
			if s := ah.shareOf("a"); s.Source != SharePolicyShared || s.Share != (limiter.Share{}) {
				t.Errorf("a: %+v", s)
			}
		})
	})
}

// blocker is an executor that holds its executions until released or
// canceled.
func blocker(release <-chan struct{}) qos.Executor {
	return qos.ExecutorFunc(func(ctx context.Context, _ *runtime.InferRequest) (*runtime.InferResponse, error) {
		select {
		case <-release:
			return &runtime.InferResponse{}, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	})
}

// Over the memory budget, idle models go least recently used first, only
// until the budget is met; models with requests queued or running, or that
// had one within KeepAlive, stay.
func TestAdjusterEvictsIdleModels(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, qos.Options{DeviceSlots: 1})
		h.run()
		release := make(chan struct{})
		defer close(release)
		for _, name := range []string{"old", "recent", "fresh"} {
			h.model(qos.ModelSpec{Name: name, Class: be}, nil)
		}
		for _, name := range []string{"running", "queued"} {
			if err := h.s.AddModel(qos.ModelSpec{Name: name, Class: be, Executor: blocker(release)}); err != nil {
				t.Fatal(err)
			}
		}
		ctx := t.Context()
		mustSucceed(t, h.submit(ctx, "old", qos.RequestOptions{}, 1)) // at 0s
		time.Sleep(30 * time.Second)
		mustSucceed(t, h.submit(ctx, "recent", qos.RequestOptions{}, 2)) // at 30s
		// "running" holds the one device slot, so "queued" waits.
		h.submit(ctx, "running", qos.RequestOptions{}, 3)
		h.submit(ctx, "queued", qos.RequestOptions{}, 4)
		time.Sleep(65 * time.Second)
		// "fresh" has a request at 95s, which admission turns away: with
		// the device busy it cannot meet its deadline.
		h.est.Observe("fresh", 1, 10*ms)
		p := h.submit(ctx, "fresh", qos.RequestOptions{Deadline: time.Now().Add(ms)}, 5)
		if err := p.wait(t); !errors.Is(err, qos.ErrRejected) {
			t.Fatalf("fresh: %v, want rejected", err)
		}
		time.Sleep(5 * time.Second)
		for name, want := range map[string][2]int{"running": {1, 0}, "queued": {0, 1}, "fresh": {0, 0}} {
			st, _ := h.s.ModelState(name)
			if got := [2]int{st.Running, st.QueueDepth}; got != want {
				t.Fatalf("%s: running and queued %v, want %v", name, got, want)
			}
		}

		act := newFakeActuator()
		act.usage = map[string]int64{"old": gib, "recent": gib / 2, "fresh": gib / 2, "running": gib / 2, "queued": gib / 2}
		a, err := NewAdjuster(h.s, AdjusterOptions{
			MemoryBudget: 2 * gib, KeepAlive: time.Minute, Predictor: newFakePredictor(), Actuator: act, Logger: testLogger(t),
		})
		if err != nil {
			t.Fatal(err)
		}
		ah := &adjHarness{harness: h, act: act, a: a, period: time.Second}
		ah.start() // at 100s: 3GiB in use
		if got := act.evictions(); !slices.Equal(got, []string{"old"}) {
			t.Errorf("evicted %v, want [old]: least recently used, and then under budget", got)
		}
		e := lastEvent(t, a, "old")
		if e.Kind != EventEvict || e.Reason != "memory 3GiB over budget 2GiB: evicted idle 1m40s" {
			t.Errorf("event %s %q", e.Kind, e.Reason)
		}

		// Far over budget: only recent is idle long enough to go; running
		// and queued have been without arrivals as long, but are busy.
		act.set(func(f *fakeActuator) { f.usage["running"], f.usage["queued"] = 4*gib, 4*gib })
		ah.tick()
		ah.tick()
		if got := act.evictions(); !slices.Equal(got, []string{"old", "recent"}) {
			t.Errorf("evicted %v, want [old recent]", got)
		}
	})
}

// A failed SetShare is an error event and is tried again at the next pass,
// then with a growing delay; the share counts as applied only once it
// succeeds.
func TestAdjusterRetriesFailedShares(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{},
			qos.ModelSpec{Name: "bad", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
			qos.ModelSpec{Name: "good", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
		)
		ah.pred.setRate("bad", 10)
		ah.pred.setRate("good", 10)
		ah.act.fail["bad"] = 2
		ah.start()
		// 10 req/s: 0.45 each.
		if s := ah.shareOf("bad"); s.Share != (limiter.Share{}) || s.Target != 0.45 {
			t.Errorf("after a failure: %+v", s)
		}
		if got := ah.act.share("good").Compute; got != 0.45 {
			t.Errorf("good: %v", got)
		}
		for range 4 {
			ah.tick()
		}
		var calls []string
		for _, c := range ah.act.callLog() {
			if strings.HasPrefix(c, "bad") {
				calls = append(calls, c)
			}
		}
		// Fails at 0s and 1s, waits 2s, succeeds at 3s.
		if want := []string{"bad=0.45/0@0", "bad=0.45/0@1", "bad=0.45/0@3"}; !slices.Equal(calls, want) {
			t.Errorf("calls %v, want %v", calls, want)
		}
		var got []string
		for _, e := range ah.a.Events(time.Time{}, 0) {
			if e.Model == "bad" {
				got = append(got, fmt.Sprintf("%.0f %s %s", ah.since(e.Time), e.Kind, e.Reason))
			}
		}
		want := []string{
			"0 error setting the share failed (attempt 1, next in 1s): runner did not come up",
			"1 error setting the share failed (attempt 2, next in 2s): runner did not come up",
			"3 resize forecast 10.0 req/s needs 0.45 to meet 100ms at p99 (predicted 87.3ms at batch 1)",
		}
		if !slices.Equal(got, want) {
			t.Errorf("events:\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
		if s := ah.shareOf("bad"); s.Share.Compute != 0.45 {
			t.Errorf("after the retry: %+v", s)
		}
	})
}

// Observed misses overrule the prediction: while attainment over at least
// 20 settled requests is under the quantile, a latency-critical floor grows
// a step a cooldown past what the queueing model asks for.
func TestAdjusterOverrulesOnMisses(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{Cooldown: 3 * time.Second})
		// Every execution takes 150ms against an SLO of 100ms, while the
		// scheduler's estimator is told 10ms before each request, so that
		// admission lets it in and it is late. Arrivals every 200ms at
		// 0.1s, 0.3s, ... and completions at 0.25s, 0.45s, ... keep off the
		// passes at whole seconds, and one execution at a time with a
		// constant overrun keeps the measured variability at zero, so the
		// prediction uses the defaults.
		ah.model(qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 1},
			func([]int64) time.Duration { return 150 * ms })
		// 5 req/s needs 0.40: t = 25ms, ρ = 0.125, wait
		// 0.55·25/0.875·ln 12.5 = 39.7ms, execution 43.4ms: 83.1ms; 0.35
		// gives 48.7 + 49.6 = 98.3ms, over 90.
		ah.pred.setRate("m", 5)
		ah.start()
		stop := make(chan struct{})
		traffic := make(chan struct{})
		go func() {
			defer close(traffic)
			time.Sleep(100 * ms)
			for id := int64(1); ; id++ {
				ah.est.Observe("m", 1, 10*ms)
				if _, err := ah.s.Submit(t.Context(), "m", idRequest(id), qos.RequestOptions{}); err != nil {
					t.Errorf("request %d: %v", id, err)
				}
				select {
				case <-stop:
					return
				case <-time.After(50 * ms):
				}
			}
		}()
		defer func() { close(stop); <-traffic }()

		// 19 requests have settled by 4s, 24 by 5s: from then on the floor
		// grows at once and then every 3s.
		want := []float64{0.40, 0.40, 0.40, 0.40, 0.40, 0.45, 0.45, 0.45, 0.50, 0.50, 0.50, 0.55}
		var got []float64
		for i := range want {
			if i > 0 {
				ah.tick()
			}
			got = append(got, ah.act.share("m").Compute)
		}
		if !slices.Equal(got, want) {
			t.Errorf("floor each second %v\nwant %v", got, want)
		}
		s := ah.shareOf("m")
		if s.Attainment != 0 || s.Share != (limiter.Share{Compute: 0.55, Mode: limiter.ModeFloor}) || s.Target != 0.55 {
			t.Errorf("Shares: %+v", s)
		}
		st, _ := ah.s.ModelState("m")
		if st.Settled < minSettled || st.ArrivalSCV != 0 || st.ServiceSCV != 0 {
			t.Errorf("%d settled, variability measured: arrivals %v, service %v; want 20 or more and none", st.Settled, st.ArrivalSCV, st.ServiceSCV)
		}
		e := lastEvent(t, ah.a, "m")
		const reason = "observed attainment 0.0% is under 99%: floor 0.55 over the predicted 0.40; " +
			"forecast 5.0 req/s needs 0.40 to meet 100ms at p99 (predicted 83.1ms at batch 1)"
		if e.Kind != EventResize || e.Reason != reason || ah.since(e.Time) != 11 {
			t.Errorf("last event at %.0fs: %s %q\nwant resize at 11s %q", ah.since(e.Time), e.Kind, e.Reason, reason)
		}
	})
}

func TestAdjusterEventsAndShares(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{EventCapacity: 3, Device: "cpu"},
			qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 4, Memory: gib})
		ah.pred.setRate("m", 10)
		ps := []*pending{
			ah.submit(t.Context(), "m", qos.RequestOptions{}, 1),
			ah.submit(t.Context(), "m", qos.RequestOptions{}, 2),
		}
		mustSucceed(t, ps...)
		ah.start()
		// 0.45, then 0.65 and 0.95: each pass grows the share.
		for _, r := range []float64{30, 60} {
			ah.pred.setRate("m", r)
			ah.tick()
		}
		if err := ah.a.Pin("m", &limiter.Share{Compute: 1}); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		// 5 events: resize at 0s, 1s, 2s, then pin and resize at 2s; 3 kept.
		all := ah.a.Events(time.Time{}, 0)
		if got, want := kinds(all), []string{"resize m", "pin m", "resize m"}; !slices.Equal(got, want) {
			t.Fatalf("events %v, want %v", got, want)
		}
		for _, e := range all {
			if e.Device != "cpu" || ah.since(e.Time) != 2 {
				t.Errorf("event %+v", e)
			}
		}
		if got := ah.a.Events(time.Time{}, 1); len(got) != 1 || got[0] != all[2] {
			t.Errorf("Events(zero, 1) = %+v, want the newest", got)
		}
		if got := ah.a.Events(ah.t0.Add(2*time.Second), 2); len(got) != 2 || got[1] != all[2] {
			t.Errorf("Events(2s, 2) = %+v", got)
		}
		if got := ah.a.Events(ah.t0.Add(3*time.Second), 0); len(got) != 0 {
			t.Errorf("Events(3s) = %+v, want none", got)
		}

		ah.tick()
		got := ah.a.Shares()
		if len(got) != 1 {
			t.Fatalf("Shares = %+v", got)
		}
		want := ModelShare{
			Model: "m", Class: lc, Share: limiter.Share{Compute: 1}, Target: 1, Pinned: true, Source: SourcePinned,
			ForecastRate: 60, SLO: 100 * ms, Attainment: 1,
		}
		if got[0] != want {
			t.Errorf("Shares()[0] = %+v\nwant %+v", got[0], want)
		}
		if err := ah.a.Pin("m", nil); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		got = ah.a.Shares()
		want = ModelShare{
			Model: "m", Class: lc, Share: limiter.Share{Compute: 0.95, Memory: gib, Mode: limiter.ModeFloor}, Target: 0.95,
			Source: SharePolicyAdaptive, PredictedLatency: got[0].PredictedLatency, ForecastRate: 60, SLO: 100 * ms, Attainment: 1,
		}
		// At 0.95 and 60 req/s: t = 10.5ms, ρ = 0.632, wait
		// 0.55·10.5/0.368·ln 63.2 = 65.1ms, execution 18.3ms: 83.4ms.
		if got[0] != want || got[0].PredictedLatency.Round(100*time.Microsecond) != 83400*time.Microsecond {
			t.Errorf("Shares()[0] = %+v\nwant %+v", got[0], want)
		}
	})
}

func TestAdjusterRun(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{Period: 5 * time.Second},
			qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 4})
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- ah.a.Run(ctx) }()
		synctest.Wait()
		if err := ah.a.Run(ctx); err == nil {
			t.Error("second Run succeeded")
		}
		time.Sleep(12 * time.Second)
		synctest.Wait()
		ah.pred.mu.Lock()
		arrived, observed := ah.pred.arrived["m"], len(ah.pred.arrived)
		ah.pred.mu.Unlock()
		if observed != 1 || arrived != 0 {
			t.Errorf("arrivals observed: %v", ah.pred.arrived)
		}
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v, want nil", err)
		}
	})
}

func TestNewAdjusterValidates(t *testing.T) {
	s, err := qos.NewScheduler(qos.Options{})
	if err != nil {
		t.Fatal(err)
	}
	act, pred := newFakeActuator(), newFakePredictor()
	for _, tc := range []struct {
		opts AdjusterOptions
		want string
	}{
		{AdjusterOptions{Policy: "greedy", Actuator: act}, `unknown share policy "greedy"`},
		{AdjusterOptions{Actuator: act}, "the adaptive policy needs a predictor"},
		{AdjusterOptions{Predictor: pred}, "no actuator"},
		{AdjusterOptions{Actuator: act, Predictor: pred, Capacity: 1.5}, "capacity 1.5 is not a fraction"},
		{AdjusterOptions{Actuator: act, Predictor: pred, Step: math.NaN()}, "step NaN is not a fraction"},
		{AdjusterOptions{Actuator: act, Predictor: pred, Headroom: 1}, "headroom 1 leaves no latency budget"},
		{AdjusterOptions{Actuator: act, Predictor: pred, Capacity: 0.5, MinShare: 0.6}, "min share 0.6 is over the capacity 0.5"},
		{AdjusterOptions{Actuator: act, Predictor: pred, Cooldown: -time.Second}, "negative period"},
		{AdjusterOptions{Actuator: act, Predictor: pred, MemoryBudget: -1}, "negative memory budget"},
	} {
		if _, err := NewAdjuster(s, tc.opts); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want %q", tc.opts, err, tc.want)
		}
	}
	if _, err := NewAdjuster(nil, AdjusterOptions{Actuator: act, Predictor: pred}); err == nil {
		t.Error("no scheduler: no error")
	}
	a, err := NewAdjuster(s, AdjusterOptions{Policy: SharePolicyStatic, Actuator: act, Headroom: -1})
	if err != nil {
		t.Fatal(err)
	}
	if a.opts.Headroom != 0 || a.opts.Period != time.Second || a.opts.Step != 0.05 || a.opts.EventCapacity != 1024 {
		t.Errorf("defaults: %+v", a.opts)
	}
}

func TestFormatting(t *testing.T) {
	for in, want := range map[int64]string{512: "512B", 3 * gib / 2: "1.5GiB", gib: "1GiB", 1536 << 10: "1.5MiB"} {
		if got := formatBytes(in); got != want {
			t.Errorf("formatBytes(%d) = %q, want %q", in, got, want)
		}
	}
	for in, want := range map[time.Duration]string{
		4 * time.Minute: "4m", 100 * time.Second: "1m40s", time.Hour: "1h", 90 * time.Minute: "1h30m",
		10 * time.Second: "10s", 1500 * time.Microsecond: "2ms", 0: "0s",
	} {
		if got := shortDuration(in); got != want {
			t.Errorf("shortDuration(%s) = %q, want %q", in, got, want)
		}
	}
}

func TestAdjusterMetrics(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		reg := prometheus.NewPedanticRegistry()
		ah := newAdjHarness(t, AdjusterOptions{Registerer: reg, Device: "cpu"},
			qos.ModelSpec{Name: "lc", Class: lc, SLO: 100 * ms, MaxBatchSize: 4, Memory: gib},
			qos.ModelSpec{Name: "be", Class: be},
		)
		if _, err := NewAdjuster(ah.s, AdjusterOptions{Registerer: reg, Device: "cpu", Predictor: ah.pred, Actuator: ah.act}); err == nil {
			t.Error("two adjusters registered the same device")
		}
		ah.pred.setRate("lc", 50) // 0.85
		ah.act.fail["be"] = 1
		ah.start()
		ah.tick()
		want := `
# HELP sloserve_adjuster_events_total Adjuster events by kind: resize, evict, pin, unpin, error.
# TYPE sloserve_adjuster_events_total counter
sloserve_adjuster_events_total{device="cpu",kind="error"} 1
sloserve_adjuster_events_total{device="cpu",kind="evict"} 0
sloserve_adjuster_events_total{device="cpu",kind="pin"} 0
sloserve_adjuster_events_total{device="cpu",kind="resize"} 2
sloserve_adjuster_events_total{device="cpu",kind="unpin"} 0
# HELP sloserve_share_compute Compute share applied to the model, as a fraction of the device; 0 means no limit.
# TYPE sloserve_share_compute gauge
sloserve_share_compute{device="cpu",model="be"} 0.05
sloserve_share_compute{device="cpu",model="lc"} 0.85
# HELP sloserve_share_memory_bytes Memory share applied to the model; 0 means no limit.
# TYPE sloserve_share_memory_bytes gauge
sloserve_share_memory_bytes{device="cpu",model="be"} 0
sloserve_share_memory_bytes{device="cpu",model="lc"} 1.073741824e+09
# HELP sloserve_share_target_compute Compute share the adjuster's last pass wanted for the model.
# TYPE sloserve_share_target_compute gauge
sloserve_share_target_compute{device="cpu",model="be"} 0.05
sloserve_share_target_compute{device="cpu",model="lc"} 0.85
`
		names := []string{"sloserve_adjuster_events_total", "sloserve_share_compute", "sloserve_share_memory_bytes", "sloserve_share_target_compute"}
		if err := testutil.GatherAndCompare(reg, strings.NewReader(want), names...); err != nil {
			t.Error(err)
		}
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		var passes uint64
		for _, mf := range mfs {
			if mf.GetName() == "sloserve_adjuster_pass_seconds" {
				passes = mf.GetMetric()[0].GetHistogram().GetSampleCount()
			}
		}
		if passes != 2 {
			t.Errorf("%d passes observed, want 2", passes)
		}

		if err := ah.s.RemoveModel(t.Context(), "be"); err != nil {
			t.Fatal(err)
		}
		ah.tick()
		if n, err := testutil.GatherAndCount(reg, "sloserve_share_compute"); err != nil || n != 1 {
			t.Errorf("share series after removing be = %d, %v; want 1", n, err)
		}
	})
}

// Where the limiter has no floors (MPS: a percentage is a ceiling), a
// latency-critical model gets a cap of the same size, and the predictor is
// told that size, not the whole device (issue 18: a floor predicted at the
// whole device but enforced as a cap starved the model on a simulated GPU).
func TestAdjusterCapsOnly(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		spec := qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 4}
		ah := newAdjHarness(t, AdjusterOptions{CapsOnly: true}, spec)
		ah.pred.setRate("m", 50)
		ah.start()
		if got := ah.act.share("m"); got.Compute != 0.85 || got.Mode != limiter.ModeCap {
			t.Errorf("share = %+v, want a cap of 0.85 (the floor it would get elsewhere)", got)
		}
		if got := ah.pred.share("m"); got != 0.85 {
			t.Errorf("predictor told %v, want the cap 0.85", got)
		}
	})
}

// On MPS (CapsOnly) the caps add up to the capacity: the best-effort cap is
// what the latency-critical cap leaves, also while the hysteresis holds the
// latency-critical cap above its target; a best-effort cap grows only by
// two steps or more and once a cooldown.
func TestAdjusterCapsOnlySumsWithinDevice(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{CapsOnly: true},
			qos.ModelSpec{Name: "lc", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
			qos.ModelSpec{Name: "be", Class: be},
		)
		ah.pred.setRate("lc", 30) // 0.65, see TestAdjusterScaleDownHysteresis
		ah.pred.setRate("be", 5)
		ah.start()
		sum := func() float64 {
			s := 0.0
			for _, c := range ah.act.computes() {
				s += c
			}
			return s
		}
		want := map[string]float64{"lc": 0.65, "be": 0.35}
		if got := ah.act.computes(); !maps.Equal(got, want) {
			t.Errorf("shares = %v, want %v (the whole cap kept from the best-effort cap)", got, want)
		}
		ah.pred.setRate("lc", 45) // 0.80
		ah.tick()
		want = map[string]float64{"lc": 0.8, "be": 0.2}
		if got := ah.act.computes(); !maps.Equal(got, want) {
			t.Errorf("after lc grew: shares = %v, want %v", got, want)
		}
		// Back down: lc is held at 0.80 through the hysteresis and be
		// stays at 0.20, however many passes.
		ah.pred.setRate("lc", 30)
		for range 5 {
			ah.tick()
			if s := sum(); s > 1+shareEpsilon {
				t.Fatalf("caps add up to %v over the device: %v", s, ah.act.computes())
			}
		}
		if got := ah.act.computes(); !maps.Equal(got, want) {
			t.Errorf("within the hysteresis: shares = %v, want %v", got, want)
		}
		// The target is held for capsOnlyTargetWindow ScaleDownAfter,
		// then the slack waits its ScaleDownAfter.
		for range (capsOnlyTargetWindow + 2) * 10 {
			ah.tick()
			if s := sum(); s > 1+shareEpsilon {
				t.Fatalf("caps add up to %v over the device: %v", s, ah.act.computes())
			}
		}
		want = map[string]float64{"lc": 0.65, "be": 0.35}
		if got := ah.act.computes(); !maps.Equal(got, want) {
			t.Errorf("after the hysteresis: shares = %v, want %v", got, want)
		}
		// A step of growth is not worth a new client.
		before := len(ah.act.callLog())
		ah.pred.setRate("lc", 25) // 0.60: a step less for lc
		for range (capsOnlyTargetWindow + 2) * 10 {
			ah.tick()
		}
		if got := ah.act.callLog()[before:]; len(got) != 1 || !strings.HasPrefix(got[0], "lc=0.6/0@") {
			t.Errorf("calls %v, want lc=0.6 alone (be's growth by one step is not worth a new client)", got)
		}
		// Two steps are.
		ah.pred.setRate("lc", 15)
		for range (capsOnlyTargetWindow + 2) * 10 {
			ah.tick()
		}
		if lcNow, beNow := ah.act.share("lc").Compute, ah.act.share("be").Compute; beNow < 1-lcNow-shareEpsilon-0.05 || lcNow+beNow > 1+shareEpsilon {
			t.Errorf("lc %v, be %v: want be within a step of what lc leaves", lcNow, beNow)
		}
	})
}

// On MPS a latency-critical cap stops at the share past which the model is
// predicted no faster, also when no share meets the SLO and while misses
// overrule the prediction.
func TestAdjusterCapsOnlyStopsAtTheKnee(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{CapsOnly: true},
			qos.ModelSpec{Name: "lc", Class: lc, SLO: 20 * ms, MaxBatchSize: 1},
			qos.ModelSpec{Name: "be", Class: be},
		)
		// 15 ms at any share from 0.4 up, slower below: 20 ms cannot be
		// met at p99 at 30 req/s.
		ah.pred.latency = func(_ string, b int, s float64) (time.Duration, bool) {
			return time.Duration(float64(15*ms) * max(1, 0.4/s)), true
		}
		ah.pred.setRate("lc", 30)
		ah.pred.setRate("be", 5)
		ah.start()
		if got := ah.act.share("lc").Compute; got != 0.4 {
			t.Errorf("lc cap %v, want 0.4 (as fast as the maximum)", got)
		}
		if got := ah.act.share("be").Compute; got != 0.6 {
			t.Errorf("be cap %v, want 0.6", got)
		}
		if e := lastEvent(t, ah.a, "lc"); !strings.Contains(e.Reason, "0.40 is as fast as the maximum") {
			t.Errorf("lc reason %q", e.Reason)
		}
	})
}

// On MPS a latency-critical model that cannot meet its SLO gets the knee of
// its largest batch, whatever the rate, and two such caps are not scaled to
// fit the device; the best-effort cap leaves each only the knee of a single
// request, so the caps add up to more than the device (a burst's large
// batches share the SMs with the others').
func TestAdjusterCapsOnlyLargestBatchKnee(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{CapsOnly: true},
			qos.ModelSpec{Name: "lc", Class: lc, SLO: 20 * ms, MaxBatchSize: 4},
			qos.ModelSpec{Name: "lc2", Class: lc, SLO: 20 * ms, MaxBatchSize: 4},
			qos.ModelSpec{Name: "be", Class: be},
		)
		// A batch of b can use 0.2·b of the device; 15 ms for one row at
		// its knee, 5 ms more a row.
		ah.pred.latency = func(_ string, b int, s float64) (time.Duration, bool) {
			return time.Duration(float64(15*ms+time.Duration(b-1)*5*ms) * max(1, 0.2*float64(b)/s)), true
		}
		ah.pred.setRate("be", 5)
		ah.pred.setRate("lc2", 40)
		for i, rate := range []float64{30, 60, 45} {
			ah.pred.setRate("lc", rate)
			if i == 0 {
				ah.start()
			} else {
				ah.tick()
			}
			for _, m := range []string{"lc", "lc2"} {
				if got := ah.act.share(m).Compute; got != 0.8 {
					t.Errorf("at %v req/s: %s cap %v, want 0.8 (the knee of a batch of 4)", rate, m, got)
				}
			}
			if got := ah.act.share("be").Compute; got != 0.6 {
				t.Errorf("at %v req/s: be cap %v, want 0.6 (what two single requests' knees, 0.2 each, leave)", rate, got)
			}
		}
		if n := len(ah.act.callLog()); n != 3 {
			t.Errorf("%d resizes (%v), want 3: one per model, none as the rate moves", n, ah.act.callLog())
		}
	})
}

// On MPS with background priority (CapsOnly and Background: best-effort
// clients below normal priority) a best-effort cap is a fill, not what the
// latency-critical caps leave: a busy best-effort model gets the whole
// device whatever the latency-critical caps, keeps it while they move
// (no new client), and drops to its minimum only when idle. The same day
// without Background gives it what the latency-critical cap leaves (see
// TestAdjusterCapsOnlySumsWithinDevice).
func TestAdjusterCapsOnlyBackgroundFills(t *testing.T) {
	for _, tc := range []struct {
		name       string
		background bool
		be         []float64 // be's cap after each lc rate below
	}{
		{"background", true, []float64{1, 1, 1}},
		{"no background", false, []float64{0.175, 0.1, 0.1}}, // half of what lc leaves each
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ah := newAdjHarness(t, AdjusterOptions{CapsOnly: true, Background: tc.background},
					qos.ModelSpec{Name: "lc", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
					qos.ModelSpec{Name: "be", Class: be},
					qos.ModelSpec{Name: "be-capped", Class: be, MaxShare: 0.5},
				)
				ah.pred.setRate("be", 5)
				ah.pred.setRate("be-capped", 5)
				for i, rate := range []float64{30, 45, 30} { // lc at 0.65, 0.80, held at 0.80
					ah.pred.setRate("lc", rate)
					if i == 0 {
						ah.start()
					} else {
						ah.tick()
					}
					got := ah.act.share("be")
					if got.Compute != tc.be[i] || got.Mode != limiter.ModeBackground {
						t.Errorf("lc at %v req/s: be %+v, want %v in the background", rate, got, tc.be[i])
					}
					if got := ah.act.share("lc"); got.Mode != limiter.ModeCap {
						t.Errorf("lc %+v, want a cap at normal priority", got)
					}
				}
				if !tc.background {
					return
				}
				if got := ah.act.share("be-capped").Compute; got != 0.5 {
					t.Errorf("be-capped %v, want its max_share 0.5", got)
				}
				if n := strings.Count(strings.Join(ah.act.callLog(), " "), "be="); n != 1 {
					t.Errorf("be placed %d times (%v), want once: its cap does not move with lc's", n, ah.act.callLog())
				}
				// Idle: the minimum, after the hysteresis.
				ah.pred.setRate("be", 0)
				for range 40 {
					ah.tick()
				}
				lo, _ := ah.a.bounds(qos.ModelSpec{Class: be})
				if got := ah.act.share("be").Compute; got != lo {
					t.Errorf("idle be %v, want its minimum %v", got, lo)
				}
			})
		})
	}
}
