package runtime

import (
	"errors"
	"fmt"
	"math"
	goruntime "runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// This file holds the call mailbox: a call that crosses to the runner
// through shared memory instead of the socket. Measured, the socket round
// trip is most of what a runner call costs over an in-process one: each
// call wakes the runner's network poller, hands the frame to a goroutine,
// and on the way back wakes the server's receiving goroutine, which hands
// the answer to the caller's (two epoll wake-ups, four socket calls and a
// hand-off per side). Through the mailbox the caller writes its request
// into a slot, rings a doorbell (a futex the runner's workers sleep on),
// and sleeps on its slot's state word until the runner's worker writes the
// answer there and wakes it: one wake-up each way, and no goroutine stands
// between.
//
// The mailbox lives in the arena's memfd, after the arena (at
// mailboxOffset), so it needs no descriptor of its own and shares the
// arena's life. Each slot has a state word, the lengths of its request and
// answer frames, and room for each (mailboxArea bytes); the frames are the
// socket's (runnerpb messages). A request or answer that does not fit
// travels on the socket instead, as does every call when no slot is free.
// The socket stays: it tells a dead runner (the connection ends) from a
// slow one, carries the goodbye, and carries what does not fit.
//
// Which slots are free is the server's own bookkeeping, never the shared
// memory's: a runner can spoil only the answers of its own calls. The
// server trusts no length, id or state a runner writes (bounds, the call's
// id, and a broken stream ends every wait).

// DefaultMailboxSlots is the mailbox of a runner whose RunnerConfig leaves
// MailboxSlots at 0.
const DefaultMailboxSlots = 32

// maxMailboxSlots bounds RunnerConfig.MailboxSlots and --mailbox-slots.
const maxMailboxSlots = 1024

const (
	// mailboxArea is the room for one request frame and, beside it, for
	// one answer frame in each slot: descriptors of tensors in the arena
	// and small tensors inline.
	mailboxArea = 4096
	// mailboxSlotHeader holds a slot's state and lengths, a cache line.
	mailboxSlotHeader = 64
	mailboxSlotSize   = mailboxSlotHeader + 2*mailboxArea
	// mailboxHeader holds the doorbell and the count of sleeping workers.
	mailboxHeader = 64
	// mailboxAlign is where the mailbox starts after the arena: a page.
	mailboxAlign = 4096
)

// The states of a slot. The server posts a free slot, a worker takes it and
// answers (in the slot or on the socket); a slot whose stream broke is
// dropped, so that neither side waits on it any more.
const (
	slotFree uint32 = iota
	slotPosted
	slotTaken
	slotAnswered // the answer is in the slot
	slotOnSocket // the answer travels on the socket
	slotDropped  // the server gave up on the call: its stream broke
)

// mailboxRecheck bounds one sleep of a waiting caller: a wake-up that
// races its going to sleep (its context ended just then) costs at most
// this.
const mailboxRecheck = 10 * time.Millisecond

// mailboxOffset is where the mailbox starts in the memfd of an arena of
// arenaSize bytes.
func mailboxOffset(arenaSize int64) int64 {
	return (arenaSize + mailboxAlign - 1) &^ (mailboxAlign - 1)
}

// mailboxBytes is the size of a mailbox of n slots.
func mailboxBytes(n int) int64 { return mailboxHeader + int64(n)*mailboxSlotSize }

// mailboxMem is a mailbox's shared memory, as either side sees it.
type mailboxMem struct {
	mem   []byte
	slots int
}

// newMailboxMem views mem as a mailbox of n slots; mem must be
// 8-byte aligned and at least mailboxBytes(n) long.
func newMailboxMem(mem []byte, n int) (mailboxMem, error) {
	if n <= 0 || n > maxMailboxSlots {
		return mailboxMem{}, fmt.Errorf("mailbox of %d slots out of range", n)
	}
	if int64(len(mem)) < mailboxBytes(n) || uintptr(unsafe.Pointer(unsafe.SliceData(mem)))%8 != 0 {
		return mailboxMem{}, fmt.Errorf("mailbox of %d slots does not fit %d bytes", n, len(mem))
	}
	return mailboxMem{mem: mem[:mailboxBytes(n)], slots: n}, nil
}

func (m mailboxMem) word(off int) *uint32 { return (*uint32)(unsafe.Pointer(&m.mem[off])) }

// doorbell counts the requests posted; workers sleep on it.
func (m mailboxMem) doorbell() *uint32 { return m.word(0) }

// sleepers counts the workers asleep on the doorbell: a poster with none
// to wake makes no system call.
func (m mailboxMem) sleepers() *uint32 { return m.word(4) }

func (m mailboxMem) slotOff(i int) int     { return mailboxHeader + i*mailboxSlotSize }
func (m mailboxMem) state(i int) *uint32   { return m.word(m.slotOff(i)) }
func (m mailboxMem) reqLen(i int) *uint32  { return m.word(m.slotOff(i) + 4) }
func (m mailboxMem) respLen(i int) *uint32 { return m.word(m.slotOff(i) + 8) }

func (m mailboxMem) reqArea(i int) []byte {
	off := m.slotOff(i) + mailboxSlotHeader
	return m.mem[off : off+mailboxArea : off+mailboxArea]
}

func (m mailboxMem) respArea(i int) []byte {
	off := m.slotOff(i) + mailboxSlotHeader + mailboxArea
	return m.mem[off : off+mailboxArea : off+mailboxArea]
}

// futexWait sleeps while *addr is val, at most timeout; it returns at once
// when *addr is something else. The futex is shared (not private): the
// two sides are different processes.
func futexWait(addr *uint32, val uint32, timeout time.Duration) {
	ts := unix.NsecToTimespec(int64(timeout))
	_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), futexWaitOp, uintptr(val), uintptr(unsafe.Pointer(&ts)), 0, 0)
}

// futexWake wakes up to n sleepers on addr.
func futexWake(addr *uint32, n int) {
	_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), futexWakeOp, uintptr(n), 0, 0, 0)
}

// The futex operations, without FUTEX_PRIVATE_FLAG.
const (
	futexWaitOp = 0
	futexWakeOp = 1
)

// mailbox is the server's side of a runner process's mailbox.
type mailbox struct {
	mailboxMem
	// acquire keeps the mapping while a call uses it (false: it is going
	// away); each successful acquire needs one release.
	acquire func() bool
	release func()

	mu   sync.Mutex
	free []int // the slots no call holds
}

func newMailbox(mem mailboxMem, acquire func() bool, release func()) *mailbox {
	m := &mailbox{mailboxMem: mem, acquire: acquire, release: release, free: make([]int, 0, mem.slots)}
	for i := mem.slots - 1; i >= 0; i-- {
		m.free = append(m.free, i)
	}
	return m
}

// get reserves a free slot; false when every slot is held.
func (m *mailbox) get() (int, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.free) == 0 {
		return 0, false
	}
	i := m.free[len(m.free)-1]
	m.free = m.free[:len(m.free)-1]
	return i, true
}

// put returns slot i, which the runner no longer touches.
func (m *mailbox) put(i int) {
	atomic.StoreUint32(m.state(i), slotFree)
	m.mu.Lock()
	m.free = append(m.free, i)
	m.mu.Unlock()
}

// post writes req, of size bytes (proto.Size), into slot i and rings the
// doorbell.
func (m *mailbox) post(i int, req *runnerpb.InferRequest, size int) error {
	b, err := proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(m.reqArea(i)[:0], req)
	if err != nil {
		return err
	}
	if len(b) != size || unsafe.SliceData(b) != unsafe.SliceData(m.reqArea(i)) {
		return fmt.Errorf("request of %d bytes did not fit its slot", len(b))
	}
	atomic.StoreUint32(m.reqLen(i), uint32(size))
	atomic.StoreUint32(m.state(i), slotPosted)
	atomic.AddUint32(m.doorbell(), 1)
	if atomic.LoadUint32(m.sleepers()) != 0 {
		futexWake(m.doorbell(), 1)
	}
	return nil
}

// await sleeps until slot i is answered, dead is set or done says so, and
// returns the slot's state.
func (m *mailbox) await(i int, dead *atomic.Bool, done func() bool) uint32 {
	st := m.state(i)
	for {
		s := atomic.LoadUint32(st)
		if s == slotAnswered || s == slotOnSocket || s == slotDropped || dead.Load() || done() {
			return s
		}
		futexWait(st, s, mailboxRecheck)
	}
}

// wake wakes whoever waits on slot i.
func (m *mailbox) wake(i int) { futexWake(m.state(i), math.MaxInt32) }

// drop ends every wait: a slot not yet answered will never be. Called
// once the stream broke; no slot is reused after that.
func (m *mailbox) drop() {
	for i := range m.slots {
		st := m.state(i)
		for {
			s := atomic.LoadUint32(st)
			if (s != slotPosted && s != slotTaken) || atomic.CompareAndSwapUint32(st, s, slotDropped) {
				break
			}
		}
		m.wake(i)
	}
}

// answer reads the answer to call id from slot i.
func (m *mailbox) answer(i int, id uint64) (*runnerpb.InferResponse, error) {
	n := atomic.LoadUint32(m.respLen(i))
	if n > mailboxArea {
		return nil, fmt.Errorf("runner's answer in slot %d claims %d bytes, over the slot's %d", i, n, mailboxArea)
	}
	resp := &runnerpb.InferResponse{}
	if err := proto.Unmarshal(m.respArea(i)[:n], resp); err != nil {
		return nil, fmt.Errorf("runner's answer in slot %d: %w", i, err)
	}
	if resp.GetId() != id {
		return nil, fmt.Errorf("runner answered call %d in the slot of call %d", resp.GetId(), id)
	}
	return resp, nil
}

// mailboxWorkers is the runner's side: workers that take posted slots,
// answer them and wake their callers.
type mailboxWorkers struct {
	mailboxMem
	// answer runs one call.
	answer func(*runnerpb.InferRequest) *runnerpb.InferResponse
	// onSocket writes an answer too large for its slot on the socket.
	onSocket func(*runnerpb.InferResponse) error
	quit     atomic.Bool
	wg       sync.WaitGroup
}

// start starts n workers.
func (w *mailboxWorkers) start(n int) {
	for k := range n {
		w.wg.Add(1)
		go func() {
			defer w.wg.Done()
			w.work(k * w.slots / n)
		}()
	}
}

// stop makes the workers take no more slots and waits for those they took
// to be answered.
func (w *mailboxWorkers) stop() {
	w.quit.Store(true)
	atomic.AddUint32(w.doorbell(), 1)
	futexWake(w.doorbell(), math.MaxInt32)
	w.wg.Wait()
}

func (w *mailboxWorkers) work(next int) {
	var yielded time.Time
	for {
		bell := atomic.LoadUint32(w.doorbell())
		if w.quit.Load() {
			return
		}
		i, ok := w.take(next)
		if !ok {
			// Through Go's scheduler now and then before a sleep: a
			// goroutine that has not been scheduled for 10 ms loses its
			// processor to Go's monitor even while it sleeps in a system
			// call, and a worker that only loops never is. Its processor
			// taken, the monitor sleeps (every processor idle) and the
			// next call wakes it. Not before every sleep: yielding wakes
			// a thread to look for work on the idle processor
			// (runnerFlags.goProcs), one per call.
			if now := time.Now(); now.Sub(yielded) >= workerYieldEvery {
				goruntime.Gosched()
				yielded = now
			}
			atomic.AddUint32(w.sleepers(), 1)
			if atomic.LoadUint32(w.doorbell()) == bell && !w.quit.Load() {
				futexWait(w.doorbell(), bell, time.Second)
			}
			atomic.AddUint32(w.sleepers(), ^uint32(0))
			continue
		}
		next = (i + 1) % w.slots
		w.serve(i)
	}
}

// workerYieldEvery is how often at most a mailbox worker yields before
// it sleeps: well inside the 10 ms after which Go's monitor takes the
// processor of a goroutine that has not been scheduled.
const workerYieldEvery = 4 * time.Millisecond

// take claims the first posted slot from next on.
func (w *mailboxWorkers) take(next int) (int, bool) {
	for k := range w.slots {
		i := (next + k) % w.slots
		if atomic.LoadUint32(w.state(i)) == slotPosted && atomic.CompareAndSwapUint32(w.state(i), slotPosted, slotTaken) {
			return i, true
		}
	}
	return 0, false
}

// errMailboxFrame is a request frame a worker cannot read.
var errMailboxFrame = errors.New("bad request frame in the mailbox")

// serve answers the call in slot i.
func (w *mailboxWorkers) serve(i int) {
	var resp *runnerpb.InferResponse
	req := &runnerpb.InferRequest{}
	n := atomic.LoadUint32(w.reqLen(i))
	if n > mailboxArea {
		resp = &runnerpb.InferResponse{Code: int32(codes.Internal), Message: fmt.Sprintf("%v: %d bytes", errMailboxFrame, n)}
	} else if err := proto.Unmarshal(w.reqArea(i)[:n], req); err != nil {
		resp = &runnerpb.InferResponse{Code: int32(codes.Internal), Message: fmt.Sprintf("%v: %v", errMailboxFrame, err)}
	} else {
		resp = w.answer(req)
		resp.Id = req.GetId()
	}
	size := proto.Size(resp)
	if size <= mailboxArea {
		b, err := proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(w.respArea(i)[:0], resp)
		if err == nil && len(b) == size {
			atomic.StoreUint32(w.respLen(i), uint32(size))
			if atomic.CompareAndSwapUint32(w.state(i), slotTaken, slotAnswered) {
				futexWake(w.state(i), math.MaxInt32)
			}
			return
		}
	}
	// Too large for the slot: say so first, so that the slot is the
	// server's again once the frame is on the socket.
	if atomic.CompareAndSwapUint32(w.state(i), slotTaken, slotOnSocket) {
		futexWake(w.state(i), math.MaxInt32)
		_ = w.onSocket(resp)
	}
}
