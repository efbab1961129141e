package server

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	"github.com/sloserve/sloserve/runtime"
)

// TestRemoveStaleSocketDirs: only the temporary folders a server of ours
// provably made (owner file naming the folder's pid, this user's, holding
// only what a server leaves) of a server that is gone are removed;
// everything else named sloserve-<pid>-* stays, whatever its pid.
func TestRemoveStaleSocketDirs(t *testing.T) {
	tmp := t.TempDir()
	// A pid that has surely exited: a finished child's.
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	dead, live, self := cmd.Process.Pid, os.Getppid(), os.Getpid()
	outside := t.TempDir() // what links point at: must survive
	keep := filepath.Join(outside, "precious")
	if err := os.WriteFile(keep, []byte("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	mk := func(name string) string {
		dir := filepath.Join(tmp, name)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	owner := func(dir, kind string, pid int, start string) {
		if err := os.WriteFile(filepath.Join(dir, ownerFile), ownerLine(kind, pid, start), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	socket := func(path string) {
		ln, err := net.Listen("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		ln.(*net.UnixListener).SetUnlinkOnClose(false)
		ln.Close()
	}
	file := func(path string) {
		if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// A socket folder as a server and its runners leave it.
	sockets := func(name string, pid int, start string) string {
		dir := mk(name)
		owner(dir, dirSockets, pid, start)
		socket(filepath.Join(dir, "sloserve-1-1.sock"))
		file(filepath.Join(dir, runtime.RunnerTempPrefix+"123", "mat-debug-77.log"))
		file(filepath.Join(dir, runtime.RunnerTempPrefix+"123", ".ses"))
		file(filepath.Join(dir, runtime.RunnerTempPrefix+"123", runtime.RunnerTelemetryDir, "onnxruntime.db"))
		return dir
	}
	deadStart, liveStart := "12345", processStart(live)
	if liveStart == "" {
		t.Fatal("cannot read the start time of the parent process")
	}

	gone := map[string]bool{} // name -> removed
	gone[filepath.Base(sockets(name("sloserve-%d-111", dead), dead, deadStart))] = true
	gone[filepath.Base(sockets(name("sloserve-%d-222", live), live, liveStart))] = false
	gone[filepath.Base(sockets(name("sloserve-%d-333", live), live, liveStart+"0"))] = true // pid reused
	gone[filepath.Base(sockets(name("sloserve-%d-444", self), self, processStart(self)))] = false
	gone[filepath.Base(sockets(name("sloserve-%d-555", dead), dead+1, deadStart))] = false // owner file names another pid
	gone[filepath.Base(sockets(name("other-%d-1", dead), dead, deadStart))] = false

	// Made by hand: no owner file.
	backup := mk(name("sloserve-%d-backup", dead))
	file(filepath.Join(backup, "notes.txt"))
	gone[filepath.Base(backup)] = false
	// An owner file, and something a server does not leave there.
	extra := sockets(name("sloserve-%d-extra", dead), dead, deadStart)
	file(filepath.Join(extra, "notes.txt"))
	gone[filepath.Base(extra)] = false
	// A folder beside the telemetry's that a runner does not make.
	nested := sockets(name("sloserve-%d-nested", dead), dead, deadStart)
	file(filepath.Join(nested, runtime.RunnerTempPrefix+"123", "Microsoft", "DeveloperTools", "other", "x"))
	gone[filepath.Base(nested)] = false
	// A link among the runner's files.
	linked := sockets(name("sloserve-%d-linked", dead), dead, deadStart)
	if err := os.Symlink(keep, filepath.Join(linked, runtime.RunnerTempPrefix+"123", "l")); err != nil {
		t.Fatal(err)
	}
	gone[filepath.Base(linked)] = false
	// The owner file is a link to a good one.
	good := sockets(filepath.Base(outside)+"-src", dead, deadStart)
	fake := mk(name("sloserve-%d-fake", dead))
	if err := os.Symlink(filepath.Join(good, ownerFile), filepath.Join(fake, ownerFile)); err != nil {
		t.Fatal(err)
	}
	gone[filepath.Base(fake)] = false
	gone[filepath.Base(good)] = false
	// The folder is a link to a server's folder elsewhere.
	target := filepath.Join(outside, "target")
	if err := os.Mkdir(target, 0o700); err != nil {
		t.Fatal(err)
	}
	owner(target, dirSockets, dead, deadStart)
	if err := os.Symlink(target, filepath.Join(tmp, name("sloserve-%d-link", dead))); err != nil {
		t.Fatal(err)
	}
	gone[name("sloserve-%d-link", dead)] = false
	// A staged repository: its links go, what they point at stays.
	models := mk(name("sloserve-%d-models-1", dead))
	owner(models, dirModels, dead, deadStart)
	file(filepath.Join(models, "m", "config.yaml"))
	if err := os.Symlink(outside, filepath.Join(models, "m", "1")); err != nil {
		t.Fatal(err)
	}
	gone[filepath.Base(models)] = true
	// Another user's, when the test may make one.
	if os.Getuid() == 0 {
		theirs := sockets(name("sloserve-%d-theirs", dead), dead, deadStart)
		if err := os.Chown(theirs, 65534, 65534); err != nil {
			t.Fatal(err)
		}
		gone[filepath.Base(theirs)] = false
	}

	removed := removeStaleSocketDirs(tmp, slog.New(slog.DiscardHandler))
	for n, want := range gone {
		_, err := os.Lstat(filepath.Join(tmp, n))
		if got := err != nil; got != want {
			t.Errorf("%s: removed=%v, want %v", n, got, want)
		}
		if want && !slices.Contains(removed, filepath.Join(tmp, n)) {
			t.Errorf("%s removed but not reported", n)
		}
	}
	if b, err := os.ReadFile(keep); err != nil || string(b) != "data" {
		t.Errorf("a file a link pointed at: %q, %v", b, err)
	}
	if _, err := os.Stat(filepath.Join(target, ownerFile)); err != nil {
		t.Errorf("a linked folder's contents: %v", err)
	}
}

// TestMakeServerDir: the folders a server makes carry an owner file that
// names this process, and are removed once the pid is taken for another
// process's (no process of this start time runs).
func TestMakeServerDir(t *testing.T) {
	t.Setenv("TMPDIR", t.TempDir())
	dir, err := makeServerDir(dirSockets, "")
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, ownerFile))
	if want := ownerLine(dirSockets, os.Getpid(), processStart(os.Getpid())); err != nil || string(b) != string(want) {
		t.Fatalf("owner file %q, %v; want %q", b, err, want)
	}
	if _, ok := staleServerDir(dir, filepath.Base(dir)); ok {
		t.Error("this process's own folder is taken for stale")
	}
}

func name(format string, pid int) string { return fmt.Sprintf(format, pid) }
