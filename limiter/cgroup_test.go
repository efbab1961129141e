package limiter

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sloserve/sloserve/internal/syncbuf"
)

func TestCgroupV1Files(t *testing.T) {
	f := newFakeV1(t)
	l, err := newLimiter(Options{Backend: BackendCgroup, Root: f.root, Logger: testLogger(t)}, f.env())
	if err != nil {
		t.Fatal(err)
	}
	if l.Kind() != KindCgroupV1 || l.CPUs() != 4 {
		t.Fatalf("kind %s, %d CPUs; want cgroup-v1 on 4", l.Kind(), l.CPUs())
	}
	cpuParent := filepath.Join(f.root, "cpu", "sloserve-4242")
	acctParent := filepath.Join(f.root, "cpuacct", "sloserve-4242")
	memParent := filepath.Join(f.root, "memory", "process_api", "abc", "sloserve-4242")
	for _, want := range []string{"cgroup v1 cpu+cpuacct+memory", cpuParent, acctParent, memParent, "period 10ms", "not a unified hierarchy"} {
		if !strings.Contains(l.Describe(), want) {
			t.Errorf("Describe() = %q, want it to mention %q", l.Describe(), want)
		}
	}

	const id = "ocr-det/1#0"
	pl, err := l.Place(id, Share{Compute: 0.25, Memory: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	name, _ := unitName(id)
	cpu, acct, mem := filepath.Join(cpuParent, name), filepath.Join(acctParent, name), filepath.Join(memParent, name)
	wantJoin := []string{filepath.Join(cpu, "cgroup.procs"), filepath.Join(mem, "cgroup.procs"), filepath.Join(acct, "cgroup.procs")}
	if !slices.Equal(pl.JoinCgroups, wantJoin) || pl.IntraOpThreads != 1 || pl.Env != nil || pl.GPUMemLimit != 0 {
		t.Errorf("placement %+v, want joins %q and 1 thread", pl, wantJoin)
	}
	// A quarter of 4 CPUs is one CPU: 10 ms of every 10 ms period.
	fileHas(t, filepath.Join(cpu, "cpu.cfs_period_us"), "10000")
	fileHas(t, filepath.Join(cpu, "cpu.cfs_quota_us"), "10000")
	fileHas(t, filepath.Join(mem, "memory.limit_in_bytes"), "67108864")

	for _, tc := range []struct {
		share        Share
		quota, limit string
	}{
		{Share{Compute: 0.5}, "20000", "-1"},
		{Share{Compute: 1, Memory: 1 << 30}, "-1", "1073741824"},
		{Share{Compute: 0.0001}, "1000", "-1"}, // the kernel's minimum
		{Share{}, "-1", "-1"},
		{Share{Compute: 0.125, Memory: 4096}, "5000", "4096"},
	} {
		if err := l.Resize(id, tc.share); err != nil {
			t.Fatalf("Resize(%+v): %v", tc.share, err)
		}
		fileHas(t, filepath.Join(cpu, "cpu.cfs_quota_us"), tc.quota)
		fileHas(t, filepath.Join(mem, "memory.limit_in_bytes"), tc.limit)
	}
	if err := l.Resize(id, Share{Compute: -1}); err == nil {
		t.Error("negative share accepted")
	}

	// What the kernel would report.
	mustWrite(t, filepath.Join(acct, "cpuacct.usage"), "1500000000\n")
	mustWrite(t, filepath.Join(cpu, "cpu.stat"), "nr_periods 40\nnr_throttled 30\nthrottled_time 250000000\nnr_bursts 0\nburst_time 0\n")
	mustWrite(t, filepath.Join(mem, "memory.usage_in_bytes"), "1048576\n")
	mustWrite(t, filepath.Join(mem, "memory.max_usage_in_bytes"), "3145728\n")
	mustWrite(t, filepath.Join(mem, "memory.limit_in_bytes"), "67108864\n")
	mustWrite(t, filepath.Join(mem, "memory.oom_control"), "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
	st, err := l.Stats(id)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Stats{CPUSeconds: 1.5, ThrottledSeconds: 0.25, MemoryBytes: 1 << 20, MemoryPeak: 3 << 20, MemoryLimit: 64 << 20, OOMKills: 2}); st != want {
		t.Errorf("Stats = %+v, want %+v", st, want)
	}
	mustWrite(t, filepath.Join(mem, "memory.limit_in_bytes"), "9223372036854771712\n")
	if st, _ := l.Stats(id); st.MemoryLimit != 0 {
		t.Errorf("unlimited memory reads as limit %d, want 0", st.MemoryLimit)
	}

	if _, err := l.Place(id, Share{}); err == nil {
		t.Error("second Place of one id accepted")
	}
	if err := l.Release(id); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{cpu, acct, mem} {
		if exists(d) {
			t.Errorf("%s still exists after Release", d)
		}
	}
	if err := l.Release(id); !errors.Is(err, ErrUnknownInstance) {
		t.Errorf("second Release = %v, want ErrUnknownInstance", err)
	}
	if _, err := l.Stats(id); !errors.Is(err, ErrUnknownInstance) {
		t.Errorf("Stats after Release = %v, want ErrUnknownInstance", err)
	}
	if err := l.Resize("never", Share{}); !errors.Is(err, ErrUnknownInstance) {
		t.Errorf("Resize of an unknown id = %v, want ErrUnknownInstance", err)
	}

	// Close removes what is left and the parents.
	if _, err := l.Place("a", Share{Compute: 0.5}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Place("b", Share{Memory: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{cpuParent, acctParent, memParent} {
		if exists(d) {
			t.Errorf("%s still exists after Close", d)
		}
	}
	if _, err := l.Place("c", Share{}); err == nil {
		t.Error("Place after Close accepted")
	}
}

// Without cpuacct, CPU time is the sum over the unit's processes.
func TestCgroupV1WithoutCPUAcct(t *testing.T) {
	f := newFakeV1(t)
	f.self = "4:memory:/process_api/abc\n1:cpu:/\n"
	l, err := newLimiter(Options{Backend: BackendCgroup, Root: f.root, Logger: testLogger(t)}, f.env())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	pl, err := l.Place("x", Share{Compute: 0.5})
	if err != nil {
		t.Fatal(err)
	}
	if len(pl.JoinCgroups) != 2 {
		t.Errorf("joins %q, want cpu and memory", pl.JoinCgroups)
	}
	// This test process stands in for the runner.
	mustWrite(t, pl.JoinCgroups[0], strconv.Itoa(os.Getpid())+"\n")
	st, err := l.Stats("x")
	if err != nil {
		t.Fatal(err)
	}
	if st.CPUSeconds <= 0 {
		t.Errorf("CPU seconds from /proc = %v, want > 0", st.CPUSeconds)
	}
	// The fake process must leave before Close can remove the unit.
	mustWrite(t, pl.JoinCgroups[0], "")
}

func TestCgroupV2Files(t *testing.T) {
	f := newFakeV2(t)
	l, err := newLimiter(Options{Backend: BackendAuto, Root: f.root, Period: 20 * time.Millisecond, Logger: testLogger(t)}, f.env())
	if err != nil {
		t.Fatal(err)
	}
	// The server's own cgroup has 1.5 CPUs of quota: 2 usable CPUs.
	if l.Kind() != KindCgroupV2 || l.CPUs() != 2 {
		t.Fatalf("kind %s, %d CPUs; want cgroup-v2 on 2 (%s)", l.Kind(), l.CPUs(), l.Describe())
	}
	parent := filepath.Join(f.root, "server", "sloserve-4242")
	if !strings.Contains(l.Describe(), parent) {
		t.Errorf("Describe() = %q, want the parent %s", l.Describe(), parent)
	}
	fileHas(t, filepath.Join(f.root, "server", "cgroup.subtree_control"), "+cpu +memory")
	fileHas(t, filepath.Join(parent, "cgroup.subtree_control"), "+cpu +memory")

	pl, err := l.Place("m", Share{Compute: 0.25, Memory: 128 << 20})
	if err != nil {
		t.Fatal(err)
	}
	unit := filepath.Join(parent, "m")
	if want := []string{filepath.Join(unit, "cgroup.procs")}; !slices.Equal(pl.JoinCgroups, want) || pl.IntraOpThreads != 1 {
		t.Errorf("placement %+v, want joins %q and 1 thread", pl, want)
	}
	// A quarter of 2 CPUs: 10 ms of every 20 ms period.
	fileHas(t, filepath.Join(unit, "cpu.max"), "10000 20000")
	fileHas(t, filepath.Join(unit, "memory.max"), "134217728")
	if err := l.Resize("m", Share{Compute: 1}); err != nil {
		t.Fatal(err)
	}
	fileHas(t, filepath.Join(unit, "cpu.max"), "max 20000")
	fileHas(t, filepath.Join(unit, "memory.max"), "max")
	if err := l.Resize("m", Share{Compute: 0.75, Memory: 1 << 30}); err != nil {
		t.Fatal(err)
	}
	fileHas(t, filepath.Join(unit, "cpu.max"), "30000 20000")
	fileHas(t, filepath.Join(unit, "memory.max"), "1073741824")

	mustWrite(t, filepath.Join(unit, "cpu.stat"), "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\nnr_periods 9\nnr_throttled 4\nthrottled_usec 500000\n")
	mustWrite(t, filepath.Join(unit, "memory.current"), "4096\n")
	mustWrite(t, filepath.Join(unit, "memory.peak"), "8192\n")
	mustWrite(t, filepath.Join(unit, "memory.events"), "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
	st, err := l.Stats("m")
	if err != nil {
		t.Fatal(err)
	}
	if want := (Stats{CPUSeconds: 2.5, ThrottledSeconds: 0.5, MemoryBytes: 4096, MemoryPeak: 8192, MemoryLimit: 1 << 30, OOMKills: 1}); st != want {
		t.Errorf("Stats = %+v, want %+v", st, want)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if exists(parent) {
		t.Errorf("%s still exists after Close", parent)
	}
}

// Where cgroups cannot be used, auto falls back to the unprivileged
// backend and says why (neither a writable tree nor a delegated subtree);
// backend cgroup fails with the same reason.
func TestCgroupUnusable(t *testing.T) {
	t.Setenv("TMPDIR", t.TempDir()) // the process units' base
	f := newFakeV1(t)
	env := f.env()
	env.mkdir = func(dir string) error { return &os.PathError{Op: "mkdir", Path: dir, Err: syscall.EACCES} }
	l, err := newLimiter(Options{Root: f.root, Logger: testLogger(t)}, env)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	want := filepath.Join(f.root, "cpu") + " is not writable: permission denied"
	for _, w := range []string{want, "delegated cgroup v2: " + f.root + " is not a unified (cgroup v2) hierarchy"} {
		if l.Kind() != KindUnprivileged || !strings.HasPrefix(l.Describe(), "unprivileged (no writable cgroup: ") || !strings.Contains(l.Describe(), w) {
			t.Errorf("kind %s, Describe() = %q; want unprivileged saying %q", l.Kind(), l.Describe(), w)
		}
	}
	if pl, err := l.Place("x", Share{Compute: 1}); err != nil || pl.IntraOpThreads != l.CPUs() || pl.JoinCgroups != nil || pl.ProcessUnit == "" {
		t.Errorf("unprivileged placement = %+v, %v; want a process unit", pl, err)
	}
	if u, err := newLimiter(Options{Backend: BackendUnprivileged, Root: f.root, Logger: testLogger(t)}, f.env()); err != nil || u.Kind() != KindUnprivileged {
		t.Errorf("backend unprivileged where cgroups are writable: %v, %v", u, err)
	} else {
		u.Close()
	}
	if _, err := newLimiter(Options{Backend: BackendCgroup, Root: f.root, Logger: testLogger(t)}, env); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("backend cgroup error = %v, want it to say %q", err, want)
	}

	f = newFakeV1(t)
	f.self = "1:cpu:/\n"
	if _, err := newLimiter(Options{Backend: BackendCgroup, Root: f.root, Logger: testLogger(t)}, f.env()); err == nil || !strings.Contains(err.Error(), "memory controller") {
		t.Errorf("no memory hierarchy: error = %v", err)
	}
	// Nothing is left behind by the failed attempt.
	if exists(filepath.Join(f.root, "cpu", "sloserve-4242")) {
		t.Error("failed setup left its cpu parent")
	}
}

func TestCleanupStaleFake(t *testing.T) {
	f := newFakeV1(t)
	f.alivePid[555] = true
	env := f.env()
	mem := filepath.Join(f.root, "memory", "process_api", "abc")
	// A dead server (pid 999) left units in all three hierarchies, one
	// with a process still in it.
	for _, d := range []string{
		filepath.Join(f.root, "cpu", "sloserve-999"), filepath.Join(f.root, "cpu", "sloserve-999", "u1"),
		filepath.Join(f.root, "cpuacct", "sloserve-999"),
		filepath.Join(f.root, "cpu", "sloserve-999-server"),
		filepath.Join(mem, "sloserve-999"), filepath.Join(mem, "sloserve-999", "u1"),
		// Kept: this server, a live one, names that are not ours, and a
		// directory outside the server's own memory cgroup.
		filepath.Join(f.root, "cpu", "sloserve-4242"),
		filepath.Join(f.root, "cpu", "sloserve-555"),
		filepath.Join(f.root, "cpu", "sloserve-abc"),
		filepath.Join(f.root, "cpu", "other-999"),
		filepath.Join(f.root, "memory", "sloserve-998"),
	} {
		if err := env.mkdir(d); err != nil {
			t.Fatal(err)
		}
	}
	mustWrite(t, filepath.Join(f.root, "cpu", "sloserve-999", "u1", "cgroup.procs"), "31337\n")
	mustWrite(t, filepath.Join(mem, "sloserve-999", "u1", "cgroup.procs"), "31337\n")
	// A runner the dead server started that never joined its unit.
	mustWrite(t, filepath.Join(f.root, "cpu", "sloserve-999-server", "cgroup.procs"), "31338\n")

	n, err := cleanupStale(f.root, env, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	if n != 4 {
		t.Errorf("removed %d, want 4 (cpu, cpuacct, memory and the server's cgroup of pid 999)", n)
	}
	if got := sortedInts(f.killed); !slices.Equal(got, []int{31337, 31338}) {
		t.Errorf("killed %v, want [31337 31338]", got)
	}
	for _, d := range []string{filepath.Join(f.root, "cpu", "sloserve-999"), filepath.Join(f.root, "cpu", "sloserve-999-server"), filepath.Join(f.root, "cpuacct", "sloserve-999"), filepath.Join(mem, "sloserve-999")} {
		if exists(d) {
			t.Errorf("stale %s kept", d)
		}
	}
	for _, d := range []string{"cpu/sloserve-4242", "cpu/sloserve-555", "cpu/sloserve-abc", "cpu/other-999", "memory/sloserve-998"} {
		if !exists(filepath.Join(f.root, d)) {
			t.Errorf("%s removed, want it kept", d)
		}
	}
}

// Each mode writes its quota and weight in its home: floors and caps in
// the units' parent (which weighs as 4 busy threads per CPU), background
// units in the idle-class background parent beside it. A change of mode
// writes both homes, so a process in either is limited as the share says.
// On 4 CPUs (v1 fake; the v2 fake has 2, from its cpu.max of 1.5) a floor
// weighs 8 default threads per CPU of its share.
func TestCgroupModes(t *testing.T) {
	for _, v2 := range []bool{false, true} {
		t.Run(map[bool]string{false: "v1", true: "v2"}[v2], func(t *testing.T) {
			f := newFakeV1(t)
			if v2 {
				f = newFakeV2(t)
			}
			l, err := newLimiter(Options{Backend: BackendCgroup, Root: f.root, Logger: testLogger(t)}, f.env())
			if err != nil {
				t.Fatal(err)
			}
			own := filepath.Join(f.root, "cpu")
			weightFile, quotaFile := "cpu.shares", "cpu.cfs_quota_us"
			if v2 {
				own = filepath.Join(f.root, "server")
				weightFile, quotaFile = "cpu.weight", "cpu.max"
			}
			parent, background := filepath.Join(own, "sloserve-4242"), filepath.Join(own, "sloserve-4242-background")
			fileHas(t, filepath.Join(parent, weightFile), map[bool]string{false: "16384", true: "800"}[v2])
			fileHas(t, filepath.Join(background, "cpu.idle"), "1")
			if !strings.Contains(l.Describe(), "background units in an idle-class parent (cpu.idle)") {
				t.Errorf("Describe() = %q, want it to name the idle-class parent", l.Describe())
			}
			const id = "m"
			pl, err := l.Place(id, Share{Compute: 0.25, Mode: ModeFloor})
			if err != nil {
				t.Fatal(err)
			}
			if want := filepath.Join(parent, id, "cgroup.procs"); pl.JoinCgroups[0] != want {
				t.Errorf("a floor joins %s, want %s", pl.JoinCgroups[0], want)
			}
			for _, tc := range []struct {
				share                Share
				v1Quota, v2Max       string
				v1Weight, v2Weight   string
				v1Threads, v2Threads int
			}{
				// A floor caps nothing: no quota, a weight by its share.
				{Share{Compute: 0.25, Mode: ModeFloor}, "-1", "max 10000", "8192", "400", 4, 2},
				{Share{Compute: 0.5, Mode: ModeFloor}, "-1", "max 10000", "16384", "800", 4, 2},
				{Share{Mode: ModeFloor}, "-1", "max 10000", "32768", "1600", 4, 2}, // unlimited: the whole device
				// Background: the quota; the default weight among its siblings.
				{Share{Compute: 0.25, Mode: ModeBackground}, "10000", "5000 10000", "1024", "100", 1, 1},
				{Share{Compute: 0.5}, "20000", "10000 10000", "1024", "100", 2, 1},
				{Share{Compute: 0.1, Mode: ModeBackground}, "4000", "2000 10000", "1024", "100", 1, 1},
				{Share{Compute: 0.75, Mode: ModeFloor}, "-1", "max 10000", "24576", "1200", 4, 2},
			} {
				if err := l.Resize(id, tc.share); err != nil {
					t.Fatalf("Resize(%+v): %v", tc.share, err)
				}
				for _, home := range []string{filepath.Join(parent, id), filepath.Join(background, id)} {
					if v2 {
						fileHas(t, filepath.Join(home, quotaFile), tc.v2Max)
						fileHas(t, filepath.Join(home, weightFile), tc.v2Weight)
					} else {
						fileHas(t, filepath.Join(home, quotaFile), tc.v1Quota)
						fileHas(t, filepath.Join(home, weightFile), tc.v1Weight)
					}
				}
				if want := map[bool]int{false: tc.v1Threads, true: tc.v2Threads}[v2]; ThreadsFor(tc.share, l.CPUs()) != want {
					t.Errorf("ThreadsFor(%+v) on %d CPUs = %d, want %d", tc.share, l.CPUs(), ThreadsFor(tc.share, l.CPUs()), want)
				}
			}
			if err := l.Resize(id, Share{Mode: 7}); err == nil {
				t.Error("unknown mode accepted")
			}
			// A background unit joins its home in the background parent.
			pl, err = l.Place("be", Share{Compute: 0.5, Mode: ModeBackground})
			if err != nil {
				t.Fatal(err)
			}
			if want := filepath.Join(background, "be", "cgroup.procs"); pl.JoinCgroups[0] != want {
				t.Errorf("a background unit joins %s, want %s", pl.JoinCgroups[0], want)
			}
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
			for _, d := range []string{parent, background} {
				if exists(d) {
					t.Errorf("%s still exists after Close", d)
				}
			}
		})
	}
}

// withoutCPUIdle makes the fake v1 hierarchies lack cpu.idle (a kernel
// before 5.15) until the test ends.
func withoutCPUIdle(t *testing.T) {
	saved := fakeV1Files
	fakeV1Files = slices.DeleteFunc(slices.Clone(saved), func(s string) bool { return s == "cpu.idle" })
	t.Cleanup(func() { fakeV1Files = saved })
}

// Without cpu.idle the background parent gets the lowest weight instead.
func TestCgroupBackgroundWithoutIdleClass(t *testing.T) {
	f := newFakeV1(t)
	withoutCPUIdle(t)
	l, err := newLimiter(Options{Backend: BackendCgroup, Root: f.root, Logger: testLogger(t)}, f.env())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if !strings.Contains(l.Describe(), "background units in a parent of the lowest weight") {
		t.Errorf("Describe() = %q, want it to say background units get the lowest weight", l.Describe())
	}
	background := filepath.Join(f.root, "cpu", "sloserve-4242-background")
	fileHas(t, filepath.Join(background, "cpu.shares"), "2")
	if exists(filepath.Join(background, "cpu.idle")) {
		t.Error("cpu.idle written on a kernel without it")
	}
	if _, err := l.Place("be", Share{Compute: 0.5, Mode: ModeBackground}); err != nil {
		t.Fatal(err)
	}
	fileHas(t, filepath.Join(background, "be", "cpu.cfs_quota_us"), "20000")
}

// LiftCompute, for a runner about to stop, takes a background unit out of
// the idle-class parent and lifts its quota; its memory limit stays.
func TestCgroupLiftCompute(t *testing.T) {
	for _, v2 := range []bool{false, true} {
		t.Run(map[bool]string{false: "v1", true: "v2"}[v2], func(t *testing.T) {
			f := newFakeV1(t)
			if v2 {
				f = newFakeV2(t)
			}
			l, err := newLimiter(Options{Backend: BackendCgroup, Root: f.root, Logger: testLogger(t)}, f.env())
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			own, memOwn := filepath.Join(f.root, "cpu"), filepath.Join(f.root, "memory", "process_api", "abc")
			quotaFile, memFile, lifted := "cpu.cfs_quota_us", "memory.limit_in_bytes", "-1"
			if v2 {
				own = filepath.Join(f.root, "server")
				memOwn = own
				quotaFile, memFile, lifted = "cpu.max", "memory.max", "max 10000"
			}
			parent, background := filepath.Join(own, "sloserve-4242", "be"), filepath.Join(own, "sloserve-4242-background", "be")
			if _, err := l.Place("be", Share{Compute: 0.05, Memory: 64 << 20, Mode: ModeBackground}); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(background, "cgroup.procs"), []byte("4711\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			lifter, ok := l.(interface{ LiftCompute(string) error })
			if !ok {
				t.Fatal("the cgroup backend cannot lift a unit's compute cap")
			}
			if err := lifter.LiftCompute("be"); err != nil {
				t.Fatal(err)
			}
			for _, home := range []string{parent, background} {
				fileHas(t, filepath.Join(home, quotaFile), lifted)
			}
			fileHas(t, filepath.Join(parent, "cgroup.procs"), "4711")
			fileHas(t, filepath.Join(memOwn, "sloserve-4242", "be", memFile), "67108864")
			// A floor has no cap to lift and keeps its weight.
			if _, err := l.Place("lc", Share{Compute: 0.25, Mode: ModeFloor}); err != nil {
				t.Fatal(err)
			}
			if err := lifter.LiftCompute("lc"); err != nil {
				t.Fatal(err)
			}
			weightFile, floorWeight := "cpu.shares", "8192"
			if v2 {
				weightFile, floorWeight = "cpu.weight", "400"
			}
			fileHas(t, filepath.Join(own, "sloserve-4242", "lc", weightFile), floorWeight)
			if err := lifter.LiftCompute("nope"); !errors.Is(err, ErrUnknownInstance) {
				t.Errorf("LiftCompute of an unknown unit: %v", err)
			}
			// The runner exits (the fake kernel does not move it).
			for _, home := range []string{parent, background} {
				mustWrite(t, filepath.Join(home, "cgroup.procs"), "")
			}
			if err := l.Release("be"); err != nil {
				t.Fatal(err)
			}
			if exists(parent) || exists(background) {
				t.Error("the unit's folders outlived Release")
			}
		})
	}
}

// Runners that stop together lift their caps at once: a lift that waits
// on one unit's files (a FIFO nobody reads here, standing for a cgroup
// write the kernel is slow to take on a busy host) does not hold up the
// lift of another unit. Before, LiftCompute wrote under the limiter's
// lock: 40 best-effort runners stopping together took their turns, the
// last one lifted (and sent SIGTERM) 4.7 s after the first.
func TestLiftComputeInParallel(t *testing.T) {
	f := newFakeV1(t)
	l, err := newLimiter(Options{Backend: BackendCgroup, Root: f.root, Logger: testLogger(t)}, f.env())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for _, id := range []string{"a", "b"} {
		if _, err := l.Place(id, Share{Compute: 0.05, Memory: 64 << 20, Mode: ModeBackground}); err != nil {
			t.Fatal(err)
		}
	}
	lifter := l.(ComputeLifter)
	slow := filepath.Join(f.root, "cpu", "sloserve-4242", "a", "cpu.shares")
	if err := os.Remove(slow); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(slow, 0o644); err != nil {
		t.Skipf("a FIFO: %v", err)
	}
	aDone := make(chan error, 1)
	go func() { aDone <- lifter.LiftCompute("a") }()
	// The lift of a waits in the kernel for a reader of its file.
	waiting := func() bool {
		wchans, _ := filepath.Glob("/proc/self/task/*/wchan")
		for _, w := range wchans {
			if b, err := os.ReadFile(w); err == nil && strings.Contains(string(b), "wait_for_partner") {
				return true
			}
		}
		return false
	}
	for deadline := time.Now().Add(10 * time.Second); !waiting(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Skip("no thread seen waiting on the FIFO (/proc/self/task/*/wchan)")
		}
	}
	bDone := make(chan error, 1)
	go func() { bDone <- lifter.LiftCompute("b") }()
	// A deadlock detector, not a timing: b's lift takes a few file writes.
	bEnded := false
	select {
	case err := <-bDone:
		bEnded = true
		if err != nil {
			t.Error(err)
		}
	case err := <-aDone:
		t.Fatalf("the lift of a ended before its file was read: %v", err)
	case <-time.After(10 * time.Second):
		t.Error("the lift of b waited for the lift of a, stuck on its files")
	}
	r, err := os.Open(slow) // a's write goes through
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := <-aDone; err != nil {
		t.Error(err)
	}
	if !bEnded {
		if err := <-bDone; err != nil {
			t.Error(err)
		}
	}
	for _, id := range []string{"a", "b"} {
		fileHas(t, filepath.Join(f.root, "cpu", "sloserve-4242", id, "cpu.cfs_quota_us"), "-1")
	}
}

// A lift that fails to write a file leaves the unit's share as it was, so
// that a retry writes the files again. Before, the share was recorded as
// lifted before the writes: the retry saw no cap and wrote nothing, and
// the runner stayed capped in the idle class.
func TestLiftComputeRetriesAfterFailure(t *testing.T) {
	for _, v2 := range []bool{false, true} {
		t.Run(map[bool]string{false: "v1", true: "v2"}[v2], func(t *testing.T) {
			f := newFakeV1(t)
			if v2 {
				f = newFakeV2(t)
			}
			l, err := newLimiter(Options{Backend: BackendCgroup, Root: f.root, Logger: testLogger(t)}, f.env())
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			own := filepath.Join(f.root, "cpu")
			quotaFile, lifted, failing := "cpu.cfs_quota_us", "-1", "cpu.cfs_period_us"
			if v2 {
				own = filepath.Join(f.root, "server")
				quotaFile, lifted, failing = "cpu.max", "max 10000", "memory.max"
			}
			parent, background := filepath.Join(own, "sloserve-4242", "be"), filepath.Join(own, "sloserve-4242-background", "be")
			if _, err := l.Place("be", Share{Compute: 0.05, Memory: 64 << 20, Mode: ModeBackground}); err != nil {
				t.Fatal(err)
			}
			read := func(file string) string {
				b, err := os.ReadFile(file)
				if err != nil {
					t.Fatal(err)
				}
				return strings.TrimSpace(string(b))
			}
			capped := read(filepath.Join(background, quotaFile))
			if capped == lifted {
				t.Fatalf("placed at 5%%, %s = %q", quotaFile, capped)
			}
			mustWrite(t, filepath.Join(background, "cgroup.procs"), "4711\n")
			// One write fails: the file is a directory for the first lift.
			bad := filepath.Join(parent, failing)
			failingWas := read(bad)
			if err := os.Remove(bad); err != nil {
				t.Fatal(err)
			}
			mustMkdir(t, bad)
			lifter := l.(ComputeLifter)
			if err := lifter.LiftCompute("be"); err == nil {
				t.Fatal("a lift whose write failed returned no error")
			}
			fileHas(t, filepath.Join(background, quotaFile), capped) // not reached
			if err := os.Remove(bad); err != nil {
				t.Fatal(err)
			}
			mustWrite(t, bad, failingWas+"\n")
			if err := lifter.LiftCompute("be"); err != nil {
				t.Fatalf("the retry: %v", err)
			}
			for _, home := range []string{parent, background} {
				fileHas(t, filepath.Join(home, quotaFile), lifted)
			}
			fileHas(t, filepath.Join(parent, "cgroup.procs"), "4711")
			fileHas(t, bad, failingWas)
		})
	}
}

// The server's own process moves into a cgroup of its own beside the
// units' parent, weighted as that parent, in the cpu hierarchy only; a
// second limiter of the same server finds the units' parent beside it,
// not below it; the last Close moves the server back and removes the
// cgroup.
func TestCgroupServerBesideUnits(t *testing.T) {
	f := newFakeV1(t)
	cpuRoot := filepath.Join(f.root, "cpu")
	mem := filepath.Join(f.root, "memory", "process_api", "abc")
	mustWrite(t, filepath.Join(cpuRoot, "cgroup.procs"), "1\n4242\n")
	mustWrite(t, filepath.Join(mem, "cgroup.procs"), "4242\n")
	mustWrite(t, filepath.Join(f.root, "cpuacct", "cgroup.procs"), "4242\n")
	opts := Options{Backend: BackendCgroup, Root: f.root, Logger: testLogger(t)}
	l, err := newLimiter(opts, f.env())
	if err != nil {
		t.Fatal(err)
	}
	server := filepath.Join(cpuRoot, "sloserve-4242-server")
	// 4 busy default threads per CPU on 4 CPUs, as the units' parent.
	fileHas(t, filepath.Join(server, "cpu.shares"), "16384")
	fileHas(t, filepath.Join(cpuRoot, "sloserve-4242", "cpu.shares"), "16384")
	fileHas(t, filepath.Join(server, "cgroup.procs"), "4242")
	fileHas(t, filepath.Join(cpuRoot, "cgroup.procs"), "1")
	// Memory and cpuacct stay as they were.
	fileHas(t, filepath.Join(mem, "cgroup.procs"), "4242")
	fileHas(t, filepath.Join(f.root, "cpuacct", "cgroup.procs"), "4242")
	for _, d := range []string{filepath.Join(mem, "sloserve-4242-server"), filepath.Join(f.root, "cpuacct", "sloserve-4242-server")} {
		if exists(d) {
			t.Errorf("%s made; want the server moved in the cpu hierarchy only", d)
		}
	}
	if want := "the server's own threads at the units' parent's weight in " + server; !strings.Contains(l.Describe(), want) {
		t.Errorf("Describe() = %q, want it to say %q", l.Describe(), want)
	}

	// The server is in its cgroup now: a second limiter and a clean-up
	// work beside it.
	f.self = "4:memory:/process_api/abc\n2:cpuacct:/\n1:cpu:/sloserve-4242-server\n"
	l2, err := newLimiter(opts, f.env())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(l2.Describe(), filepath.Join(cpuRoot, "sloserve-4242")+",") || strings.Contains(l2.Describe(), server+"/") {
		t.Errorf("second limiter: Describe() = %q, want its parent at %s", l2.Describe(), cpuRoot)
	}
	pl, err := l2.Place("m", Share{Compute: 0.5})
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(cpuRoot, "sloserve-4242", "m", "cgroup.procs"); pl.JoinCgroups[0] != want {
		t.Errorf("second limiter joins %s, want %s", pl.JoinCgroups[0], want)
	}
	if n, err := cleanupStale(f.root, f.env(), testLogger(t)); err != nil || n != 0 || !exists(server) {
		t.Errorf("clean-up from the moved server: %d removed, %v; want none and its cgroup kept", n, err)
	}

	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	fileHas(t, filepath.Join(server, "cgroup.procs"), "4242") // the second limiter still uses it
	if err := l2.Close(); err != nil {
		t.Fatal(err)
	}
	if exists(server) || exists(filepath.Join(cpuRoot, "sloserve-4242")) {
		t.Errorf("after the last Close: want %s and the units' parent gone", server)
	}
	fileHas(t, filepath.Join(cpuRoot, "cgroup.procs"), "1\n4242")

	// A server that cannot be moved is an error that leaves nothing.
	env := f.env()
	env.join = func(procs string, pid int) error {
		return &os.PathError{Op: "write", Path: procs, Err: syscall.EACCES}
	}
	f.self = "4:memory:/process_api/abc\n2:cpuacct:/\n1:cpu:/\n"
	if _, err := newLimiter(opts, env); err == nil || !strings.Contains(err.Error(), "moving the server into "+server) {
		t.Errorf("server not movable: error %v", err)
	}
	for _, d := range []string{server, filepath.Join(cpuRoot, "sloserve-4242"), filepath.Join(cpuRoot, "sloserve-4242-background")} {
		if exists(d) {
			t.Errorf("failed setup left %s", d)
		}
	}
}

// On cgroup v2 the server's cgroup is a leaf beside the units' parent
// with its cpu.weight; a delegated server returns to the delegated leaf.
func TestCgroupV2ServerBesideUnits(t *testing.T) {
	f := newFakeV2(t)
	mustWrite(t, filepath.Join(f.root, "server", "cgroup.procs"), "4242\n")
	l, err := newLimiter(Options{Backend: BackendCgroup, Root: f.root, Logger: testLogger(t)}, f.env())
	if err != nil {
		t.Fatal(err)
	}
	server := filepath.Join(f.root, "server", "sloserve-4242-server")
	fileHas(t, filepath.Join(server, "cpu.weight"), "800") // 4 per CPU on 2 CPUs
	fileHas(t, filepath.Join(f.root, "server", "sloserve-4242", "cpu.weight"), "800")
	fileHas(t, filepath.Join(server, "cgroup.procs"), "4242")
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if exists(server) {
		t.Errorf("%s still exists after Close", server)
	}
	fileHas(t, filepath.Join(f.root, "server", "cgroup.procs"), "4242")

	d, own := newFakeDelegated(t)
	dl, err := newDelegated(Options{Root: d.root, Period: DefaultPeriod, Logger: testLogger(t)}, d.env(), grant(own), testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	server = filepath.Join(own, "sloserve-4242-server")
	fileHas(t, filepath.Join(server, "cgroup.procs"), "4242")
	fileHas(t, filepath.Join(server, "cpu.weight"), "1600") // 4 per CPU on the fake's 4
	if err := dl.Close(); err != nil {
		t.Fatal(err)
	}
	if exists(server) {
		t.Errorf("%s still exists after Close", server)
	}
	// Back in the leaf, not in the delegated cgroup (which may hold no
	// processes now that it passes controllers down).
	fileHas(t, filepath.Join(own, delegatedLeaf, "cgroup.procs"), "4300\n4242")
	if pids, _ := readPids(filepath.Join(own, "cgroup.procs")); slices.Contains(pids, 4242) {
		t.Errorf("the server went back to %s, which passes controllers down", own)
	}
}

// A server in the host's root cgroup is told that its best-effort units
// yield to every process of the host, in Describe and once in the log;
// one in a container's namespace root or a service's cgroup is not.
func TestHostRootNamed(t *testing.T) {
	const named = "in the host's root cgroup"
	for _, tc := range []struct {
		name string
		host func(t *testing.T) *fakeHost
		want string // the cgroup named, "" none
	}{
		{"v1 at the host's root", newFakeV1, "cpu"},
		{"v1 at a namespace's root", func(t *testing.T) *fakeHost {
			f := newFakeV1(t)
			for _, d := range []string{"cpu", "cpuacct", "memory"} {
				if err := os.Remove(filepath.Join(f.root, d, "release_agent")); err != nil {
					t.Fatal(err)
				}
			}
			return f
		}, ""},
		{"v2 in a service's cgroup", newFakeV2, ""},
		{"v2 at the host's root", func(t *testing.T) *fakeHost {
			f := newFakeV2(t)
			f.self = "0::/\n"
			mustWrite(t, filepath.Join(f.root, "cpu.max"), "max 100000\n")
			return f
		}, "."},
		{"v2 at a namespace's root", func(t *testing.T) *fakeHost {
			f := newFakeV2(t)
			f.self = "0::/\n"
			mustWrite(t, filepath.Join(f.root, "cpu.max"), "max 100000\n")
			mustWrite(t, filepath.Join(f.root, "cgroup.type"), "domain\n")
			return f
		}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := tc.host(t)
			var log syncbuf.Buffer
			l, err := newLimiter(Options{Backend: BackendCgroup, Root: f.root, Logger: slog.New(slog.NewTextHandler(&log, nil))}, f.env())
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			warns := strings.Count(log.String(), "level=WARN msg=\"the server runs in the host's root cgroup")
			if tc.want == "" {
				if strings.Contains(l.Describe(), named) || warns != 0 {
					t.Errorf("Describe() = %q, %d WARNs; want neither to name the host's root", l.Describe(), warns)
				}
				return
			}
			if !strings.Contains(l.Describe(), named) {
				t.Errorf("Describe() = %q, want it to say %q", l.Describe(), named)
			}
			if dir := filepath.Join(f.root, tc.want); warns != 1 || !strings.Contains(log.String(), "cgroup="+dir) {
				t.Errorf("%d WARNs naming the host's root, want 1 with cgroup=%s; log:\n%s", warns, dir, log.String())
			}
		})
	}
}

// LiftBackground, for a stopping server, takes the background parent out
// of the idle class and weighs it as the units' parent, so that a
// best-effort runner restarted into it (its first placement's home) loads
// and answers as a peer; without cpu.idle the lowest weight is raised the
// same way. Its units' caps are LiftCompute's.
func TestLiftBackground(t *testing.T) {
	for _, tc := range []struct {
		name       string
		host       func(t *testing.T) *fakeHost
		own        string
		weightFile string
		want       string // the units' parent's weight
		idle       bool
	}{
		{"v1", newFakeV1, "cpu", "cpu.shares", "16384", true},
		{"v2", newFakeV2, "server", "cpu.weight", "800", true},
		{"v1 without cpu.idle", func(t *testing.T) *fakeHost {
			withoutCPUIdle(t)
			return newFakeV1(t)
		}, "cpu", "cpu.shares", "16384", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := tc.host(t)
			l, err := newLimiter(Options{Backend: BackendCgroup, Root: f.root, Logger: testLogger(t)}, f.env())
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			own := filepath.Join(f.root, tc.own)
			parent, background := filepath.Join(own, "sloserve-4242"), filepath.Join(own, "sloserve-4242-background")
			if _, err := l.Place("be", Share{Compute: 0.05, Mode: ModeBackground}); err != nil {
				t.Fatal(err)
			}
			if tc.idle {
				fileHas(t, filepath.Join(background, "cpu.idle"), "1")
			} else {
				fileHas(t, filepath.Join(background, tc.weightFile), "2")
			}
			if err := l.(BackgroundLifter).LiftBackground(); err != nil {
				t.Fatal(err)
			}
			if tc.idle {
				fileHas(t, filepath.Join(background, "cpu.idle"), "0")
			} else if exists(filepath.Join(background, "cpu.idle")) {
				t.Error("cpu.idle written on a kernel without it")
			}
			fileHas(t, filepath.Join(parent, tc.weightFile), tc.want)
			fileHas(t, filepath.Join(background, tc.weightFile), tc.want)
		})
	}
}

// Stats beside a Resize that moves the unit between its homes reads one
// home's files whole, never an error or a mix: it takes the unit's mode
// under the limiter's lock (the race detector saw Stats read it unlocked
// while TestCgroupResizeLive resized the unit).
func TestCgroupStatsBesideResize(t *testing.T) {
	f := newFakeV2(t)
	l, err := newLimiter(Options{Backend: BackendAuto, Root: f.root, Logger: testLogger(t)}, f.env())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := l.Place("m", Share{Compute: 0.25}); err != nil {
		t.Fatal(err)
	}
	var homes []string
	filepath.WalkDir(f.root, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() && d.Name() == "m" {
			homes = append(homes, p)
		}
		return err
	})
	if len(homes) != 2 {
		t.Fatalf("the unit's homes: %q, want two (its parent's and the background parent's)", homes)
	}
	// Each home reports its own memory.
	for i, home := range homes {
		mustWrite(t, filepath.Join(home, "cpu.stat"), "usage_usec 1000000\nthrottled_usec 0\n")
		mustWrite(t, filepath.Join(home, "memory.current"), strconv.Itoa((i+1)<<20)+"\n")
		mustWrite(t, filepath.Join(home, "memory.events"), "oom_kill 0\n")
	}
	done := make(chan error, 1)
	go func() {
		var err error
		for i := range 200 {
			s := Share{Compute: 0.25}
			if i%2 == 0 {
				s = Share{Mode: ModeBackground}
			}
			if err = l.Resize("m", s); err != nil {
				break
			}
		}
		done <- err
	}()
	seen := map[int64]int{}
	for range 200 {
		st, err := l.Stats("m")
		if err != nil {
			t.Fatalf("Stats beside a Resize: %v", err)
		}
		seen[st.MemoryBytes]++
		if st.MemoryBytes != 1<<20 && st.MemoryBytes != 2<<20 {
			t.Fatalf("Stats beside a Resize read %d bytes of memory, want one home's (1 or 2 MiB)", st.MemoryBytes)
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	t.Logf("memory read from each home: %v", seen)
}
