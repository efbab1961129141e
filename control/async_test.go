package control

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/qos"
)

// asyncActuator resizes as a registry whose instances must be replaced:
// a requested share takes effect after the passes the test sets (or fails
// with swapErr), and SetShare is never called.
type asyncActuator struct {
	*fakeActuator
	mu       sync.Mutex
	inEffect map[string]limiter.Share
	want     map[string]limiter.Share
	left     map[string]int // polls until the pending share applies
	slow     int            // polls a request stays pending
	swapErr  error          // the next finished request fails with it
	lastErr  map[string]error
	sync     int      // SetShare calls: must stay 0
	asked    []string // the models of the RequestShare calls, in order
}

var _ AsyncActuator = (*asyncActuator)(nil)

func newAsyncActuator(slow int) *asyncActuator {
	return &asyncActuator{fakeActuator: newFakeActuator(), inEffect: map[string]limiter.Share{},
		want: map[string]limiter.Share{}, left: map[string]int{}, lastErr: map[string]error{}, slow: slow}
}

func (f *asyncActuator) SetShare(context.Context, string, limiter.Share) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sync++
	return errors.New("the adjuster must not wait on an AsyncActuator")
}

func (f *asyncActuator) RequestShare(model string, s limiter.Share) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.want[model], f.left[model] = s, f.slow
	f.asked = append(f.asked, model)
	return nil
}

func (f *asyncActuator) ShareInEffect(model string) (limiter.Share, bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if w, ok := f.want[model]; ok {
		if f.left[model] > 0 {
			f.left[model]--
			return f.inEffect[model], true, nil
		}
		delete(f.want, model)
		f.lastErr[model] = f.swapErr
		if f.swapErr == nil {
			f.inEffect[model] = w
		}
		f.swapErr = nil
	}
	return f.inEffect[model], false, f.lastErr[model]
}

// With an AsyncActuator the loop asks for a share and goes on: the
// predictor learns the share, and the resize is recorded, only once it is
// in effect; a replacement that fails is an error event and the share is
// asked for again after the backoff.
func TestAdjusterAsyncResize(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		act := newAsyncActuator(2)
		ah := newAdjHarness(t, AdjusterOptions{Actuator: act},
			qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
		)
		ah.pred.setRate("m", 10)
		ah.pred.SetShare("m", -1) // not told yet
		act.swapErr = errors.New("replacement did not come up")
		ah.start()
		// Asked at 0 s (the request and the pass's first look: starting);
		// still starting at 1 s; failed at 2 s: an error, asked again after
		// the 1 s backoff (at 3 s), starting at 3 s and 4 s, in effect at
		// 5 s.
		for pass := 1; pass <= 6; pass++ {
			ah.tick()
			told := ah.pred.share("m") != -1
			if pass < 5 && told {
				t.Errorf("pass %d: the predictor was told the share before it was in effect", pass)
			}
			if pass >= 5 && !told {
				t.Errorf("pass %d: the predictor was not told the share in effect", pass)
			}
		}
		var got []string
		for _, e := range ah.a.Events(time.Time{}, 0) {
			got = append(got, e.Kind+" "+e.Reason)
		}
		if len(got) != 2 || !strings.HasPrefix(got[0], "error setting the share failed (attempt 1, next in 1s): replacement did not come up") ||
			!strings.HasPrefix(got[1], "resize ") || !strings.Contains(got[1], "in effect 2s after it was asked for") {
			t.Errorf("events:\n%s", strings.Join(got, "\n"))
		}
		if act.sync != 0 {
			t.Errorf("%d SetShare calls", act.sync)
		}
	})
}

// Where every share is a new client (CapsOnly: MPS) the models' first
// shares go one at a time: the next model's first share is asked for
// once the one before is in effect, so that the device never holds more
// than one first swap's two clients. A model's later shares do not wait.
func TestAdjusterStaggersFirstSwapsOnMPS(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		act := newAsyncActuator(2)
		ah := newAdjHarness(t, AdjusterOptions{Actuator: act, CapsOnly: true},
			qos.ModelSpec{Name: "a", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
			qos.ModelSpec{Name: "b", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
			qos.ModelSpec{Name: "c", Class: lc, SLO: 100 * ms, MaxBatchSize: 4},
		)
		for _, m := range []string{"a", "b", "c"} {
			ah.pred.setRate(m, 10)
		}
		ah.start()
		pending := func() (n int) {
			act.mu.Lock()
			defer act.mu.Unlock()
			return len(act.want)
		}
		most := pending()
		for range 12 {
			ah.tick()
			most = max(most, pending())
		}
		act.mu.Lock()
		asked := append([]string(nil), act.asked...)
		inEffect := len(act.inEffect)
		act.mu.Unlock()
		if most != 1 {
			t.Errorf("%d first shares starting at once, want 1", most)
		}
		if inEffect != 3 {
			t.Errorf("%d of 3 models have a share in effect after 12 passes (asked: %v), want all", inEffect, asked)
		}
		seen := map[string]bool{}
		for _, m := range asked[:min(3, len(asked))] {
			seen[m] = true
		}
		if len(asked) < 3 || len(seen) != 3 {
			t.Errorf("first requests %v, want each model once before any asks again", asked)
		}
	})
}
