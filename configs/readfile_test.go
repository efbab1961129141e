package configs

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// hostileFile makes, at path, one of the files a config reader must refuse
// without hanging or exhausting memory, and returns the error it must wrap.
type hostileFile struct {
	name string
	make func(t *testing.T, path string)
	want error
}

func hostileFiles() []hostileFile {
	return []hostileFile{
		{"symlink to /dev/zero", func(t *testing.T, path string) {
			if err := os.Symlink("/dev/zero", path); err != nil {
				t.Fatal(err)
			}
		}, ErrNotRegular},
		{"FIFO", func(t *testing.T, path string) {
			if err := syscall.Mkfifo(path, 0o644); err != nil {
				t.Fatal(err)
			}
		}, ErrNotRegular},
		{"symlink to a FIFO", func(t *testing.T, path string) {
			fifo := path + ".fifo"
			if err := syscall.Mkfifo(fifo, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(fifo, path); err != nil {
				t.Fatal(err)
			}
		}, ErrNotRegular},
		{"folder", func(t *testing.T, path string) {
			if err := os.Mkdir(path, 0o755); err != nil {
				t.Fatal(err)
			}
		}, ErrNotRegular},
		{"oversized", func(t *testing.T, path string) {
			// Valid YAML, so only the size can refuse it.
			data := "name: m\n#" + strings.Repeat("x", MaxConfigFile) + "\n"
			if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
				t.Fatal(err)
			}
		}, ErrTooLarge},
	}
}

// within fails the test when f does not return in time (a FIFO read
// blocks for ever).
func within[T any](t *testing.T, f func() (T, error)) (T, error) {
	t.Helper()
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := f()
		done <- result{v, err}
	}()
	select {
	case r := <-done:
		return r.v, r.err
	case <-time.After(10 * time.Second):
		t.Fatal("the read hung")
	}
	panic("unreachable")
}

func TestReadFile(t *testing.T) {
	for _, h := range hostileFiles() {
		t.Run(h.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "c.yaml")
			h.make(t, path)
			data, err := within(t, func() ([]byte, error) { return ReadFile(path) })
			if !errors.Is(err, h.want) {
				t.Fatalf("err = %v (%d bytes read), want %v", err, len(data), h.want)
			}
			if !strings.Contains(err.Error(), path) {
				t.Errorf("error does not name the file: %v", err)
			}
		})
	}
	t.Run("regular through a symlink, at the limit", func(t *testing.T) {
		dir := t.TempDir()
		want := strings.Repeat("x", MaxConfigFile)
		if err := os.WriteFile(filepath.Join(dir, "real"), []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("real", filepath.Join(dir, "link")); err != nil {
			t.Fatal(err)
		}
		got, err := ReadFile(filepath.Join(dir, "link"))
		if err != nil || string(got) != want {
			t.Fatalf("read %d bytes, err %v; want %d bytes", len(got), err, len(want))
		}
	})
	t.Run("missing", func(t *testing.T) {
		if _, err := ReadFile(filepath.Join(t.TempDir(), "nope")); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("err = %v, want ErrNotExist", err)
		}
	})
}

// TestLoadRefusesHostileConfigs: the model config (load and poll go
// through LoadModel) and the server config (startup and reload go through
// LoadServer) refuse a device, a FIFO and an oversized file.
func TestLoadRefusesHostileConfigs(t *testing.T) {
	for _, h := range hostileFiles() {
		t.Run("model/"+h.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "m")
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(dir, ModelConfigFile)
			h.make(t, path)
			m, err := within(t, func() (*Model, error) { return LoadModel(dir) })
			if !errors.Is(err, h.want) || !strings.Contains(err.Error(), path) {
				t.Fatalf("LoadModel = %+v, %v; want %v naming %s", m, err, h.want, path)
			}
		})
		t.Run("server/"+h.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "sloserve.yaml")
			h.make(t, path)
			s, err := within(t, func() (*Server, error) { return LoadServer(path) })
			if !errors.Is(err, h.want) || !strings.Contains(err.Error(), path) {
				t.Fatalf("LoadServer = %+v, %v; want %v naming %s", s, err, h.want, path)
			}
		})
	}
}
