package e2e

import (
	"context"
	"fmt"
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
// ready after 30 s. The limiter's log shows the runner's unit placed
// without a quota and given its share before the model is ready, and the
// kernel's files show the runner under its quota once loaded.
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
	// Once loaded, the best-effort runner is under its quota: its share
	// holds once it serves.
	capped := func() {
		waitFor(t, "the best-effort runner under its quota", 30*time.Second, func() bool {
			uncapped, quota := unitQuotas(s.cmd.Process.Pid, "be")
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
		b, ok := load("be", 10*limit, func() {
			// The server's log reaches the test through a pipe: its
			// "model ready" line may come after the answer.
			waitFor(t, "the best-effort model's ready line", 30*time.Second, func() bool {
				return strings.Count(s.log.String(), `msg="model ready" component=models model=be `) > round
			})
			if err := startedUncapped(s.log.String()); err != nil {
				t.Errorf("round %d: %v", round, err)
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

// unitQuotas reports, of the limiter units of a server's model that hold
// a process, whether one has no CPU quota and whether one has a quota,
// from the kernel's files.
func unitQuotas(server int, model string) (uncapped, quota bool) {
	for _, d := range cgroupDirs(server) {
		for _, home := range []string{d, d + "-background"} {
			for _, f := range []string{"cpu.cfs_quota_us", "cpu.max"} {
				files, _ := filepath.Glob(filepath.Join(home, model+"-*", f))
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

// startedUncapped checks, in a server's log, that the best-effort model's
// latest unit was placed without a compute cap and resized to its share of
// 0.025 before the model's latest "model ready".
func startedUncapped(log string) error {
	lines := strings.Split(log, "\n")
	placed, unit := -1, ""
	for i, l := range lines {
		if strings.Contains(l, `msg="instance placed"`) && strings.Contains(l, " id=be-") {
			placed, unit = i, fieldOf(l, "id")
		}
	}
	if placed < 0 {
		return fmt.Errorf("no best-effort unit placed in the log")
	}
	if c := fieldOf(lines[placed], "share.compute"); c != "0" {
		return fmt.Errorf("unit %s placed at compute %s, want 0 (no cap) while it starts", unit, c)
	}
	resized, ready := -1, -1
	for i := placed + 1; i < len(lines); i++ {
		l := lines[i]
		if resized < 0 && strings.Contains(l, `msg="instance resized"`) && fieldOf(l, "id") == unit && fieldOf(l, "to.compute") == "0.025" {
			resized = i
		}
		if strings.Contains(l, `msg="model ready"`) && fieldOf(l, "model") == "be" {
			ready = i
		}
	}
	if resized < 0 || ready < 0 || resized > ready {
		return fmt.Errorf("unit %s: resized to 0.025 at log line %d, model ready at line %d; want the resize first", unit, resized, ready)
	}
	return nil
}

// fieldOf is the value of key=value in a logfmt line ("" when absent).
func fieldOf(line, key string) string {
	for _, f := range strings.Fields(line) {
		if v, ok := strings.CutPrefix(f, key+"="); ok {
			return v
		}
	}
	return ""
}
