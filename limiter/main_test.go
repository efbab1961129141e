package limiter

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/sloserve/sloserve/runtime"
)

// childEnv makes the test binary act as a helper process: "runner" serves
// a model like `sloserve runner`; "alloc" joins the cgroups listed in
// childCgroupsEnv and then allocates memory until it is killed; "churn"
// joins them and then starts and ends threads until it is killed.
const (
	childEnv        = "SLOSERVE_LIMITER_CHILD"
	childCgroupsEnv = "SLOSERVE_LIMITER_CHILD_CGROUPS"
)

func TestMain(m *testing.M) {
	switch os.Getenv(childEnv) {
	case "runner":
		os.Exit(runRunnerChild())
	case "alloc":
		os.Exit(runAllocChild())
	case "churn":
		os.Exit(runChurnChild())
	case leaveIdleChild:
		os.Exit(runLeaveIdleChild())
	}
	goleak.VerifyTestMain(m)
}

func runRunnerChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	args := os.Args[1:]
	if len(args) > 0 && args[0] == "runner" {
		args = args[1:]
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil)).With("pid", os.Getpid())
	if err := runtime.RunnerMain(ctx, args, logger); err != nil {
		fmt.Fprintf(os.Stderr, "sloserve runner: %v\n", err)
		return 1
	}
	return 0
}

// runAllocChild touches memory in 4 MiB steps up to 512 MiB, then waits.
// Under a smaller memory limit the kernel's OOM killer ends it.
func runAllocChild() int {
	if err := joinChildCgroups(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	var hold [][]byte
	for range 128 {
		b := make([]byte, 4<<20)
		for i := 0; i < len(b); i += 4096 {
			b[i] = 1
		}
		hold = append(hold, b)
	}
	fmt.Fprintln(os.Stderr, "allocated", len(hold)*4, "MiB without being killed")
	time.Sleep(time.Minute)
	return 3
}

// joinChildCgroups writes the process's pid into each cgroup.procs file
// named in childCgroupsEnv.
func joinChildCgroups() error {
	for f := range strings.SplitSeq(os.Getenv(childCgroupsEnv), ",") {
		if err := os.WriteFile(f, []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
			return err
		}
	}
	return nil
}

// runChurnChild keeps threads starting and ending, as a runner's do while
// it serves: goroutines that lock their thread and return end it. It
// prints "churning" once it has joined its cgroups and then runs until it
// is killed.
func runChurnChild() int {
	if err := joinChildCgroups(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	for range 4 {
		go func() {
			for {
				done := make(chan struct{})
				go func() {
					goruntime.LockOSThread() // not unlocked: the thread ends with the goroutine
					time.Sleep(time.Millisecond)
					close(done)
				}()
				<-done
			}
		}()
	}
	fmt.Println("churning")
	select {}
}

// testLogger logs into the test's output.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// fakeHost is a host whose cgroup filesystem is a plain directory tree:
// mkdir fills a new cgroup with empty control files as the kernel would,
// and rmdir refuses a cgroup with children or processes, as the kernel
// does.
type fakeHost struct {
	root     string
	v2       bool
	self     string
	pid      int
	alivePid map[int]bool
	killed   []int
}

var (
	fakeV1Files = []string{"cgroup.procs", "cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.stat", "cpu.shares", "cpu.idle",
		"cpuacct.usage", "memory.limit_in_bytes", "memory.usage_in_bytes", "memory.oom_control"}
	fakeV2Files = []string{"cgroup.procs", "cgroup.type", "cgroup.controllers", "cgroup.subtree_control", "cpu.max", "cpu.weight", "cpu.idle",
		"cpu.stat", "memory.max", "memory.current", "memory.events"}
)

// fakeDefaults are what a new cgroup's files hold.
var fakeDefaults = map[string]string{
	"cgroup.controllers": "cpu memory io\n", "cpu.cfs_period_us": "100000\n", "cpu.cfs_quota_us": "-1\n",
	"cpuacct.usage": "0\n", "memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": "0\n",
	"memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n", "cpu.max": "max 100000\n",
	"memory.max": "max\n", "memory.current": "0\n", "cpu.shares": "1024\n", "cpu.weight": "100\n", "cpu.idle": "0\n",
}

func (f *fakeHost) env() hostEnvironment {
	return hostEnvironment{
		selfCgroup: func() ([]byte, error) { return []byte(f.self), nil },
		pid:        f.pid,
		alive:      func(pid int) bool { return f.alivePid[pid] },
		kill: func(pid int) error {
			// The process dies: it leaves every cgroup.procs file.
			f.killed = append(f.killed, pid)
			return filepath.WalkDir(f.root, func(p string, d os.DirEntry, err error) error {
				if err != nil || d.Name() != "cgroup.procs" {
					return err
				}
				pids, _ := readPids(p)
				var keep []string
				for _, q := range pids {
					if q != pid {
						keep = append(keep, strconv.Itoa(q))
					}
				}
				return os.WriteFile(p, []byte(strings.Join(keep, "\n")), 0o644)
			})
		},
		numCPU: 4,
		join:   f.join,
		mkdir: func(dir string) error {
			if err := os.Mkdir(dir, 0o755); err != nil {
				return err
			}
			files := fakeV1Files
			if f.v2 {
				files = fakeV2Files
			}
			for _, name := range files {
				content := fakeDefaults[name]
				if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
					return err
				}
			}
			return nil
		},
		rmdir: func(dir string) error {
			entries, err := os.ReadDir(dir)
			if err != nil {
				return err
			}
			for _, e := range entries {
				if e.IsDir() {
					return &os.PathError{Op: "rmdir", Path: dir, Err: syscall.EBUSY}
				}
			}
			if pids, _ := readPids(filepath.Join(dir, "cgroup.procs")); len(pids) > 0 {
				return &os.PathError{Op: "rmdir", Path: dir, Err: syscall.EBUSY}
			}
			return os.RemoveAll(dir)
		},
	}
}

// join moves pid into the cgroup of procs as the kernel does: out of
// every other cgroup.procs of the same hierarchy (on v1 the first
// directory below the root; on v2 the whole tree).
func (f *fakeHost) join(procs string, pid int) error {
	top := f.root
	if !f.v2 {
		rel, err := filepath.Rel(f.root, procs)
		if err != nil {
			return err
		}
		top = filepath.Join(f.root, strings.Split(rel, string(filepath.Separator))[0])
	}
	if _, err := os.Stat(procs); err != nil {
		return err
	}
	err := filepath.WalkDir(top, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.Name() != "cgroup.procs" {
			return err
		}
		pids, _ := readPids(p)
		keep := []string{}
		for _, q := range pids {
			if q != pid {
				keep = append(keep, strconv.Itoa(q))
			}
		}
		if p == procs {
			keep = append(keep, strconv.Itoa(pid))
		}
		return os.WriteFile(p, []byte(strings.Join(keep, "\n")), 0o644)
	})
	return err
}

// newFakeV1 lays out cpu, cpuacct and memory hierarchies as on the
// development machines: cpu and cpuacct at their roots, memory in
// /process_api/abc.
func newFakeV1(t *testing.T) *fakeHost {
	t.Helper()
	f := &fakeHost{root: t.TempDir(), pid: 4242, alivePid: map[int]bool{},
		self: "9:name=systemd:/\n4:memory:/process_api/abc\n2:cpuacct:/\n1:cpu:/\n0::/\n"}
	for _, d := range []string{"cpu", "cpuacct", "memory", "memory/process_api", "memory/process_api/abc"} {
		mustMkdir(t, filepath.Join(f.root, d))
		mustWrite(t, filepath.Join(f.root, d, "cgroup.procs"), "")
	}
	for _, d := range []string{"cpu", "cpuacct", "memory"} { // the host's roots
		mustWrite(t, filepath.Join(f.root, d, "release_agent"), "")
	}
	mustWrite(t, filepath.Join(f.root, "cpu", "cpu.cfs_quota_us"), "-1\n")
	mustWrite(t, filepath.Join(f.root, "cpu", "cpu.cfs_period_us"), "100000\n")
	return f
}

// newFakeV2 lays out a unified hierarchy with the server in /server.
func newFakeV2(t *testing.T) *fakeHost {
	t.Helper()
	f := &fakeHost{root: t.TempDir(), pid: 4242, alivePid: map[int]bool{}, v2: true, self: "0::/server\n"}
	for _, d := range []string{"", "server"} {
		mustMkdir(t, filepath.Join(f.root, d))
		mustWrite(t, filepath.Join(f.root, d, "cgroup.controllers"), "cpuset cpu io memory pids\n")
		mustWrite(t, filepath.Join(f.root, d, "cgroup.subtree_control"), "")
		mustWrite(t, filepath.Join(f.root, d, "cgroup.procs"), "")
	}
	mustWrite(t, filepath.Join(f.root, "server", "cpu.max"), "150000 100000\n")
	mustWrite(t, filepath.Join(f.root, "server", "cgroup.type"), "domain\n") // not the host's root
	return f
}

func mustMkdir(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
}

func mustWrite(t *testing.T, file, content string) {
	t.Helper()
	if err := os.WriteFile(file, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// fileHas checks a control file's content, ignoring surrounding space.
func fileHas(t *testing.T, file, want string) {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Errorf("read %s: %v", file, err)
		return
	}
	if got := strings.TrimSpace(string(b)); got != want {
		t.Errorf("%s = %q, want %q", file, got, want)
	}
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

func sortedInts(v []int) []int {
	v = slices.Clone(v)
	slices.Sort(v)
	return v
}
