package runtime

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestRunnerServesWithoutAWritableHome: ONNX Runtime's telemetry keeps a
// SQLite database under $XDG_CACHE_HOME or $HOME/.cache
// (Microsoft/DeveloperTools/.onnxruntime), written at every start. With a
// read-only home (a read-only root filesystem, a non-root image) or none,
// a runner still starts and serves correct outputs: ONNX Runtime keeps the
// database in memory (and writes a `:memory:.ses` into the working
// folder), or makes the missing folders.
func TestRunnerServesWithoutAWritableHome(t *testing.T) {
	for _, tc := range []struct {
		name string
		home func(t *testing.T) string
	}{
		{"read-only", func(t *testing.T) string {
			home := t.TempDir()
			// chmod does not stop root: a read-only bind mount does.
			if err := syscall.Mount(home, home, "", syscall.MS_BIND, ""); err != nil {
				t.Skipf("bind mount (needs root): %v", err)
			}
			t.Cleanup(func() { _ = syscall.Unmount(home, syscall.MNT_DETACH) })
			if err := syscall.Mount("", home, "", syscall.MS_BIND|syscall.MS_REMOUNT|syscall.MS_RDONLY, ""); err != nil {
				t.Skipf("read-only remount: %v", err)
			}
			if err := os.Mkdir(filepath.Join(home, "probe"), 0o700); err == nil {
				t.Fatal("the read-only home took a folder")
			}
			return home
		}},
		{"missing", func(t *testing.T) string { return filepath.Join(t.TempDir(), "no", "home") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The model first: finding it may run the go command, which
			// keeps telemetry of its own under HOME.
			cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
			cfg.MaxRestarts = 0 // a runner that dies fails the test
			t.Setenv("HOME", tc.home(t))
			t.Setenv("XDG_CACHE_HOME", "")
			os.Unsetenv("XDG_CACHE_HOME")
			t.Chdir(t.TempDir()) // the runner's working folder
			r, err := StartRunner(t.Context(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			pid := r.Pid()
			for i := range 3 {
				req, want := rowSumsRequest(rand.New(rand.NewPCG(uint64(i), 7)), 1+i)
				resp, err := r.Infer(t.Context(), req)
				if err != nil {
					t.Fatal(err)
				}
				checkRowSums(t, resp, want)
			}
			if r.Pid() != pid {
				t.Errorf("the runner restarted: pid %d, then %d", pid, r.Pid())
			}
			if err := r.Stop(t.Context()); err != nil {
				t.Fatal(err)
			}
		})
	}
}
