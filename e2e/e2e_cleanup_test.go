package e2e

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// `sloserve cleanup` after a server was killed with SIGKILL: the dead
// server's cgroups (the server's own beside its units' too) and socket
// folder go, a live server's stay, a folder
// made by hand with the dead server's pid in its name stays, and the
// command says what it removed.
func TestE2ECleanupCommand(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
	live := startServer(t, repo, "")
	requireCgroups(t, live.control(t))
	dead := startServer(t, repo, "")
	deadPid := dead.cmd.Process.Pid
	runners := dead.runnerPids(t, repo)
	requireServerCgroup(t, live.cmd.Process.Pid)
	requireServerCgroup(t, deadPid)
	cgroups := serverCgroups(t, deadPid)
	sockets, err := filepath.Glob(filepath.Join(os.TempDir(), fmt.Sprintf("sloserve-%d-*", deadPid)))
	if err != nil || len(sockets) != 1 {
		t.Fatalf("socket folder of the server: %v %v, want one", sockets, err)
	}
	liveCgroups := serverCgroups(t, live.cmd.Process.Pid)
	liveSockets, _ := filepath.Glob(filepath.Join(os.TempDir(), fmt.Sprintf("sloserve-%d-*", live.cmd.Process.Pid)))

	// Every server cleans up dead servers' leftovers as it starts: one
	// started meanwhile by another test or package on the machine may
	// remove the dead server's cgroups before the command does (make test
	// run beside two CPU burners: "removed 0 cgroup folders", the folders
	// gone). The servers whose cgroups sit beside the dead one's are
	// listed before the kill and after the command to tell.
	before := serversBeside(cgroups)
	dead.kill(t)
	waitFor(t, "the runners to die with the server", 10*time.Second, func() bool { return !anyAlive(runners) })
	for _, dir := range append(slices.Clone(cgroups), sockets...) {
		if _, err := os.Stat(dir); err != nil {
			if started := serversStarted(cgroups, before, deadPid); len(started) > 0 {
				t.Skipf("%s is gone before the cleanup (%v), and servers started meanwhile (%v) clean up too: nothing left for the command", dir, err, started)
			}
			t.Fatalf("%s is gone before the cleanup (%v): nothing to test", dir, err)
		}
	}

	// A folder named like a dead server's but made by hand: it is no
	// server's (no owner file) and must survive.
	backup := filepath.Join(os.TempDir(), fmt.Sprintf("sloserve-%d-backup", deadPid))
	if err := os.MkdirAll(backup, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(backup) })
	if err := os.WriteFile(filepath.Join(backup, "notes.txt"), []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}

	out, err := exec.Command(sloserveBin, "cleanup").Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("sloserve cleanup: %v\n%s", err, ee.Stderr)
		}
		t.Fatal(err)
	}
	// Other tests' servers may have died before; at least the killed one's.
	var nCgroups, nSockets int
	if _, err := fmt.Sscanf(string(out), "removed %d cgroup folders and %d socket folders", &nCgroups, &nSockets); err != nil {
		t.Fatalf("output %q: %v", out, err)
	}
	started := serversStarted(cgroups, before, deadPid)
	switch {
	case (nCgroups < 1 || nSockets < 1) && len(started) > 0:
		t.Logf("output %q: the dead server's folders not all counted, and servers started meanwhile (%v) clean up too", strings.TrimSpace(string(out)), started)
	case nCgroups < 1 || nSockets < 1:
		t.Errorf("output %q: want the dead server's cgroups and socket folder counted", strings.TrimSpace(string(out)))
	}
	for _, dir := range append(slices.Clone(cgroups), sockets...) {
		if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s of the killed server is still there after the cleanup (%v)", dir, err)
		}
	}
	for _, dir := range append(slices.Clone(liveCgroups), liveSockets...) {
		if _, err := os.Stat(dir); err != nil {
			t.Errorf("%s of the live server was removed: %v", dir, err)
		}
	}
	if b, err := os.ReadFile(filepath.Join(backup, "notes.txt")); err != nil || string(b) != "keep me" {
		t.Errorf("a hand-made %s after the cleanup: %q, %v; want it kept", backup, b, err)
	}
	if code, b, _ := live.do(t, "POST", "/v2/models/dyn/infer", dynBody); code != 200 {
		t.Errorf("the live server after the cleanup: %d %s", code, b)
	}
}

// serversBeside names the sloserve-<pid> cgroup folders beside those in
// dirs: the servers running on the machine (and dead ones not yet cleaned
// up). Each name carries its folder's inode: a test binary that runs
// servers in its own process one after another makes its sloserve-<pid>
// folder anew for each, under one name.
func serversBeside(dirs []string) []string {
	var names []string
	for _, dir := range dirs {
		matches, _ := filepath.Glob(filepath.Join(filepath.Dir(dir), "sloserve-*"))
		for _, m := range matches {
			fi, err := os.Stat(m)
			if err != nil {
				continue // gone meanwhile
			}
			name := filepath.Base(m)
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				name += "@" + strconv.FormatUint(st.Ino, 10)
			}
			if !slices.Contains(names, name) {
				names = append(names, name)
			}
		}
	}
	return names
}

// serversStarted are the servers of serversBeside(dirs) that were not in
// before, less those of the server of pid.
func serversStarted(dirs, before []string, pid int) []string {
	own := fmt.Sprintf("sloserve-%d", pid)
	return slices.DeleteFunc(serversBeside(dirs), func(name string) bool {
		base, _, _ := strings.Cut(name, "@")
		return slices.Contains(before, name) || base == own || strings.HasPrefix(base, own+"-")
	})
}
