package models

import (
	"errors"
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
	fail    error                      // when set, every resize fails with it
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
	l.mu.Lock()
	fail := l.fail
	l.mu.Unlock()
	if fail != nil {
		return fail
	}
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

func (l *liveLimiter) failResizes(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.fail = err
}

// unitShare is the share unit id is at now.
func (l *liveLimiter) unitShare(id string) limiter.Share {
	l.fakeLimiter.mu.Lock()
	defer l.fakeLimiter.mu.Unlock()
	return l.units[id]
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

// A restart of an instance's process (after a crash or a kill) is a start
// like the first: its unit is lifted before the new process loads and
// given its share once the process is ready, before it serves. The share
// it takes is the one last asked for: a share set while the process loads
// is recorded, not applied to the loading process, and wins over the one
// the instance had. The fake instance does not restart; the test calls its
// spec's hook as the runner's supervisor does (runtime.RunnerConfig).
func TestRestartLoadsUncappedAndServesAtItsLatestShare(t *testing.T) {
	r, f, lim := cappedSum(t)
	spec := f.of("sum", 1)[0].spec
	id := unitOfSpec(spec)
	if spec.Restarting == nil {
		t.Fatal("an instance on a backend that sets shares live has no Restarting hook")
	}
	share := limiter.Share{Compute: 0.5, Memory: 64 << 20}
	started := limiter.Share{Memory: 64 << 20, Mode: limiter.ModeCap}

	// A restart: uncapped while it loads, its share once ready.
	ready := spec.Restarting()
	if got := lim.unitShare(id); got != started {
		t.Errorf("unit while the restarted process loads = %+v, want %+v", got, started)
	}
	if err := ready(1); err != nil {
		t.Fatalf("ready: %v", err)
	}
	if got, want := lim.historyOf(id), []limiter.Share{started, share, started, share}; !slices.Equal(got, want) {
		t.Errorf("unit's shares = %+v, want %+v (the start, then the restart)", got, want)
	}

	// A share set while the process loads waits for it, and is the one it
	// serves at.
	ready = spec.Restarting()
	smaller := limiter.Share{Compute: 0.25, Memory: 64 << 20, Mode: limiter.ModeBackground}
	if err := r.SetShare(t.Context(), "sum/1", smaller); err != nil {
		t.Fatal(err)
	}
	if got := lim.unitShare(id); got != started {
		t.Errorf("unit after a share set during the restart = %+v, want still %+v while it loads", got, started)
	}
	if err := ready(1); err != nil {
		t.Fatalf("ready: %v", err)
	}
	if got := lim.unitShare(id); got != smaller {
		t.Errorf("unit once the restart is ready = %+v, want the share set meanwhile, %+v", got, smaller)
	}
	if len(f.of("sum", 1)) != 1 {
		t.Errorf("%d instances started, want the one (the share was set live)", len(f.of("sum", 1)))
	}

	// A share set once the process serves is applied at once.
	if err := r.SetShare(t.Context(), "sum/1", share); err != nil {
		t.Fatal(err)
	}
	if got := lim.unitShare(id); got != share {
		t.Errorf("unit after a share set while serving = %+v, want %+v", got, share)
	}

	// A share set at the moment the process gets ready: whichever comes
	// last, the unit ends at the share last asked for, and never lifted.
	for round := range 20 {
		want := []limiter.Share{smaller, share}[round%2]
		ready = spec.Restarting()
		var wg sync.WaitGroup
		var setErr, readyErr error
		wg.Go(func() { setErr = r.SetShare(t.Context(), "sum/1", want) })
		wg.Go(func() { readyErr = ready(1) })
		wg.Wait()
		if setErr != nil || readyErr != nil {
			t.Fatalf("round %d: set %v, ready %v", round, setErr, readyErr)
		}
		if got := lim.unitShare(id); got != want {
			t.Fatalf("round %d: unit = %+v, want the share set, %+v", round, got, want)
		}
	}
}

// A restarted process whose share cannot be set once it is ready must not
// serve: the hook's ready fails (the runner then kills that process and
// counts a failed restart), and the unit stays lifted for the next try,
// which takes the share once the limiter can set it.
func TestRestartWhoseShareFailsDoesNotServe(t *testing.T) {
	_, f, lim := cappedSum(t)
	spec := f.of("sum", 1)[0].spec
	id := unitOfSpec(spec)
	share := limiter.Share{Compute: 0.5, Memory: 64 << 20}
	started := limiter.Share{Memory: 64 << 20, Mode: limiter.ModeCap}
	if spec.Restarting == nil {
		t.Fatal("an instance on a backend that sets shares live has no Restarting hook")
	}

	ready := spec.Restarting()
	refused := errors.New("refused")
	lim.failResizes(refused)
	if err := ready(1); !errors.Is(err, refused) {
		t.Fatalf("ready with a limiter that refuses the share: %v, want %v", err, refused)
	}
	if got := lim.unitShare(id); got != started {
		t.Errorf("unit after the failed resize = %+v, want still %+v", got, started)
	}

	// The next try loads uncapped as well, and serves at the share.
	lim.failResizes(nil)
	ready = spec.Restarting()
	if got := lim.unitShare(id); got != started {
		t.Errorf("unit while the next try loads = %+v, want %+v", got, started)
	}
	if err := ready(1); err != nil {
		t.Fatalf("ready: %v", err)
	}
	if got := lim.unitShare(id); got != share {
		t.Errorf("unit once the next try is ready = %+v, want %+v", got, share)
	}
}

// A restart on a backend that cannot set a share live and does not
// account by process has no hook: the process restarts at its share.
func TestRestartWithoutLiveSharesHasNoHook(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+
		"resources: {memory_limit: 64MiB, max_compute_share: 0.5}\n", 1)
	_, f := newShareRegistry(t, repo, newFakeLimiter(2), nil)
	if spec := f.of("sum", 1)[0].spec; spec.Restarting != nil {
		t.Error("an instance on a backend without live shares has a Restarting hook")
	}
}

// trackingLimiter accounts by process, as MPS does: it is told each
// instance's pid.
type trackingLimiter struct {
	*fakeLimiter
	mu   sync.Mutex
	pids map[string][]int
}

func (l *trackingLimiter) Track(id string, pid int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.pids[id] = append(l.pids[id], pid)
	return nil
}

// A restart on a backend that accounts by process tells it the new
// process's pid once ready: without it, a restarted MPS client's use was
// read off the dead process's pid.
func TestRestartTellsAProcessTrackerTheNewPid(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+
		"resources: {memory_limit: 64MiB, max_compute_share: 0.5}\n", 1)
	lim := &trackingLimiter{fakeLimiter: newFakeLimiter(2), pids: map[string][]int{}}
	_, f := newShareRegistry(t, repo, lim, nil)
	spec := f.of("sum", 1)[0].spec
	if spec.Restarting == nil {
		t.Fatal("an instance on a backend that accounts by process has no Restarting hook")
	}
	before := lim.shares()
	if err := spec.Restarting()(4242); err != nil {
		t.Fatalf("ready: %v", err)
	}
	lim.mu.Lock()
	var got []int
	for _, p := range lim.pids {
		got = append(got, p...)
	}
	lim.mu.Unlock()
	if !slices.Contains(got, 4242) {
		t.Errorf("pids tracked = %v, want the restarted process's 4242", got)
	}
	if after := lim.shares(); !slices.Equal(before, after) {
		t.Errorf("a backend without live shares resized on a restart: %v -> %v", before, after)
	}
}
