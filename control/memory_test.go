package control

import (
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/qos"
)

const mib = int64(1) << 20

// wsPredictor is the fake predictor with working sets: weights plus a
// part per batch row.
type wsPredictor struct {
	*fakePredictor
	weights, perRow int64
}

func (p *wsPredictor) WorkingSet(_ string, batch int) (int64, bool) {
	return p.weights + int64(max(batch, 1))*p.perRow, true
}

// heldActuator is the fake actuator reading what each model's largest
// instance holds.
type heldActuator struct {
	*fakeActuator
	mu   sync.Mutex
	held map[string]int64
}

func (f *heldActuator) InstanceMemory(model string) int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.held[model]
}

func (f *heldActuator) hold(model string, n int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.held[model] = n
}

// newMemHarness is an adjuster whose predictor knows working sets of
// 100MiB + 50MiB per row and whose actuator reads what instances hold.
func newMemHarness(t *testing.T, opts AdjusterOptions, specs ...qos.ModelSpec) (*adjHarness, *heldActuator) {
	t.Helper()
	pred := &wsPredictor{fakePredictor: newFakePredictor(), weights: 100 * mib, perRow: 50 * mib}
	act := &heldActuator{fakeActuator: newFakeActuator(), held: map[string]int64{}}
	opts.Predictor, opts.Actuator = pred, act
	ah := newAdjHarness(t, opts, specs...)
	ah.pred, ah.act = pred.fakePredictor, act.fakeActuator
	return ah, act
}

// The memory share follows the working set of the batch the model is
// expected to run: an idle model's is its batch-1 set with the headroom; a
// forecast rise grows it in the same pass, before any batch of that size
// has run; it shrinks back only after ScaleDownAfter of smaller targets and
// Cooldown after its last change.
func TestMemoryGrowsBeforeTheBatchAndShrinksAfterIdle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah, _ := newMemHarness(t, AdjusterOptions{ScaleDownAfter: 2 * time.Second, Cooldown: 4 * time.Second},
			qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 8, Memory: 2 << 30})
		ah.start()
		// Idle: batch 1, (100 + 50)MiB × 1.25 = 187.5MiB, rounded up.
		if got := ah.act.share("m").Memory; got != 188*mib {
			t.Fatalf("idle memory share %dMiB, want 188MiB", got/mib)
		}
		if e := lastEvent(t, ah.a, "m"); !strings.Contains(e.Reason, "memory 188MiB: batch 1 (idle) needs 150MiB + 25%") {
			t.Errorf("first event's reason %q", e.Reason)
		}

		// 10 req/s at the floor 0.45 with t(b) = 10ms·b/0.45: n = 0.222·b
		// arrivals over one execution; b = 5 is the first batch with
		// n + 2.326·√n + 1 <= b. (100 + 250)MiB × 1.25 = 437.5MiB.
		ah.pred.setRate("m", 10)
		ah.tick()
		if got := ah.act.share("m").Memory; got != 438*mib {
			t.Fatalf("memory share at 10 req/s %dMiB, want 438MiB", got/mib)
		}
		if n := len(ah.rec.snapshot()); n != 0 {
			t.Fatalf("%d executions before the share grew; the test wants it to grow first", n)
		}
		e := lastEvent(t, ah.a, "m")
		if e.Old.Memory != 188*mib || e.New.Memory != 438*mib ||
			!strings.Contains(e.Reason, "memory 188MiB -> 438MiB: batch 5 (forecast 10.0 req/s) needs 350MiB + 25%") {
			t.Errorf("growth event %+v", e)
		}
		if got := ah.shareOf("m"); got.MemoryTarget != 438*mib || !strings.HasPrefix(got.MemoryReason, "memory 188MiB -> 438MiB") {
			t.Errorf("Shares: target %d, reason %q", got.MemoryTarget, got.MemoryReason)
		}

		// Idle again at 2s: held while the targets of the last 2s are not
		// all smaller and for the 4s cooldown after the growth at 1s.
		ah.pred.setRate("m", 0)
		for at := 2; at <= 4; at++ {
			ah.tick()
			if got := ah.act.share("m").Memory; got != 438*mib {
				t.Fatalf("t=%ds: memory share %dMiB, want 438MiB held", at, got/mib)
			}
		}
		ah.tick() // 5s
		if got := ah.act.share("m").Memory; got != 188*mib {
			t.Fatalf("t=5s: memory share %dMiB, want 188MiB after idle", got/mib)
		}
		if got := ah.shareOf("m").MemoryReason; !strings.HasPrefix(got, "memory 438MiB -> 188MiB after 2s under it: batch 1 (idle)") {
			t.Errorf("shrink reason %q", got)
		}
	})
}

// A queue that built up counts as a batch: the share grows for what is
// queued even where the forecast says little.
func TestMemoryGrowsForTheQueue(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah, _ := newMemHarness(t, AdjusterOptions{}, qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 8, Memory: 2 << 30})
		st := qos.ModelState{Spec: qos.ModelSpec{Name: "m", MaxBatchSize: 8}, QueueDepth: 6}
		if b, why := ah.a.nextBatch(st, 0.5, 0); b != 6 || why != "6 queued" {
			t.Errorf("nextBatch with 6 queued = %d (%s), want 6", b, why)
		}
		st.QueueDepth = 20
		if b, _ := ah.a.nextBatch(st, 0.5, 0); b != 8 {
			t.Errorf("nextBatch with 20 queued = %d, want the maximum 8", b)
		}
	})
}

// No memory share goes below what the instance holds now (plus a margin):
// the kernel would kill it.
func TestMemoryNeverBelowWhatTheInstanceHolds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah, act := newMemHarness(t, AdjusterOptions{ScaleDownAfter: time.Second, Cooldown: time.Second},
			qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 8, Memory: 2 << 30})
		act.hold("m", 400*mib) // its arena grew at a batch of 6 earlier
		ah.start()
		// 400MiB + 1/16 = 425MiB, over the idle target of 188MiB.
		if got := ah.act.share("m").Memory; got != 425*mib {
			t.Fatalf("memory share %dMiB, want 425MiB", got/mib)
		}
		if e := lastEvent(t, ah.a, "m"); !strings.Contains(e.Reason, "the instance holds 400MiB") {
			t.Errorf("reason %q", e.Reason)
		}
		// Over the limit: the limit, whatever the instance holds.
		act.hold("m", 3<<30)
		for range 4 {
			ah.tick()
		}
		if got := ah.act.share("m").Memory; got != 2<<30 {
			t.Errorf("memory share %dMiB, want the 2048MiB limit", got/mib)
		}
		// It released memory: the share follows down after the hysteresis,
		// never under what it holds.
		act.hold("m", 200*mib)
		for range 4 {
			ah.tick()
		}
		if got := ah.act.share("m").Memory; got != 213*mib {
			t.Errorf("memory share %dMiB, want 213MiB (200MiB held + 1/16, rounded up)", got/mib)
		}
	})
}

// The memory shares count against the budget: when a busy model's growth
// and an idle model's share do not fit, the idle one is evicted.
func TestMemorySumOverBudgetEvictsIdle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah, _ := newMemHarness(t, AdjusterOptions{MemoryBudget: 700 * mib, KeepAlive: 3 * time.Second},
			qos.ModelSpec{Name: "busy", Class: lc, SLO: 100 * ms, MaxBatchSize: 8, Memory: 2 << 30},
			qos.ModelSpec{Name: "idle", Class: be, MaxBatchSize: 8, Memory: 2 << 30})
		ah.start()
		// 188MiB each: within the budget.
		if got := ah.act.evictions(); len(got) != 0 {
			t.Fatalf("evicted %v while within the budget", got)
		}
		time.Sleep(3 * time.Second)
		mustSucceed(t, ah.submit(t.Context(), "busy", qos.RequestOptions{}, 1)) // busy is active
		ah.pred.setRate("busy", 10)                                             // 438MiB + 188MiB = 626MiB: still within
		ah.tick()
		if got := ah.act.evictions(); len(got) != 0 {
			t.Fatalf("evicted %v at 626MiB of 700MiB", got)
		}
		ah.pred.setRate("busy", 30) // a larger batch: over the budget beside idle
		ah.tick()
		if got := ah.act.share("busy").Memory; got <= 512*mib {
			t.Fatalf("busy's memory share %dMiB, want it grown past 512MiB", got/mib)
		}
		if got := ah.act.evictions(); len(got) != 1 || got[0] != "idle" {
			t.Errorf("evicted %v, want [idle]", got)
		}
	})
}

// Where shares are caps (MPS) the memory share is sized for the largest
// batch whatever the forecast (an arena cannot grow past a client's pinned
// limit), grows at once when the instance holds more, and a shrink under
// half of the share waits for a compute resize to ride along with, since
// each change is a new client.
func TestMemoryWhereCapsOnly(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah, act := newMemHarness(t, AdjusterOptions{CapsOnly: true, ScaleDownAfter: 2 * time.Second, Cooldown: time.Second},
			qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 8, Memory: 2 << 30})
		ah.start()
		ah.pred.setRate("m", 10) // batch 1 would do: 0.45
		ah.tick()
		// 100MiB + 8 x 50MiB at the largest batch, + 25%.
		if got := ah.act.share("m"); got.Memory != 625*mib || got.Compute != 0.45 {
			t.Fatalf("t=1s: share %.2f, %dMiB; want 0.45 and 625MiB (batch 8's 500MiB + 25%%), not the 2048MiB limit", got.Compute, got.Memory/mib)
		}
		act.hold("m", 640*mib) // more than measured: grows alone
		ah.tick()
		if got := ah.act.share("m"); got.Memory != 680*mib || got.Compute != 0.45 {
			t.Fatalf("t=2s: share %.2f, %dMiB; want 0.45 and 680MiB (640MiB + 1/16)", got.Compute, got.Memory/mib)
		}
		resizes := len(ah.act.callLog())
		act.hold("m", 0) // back to 625MiB: a shrink of 55MiB
		for range 5 {
			ah.tick()
		}
		if got := ah.act.share("m"); got.Memory != 680*mib {
			t.Fatalf("t=7s: memory %dMiB, want 680MiB until a compute resize (a shrink alone would start a client)", got.Memory/mib)
		}
		if n := len(ah.act.callLog()); n != resizes {
			t.Errorf("%d resizes while only the memory could shrink, want none", n-resizes)
		}
		ah.pred.setRate("m", 40) // 0.75: the shrink rides along
		ah.tick()
		if got := ah.act.share("m"); got.Memory != 625*mib || got.Compute != 0.75 {
			t.Errorf("t=8s: share %.2f, %dMiB; want 0.75 with 625MiB in the same resize", got.Compute, got.Memory/mib)
		}
		if n := len(ah.act.callLog()); n != resizes+1 {
			t.Errorf("%d resizes for the compute growth, want 1", n-resizes)
		}
	})
}

// A model without a memory limit, on a device without a budget, stays
// unlimited.
func TestMemoryUnlimitedStaysUnlimited(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah, _ := newMemHarness(t, AdjusterOptions{}, qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 8})
		ah.start()
		ah.pred.setRate("m", 10)
		ah.tick()
		if got := ah.act.share("m").Memory; got != 0 {
			t.Errorf("memory share %d, want 0 (no limit)", got)
		}
	})
}

// A move of the memory alone does not restart the compute's scale-down:
// the compute share shrinks when its own slack has lasted.
func TestMemoryMoveKeepsComputeSlack(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah, act := newMemHarness(t, AdjusterOptions{ScaleDownAfter: 2 * time.Second, Cooldown: time.Second},
			qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 8, Memory: 2 << 30})
		ah.pred.setRate("m", 40) // 0.75 (TestAdjusterScaleDownHysteresis)
		ah.start()
		ah.pred.setRate("m", 10) // 0.45 wanted from 1s: slack
		ah.tick()
		act.hold("m", 1<<30) // 2s: the instance holds more, the memory grows
		ah.tick()
		if got := ah.act.share("m"); got.Compute != 0.75 || got.Memory != 1088*mib {
			t.Fatalf("t=2s: share %+v, want compute 0.75 held and memory 1088MiB (1GiB + 1/16)", got)
		}
		ah.tick() // 3s: the slack began at 1s and has lasted 2s
		if got := ah.act.share("m").Compute; got != 0.45 {
			t.Errorf("t=3s: compute %v, want 0.45 (the memory's move at 2s did not restart the slack)", got)
		}
	})
}
