package runtime

import (
	"bytes"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

func TestArenaAllocator(t *testing.T) {
	a := newArenaAllocator(1024)
	x, ok := a.alloc(1)
	if !ok || x != 0 {
		t.Fatalf("alloc(1) = %d, %v", x, ok)
	}
	y, ok := a.alloc(65)
	if !ok || y != 64 {
		t.Fatalf("alloc(65) = %d, %v; want 64 (one aligned slot after the first)", y, ok)
	}
	if got := a.bytesInUse(); got != 64+128 {
		t.Errorf("in use %d, want 192", got)
	}
	if _, ok := a.alloc(1024); ok {
		t.Error("alloc(1024) succeeded with 192 bytes in use")
	}
	if _, ok := a.alloc(math.MaxUint64); ok {
		t.Error("alloc(MaxUint64) succeeded")
	}
	if a.release(7) {
		t.Error("release of an offset that is no slot succeeded")
	}
	if !a.release(x) || a.release(x) {
		t.Error("release twice: want true, then false")
	}
	if !a.release(y) {
		t.Error("release(y) failed")
	}
	// Everything merged back: the whole arena is one slot again.
	if z, ok := a.alloc(1024); !ok || z != 0 {
		t.Errorf("alloc(1024) after freeing all = %d, %v", z, ok)
	}
	if _, ok := newArenaAllocator(10).alloc(1); ok {
		t.Error("an arena smaller than one aligned slot handed one out")
	}
}

// Random allocations and frees never overlap, stay inside the arena, and
// leave the arena whole when all is freed.
func TestArenaAllocatorRandom(t *testing.T) {
	const size = 64 << 10
	a := newArenaAllocator(size)
	rng := rand.New(rand.NewPCG(5, 6))
	live := map[uint64]uint64{}
	for range 5000 {
		if len(live) > 0 && rng.IntN(3) == 0 {
			for off := range live {
				if !a.release(off) {
					t.Fatalf("release(%d) failed", off)
				}
				delete(live, off)
				break
			}
			continue
		}
		n := uint64(rng.IntN(4096))
		off, ok := a.alloc(n)
		if !ok {
			continue
		}
		if off%arenaAlign != 0 || off+n > size {
			t.Fatalf("alloc(%d) = %d: unaligned or outside", n, off)
		}
		for o, m := range live {
			if off < o+m && o < off+max(n, 1) {
				t.Fatalf("alloc(%d) = %d overlaps [%d, +%d)", n, off, o, m)
			}
		}
		live[off] = max(n, 1)
	}
	for off := range live {
		a.release(off)
	}
	if a.bytesInUse() != 0 || len(a.free) != 1 || a.free[0] != (extent{0, size}) {
		t.Errorf("after freeing all: in use %d, free %v", a.bytesInUse(), a.free)
	}
}

func TestArenaBytesHostile(t *testing.T) {
	mem := make([]byte, 4096)
	tests := []struct {
		name           string
		regionOff, len uint64
		s              *runnerpb.ArenaSlice
	}{
		{"before the region", 1024, 1024, &runnerpb.ArenaSlice{Offset: 1000, Length: 16}},
		{"after the region", 1024, 1024, &runnerpb.ArenaSlice{Offset: 2048, Length: 1}},
		{"runs past the region", 1024, 1024, &runnerpb.ArenaSlice{Offset: 2000, Length: 49}},
		{"length overflows", 1024, 1024, &runnerpb.ArenaSlice{Offset: 1032, Length: math.MaxUint64}},
		{"offset at the top", 1024, 1024, &runnerpb.ArenaSlice{Offset: math.MaxUint64, Length: 2}},
		{"region outside the arena", 4000, 1024, &runnerpb.ArenaSlice{Offset: 4000, Length: 8}},
		{"region overflows", math.MaxUint64 - 1, 4, &runnerpb.ArenaSlice{Offset: math.MaxUint64, Length: 0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := arenaBytes(mem, tt.regionOff, tt.len, tt.s)
			if !errors.Is(err, ErrArena) || b != nil {
				t.Errorf("arenaBytes = %d bytes, %v; want ErrArena", len(b), err)
			}
		})
	}
	b, err := arenaBytes(mem, 1024, 1024, &runnerpb.ArenaSlice{Offset: 2040, Length: 8})
	if err != nil || len(b) != 8 || cap(b) != 8 {
		t.Errorf("the region's last 8 bytes: %d bytes (cap %d), %v", len(b), cap(b), err)
	}
}

// A runner's answer with hostile descriptors fails with a clear error,
// never reads outside the call's region, and never panics.
func TestReadResponseHostile(t *testing.T) {
	mem := make([]byte, 4096)
	for i := range mem {
		mem[i] = byte(i)
	}
	region := &runnerpb.ArenaSlice{Offset: 1024, Length: 1024}
	tensor := func(dt string, shape []int64, off, n uint64) *runnerpb.InferResponse {
		return &runnerpb.InferResponse{Outputs: []*runnerpb.Tensor{{
			Name: "y", Datatype: dt, Shape: shape, Arena: &runnerpb.ArenaSlice{Offset: off, Length: n},
		}}}
	}
	tests := []struct {
		name   string
		resp   *runnerpb.InferResponse
		region *runnerpb.ArenaSlice
		want   string
	}{
		{"out of bounds offset", tensor("FP32", []int64{2}, 0, 8), region, "lies outside"},
		{"offset past the arena", tensor("FP32", []int64{2}, 1<<40, 8), region, "lies outside"},
		{"overflowing length", tensor("UINT8", []int64{4}, 1024, math.MaxUint64), region, "lies outside"},
		{"wrong size for the dtype", tensor("FP32", []int64{3}, 1024, 8), region, "needs 12 bytes, the descriptor says 8"},
		{"shape overflows", tensor("FP64", []int64{math.MaxInt64, math.MaxInt64}, 1024, 16), region, "more than"},
		{"negative dimension", tensor("FP32", []int64{-1}, 1024, 4), region, "dimension 0 is -1"},
		{"unknown dtype", tensor("FP128", []int64{1}, 1024, 16), region, "unknown datatype"},
		{"no region given", tensor("FP32", []int64{1}, 1024, 4), nil, "gave it no room"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := readResponse(tt.resp, mem, tt.region)
			if !errors.Is(err, ErrArena) || !strings.Contains(err.Error(), tt.want) || resp != nil {
				t.Errorf("readResponse = %v, %v; want ErrArena with %q", resp, err, tt.want)
			}
		})
	}

	resp, err := readResponse(tensor("INT16", []int64{2, 2}, 1088, 8), mem, region)
	if err != nil {
		t.Fatal(err)
	}
	want := slices.Clone(mem[1088:1096])
	mem[1088] ^= 0xff // the slot is reused: the output must be a copy
	if got := resp.Outputs[0]; got.DataType != Int16 || !bytes.Equal(got.Data, want) {
		t.Errorf("output %s %v, want INT16 %v", got.DataType, got.Data, want)
	}
}

// The runner side resolves only descriptors inside its arena.
func TestOutputRegion(t *testing.T) {
	mem := make([]byte, 1024)
	o := newOutputRegion(mem, &runnerpb.ArenaSlice{Offset: 512, Length: 100})
	s, b := o.take(10)
	if b == nil || s.GetOffset() != 512 || len(b) != 10 {
		t.Fatalf("take(10) = %v, %d bytes", s, len(b))
	}
	if s, b := o.take(30); b == nil || s.GetOffset() != 576 {
		t.Fatalf("take(30) = %v: want the next aligned offset 576", s)
	}
	if _, b := o.take(10); b != nil {
		t.Error("take(10) past the region's end succeeded")
	}
	for _, bad := range []*runnerpb.ArenaSlice{{Offset: 1000, Length: 100}, {Offset: math.MaxUint64, Length: 1}, nil} {
		if _, b := newOutputRegion(mem, bad).take(1); b != nil {
			t.Errorf("region %v outside the arena handed out memory", bad)
		}
	}
}
