package limiter

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// newFakeDelegated lays out a unified hierarchy whose cgroup of the
// server, a systemd user service, is delegated to it: the server and one
// other process of the service are in it.
func newFakeDelegated(t *testing.T) (*fakeHost, string) {
	t.Helper()
	f := &fakeHost{root: t.TempDir(), pid: 4242, alivePid: map[int]bool{}, v2: true,
		self: "0::/user.slice/user-1000.slice/user@1000.service/app.slice/sloserve.service\n"}
	own := filepath.Join(f.root, "user.slice/user-1000.slice/user@1000.service/app.slice/sloserve.service")
	for d := own; ; d = filepath.Dir(d) {
		mustMkdir(t, d)
		mustWrite(t, filepath.Join(d, "cgroup.controllers"), "cpu memory pids\n")
		mustWrite(t, filepath.Join(d, "cgroup.subtree_control"), "")
		mustWrite(t, filepath.Join(d, "cgroup.procs"), "")
		if d == f.root {
			break
		}
		mustWrite(t, filepath.Join(d, "cgroup.type"), "domain\n") // not the host's root
	}
	mustWrite(t, filepath.Join(own, "cgroup.procs"), "4242\n4300\n")
	return f, own
}

// grant lets the server write below dir only.
func grant(dir string) func(string) error {
	return func(p string) error {
		if p == dir || strings.HasPrefix(p, dir+"/") {
			return nil
		}
		return &os.PathError{Op: "access", Path: p, Err: syscall.EACCES}
	}
}

// A delegated subtree is found, the server's processes move to a leaf,
// cpu and memory are enabled for the children, and the cgroup backend
// runs below it.
func TestDelegated(t *testing.T) {
	f, own := newFakeDelegated(t)
	l, err := newDelegated(Options{Root: f.root, Period: DefaultPeriod, Logger: testLogger(t)}, f.env(), grant(own), testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	leaf := filepath.Join(own, delegatedLeaf)
	fileHas(t, filepath.Join(leaf, "cgroup.procs"), "4300") // the last process written (the fake keeps one)
	fileHas(t, filepath.Join(own, "cgroup.subtree_control"), "+cpu +memory")
	if l.Kind() != KindCgroupV2 || !strings.HasPrefix(l.Describe(), "delegated cgroup v2 subtree "+own+" (the server's 2 process(es) moved to sloserve-server): cgroup v2 cpu.max") ||
		strings.Contains(l.Describe(), "host's root") {
		t.Errorf("kind %s, Describe() = %q (a delegated subtree is not the host's root)", l.Kind(), l.Describe())
	}
	pl, err := l.Place("m", Share{Compute: 0.5, Memory: 64 << 20, Mode: ModeFloor})
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(own, "sloserve-4242", "m", "cgroup.procs"); len(pl.JoinCgroups) != 1 || pl.JoinCgroups[0] != want {
		t.Errorf("JoinCgroups %v, want [%s]", pl.JoinCgroups, want)
	}
	fileHas(t, filepath.Join(own, "sloserve-4242", "m", "memory.max"), "67108864")
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if exists(filepath.Join(own, "sloserve-4242")) || !exists(leaf) {
		t.Error("after Close: want the units' parent gone and the server's leaf kept (the server is in it)")
	}

	// A second start finds the server in the leaf already.
	f.self = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/sloserve.service/sloserve-server\n"
	if dir, err := findDelegated(f.root, f.env(), grant(own)); err != nil || dir != own {
		t.Errorf("server in the leaf: %q, %v; want %s", dir, err, own)
	}
}

// What is not a delegated subtree, and why.
func TestDelegatedRefused(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(f *fakeHost, own string) func(string) error
		want  string
	}{
		{"not writable", func(f *fakeHost, own string) func(string) error { return grant(filepath.Dir(own) + "/other") },
			"is not writable by uid"},
		{"procs not writable", func(f *fakeHost, own string) func(string) error {
			return func(p string) error {
				if strings.HasSuffix(p, "cgroup.procs") {
					return syscall.EROFS
				}
				return nil
			}
		}, "cgroup.procs is not writable by uid " + strconv.Itoa(os.Getuid()) + ": read-only file system"},
		{"no memory controller", func(f *fakeHost, own string) func(string) error {
			mustWrite(t, filepath.Join(own, "cgroup.controllers"), "cpu pids\n")
			return grant(own)
		}, "controller memory is not delegated"},
		{"no v2 line", func(f *fakeHost, own string) func(string) error {
			f.self = "4:memory:/\n"
			return grant(own)
		}, "no cgroup v2 (0::) line"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, own := newFakeDelegated(t)
			access := tc.setup(f, own)
			_, err := newDelegated(Options{Root: f.root, Period: DefaultPeriod, Logger: testLogger(t)}, f.env(), access, testLogger(t))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want it to say %q", err, tc.want)
			}
			if exists(filepath.Join(own, delegatedLeaf)) {
				t.Error("a refused subtree got a leaf")
			}
		})
	}
	f := newFakeV1(t)
	if _, err := findDelegated(f.root, f.env(), grant(f.root)); err == nil || !strings.Contains(err.Error(), "not a unified") {
		t.Errorf("cgroup v1: %v", err)
	}
}
