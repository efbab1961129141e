package server

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

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

// Readiness turns true once, when the initial loads are done, and never
// once the shutdown has begun: loads that end during the shutdown do not
// make the server ready again.
func TestReadinessNeverReturnsAfterShutdown(t *testing.T) {
	var b backend
	if !b.markReady() || b.state.Load() != stateReady {
		t.Fatal("the initial loads did not make the backend ready")
	}
	b.shutdown()
	if b.markReady() || b.state.Load() != stateShuttingDown {
		t.Error("ready again after the shutdown began")
	}
	var late backend
	late.shutdown()
	if late.markReady() || late.state.Load() != stateShuttingDown {
		t.Error("loads that ended after the shutdown began made the backend ready")
	}
}
