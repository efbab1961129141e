package e2e

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestE2EBestEffortLoadsBesideBusyHost: a best-effort model pinned at a
// fortieth of the machine (a quota of 0.5 ms in each 10 ms period) loads
// beside two busy processes about as fast as a model without a cap: its
// runner starts uncapped (no quota, the default weight, not in the idle
// class) and takes its share once ready. Before, a runner started inside
// its share: under the burners a best-effort replacement at 0.025 was not
// ready after 30 s. The test sees the runner without a quota while it
// loads, and under its quota once loaded.
//
// The bound is relative: each best-effort load, alternated with a load of
// the uncapped model, within 4x the median of the uncapped ones.
func TestE2EBestEffortLoadsBesideBusyHost(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo,
		repoModel{"free", demoModel(t, "wakeword-hello"),
			"slo: {latency_ms: 1000, class: latency-critical}\nresources: {memory_limit: 256MiB}\n"},
		repoModel{"be", demoModel(t, "wakeword-hello"),
			"slo: {latency_ms: 1000, class: best-effort}\nresources: {memory_limit: 256MiB, compute_share: 0.025}\n"})
	// No profile: a load is the runner's start and warm-up.
	s := startServer(t, repo, "model_control: explicit\ncontrol: {profile: {enabled: false}}\n", withSet("control.policy=adaptive"))
	requireCgroups(t, s.control(t))
	startBurners(t, 2)

	// load loads a model and unloads it, and returns how long the load
	// took; ok is false when it had not answered within limit.
	load := func(name string, limit time.Duration, check func()) (took time.Duration, ok bool) {
		ctx, cancel := context.WithTimeout(t.Context(), limit)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, "POST", s.http+"/v2/repository/models/"+name+"/load", nil)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		resp, err := s.client.Do(req)
		took = time.Since(start)
		if ctx.Err() != nil {
			return took, false
		}
		if err != nil {
			t.Fatalf("loading %s: %v", name, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("loading %s: %d %s", name, resp.StatusCode, body)
		}
		if check != nil {
			check()
		}
		if code, b, _ := s.do(t, "POST", "/v2/repository/models/"+name+"/unload", nil); code != 200 {
			t.Fatalf("unloading %s: %d %s", name, code, b)
		}
		return took, true
	}
	// beUnits reports, of the best-effort model's units that hold a
	// process, whether one has no quota and whether one has a quota.
	beUnits := func() (uncapped, quota bool) {
		for _, d := range cgroupDirs(s.cmd.Process.Pid) {
			for _, home := range []string{d, d + "-background"} {
				for _, f := range []string{"cpu.cfs_quota_us", "cpu.max"} {
					files, _ := filepath.Glob(filepath.Join(home, "be-*", f))
					for _, q := range files {
						procs, _ := os.ReadFile(filepath.Join(filepath.Dir(q), "cgroup.procs"))
						b, err := os.ReadFile(q)
						if err != nil || strings.TrimSpace(string(procs)) == "" {
							continue
						}
						if v := strings.TrimSpace(string(b)); v == "-1" || strings.HasPrefix(v, "max") {
							uncapped = true
						} else {
							quota = true
						}
					}
				}
			}
		}
		return uncapped, quota
	}
	// Once loaded, the best-effort runner is under its quota: its share
	// holds once it serves.
	capped := func() {
		waitFor(t, "the best-effort runner under its quota", 30*time.Second, func() bool {
			uncapped, quota := beUnits()
			return quota && !uncapped
		})
	}

	var free, be []time.Duration
	for round := range 3 {
		f, ok := load("free", 5*time.Minute, nil)
		if !ok {
			t.Fatalf("round %d: the uncapped model did not load within 5 minutes", round)
		}
		free = append(free, f)
		base := slices.Clone(free)
		slices.Sort(base)
		limit := 4 * base[len(base)/2]
		// While it loads, its runner is seen without a quota.
		done := make(chan struct{})
		sawUncapped := make(chan bool, 1)
		go func() {
			saw := false
			for {
				if u, _ := beUnits(); u {
					saw = true
				}
				select {
				case <-done:
					sawUncapped <- saw
					return
				case <-time.After(5 * time.Millisecond):
				}
			}
		}()
		b, ok := load("be", 10*limit, func() {
			close(done)
			if !<-sawUncapped {
				t.Errorf("round %d: the best-effort runner was never seen without a quota while it loaded", round)
			}
			capped()
		})
		t.Logf("round %d: uncapped load %v, best-effort load %v (bound %v)", round, f, b, limit)
		if !ok {
			t.Fatalf("round %d: the best-effort model did not load within %v, 10x the bound (uncapped loads %v)", round, 10*limit, free)
		}
		be = append(be, b)
	}
	slices.Sort(free)
	slices.Sort(be)
	if limit := 4 * free[1]; be[1] > limit {
		t.Errorf("best-effort loads %v (median %v) against uncapped loads %v: want the median within 4x the uncapped median, %v", be, be[1], free, limit)
	}
}
