package qos

import (
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// A latency-critical batch is held back rather than started beside a
// running latency-critical execution that the overlap (OverlapSlowdown)
// would make late, when it can wait for that execution's predicted end
// and still meet its own deadline; otherwise it starts on the free slot
// at once. Model "y" runs 30 ms (predicted 30 ms) from 0 with its
// deadline at yDeadline; "x" (10 ms) arrives at 5 ms with its deadline
// xDeadline after its arrival. Beside x, y would end at
// 30 + (k-1) x 10 ms.
func TestOverlapHoldsBesideExecutionAtRisk(t *testing.T) {
	cases := []struct {
		name                 string
		k                    float64
		yDeadline, xDeadline time.Duration
		yTakes               time.Duration // what y's execution really takes
		xClass               Class
		wantX                time.Duration // when x starts
		wantHolds            float64
	}{
		// y ends at 50 ms beside x (k = 3), past its 40 ms: x waits
		// for y's end at 30 ms, and still ends by its deadline (40 ms
		// of 105).
		{name: "held until the running one ends", k: 3, yDeadline: 40 * ms, xDeadline: 100 * ms, yTakes: 30 * ms, xClass: lc, wantX: 30 * ms, wantHolds: 1},
		// x could not wait: y's end and x's own 10 ms is 40 ms, past
		// x's deadline at 35 ms. A sure miss is not traded for a
		// likely one.
		{name: "starts when it cannot wait", k: 3, yDeadline: 40 * ms, xDeadline: 30 * ms, yTakes: 30 * ms, xClass: lc, wantX: 5 * ms},
		// y would end at 50 ms beside x, within its 60 ms.
		{name: "starts beside one not at risk", k: 3, yDeadline: 60 * ms, xDeadline: 100 * ms, yTakes: 30 * ms, xClass: lc, wantX: 5 * ms},
		// k = 2: y ends at 40 ms beside x, at its deadline.
		{name: "the slowdown decides", k: 2, yDeadline: 40 * ms, xDeadline: 100 * ms, yTakes: 30 * ms, xClass: lc, wantX: 5 * ms},
		{name: "off by default", k: 0, yDeadline: 40 * ms, xDeadline: 100 * ms, yTakes: 30 * ms, xClass: lc, wantX: 5 * ms},
		// y runs 60 ms against its 30 predicted: x waits until y's
		// predicted end only, where what y still takes is unknown.
		{name: "held no longer than the predicted end", k: 3, yDeadline: 40 * ms, xDeadline: 100 * ms, yTakes: 60 * ms, xClass: lc, wantX: 30 * ms, wantHolds: 1},
		// Best-effort work is not held by this rule (in one pool it
		// waits for latency-critical work anyway, and here for its
		// slot's turn).
		{name: "best-effort not held", k: 3, yDeadline: 40 * ms, xDeadline: 100 * ms, yTakes: 30 * ms, xClass: be, wantX: 5 * ms},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				reg := prometheus.NewRegistry()
				h := newHarness(t, Options{DeviceSlots: 2, SeparateClasses: true, OverlapSlowdown: c.k, Registerer: reg, BestEffortFloor: -1})
				h.model(ModelSpec{Name: "y", Class: lc, SLO: time.Second}, constant(c.yTakes))
				h.model(ModelSpec{Name: "x", Class: c.xClass, SLO: time.Second}, constant(10*ms))
				h.seed("y", 1, constant(30*ms))
				h.seed("x", 1, constant(10*ms))
				h.run()
				ctx := t.Context()
				start := time.Now()
				py := h.submit(ctx, "y", RequestOptions{Deadline: start.Add(c.yDeadline)}, 1)
				time.Sleep(5 * ms)
				px := h.submit(ctx, "x", RequestOptions{Deadline: time.Now().Add(c.xDeadline)}, 2)
				py.wait(t)
				px.wait(t)
				got := map[string]time.Duration{}
				for _, cl := range h.rec.snapshot() {
					got[cl.model] = cl.at
				}
				if got["y"] != 0 || got["x"] != c.wantX {
					t.Errorf("executions %v, want y at 0s and x at %s", h.rec.snapshot(), c.wantX)
				}
				if n := testutil.ToFloat64(h.s.metrics.holds.WithLabelValues("x")); n != c.wantHolds {
					t.Errorf("sloserve_qos_overlap_holds_total{model=x} = %v, want %v", n, c.wantHolds)
				}
			})
		})
	}
}

// A hold is counted once per held batch, however many dispatch passes
// repeat it, and a held batch takes in the requests that arrive while it
// waits.
func TestOverlapHoldCountedOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		reg := prometheus.NewRegistry()
		h := newHarness(t, Options{DeviceSlots: 2, SeparateClasses: true, OverlapSlowdown: 3, Registerer: reg})
		h.model(ModelSpec{Name: "y", Class: lc, SLO: time.Second}, constant(30*ms))
		h.model(ModelSpec{Name: "x", Class: lc, SLO: time.Second, MaxBatchSize: 4}, constant(10*ms))
		h.model(ModelSpec{Name: "z", Class: lc, SLO: time.Second}, constant(1*ms))
		h.seed("y", 1, constant(30*ms))
		h.seed("x", 4, constant(10*ms))
		h.seed("z", 1, constant(1*ms))
		h.run()
		ctx := t.Context()
		start := time.Now()
		ps := []*pending{h.submit(ctx, "y", RequestOptions{Deadline: start.Add(40 * ms)}, 1)}
		for i := range 3 {
			time.Sleep(5 * ms)
			ps = append(ps, h.submit(ctx, "x", RequestOptions{Deadline: time.Now().Add(100 * ms)}, int64(10+i)))
			// Another model's request passes through (its execution
			// of 1 ms beside y's does not make y late) and makes the
			// dispatcher look at x's held batch again.
			ps = append(ps, h.submit(ctx, "z", RequestOptions{Deadline: time.Now().Add(100 * ms)}, int64(20+i)))
		}
		mustSucceed(t, ps...)
		var order []string
		for _, cl := range h.rec.snapshot() {
			order = append(order, fmt.Sprintf("%s%v@%s", cl.model, cl.ids, cl.at))
		}
		want := "[y[1]@0s z[20]@5ms z[21]@10ms z[22]@15ms x[10 11 12]@30ms]"
		if fmt.Sprint(order) != want {
			t.Errorf("executions %v, want %s", order, want)
		}
		if n := testutil.ToFloat64(h.s.metrics.holds.WithLabelValues("x")); n != 1 {
			t.Errorf("sloserve_qos_overlap_holds_total{model=x} = %v, want 1", n)
		}
	})
}
