package models

import (
	"fmt"
	"slices"
	"testing"

	"github.com/sloserve/sloserve/limiter"
)

// Once the server stops taking requests (LiftCaps), every instance with a
// cap to lift runs uncapped until it is released, so that the requests it
// admitted finish at the speed the machine allows: a best-effort request
// running in the idle class at a 5% cap beside busy processes held a stop
// for a second. Shares asked for from then on are recorded and not
// applied (a cap asked of a floor is lifted at once), no instance is
// replaced for one, and a restarted process that gets ready stays
// uncapped; the background parent leaves the idle class once, so that a
// restarted process loads at a peer's speed too. A floor has no cap and
// keeps its share; the memory limit holds throughout.
func TestLiftCapsHoldsUnitsUncappedForTheStop(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "capped", fmt.Sprintf(sumConfig, "capped", 1, 1)+
		"resources: {memory_limit: 64MiB, max_compute_share: 0.5}\n", 1)
	writeModel(t, repo, "floor", fmt.Sprintf(sumConfig, "floor", 1, 1)+
		"resources: {memory_limit: 32MiB}\n", 1)
	lim := newLiveLimiter()
	r, f := newShareRegistry(t, repo, lim, nil)
	capped, floor := unitOfSpec(f.of("capped", 1)[0].spec), unitOfSpec(f.of("floor", 1)[0].spec)
	background := limiter.Share{Compute: 0.05, Memory: 64 << 20, Mode: limiter.ModeBackground}
	if err := r.SetShare(t.Context(), "capped/1", background); err != nil {
		t.Fatal(err)
	}
	atFloor := limiter.Share{Compute: 0.2, Memory: 32 << 20, Mode: limiter.ModeFloor}
	if err := r.SetShare(t.Context(), "floor/1", atFloor); err != nil {
		t.Fatal(err)
	}
	if got := lim.unitShare(capped); got != background {
		t.Fatalf("capped unit before the stop = %+v, want %+v", got, background)
	}
	before := len(lim.historyOf(floor))

	if n := r.LiftCaps(); n != 2 {
		t.Errorf("LiftCaps held %d units, want 2 (one lifted, one floor kept)", n)
	}
	uncapped := limiter.Share{Memory: 64 << 20, Mode: limiter.ModeCap}
	if got := lim.unitShare(capped); got != uncapped {
		t.Errorf("capped unit after LiftCaps = %+v, want %+v", got, uncapped)
	}
	if got := lim.historyOf(floor); len(got) != before {
		t.Errorf("the floor was resized by LiftCaps: %+v", got[before:])
	}
	if n := r.LiftCaps(); n != 0 {
		t.Errorf("a second LiftCaps held %d units, want 0", n)
	}
	// The background parent left the idle class once, for both models
	// on the one limiter: a runner restarted from now on loads there.
	if n := lim.backgroundLifted(); n != 1 {
		t.Errorf("the background parent lifted %d times, want 1", n)
	}

	// The control loop goes on asking: a cap is recorded, not applied,
	// and nothing is replaced although the thread count would change.
	smaller := limiter.Share{Compute: 0.25, Memory: 64 << 20, Mode: limiter.ModeBackground}
	if err := r.SetShare(t.Context(), "capped/1", smaller); err != nil {
		t.Fatal(err)
	}
	if err := r.RequestShare("capped/1", limiter.Share{Compute: 1, Memory: 64 << 20, Mode: limiter.ModeBackground}); err != nil {
		t.Fatal(err)
	}
	if got := lim.unitShare(capped); got != uncapped {
		t.Errorf("capped unit after shares asked during the stop = %+v, want still %+v", got, uncapped)
	}
	// A floor asked for a cap is lifted instead.
	capFloor := limiter.Share{Compute: 0.1, Memory: 32 << 20, Mode: limiter.ModeBackground}
	if err := r.SetShare(t.Context(), "floor/1", capFloor); err != nil {
		t.Fatal(err)
	}
	if got, want := lim.unitShare(floor), (limiter.Share{Memory: 32 << 20, Mode: limiter.ModeCap}); got != want {
		t.Errorf("floor unit asked for a cap during the stop = %+v, want %+v", got, want)
	}

	// A process restarted during the stop loads uncapped and stays so
	// once ready.
	ready := f.of("capped", 1)[0].spec.Restarting()
	if err := ready(1); err != nil {
		t.Fatal(err)
	}
	if got := lim.unitShare(capped); got != uncapped {
		t.Errorf("capped unit once a restart during the stop is ready = %+v, want %+v", got, uncapped)
	}
	if n := len(f.of("capped", 1)); n != 1 {
		t.Errorf("%d instances of capped started, want 1: nothing is replaced during the stop", n)
	}
	for _, s := range lim.historyOf(capped) {
		if s.Memory != 64<<20 {
			t.Errorf("the capped unit was at %+v: its memory limit must hold", s)
		}
	}
	if h := lim.historyOf(capped); slices.Contains(h[len(h)-3:], smaller) {
		t.Errorf("a share asked during the stop was applied: %+v", h)
	}
}
