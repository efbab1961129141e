package models

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sloserve/sloserve/configs"
)

// hostileConfig replaces a model folder's config.yaml with something a
// reader must refuse at once: reading it would block for ever or without
// bound.
var hostileConfigs = []struct {
	name string
	make func(t *testing.T, path string)
}{
	{"symlink to /dev/zero", func(t *testing.T, path string) {
		if err := os.Symlink("/dev/zero", path); err != nil {
			t.Fatal(err)
		}
	}},
	{"FIFO", func(t *testing.T, path string) {
		if err := syscall.Mkfifo(path, 0o644); err != nil {
			t.Fatal(err)
		}
	}},
	{"oversized", func(t *testing.T, path string) {
		data := "name: bad\n#" + strings.Repeat("x", configs.MaxConfigFile) + "\n"
		if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}},
}

func writeHostileModel(t *testing.T, repo string, make func(*testing.T, string)) string {
	t.Helper()
	writeModel(t, repo, "bad", "name: bad\n", 1)
	path := filepath.Join(repo, "bad", configs.ModelConfigFile)
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	make(t, path)
	return path
}

// inTime fails the test when f takes more than a few seconds.
func inTime(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s hung", what)
	}
}

// TestHostileConfigInPoll: a model folder whose config is a device, a FIFO
// or too large is refused by the poll loop at once, with a reason that
// names the file, and the other models still load.
func TestHostileConfigInPoll(t *testing.T) {
	for _, h := range hostileConfigs {
		t.Run(h.name, func(t *testing.T) {
			repo := t.TempDir()
			path := writeHostileModel(t, repo, h.make)
			r, _, _ := newTestRegistry(t, ControlPoll, repo)
			inTime(t, "start", func() {
				if err := r.Start(t.Context()); err != nil {
					t.Error(err)
				}
			})
			t.Cleanup(func() { r.Stop(t.Context()) })
			// A model added later is loaded by the next pass.
			writeModel(t, repo, "zz", fmt.Sprintf(sumConfig, "zz", 1, 1), 1)
			inTime(t, "poll", func() { r.pollOnce(t.Context()) })
			if ok, err := r.ModelReady("zz", ""); !ok {
				t.Errorf("a model next to the hostile one did not load: %v", err)
			}
			idx := r.Index(false)
			if len(idx) != 2 || idx[0].Name != "bad" || idx[0].State != StateUnavailable || !strings.Contains(idx[0].Reason, path) {
				t.Errorf("index = %+v, want bad UNAVAILABLE naming %s", idx, path)
			}
			// An unchanged hostile folder is not retried on every pass.
			failures := testutil.ToFloat64(r.metrics.loadFailures.WithLabelValues("bad"))
			inTime(t, "second poll", func() { r.pollOnce(t.Context()) })
			if got := testutil.ToFloat64(r.metrics.loadFailures.WithLabelValues("bad")); got != failures || failures != 1 {
				t.Errorf("load failures = %v then %v, want 1 then 1", failures, got)
			}
		})
	}
}

// TestHostileConfigInLoad: an explicit load of such a folder fails at once
// with ErrBadConfig naming the file, and an unload afterwards works.
func TestHostileConfigInLoad(t *testing.T) {
	for _, h := range hostileConfigs {
		t.Run(h.name, func(t *testing.T) {
			repo := t.TempDir()
			path := writeHostileModel(t, repo, h.make)
			r, _, _ := newTestRegistry(t, ControlExplicit, repo)
			if err := r.Start(t.Context()); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { r.Stop(t.Context()) })
			var err error
			inTime(t, "load", func() { err = r.Load(t.Context(), "bad") })
			if !errors.Is(err, ErrBadConfig) || !strings.Contains(err.Error(), path) {
				t.Errorf("Load = %v, want ErrBadConfig naming %s", err, path)
			}
			inTime(t, "unload", func() { err = r.Unload(t.Context(), "bad") })
			if err != nil {
				t.Errorf("Unload = %v", err)
			}
		})
	}
}
