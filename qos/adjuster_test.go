package qos

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
	"github.com/sloserve/sloserve/runtime"
)

// The adjuster tests run a real Scheduler and Adjuster in a synctest bubble
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
}

var _ Predictor = (*fakePredictor)(nil)

func newFakePredictor() *fakePredictor {
	return &fakePredictor{
		latency: func(_ string, b int, s float64) (time.Duration, bool) {
			return time.Duration(float64(10*ms) * float64(b) / s), true
		},
		rates:   map[string]float64{},
		arrived: map[string]uint64{},
		shares:  map[string]float64{},
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

func (p *fakePredictor) ForecastRate(model string, _ time.Duration) float64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rates[model]
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
func newAdjHarness(t *testing.T, opts AdjusterOptions, specs ...ModelSpec) *adjHarness {
	t.Helper()
	h := newHarness(t, Options{DeviceSlots: 4})
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
// t(b, s) = 10ms·b/s, SLO 100ms, headroom 0.2 (budget 80ms), one slot:
// utilisation ρ = rate·t/b = rate·10ms/s must stay under 0.8, and
// latency = (b-1)/rate + ρ·t/(2(1-ρ)) + t must be <= 80ms. Batching does
// not help this model (no fixed cost), so b = 1 wins.
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
		spec    ModelSpec
		latency func(string, int, float64) (time.Duration, bool)
		rate    float64
		want    float64
		reason  string
	}{
		// ρ = 0.5/s < 0.8 needs s > 0.625: 0.65 gives t = 15.4ms,
		// ρ = 0.769, queueing 25.6ms: 41.0ms.
		{"rate 50", ModelSpec{MaxBatchSize: 4}, linear, 50, 0.65,
			"forecast 50.0 req/s needs 0.65 to meet 100ms (predicted 41.0ms at batch 1)"},
		// ρ = 0.1/s: 0.15 gives t = 66.7ms, ρ = 0.667, queueing 66.7ms:
		// 133ms, too slow; 0.20 gives 50 + 25 = 75ms.
		{"rate 10", ModelSpec{MaxBatchSize: 4}, linear, 10, 0.20,
			"forecast 10.0 req/s needs 0.20 to meet 100ms (predicted 75.0ms at batch 1)"},
		{"rate 10 above the model's minimum", ModelSpec{MaxBatchSize: 4, MinShare: 0.3}, linear, 10, 0.30,
			"forecast 10.0 req/s needs 0.30 to meet 100ms"},
		// ρ = 1/s: over 0.8 at any share.
		{"rate 100 cannot be met", ModelSpec{MaxBatchSize: 4}, linear, 100, 1,
			"forecast 100.0 req/s: cannot meet 100ms even at the maximum share 1.00 (utilisation over 0.80 at every batch size)"},
		{"rate 100 at the model's maximum", ModelSpec{MaxBatchSize: 4, MaxShare: 0.7}, linear, 100, 0.7,
			"cannot meet 100ms even at the maximum share 0.70"},
		{"no traffic", ModelSpec{MaxBatchSize: 4}, linear, 0, 0.05, "no traffic: minimum share 0.05"},
		// ρ = (0.8/b + 0.2)/s. At 0.65: b = 2 gives ρ = 0.92; b = 3 gives
		// t = 21.5ms, ρ = 0.718, fill 20ms, queueing 27.4ms: 69.0ms. At
		// 0.60 the best is b = 4 at 83.3ms, over 80.
		{"batching", ModelSpec{MaxBatchSize: 8}, fixed, 100, 0.65,
			"forecast 100.0 req/s needs 0.65 to meet 100ms (predicted 69.0ms at batch 3)"},
		// Two slots halve ρ: 0.35 gives ρ = 0.714 and t = 28.6ms, queueing
		// 35.7ms: 64.3ms; 0.30 gives ρ = 0.833, over 0.8.
		{"two slots", ModelSpec{MaxBatchSize: 1, Slots: 2}, linear, 50, 0.35,
			"forecast 50.0 req/s needs 0.35 to meet 100ms (predicted 64.3ms at batch 1)"},
		{"no prediction yet", ModelSpec{MaxBatchSize: 4}, func(string, int, float64) (time.Duration, bool) { return 0, false }, 50, 1,
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
				if got := ah.act.share("m").Compute; got != tc.want {
					t.Errorf("share = %v, want %v", got, tc.want)
				}
				if got := ah.pred.share("m"); got != tc.want {
					t.Errorf("predictor told %v, want %v", got, tc.want)
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
		ah := newAdjHarness(t, AdjusterOptions{}, ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 4})
		ah.pred.setRate("m", 10)
		ah.start()
		if got := ah.act.share("m").Compute; got != 0.20 {
			t.Fatalf("share at 10 req/s = %v, want 0.20", got)
		}
		ah.pred.setRate("m", 50)
		ah.tick()
		if got := ah.act.share("m").Compute; got != 0.65 {
			t.Errorf("share one period after the step to 50 req/s = %v, want 0.65", got)
		}
		e := lastEvent(t, ah.a, "m")
		want := Event{
			Time: ah.rec.start.Add(time.Second), Model: "m", Kind: EventResize,
			Old: limiter.Share{Compute: 0.20}, New: limiter.Share{Compute: 0.65},
			Reason:       "forecast 50.0 req/s needs 0.65 to meet 100ms (predicted 41.0ms at batch 1)",
			Predicted:    e.Predicted,
			ForecastRate: 50,
		}
		if e != want {
			t.Errorf("event = %+v\nwant %+v", e, want)
		}
		if e.Predicted.Round(ms) != 41*ms {
			t.Errorf("predicted %s, want 41ms", e.Predicted)
		}
		if got := ah.act.callLog(); !slices.Equal(got, []string{"m=0.2/0@0", "m=0.65/0@1"}) {
			t.Errorf("SetShare calls = %v", got)
		}
	})
}

// A share shrinks only after ScaleDownAfter of slack, and Cooldown after
// its last change, to the largest target of the window.
func TestAdjusterScaleDownHysteresis(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{ScaleDownAfter: 2 * time.Second, Cooldown: 4 * time.Second},
			ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 4})
		// Targets: 10 req/s 0.20, 25 req/s 0.35, 30 req/s 0.40, 50 req/s
		// 0.65, 70 req/s 0.90.
		steps := []struct {
			rate float64
			want float64
			why  string
		}{
			{50, 0.65, "first pass"},
			{10, 0.65, "slack for 0s"},
			{70, 0.90, "load is back and more: up at once, slack forgotten"},
			{30, 0.90, "slack for 0s"},
			{25, 0.90, "slack for 1s"},
			{10, 0.90, "slack for 2s, but the last change was 3s ago, under the cooldown"},
			{10, 0.35, "slack for 3s, 4s since the last change: the largest target of the last 2s"},
			{10, 0.35, "slack begins again below 0.35"},
			{10, 0.35, "slack for 1s"},
			{10, 0.35, "slack for 2s, cooldown not over"},
			{10, 0.20, "cooldown over"},
			{10, 0.20, "steady"},
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
			"0 forecast 50.0 req/s needs 0.65 to meet 100ms (predicted 41.0ms at batch 1)",
			"2 forecast 70.0 req/s needs 0.90 to meet 100ms (predicted 30.6ms at batch 1)",
			"6 slack for 3s: 0.90 -> 0.35; forecast 10.0 req/s needs 0.20 to meet 100ms (predicted 75.0ms at batch 1)",
			"10 slack for 3s: 0.35 -> 0.20; forecast 10.0 req/s needs 0.20 to meet 100ms (predicted 75.0ms at batch 1)",
		}
		if !slices.Equal(reasons, want) {
			t.Errorf("events:\n%s\nwant\n%s", strings.Join(reasons, "\n"), strings.Join(want, "\n"))
		}
		if n := len(ah.act.callLog()); n != 4 {
			t.Errorf("%d SetShare calls, want 4 (one a change)", n)
		}
		if got := ah.shareOf("m"); got.Target != 0.20 || got.Share.Compute != 0.20 {
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
			ModelSpec{Name: "lc", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
			ModelSpec{Name: "be1", Class: be, Priority: 1},
			ModelSpec{Name: "be2", Class: be, Priority: 2},
			ModelSpec{Name: "idle", Class: be},
		)
		ah.pred.setRate("lc", 50) // 0.65
		ah.pred.setRate("be1", 5)
		ah.pred.setRate("be2", 5)
		ah.start()
		// 1 - 0.65 - 0.05 (idle) = 0.30: be1 gets twice what be2 gets.
		want := map[string]float64{"lc": 0.65, "be1": 0.2, "be2": 0.1, "idle": 0.05}
		if got := ah.act.computes(); !maps.Equal(got, want) {
			t.Errorf("shares = %v\nwant %v", got, want)
		}
		if e := lastEvent(t, ah.a, "be2"); e.Reason != "best-effort: 0.10 of the 0.30 left (priority rank 2)" {
			t.Errorf("be2 reason %q", e.Reason)
		}
		if e := lastEvent(t, ah.a, "idle"); e.Reason != "best-effort, idle: minimum share 0.05" {
			t.Errorf("idle reason %q", e.Reason)
		}

		// 62 req/s needs 0.80 (ρ = 0.62/s < 0.8 from 0.775 up).
		ah.pred.setRate("lc", 62)
		ah.tick()
		// 0.15 left: be2 is at its minimum.
		want = map[string]float64{"lc": 0.8, "be1": 0.1, "be2": 0.05, "idle": 0.05}
		if got := ah.act.computes(); !maps.Equal(got, want) {
			t.Errorf("after lc grew: shares = %v\nwant %v", got, want)
		}
		if e := lastEvent(t, ah.a, "be1"); e.Reason != "capacity needed by other models: 0.20 -> 0.10; best-effort: 0.10 of the 0.15 left (priority rank 1)" {
			t.Errorf("be1 reason %q", e.Reason)
		}

		// Back down: the latency-critical model keeps its share through the
		// hysteresis, and the best-effort ones wait for it.
		ah.pred.setRate("lc", 50)
		for range 10 { // slack from 2s to 11s
			ah.tick()
		}
		if got := ah.act.computes(); !maps.Equal(got, want) {
			t.Errorf("within the hysteresis: shares = %v\nwant %v", got, want)
		}
		ah.tick()
		want = map[string]float64{"lc": 0.65, "be1": 0.2, "be2": 0.1, "idle": 0.05}
		if got := ah.act.computes(); !maps.Equal(got, want) {
			t.Errorf("after the hysteresis: shares = %v\nwant %v", got, want)
		}
		// Shrinks went first.
		calls := ah.act.callLog()
		if got := calls[len(calls)-3:]; !slices.Equal(got, []string{"lc=0.65/0@12", "be2=0.1/0@12", "be1=0.2/0@12"}) {
			t.Errorf("last calls %v", got)
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
		// Targets 0.65 + 0.65 = 1.30 over 1: each gives up its target ×
		// its rank × θ; 0.65θ + 1.30θ = 0.30: θ = 0.154, cuts 0.10 and
		// 0.20.
		{"priorities", 1, [2]int{1, 2}, [2]float64{0.55, 0.45}},
		{"equal", 0.8, [2]int{0, 0}, [2]float64{0.4, 0.4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ah := newAdjHarness(t, AdjusterOptions{Capacity: tc.capacity},
					ModelSpec{Name: "a", Class: lc, SLO: 100 * ms, MaxBatchSize: 4, Priority: tc.prio[0]},
					ModelSpec{Name: "b", Class: lc, SLO: 100 * ms, MaxBatchSize: 4, Priority: tc.prio[1]},
				)
				ah.pred.setRate("a", 50)
				ah.pred.setRate("b", 50)
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
			ModelSpec{Name: "cfg", Class: lc, SLO: 100 * ms, Pin: &limiter.Share{Compute: 0.3, Memory: gib}},
			ModelSpec{Name: "lc", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
			ModelSpec{Name: "be", Class: be},
		)
		ah.pred.setRate("cfg", 50)
		ah.pred.setRate("lc", 10) // 0.20
		ah.pred.setRate("be", 1)
		ah.start()
		want := map[string]float64{"cfg": 0.3, "lc": 0.2, "be": 0.5}
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
		if got := ah.act.share("lc").Compute; got != 0.2 {
			t.Errorf("lc after unpin: %v, want 0.2 at once", got)
		}
		if err := ah.a.Pin("lc", nil); err != nil {
			t.Errorf("unpinning twice: %v", err)
		}
		if err := ah.a.Pin("nope", &limiter.Share{Compute: 0.5}); !errors.Is(err, ErrUnknownModel) {
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
		if err := ah.s.UpdateModel(ModelSpec{Name: "cfg", Class: lc, SLO: 100 * ms, Executor: &fakeModel{name: "cfg", rec: ah.rec}}); err != nil {
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
				ModelSpec{Name: "a", Class: lc, SLO: 100 * ms},
				ModelSpec{Name: "b", Class: be},
				ModelSpec{Name: "c", Class: be},
			)
			ah.start()
			third := limiter.Share{Compute: 0.3333, Memory: gib}
			want := map[string]limiter.Share{"a": third, "b": third, "c": third}
			if got := ah.act.all(); !maps.Equal(got, want) {
				t.Errorf("shares = %v, want %v", got, want)
			}
			ah.model(ModelSpec{Name: "d", Class: be}, nil)
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
			if ah.a.Policy() != SharePolicyStatic {
				t.Errorf("Policy() = %q", ah.a.Policy())
			}
		})
	})
	t.Run("shared", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			ah := newAdjHarness(t, AdjusterOptions{Policy: SharePolicyShared, MemoryBudget: gib},
				ModelSpec{Name: "a", Class: lc, SLO: 100 * ms, Memory: gib},
				ModelSpec{Name: "b", Class: be},
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
func blocker(release <-chan struct{}) Executor {
	return ExecutorFunc(func(ctx context.Context, _ *runtime.InferRequest) (*runtime.InferResponse, error) {
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
		h := newHarness(t, Options{DeviceSlots: 1})
		h.run()
		release := make(chan struct{})
		defer close(release)
		for _, name := range []string{"old", "recent", "fresh"} {
			h.model(ModelSpec{Name: name, Class: be}, nil)
		}
		for _, name := range []string{"running", "queued"} {
			if err := h.s.AddModel(ModelSpec{Name: name, Class: be, Executor: blocker(release)}); err != nil {
				t.Fatal(err)
			}
		}
		ctx := t.Context()
		mustSucceed(t, h.submit(ctx, "old", RequestOptions{}, 1)) // at 0s
		time.Sleep(30 * time.Second)
		mustSucceed(t, h.submit(ctx, "recent", RequestOptions{}, 2)) // at 30s
		// "running" holds the one device slot, so "queued" waits.
		h.submit(ctx, "running", RequestOptions{}, 3)
		h.submit(ctx, "queued", RequestOptions{}, 4)
		time.Sleep(65 * time.Second)
		// "fresh" has a request at 95s, which admission turns away: with
		// the device busy it cannot meet its deadline.
		h.est.Observe("fresh", 1, 10*ms)
		p := h.submit(ctx, "fresh", RequestOptions{Deadline: time.Now().Add(ms)}, 5)
		if err := p.wait(t); !errors.Is(err, ErrRejected) {
			t.Fatalf("fresh: %v, want rejected", err)
		}
		time.Sleep(5 * time.Second)
		for name, want := range map[string][2]int{"running": {1, 0}, "queued": {0, 1}, "fresh": {0, 0}} {
			st, _ := h.s.modelState(name)
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
			ModelSpec{Name: "bad", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
			ModelSpec{Name: "good", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
		)
		ah.pred.setRate("bad", 10)
		ah.pred.setRate("good", 10)
		ah.act.fail["bad"] = 2
		ah.start()
		if s := ah.shareOf("bad"); s.Share != (limiter.Share{}) || s.Target != 0.2 {
			t.Errorf("after a failure: %+v", s)
		}
		if got := ah.act.share("good").Compute; got != 0.2 {
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
		if want := []string{"bad=0.2/0@0", "bad=0.2/0@1", "bad=0.2/0@3"}; !slices.Equal(calls, want) {
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
			"3 resize forecast 10.0 req/s needs 0.20 to meet 100ms (predicted 75.0ms at batch 1)",
		}
		if !slices.Equal(got, want) {
			t.Errorf("events:\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
		if s := ah.shareOf("bad"); s.Share.Compute != 0.2 {
			t.Errorf("after the retry: %+v", s)
		}
	})
}

func TestAdjusterEventsAndShares(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{EventCapacity: 3, Device: "cpu"},
			ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 4, Memory: gib})
		ah.pred.setRate("m", 10)
		ps := []*pending{
			ah.submit(t.Context(), "m", RequestOptions{}, 1),
			ah.submit(t.Context(), "m", RequestOptions{}, 2),
		}
		mustSucceed(t, ps...)
		ah.start()
		for _, r := range []float64{50, 70} {
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
			ForecastRate: 70, SLO: 100 * ms, Attainment: 1,
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
			Model: "m", Class: lc, Share: limiter.Share{Compute: 0.9, Memory: gib}, Target: 0.9, Source: SharePolicyAdaptive,
			PredictedLatency: got[0].PredictedLatency, ForecastRate: 70, SLO: 100 * ms, Attainment: 1,
		}
		// At 0.90: t = 11.1ms, ρ = 0.778, queueing 19.4ms.
		if got[0] != want || got[0].PredictedLatency.Round(100*time.Microsecond) != 30600*time.Microsecond {
			t.Errorf("Shares()[0] = %+v\nwant %+v", got[0], want)
		}
	})
}

func TestAdjusterRun(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah := newAdjHarness(t, AdjusterOptions{Period: 5 * time.Second},
			ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 4})
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
	s, err := NewScheduler(Options{})
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

func TestModelSpecShareFields(t *testing.T) {
	exec := ExecutorFunc(func(context.Context, *runtime.InferRequest) (*runtime.InferResponse, error) { return nil, nil })
	for _, tc := range []struct {
		spec ModelSpec
		want string
	}{
		{ModelSpec{MinShare: 1.5}, "min share 1.5 or max share 0 is not a fraction"},
		{ModelSpec{MaxShare: -0.1}, "is not a fraction"},
		{ModelSpec{MinShare: 0.5, MaxShare: 0.2}, "min share 0.5 is over max share 0.2"},
		{ModelSpec{Pin: &limiter.Share{Compute: math.NaN()}}, "pinned share"},
		{ModelSpec{Pin: &limiter.Share{Memory: -1}}, "pinned share"},
		{ModelSpec{Memory: -1}, "memory share -1 is negative"},
	} {
		spec := tc.spec
		spec.Name, spec.Executor = "m", exec
		if err := validateSpec(&spec); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.spec, err, tc.want)
		}
	}
	pin := &limiter.Share{Compute: 0.5}
	spec := ModelSpec{Name: "m", Executor: exec, MinShare: 0.1, MaxShare: 0.9, Pin: pin, Memory: gib}
	if err := validateSpec(&spec); err != nil {
		t.Fatal(err)
	}
	pin.Compute = 0.7
	if spec.Pin.Compute != 0.5 {
		t.Error("the spec shares its pin with the caller")
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
			ModelSpec{Name: "lc", Class: lc, SLO: 100 * ms, MaxBatchSize: 4, Memory: gib},
			ModelSpec{Name: "be", Class: be},
		)
		if _, err := NewAdjuster(ah.s, AdjusterOptions{Registerer: reg, Device: "cpu", Predictor: ah.pred, Actuator: ah.act}); err == nil {
			t.Error("two adjusters registered the same device")
		}
		ah.pred.setRate("lc", 50)
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
sloserve_share_compute{device="cpu",model="lc"} 0.65
# HELP sloserve_share_memory_bytes Memory share applied to the model; 0 means no limit.
# TYPE sloserve_share_memory_bytes gauge
sloserve_share_memory_bytes{device="cpu",model="be"} 0
sloserve_share_memory_bytes{device="cpu",model="lc"} 1.073741824e+09
# HELP sloserve_share_target_compute Compute share the adjuster's last pass wanted for the model.
# TYPE sloserve_share_target_compute gauge
sloserve_share_target_compute{device="cpu",model="be"} 0.05
sloserve_share_target_compute{device="cpu",model="lc"} 0.65
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
