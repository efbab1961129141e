package models

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sloserve/sloserve/limiter"
)

// fakeLimiter records units and their shares. restart makes every resize
// need a new instance (as MPS does).
type fakeLimiter struct {
	mu       sync.Mutex
	cpus     int
	restart  bool
	units    map[string]limiter.Share
	released []string
	resizes  int
}

func newFakeLimiter(cpus int) *fakeLimiter {
	return &fakeLimiter{cpus: cpus, units: map[string]limiter.Share{}}
}

func (l *fakeLimiter) Kind() string     { return "fake" }
func (l *fakeLimiter) Describe() string { return "fake limiter" }
func (l *fakeLimiter) CPUs() int        { return l.cpus }
func (l *fakeLimiter) Capabilities() limiter.Capabilities {
	return limiter.Capabilities{Enforces: true, Metering: limiter.MeterCPUTime}
}
func (l *fakeLimiter) Close() error { return nil }

func (l *fakeLimiter) Place(id string, s limiter.Share) (limiter.Placement, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.units[id] = s
	return limiter.Placement{JoinCgroups: []string{"/fake/" + id}, IntraOpThreads: limiter.ThreadsFor(s, l.cpus)}, nil
}

func (l *fakeLimiter) Resize(id string, s limiter.Share) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	old, ok := l.units[id]
	if !ok {
		return limiter.ErrUnknownInstance
	}
	if l.restart && old != s {
		return limiter.ErrRestartRequired
	}
	l.units[id] = s
	l.resizes++
	return nil
}

func (l *fakeLimiter) Release(id string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.units, id)
	l.released = append(l.released, id)
	return nil
}

func (l *fakeLimiter) Stats(id string) (limiter.Stats, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	s, ok := l.units[id]
	if !ok {
		return limiter.Stats{}, limiter.ErrUnknownInstance
	}
	return limiter.Stats{MemoryLimit: s.Memory, MemoryBytes: 1000}, nil
}

// shares returns the shares of the live units, sorted by id.
func (l *fakeLimiter) shares() []limiter.Share {
	l.mu.Lock()
	defer l.mu.Unlock()
	ids := make([]string, 0, len(l.units))
	for id := range l.units {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	out := make([]limiter.Share, len(ids))
	for i, id := range ids {
		out[i] = l.units[id]
	}
	return out
}

func newShareRegistry(t *testing.T, repo string, lim limiter.Limiter, profile func(context.Context, ProfileRun) error) (*Registry, *fakeFactory) {
	t.Helper()
	f := &fakeFactory{fail: map[string]error{}}
	r, err := New(Options{
		Repositories:      []string{repo},
		Control:           ControlExplicit,
		StartupModels:     []string{"*"},
		MaxTensorElements: 1 << 20,
		DrainTimeout:      5 * time.Second,
		NewInstance:       f.start,
		Registerer:        prometheus.NewRegistry(),
		Limiter:           func(string) limiter.Limiter { return lim },
		Profile:           profile,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	return r, f
}

func TestSharesPlaceResizeRelease(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 2, 1)+
		"execution: {intra_op_threads: 1}\nresources: {memory_limit: 64MiB, max_compute_share: 0.8}\n", 1)
	lim := newFakeLimiter(4)
	r, f := newShareRegistry(t, repo, lim, nil)

	// Two instances start at the configured maximum, split between them,
	// in their own units, with the configured thread count.
	want := limiter.Share{Compute: 0.4, Memory: 64 << 20}
	if got := lim.shares(); !slices.Equal(got, []limiter.Share{want, want}) {
		t.Fatalf("units at start = %+v, want two of %+v", got, want)
	}
	for _, fi := range f.of("sum", 1) {
		if fi.spec.IntraOpThreads != 1 || len(fi.spec.Placement.JoinCgroups) != 1 {
			t.Errorf("instance spec = %+v, want 1 thread and a unit to join", fi.spec)
		}
	}
	if s, _ := r.Share("sum/1"); s.Compute != 0.8 {
		t.Errorf("Share = %+v, want compute 0.8", s)
	}

	// A live resize reaches every unit, split again; no instance restarts.
	if err := r.SetShare(t.Context(), "sum/1", limiter.Share{Compute: 0.3, Memory: 32 << 20}); err != nil {
		t.Fatal(err)
	}
	want = limiter.Share{Compute: 0.15, Memory: 32 << 20}
	if got := lim.shares(); !slices.Equal(got, []limiter.Share{want, want}) {
		t.Errorf("units after resize = %+v, want two of %+v", got, want)
	}
	if n := len(f.of("sum", 1)); n != 2 {
		t.Errorf("%d instances started, want 2 (a live resize starts none)", n)
	}
	if st := r.UnitStats("sum/1"); st.MemoryLimit != 64<<20 || st.MemoryBytes != 2000 {
		t.Errorf("UnitStats = %+v", st)
	}
	for _, bad := range []string{"sum", "nope/1", "sum/7"} {
		if err := r.SetShare(t.Context(), bad, want); err == nil {
			t.Errorf("SetShare(%q) succeeded", bad)
		}
	}

	// The model's own ModelSpec bounds: one thread per instance on 4 CPUs
	// can use at most 2 × 1/4 of the device.
	v, err := r.versionByKey("sum/1")
	if err != nil {
		t.Fatal(err)
	}
	if u := v.usefulShare(); u != 0.5 {
		t.Errorf("usefulShare = %v, want 0.5", u)
	}

	// Unloading releases the units.
	if err := r.Unload(t.Context(), "sum"); err != nil {
		t.Fatal(err)
	}
	if got := lim.shares(); len(got) != 0 {
		t.Errorf("units left after unload: %+v", got)
	}
	if len(lim.released) != 2 {
		t.Errorf("released %v, want 2 units", lim.released)
	}
}

// TestShareSwapLosesNoRequest resizes a model whose limiter cannot resize a
// running instance, under a steady stream of requests: each resize starts a
// warmed replacement, switches to it and stops the old instance, and no
// request fails.
func TestShareSwapLosesNoRequest(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+"execution: {concurrency: 2}\n", 1)
	lim := newFakeLimiter(2)
	lim.restart = true
	r, f := newShareRegistry(t, repo, lim, nil)

	ctx, cancel := context.WithCancel(t.Context())
	var (
		wg       sync.WaitGroup
		ok, fail atomic.Int64
		firstErr atomic.Value
	)
	for range 4 {
		wg.Go(func() {
			for ctx.Err() == nil {
				resp, _, err := r.Infer(context.Background(), "sum", "", sumRequest([4]float32{1, 2, 3, 4}))
				if err != nil || floats(resp.Outputs[0].Data)[0] != 10 {
					fail.Add(1)
					firstErr.CompareAndSwap(nil, fmt.Sprint(err))
					continue
				}
				ok.Add(1)
			}
		})
	}
	shares := []float64{0.2, 0.7, 0.4, 0.9, 0.3}
	for _, c := range shares {
		if err := r.SetShare(t.Context(), "sum/1", limiter.Share{Compute: c}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	if fail.Load() != 0 {
		t.Errorf("%d of %d requests failed during swaps; first: %v", fail.Load(), fail.Load()+ok.Load(), firstErr.Load())
	}
	insts := f.of("sum", 1)
	if len(insts) != 1+len(shares) {
		t.Fatalf("%d instances started, want %d (one per swap)", len(insts), 1+len(shares))
	}
	for i, fi := range insts[:len(insts)-1] {
		if !fi.stopped.Load() {
			t.Errorf("replaced instance %d not stopped", i)
		}
	}
	last := insts[len(insts)-1]
	// Threads follow the share when the config leaves them to the server:
	// 0.9 of 2 CPUs is 2 threads, 0.3 is 1.
	if last.stopped.Load() || last.spec.IntraOpThreads != 1 || insts[4].spec.IntraOpThreads != 2 {
		t.Errorf("current instance: stopped %v, threads %d (before it %d); want running with 1 (2)",
			last.stopped.Load(), last.spec.IntraOpThreads, insts[4].spec.IntraOpThreads)
	}
	if got := lim.shares(); len(got) != 1 || got[0].Compute != 0.3 {
		t.Errorf("units = %+v, want one at 0.3", got)
	}
	if ok.Load() == 0 {
		t.Error("no request completed")
	}
}

func TestEvictAndLoadOnDemand(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
	lim := newFakeLimiter(2)
	r, f := newShareRegistry(t, repo, lim, nil)
	if err := r.Evict(t.Context(), "sum/1"); err != nil {
		t.Fatal(err)
	}
	if ready, _ := r.ModelReady("sum", ""); ready {
		t.Fatal("evicted model still ready")
	}
	if !f.of("sum", 1)[0].stopped.Load() {
		t.Error("evicted instance not stopped")
	}
	// Concurrent requests for the evicted model load it once and are all
	// answered.
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			resp, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 1, 1, 1}))
			if err == nil && floats(resp.Outputs[0].Data)[0] != 4 {
				err = errors.New("wrong sum")
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("request to an evicted model: %v", err)
		}
	}
	if n := len(f.of("sum", 1)); n != 2 {
		t.Errorf("%d instances started, want 2 (one load on demand)", n)
	}
	// An unload (not an eviction) is not undone by a request, even of a
	// model evicted before.
	if err := r.Evict(t.Context(), "sum/1"); err != nil {
		t.Fatal(err)
	}
	if err := r.Unload(t.Context(), "sum"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{})); !errors.Is(err, ErrNotReady) {
		t.Errorf("request to an unloaded model: %v, want ErrNotReady", err)
	}
}

func TestProfileRunsBeforeTraffic(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+
		"execution: {intra_op_threads: 1}\nresources: {memory_limit: 1MiB}\nprofile: {batch_sizes: [1, 4]}\n", 1)
	lim := newFakeLimiter(2)
	var got ProfileRun
	var measured []string
	r, f := newShareRegistry(t, repo, lim, func(ctx context.Context, run ProfileRun) error {
		got = run
		for _, s := range []float64{0.125, 0.5} {
			for _, b := range run.BatchSizes {
				d, err := run.Measure(ctx, b, s, 2)
				if err != nil || d <= 0 {
					return fmt.Errorf("measure(%d, %v) = %v, %v", b, s, d, err)
				}
				measured = append(measured, fmt.Sprintf("%d@%v:%v", b, s, lim.shares()[0].Compute))
			}
		}
		return nil
	})
	if got.Key != "sum/1" || got.MaxShare != 0.5 || got.Threads != 1 || !slices.Equal(got.BatchSizes, []int{1, 4}) {
		t.Errorf("profile run = %+v", got)
	}
	want := []string{"1@0.125:0.125", "4@0.125:0.125", "1@0.5:0.5", "4@0.5:0.5"}
	if !slices.Equal(measured, want) {
		t.Errorf("measured %v, want %v (the unit follows each share)", measured, want)
	}
	// Each measurement ran runs+1 executions; the share is back afterwards.
	if n := f.of("sum", 1)[0].calls.Load(); n < 12 {
		t.Errorf("%d executions, want at least 12", n)
	}
	if s := lim.shares(); len(s) != 1 || s[0] != (limiter.Share{Compute: 1, Memory: 1 << 20}) {
		t.Errorf("unit after profiling = %+v, want the initial share back", s)
	}
	if ready, _ := r.ModelReady("sum", ""); !ready {
		t.Error("model not ready after profiling")
	}
}

// On a limiter whose running instances cannot be resized (MPS), profiling
// runs each share in an instance started at that share (G1 of issue 18:
// before, the resize was skipped and every point ran at the initial
// share, so the fitted curve was flat in the share).
func TestProfileStartsAnInstancePerShareWhenResizeNeedsARestart(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+
		"execution: {intra_op_threads: 1}\nresources: {memory_limit: 1MiB}\nprofile: {batch_sizes: [1, 4]}\n", 1)
	lim := newFakeLimiter(2)
	lim.restart = true
	var measured []string
	r, f := newShareRegistry(t, repo, lim, func(ctx context.Context, run ProfileRun) error {
		for _, s := range []float64{0.125, 0.25} {
			for _, b := range run.BatchSizes {
				if _, err := run.Measure(ctx, b, s, 2); err != nil {
					return err
				}
				// One unit lives: the instance's that just ran.
				units := lim.shares()
				if len(units) != 1 {
					return fmt.Errorf("%d units live while measuring", len(units))
				}
				measured = append(measured, fmt.Sprintf("%d@%v:%v", b, s, units[0].Compute))
			}
		}
		return nil
	})
	want := []string{"1@0.125:0.125", "4@0.125:0.125", "1@0.25:0.25", "4@0.25:0.25"}
	if !slices.Equal(measured, want) {
		t.Errorf("measured %v, want %v (each share in an instance started at it)", measured, want)
	}
	// The first instance, one per profiled share, one back at the initial
	// share; all but the last stopped.
	insts := f.of("sum", 1)
	if len(insts) != 4 {
		t.Errorf("%d instances started, want 4", len(insts))
	}
	for i, fi := range insts {
		if stopped := fi.stopped.Load(); stopped != (i < len(insts)-1) {
			t.Errorf("instance %d stopped = %v", i, stopped)
		}
	}
	if s := lim.shares(); len(s) != 1 || s[0] != (limiter.Share{Compute: 1, Memory: 1 << 20}) {
		t.Errorf("unit after profiling = %+v, want the initial share back", s)
	}
	if got, _ := r.Share("sum/1"); got != (limiter.Share{Compute: 1, Memory: 1 << 20}) {
		t.Errorf("recorded share %+v", got)
	}
}

// A share a limiter cannot apply without a restart is not recorded as set
// when no restart is allowed.
func TestShareNotRecordedWhenItCouldNotBeApplied(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+"execution: {intra_op_threads: 1}\n", 1)
	lim := newFakeLimiter(2)
	lim.restart = true
	r, _ := newShareRegistry(t, repo, lim, nil)
	v, err := r.versionByKey("sum/1")
	if err != nil {
		t.Fatal(err)
	}
	v.shareMu.Lock()
	err = r.setShareLocked(t.Context(), v, limiter.Share{Compute: 0.25}, swapNever)
	v.shareMu.Unlock()
	if !errors.Is(err, limiter.ErrRestartRequired) {
		t.Errorf("setShareLocked without swaps = %v, want ErrRestartRequired", err)
	}
	if got, _ := r.Share("sum/1"); got.Compute == 0.25 {
		t.Errorf("share recorded as %+v though no instance runs at it", got)
	}
}

// A best-effort version starts in the class Options.BestEffortMode names
// for its device, so that the control loop's first share is no change of
// class (a new client on MPS); a latency-critical one in the default.
func TestSharesBestEffortStartsInItsClass(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "be", fmt.Sprintf(sumConfig, "be", 1, 1)+"slo: {latency_ms: 1000, class: best-effort}\nresources: {memory_limit: 64MiB}\n", 1)
	writeModel(t, repo, "lc", fmt.Sprintf(sumConfig, "lc", 1, 1)+"slo: {latency_ms: 100, class: latency-critical}\nresources: {memory_limit: 64MiB}\n", 1)
	lim := newFakeLimiter(4)
	f := &fakeFactory{fail: map[string]error{}}
	var asked []string
	var mu sync.Mutex
	r, err := New(Options{
		Repositories: []string{repo}, Control: ControlExplicit, StartupModels: []string{"*"},
		MaxTensorElements: 1 << 20, DrainTimeout: 5 * time.Second, NewInstance: f.start,
		Registerer: prometheus.NewRegistry(), Limiter: func(string) limiter.Limiter { return lim },
		BestEffortMode: func(device string) limiter.Mode {
			mu.Lock()
			defer mu.Unlock()
			asked = append(asked, device)
			return limiter.ModeBackground
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	for model, want := range map[string]limiter.Mode{"be": limiter.ModeBackground, "lc": limiter.ModeCap} {
		fi := f.of(model, 1)
		if len(fi) != 1 {
			t.Fatalf("%s: %d instances (%+v)", model, len(fi), r.Index(false))
		}
		if s, _ := r.Share(model + "/1"); s.Mode != want {
			t.Errorf("%s starts at %+v, want mode %v", model, s, want)
		}
	}
	var modes []limiter.Mode
	for _, s := range lim.shares() {
		modes = append(modes, s.Mode)
	}
	slices.Sort(modes)
	if want := []limiter.Mode{limiter.ModeCap, limiter.ModeBackground}; !slices.Equal(modes, want) {
		t.Errorf("units placed in %v, want %v", modes, want)
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(asked, []string{"cpu"}) {
		t.Errorf("BestEffortMode asked for %v, want the best-effort model's device once", asked)
	}
}
