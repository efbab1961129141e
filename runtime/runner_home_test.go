package runtime

import (
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// TestRunnerWritesNothingUnderHome: ONNX Runtime's telemetry database
// goes to the runner's own folder (its XDG_CACHE_HOME), removed when the
// process ends, never under $HOME: not into the user's home, where every
// runner queued on one file, and a read-only or missing home costs
// nothing. The runner serves correct outputs in every case.
func TestRunnerWritesNothingUnderHome(t *testing.T) {
	for _, tc := range []struct {
		name string
		home func(t *testing.T) string
	}{
		{"writable", func(t *testing.T) string { return t.TempDir() }},
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
			home := tc.home(t)
			t.Setenv("HOME", home)
			t.Setenv("XDG_CACHE_HOME", "")
			os.Unsetenv("XDG_CACHE_HOME")
			r, err := StartRunner(t.Context(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			folders, _ := filepath.Glob(filepath.Join(cfg.SocketDir, RunnerTempPrefix+"*"))
			if len(folders) != 1 {
				t.Fatalf("runner folders %v, want one", folders)
			}
			own := folders[0]
			// ONNX Runtime writes the database from a thread of its own,
			// not always before the runner is ready: seeing it shows the
			// telemetry ran, and where.
			tail := filepath.Join("Microsoft", "DeveloperTools", ".onnxruntime", "onnxruntime.db")
			db, inHome := filepath.Join(own, tail), filepath.Join(home, ".cache", tail)
			waitFor(t, 30*time.Second, "ONNX Runtime's telemetry database", func() bool {
				_, err := os.Stat(db)
				_, errHome := os.Stat(inHome)
				return err == nil || errHome == nil
			})
			if _, err := os.Stat(db); err != nil {
				t.Errorf("no telemetry database in the runner's folder: %v", err)
			}
			for i := range 3 {
				req, want := rowSumsRequest(rand.New(rand.NewPCG(uint64(i), 7)), 1+i)
				resp, err := r.Infer(t.Context(), req)
				if err != nil {
					t.Fatal(err)
				}
				checkRowSums(t, resp, want)
			}
			if err := r.Stop(t.Context()); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(own); !os.IsNotExist(err) {
				t.Errorf("the runner's folder %s outlived it: %v", own, err)
			}
			filepath.WalkDir(home, func(path string, d fs.DirEntry, err error) error {
				if err == nil && path != home {
					t.Errorf("written under HOME: %s", path)
				}
				return nil
			})
		})
	}
}
