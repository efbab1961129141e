package models

import (
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/sloserve/sloserve/limiter"
)

// liveLimiter is a liftingLimiter whose shares change live, as cgroups'
// do, and that records every share a unit was placed at and resized to.
type liveLimiter struct {
	*liftingLimiter
	mu      sync.Mutex
	history map[string][]limiter.Share // unit -> placed, then each resize
}

func newLiveLimiter() *liveLimiter {
	l := &liveLimiter{liftingLimiter: newLiftingLimiter(), history: map[string][]limiter.Share{}}
	l.restart = false
	return l
}

func (l *liveLimiter) Place(id string, s limiter.Share) (limiter.Placement, error) {
	l.mu.Lock()
	l.history[id] = append(l.history[id], s)
	l.mu.Unlock()
	return l.liftingLimiter.Place(id, s)
}

func (l *liveLimiter) Resize(id string, s limiter.Share) error {
	if err := l.liftingLimiter.Resize(id, s); err != nil {
		return err
	}
	l.mu.Lock()
	l.history[id] = append(l.history[id], s)
	l.mu.Unlock()
	return nil
}

func (l *liveLimiter) historyOf(id string) []limiter.Share {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.history[id])
}

// cappedSum serves the sum model at a capped share of 0.5 with a 64 MiB
// memory limit on a liveLimiter.
func cappedSum(t *testing.T) (*Registry, *fakeFactory, *liveLimiter) {
	t.Helper()
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+
		"resources: {memory_limit: 64MiB, max_compute_share: 0.5}\n", 1)
	lim := newLiveLimiter()
	r, f := newShareRegistry(t, repo, lim, nil)
	return r, f, lim
}

// An instance at a capped share starts uncapped where the backend sets
// shares live, and is at its share before it serves: a runner loading
// under a small cap, or in the idle class behind busy processes, took
// seconds (a best-effort replacement at a 0.025 share beside two busy
// threads was not ready after 30 s). Its memory limit holds from the
// start. A floor, or a backend without live shares, starts at the share.
func TestInstanceStartsUncappedAndServesAtItsShare(t *testing.T) {
	r, f, lim := cappedSum(t)

	want := limiter.Share{Compute: 0.5, Memory: 64 << 20}
	first := unitOfSpec(f.of("sum", 1)[0].spec)
	started := limiter.Share{Memory: 64 << 20, Mode: limiter.ModeCap}
	if got := lim.historyOf(first); !slices.Equal(got, []limiter.Share{started, want}) {
		t.Errorf("unit's shares at load = %+v, want placed uncapped with its memory limit (%+v), then %+v", got, started, want)
	}
	if got := lim.shares(); !slices.Equal(got, []limiter.Share{want}) {
		t.Errorf("units once loaded = %+v, want one at %+v", got, want)
	}

	// A replacement (a share whose thread count differs) starts uncapped
	// too; the share it serves at is the one asked for.
	var mu sync.Mutex
	var atStart []limiter.Share
	f.mu.Lock()
	f.onStart = func(spec InstanceSpec) {
		lim.fakeLimiter.mu.Lock()
		s := lim.units[unitOfSpec(spec)]
		lim.fakeLimiter.mu.Unlock()
		mu.Lock()
		atStart = append(atStart, s)
		mu.Unlock()
	}
	f.mu.Unlock()
	wider := limiter.Share{Compute: 1, Memory: 64 << 20, Mode: limiter.ModeBackground}
	if err := r.RequestShare("sum/1", wider); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the share to apply", func() bool {
		st, _ := r.ShareStatus("sum/1")
		return st.Pending == nil
	})
	if st, _ := r.ShareStatus("sum/1"); st.Err != nil || st.Share != wider {
		t.Fatalf("after the request: %+v, want share %+v", st, wider)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(atStart) != 1 || atStart[0] != started {
		t.Errorf("the replacement's unit while it started = %+v, want %+v", atStart, started)
	}
	if got := lim.shares(); !slices.Equal(got, []limiter.Share{wider}) {
		t.Errorf("units after the replacement = %+v, want one at %+v", got, wider)
	}

	// A floor has no cap to lift, and a backend that cannot set shares
	// live (fakeLimiter: not a ComputeLifter) starts every unit at its
	// share.
	for _, c := range []struct {
		lim limiter.Limiter
		s   limiter.Share
	}{
		{lim, limiter.Share{Compute: 0.5, Mode: limiter.ModeFloor}},
		{newFakeLimiter(2), limiter.Share{Compute: 0.5}},
	} {
		if startsLifted(c.lim, c.s) {
			t.Errorf("%T at %+v starts uncapped, want at its share", c.lim, c.s)
		}
	}
}

// An instance whose share cannot be set once it has started is stopped,
// its unit released, and the start fails: it never serves uncapped. The
// version keeps its instance at the old share. Here the limiter stops
// resizing live after the load: the first instance's resize asks for a
// replacement, and the replacement's own share, once started, fails.
func TestInstanceWhoseShareFailsAfterStartIsStopped(t *testing.T) {
	r, f, lim := cappedSum(t)
	old := limiter.Share{Compute: 0.5, Memory: 64 << 20}

	lim.fakeLimiter.mu.Lock()
	lim.restart = true
	lim.fakeLimiter.mu.Unlock()
	if err := r.RequestShare("sum/1", limiter.Share{Compute: 1, Memory: 64 << 20, Mode: limiter.ModeBackground}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the request to end", func() bool {
		st, _ := r.ShareStatus("sum/1")
		return st.Pending == nil
	})
	if st, _ := r.ShareStatus("sum/1"); st.Err == nil || st.Share != old {
		t.Errorf("after a replacement whose share failed: %+v, want an error and the share %+v", st, old)
	}
	insts := f.of("sum", 1)
	if len(insts) != 2 {
		t.Fatalf("%d instances started, want the first and the replacement", len(insts))
	}
	if insts[0].stopped.Load() || !insts[1].stopped.Load() {
		t.Errorf("stopped: first %v, replacement %v; want false, true", insts[0].stopped.Load(), insts[1].stopped.Load())
	}
	if got := lim.shares(); !slices.Equal(got, []limiter.Share{old}) {
		t.Errorf("units = %+v, want only the first at %+v", got, old)
	}
	if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 2, 3, 4})); err != nil {
		t.Errorf("a request after the failed replacement: %v", err)
	}
}
