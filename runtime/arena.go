package runtime

import (
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// This file holds the shared-memory arena between the server and one runner
// process: a memfd the server creates and the runner inherits as a file
// descriptor, mapped by both. The server allocates a slot of it per call,
// writes the inputs there once, and tells the runner where they lie; the
// runner runs ONNX Runtime over that memory in place and writes the outputs
// into the slot's output part. Only offsets and lengths travel on the
// socket.
//
// Each runner process gets an arena of its own, created with it and
// unmapped once it has been reaped and no call uses the mapping any more: a
// runner that dies mid-write can only spoil its own calls' slots, and a
// restarted process starts on fresh memory.

// DefaultArenaSize is the arena of a runner whose RunnerConfig leaves
// ArenaSize at 0.
const DefaultArenaSize = 64 << 20

// arenaAlign is the alignment of every slot and of every tensor in a slot:
// a cache line, more than any element type needs.
const arenaAlign = 64

// arenaFD is the descriptor number the runner finds its arena at: the first
// of exec.Cmd.ExtraFiles.
const arenaFD = 3

// ErrArena means a descriptor does not fit the arena: out of bounds, sizes
// that overflow, or lengths that disagree with the tensor's shape.
var ErrArena = errors.New("bad arena descriptor")

// alignUp rounds n up to arenaAlign; ok is false on overflow.
func alignUp(n uint64) (uint64, bool) {
	if n > math.MaxUint64-(arenaAlign-1) {
		return 0, false
	}
	return (n + arenaAlign - 1) &^ (arenaAlign - 1), true
}

// arenaAllocator hands out aligned byte ranges of an arena of fixed size,
// first fit over a list of free extents that merge again when freed. It
// never grows: a request that does not fit is refused, and the caller
// sends the data inline instead.
type arenaAllocator struct {
	mu    sync.Mutex
	size  uint64
	free  []extent          // sorted by offset, never adjacent
	used  map[uint64]uint64 // offset -> length of each live slot
	inUse uint64
}

type extent struct{ off, len uint64 }

func newArenaAllocator(size uint64) *arenaAllocator {
	size &^= arenaAlign - 1
	a := &arenaAllocator{size: size, used: make(map[uint64]uint64)}
	if size > 0 {
		a.free = []extent{{0, size}}
	}
	return a
}

// alloc reserves n bytes (rounded up to arenaAlign) and returns their
// offset, or false when no free extent is large enough.
func (a *arenaAllocator) alloc(n uint64) (uint64, bool) {
	n, ok := alignUp(max(n, 1))
	if !ok || n > a.size {
		return 0, false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for i, e := range a.free {
		if e.len < n {
			continue
		}
		if e.len == n {
			a.free = slices.Delete(a.free, i, i+1)
		} else {
			a.free[i] = extent{e.off + n, e.len - n}
		}
		a.used[e.off] = n
		a.inUse += n
		return e.off, true
	}
	return 0, false
}

// release returns the slot at off. It reports false for an offset that is
// not a live slot, and then changes nothing.
func (a *arenaAllocator) release(off uint64) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	n, ok := a.used[off]
	if !ok {
		return false
	}
	delete(a.used, off)
	a.inUse -= n
	i, _ := slices.BinarySearchFunc(a.free, off, func(e extent, off uint64) int {
		switch {
		case e.off < off:
			return -1
		case e.off > off:
			return 1
		}
		return 0
	})
	a.free = slices.Insert(a.free, i, extent{off, n})
	// Merge with the next extent, then with the previous one.
	if i+1 < len(a.free) && a.free[i].off+a.free[i].len == a.free[i+1].off {
		a.free[i].len += a.free[i+1].len
		a.free = slices.Delete(a.free, i+1, i+2)
	}
	if i > 0 && a.free[i-1].off+a.free[i-1].len == a.free[i].off {
		a.free[i-1].len += a.free[i].len
		a.free = slices.Delete(a.free, i, i+1)
	}
	return true
}

// used reports the bytes held by live slots.
func (a *arenaAllocator) bytesInUse() uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.inUse
}

// arena is the server's side of one runner process's shared memory: the
// memfd, its mapping and the allocator over it.
type arena struct {
	file  *os.File // the memfd; the child inherits it through ExtraFiles
	mem   []byte   // the arena proper, the allocator's
	whole []byte   // the mapping: the arena, then the mailbox if any
	alloc *arenaAllocator
	box   *mailbox // nil: no mailbox

	mu      sync.Mutex
	users   int  // calls between acquire and release
	closing bool // close was called: no new users; the last one unmaps
	retired bool // the runner's stream broke: slots in flight are never reused
}

// newArena creates a memfd of size bytes, followed by a mailbox of slots
// slots when slots > 0 (at mailboxOffset(size)), and maps it.
func newArena(name string, size int64, slots int) (*arena, error) {
	if size <= 0 || size > math.MaxInt32*int64(arenaAlign) {
		return nil, fmt.Errorf("arena size %d out of range", size)
	}
	if slots < 0 || slots > maxMailboxSlots {
		return nil, fmt.Errorf("mailbox of %d slots out of range", slots)
	}
	whole := size
	if slots > 0 {
		whole = mailboxOffset(size) + mailboxBytes(slots)
	}
	fd, err := unix.MemfdCreate("sloserve-arena-"+name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("create arena: memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "sloserve-arena-"+name)
	if err := f.Truncate(whole); err != nil {
		f.Close()
		return nil, fmt.Errorf("create arena: size it to %d bytes: %w", whole, err)
	}
	mem, err := syscall.Mmap(fd, 0, int(whole), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("create arena: mmap: %w", err)
	}
	a := &arena{file: f, mem: mem[:size:size], whole: mem, alloc: newArenaAllocator(uint64(size))}
	if slots > 0 {
		bm, err := newMailboxMem(mem[mailboxOffset(size):], slots)
		if err != nil {
			syscall.Munmap(mem)
			f.Close()
			return nil, err
		}
		a.box = newMailbox(bm, a.acquire, a.release)
		a.box.track()
	}
	return a, nil
}

// acquire marks a call as using the mapping; it fails once close has been
// called. Every successful acquire needs one release.
func (a *arena) acquire() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closing {
		return false
	}
	a.users++
	return true
}

func (a *arena) release() {
	a.mu.Lock()
	a.users--
	unmap := a.closing && a.users == 0
	a.mu.Unlock()
	if unmap {
		a.unmap()
	}
}

// retire stops the reuse of slots: after the runner's stream broke, the
// process may still be writing into any slot it was given.
func (a *arena) retire() {
	a.mu.Lock()
	a.retired = true
	a.mu.Unlock()
}

// slot reserves n bytes for a call; false when the arena is full or
// retired.
func (a *arena) slot(n uint64) (uint64, bool) {
	a.mu.Lock()
	retired := a.retired
	a.mu.Unlock()
	if retired {
		return 0, false
	}
	return a.alloc.alloc(n)
}

// free returns a call's slot, unless the arena is retired.
func (a *arena) free(off uint64) {
	a.mu.Lock()
	retired := a.retired
	a.mu.Unlock()
	if !retired {
		a.alloc.release(off)
	}
}

// close closes the memfd and unmaps the arena once the last call using it
// has let go. Call it after the runner process has been reaped.
func (a *arena) close() {
	a.mu.Lock()
	if a.closing {
		a.mu.Unlock()
		return
	}
	a.closing = true
	unmap := a.users == 0
	a.mu.Unlock()
	a.file.Close()
	if unmap {
		a.unmap()
	}
}

func (a *arena) unmap() {
	if a.whole != nil {
		if a.box != nil {
			a.box.forget() // its counts are read from the mapping
		}
		_ = syscall.Munmap(a.whole)
		a.whole, a.mem = nil, nil
	}
}

// arenaBytes resolves a descriptor to the bytes it names inside region,
// a byte range [regionOff, regionOff+regionLen) of mem. Whatever the
// descriptor says, the result lies inside the region or an ErrArena error
// is returned.
func arenaBytes(mem []byte, regionOff, regionLen uint64, s *runnerpb.ArenaSlice) ([]byte, error) {
	if regionOff > uint64(len(mem)) || regionLen > uint64(len(mem))-regionOff {
		return nil, fmt.Errorf("%w: region [%d, +%d) outside the arena of %d bytes", ErrArena, regionOff, regionLen, len(mem))
	}
	off, n := s.GetOffset(), s.GetLength()
	if off < regionOff || off-regionOff > regionLen || n > regionLen-(off-regionOff) {
		return nil, fmt.Errorf("%w: [%d, +%d) lies outside [%d, +%d)", ErrArena, off, n, regionOff, regionLen)
	}
	return mem[off : off+n : off+n], nil
}

// checkArenaTensor checks that a tensor's data length fits its data type and
// shape without overflow. BYTES tensors are checked when split.
func checkArenaTensor(t *runnerpb.Tensor, length uint64) (DataType, error) {
	dt, ok := ParseDataType(t.GetDatatype())
	if !ok {
		return "", fmt.Errorf("%w: tensor %q has unknown datatype %q", ErrArena, t.GetName(), t.GetDatatype())
	}
	if dt == Bytes {
		return dt, nil
	}
	limit := int64(math.MaxInt64)
	if dt.Size() > 0 {
		limit = int64(min(length/uint64(dt.Size())+1, math.MaxInt64))
	}
	n, err := ElementCount(t.GetShape(), limit)
	if err != nil {
		return "", fmt.Errorf("%w: tensor %q: %w", ErrArena, t.GetName(), err)
	}
	if want := dt.ByteSize(n); uint64(want) != length {
		return "", fmt.Errorf("%w: tensor %q of %s %v needs %d bytes, the descriptor says %d", ErrArena, t.GetName(), dt, t.GetShape(), want, length)
	}
	return dt, nil
}

// mapArena maps the arena a runner inherited.
func mapArena(fd int, size int64) ([]byte, error) {
	if size <= 0 || size > math.MaxInt32*int64(arenaAlign) {
		return nil, fmt.Errorf("arena size %d out of range", size)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("arena fd %d: %w", fd, err)
	}
	if st.Size < size {
		return nil, fmt.Errorf("arena fd %d holds %d bytes, not %d", fd, st.Size, size)
	}
	mem, err := syscall.Mmap(fd, 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("map arena: %w", err)
	}
	return mem, nil
}
