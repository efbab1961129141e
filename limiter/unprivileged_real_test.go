package limiter

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sloserve/sloserve/runtime"
)

// The tests in this file start real runner processes as the current user
// in process units of the unprivileged backend, and read what the kernel
// holds for them from /proc.

// realUnprivileged is an unprivileged limiter whose units live in the
// test's temporary directory, closed when the test ends, on the server's
// CPUs or, with one, on its last CPU alone.
func realUnprivileged(t *testing.T, one bool) *unprivLimiter {
	t.Helper()
	cpus, err := serverCPUs()
	if err != nil {
		t.Fatal(err)
	}
	if one {
		cpus = cpus[len(cpus)-1:]
	}
	l, err := newUnprivileged(filepath.Join(t.TempDir(), "units"), cpus, "test", testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := l.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if exists(l.dir) {
			t.Errorf("%s still exists after Close", l.dir)
		}
	})
	return l
}

// startUnitRunner starts the test binary as a runner of the detector in
// pl's process unit, with intra-op threads as the placement says.
func startUnitRunner(t *testing.T, pl Placement, threads int) *runtime.Runner {
	t.Helper()
	r, err := runtime.StartRunner(t.Context(), runtime.RunnerConfig{
		Name:         "limiter-test/ocr-det",
		ModelPath:    detector(t),
		Library:      ortLibrary(t),
		Executable:   os.Args[0],
		Env:          []string{childEnv + "=runner", "GORACE=atexit_sleep_ms=0"},
		SocketDir:    t.TempDir(),
		Provider:     runtime.ProviderOptions{IntraOpThreads: threads, InterOpThreads: 1},
		ProcessUnit:  pl.ProcessUnit,
		Calls:        8,
		MaxRestarts:  -1,
		ReadyTimeout: 30 * time.Second,
		Logger:       testLogger(t),
	})
	if err != nil {
		t.Fatalf("StartRunner: %v", err)
	}
	t.Cleanup(func() { stopRunner(t, r) })
	return r
}

// threadState is what the kernel holds for each thread of a process:
// scheduling policy (from sched_getattr) and allowed CPUs (from
// /proc/<pid>/task/<tid>/status).
func threadState(t *testing.T, pid int) (policies map[int]uint32, cpus map[int]string) {
	t.Helper()
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatal(err)
	}
	policies, cpus = map[int]uint32{}, map[int]string{}
	for _, e := range entries {
		tid, _ := strconv.Atoi(e.Name())
		attr, err := unix.SchedGetAttr(tid, 0)
		if err != nil {
			continue // ended
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/status", pid, tid))
		if err != nil {
			continue
		}
		for line := range strings.Lines(string(b)) {
			if v, ok := strings.CutPrefix(line, "Cpus_allowed_list:"); ok {
				cpus[tid] = strings.TrimSpace(v)
			}
		}
		policies[tid] = attr.Policy
	}
	return policies, cpus
}

// checkThreads checks every thread of pid runs in the policy on cpus.
func checkThreads(t *testing.T, pid int, policy uint32, cpus string) {
	t.Helper()
	policies, allowed := threadState(t, pid)
	if len(policies) < 3 {
		t.Errorf("process %d has %d threads, want a runner's several", pid, len(policies))
	}
	for tid, p := range policies {
		if p != policy || allowed[tid] != cpus {
			t.Errorf("thread %d of %d: policy %d on CPUs %q, want policy %d on %q", tid, pid, p, allowed[tid], policy, cpus)
		}
	}
}

// dataLimit reads the soft "Max data size" of /proc/<pid>/limits.
func dataLimit(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "Max data size"); ok {
			return strings.Fields(rest)[0]
		}
	}
	t.Fatal("no Max data size line")
	return ""
}

// A background runner's threads, those ONNX Runtime made after the start
// too, are in SCHED_IDLE on the CPUs of its cap, under its data limit; a
// resize moves them, and the readings come from /proc.
func TestUnprivilegedRunner(t *testing.T) {
	l := realUnprivileged(t, false)
	if len(l.allowed) < 2 {
		t.Skipf("%d CPU(s): a cap cannot be narrower than the device", len(l.allowed))
	}
	n := len(l.allowed)
	last := strconv.Itoa(l.allowed[n-1])
	all := cpuList(l.allowed)
	// A race-instrumented runner (this binary) maps gigabytes of data for
	// ThreadSanitizer: there the memory share is large enough for it.
	mem := int64(200 << 20)
	if raceEnabled {
		mem = 8 << 30
	}
	id := "unpriv-runner"
	s := Share{Compute: 0.9 / float64(n), Memory: mem, Mode: ModeBackground}
	pl, err := l.Place(id, s)
	if err != nil {
		t.Fatal(err)
	}
	if pl.ProcessUnit == "" || pl.IntraOpThreads != 1 || pl.JoinCgroups != nil {
		t.Fatalf("placement %+v: want a process unit and 1 intra-op thread", pl)
	}
	// Two intra-op threads: ONNX Runtime's pool thread is made after the
	// runner applied its limits, and must have inherited them.
	r := startUnitRunner(t, pl, 2)
	req := detectorRequest()
	timeCall(t, r, req)
	pid := r.Pid()
	checkThreads(t, pid, unix.SCHED_IDLE, last)
	if got, want := dataLimit(t, pid), strconv.FormatInt(mem+DataReserve, 10); got != want {
		t.Errorf("data limit %s, want %s", got, want)
	}
	status, err := readStatus(pid)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("runner after a call: VmData %d MiB, VmRSS %d MiB, VmHWM %d MiB, VmSize %d MiB",
		status["VmData"]>>20, status["VmRSS"]>>20, status["VmHWM"]>>20, status["VmSize"]>>20)

	// Wider, more memory: live.
	if err := l.Resize(id, Share{Compute: 1, Memory: 2 * mem, Mode: ModeBackground}); err != nil {
		t.Fatal(err)
	}
	checkThreads(t, pid, unix.SCHED_IDLE, all)
	if got, want := dataLimit(t, pid), strconv.FormatInt(2*mem+DataReserve, 10); got != want {
		t.Errorf("data limit after the resize %s, want %s", got, want)
	}
	// Out of the background: root may take threads out of the idle
	// class; an unprivileged server may not (ErrRestartRequired, tested
	// with the kernel's answer in TestUnprivilegedLeaveIdle).
	if os.Getuid() == 0 {
		if err := l.Resize(id, Share{Compute: 0.9 / float64(n), Mode: ModeCap}); err != nil {
			t.Fatal(err)
		}
		checkThreads(t, pid, unix.SCHED_NORMAL, last)
		if got := dataLimit(t, pid); got != "unlimited" {
			t.Errorf("data limit with no memory share %s, want unlimited", got)
		}
	}
	for range 3 {
		timeCall(t, r, req)
	}
	st, err := l.Stats(id)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("stats: %+v", st)
	if st.CPUSeconds <= 0 || st.MemoryBytes < 10<<20 || st.MemoryPeak < st.MemoryBytes || st.OOMKills != 0 {
		t.Errorf("stats %+v: want CPU time, resident memory under its peak, no OOM", st)
	}
	stopRunner(t, r)
	// The process has ended: its CPU time is kept.
	after, err := l.Stats(id)
	if err != nil {
		t.Fatal(err)
	}
	if after.CPUSeconds < st.CPUSeconds || after.MemoryBytes != 0 {
		t.Errorf("stats after the runner stopped %+v, want CPU time at least %.3f s and no memory", after, st.CPUSeconds)
	}
	if err := l.Release(id); err != nil {
		t.Fatal(err)
	}
	if exists(pl.ProcessUnit) {
		t.Errorf("%s still exists after Release", pl.ProcessUnit)
	}
}

// A background unit yields the CPU to a floor: with both runners kept
// busy by more calls than there are CPUs, the floor's runner gets nearly
// all of the CPU time; both at normal priority split it about evenly.
// The limiter has one CPU, so that the runners compete for it with each
// other more than with the machine's other work (a floor in this backend
// is normal priority, no more: a busy machine's other threads take their
// part of its CPU, and the background runner fills every gap they leave).
func TestUnprivilegedBackgroundYieldsToFloor(t *testing.T) {
	l := realUnprivileged(t, true)
	req := detectorRequest()
	busy := func(ids [2]string, runners [2]*runtime.Runner, d time.Duration) [2]float64 {
		var before, after [2]float64
		for i, id := range ids {
			st, err := l.Stats(id)
			if err != nil {
				t.Fatal(err)
			}
			before[i] = st.CPUSeconds
		}
		ctx, cancel := context.WithTimeout(t.Context(), d)
		defer cancel()
		var wg sync.WaitGroup
		for _, r := range runners {
			for range 4 * l.CPUs() { // more calls than CPUs: each runner always has work
				wg.Go(func() {
					for ctx.Err() == nil {
						_, _ = r.Infer(ctx, req)
					}
				})
			}
		}
		wg.Wait()
		for i, id := range ids {
			st, err := l.Stats(id)
			if err != nil {
				t.Fatal(err)
			}
			after[i] = st.CPUSeconds - before[i]
		}
		return after
	}
	ids := [2]string{"yield-floor", "yield-background"}
	var runners [2]*runtime.Runner
	for i, s := range []Share{{Compute: 0.25, Mode: ModeFloor}, {Mode: ModeBackground}} {
		pl, err := l.Place(ids[i], s)
		if err != nil {
			t.Fatal(err)
		}
		runners[i] = startUnitRunner(t, pl, 1)
		timeCall(t, runners[i], req)
	}
	busy(ids, runners, time.Second)
	// CPU time reads in ticks of 10 ms: on a machine busy with other work
	// the windows add up until the floor's runner has half a CPU second
	// (at most four); the background runner is counted a tick more.
	var prio [2]float64
	windows := 0
	for ; windows < 4 && prio[0] < 0.5; windows++ {
		p := busy(ids, runners, 3*time.Second)
		prio[0], prio[1] = prio[0]+p[0], prio[1]+p[1]
	}
	t.Logf("CPU seconds in %d x 3 s, floor vs background: %.2f vs %.2f (%.1fx)", windows, prio[0], prio[1], prio[0]/max(prio[1], 1e-3))
	// The background runner takes the floor's idle moments (SCHED_IDLE is
	// work-conserving). Under -race this test's own calling loop is slow
	// enough to leave the floor's runner idle about half the time (1.61
	// CPU s in 3 s, 4.4x, seen in make test), so the bound there is 3x;
	// the 5x aim is the real binary's (TestE2EUnprivilegedYield).
	want := 5.0
	if raceEnabled {
		want = 3
	}
	if prio[0] < 0.5 || prio[0] < want*(prio[1]+0.01) {
		t.Errorf("the floor's runner used %.2f CPU s and the background one %.2f; want at least %.0f times as much, and half a second", prio[0], prio[1], want)
	}
	if os.Getuid() != 0 {
		return // the background runner cannot leave the idle class
	}
	for _, id := range ids {
		if err := l.Resize(id, Share{}); err != nil {
			t.Fatal(err)
		}
	}
	even := busy(ids, runners, 3*time.Second)
	t.Logf("at normal priority both: %.2f vs %.2f", even[0], even[1])
	if even[1] < even[0]/2 {
		t.Errorf("at normal priority the runners used %.2f and %.2f CPU s; want about even (the test's load is not what it assumes)", even[0], even[1])
	}
}

// leaveIdleChild is the helper mode of TestUnprivilegedLeaveIdle: as an
// unprivileged user, it enters the idle class and asks to leave it.
const leaveIdleChild = "leave-idle"

func runLeaveIdleChild() int {
	pid := os.Getpid()
	if err := runtime.ApplyProcessLimits(pid, runtime.ProcessLimits{Idle: true}); err != nil {
		fmt.Println("enter:", err)
		return 2
	}
	err := runtime.ApplyProcessLimits(pid, runtime.ProcessLimits{})
	fmt.Println("leave:", err, errors.Is(err, runtime.ErrLeaveIdle))
	return 0
}

// The kernel keeps an unprivileged thread in the idle class: the test
// binary, run as nobody (uid 65534) through setpriv, enters SCHED_IDLE
// and is refused its way out with ErrLeaveIdle, which Resize turns into
// ErrRestartRequired.
func TestUnprivilegedLeaveIdle(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to run a child as another user")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Skipf("no setpriv: %v", err)
	}
	bin := nobodyCopy(t, os.Args[0])
	cmd := exec.Command(setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", bin)
	cmd.Env = append(os.Environ(), childEnv+"="+leaveIdleChild, "GORACE=atexit_sleep_ms=0")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if got := strings.TrimSpace(string(out)); !strings.HasPrefix(got, "leave: ") || !strings.HasSuffix(got, " true") {
		t.Errorf("child said %q, want the way out refused with ErrLeaveIdle", got)
	}
}

// nobodyCopy copies a file into a directory any user can read and enter,
// executable by all.
func nobodyCopy(t *testing.T, file string) string {
	t.Helper()
	dir := t.TempDir()
	for d := dir; d != "/"; d = filepath.Dir(d) {
		st, err := os.Stat(d)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm()&0o005 != 0o005 {
			if err := os.Chmod(d, st.Mode().Perm()|0o005); err != nil {
				t.Fatal(err)
			}
		}
	}
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, filepath.Base(file))
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return dst
}

// detectorRequestOf is one image of size x size.
func detectorRequestOf(size int) *runtime.InferRequest {
	data := make([]byte, 4*3*size*size)
	for i := 0; i < len(data); i += 4 {
		binary.LittleEndian.PutUint32(data[i:], math.Float32bits(float32(i%255)/255))
	}
	return &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 3, int64(size), int64(size)}, Data: data}}}
}

// An allocation that fails under the data limit ends the runner as the
// kernel's OOM killer ends one in a cgroup: the call in flight fails with
// ErrOutOfMemory, the runner's exit says out of memory, and Stats counts
// it. The same runner answered a small image first: it is the large
// image's memory that the limit refuses.
//
// Any allocation may be the one refused: where it is a new thread's stack
// rather than ONNX Runtime's arena or Go's heap, the runner aborts
// (runtime/cgo: pthread_create failed) and its exit is a crash, not an
// out-of-memory end (about once in 20 runs on a busy machine before the
// runner kept spare threads; none in 24 since). Such a run is tried again
// once, in a new unit.
func TestUnprivilegedOutOfMemory(t *testing.T) {
	if raceEnabled {
		t.Skip("a data limit a runner keeps to is too small for a race-instrumented one")
	}
	l := realUnprivileged(t, false)
	for attempt := 1; ; attempt++ {
		aborted := outOfMemoryRun(t, l, fmt.Sprintf("oom-%d", attempt))
		if !aborted || t.Failed() {
			return
		}
		if attempt == 2 {
			t.Fatal("the runner aborted in two runs out of two instead of ending as out of memory")
		}
		t.Log("the runner aborted (a refused allocation outside the arena); trying again")
	}
}

// outOfMemoryRun is one run of TestUnprivilegedOutOfMemory in unit id; it
// reports whether the runner aborted instead of ending as out of memory.
func outOfMemoryRun(t *testing.T, l *unprivLimiter, id string) (aborted bool) {
	const mem = 16 << 20
	pl, err := l.Place(id, Share{Memory: mem})
	if err != nil {
		t.Fatal(err)
	}
	exits := make(chan runtime.Exit, 1)
	r, err := runtime.StartRunner(t.Context(), runtime.RunnerConfig{
		Name:        "limiter-test/oom",
		ModelPath:   detector(t),
		Library:     ortLibrary(t),
		Executable:  os.Args[0],
		Env:         []string{childEnv + "=runner", "GORACE=atexit_sleep_ms=0"},
		SocketDir:   t.TempDir(),
		Provider:    runtime.ProviderOptions{IntraOpThreads: 1, InterOpThreads: 1},
		ProcessUnit: pl.ProcessUnit,
		MaxRestarts: -1,
		OnExit:      func(e runtime.Exit) { exits <- e },
		MemoryEvents: func() (uint64, int64, error) {
			st, err := l.Stats(id)
			return st.OOMKills, st.MemoryLimit, err
		},
		ReadyTimeout: 30 * time.Second,
		Logger:       testLogger(t),
	})
	if err != nil {
		t.Fatalf("StartRunner under a %d MiB share: %v", mem>>20, err)
	}
	defer stopRunner(t, r)
	pid := r.Pid()
	status, _ := readStatus(pid)
	t.Logf("runner at rest: VmData %d MiB (limit %d MiB), VmRSS %d MiB", status["VmData"]>>20, (mem+DataReserve)>>20, status["VmRSS"]>>20)
	if _, err := r.Infer(t.Context(), detectorRequestOf(160)); err != nil {
		t.Fatalf("a small image under the limit: %v", err)
	}
	_, err = r.Infer(t.Context(), detectorRequestOf(1600))
	var e runtime.Exit
	select {
	case e = <-exits:
	case <-time.After(10 * time.Second):
		t.Fatalf("no exit reported; the call: %v", err)
	}
	crash, _ := os.ReadFile(filepath.Join(pl.ProcessUnit, runtime.UnitCrashFile))
	if !e.OOM && bytes.Contains(crash, []byte("SIGABRT")) {
		return true // Go reports the abort: exit status 2
	}
	if !e.OOM || !strings.Contains(e.Cause, "out of memory") {
		t.Errorf("exit %+v, want out of memory", e)
	}
	// The call learns of the out-of-memory end when the process has been
	// reaped within the runtime's wait for it (half a second), as with a
	// kernel OOM kill in a cgroup; on a busy machine the dying process may
	// take longer, and the call fails as the runner being unavailable.
	switch {
	case errors.Is(err, runtime.ErrOutOfMemory):
	case errors.Is(err, runtime.ErrUnavailable):
		t.Logf("the call failed before the runner was reaped: %v", err)
	default:
		t.Errorf("a 1600x1600 image under a %d MiB data limit: %v, want ErrOutOfMemory", (mem+DataReserve)>>20, err)
	}
	st, err := l.Stats(id)
	if err != nil {
		t.Fatal(err)
	}
	oom, _ := os.ReadFile(filepath.Join(pl.ProcessUnit, runtime.UnitOOMFile))
	t.Logf("stats %+v; oom file %q; crash file %d bytes", st, oom, len(crash))
	if st.OOMKills != 1 || st.MemoryLimit != mem {
		t.Errorf("stats %+v, want 1 OOM kill and the %d byte limit", st, mem)
	}
	return false
}
