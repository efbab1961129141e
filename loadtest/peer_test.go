package loadtest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

func TestParseCPUCgroup(t *testing.T) {
	v1 := "12:pids:/\n4:memory:/process_api/abc\n2:cpuacct:/\n1:cpu:/sloserve-41-server\n0::/\n"
	v1joint := "3:cpu,cpuacct:/a/sloserve-41-server\n0::/\n"
	v2 := "0::/user.slice/sloserve-41-server\n"
	mounts := func(paths ...string) func(string) bool {
		return func(p string) bool {
			for _, q := range paths {
				if p == q {
					return true
				}
			}
			return false
		}
	}
	cases := []struct {
		name, file string
		exists     func(string) bool
		want       cpuCgroup
		ok         bool
	}{
		{"v1 cpu alone", v1, mounts("/cg/cpu/cpu.shares"), cpuCgroup{mount: "/cg/cpu", rel: "/sloserve-41-server"}, true},
		{"v1 cpu,cpuacct mounted jointly", v1joint, mounts("/cg/cpu,cpuacct/cpu.shares"), cpuCgroup{mount: "/cg/cpu,cpuacct", rel: "/a/sloserve-41-server"}, true},
		{"v1 cpu,cpuacct through the cpu link", v1joint, mounts("/cg/cpu/cpu.shares"), cpuCgroup{mount: "/cg/cpu", rel: "/a/sloserve-41-server"}, true},
		{"v1 listed but not mounted", v1, mounts(), cpuCgroup{}, false},
		{"v2", v2, mounts("/cg/cgroup.controllers"), cpuCgroup{mount: "/cg", rel: "/user.slice/sloserve-41-server", v2: true}, true},
		{"v2 not mounted", v2, mounts(), cpuCgroup{}, false},
		{"garbage", "nonsense\n::\n", mounts("/cg/cgroup.controllers"), cpuCgroup{}, false},
	}
	for _, c := range cases {
		got, ok := parseCPUCgroup([]byte(c.file), "/cg", c.exists)
		if got != c.want || ok != c.ok {
			t.Errorf("%s: got %+v %v, want %+v %v", c.name, got, ok, c.want, c.ok)
		}
	}
}

// A load generator beside a server in a cgroup of its own (as the cgroup
// limiter puts the server) joins a cgroup beside it at the same weight,
// and leave takes it back and removes that cgroup; beside a server in no
// cgroup of its own it stays where it is. Real cgroups: root only.
func TestJoinPeerCgroupReal(t *testing.T) {
	self, ok := cpuCgroupOf(os.Getpid())
	if !ok || os.Geteuid() != 0 {
		if os.Getenv("SLOSERVE_REQUIRE_CGROUPS") == "1" {
			t.Fatalf("no writable cpu cgroup (root %v, found %v) and SLOSERVE_REQUIRE_CGROUPS=1", os.Geteuid() == 0, ok)
		}
		t.Skip("needs root and a cpu cgroup")
	}
	server := exec.Command("sleep", "60")
	if err := server.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Process.Kill(); server.Wait() })

	leave, desc := joinPeerCgroup(server.Process.Pid)
	if !strings.HasPrefix(desc, "default weight") {
		t.Fatalf("beside a server in no cgroup of its own: %q, want the default weight", desc)
	}
	if err := leave(); err != nil {
		t.Fatal(err)
	}

	dir := filepath.Join(self.dir(), "sloserve-"+strconv.Itoa(server.Process.Pid)+"-server")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(filepath.Join(self.dir(), "cgroup.procs"), []byte(strconv.Itoa(server.Process.Pid)), 0)
		os.Remove(dir)
	})
	weight := "8192"
	if self.v2 {
		weight = "800"
	}
	for file, v := range map[string]string{self.weightFile(): weight, "cgroup.procs": strconv.Itoa(server.Process.Pid)} {
		if err := os.WriteFile(filepath.Join(dir, file), []byte(v), 0); err != nil {
			t.Fatal(err)
		}
	}
	leave, desc = joinPeerCgroup(server.Process.Pid)
	t.Log(desc)
	peer := filepath.Join(self.dir(), "sloserve-"+strconv.Itoa(os.Getpid())+"-loadtest")
	got, ok := cpuCgroupOf(os.Getpid())
	if !ok || got.dir() != peer {
		leave()
		t.Fatalf("the generator's cpu cgroup is %s, want %s (%s)", got.dir(), peer, desc)
	}
	w, err := os.ReadFile(filepath.Join(peer, self.weightFile()))
	if err != nil || strings.TrimSpace(string(w)) != weight {
		leave()
		t.Fatalf("the generator's weight %q (%v), want the server's %s", w, err, weight)
	}
	if err := leave(); err != nil {
		t.Fatal(err)
	}
	if got, _ := cpuCgroupOf(os.Getpid()); got.dir() != self.dir() {
		t.Errorf("after leave the generator is in %s, want %s", got.dir(), self.dir())
	}
	if _, err := os.Stat(peer); !os.IsNotExist(err) {
		t.Errorf("after leave %s is still there (%v)", peer, err)
	}
}
