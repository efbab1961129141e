package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// bgPbtxt configures model "be" as a Triton repository has it: no SLO
// parameter, so best-effort by default.
const bgPbtxt = `name: "be"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "input_vectors", data_type: TYPE_FP32, dims: [ 10 ] } ]
output [ { name: "output_scalars", data_type: TYPE_FP32, dims: [ ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
dynamic_batching { }
`

// bgRepo is a repository with the best-effort model "be" from a Triton
// config.pbtxt and the latency-critical model "lc" from a config.yaml,
// both the tiny dynamic-axes network. The SLO is long: the test compares
// latencies, and admission must not drop a request on a busy host.
func bgRepo(t *testing.T) string {
	t.Helper()
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"lc", testModel(t, "example_dynamic_axes.onnx"),
		"max_batch_size: 8\nslo: {latency_ms: 10000, class: latency-critical}\n"})
	dir := filepath.Join(repo, "be", "1")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(testModel(t, "example_dynamic_axes.onnx"), filepath.Join(dir, "model.onnx")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(repo, "be", "config.pbtxt"), []byte(bgPbtxt), 0o644); err != nil {
		t.Fatal(err)
	}
	return repo
}

// bgClosedLoop runs clients closed-loop gRPC clients on model, n requests
// each, and returns the latencies of all. Each request may take 30 s.
func bgClosedLoop(t *testing.T, s *testServer, model string, clients, n int) []time.Duration {
	t.Helper()
	return bgClosedLoopWithin(t, s, model, clients, n, 30*time.Second)
}

// bgClosedLoopWithin is bgClosedLoop with each request's timeout.
func bgClosedLoopWithin(t *testing.T, s *testServer, model string, clients, n int, timeout time.Duration) []time.Duration {
	t.Helper()
	req := grpcDynRequest()
	req.ModelName = model
	var mu sync.Mutex
	var lat []time.Duration
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			mine := make([]time.Duration, 0, n)
			for range n {
				ctx, cancel := context.WithTimeout(t.Context(), timeout)
				start := time.Now()
				_, err := s.grpc.ModelInfer(ctx, req)
				cancel()
				if err != nil {
					t.Errorf("%s: %v", model, err)
					return
				}
				mine = append(mine, time.Since(start))
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	return lat
}

func bgMedian(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	d = slices.Clone(d)
	slices.Sort(d)
	return d[len(d)/2]
}

// One closed-loop client on an otherwise idle server is served no slower
// than two (issue 33: a lone best-effort model from a config.pbtxt had a
// p50 of 1.62 ms alone and 0.70 ms beside a second client), for a
// latency-critical and a best-effort model. Rounds of one and two clients
// alternate, and the medians over the rounds are compared: ratios in one
// run, no absolute bound. The best-effort runner is in the idle class,
// which yields, by design, to any other work: the property is about an
// idle machine, and is checked for "be" only when a probe finds that this
// host gives the idle class CPU (probeIdleClass). On a host whose CPUs
// other work keeps busy, what holds there is checked instead: every
// request to "be" is answered or ends at its own deadline (a thousand
// times lc's p50 measured here), and the runner is neither killed nor
// restarted.
func TestE2ELoneClientNotSlowerThanTwo(t *testing.T) {
	s := startServer(t, bgRepo(t), "")
	requireCgroups(t, s.control(t))
	var lcP50 time.Duration
	for _, model := range []string{"lc", "be"} {
		t.Run(model, func(t *testing.T) {
			if model == "be" {
				p := probeIdleClass(t)
				if !p.served() {
					t.Logf("branch: busy host, the idle class gets no CPU (%v): the idle-machine property is not checked; each request gets %v (1000x lc's p50)", p, 1000*lcP50)
					idleClassOnBusyHost(t, s, "be", 1000*lcP50)
					return
				}
				t.Logf("branch: the host gives the idle class CPU (%v): checking the idle-machine property", p)
			}
			bgClosedLoop(t, s, model, 2, 100) // warm, and let the loop settle
			const rounds, n = 3, 200
			var one, two []time.Duration
			for range rounds {
				one = append(one, bgMedian(bgClosedLoop(t, s, model, 1, n)))
				two = append(two, bgMedian(bgClosedLoop(t, s, model, 2, n)))
			}
			p1, p2 := bgMedian(one), bgMedian(two)
			t.Logf("%s: p50 one client %v (rounds %v), two clients %v (rounds %v)", model, p1, one, p2, two)
			if model == "lc" {
				lcP50 = p1
			}
			if float64(p1) > 1.2*float64(p2) {
				t.Errorf("%s: p50 with one client %v, more than 1.2x the p50 with two (%v)", model, p1, p2)
			}
		})
	}
}

// idleProbe is what a thread in the idle scheduling class got of a CPU
// while spinning for a window, the least of idleSpins such windows, and
// what one at normal priority got over one window after them.
type idleProbe struct{ window, idle, normal time.Duration }

// idleSpins is how many windows the idle thread spins.
const idleSpins = 3

// served says whether the host gives the idle class CPU: in every window,
// at least half of it, and at least half of what it gives a thread at
// normal priority. On an idle machine both get the whole window; beside
// two busy processes at normal priority on this 2-core host the idle
// thread got 1-80 ms of a 200 ms window (other work on the host comes
// and goes), the normal one 25-170 ms.
func (p idleProbe) served() bool { return 2*p.idle >= p.window && 2*p.idle >= p.normal }

func (p idleProbe) String() string {
	return fmt.Sprintf("spinning %v, a SCHED_IDLE thread ran %v at least (of %d windows), a normal one %v", p.window, p.idle.Round(time.Microsecond), idleSpins, p.normal.Round(time.Microsecond))
}

// probeIdleClass measures whether this host gives the idle class CPU at
// all: a thread of this process in SCHED_IDLE (the weight of a best-effort
// runner, in the idle class of a cgroup or, unprivileged, in SCHED_IDLE
// itself) spins for a window and reads the CPU time it got, idleSpins
// times; then a thread at normal priority does the same once, the
// baseline of what the host gives.
func probeIdleClass(t *testing.T) idleProbe {
	t.Helper()
	const window = 200 * time.Millisecond
	spin := func(idle bool) time.Duration {
		got := make(chan time.Duration, 1)
		go func() {
			// Never unlocked: the thread ends with the goroutine, and its
			// scheduling class with it.
			goruntime.LockOSThread()
			if idle {
				attr := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}
				if err := unix.SchedSetAttr(0, &attr, 0); err != nil {
					t.Errorf("SCHED_IDLE for the probe: %v", err)
					got <- 0
					return
				}
			}
			var t0, t1 unix.Timespec
			unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &t0)
			for start := time.Now(); time.Since(start) < window; {
			}
			unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &t1)
			got <- time.Duration(t1.Nano() - t0.Nano())
		}()
		return <-got
	}
	p := idleProbe{window: window, idle: window}
	for range idleSpins {
		p.idle = min(p.idle, spin(true))
	}
	p.normal = spin(false)
	return p
}

// idleClassOnBusyHost checks what holds for the best-effort model on a
// host that gives the idle class no CPU: four requests, each with a
// deadline of bound, are answered or end at their own deadline (none
// fails otherwise), and the model's runner is neither killed nor
// restarted meanwhile.
func idleClassOnBusyHost(t *testing.T, s *testServer, model string, bound time.Duration) {
	t.Helper()
	before := s.runnerPids(t, model+"/1/model.onnx")
	req := grpcDynRequest()
	req.ModelName = model
	const clients = 4
	errs := make(chan error, clients)
	for range clients {
		go func() {
			ctx, cancel := context.WithTimeout(t.Context(), bound)
			defer cancel()
			_, err := s.grpc.ModelInfer(ctx, req)
			errs <- err
		}()
	}
	answered, expired := 0, 0
	for range clients {
		switch err := <-errs; status.Code(err) {
		case codes.OK:
			answered++
		case codes.DeadlineExceeded:
			expired++
		default:
			t.Errorf("%s on a busy host: a request failed other than at its own deadline: %v", model, err)
		}
	}
	t.Logf("%s on a busy host: %d requests answered within %v, %d ended at that deadline", model, answered, bound, expired)
	checkNotRestarted(t, s, model, before)
}

// checkNotRestarted checks that model's runner (before: its pids then)
// was not killed as hung nor restarted.
func checkNotRestarted(t *testing.T, s *testServer, model string, before []int) {
	t.Helper()
	if s.logHas("runner hung") {
		t.Error("the starved runner was killed as hung")
	}
	// The control loop may have started a runner of another share beside
	// it (a swap); the starved one must not have been killed.
	// A swap the control loop finished (a resize starts a runner in a new
	// unit and stops the old one) also removes it: only a kill counts.
	// The swap's log line comes once the old runner has stopped, which a
	// starved host can delay: a swap under way gets a minute to say so.
	if after := s.runnerPids(t, model+"/1/model.onnx"); len(before) > 0 && !slices.Contains(after, before[0]) {
		deadline := time.Now().Add(time.Minute)
		for !s.logHas("instance replaced at a new share") && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
		if !s.logHas("instance replaced at a new share") {
			t.Errorf("runners %v, were %v, and no swap finished: the starved runner was killed", after, before)
		}
	}
	if v, _ := s.metricValue(t, fmt.Sprintf(`sloserve_runner_restarts_total{model=%q,version="1"}`, model)); v != 0 {
		t.Errorf("restarts = %v, want 0", v)
	}
}

// A best-effort runner (the idle class of a cgroup) that two busy
// processes at normal priority freeze out of the CPU is starved, not hung:
// its health checks and its calls fail for want of CPU, with health checks
// every 200 ms and a call timeout of 1 s, yet it is not restarted, and no
// request sent meanwhile fails. On a host that gives the idle class CPU
// once the test's burners stop, every such request is answered; on one
// whose other work keeps starving it, they may still wait, and end at
// their own deadline (see starvedNotRestarted).
func TestE2EStarvedBestEffortRunnerIsNotRestarted(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"be", testModel(t, "example_dynamic_axes.onnx"), starvedBEConfig})
	s := startServer(t, repo, "", withSet(starvedSets...))
	requireCgroups(t, s.control(t))
	starvedNotRestarted(t, s, repo)
}

// The same without root: the unprivileged limiter puts the best-effort
// runner's threads in SCHED_IDLE, which two burners starve as the idle
// class of a cgroup does. (A short name: the runner's socket lives in a
// folder named after the test, and a socket path has 107 bytes.)
func TestE2EUnprivStarvedBE(t *testing.T) {
	w := newNobodyWorld(t, -1)
	repo := filepath.Join(w.dir, "repo")
	writeRepo(t, repo, repoModel{"be", w.readable(t, testModel(t, "example_dynamic_axes.onnx")), starvedBEConfig})
	if err := filepath.WalkDir(repo, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return os.Chmod(p, map[bool]os.FileMode{true: 0o755, false: 0o644}[d.IsDir()])
	}); err != nil {
		t.Fatal(err)
	}
	t.Setenv("SLOSERVE_ONNXRUNTIME_LIBRARY", w.readable(t, need(t, "SLOSERVE_ONNXRUNTIME_LIBRARY")))
	s := startServer(t, repo, "", withCommand(w.bin, w.wrap, w.env...), withSet(starvedSets...))
	if c := s.control(t); len(c.Devices) == 0 || c.Devices[0].Limiter != "unprivileged" {
		t.Fatalf("limiter %+v, want unprivileged", c.Devices)
	}
	starvedNotRestarted(t, s, repo)
}

const starvedBEConfig = "max_batch_size: 8\nslo: {latency_ms: 120000, class: best-effort}\n"

// starvedSets check a runner's health every 200 ms and abandon a call
// after 1 s: a starved runner fails many checks and outlasts a call.
var starvedSets = []string{"runtime.health_interval=200ms", "runtime.call_timeout=1s"}

// starvedNotRestarted starves s's best-effort runner of model be with
// burners at normal priority, sends requests meanwhile, and checks that
// the runner was not killed and that no request failed. Whether the host
// gives the idle class CPU apart from the test's burners is probed first
// (probeIdleClass): if it does, every request must be answered, within
// ten times as long as the starvation lasted; if it does not (outside
// work keeps every CPU), a request may wait as long as the starvation
// lasted and is then cancelled, and must have been answered or cancelled,
// never failed otherwise.
func starvedNotRestarted(t *testing.T, s *testServer, repo string) {
	t.Helper()
	var before []int
	waitFor(t, "one runner of be", 30*time.Second, func() bool {
		before = s.runnerPids(t, "be/1/model.onnx")
		return len(before) == 1
	})
	req := grpcDynRequest()
	req.ModelName = "be"
	probe := probeIdleClass(t)
	idleHost := probe.served()
	alone := time.Duration(0)
	if idleHost {
		t.Logf("branch: the host gives the idle class CPU (%v): every request must be answered once the burners stop", probe)
		alone = bgMedian(bgClosedLoop(t, s, "be", 1, 50))
	} else {
		t.Logf("branch: busy host, the idle class gets no CPU even before the test's burners (%v): requests may wait, and are cancelled after as long as the starvation lasted", probe)
	}

	// Two burners at normal priority: one per core of this machine, more
	// where it has more.
	var burners []*exec.Cmd
	for range max(2, goruntime.NumCPU()) {
		cmd := exec.Command("sh", "-c", "while :; do :; done")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		burners = append(burners, cmd)
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	}
	burning := time.Now()
	waitFor(t, "the runner's health checks to fail for want of CPU", time.Minute, func() bool {
		return s.logHas("starved of CPU")
	})
	// Requests sent while it is starved, for longer than the call timeout
	// and than the health checks that would have found it hung (three,
	// or, before, ten starved ones and three more).
	const clients = 4
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	errs := make(chan error, clients)
	took := make(chan time.Duration, clients)
	for range clients {
		go func() {
			start := time.Now()
			_, err := s.grpc.ModelInfer(ctx, req)
			took <- time.Since(start)
			errs <- err
		}()
	}
	time.Sleep(15 * 200 * time.Millisecond)
	starved := time.Since(burning)
	for _, b := range burners {
		b.Process.Kill()
		b.Wait()
	}
	bound := starved
	if idleHost {
		bound = 10 * starved
	}
	stop := time.AfterFunc(bound, cancel)
	defer stop.Stop()
	answered, cancelled := 0, 0
	var slowest time.Duration
	for range clients {
		slowest = max(slowest, <-took)
		switch err := <-errs; {
		case err == nil:
			answered++
		case status.Code(err) == codes.Canceled && ctx.Err() != nil && !idleHost:
			cancelled++
		case ctx.Err() != nil:
			t.Errorf("a request sent while the runner was starved was not answered within %v after the burners stopped (10x the starvation): %v", bound, err)
		default:
			t.Errorf("a request sent while the runner was starved: %v", err)
		}
	}
	t.Logf("alone p50 %v; starved %v; of the %d requests sent meanwhile %d answered, %d still waiting %v after the burners stopped and cancelled; the slowest took %v",
		alone, starved.Round(time.Millisecond), clients, answered, cancelled, bound.Round(time.Millisecond), slowest.Round(time.Millisecond))
	checkNotRestarted(t, s, "be", before)
	if idleHost {
		// The runner serves again, each request within as long again as
		// ten starvations.
		if lat := bgClosedLoopWithin(t, s, "be", 1, 50, 10*starved); len(lat) != 50 {
			t.Errorf("after the starvation: %d of 50 answered", len(lat))
		}
	} else {
		idleClassOnBusyHost(t, s, "be", starved)
	}
}
