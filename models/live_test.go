package models

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sloserve/sloserve/limiter"
)

// series gathers every series of reg, keyed as the text exposition writes
// them: name{label="value",...} with labels sorted by name.
func series(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			key := mf.GetName() + "{" + strings.Join(labels, ",") + "}"
			switch {
			case m.Counter != nil:
				out[key] = m.GetCounter().GetValue()
			case m.Gauge != nil:
				out[key] = m.GetGauge().GetValue()
			}
		}
	}
	return out
}

// hasSeriesOf reports whether any series carries the label pair.
func hasSeriesOf(all map[string]float64, pair string) []string {
	var out []string
	for k := range all {
		if strings.Contains(k, pair) {
			out = append(out, k)
		}
	}
	return out
}

func stateSeries(model, version, state string) string {
	return fmt.Sprintf(`sloserve_model_state{model=%q,state=%q,version=%q}`, model, state, version)
}

// A change that fails to load counts a failure once per change of the
// files (not once per poll), flags the model, keeps the previous version
// READY and serving, and leaves no series for the version that failed. The
// fix reloads and clears the flag; a removed model's series go.
func TestLoadFailureMetricsAndState(t *testing.T) {
	repo := t.TempDir()
	good := fmt.Sprintf(sumConfig, "sum", 1, 1)
	writeModel(t, repo, "sum", good, 1)
	r, f, preg := newTestRegistry(t, ControlPoll, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })

	s := series(t, preg)
	if s[stateSeries("sum", "1", "READY")] != 1 || s[stateSeries("sum", "1", "LOADING")] != 0 ||
		s[`sloserve_model_load_failed{model="sum"}`] != 0 || s[`sloserve_model_loads_total{model="sum"}`] != 1 {
		t.Fatalf("after start: %v", s)
	}

	// Version 2 cannot start: version 1 keeps serving.
	f.mu.Lock()
	f.fail["sum"] = errors.New("model file is not ONNX")
	f.mu.Unlock()
	writeModel(t, repo, "sum", good, 2)
	for range 3 { // the same files: tried once
		r.pollOnce(t.Context())
	}
	if _, ver, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 1, 1, 1})); err != nil || ver != "1" {
		t.Fatalf("after a failed reload: version %q, %v; want version 1 serving", ver, err)
	}
	s = series(t, preg)
	for k, want := range map[string]float64{
		`sloserve_model_load_failures_total{model="sum"}`: 1,
		`sloserve_model_load_failed{model="sum"}`:         1,
		`sloserve_model_loads_total{model="sum"}`:         1,
		stateSeries("sum", "1", "READY"):                  1,
		stateSeries("sum", "2", "UNAVAILABLE"):            1,
		stateSeries("sum", "2", "READY"):                  0,
	} {
		if s[k] != want {
			t.Errorf("after a failed reload: %s = %v, want %v", k, s[k], want)
		}
	}
	for _, k := range hasSeriesOf(s, `version="2"`) {
		if !strings.HasPrefix(k, "sloserve_model_state{") {
			t.Errorf("the version that failed to load left a series: %s", k)
		}
	}
	idx := r.Index(false)
	if len(idx) != 2 || idx[0].State != StateReady || !strings.Contains(idx[0].Reason, "reload failed, previous version serving") ||
		!strings.Contains(idx[0].Reason, "not ONNX") || idx[1].State != StateUnavailable || !strings.Contains(idx[1].Reason, "not ONNX") {
		t.Errorf("index after a failed reload = %+v", idx)
	}

	// The fix (here: the factory starts it now; on disk: a new file) loads.
	f.mu.Lock()
	delete(f.fail, "sum")
	f.mu.Unlock()
	now := time.Now().Add(time.Second)
	if err := os.Chtimes(filepath.Join(repo, "sum", "2", "model.onnx"), now, now); err != nil {
		t.Fatal(err)
	}
	r.pollOnce(t.Context())
	if _, ver, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 1, 1, 1})); err != nil || ver != "2" {
		t.Fatalf("after the fix: version %q, %v; want version 2", ver, err)
	}
	s = series(t, preg)
	for k, want := range map[string]float64{
		`sloserve_model_load_failures_total{model="sum"}`: 1,
		`sloserve_model_load_failed{model="sum"}`:         0,
		`sloserve_model_loads_total{model="sum"}`:         2,
		stateSeries("sum", "2", "READY"):                  1,
	} {
		if s[k] != want {
			t.Errorf("after the fix: %s = %v, want %v", k, s[k], want)
		}
	}
	if got := hasSeriesOf(s, `version="1"`); len(got) > 0 {
		t.Errorf("version 1 left series after version 2 replaced it: %v", got)
	}
	if idx := r.Index(false); len(idx) != 1 || idx[0].Reason != "" {
		t.Errorf("index after the fix = %+v, want version 2 without a reason", idx)
	}

	// A removed model: requests find no model, its series go.
	if err := os.RemoveAll(filepath.Join(repo, "sum")); err != nil {
		t.Fatal(err)
	}
	r.pollOnce(t.Context())
	if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 1, 1, 1})); !errors.Is(err, ErrModelNotFound) {
		t.Errorf("request for a removed model: %v, want ErrModelNotFound", err)
	}
	if got := hasSeriesOf(series(t, preg), `model="sum"`); len(got) > 0 {
		t.Errorf("a removed model left series: %v", got)
	}
}

// A bad config on a model that never loaded: flagged, UNAVAILABLE with the
// field in the reason; no version series.
func TestLoadFailureOfNewModel(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "bad", "name: bad\nmax_batch_size: 4\nbogus: 1\n", 1)
	r, _, preg := newTestRegistry(t, ControlPoll, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	r.pollOnce(t.Context())
	s := series(t, preg)
	if s[`sloserve_model_load_failures_total{model="bad"}`] != 1 || s[`sloserve_model_load_failed{model="bad"}`] != 1 ||
		s[stateSeries("bad", "", "UNAVAILABLE")] != 1 {
		t.Errorf("series = %v", s)
	}
	idx := r.Index(false)
	if len(idx) != 1 || idx[0].State != StateUnavailable || !strings.Contains(idx[0].Reason, "bogus") {
		t.Errorf("index = %+v, want UNAVAILABLE naming the unknown field", idx)
	}
}

// While a reload of the same version starts its new instances, the index
// keeps the serving version READY and requests keep going to it.
func TestReloadKeepsServingVersionReady(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
	r, f, preg := newTestRegistry(t, ControlPoll, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	starting, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	f.mu.Lock()
	f.onStart = func(InstanceSpec) { once.Do(func() { close(starting) }); <-release }
	f.mu.Unlock()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 2, 1))
	done := make(chan struct{})
	go func() { r.pollOnce(t.Context()); close(done) }()
	<-starting
	if idx := r.Index(false); len(idx) != 1 || idx[0].State != StateReady {
		t.Errorf("index while the reload starts = %+v, want READY", idx)
	}
	if s := series(t, preg); s[stateSeries("sum", "1", "READY")] != 1 {
		t.Errorf("state while the reload starts: %v", s)
	}
	if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 1, 1, 1})); err != nil {
		t.Errorf("request while the reload starts: %v", err)
	}
	f.mu.Lock()
	f.onStart = nil
	f.mu.Unlock()
	close(release)
	<-done
	if n := len(f.of("sum", 1)); n != 3 {
		t.Errorf("%d instances started, want 1 + 2", n)
	}
}

// A share swap in flight when its version is replaced either finishes
// before the version stops or, once the version starts to stop, is given up
// (its start's context ends); either way the instance it started is stopped
// too, not leaked.
func TestShareSwapDuringReloadLeaksNoInstance(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
	lim := newFakeLimiter(2)
	lim.restart = true // every resize swaps
	r, f := newShareRegistry(t, repo, lim, nil)

	swapStarting, release := make(chan struct{}), make(chan struct{})
	f.mu.Lock()
	f.onStart = func(spec InstanceSpec) {
		if spec.Version == 1 {
			close(swapStarting)
			<-release
		}
	}
	f.mu.Unlock()
	swapped := make(chan error, 1)
	go func() { swapped <- r.SetShare(context.Background(), "sum/1", limiter.Share{Compute: 0.3}) }()
	<-swapStarting

	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 2)
	loaded := make(chan error, 1)
	go func() { loaded <- r.Load(context.Background(), "sum") }()
	// Version 2 serves while version 1's swap is still starting.
	waitUntil(t, "version 2 to serve", func() bool {
		_, ver, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 1, 1, 1}))
		return err == nil && ver == "2"
	})
	close(release)
	if err := <-swapped; err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("swap of the replaced version: %v, want done or given up (context canceled)", err)
	}
	if err := <-loaded; err != nil {
		t.Fatal(err)
	}
	v1 := f.of("sum", 1)
	if len(v1) != 2 {
		t.Fatalf("%d instances of version 1, want the first and the swap's", len(v1))
	}
	for i, fi := range v1 {
		if !fi.stopped.Load() {
			t.Errorf("version 1 instance %d still running after version 2 replaced it", i)
		}
	}
	if err := r.SetShare(context.Background(), "sum/2", limiter.Share{Compute: 0.5}); err != nil {
		t.Errorf("swap on version 2: %v", err)
	}
	if got := len(lim.shares()); got != 1 {
		t.Errorf("%d limiter units left, want version 2's one", got)
	}
}

// In none mode nothing changes until Rescan; then new folders load,
// changed ones reload and removed ones unload. In poll mode Rescan does not
// wait for the interval.
func TestRescan(t *testing.T) {
	for _, mode := range []string{ControlNone, ControlPoll} {
		t.Run(mode, func(t *testing.T) {
			repo := t.TempDir()
			writeModel(t, repo, "a", fmt.Sprintf(sumConfig, "a", 1, 1), 1)
			f := &fakeFactory{fail: map[string]error{}}
			r, err := New(Options{
				Repositories: []string{repo}, Control: mode, PollInterval: time.Hour,
				NewInstance: f.start, Registerer: prometheus.NewRegistry(),
			})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			if err := r.Start(ctx); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { cancel(); r.Stop(context.Background()) })

			other := t.TempDir()
			writeModel(t, other, "b", fmt.Sprintf(sumConfig, "b", 1, 1), 1)
			if err := r.SetRepositories([]string{other, filepath.Join(other, "missing")}); err == nil {
				t.Fatal("SetRepositories accepted a missing directory")
			}
			if err := r.SetRepositories([]string{other}); err != nil {
				t.Fatal(err)
			}
			if ok, _ := r.ModelReady("a", ""); !ok {
				t.Fatal("a model unloaded before a rescan")
			}
			r.Rescan()
			waitUntil(t, "b to load and a to unload", func() bool {
				okB, _ := r.ModelReady("b", "")
				_, errA := r.ModelReady("a", "")
				return okB && errors.Is(errA, ErrModelNotFound)
			})
			if !f.of("a", 1)[0].stopped.Load() {
				t.Error("a's instance still running")
			}
		})
	}
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// The watcher sees what a load reads: a version folder that is a symlink
// (releases kept elsewhere) counts, and re-pointing it reloads; a hidden
// folder where a version is staged does not.
func TestFingerprintFollowsVersionFolders(t *testing.T) {
	repo, releases := t.TempDir(), t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
	r, f, preg := newTestRegistry(t, ControlPoll, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	loads := func() float64 { return series(t, preg)[`sloserve_model_loads_total{model="sum"}`] }

	// Staging a version in a hidden folder changes nothing.
	staging := filepath.Join(repo, "sum", ".staging")
	if err := os.MkdirAll(staging, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(staging, "model.onnx"), []byte("onnx v2"), 0o644); err != nil {
		t.Fatal(err)
	}
	r.pollOnce(t.Context())
	if n := loads(); n != 1 {
		t.Fatalf("a hidden staging folder caused a reload: %v loads", n)
	}

	// A symlinked version folder is a new version.
	for _, rel := range []string{"a", "b"} {
		if err := os.MkdirAll(filepath.Join(releases, rel), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(releases, rel, "model.onnx"), []byte("onnx "+rel), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	link := filepath.Join(repo, "sum", "2")
	if err := os.Symlink(filepath.Join(releases, "a"), link); err != nil {
		t.Fatal(err)
	}
	r.pollOnce(t.Context())
	if _, ver, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 1, 1, 1})); err != nil || ver != "2" {
		t.Fatalf("after linking version 2: version %q, %v", ver, err)
	}
	// Re-pointing the link (same size, maybe the same time) reloads.
	tmp := filepath.Join(repo, "sum", ".2.tmp")
	if err := os.Symlink(filepath.Join(releases, "b"), tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, link); err != nil {
		t.Fatal(err)
	}
	r.pollOnce(t.Context())
	if n := loads(); n != 3 {
		t.Errorf("%v loads after re-pointing version 2, want 3", n)
	}
	insts := f.of("sum", 2)
	if len(insts) != 2 || !strings.HasSuffix(filepath.Dir(insts[1].spec.Path), "2") {
		t.Errorf("version 2 instances after re-pointing: %d", len(insts))
	}
}

// Options.Forget hears of versions gone for good: replaced by another
// version, unloaded through the API, removed with their folder; not of a
// reload of the same version or an eviction.
func TestForgetRetiredVersions(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
	writeModel(t, repo, "other", fmt.Sprintf(sumConfig, "other", 1, 1), 1)
	var (
		mu     sync.Mutex
		forgot []string
	)
	f := &fakeFactory{fail: map[string]error{}}
	r, err := New(Options{
		Repositories: []string{repo}, Control: ControlExplicit, StartupModels: []string{"*"},
		NewInstance: f.start, Registerer: prometheus.NewRegistry(),
		Forget: func(key string) { mu.Lock(); forgot = append(forgot, key); mu.Unlock() },
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	got := func() string { mu.Lock(); defer mu.Unlock(); return strings.Join(forgot, " ") }

	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 2, 1)) // same version, new config
	if err := r.Load(t.Context(), "sum"); err != nil {
		t.Fatal(err)
	}
	if err := r.Evict(t.Context(), "other/1"); err != nil {
		t.Fatal(err)
	}
	if g := got(); g != "" {
		t.Errorf("forgot %q after a same-version reload and an eviction, want nothing", g)
	}
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 2)
	if err := r.Load(t.Context(), "sum"); err != nil {
		t.Fatal(err)
	}
	if err := r.Unload(t.Context(), "sum"); err != nil {
		t.Fatal(err)
	}
	if g := got(); g != "sum/1 sum/2" {
		t.Errorf("forgot %q, want sum/1 (replaced) then sum/2 (unloaded)", g)
	}
}
