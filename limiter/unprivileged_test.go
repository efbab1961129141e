package limiter

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

// applied is one call of a fake apply.
type applied struct {
	pid    int
	limits string
}

// fakeUnprivileged is an unprivileged limiter on four CPUs whose units
// live in the test's temporary directory and whose live resizes are
// recorded (and answered err) instead of made.
func fakeUnprivileged(t *testing.T, err *error) (*unprivLimiter, *[]applied) {
	t.Helper()
	l, e := newUnprivileged(filepath.Join(t.TempDir(), "units"), []int{0, 1, 2, 3}, "no cgroup here", testLogger(t))
	if e != nil {
		t.Fatal(e)
	}
	var calls []applied
	// This test's own process stands in for a runner.
	l.member = func(pid int, dir string) bool { return processAlive(pid) }
	l.apply = func(pid int, pl runtime.ProcessLimits) error {
		calls = append(calls, applied{pid, pl.String()})
		return *err
	}
	return l, &calls
}

func TestUnprivilegedPlacements(t *testing.T) {
	var applyErr error
	l, _ := fakeUnprivileged(t, &applyErr)
	defer l.Close()
	if l.Kind() != KindUnprivileged || l.CPUs() != 4 {
		t.Errorf("kind %s, %d CPUs; want unprivileged on 4", l.Kind(), l.CPUs())
	}
	for _, want := range []string{"no cgroup here", "SCHED_IDLE", "CPU affinity in whole CPUs of 4 (0-3)", "RLIMIT_DATA"} {
		if !strings.Contains(l.Describe(), want) {
			t.Errorf("Describe() = %q, want it to say %q", l.Describe(), want)
		}
	}
	for _, tc := range []struct {
		id      string
		share   Share
		threads int
		limits  string
	}{
		// Caps take the CPUs the others claim least of, the last first.
		{"bg-quarter", Share{Compute: 0.2, Mode: ModeBackground}, 1, "idle=1 cpus=3 data=0"},
		{"cap-half", Share{Compute: 0.5, Memory: 100 << 20}, 2, fmt.Sprintf("idle=0 cpus=1,2 data=%d", 100<<20+DataReserve)},
		{"cap-one", Share{Compute: 0.25}, 1, "idle=0 cpus=0"},
		// Claims: 0 has 1 CPU, 1 and 2 one each, 3 0.8: 3 is least.
		{"bg-again", Share{Compute: 0.1, Mode: ModeBackground}, 1, "idle=1 cpus=3"},
		{"floor", Share{Compute: 0.3, Mode: ModeFloor}, 4, "idle=0 cpus=0-3"},
		{"background-unlimited", Share{Mode: ModeBackground, Memory: 1 << 30}, 4, fmt.Sprintf("idle=1 cpus=0,1,2,3 data=%d", 1<<30+DataReserve)},
	} {
		t.Run(tc.id, func(t *testing.T) {
			pl, err := l.Place(tc.id, tc.share)
			if err != nil {
				t.Fatal(err)
			}
			if pl.IntraOpThreads != tc.threads || pl.JoinCgroups != nil || pl.Env != nil || filepath.Dir(pl.ProcessUnit) != l.dir {
				t.Errorf("placement %+v, want %d threads and a process unit under %s", pl, tc.threads, l.dir)
			}
			got, err := runtime.ReadProcessLimits(pl.ProcessUnit)
			if err != nil {
				t.Fatal(err)
			}
			want := strings.Replace(tc.limits, "cpus=0-3", "cpus=0,1,2,3", 1)
			if !strings.Contains(want, "data=") {
				want += " data=0"
			}
			if got.String() != want {
				t.Errorf("limits %q, want %q", got.String(), want)
			}
			if b, err := os.ReadFile(filepath.Join(pl.ProcessUnit, runtime.UnitProcsFile)); err != nil || len(b) != 0 {
				t.Errorf("procs file: %q, %v; want it empty", b, err)
			}
		})
	}
	if _, err := l.Place("floor", Share{}); err == nil {
		t.Error("placing an id twice did not fail")
	}
	if _, err := l.Place("bad", Share{Compute: -1}); err == nil {
		t.Error("a negative share was placed")
	}
	if err := l.Resize("nobody", Share{}); !errors.Is(err, ErrUnknownInstance) {
		t.Errorf("Resize of an unknown id: %v", err)
	}
	if _, err := l.Stats("nobody"); !errors.Is(err, ErrUnknownInstance) {
		t.Errorf("Stats of an unknown id: %v", err)
	}
}

// deadPid is a pid that was just used and is free again.
func deadPid(t *testing.T) int {
	t.Helper()
	c := exec.Command("true")
	if err := c.Run(); err != nil {
		t.Fatal(err)
	}
	if processAlive(c.Process.Pid) {
		t.Skipf("pid %d was reused at once", c.Process.Pid)
	}
	return c.Process.Pid
}

func addPid(t *testing.T, dir string, pid int) {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(dir, runtime.UnitProcsFile), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(f, "%d\n", pid)
	f.Close()
}

// Resize rewrites the unit's limits and applies them to its live
// processes only; leaving the background is ErrRestartRequired when the
// kernel refuses it, and the unit keeps its limits.
func TestUnprivilegedResize(t *testing.T) {
	var applyErr error
	l, calls := fakeUnprivileged(t, &applyErr)
	defer l.Close()
	pl, err := l.Place("u", Share{Compute: 0.25, Mode: ModeBackground})
	if err != nil {
		t.Fatal(err)
	}
	// No process yet: the limits file alone changes.
	if err := l.Resize("u", Share{Compute: 0.5, Mode: ModeBackground}); err != nil {
		t.Fatal(err)
	}
	if len(*calls) != 0 {
		t.Errorf("applied %v with no process in the unit", *calls)
	}
	addPid(t, pl.ProcessUnit, deadPid(t))
	addPid(t, pl.ProcessUnit, os.Getpid())
	if err := l.Resize("u", Share{Compute: 0.75, Memory: 64 << 20, Mode: ModeBackground}); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("idle=1 cpus=1,2,3 data=%d", 64<<20+DataReserve)
	if len(*calls) != 1 || (*calls)[0] != (applied{os.Getpid(), want}) {
		t.Errorf("applied %v, want %q to the live process %d alone", *calls, want, os.Getpid())
	}

	applyErr = fmt.Errorf("process %d thread 9: %w: %w", os.Getpid(), runtime.ErrLeaveIdle, syscall.EPERM)
	err = l.Resize("u", Share{Compute: 0.3, Mode: ModeFloor})
	if !errors.Is(err, ErrRestartRequired) {
		t.Errorf("leaving the idle class: %v, want ErrRestartRequired", err)
	}
	if got, _ := runtime.ReadProcessLimits(pl.ProcessUnit); got.String() != want {
		t.Errorf("limits after the refused resize %q, want the old %q", got.String(), want)
	}
	applyErr = syscall.EINVAL
	if err := l.Resize("u", Share{Compute: 0.5, Mode: ModeBackground}); err == nil || errors.Is(err, ErrRestartRequired) {
		t.Errorf("a failed apply: %v, want an error that is not ErrRestartRequired", err)
	}
}

// Stats reads the unit's processes from /proc: this test's own process
// stands in for a runner.
func TestUnprivilegedStats(t *testing.T) {
	var applyErr error
	l, _ := fakeUnprivileged(t, &applyErr)
	pl, err := l.Place("s", Share{Memory: 300 << 20})
	if err != nil {
		t.Fatal(err)
	}
	st, err := l.Stats("s")
	if err != nil || st != (Stats{MemoryLimit: 300 << 20}) {
		t.Errorf("stats of an empty unit %+v, %v", st, err)
	}
	addPid(t, pl.ProcessUnit, deadPid(t))
	addPid(t, pl.ProcessUnit, os.Getpid())
	for range 1_000_000 {
		_ = strconv.Itoa(7) // some CPU time
	}
	mustWrite(t, filepath.Join(pl.ProcessUnit, runtime.UnitOOMFile), "12 bad allocation\n13 bad allocation\n")
	mustWrite(t, filepath.Join(pl.ProcessUnit, runtime.UnitCrashFile), "fatal error: runtime: out of memory\n\ngoroutine 1 ...\n"+
		"fatal error: out of memory\n\ngoroutine 1 ...\npanic: other\nfatal error: concurrent map writes\n")
	st, err = l.Stats("s")
	if err != nil {
		t.Fatal(err)
	}
	own, _ := processCPU(os.Getpid())
	status, _ := readStatus(os.Getpid())
	if st.CPUSeconds <= 0 || st.CPUSeconds > own+0.01 || st.MemoryBytes <= 0 || st.MemoryPeak < st.MemoryBytes ||
		st.MemoryBytes > 2*status["VmRSS"] || st.OOMKills != 4 || st.MemoryLimit != 300<<20 || st.ThrottledSeconds != 0 {
		t.Errorf("stats %+v; want this process's CPU time (%.2f s) and memory (%d), 4 OOMs, the 300 MiB limit", st, own, status["VmRSS"])
	}
	if err := l.Release("s"); err != nil {
		t.Fatal(err)
	}
	if exists(pl.ProcessUnit) {
		t.Error("the unit is still there after Release")
	}
	if err := l.Release("s"); !errors.Is(err, ErrUnknownInstance) {
		t.Errorf("second Release: %v", err)
	}
	if _, err := l.Place("left", Share{}); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if exists(l.dir) || exists(filepath.Dir(l.dir)) {
		t.Errorf("%s or its base still there after Close", l.dir)
	}
	if _, err := l.Place("late", Share{}); err == nil {
		t.Error("placed after Close")
	}
}

// A new limiter removes the units of servers that are gone and keeps
// those of live ones; it refuses a base someone else may write.
func TestUnprivilegedBase(t *testing.T) {
	base := filepath.Join(t.TempDir(), "units")
	dead := filepath.Join(base, parentName(deadPid(t)))
	live := filepath.Join(base, parentName(1))
	for _, d := range []string{filepath.Join(dead, "u"), live, filepath.Join(base, "other")} {
		mustMkdir(t, d)
	}
	if err := os.Chmod(base, 0o700); err != nil {
		t.Fatal(err)
	}
	l, err := newUnprivileged(base, []int{0}, "test", testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	if exists(dead) || !exists(live) || !exists(filepath.Join(base, "other")) {
		t.Errorf("after start: stale %v (want gone), live %v, other %v (want kept)", exists(dead), exists(live), exists(filepath.Join(base, "other")))
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if !exists(base) {
		t.Error("Close removed a base that holds another server's units")
	}
	if err := os.Chmod(base, 0o777); err != nil {
		t.Fatal(err)
	}
	if _, err := newUnprivileged(base, []int{0}, "test", testLogger(t)); err == nil || !strings.Contains(err.Error(), "writable only by it") {
		t.Errorf("a base others may write: %v", err)
	}
	if _, err := newUnprivileged(t.TempDir(), nil, "test", testLogger(t)); err == nil {
		t.Error("no CPUs: no error")
	}
}

// A pid is a unit's only while its command line names the unit: a pid
// reused by another process is neither resized nor counted.
func TestUnitMember(t *testing.T) {
	dir := t.TempDir()
	if unitMember(os.Getpid(), dir) {
		t.Error("this test's process counts as a member of a unit it does not name")
	}
	if unitMember(deadPid(t), dir) {
		t.Error("a dead pid is a member")
	}
	self, err := exec.LookPath("sh")
	if err != nil {
		t.Skip(err)
	}
	// A second command keeps the shell from exec'ing sleep in its place.
	named := exec.Command(self, "-c", "sleep 60; true", "--process-unit", dir)
	if err := named.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { named.Process.Kill(); named.Wait() }()
	// Start returns once the child is forked; its command line is the
	// shell's only after the exec, which a busy machine may delay.
	for deadline := time.Now().Add(30 * time.Second); !unitMember(named.Process.Pid, dir) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if !unitMember(named.Process.Pid, dir) || unitMember(named.Process.Pid, dir+"x") {
		t.Errorf("a process whose command line names the unit: member %v, of another unit %v; want true, false",
			unitMember(named.Process.Pid, dir), unitMember(named.Process.Pid, dir+"x"))
	}
}

func TestCPUList(t *testing.T) {
	for in, want := range map[string]string{"": "", "0": "0", "0,1,2,3": "0-3", "0,2,3,4,7": "0,2-4,7"} {
		var cpus []int
		for c := range strings.SplitSeq(in, ",") {
			if n, err := strconv.Atoi(c); err == nil {
				cpus = append(cpus, n)
			}
		}
		if got := cpuList(cpus); got != want {
			t.Errorf("cpuList(%v) = %q, want %q", cpus, got, want)
		}
	}
}

// CleanupStale (sloserve cleanup) removes the process units of servers
// that are gone.
func TestCleanupStaleUnits(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	base := unitsBase()
	if filepath.Dir(base) != tmp {
		t.Fatalf("units base %s is not in TMPDIR %s", base, tmp)
	}
	dead := filepath.Join(base, parentName(deadPid(t)))
	mustMkdir(t, filepath.Join(dead, "u"))
	n, err := CleanupStale(t.TempDir(), testLogger(t)) // a root with no cgroup hierarchy
	if err != nil {
		t.Fatal(err)
	}
	if n != 1 || exists(dead) {
		t.Errorf("removed %d, %s still there: %v; want it removed", n, dead, exists(dead))
	}
}

// A stopping runner's cap is lifted: its affinity widens to every allowed
// CPU; its class and memory limit stay (an unprivileged thread cannot
// leave SCHED_IDLE). An uncapped unit is left alone.
func TestUnprivilegedLiftCompute(t *testing.T) {
	var applyErr error
	l, calls := fakeUnprivileged(t, &applyErr)
	defer l.Close()
	pl, err := l.Place("be", Share{Compute: 0.05, Memory: 64 << 20, Mode: ModeBackground})
	if err != nil {
		t.Fatal(err)
	}
	addPid(t, pl.ProcessUnit, os.Getpid())
	if got, _ := runtime.ReadProcessLimits(pl.ProcessUnit); len(got.CPUs) != 1 {
		t.Fatalf("a 0.05 cap runs on %v, want one CPU", got.CPUs)
	}
	if err := l.LiftCompute("be"); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("idle=1 cpus=0,1,2,3 data=%d", 64<<20+DataReserve)
	if got, _ := runtime.ReadProcessLimits(pl.ProcessUnit); got.String() != want {
		t.Errorf("limits after the lift %q, want %q", got.String(), want)
	}
	if len(*calls) != 1 || (*calls)[0] != (applied{os.Getpid(), want}) {
		t.Errorf("applied %v, want %q to the live process", *calls, want)
	}
	if _, err := l.Place("lc", Share{Compute: 0.5, Mode: ModeFloor}); err != nil {
		t.Fatal(err)
	}
	before := len(*calls)
	if err := l.LiftCompute("lc"); err != nil || len(*calls) != before {
		t.Errorf("lifting a floor: %v, %d applications, want none", err, len(*calls)-before)
	}
	if err := l.LiftCompute("gone"); !errors.Is(err, ErrUnknownInstance) {
		t.Errorf("lifting an unknown unit: %v, want ErrUnknownInstance", err)
	}
}
