package runtime

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// TestRunnerTempFolder: ONNX Runtime's telemetry files (mat-debug-<pid>.log,
// .ses) go to a temporary folder of each runner process's own inside the
// socket folder, never to the server's TMPDIR, and each folder is removed
// when its process ends: after a crash and restart one is left, after the
// stop none.
func TestRunnerTempFolder(t *testing.T) {
	outer := t.TempDir()
	t.Setenv("TMPDIR", outer)
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	r, err := StartRunner(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	own := func() []string {
		m, _ := filepath.Glob(filepath.Join(cfg.SocketDir, RunnerTempPrefix+"*"))
		return m
	}
	telemetry := func(dir string) []string {
		m, _ := filepath.Glob(filepath.Join(dir, "mat-debug-*.log"))
		return m
	}
	first := own()
	if len(first) != 1 {
		t.Fatalf("runner temporary folders %v, want one", first)
	}
	// ONNX Runtime writes its telemetry files from a thread of its own, not
	// always before the runner is ready (CI saw none yet at this point), so
	// the test reads the TMPDIR the process was given rather than wait for
	// a file that may come later.
	if got := environ(t, r.Pid())["TMPDIR"]; got != first[0] {
		t.Errorf("the runner's TMPDIR is %q, want its own folder %s", got, first[0])
	}
	pid := r.Pid()
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the runner restarted", func() bool { return r.Pid() != pid && r.Pid() > 0 && r.State() == RunnerReady })
	if now := own(); len(now) != 1 || now[0] == first[0] {
		t.Errorf("after a restart the temporary folders are %v, want one other than %s", now, first[0])
	}
	if err := r.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	if left := own(); len(left) != 0 {
		t.Errorf("left behind after the stop: %v", left)
	}
	if got := telemetry(outer); len(got) != 0 {
		t.Errorf("ONNX Runtime's logs in the server's TMPDIR: %v", got)
	}
}

// environ reads a process's environment from /proc.
func environ(t *testing.T, pid int) map[string]string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "environ"))
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{}
	for _, kv := range bytes.Split(raw, []byte{0}) {
		if k, v, ok := bytes.Cut(kv, []byte("=")); ok {
			env[string(k)] = string(v)
		}
	}
	return env
}
