package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// runnerStartedRe and runnerReadyRe read the runner processes a server
// started and how long each took to be ready, from its debug log.
var (
	runnerStartedRe = regexp.MustCompile(`msg="runner process started".* pid=(\d+)`)
	runnerReadyRe   = regexp.MustCompile(`msg="runner process ready".* took=(\S+)`)
)

// loggedRunners lists the pids of every runner process the server's log
// says it started, restarts included.
func (s *testServer) loggedRunners() []int {
	var pids []int
	for _, m := range runnerStartedRe.FindAllStringSubmatch(s.log.String(), -1) {
		if pid, err := strconv.Atoi(m[1]); err == nil && !slices.Contains(pids, pid) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// slowestRunnerStart is the longest a runner process of the server took
// from its start to ready, from its debug log; 0 when none is logged.
func (s *testServer) slowestRunnerStart() time.Duration {
	var d time.Duration
	for _, m := range runnerReadyRe.FindAllStringSubmatch(s.log.String(), -1) {
		if took, err := time.ParseDuration(m[1]); err == nil {
			d = max(d, took)
		}
	}
	return d
}

// pacedLoad sends one-row gRPC requests for model from workers goroutines,
// back to back while they succeed, and 10ms apart after a failure, as a
// client that backs off would: a client that spins on failures (a runner
// restarting answers at once) only takes the CPU from the server it tests.
// ok counts the answers that succeeded; stop ends the load and waits for
// its calls.
func pacedLoad(t *testing.T, s *testServer, model string, workers int) (ok *atomic.Int64, stop func()) {
	t.Helper()
	ok = new(atomic.Int64)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for ctx.Err() == nil {
				call, done := context.WithTimeout(ctx, 5*time.Second)
				_, err := s.grpc.ModelInfer(call, grpcDyn(model, 1))
				done()
				if err == nil {
					ok.Add(1)
					continue
				}
				select {
				case <-ctx.Done():
				case <-time.After(10 * time.Millisecond):
				}
			}
		})
	}
	stop = func() { cancel(); wg.Wait() }
	t.Cleanup(stop)
	return ok, stop
}

// TestE2ERunnerCrashAsServerStops: a runner that crashes just before or as
// SIGTERM arrives, so that its restart (after restart_backoff_initial, then
// loading its model) races the shutdown, does not hold the stop. A server
// with a latency-critical and a best-effort model, under load on both, on
// the cgroup limiter: one runner (each model's in turn) or both are killed
// with SIGKILL and the server gets SIGTERM at once, a few ms later, inside
// the restart backoff, or as the new runner process loads its model. Each
// stop must take about as long as the same server's stop without a crash
// (measured in the test, before and after), plus at most one runner start
// (measured from the servers' logs): the server exits 0, kills no runner at
// the stop timeout, and leaves no runner process (the restarted ones
// included, read from its log) and no cgroup folder behind. A stop over the
// bound is reported with the server's goroutines (--pprof-addr), taken
// while it was still stopping.
func TestE2ERunnerCrashAsServerStops(t *testing.T) {
	const (
		lcConfig = "max_batch_size: 8\nexecution: {intra_op_threads: 1}\n" + latencyCritical
		beConfig = "max_batch_size: 8\nexecution: {intra_op_threads: 1}\nslo: {latency_ms: 1000, class: best-effort}\nresources: {min_compute_share: 0.05}\n"
		backoff  = 200 * time.Millisecond
	)
	var slowestStart, dumpAfter time.Duration
	dumps := map[string]string{}
	// run starts the server under load, kills the runners of the models
	// named in kill, waits for at(), sends SIGTERM and returns how long
	// the server took to exit (not counting the harness's wait for what
	// it leaves behind).
	run := func(name string, kill []string, at func(s *testServer, before []int)) time.Duration {
		t.Helper()
		repo := t.TempDir()
		writeRepo(t, repo,
			repoModel{"lc", testModel(t, "example_dynamic_axes.onnx"), lcConfig},
			repoModel{"be", testModel(t, "example_dynamic_axes.onnx"), beConfig},
		)
		pprofAddr := freePort(t)
		s := startServer(t, repo, "", withSet("runtime.restart_backoff_initial="+backoff.String()), withFlags("--pprof-addr", pprofAddr))
		requireCgroups(t, s.control(t))
		runners := map[string]int{}
		for _, m := range []string{"lc", "be"} {
			pids := s.runnerPids(t, filepath.Join(repo, m)+"/")
			if len(pids) != 1 {
				t.Fatalf("%s: runners of %s: %v, want 1", name, m, pids)
			}
			runners[m] = pids[0]
		}
		lc, stopLC := pacedLoad(t, s, "lc", 2)
		_, stopBE := pacedLoad(t, s, "be", 1)
		waitFor(t, "answers on lc", 30*time.Second, func() bool { return lc.Load() >= 50 })
		before := s.children()
		for _, m := range kill {
			if err := syscall.Kill(runners[m], syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
		}
		if at != nil {
			at(s, before)
		}
		// The stop is timed to the server's exit, seen in /proc; the
		// harness then waits for what it must have removed (runners,
		// sockets, cgroup folders), timed apart. A server still running
		// at the bound known so far (the first baseline's) has its
		// goroutines kept for the report: what it waits for.
		pid, start := s.cmd.Process.Pid, time.Now()
		exitc := make(chan time.Duration, 1)
		dumped := make(chan string, 1)
		go func() {
			defer close(dumped)
			var dumpAt <-chan time.Time
			if dumpAfter > 0 {
				dumpAt = time.After(dumpAfter)
			}
			tick := time.NewTicker(time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-tick.C:
				case <-dumpAt:
					if resp, err := http.Get("http://" + pprofAddr + "/debug/pprof/goroutine?debug=1"); err == nil {
						b, _ := io.ReadAll(resp.Body)
						resp.Body.Close()
						dumped <- string(b)
					}
				}
				if !alive(pid) {
					exitc <- time.Since(start)
					return
				}
			}
		}()
		err := s.stop()
		total := time.Since(start)
		took := <-exitc
		if d := <-dumped; d != "" && took > dumpAfter {
			dumps[name] = fmt.Sprintf("goroutines of the server %v after SIGTERM:\n%s\nits log:\n%s", dumpAfter, d, s.log.String())
		}
		stopLC()
		stopBE()
		if err != nil {
			t.Errorf("%s: %v", name, err)
		}
		if s.logHas("did not stop in time") {
			t.Errorf("%s: a runner did not stop in time and was killed", name)
		}
		all := s.loggedRunners()
		if left := slices.DeleteFunc(slices.Clone(all), func(p int) bool { return !alive(p) }); len(left) > 0 {
			t.Errorf("%s: runners outlived the server: %v of %v", name, left, all)
		}
		slowestStart = max(slowestStart, s.slowestRunnerStart())
		restarted := s.logHas(`msg="runner restarted"`)
		t.Logf("%s: exited %v after SIGTERM, nothing left %v after (runner processes %d, a restart finished: %v)",
			name, took.Round(time.Millisecond), total.Round(time.Millisecond), len(all), restarted)
		return took
	}
	sleep := func(d time.Duration) func(*testServer, []int) {
		return func(*testServer, []int) { time.Sleep(d) }
	}
	// loading waits until a new runner process is up, that is, loading
	// its model (it reports ready later).
	loading := func(s *testServer, before []int) {
		deadline := time.Now().Add(30 * time.Second)
		for time.Now().Before(deadline) {
			for _, p := range s.children() {
				if !slices.Contains(before, p) {
					return
				}
			}
			time.Sleep(time.Millisecond)
		}
		t.Fatal("no new runner process within 30s of the kill")
	}

	baseline := run("no crash", nil, nil)
	dumpAfter = 3*baseline + slowestStart
	type when struct {
		name string
		at   func(*testServer, []int)
	}
	var stops []string
	var worst time.Duration
	var worstCase string
	for _, kill := range [][]string{{"lc"}, {"be"}, {"lc", "be"}} {
		for _, w := range []when{
			{"at once", nil},
			{"5ms after", sleep(5 * time.Millisecond)},
			{"inside the backoff", sleep(backoff / 2)},
			{"as the new runner loads", loading},
		} {
			name := fmt.Sprintf("%v killed, SIGTERM %s", kill, w.name)
			took := run(name, kill, w.at)
			stops = append(stops, fmt.Sprintf("%s: %v", name, took.Round(time.Millisecond)))
			if took > worst {
				worst, worstCase = took, name
			}
		}
	}
	// The machine's load drifts between servers: the longer of two
	// baselines.
	baseline = max(baseline, run("no crash, again", nil, nil))
	limit := 3*baseline + slowestStart
	t.Logf("stop without a crash %v; slowest runner start %v; bound %v; slowest stop with a crash %v (%s)",
		baseline.Round(time.Millisecond), slowestStart.Round(time.Millisecond), limit.Round(time.Millisecond), worst.Round(time.Millisecond), worstCase)
	if worst > limit {
		t.Errorf("a runner crash as the server stopped held the stop: %v (%s), want at most 3x the %v of a stop without one plus the slowest runner start %v; all stops:\n%v",
			worst, worstCase, baseline, slowestStart, stops)
		if d, ok := dumps[worstCase]; ok {
			t.Log(d)
		}
	}
}
