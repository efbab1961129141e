package predictor

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestCacheRoundTrip(t *testing.T) {
	c := Cache{Dir: filepath.Join(t.TempDir(), "profiles")} // created on Store
	pts := synth(truth, []int{1, 4, 8}, []float64{0.25, 0.5, 1}, 0.03, 3)
	p, err := NewProfile("abc123", pts, time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC))
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, err := c.Load("abc123"); ok || err != nil {
		t.Fatalf("before Store: ok %v, err %v", ok, err)
	}
	if err := c.Store(p); err != nil {
		t.Fatal(err)
	}
	got, ok, err := c.Load("abc123")
	if !ok || err != nil {
		t.Fatalf("ok %v, err %v", ok, err)
	}
	if !reflect.DeepEqual(got, p) {
		t.Errorf("loaded %+v\nwant %+v", got, p)
	}
	if p.MAPE <= 0 || p.MAPE > 0.05 {
		t.Errorf("profile MAPE %g", p.MAPE)
	}
	// No temporary files are left behind.
	entries, _ := os.ReadDir(c.Dir)
	if len(entries) != 1 || entries[0].Name() != "abc123.json" {
		t.Errorf("cache dir holds %v", entries)
	}
}

func TestCacheStoreReplacesAtomically(t *testing.T) {
	c := Cache{Dir: t.TempDir()}
	profile := func(k2 float64) Profile {
		return Profile{Key: "k", Points: make([]Point, 300), Curve: Curve{K2: k2}}
	}
	if err := c.Store(profile(1)); err != nil {
		t.Fatal(err)
	}
	// Readers racing writers see one whole profile or the other.
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for w := range 2 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				if err := c.Store(profile(float64(1 + (i+w)%2))); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	for range 50 {
		p, ok, err := c.Load("k")
		if err != nil || !ok || (p.Curve.K2 != 1 && p.Curve.K2 != 2) || len(p.Points) != 300 {
			t.Errorf("torn read: ok %v, err %v, curve %+v", ok, err, p.Curve)
			break
		}
	}
	close(stop)
	wg.Wait()
}

func TestCacheCorrupt(t *testing.T) {
	c := Cache{Dir: t.TempDir()}
	for name, content := range map[string]string{
		"truncated": `{"Key": "truncated", "Curve": {"K2": 0.0`,
		"garbage":   "\x00\x01",
		"other key": `{"Key": "x", "Curve": {"K2": 0.001}}`,
		"bad curve": `{"Key": "bad_curve", "Curve": {"K2": -1}}`,
		"unknown":   `{"Key": "unknown", "Curve": {"K2": 0.001}, "Extra": 1}`,
	} {
		key := strings.ReplaceAll(name, " ", "_")
		if err := os.WriteFile(filepath.Join(c.Dir, key+".json"), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, ok, err := c.Load(key); ok || err == nil {
			t.Errorf("%s: ok %v, err %v; want an error", name, ok, err)
		}
	}
	// Storing over a corrupt file repairs it.
	if err := c.Store(Profile{Key: "garbage", Curve: Curve{K2: 0.001}}); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := c.Load("garbage"); !ok || err != nil {
		t.Errorf("after Store: ok %v, err %v", ok, err)
	}
}

func TestCacheBadKeys(t *testing.T) {
	c := Cache{Dir: t.TempDir()}
	for _, key := range []string{"", "../x", "a/b", ".hidden", strings.Repeat("a", 129), "a b"} {
		if _, _, err := c.Load(key); !errors.Is(err, ErrBadKey) {
			t.Errorf("Load(%q): %v", key, err)
		}
		if err := c.Store(Profile{Key: key, Curve: Curve{K2: 1}}); !errors.Is(err, ErrBadKey) {
			t.Errorf("Store(%q): %v", key, err)
		}
	}
}

func TestKey(t *testing.T) {
	dir := t.TempDir()
	model := filepath.Join(dir, "model.onnx")
	write := func(s string) {
		if err := os.WriteFile(model, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	key := func(machine string, extra ...string) string {
		t.Helper()
		k, err := Key(model, machine, extra...)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	write("weights v1")
	base := key("m1", "cpu", "threads=4")
	if len(base) != 64 || strings.Trim(base, "0123456789abcdef") != "" {
		t.Errorf("key %q is not 64 hex digits", base)
	}
	if again := key("m1", "cpu", "threads=4"); again != base {
		t.Errorf("key not stable: %s, %s", base, again)
	}
	for name, k := range map[string]string{
		"machine":      key("m2", "cpu", "threads=4"),
		"extra":        key("m1", "cpu", "threads=8"),
		"extra order":  key("m1", "threads=4", "cpu"),
		"extra split":  key("m1", "cputhreads=4"),
		"extra absent": key("m1", "cpu"),
	} {
		if k == base {
			t.Errorf("%s does not change the key", name)
		}
	}
	write("weights v2")
	if key("m1", "cpu", "threads=4") == base {
		t.Error("the model file's content does not change the key")
	}
	if _, err := Key(filepath.Join(dir, "missing.onnx"), "m1"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
	// The key names a cache file.
	if _, _, err := (Cache{Dir: dir}).Load(base); err != nil {
		t.Error(err)
	}
}

func TestMachineID(t *testing.T) {
	x86 := "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)   CPU @ 2.20GHz\n\nprocessor\t: 1\nmodel name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\n"
	arm := "processor\t: 0\nBogoMIPS\t: 50.00\nCPU part\t: 0xd0c\n"
	for _, tt := range []struct {
		name, cpuinfo, gpu, want string
	}{
		{"x86", x86, "", "cpu=Intel(R) Xeon(R) CPU @ 2.20GHz;cpus=8;arch=amd64"},
		{"arm", arm, "", "cpu=0xd0c;cpus=8;arch=amd64"},
		{"none", "", "", "cpu=unknown;cpus=8;arch=amd64"},
		{"gpu", x86, "NVIDIA H100 80GB HBM3", "cpu=Intel(R) Xeon(R) CPU @ 2.20GHz;cpus=8;arch=amd64;gpu=NVIDIA H100 80GB HBM3"},
	} {
		if got := machineID([]byte(tt.cpuinfo), 8, "amd64", tt.gpu); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
	if a, b := MachineID(), MachineID(); a != b || !strings.Contains(a, "cpus=") {
		t.Errorf("MachineID %q, %q", a, b)
	}
	t.Logf("this machine: %s", MachineID())
}
