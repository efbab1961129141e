package runtime

import (
	"errors"
	"math"
	goruntime "runtime"
	"testing"
)

func TestElementCount(t *testing.T) {
	for _, tc := range []struct {
		name  string
		shape []int64
		limit int64
		want  int64
		err   bool
	}{
		{"scalar", nil, 0, 1, false},
		{"matrix", []int64{3, 4}, 0, 12, false},
		{"at limit", []int64{4, 4}, 16, 16, false},
		{"over limit", []int64{4, 5}, 16, 0, true},
		{"negative", []int64{2, -1}, 0, 0, true},
		{"overflow", []int64{math.MaxInt64, 2}, 0, 0, true},
		{"zero anywhere", []int64{1 << 40, 1 << 40, 0}, 16, 0, false},
		{"zero before huge", []int64{0, math.MaxInt64, math.MaxInt64}, 0, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ElementCount(tc.shape, tc.limit)
			if tc.err {
				if !errors.Is(err, ErrShape) {
					t.Fatalf("err = %v, want ErrShape", err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("got %d, %v; want %d", got, err, tc.want)
			}
		})
	}
}

func TestSplitBytes(t *testing.T) {
	var buf []byte
	buf = AppendBytesElement(buf, []byte("héllo"))
	buf = AppendBytesElement(buf, nil)
	buf = AppendBytesElement(buf, []byte{0xff, 0})
	got, err := SplitBytes(buf, 3)
	if err != nil || string(got[0]) != "héllo" || len(got[1]) != 0 || string(got[2]) != "\xff\x00" {
		t.Fatalf("SplitBytes = %q, %v", got, err)
	}
	for _, tc := range []struct {
		name string
		data []byte
		n    int64
	}{
		{"count short", buf, 4},
		{"count long", buf, 2},
		{"truncated prefix", buf[:2], 1},
		{"length past end", []byte{9, 0, 0, 0, 'a'}, 1},
		{"huge length", []byte{0xff, 0xff, 0xff, 0xff}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := SplitBytes(tc.data, tc.n)
			if err == nil {
				t.Fatal("want an error")
			}
			if cerr := CheckBytes(tc.data, tc.n); cerr == nil || cerr.Error() != err.Error() {
				t.Fatalf("CheckBytes = %v, SplitBytes = %v: want the same error", cerr, err)
			}
		})
	}
	if err := CheckBytes(buf, 3); err != nil {
		t.Fatal(err)
	}
}

// TestBytesCountedFirst: checking BYTES data allocates nothing, and
// splitting it allocates only when it holds the elements the shape says:
// 4 MiB of zeros are a million empty elements, not 24 MiB of slice headers
// for a shape that does not match.
func TestBytesCountedFirst(t *testing.T) {
	zeros := make([]byte, 4<<20)
	n := int64(len(zeros) / 4)
	// The heap's counts are the process's: another test's goroutines
	// (a runner's output readers, a stopping server) allocate meanwhile.
	// The fewest over a few tries is the code's own.
	allocs, bytes := math.Inf(1), uint64(math.MaxUint64)
	for range 5 {
		allocs = min(allocs, testing.AllocsPerRun(5, func() {
			if err := CheckBytes(zeros, n); err != nil {
				t.Fatal(err)
			}
		}))
		var before, after goruntime.MemStats
		goruntime.ReadMemStats(&before)
		_, _ = SplitBytes(zeros, n+1)
		goruntime.ReadMemStats(&after)
		bytes = min(bytes, after.TotalAlloc-before.TotalAlloc)
		if allocs == 0 && bytes <= 1<<10 {
			return
		}
	}
	if allocs != 0 {
		t.Errorf("CheckBytes: %v allocations, want 0", allocs)
	}
	if bytes > 1<<10 {
		t.Errorf("SplitBytes of a mismatched count allocated %d bytes", bytes)
	}
}
