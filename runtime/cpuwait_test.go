package runtime

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sloserve/sloserve/internal/syncbuf"
)

func TestParseSchedstat(t *testing.T) {
	for _, c := range []struct {
		in        string
		run, wait time.Duration
		ok        bool
	}{
		{"92405289888 22926744544 56534\n", 92405289888, 22926744544, true},
		{"0 0 1", 0, 0, true},
		{"1 2", 0, 0, false},
		{"1 x 3", 0, 0, false},
		{"x 1 3", 0, 0, false},
		{"1 -5 3", 0, 0, false},
		{"-1 5 3", 0, 0, false},
		{"", 0, 0, false},
	} {
		run, wait, err := parseSchedstat([]byte(c.in))
		if (err == nil) != c.ok || run != c.run || wait != c.wait {
			t.Errorf("parseSchedstat(%q) = %v, %v, %v; want %v, %v, ok %v", c.in, run, wait, err, c.run, c.wait, c.ok)
		}
	}
}

// The run delay of a process grows while it waits for a CPU beside busy
// threads on the same CPU, and stands still while it is frozen.
func TestCPUWait(t *testing.T) {
	if _, ok := cpuWait(os.Getpid()); !ok {
		t.Skip("the kernel gives no /proc/<pid>/task/<tid>/schedstat")
	}
	cmd := startSpinner(t)
	cpu := lastCPU(t)
	burn(t, cpu, 2)
	pin(t, cmd.Process.Pid, cpu, false)
	w0, _ := cpuWait(cmd.Process.Pid)
	time.Sleep(300 * time.Millisecond)
	w1, _ := cpuWait(cmd.Process.Pid)
	if w1-w0 < 50*time.Millisecond {
		t.Errorf("a spinner sharing a CPU with two others waited %v in 300ms, want over 50ms", w1-w0)
	}
	freeze(t, cmd.Process.Pid)
	w2, _ := cpuWait(cmd.Process.Pid)
	time.Sleep(300 * time.Millisecond)
	w3, ok := cpuWait(cmd.Process.Pid)
	if !ok || w3 != w2 {
		t.Errorf("a frozen process's CPU wait went from %v to %v (read %v)", w2, w3, ok)
	}
}

// A runner starved of CPU (idle class, on one CPU with busy processes) fails
// health checks but is not killed as hung: the failed checks are not
// counted. A frozen one in the same place is still killed as hung.
func TestRunnerStarvedIsNotHung(t *testing.T) {
	if _, ok := cpuWait(os.Getpid()); !ok {
		t.Skip("the kernel gives no /proc/<pid>/task/<tid>/schedstat")
	}
	if goruntime.NumCPU() < 2 {
		t.Skip("needs 2 CPUs: one to starve the runner on, one for the test")
	}
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	// Checks of 200 ms (the timeout is the interval): a runner of the
	// idle scheduling class behind three busy processes on its CPU cannot
	// answer them all in time, while the test itself, on the other CPUs,
	// answers its part well within it even on a busy machine.
	cfg.HealthInterval = 200 * time.Millisecond
	var log syncbuf.Buffer
	cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(t.Output(), &log), &slog.HandlerOptions{Level: slog.LevelDebug}))
	r := startTestRunner(t, cfg)
	pid := r.Pid()

	cpu := lastCPU(t)
	spinners := burn(t, cpu, 3)
	pin(t, pid, cpu, true)
	// Three times hungAfter failed checks; the runner stays the same all
	// along.
	deadline := time.Now().Add(30 * time.Second)
	for strings.Count(log.String(), "starved of CPU; not counted") < 3*hungAfter {
		if got := r.Pid(); got != pid || r.Restarts() != 0 || strings.Contains(log.String(), "runner hung") {
			t.Fatalf("the starved runner %d was replaced by %d (%d restarts; reason %q)", pid, got, r.Restarts(), r.Reason())
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d health checks failed for want of CPU in 30s, want %d: the runner was not starved enough",
				strings.Count(log.String(), "not counted"), 3*hungAfter)
		}
		time.Sleep(10 * time.Millisecond)
	}

	// A thread of the idle class behind three spinners may wait seconds
	// for the CPU it needs to take its stop signal: the spinners pause
	// while it is frozen, then spin on beside the frozen runner.
	for _, s := range spinners {
		s.Process.Signal(syscall.SIGSTOP)
	}
	freeze(t, pid)
	for _, s := range spinners {
		s.Process.Signal(syscall.SIGCONT)
	}
	waitFor(t, 20*time.Second, "the frozen runner to be killed as hung", func() bool {
		return strings.Contains(log.String(), "runner hung; killing it")
	})
	for _, s := range spinners {
		s.Process.Kill() // let the killed runner, of the idle class, exit
	}
	waitFor(t, 30*time.Second, "a new runner", func() bool { return r.Pid() != 0 && r.Pid() != pid })
}

// A process that spins without answering (a livelock) has the CPU: it
// is not starved, so its failed checks count and it is found hung. The
// same process in the idle class behind three busy ones on its CPU is
// starved; frozen there, it is not (no thread wants a CPU).
func TestStarvationTellsSpinningFromStarved(t *testing.T) {
	if _, ok := cpuWait(os.Getpid()); !ok {
		t.Skip("the kernel gives no /proc/<pid>/task/<tid>/schedstat")
	}
	cpu := lastCPU(t)
	over := func(pid int) (bool, string) {
		s := startStarvation(pid, nil, nil)
		time.Sleep(400 * time.Millisecond)
		return s.starved()
	}
	spinner := startSpinner(t)
	pin(t, spinner.Process.Pid, cpu, false)
	// The highest weight, so that it has its CPU however busy the host:
	// a cgroup of its own at the top of the cpu hierarchy.
	heavy(t, spinner)
	if starved, why := over(spinner.Process.Pid); starved {
		t.Errorf("a spinning process counted as starved: %s", why)
	}

	starving := startSpinner(t)
	burners := burn(t, cpu, 3)
	syscall.Kill(spinner.Process.Pid, syscall.SIGSTOP) // three burners, not four
	pin(t, starving.Process.Pid, cpu, true)
	if starved, why := over(starving.Process.Pid); !starved {
		t.Errorf("an idle-class process behind three busy ones not counted as starved: %s", why)
	}
	// It needs its CPU to take the stop signal: the burners pause.
	for _, b := range burners {
		b.Process.Signal(syscall.SIGSTOP)
	}
	freeze(t, starving.Process.Pid)
	for _, b := range burners {
		b.Process.Signal(syscall.SIGCONT)
	}
	if starved, why := over(starving.Process.Pid); starved {
		t.Errorf("a frozen process counted as starved: %s", why)
	}
}

// heavy moves cmd's process into a cgroup v1 cpu group of its own at the
// top with the highest weight, so that it has its CPU however busy the
// host; it skips the test where that cannot be done.
func heavy(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	dir := fmt.Sprintf("/sys/fs/cgroup/cpu/sloserve-test-heavy-%d", cmd.Process.Pid)
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Skipf("a cpu cgroup of the highest weight: %v", err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		os.Remove(dir)
	})
	if err := os.WriteFile(filepath.Join(dir, "cpu.shares"), []byte("262144"), 0o644); err != nil {
		t.Skipf("a cpu cgroup of the highest weight: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
		t.Fatalf("moving %d into %s: %v", cmd.Process.Pid, dir, err)
	}
}

// lastCPU is the highest CPU the test may run on.
func lastCPU(t *testing.T) int {
	t.Helper()
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		t.Fatal(err)
	}
	last := -1
	for i := range 1024 {
		if set.IsSet(i) {
			last = i
		}
	}
	if set.Count() < 2 {
		t.Skip("needs 2 CPUs")
	}
	return last
}

// burn keeps n spinning processes busy on cpu until the test ends.
// Processes, not goroutines: busy goroutines would take the test's own
// Go processors from the runner's supervisor.
func burn(t *testing.T, cpu, n int) []*exec.Cmd {
	t.Helper()
	var cmds []*exec.Cmd
	for range n {
		cmd := startSpinner(t)
		pin(t, cmd.Process.Pid, cpu, false)
		cmds = append(cmds, cmd)
	}
	return cmds
}

// pin puts every thread of pid on cpu, and in the idle scheduling class
// (it runs only when nothing else on the CPU wants to) if idle; threads it
// starts later inherit both.
func pin(t *testing.T, pid, cpu int, idle bool) {
	t.Helper()
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*", pid))
	if err != nil || len(tasks) == 0 {
		t.Fatalf("threads of %d: %v", pid, err)
	}
	var set unix.CPUSet
	set.Set(cpu)
	for _, task := range tasks {
		tid, err := strconv.Atoi(filepath.Base(task))
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.SchedSetaffinity(tid, &set); err != nil && err != syscall.ESRCH {
			t.Fatalf("pin thread %d: %v", tid, err)
		}
		if !idle {
			continue
		}
		attr := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}
		if err := unix.SchedSetAttr(tid, &attr, 0); err != nil && err != syscall.ESRCH {
			t.Fatalf("idle class for thread %d: %v", tid, err)
		}
	}
}

// startSpinner starts a busy shell loop, killed when the test ends.
func startSpinner(t *testing.T) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sh", "-c", "while :; do :; done")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	return cmd
}

// A runner that starts in the idle class while busy processes hold every
// CPU gets none to load its model: its ready timeout stands still
// meanwhile, and it is ready once they stop, though that is several times
// the timeout after its start.
func TestRunnerStarvedAtStartIsNotTimedOut(t *testing.T) {
	if _, ok := cpuWait(os.Getpid()); !ok {
		t.Skip("the kernel gives no /proc/<pid>/task/<tid>/schedstat")
	}
	dir := fmt.Sprintf("/sys/fs/cgroup/cpu/sloserve-test-idle-%d", os.Getpid())
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Skipf("a cpu cgroup in the idle class: %v", err)
	}
	t.Cleanup(func() { os.Remove(dir) })
	if err := os.WriteFile(filepath.Join(dir, "cpu.idle"), []byte("1"), 0o644); err != nil {
		t.Skipf("a cpu cgroup in the idle class: %v", err)
	}
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		t.Fatal(err)
	}
	var burners []*exec.Cmd
	for cpu := range 1024 {
		if set.IsSet(cpu) {
			burners = append(burners, burn(t, cpu, 1)...)
		}
	}
	const timeout, starve = time.Second, 4 * time.Second
	time.AfterFunc(starve, func() {
		for _, b := range burners {
			b.Process.Kill()
		}
	})
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	cfg.ReadyTimeout = timeout
	cfg.JoinCgroups = []string{filepath.Join(dir, "cgroup.procs")}
	start := time.Now()
	r, err := StartRunner(t.Context(), cfg)
	took := time.Since(start)
	if err != nil {
		t.Fatalf("a runner starved at its start, after %v: %v", took.Round(time.Millisecond), err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	t.Logf("ready %v after its start (ready timeout %v, starved for about %v)", took.Round(time.Millisecond), timeout, starve)
	if took < 2*timeout {
		t.Errorf("ready after %v: it was not starved at its start (the burners ran %v)", took, starve)
	}
}

// Runner.Starved measures its window even when no thread of the process
// wants a CPU as it begins: a process that waits for a moment, then wants
// a CPU that busy processes keep from it, is starved over the window (a
// call on it waits for CPU, and must not be abandoned as hung). Before, one
// look at the window's start answered false at once. A frozen process is
// still told at once, not starved.
func TestStarvedLooksPastAMomentWithoutRunnableThread(t *testing.T) {
	if _, ok := cpuWait(os.Getpid()); !ok {
		t.Skip("the kernel gives no /proc/<pid>/task/<tid>/schedstat")
	}
	cpu := lastCPU(t)
	// The shell waits for sleep (no runnable thread), then spins.
	cmd := exec.Command("sh", "-c", "sleep 1; while :; do :; done")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	waitFor(t, 5*time.Second, "the shell to wait for sleep", func() bool { return !runnable(cmd.Process.Pid) })
	burners := burn(t, cpu, 3)
	pin(t, cmd.Process.Pid, cpu, true)
	r := &Runner{log: testLogger(t)}
	r.live.Store(&process{pid: cmd.Process.Pid, exited: make(chan struct{})})
	const window = 2500 * time.Millisecond
	if !r.Starved(window, nil) {
		t.Error("a process that waited a moment, then wanted a CPU it could not get, was not starved over the window")
	}
	// Frozen: no thread wants a CPU, and it is told at once.
	for _, b := range burners {
		b.Process.Signal(syscall.SIGSTOP)
	}
	freeze(t, cmd.Process.Pid)
	for _, b := range burners {
		b.Process.Signal(syscall.SIGCONT)
	}
	start := time.Now()
	if r.Starved(window, nil) {
		t.Error("a frozen process was starved")
	}
	if took := time.Since(start); took > window/2 {
		t.Errorf("a frozen process was told after %v, not at once (window %v)", took, window)
	}
}

// A process that spins under a CPU quota of half a CPU runs half the
// time and is throttled the other half. With a call in flight it is busy
// at its own quota's limit, not hung, though it ran more than a quarter
// of the check's time, which alone says "it had the CPU" (the ocr-rec
// runner killed while profiled at a 0.5-CPU quota in the predictor
// benchmark: "check took 1.947s, the runner ran 975ms and waited 4.031s
// for a CPU"). Without a call in flight it is a livelock and still found
// hung, and so it is with a call in flight but no quota (not throttled).
func TestStarvationCountsQuotaThrottling(t *testing.T) {
	if _, ok := cpuWait(os.Getpid()); !ok {
		t.Skip("the kernel gives no /proc/<pid>/task/<tid>/schedstat")
	}
	spinner := startSpinner(t)
	setQuota := quotaCgroup(t, spinner.Process.Pid)
	setQuota(5000, 10000) // half a CPU
	pid := spinner.Process.Pid
	over := func(busy bool) (starved bool, ranShare float64, why string) {
		r0, _, _ := cpuTimes(pid)
		s := startStarvation(pid, nil, func() bool { return busy })
		time.Sleep(400 * time.Millisecond)
		starved, why = s.starved()
		r1, _, _ := cpuTimes(pid)
		return starved, float64(r1-r0) / float64(time.Since(s.start)), why
	}
	starved, ran, why := over(true)
	if ran*starvedShare < 1 {
		t.Fatalf("the spinner ran %.2f of the window under a quota of half a CPU, under 1/%d: the host is too busy for the test (%s)", ran, starvedShare, why)
	}
	if !starved {
		t.Errorf("a process at its quota's limit with a call in flight counted as hung: %s", why)
	}
	if starved, _, why := over(false); starved {
		t.Errorf("a process spinning at its quota's limit with no call in flight (a livelock) counted as starved: %s", why)
	}
	setQuota(-1, 10000)
	if starved, _, why := over(true); starved {
		t.Errorf("a process spinning with no quota and a call in flight counted as starved: %s", why)
	}
}

// quotaCgroup moves process pid into a cpu cgroup of its own (see
// quotaCgroupDir) and returns the function that sets its quota.
func quotaCgroup(t *testing.T, pid int) func(quota, period int) {
	t.Helper()
	dir, set := quotaCgroupDir(t)
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) }) // runs before the removal
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
		t.Fatalf("moving %d into %s: %v", pid, dir, err)
	}
	return set
}

// quotaCgroupDir makes a cpu cgroup at the top of the hierarchy, of the
// highest weight (so that what is in it gets what its quota allows however
// busy the host), removed when the test ends, and returns it with a
// function that sets its CPU quota (-1: none) over a period, in
// microseconds; it skips the test where that cannot be done (not root, no
// cpu controller).
func quotaCgroupDir(t *testing.T) (string, func(quota, period int)) {
	t.Helper()
	v2 := false
	root := "/sys/fs/cgroup/cpu"
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		v2, root = true, "/sys/fs/cgroup"
	}
	dir, err := os.MkdirTemp(root, "sloserve-test-quota-")
	if err != nil {
		t.Skipf("a cpu cgroup with a quota: %v", err)
	}
	t.Cleanup(func() {
		waitFor(t, 10*time.Second, "the cgroup to empty", func() bool { return os.Remove(dir) == nil })
	})
	weight, value := "cpu.shares", "262144"
	if v2 {
		weight, value = "cpu.weight", "10000"
	}
	if err := os.WriteFile(filepath.Join(dir, weight), []byte(value), 0o644); err != nil {
		t.Skipf("a cpu cgroup with a quota: %v", err)
	}
	return dir, func(quota, period int) {
		t.Helper()
		var err error
		if v2 {
			q := "max"
			if quota > 0 {
				q = strconv.Itoa(quota)
			}
			err = os.WriteFile(filepath.Join(dir, "cpu.max"), []byte(q+" "+strconv.Itoa(period)), 0o644)
		} else {
			err = errors.Join(
				os.WriteFile(filepath.Join(dir, "cpu.cfs_quota_us"), []byte("-1"), 0o644),
				os.WriteFile(filepath.Join(dir, "cpu.cfs_period_us"), []byte(strconv.Itoa(period)), 0o644),
				os.WriteFile(filepath.Join(dir, "cpu.cfs_quota_us"), []byte(strconv.Itoa(quota)), 0o644))
		}
		if err != nil {
			t.Fatalf("quota %d/%d: %v", quota, period, err)
		}
	}
}

// The cpu cgroup of a process is found in the hierarchy mounted with the
// cpu controller (v1), else in the unified one (v2), relative to the
// mount's root.
func TestCPUCgroupDir(t *testing.T) {
	const hybrid = `30 22 0:27 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
31 30 0:28 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
32 30 0:29 / /sys/fs/cgroup/cpu\040acct rw,relatime - cgroup cgroup rw,cpuacct
40 30 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
`
	const v2 = `25 20 0:22 /kubepods/pod1 /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw
`
	const joint = `31 30 0:28 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
`
	const escaped = `31 30 0:28 / /mnt/cg\040cpu rw shared:5 - cgroup none rw,cpu
`
	for _, c := range []struct {
		name, mountinfo, path string
		want                  cgroupDir
		ok                    bool
	}{
		{"v1", hybrid, "1:cpu:/sloserve-1/u", cgroupDir{"/sys/fs/cgroup/cpu/sloserve-1/u", "/sys/fs/cgroup/cpu"}, true},
		{"v1 root", hybrid, "1:cpu:/", cgroupDir{"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu"}, true},
		{"v1 joint", joint, "3:cpuacct,cpu:/a", cgroupDir{"/sys/fs/cgroup/cpu,cpuacct/a", "/sys/fs/cgroup/cpu,cpuacct"}, true},
		{"escaped mount point", escaped, "1:cpu:/a", cgroupDir{"/mnt/cg cpu/a", "/mnt/cg cpu"}, true},
		{"cpuacct is not cpu", hybrid, "2:cpuacct:/a", cgroupDir{}, false},
		{"v2 under the mount's root", v2, "0::/kubepods/pod1/c", cgroupDir{"/sys/fs/cgroup/c", "/sys/fs/cgroup"}, true},
		{"v2 outside the mount's root", v2, "0::/kubepods/pod10/c", cgroupDir{}, false},
		{"outside the namespace", hybrid, "1:cpu:/../x", cgroupDir{}, false},
		{"v2 in a hybrid, no cpu line", hybrid, "0::/x", cgroupDir{"/sys/fs/cgroup/unified/x", "/sys/fs/cgroup/unified"}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, ok := cpuCgroupDirIn(parseCgroupMounts([]byte(c.mountinfo)), []byte(c.path+"\n"))
			if got != c.want || ok != c.ok {
				t.Errorf("got %+v, %v; want %+v, %v", got, ok, c.want, c.ok)
			}
		})
	}
	if got := parseCgroupMounts([]byte(hybrid)); len(got) != 2 || got[1].point != "/sys/fs/cgroup/unified" {
		t.Errorf("mounts of a hybrid host: %+v, want the cpu hierarchy and the unified one", got)
	}
}

// The hung rule on the measures of failed checks, most of them as logged
// by TestRunnerAtItsQuotaIsNotHung under two CPU burners, where three
// counted in a row killed the runner mid-call. A check during which the
// runner waited for a CPU at least as long as it ran is starved; so is
// one during which it slept with a call in flight while the server
// itself waited for a CPU all along (the call, and the check, were the
// server's to move). A runner that sleeps with no call in flight, or
// while the server could run, or frozen, or that ran more than it waited,
// is still counted.
func TestCheckMeasureStarved(t *testing.T) {
	ms := time.Millisecond
	for _, c := range []struct {
		name    string
		m       checkMeasure
		starved bool
	}{
		{"waited more than it ran, runnable, not throttled (logged)",
			checkMeasure{took: 7 * ms, ran: 15 * ms, waited: 43 * ms, runnable: true, busy: true, busyKnown: true}, true},
		{"waited more than it ran, not throttled (logged)",
			checkMeasure{took: 18 * ms, ran: 24 * ms, waited: 29 * ms, runnable: true, busy: true, busyKnown: true}, true},
		{"waited as long as it ran, no call in flight",
			checkMeasure{took: 40 * ms, ran: 20 * ms, waited: 20 * ms}, true},
		{"asleep with a call in flight, the server starved (logged)",
			checkMeasure{took: 110 * ms, ran: 2 * ms, busy: true, busyKnown: true, serverWaited: 366 * ms, serverWindow: 150 * ms, serverKnown: true}, true},
		{"ran little and waited for a quarter",
			checkMeasure{took: 40 * ms, ran: 5 * ms, waited: 10 * ms}, true},
		{"at its quota's limit with a call in flight",
			checkMeasure{took: 400 * ms, ran: 200 * ms, waited: 180 * ms, busy: true, busyKnown: true, throttled: 20}, true},

		{"ran more than it waited, not throttled (a livelock on a busy host)",
			checkMeasure{took: 8 * ms, ran: 5 * ms, waited: 4 * ms, runnable: true, busy: true, busyKnown: true}, false},
		{"spinning alone",
			checkMeasure{took: 40 * ms, ran: 40 * ms, runnable: true}, false},
		{"spinning at its quota's limit with no call in flight (a livelock; make test beside two burners)",
			checkMeasure{took: 402 * ms, ran: 205 * ms, waited: 205 * ms, runnable: true, busyKnown: true, throttled: 35}, false},
		{"waited longer than it ran but under a quarter of the check",
			checkMeasure{took: 100 * ms, ran: 5 * ms, waited: 6 * ms}, false},
		{"asleep with a call in flight, the server could run (deadlocked)",
			checkMeasure{took: 110 * ms, busy: true, busyKnown: true, serverWaited: 20 * ms, serverWindow: 150 * ms, serverKnown: true}, false},
		{"asleep with no call in flight, the server starved",
			checkMeasure{took: 110 * ms, busy: false, busyKnown: true, serverWaited: 366 * ms, serverWindow: 150 * ms, serverKnown: true}, false},
		{"frozen with a call in flight, the server starved",
			checkMeasure{took: 110 * ms, stopped: true, busy: true, busyKnown: true, serverWaited: 366 * ms, serverWindow: 150 * ms, serverKnown: true}, false},
		{"asleep with a call in flight, the server's wait unknown",
			checkMeasure{took: 110 * ms, busy: true, busyKnown: true}, false},
	} {
		if got := c.m.starved(); got != c.starved {
			t.Errorf("%s: %+v: starved %v, want %v", c.name, c.m, got, c.starved)
		}
	}
}

// A check that fails after the quiet time is measured, even when this
// server, late on a busy host, finds its end and the quiet timer ready
// together and takes the end first (select picks either): before, about
// half such checks were counted as failed at once, unmeasured, and
// counted against the runner (twice in five runs under two burners). A
// check that fails within the quiet time is still judged at once.
func TestCheckFailingLateIsMeasured(t *testing.T) {
	if _, ok := cpuWait(os.Getpid()); !ok {
		t.Skip("the kernel gives no /proc/<pid>/task/<tid>/schedstat")
	}
	synctest.Test(t, func(t *testing.T) {
		r := &Runner{ctx: t.Context()}
		p := &process{pid: os.Getpid(), exited: make(chan struct{})}
		const timeout = 200 * time.Millisecond
		quietFor := min(checkQuiet, timeout/starvedShare)
		timedOut := func() error { time.Sleep(quietFor); return context.DeadlineExceeded }
		lateServer := func() { time.Sleep(2 * quietFor) }
		atOnce := 0
		for range 40 {
			_, waits, err := r.checkWith(p, timeout, timedOut, lateServer)
			if err == nil {
				t.Fatal("the check passed, want it failed")
			}
			if strings.Contains(waits, "failed at once") {
				atOnce++
			}
		}
		if atOnce > 0 {
			t.Errorf("%d of 40 checks that failed after the quiet time were judged failed at once, unmeasured", atOnce)
		}
		refused := errors.New("connection refused")
		_, waits, err := r.checkWith(p, timeout, func() error { return refused }, nil)
		if err != refused || !strings.Contains(waits, "failed at once") {
			t.Errorf("a check refused at once: %v, %q; want it judged at once", err, waits)
		}
	})
}
