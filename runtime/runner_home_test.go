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

// ortCIVariables turn ONNX Runtime's telemetry off wherever one is set
// (read off the 1.30 library; CI tried by hand): the tests that need it on
// to show where it writes clear them, or on a CI machine they could not
// fail.
var ortCIVariables = []string{"CI", "TF_BUILD", "GITHUB_ACTIONS", "GITLAB_CI", "CIRCLECI", "TRAVIS",
	"JENKINS_URL", "CODEBUILD_BUILD_ID", "BUILDKITE", "TEAMCITY_VERSION", "APPVEYOR", "BITBUCKET_BUILD_NUMBER"}

// telemetryAsDeployed makes the test's environment one where ONNX
// Runtime's telemetry would run but for what sloserve does: no CI
// variable, no TelemetryEnv of the operator's.
func telemetryAsDeployed(t *testing.T) {
	for _, v := range append([]string{TelemetryEnv}, ortCIVariables...) {
		t.Setenv(v, "")
		os.Unsetenv(v)
	}
}

// TestRunnerWritesNothingUnderHome: a runner keeps ONNX Runtime's
// telemetry off, so it writes no database, sends nothing and leaves
// nothing behind; an operator who turns it on (TelemetryEnv=0) gets the
// database in the runner's own folder (its XDG_CACHE_HOME), removed when
// the process ends, never under $HOME: not into the user's home, where
// every runner queued on one file. A writable, read-only or missing home
// costs nothing, and the runner serves correct outputs in every case.
func TestRunnerWritesNothingUnderHome(t *testing.T) {
	tail := filepath.Join("Microsoft", "DeveloperTools", ".onnxruntime", "onnxruntime.db")
	// How long the database took to appear with telemetry on: the runs
	// with it off watch for twice as long.
	var took time.Duration
	for _, tc := range []struct {
		name string
		on   bool
		home func(t *testing.T) string
	}{
		{"on", true, func(t *testing.T) string { return t.TempDir() }},
		{"writable", false, func(t *testing.T) string { return t.TempDir() }},
		{"read-only", false, func(t *testing.T) string {
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
		{"missing", false, func(t *testing.T) string { return filepath.Join(t.TempDir(), "no", "home") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The model first: finding it may run the go command, which
			// keeps telemetry of its own under HOME.
			cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
			home := tc.home(t)
			telemetryAsDeployed(t)
			t.Setenv("HOME", home)
			t.Setenv("XDG_CACHE_HOME", "")
			os.Unsetenv("XDG_CACHE_HOME")
			if tc.on {
				cfg.Env = append(cfg.Env, TelemetryEnv+"=0")
			} else if took == 0 {
				t.Skip("the run with telemetry on did not finish")
			}
			start := time.Now()
			r, err := StartRunner(t.Context(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			folders, _ := filepath.Glob(filepath.Join(cfg.SocketDir, RunnerTempPrefix+"*"))
			if len(folders) != 1 {
				t.Fatalf("runner folders %v, want one", folders)
			}
			own := folders[0]
			db, inHome := filepath.Join(own, tail), filepath.Join(home, ".cache", tail)
			written := func() bool {
				_, err := os.Stat(db)
				_, errHome := os.Stat(inHome)
				return err == nil || errHome == nil
			}
			if tc.on {
				// ONNX Runtime writes the database from a thread of its
				// own, not always before the runner is ready: seeing it
				// shows the telemetry ran, and where.
				waitFor(t, 30*time.Second, "ONNX Runtime's telemetry database", written)
				took = time.Since(start)
				if _, err := os.Stat(db); err != nil {
					t.Errorf("no telemetry database in the runner's folder: %v", err)
				}
			} else {
				for time.Since(start) < 2*took && !written() {
					time.Sleep(10 * time.Millisecond)
				}
				entries, _ := os.ReadDir(own)
				for _, e := range entries {
					t.Errorf("with telemetry off, the runner wrote %s in its folder (%s after its start; the database took %s with it on)",
						e.Name(), time.Since(start).Round(time.Millisecond), took.Round(time.Millisecond))
				}
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
