package control

import (
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/qos"
)

// boundedActuator is heldActuator whose models' instances bound their
// batches by their memory (MemoryBatchBounder), as simulated MPS clients
// do.
type boundedActuator struct{ *heldActuator }

func (boundedActuator) BoundsBatchesByMemory(string) bool { return true }

var _ MemoryBatchBounder = boundedActuator{}

// Where shares are caps (MPS) and the instances bound their batches by
// their memory, the memory share follows load as on the CPU: an idle
// model's is its batch-1 working set, not its largest batch's; a forecast
// rise grows it in the same pass, before a batch of that size has come; a
// large request holds it up while such requests keep arriving; once idle
// it shrinks, riding along with the compute share's shrink (each change is
// a new client), never by a small step alone. What the running client
// holds is no floor: its successor's arena starts empty.
func TestMemoryFollowsLoadOnMPS(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah, held := newMemHarness(t, AdjusterOptions{CapsOnly: true, ScaleDownAfter: 2 * time.Second, Cooldown: time.Second},
			qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 8, Memory: 2 << 30})
		ah.a.opts.Actuator = boundedActuator{held}
		held.hold("m", 625*mib) // the client at the load's share ran batch 8 (its profile)
		ah.start()
		// Idle: batch 1, (100 + 50)MiB × 1.25, not batch 8's 625MiB.
		if got := ah.act.share("m"); got.Memory != 188*mib {
			t.Fatalf("idle on MPS: memory share %dMiB, want 188MiB (batch 1's 150MiB + 25%%; the largest batch's is 625MiB)", got.Memory/mib)
		}

		// 10 req/s: batch 5, (100 + 250)MiB × 1.25 = 437.5MiB, with the
		// compute growth in one resize (one new client).
		resizes := len(ah.act.callLog())
		ah.pred.setRate("m", 10)
		ah.tick()
		if got := ah.act.share("m"); got.Memory != 438*mib || got.Compute != 0.45 {
			t.Fatalf("t=1s at 10 req/s: share %.2f, %dMiB; want 0.45 and 438MiB", got.Compute, got.Memory/mib)
		}
		if n := len(ah.act.callLog()) - resizes; n != 1 {
			t.Errorf("%d resizes for the growth, want 1 (compute and memory together)", n)
		}
		if e := lastEvent(t, ah.a, "m"); !strings.Contains(e.Reason, "memory 188MiB -> 438MiB: batch 5 (forecast 10.0 req/s)") {
			t.Errorf("growth reason %q", e.Reason)
		}

		// A request of 8 rows: the share holds batch 8 while such requests
		// come, whatever the rate says.
		p := ah.submit(t.Context(), "m", qos.RequestOptions{}, 1, 2, 3, 4, 5, 6, 7, 8)
		mustSucceed(t, p)
		ah.tick()
		if got := ah.act.share("m").Memory; got != 625*mib {
			t.Fatalf("t=2s after a request of 8: memory share %dMiB, want 625MiB (batch 8)", got/mib)
		}

		// Idle for good (the large request ages out after a minute): the
		// compute shrinks after its slack, and the memory with it, to batch
		// 1's, in the same resize.
		ah.pred.setRate("m", 0)
		time.Sleep(time.Minute)
		synctest.Wait()
		for range 4 {
			ah.tick()
		}
		got := ah.act.share("m")
		if got.Memory != 188*mib {
			t.Fatalf("idle again: memory share %dMiB (compute %.2f), want 188MiB", got.Memory/mib, got.Compute)
		}
	})
}

// A small shrink alone waits on MPS (it would start a client for little),
// and a rate that swings back and forth within the hysteresis does not
// move the memory share down and up: growth at once, shrink only after
// ScaleDownAfter of smaller targets. Growth for the headroom alone is not
// made either: a larger batch whose working set still fits the share
// leaves it (and the client) as it is.
func TestMemoryOnMPSDoesNotThrash(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah, held := newMemHarness(t, AdjusterOptions{CapsOnly: true, ScaleDownAfter: 3 * time.Second, Cooldown: time.Second},
			qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 8, Memory: 2 << 30})
		ah.a.opts.Actuator = boundedActuator{held}
		ah.pred.setRate("m", 10)
		ah.start()
		if got := ah.act.share("m").Memory; got != 438*mib {
			t.Fatalf("memory share %dMiB at 10 req/s, want 438MiB", got/mib)
		}
		resizes := len(ah.act.callLog())
		for i := range 6 { // 10, 5, 10, 5...: each 5 req/s target is smaller
			ah.pred.setRate("m", []float64{5, 10}[i%2])
			ah.tick()
		}
		if got := ah.act.share("m").Memory; got != 438*mib {
			t.Errorf("memory share %dMiB after a swinging rate, want 438MiB held", got/mib)
		}
		if n := len(ah.act.callLog()) - resizes; n != 0 {
			t.Errorf("%d resizes while the rate swung within the hysteresis, want none", n)
		}
	})
}

func TestMemoryOnMPSGrowsOnlyWhenTheBatchDoesNotFit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ah, held := newMemHarness(t, AdjusterOptions{CapsOnly: true, ScaleDownAfter: 3 * time.Second, Cooldown: time.Second},
			qos.ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 8, Memory: 2 << 30})
		ah.a.opts.Actuator = boundedActuator{held}
		ah.pred.setRate("m", 13) // compute 0.5, batch 5: 350MiB + 25% = 438MiB
		ah.start()
		if got := ah.act.share("m"); got.Memory != 438*mib || got.Compute != 0.5 {
			t.Fatalf("at 13 req/s: %+v, want 0.5 and 438MiB", got)
		}
		resizes := len(ah.act.callLog())
		ah.pred.setRate("m", 14) // compute 0.5, batch 6: 400MiB, within 438MiB
		ah.tick()
		if got := ah.act.share("m"); got.Memory != 438*mib {
			t.Errorf("at 14 req/s: memory %dMiB, want 438MiB kept (batch 6's 400MiB fits it)", got.Memory/mib)
		}
		if n := len(ah.act.callLog()) - resizes; n != 0 {
			t.Errorf("%d resizes for headroom alone, want none", n)
		}
		ah.pred.setRate("m", 40) // a batch that does not fit, and more compute: grows
		ah.tick()
		if got := ah.act.share("m"); got.Memory <= 438*mib {
			t.Errorf("at 40 req/s: memory %dMiB, want grown", got.Memory/mib)
		}
	})
}
