package runtime

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestProcessLimitsFile(t *testing.T) {
	dir := t.TempDir()
	for _, l := range []ProcessLimits{
		{},
		{Idle: true, CPUs: []int{3}, DataLimit: 1 << 30},
		{CPUs: []int{0, 1, 2, 3}},
	} {
		if err := WriteProcessLimits(dir, l); err != nil {
			t.Fatal(err)
		}
		got, err := ReadProcessLimits(dir)
		if err != nil {
			t.Fatal(err)
		}
		if got.Idle != l.Idle || !slices.Equal(got.CPUs, l.CPUs) || got.DataLimit != l.DataLimit {
			t.Errorf("wrote %+v (%q), read %+v", l, l.String(), got)
		}
	}
	if s := (ProcessLimits{Idle: true, CPUs: []int{1, 2}, DataLimit: 5}).String(); s != "idle=1 cpus=1,2 data=5" {
		t.Errorf("String() = %q", s)
	}
	for _, bad := range []string{"idle=1 cpus=x", "data=-1", "data=lots", "nice=3", "cpus=-2"} {
		if _, err := ParseProcessLimits(bad); err == nil {
			t.Errorf("ParseProcessLimits(%q): no error", bad)
		}
	}
	// No temporary file is left beside the limits.
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 || entries[0].Name() != UnitLimitsFile {
		t.Errorf("unit holds %v, want the limits file alone", entries)
	}
	if _, err := ReadProcessLimits(filepath.Join(dir, "none")); err == nil {
		t.Error("reading a missing unit: no error")
	}
}

func TestAllocationFailure(t *testing.T) {
	for msg, want := range map[string]bool{
		"Error running network: ... bfc_arena.cc:360 Failed to allocate memory for requested buffer of size 40960000": true,
		"std::bad_alloc": true,
		"bad allocation": true,
		"input \"x\": shape [1 3] does not match": false,
		"": false,
	} {
		var err error
		if msg != "" {
			err = errors.New(msg)
		}
		if got := allocationFailure(err); got != want {
			t.Errorf("allocationFailure(%q) = %v, want %v", msg, got, want)
		}
	}
	// A runner without a data limit, or outside a unit, goes on.
	(&processUnit{dir: t.TempDir()}).outOfMemory(fmt.Errorf("bad_alloc"))
	(*processUnit)(nil).outOfMemory(fmt.Errorf("bad_alloc"))
}
