package qos

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"
)

// With SeparateClasses a latency-critical request neither waits for nor is
// refused because of best-effort executions holding every device slot;
// without it, the same request is refused (the one-pool behaviour).
func TestSeparateClassesLatencyCriticalPassesBestEffort(t *testing.T) {
	for _, separate := range []bool{true, false} {
		t.Run(fmt.Sprint("separate=", separate), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				h := newHarness(t, Options{DeviceSlots: 2, SeparateClasses: separate})
				h.model(ModelSpec{Name: "be", Class: be, Slots: 2}, constant(300*ms))
				h.model(ModelSpec{Name: "lc", Class: lc, SLO: 40 * ms}, constant(10*ms))
				h.seed("be", 1, constant(300*ms))
				h.seed("lc", 1, constant(10*ms))
				h.run()
				ctx := t.Context()
				long := []*pending{h.submit(ctx, "be", RequestOptions{}, 1), h.submit(ctx, "be", RequestOptions{}, 2)}
				synctest.Wait() // both slots hold 300ms best-effort batches
				quick := h.submit(ctx, "lc", RequestOptions{}, 10)
				<-quick.done
				if separate {
					mustSucceed(t, quick)
					mustSucceed(t, long...)
					checkCalls(t, h, "be[1]@0s", "be[2]@0s", "lc[10]@0s")
					return
				}
				if !errors.Is(quick.err, ErrRejected) || !strings.Contains(quick.err.Error(), "queue ahead 300.0ms") {
					t.Errorf("one pool: lc behind two 300ms batches: %v, want rejected with the queue ahead 300ms", quick.err)
				}
				mustSucceed(t, long...)
			})
		})
	}
}

// Separate pools still bound each class: a third best-effort batch waits
// for a best-effort slot even while latency-critical slots are free, and
// latency-critical executions never exceed the device's slots.
func TestSeparateClassesBoundEachClass(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{DeviceSlots: 2, SeparateClasses: true})
		h.model(ModelSpec{Name: "be", Class: be, Slots: 4}, constant(100*ms))
		h.model(ModelSpec{Name: "lc", Class: lc, SLO: time.Second, Slots: 4}, constant(50*ms))
		var ps []*pending
		for i := range int64(3) {
			ps = append(ps, h.submit(t.Context(), "be", RequestOptions{}, 1+i))
		}
		for i := range int64(3) {
			ps = append(ps, h.submit(t.Context(), "lc", RequestOptions{}, 10+i))
		}
		h.run()
		mustSucceed(t, ps...)
		// Executions that start at one instant record in any order.
		var got []string
		for _, c := range h.rec.snapshot() {
			got = append(got, c.String())
		}
		slices.Sort(got)
		want := []string{"be[1]@0s", "be[2]@0s", "be[3]@100ms", "lc[10]@0s", "lc[11]@0s", "lc[12]@50ms"}
		if !slices.Equal(got, want) {
			t.Errorf("executions = %v, want %v", got, want)
		}
	})
}

// Best-effort models of one priority take turns by predicted work: a
// model with 40ms executions gets about as much device time as one with
// 10ms executions, not a FIFO's share by arrival, and a model that was
// idle does not get its idle time back as a burst.
func TestBestEffortFairQueueing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{DeviceSlots: 1})
		h.model(ModelSpec{Name: "big", Class: be, QueueCapacity: 100}, constant(40*ms))
		h.model(ModelSpec{Name: "small", Class: be, QueueCapacity: 100}, constant(10*ms))
		h.seed("big", 1, constant(40*ms))
		h.seed("small", 1, constant(10*ms))
		var ps []*pending
		// big's requests all arrive first: a FIFO would run them all first.
		for i := range int64(10) {
			ps = append(ps, h.submit(t.Context(), "big", RequestOptions{}, 100+i))
		}
		for i := range int64(40) {
			ps = append(ps, h.submit(t.Context(), "small", RequestOptions{}, 200+i))
		}
		h.run()
		time.Sleep(400 * ms)
		busy := map[string]time.Duration{}
		for _, c := range h.rec.snapshot() {
			if c.at < 400*ms {
				busy[c.model] += map[string]time.Duration{"big": 40 * ms, "small": 10 * ms}[c.model]
			}
		}
		if d := busy["big"] - busy["small"]; d < -50*ms || d > 50*ms {
			t.Errorf("device time in the first 400ms: big %s, small %s; want within 50ms of each other", busy["big"], busy["small"])
		}
		mustSucceed(t, ps...)

		// small is idle now; big works alone for a while, then small
		// returns and must not run a long burst while big waits.
		for i := range int64(10) {
			ps = append(ps, h.submit(t.Context(), "big", RequestOptions{}, 300+i))
		}
		time.Sleep(200 * ms)
		for i := range int64(20) {
			ps = append(ps, h.submit(t.Context(), "small", RequestOptions{}, 400+i))
		}
		mustSucceed(t, ps...)
		run, longest := 0, 0
		for _, c := range h.rec.snapshot() {
			if c.model == "small" && c.ids[0] >= 400 {
				run++
				longest = max(longest, run)
			} else {
				run = 0
			}
		}
		// Turns are by work: 4 of small's 10ms per big's 40ms, and at most
		// one more turn's worth while big's execution in flight counts
		// against it. Without the catch-up small would run all 20.
		if longest > 8 {
			t.Errorf("small ran %d executions in a row after returning from idle; want turns with big (4 of 10ms per 40ms)", longest)
		}
	})
}

// A best-effort batch stops growing before its predicted duration passes
// MaxBestEffortExecution; latency-critical batches are not bounded by it.
func TestBestEffortBatchBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{MaxBestEffortExecution: 50 * ms})
		perRow := func(ids []int64) time.Duration { return time.Duration(len(ids)) * 20 * ms }
		h.model(ModelSpec{Name: "be", Class: be, MaxBatchSize: 8}, perRow)
		h.model(ModelSpec{Name: "lc", Class: lc, SLO: time.Second, MaxBatchSize: 8}, perRow)
		for b := 1; b <= 8; b++ {
			h.est.Observe("be", b, time.Duration(b)*20*ms)
			h.est.Observe("lc", b, time.Duration(b)*20*ms)
		}
		var ps []*pending
		for i := range int64(5) {
			ps = append(ps, h.submit(t.Context(), "be", RequestOptions{}, 1+i))
		}
		h.run()
		mustSucceed(t, ps...)
		// 2 rows are 40ms, 3 would be 60ms: batches of 2, 2, 1.
		checkCalls(t, h, "be[1 2]@0s", "be[3 4]@40ms", "be[5]@80ms")

		// While a best-effort row holds the device, five latency-critical
		// requests queue: they run as one batch of 100ms.
		ps = []*pending{h.submit(t.Context(), "be", RequestOptions{}, 100)}
		for i := range int64(5) {
			ps = append(ps, h.submit(t.Context(), "lc", RequestOptions{}, 11+i))
		}
		mustSucceed(t, ps...)
		calls := h.rec.snapshot()
		if last := calls[len(calls)-1]; last.model != "lc" || len(last.ids) != 5 {
			t.Errorf("executions %v, want the latency-critical five in one batch", calls)
		}
	})
}
