package server

import (
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

func TestRemoveStaleSocketDirs(t *testing.T) {
	tmp := t.TempDir()
	// A pid that has surely exited: a finished child's.
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	dead := strconv.Itoa(cmd.Process.Pid)
	live := strconv.Itoa(os.Getppid())
	self := strconv.Itoa(os.Getpid())
	dirs := map[string]bool{ // name -> should survive
		"sloserve-" + dead + "-123": false,
		"sloserve-" + live + "-456": true,
		"sloserve-" + self + "-789": true,
		"sloserve-notapid-1":        true,
		"other-" + dead + "-1":      true,
	}
	for name := range dirs {
		if err := os.MkdirAll(filepath.Join(tmp, name, "x.sock"), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	removeStaleSocketDirs(tmp, slog.New(slog.DiscardHandler))
	for name, survive := range dirs {
		_, err := os.Stat(filepath.Join(tmp, name))
		if got := err == nil; got != survive {
			t.Errorf("%s: exists=%v, want %v", name, got, survive)
		}
	}
}

func TestFindONNXRuntime(t *testing.T) {
	lib := filepath.Join(t.TempDir(), "libonnxruntime.so")
	if err := os.WriteFile(lib, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := FindONNXRuntime(lib); err != nil || got != lib {
		t.Errorf("configured path: %q, %v", got, err)
	}
	if _, err := FindONNXRuntime(lib + ".missing"); err == nil {
		t.Error("a configured path that does not exist must be an error")
	}
	for _, system := range []string{"/opt/sloserve/lib/libonnxruntime.so.1.30.0", "/usr/local/lib/libonnxruntime.so", "/usr/lib/libonnxruntime.so"} {
		if _, err := os.Stat(system); err == nil {
			t.Skipf("%s exists on this machine; auto-detection would find it", system)
		}
	}
	t.Chdir(t.TempDir())
	if _, err := FindONNXRuntime(""); err == nil || !strings.Contains(err.Error(), "make setup") {
		t.Errorf("no library anywhere: err = %v, want one that says to run make setup", err)
	}
}
