package e2e

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// controlJSON is the part of GET /v2/control the tests read.
type controlJSON struct {
	Policy  string `json:"policy"`
	Devices []struct {
		Device  string `json:"device"`
		Limiter string `json:"limiter"`
		Detail  string `json:"limiter_detail"`
		CPUs    int    `json:"cpus"`
		Models  []struct {
			Model        string  `json:"model"`
			ComputeShare float64 `json:"compute_share"`
			Source       string  `json:"source"`
			Pinned       bool    `json:"pinned"`
			ForecastRate float64 `json:"forecast_rate"`
			ProfileMAPE  float64 `json:"profile_mape"`
			Samples      int     `json:"prediction_samples"`
		} `json:"models"`
	} `json:"devices"`
}

type eventsJSON struct {
	Events []struct {
		Model  string `json:"model"`
		Kind   string `json:"kind"`
		Reason string `json:"reason"`
		New    struct {
			Compute float64 `json:"compute"`
		} `json:"new"`
	} `json:"events"`
}

func (s *testServer) control(t *testing.T) controlJSON {
	t.Helper()
	var c controlJSON
	if code := s.json(t, "GET", "/v2/control", nil, &c); code != 200 {
		t.Fatalf("GET /v2/control: %d", code)
	}
	return c
}

// share returns a model's compute share on the CPU device, -1 if absent.
func (c controlJSON) share(model string) float64 {
	for _, d := range c.Devices {
		for _, m := range d.Models {
			if m.Model == model {
				return m.ComputeShare
			}
		}
	}
	return -1
}

// cpuDir is the directory of a process's cgroup that has the cpu
// controller, and whether it is cgroup v2.
func cpuDir(t *testing.T, pid int) (string, bool) {
	t.Helper()
	return cgroupDir(t, pid, "cpu")
}

// cgroupDir is the directory of a process's cgroup that has controller
// (v1), or its unified cgroup (v2), and whether it is cgroup v2.
func cgroupDir(t *testing.T, pid int, controller string) (string, bool) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(strings.TrimSpace(string(b)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		for c := range strings.SplitSeq(parts[1], ",") {
			if c == controller {
				return filepath.Join("/sys/fs/cgroup", parts[1], parts[2]), false
			}
		}
		if parts[1] == "" {
			return filepath.Join("/sys/fs/cgroup", parts[2]), true
		}
	}
	t.Fatalf("pid %d: no %s cgroup in %s", pid, controller, b)
	return "", false
}

// cpuQuota reads the CPU quota of a process's cgroup, in cores (v1
// cfs_quota_us/cfs_period_us, v2 cpu.max); +Inf when unlimited.
func cpuQuota(t *testing.T, pid int) float64 {
	t.Helper()
	dir, v2 := cpuDir(t, pid)
	if v2 {
		f := strings.Fields(string(mustRead(t, filepath.Join(dir, "cpu.max"))))
		if f[0] == "max" {
			return math.Inf(1)
		}
		q, _ := strconv.Atoi(f[0])
		p, _ := strconv.Atoi(f[1])
		return float64(q) / float64(p)
	}
	q := readInt(t, filepath.Join(dir, "cpu.cfs_quota_us"))
	if q < 0 {
		return math.Inf(1)
	}
	return float64(q) / float64(readInt(t, filepath.Join(dir, "cpu.cfs_period_us")))
}

// cpuWeight reads the scheduling weight of a process's cgroup in the
// kernel's default weights (v1 cpu.shares / 1024, v2 cpu.weight / 100).
func cpuWeight(t *testing.T, pid int) float64 {
	t.Helper()
	dir, v2 := cpuDir(t, pid)
	if v2 {
		return float64(readInt(t, filepath.Join(dir, "cpu.weight"))) / 100
	}
	return float64(readInt(t, filepath.Join(dir, "cpu.shares"))) / 1024
}

// floorWeight is the weight the limiter gives a latency-critical floor:
// 8 default threads per CPU of its share.
func floorWeight(share, cpus float64) float64 { return share * cpus * 8 }

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func readInt(t *testing.T, path string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(strings.TrimSpace(string(mustRead(t, path))), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestE2EAdaptiveControl runs the control loop against the real detector:
// it is profiled at load, shrinks to its minimum share when idle, grows
// when load comes (its share is a floor: the runner's real cgroup has no
// quota and a weight that follows the share), can be pinned (a hard
// quota) and unpinned through the API, and its cgroups are gone after the
// server stops.
func TestE2EAdaptiveControl(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"det", demoModel(t, "ocr-det"), `max_batch_size: 4
slo: {latency_ms: 300, class: latency-critical}
execution: {intra_op_threads: 1}
resources: {min_compute_share: 0.1, memory_limit: 512MiB}
profile: {shapes: {x: [1, 3, 128, 128]}, batch_sizes: [1, 4]}
`})
	s := startServer(t, repo, fmt.Sprintf(`control:
  period: 200ms
  scale_down_after: 1s
  cooldown: 500ms
  profile: {cache_dir: %q, budget: 30s}
`, t.TempDir()))

	waitFor(t, "the adjuster's first pass", 5*time.Second, func() bool { return s.control(t).share("det/1") >= 0 })
	c := s.control(t)
	requireCgroups(t, c)
	if c.Policy != "adaptive" || len(c.Devices[0].Models) != 1 {
		t.Fatalf("control = %+v", c)
	}
	cpus := float64(c.Devices[0].CPUs)
	if m := c.Devices[0].Models[0]; !(m.ProfileMAPE > 0 && m.ProfileMAPE < 0.5) {
		t.Errorf("profile MAPE %v: the model was not profiled at load, or badly", m.ProfileMAPE)
	}
	pids := s.runnerPids(t, "det/1/model.onnx")
	if len(pids) != 1 {
		t.Fatalf("runner pids %v", pids)
	}
	pid := pids[0]

	// Idle: the minimum share, as a floor: no quota, the floor's weight.
	waitFor(t, "the idle model to reach its minimum share", 5*time.Second, func() bool {
		return s.control(t).share("det/1") == 0.1
	})
	if q := cpuQuota(t, pid); !math.IsInf(q, 1) {
		t.Errorf("cgroup quota %v cores, want none (a floor is work-conserving)", q)
	}
	if w := cpuWeight(t, pid); math.Abs(w-floorWeight(0.1, cpus)) > 0.01 {
		t.Errorf("cgroup weight %v, want %v", w, floorWeight(0.1, cpus))
	}

	// Load: a steady stream the minimum share cannot serve in 300 ms.
	body, hlen := detRequest(t, 128, nil)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	codes := map[int]int{}
	for range 2 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				code, _, _ := s.do(t, "POST", "/v2/models/det/infer", body, "Inference-Header-Content-Length", hlen)
				mu.Lock()
				codes[code]++
				mu.Unlock()
			}
		})
	}
	waitFor(t, "the share to grow under load", 10*time.Second, func() bool {
		return s.control(t).share("det/1") >= 0.2
	})
	grown := s.control(t).share("det/1")
	if w := cpuWeight(t, pid); math.Abs(w-floorWeight(grown, cpus)) > 0.01 && s.control(t).share("det/1") == grown {
		t.Errorf("cgroup weight %v, want %v (share %v)", w, floorWeight(grown, cpus), grown)
	}
	var ev eventsJSON
	s.json(t, "GET", "/v2/control/events?limit=1000", nil, &ev)
	found := false
	for _, e := range ev.Events {
		if e.Model == "det/1" && e.Kind == "resize" && strings.Contains(e.Reason, "forecast") && e.New.Compute >= 0.2 {
			found = true
		}
	}
	if !found {
		t.Errorf("no resize event naming the forecast among %+v", ev.Events)
	}

	// A pin holds whatever the load, as a hard quota, at once.
	if code, b, _ := s.do(t, "PUT", "/v2/models/det/share", []byte(`{"compute": 0.35}`)); code != 200 {
		t.Fatalf("pin: %d %s", code, b)
	}
	waitFor(t, "the pinned quota", 2*time.Second, func() bool { return math.Abs(cpuQuota(t, pid)-0.35*cpus) < 0.01 })
	// The status is published at the end of the pass that wrote the
	// quota: it may lag the cgroup file by a moment.
	waitFor(t, "the pin in the control status", 2*time.Second, func() bool {
		c := s.control(t)
		return c.share("det/1") == 0.35 && c.Devices[0].Models[0].Pinned
	})
	close(stop)
	wg.Wait()
	mu.Lock()
	if codes[200] == 0 || len(codes) != 1 {
		t.Errorf("request outcomes under load %v; want all 200", codes)
	}
	mu.Unlock()

	// Unpinned and idle again, it shrinks back after the slack lasted.
	if code, b, _ := s.do(t, "DELETE", "/v2/models/det/share", nil); code != 200 {
		t.Fatalf("unpin: %d %s", code, b)
	}
	waitFor(t, "the share to shrink back when idle", 10*time.Second, func() bool {
		return s.control(t).share("det/1") == 0.1
	})
	s.json(t, "GET", "/v2/control/events?limit=1000", nil, &ev)
	kinds := map[string]bool{}
	for _, e := range ev.Events {
		kinds[e.Kind] = true
	}
	if !kinds["pin"] || !kinds["unpin"] {
		t.Errorf("event kinds %v; want pin and unpin", kinds)
	}

	// The server's cgroups are removed when it stops.
	cg := string(mustRead(t, fmt.Sprintf("/proc/%d/cgroup", pid)))
	if err := s.stop(); err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(strings.TrimSpace(cg), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && strings.Contains(parts[2], "sloserve-") {
			dir := filepath.Join("/sys/fs/cgroup", parts[1], parts[2])
			if parts[1] == "" {
				dir = filepath.Join("/sys/fs/cgroup", parts[2])
			}
			if _, err := os.Stat(dir); !os.IsNotExist(err) {
				t.Errorf("cgroup %s still exists after the server stopped (%v)", dir, err)
			}
		}
	}
}

// TestE2EStaticAndSharedPolicies: static splits the device equally, shared
// sets no limit and enforces nothing.
func TestE2EStaticAndSharedPolicies(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo,
		repoModel{"a", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\nslo: {latency_ms: 100, class: latency-critical}\n"},
		repoModel{"b", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"},
	)
	t.Run("static", func(t *testing.T) {
		s := startServer(t, repo, "control: {policy: static, period: 100ms}\n")
		waitFor(t, "equal shares", 5*time.Second, func() bool {
			c := s.control(t)
			return c.share("a/1") == 0.5 && c.share("b/1") == 0.5
		})
		c := s.control(t)
		requireCgroups(t, c)
		for _, m := range c.Devices[0].Models {
			if m.Source != "static" {
				t.Errorf("%s source %q, want static", m.Model, m.Source)
			}
		}
		pids := s.runnerPids(t, "a/1/model.onnx")
		if len(pids) != 1 {
			t.Fatalf("runner pids %v", pids)
		}
		if q := cpuQuota(t, pids[0]); math.Abs(q-0.5*float64(c.Devices[0].CPUs)) > 0.01 {
			t.Errorf("quota %v cores, want half the device", q)
		}
	})
	t.Run("shared", func(t *testing.T) {
		s := startServer(t, repo, "control: {policy: shared, period: 100ms}\n")
		c := s.control(t)
		if c.Policy != "shared" || c.Devices[0].Limiter != "none" {
			t.Fatalf("control = %+v; want the shared policy with no limiter", c)
		}
		waitFor(t, "no limits", 5*time.Second, func() bool {
			c := s.control(t)
			return c.share("a/1") == 0 && c.share("b/1") == 0
		})
	})
}

// TestE2EProfileCommand: `sloserve profile` measures, prints the points and
// the fitted curve, and reads the cache the second time.
func TestE2EProfileCommand(t *testing.T) {
	lib := need(t, "SLOSERVE_ONNXRUNTIME_LIBRARY")
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"det", demoModel(t, "ocr-det"), `max_batch_size: 4
execution: {intra_op_threads: 1}
profile: {shapes: {x: [1, 3, 96, 96]}, batch_sizes: [1, 2, 4]}
`})
	cache := t.TempDir()
	run := func(args ...string) string {
		t.Helper()
		out, errOut, err := runSloserve(append([]string{"profile", "--repository", repo,
			"--set", "runtime.onnxruntime_library=" + lib, "--set", "control.profile.cache_dir=" + cache}, args...)...)
		if err != nil {
			if strings.Contains(errOut, "not profiled") && os.Getenv("SLOSERVE_REQUIRE_CGROUPS") != "1" {
				t.Skip(errOut)
			}
			t.Fatalf("sloserve profile %v: %v\n%s%s", args, err, out, errOut)
		}
		return out
	}
	out := run("--fresh", "det")
	// 3 shares x 3 batch sizes, each a row "batch share measured curve error".
	rows := 0
	for line := range strings.SplitSeq(out, "\n") {
		if f := strings.Fields(line); len(f) == 5 && strings.HasSuffix(f[4], "%") {
			rows++
		}
	}
	if rows != 9 || !strings.Contains(out, "t(b, s) = ") || !strings.Contains(out, "MAPE") || !strings.Contains(out, "measured now") {
		t.Errorf("profile output (%d point rows):\n%s", rows, out)
	}
	if again := run("det"); !strings.Contains(again, "from the cache") {
		t.Errorf("second run did not use the cache:\n%s", again)
	}
	out, errOut, err := runSloserve("profile", "--repository", repo, "--set", "runtime.onnxruntime_library="+lib, "nope")
	if err == nil || !strings.Contains(out+errOut, `model not found: "nope"`) {
		t.Errorf("profile of an unknown model: %v %s%s", err, out, errOut)
	}
}
