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
	// mailboxHeader holds the doorbell and the count of sleeping workers
	// (a cache line), then the server's counts of how its calls waited
	// and the runner's of how its workers did (mailboxStats), a cache line
	// each, so that neither side's counting moves a line the other polls.
	mailboxHeader     = 3 * 64
	mailboxCallerLine = 64
	mailboxWorkerLine = 128
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

// callerStats and workerStats are the two sides' counts in the header:
// each side writes only its own; anyone who maps the mailbox can read
// both (the server's metrics read the runner's, as numbers it reports and
// never acts on).
func (m mailboxMem) callerStats() *mailboxStats {
	return (*mailboxStats)(unsafe.Pointer(&m.mem[mailboxCallerLine]))
}

func (m mailboxMem) workerStats() *mailboxStats {
	return (*mailboxStats)(unsafe.Pointer(&m.mem[mailboxWorkerLine]))
}

func (m mailboxMem) slotOff(i int) int     { return mailboxHeader + i*mailboxSlotSize }
func (m mailboxMem) state(i int) *uint32   { return m.word(m.slotOff(i)) }
func (m mailboxMem) reqLen(i int) *uint32  { return m.word(m.slotOff(i) + 4) }
func (m mailboxMem) respLen(i int) *uint32 { return m.word(m.slotOff(i) + 8) }

// waiting is set by a caller before it sleeps on its slot's state: a
// worker whose caller is not asleep (it polls, see mailbox.poll) wakes no
// one and makes no system call.
func (m mailboxMem) waiting(i int) *uint32 { return m.word(m.slotOff(i) + 12) }

// postedAt and answeredAt are when the server posted the slot's request
// and when the worker wrote its answer, on the host's monotonic clock
// (monoNanos, the one both processes read the same): each side learns from
// them how soon the other answers, whether or not it slept meanwhile.
func (m mailboxMem) postedAt(i int) *int64   { return m.stamp(m.slotOff(i) + 16) }
func (m mailboxMem) answeredAt(i int) *int64 { return m.stamp(m.slotOff(i) + 24) }

// takenAt is when a worker took the slot's call (monoNanos): with
// the other two stamps it splits a call's wait into the worker's coming
// (postedAt to takenAt) and the run (takenAt to answeredAt), for
// mailboxStats.
func (m mailboxMem) takenAt(i int) *int64 { return m.stamp(m.slotOff(i) + 32) }

func (m mailboxMem) stamp(off int) *int64 { return (*int64)(unsafe.Pointer(&m.mem[off])) }

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

	// spin is how a caller polls for its answer before it sleeps
	// (mailbox.poll).
	spin spinPolicy
	// answerNs is the recent time from a post to its answer in
	// nanoseconds, a moving average over every call's stamps.
	answerNs atomic.Int64
	// stats counts what the waits did (in the shared header: callerStats),
	// for the metrics, tests and benchmarks.
	stats *mailboxStats
	// names interns the output names of the answers.
	names nameCache
}

// mailboxStats counts how the calls of one side waited. It lives in the
// mailbox's shared header (mailboxMem.callerStats, workerStats): one cache
// line, 8 counters.
type mailboxStats struct {
	spins  atomic.Int64 // waits that polled
	caught atomic.Int64 // of those, the ones that saw their event while polling
	sleeps atomic.Int64 // futex sleeps
	wakes  atomic.Int64 // futex wake-ups sent to the other side
	// On the server's side, the sums over the calls answered in their
	// slot (calls) of the nanoseconds from the post to the take (the
	// worker's coming), from the take to the answer (the run) and from
	// the answer to the caller having read it (the caller's coming), from
	// the slot's stamps: where the hop's time goes.
	calls                    atomic.Int64
	toTake, toAnswer, toSeen atomic.Int64
}

// mailboxStats fills one cache line exactly (a compile-time check).
var _ = [1]struct{}{}[unsafe.Sizeof(mailboxStats{})-mailboxCallerLine]

func newMailbox(mem mailboxMem, acquire func() bool, release func()) *mailbox {
	m := &mailbox{mailboxMem: mem, acquire: acquire, release: release, free: make([]int, 0, mem.slots),
		spin: spinPolicy{limit: callerSpinCap, preempted: spinPreempted}, stats: mem.callerStats()}
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
// doorbell. It returns when it posted (monoNanos, for learn).
func (m *mailbox) post(i int, req *runnerpb.InferRequest, size int) (int64, error) {
	b, err := proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(m.reqArea(i)[:0], req)
	if err != nil {
		return 0, err
	}
	if len(b) != size || unsafe.SliceData(b) != unsafe.SliceData(m.reqArea(i)) {
		return 0, fmt.Errorf("request of %d bytes did not fit its slot", len(b))
	}
	now := monoNanos()
	atomic.StoreUint32(m.reqLen(i), uint32(size))
	atomic.StoreUint32(m.waiting(i), 0)
	atomic.StoreInt64(m.postedAt(i), now)
	atomic.StoreUint32(m.state(i), slotPosted)
	atomic.AddUint32(m.doorbell(), 1)
	if atomic.LoadUint32(m.sleepers()) != 0 {
		m.stats.wakes.Add(1)
		futexWake(m.doorbell(), 1)
	}
	return now, nil
}

// ended reports whether state s is one a caller stops waiting at.
func ended(s uint32) bool { return s == slotAnswered || s == slotOnSocket || s == slotDropped }

// await sleeps until slot i is answered, dead is set or done says so, and
// returns the slot's state. A caller says it sleeps (the slot's waiting
// word) before it looks at the state a last time, and the worker looks at
// that word after it wrote the state: one of the two sees the other's
// write, so the worker wakes every caller that sleeps, and only those.
func (m *mailbox) await(i int, dead *atomic.Bool, done func() bool) uint32 {
	st := m.state(i)
	for {
		s := atomic.LoadUint32(st)
		if ended(s) || dead.Load() || done() {
			return s
		}
		atomic.StoreUint32(m.waiting(i), 1)
		if atomic.LoadUint32(st) != s {
			continue
		}
		m.stats.sleeps.Add(1)
		futexWait(st, s, mailboxRecheck)
	}
}

// The callers' spin: a caller whose answer usually comes sooner than a
// sleep and a wake-up take polls for it instead, for about the time the
// recent answers took, and sleeps only if it has not come by then. On
// this machine's virtual CPUs a cross-process futex wake-up costs tens of
// microseconds (the woken thread's CPU has gone idle), as much as a small
// model's whole run; polling keeps the caller's CPU awake for the answer.
// It costs that CPU for the time it polls, so it is bounded and taken
// only where it pays:
//   - never longer than callerSpinCap, and not at all when the recent
//     answers (answerNs, from the slots' stamps, so learnt whether the
//     caller polled or slept) took longer than that;
//   - only by a caller whose call is the only mailbox call of the server
//     in flight (mailboxCalls): with more, the CPUs have other work;
//   - not while spinQuietUntil holds: a poll that lost its CPU for more
//     than spinPreempted (another thread or goroutine wanted it) turns
//     polling off, on both sides, for spinQuiet.
const (
	// callerSpinCap covers an answer that takes a worker's wake-up and a
	// small model's run: in ServerOverhead those answers came about 61
	// µs after the post, just over the 60 µs the cap was, so that no
	// caller polled and each slept and was woken (BenchmarkHopFloor: a
	// futex round trip between two processes here is 16 µs at the median
	// and 26-33 µs on average, with a tail past 60 µs).
	callerSpinCap = 150 * time.Microsecond
	// spinPreempted is a pause between two polls that says the CPU is
	// wanted by someone else.
	spinPreempted = 20 * time.Microsecond
	// spinQuiet is how long polling stays off after one lost its CPU.
	spinQuiet = 20 * time.Millisecond
	// neverPreempted is the pause of a poll that does not give way
	// (runnerFlags.workerSpin with --allow-spinning): longer than any
	// poll's budget.
	neverPreempted = time.Duration(math.MaxInt64)
)

// mailboxCalls counts the server's mailbox calls in flight, across runners.
var mailboxCalls atomic.Int32

// spinQuietUntil is when polling may start again in this process
// (monoNanos).
var spinQuietUntil atomic.Int64

// spinPolicy is how one side polls.
type spinPolicy struct {
	// limit bounds one poll; 0 or less: the side never polls.
	limit time.Duration
	// preempted is a pause between two reads that ends a poll, and
	// polling on both sides for spinQuiet: the CPU is wanted elsewhere.
	preempted time.Duration
}

// spinning is the polling of a model that allows spinning, on both
// sides of its mailbox (runnerFlags.workerSpin; startProcess for the
// caller): up to maxMailboxSpin, not giving way when the CPU is wanted
// elsewhere nor while other polls have turned polling off.
var spinning = spinPolicy{limit: maxMailboxSpin, preempted: neverPreempted}

// givesWay reports whether the policy stops polling when the CPU is
// wanted elsewhere (a pause of preempted), and does not poll while
// polling is off (quiet).
func (p spinPolicy) givesWay() bool { return p.preempted < neverPreempted }

// poll reads until done says so (true) or budget has passed since start
// (false). Between reads it lets the goroutines that want the processor
// run.
func (p spinPolicy) poll(done func() bool, start time.Time, budget time.Duration) bool {
	last := start
	for {
		if done() {
			return true
		}
		goruntime.Gosched()
		now := time.Now()
		if now.Sub(last) > p.preempted {
			spinQuietUntil.Store(monoNanos() + int64(spinQuiet))
			return false
		}
		if now.Sub(start) >= budget {
			return false
		}
		last = now
	}
}

// quiet reports whether polling is off at now.
func quiet() bool { return monoNanos() < spinQuietUntil.Load() }

// spinBudget is how long a caller may poll for its answer: twice the
// recent answer time (room for its spread), at least a quarter of the cap
// and at most the cap; 0 when the answers take longer than the cap or
// polling is off.
func (m *mailbox) spinBudget() time.Duration {
	est := time.Duration(m.answerNs.Load())
	if m.spin.limit <= 0 || est <= 0 || est > m.spin.limit {
		return 0
	}
	return min(m.spin.limit, max(2*est, m.spin.limit/4))
}

// poll polls slot i for up to spinBudget while this is the only mailbox
// call in flight (alone). It returns the slot's state and whether the
// wait ended while polling; false: the caller sleeps on it (await).
func (m *mailbox) poll(i int, dead *atomic.Bool, alone bool) (uint32, bool) {
	budget := m.spinBudget()
	if budget <= 0 || !alone {
		return 0, false
	}
	start := time.Now()
	if m.spin.givesWay() && quiet() {
		return 0, false
	}
	m.stats.spins.Add(1)
	st := m.state(i)
	var s uint32
	if !m.spin.poll(func() bool { s = atomic.LoadUint32(st); return ended(s) || dead.Load() }, start, budget) {
		return 0, false
	}
	m.stats.caught.Add(1)
	return s, true
}

// learn folds the answer time of the call posted at posted into slot i
// into answerNs, after the answer was read, and adds the call's stamps to
// stats. Each time counts at most twice the cap, so that one stall moves
// the average by a quarter of the cap, not by the stall; a stamp out of
// order counts as the cap.
func (m *mailbox) learn(i int, posted int64) {
	answered, taken := atomic.LoadInt64(m.answeredAt(i)), atomic.LoadInt64(m.takenAt(i))
	learnInto(&m.answerNs, answered-posted, max(m.spin.limit, callerSpinCap))
	m.stats.calls.Add(1)
	m.stats.toTake.Add(taken - posted)
	m.stats.toAnswer.Add(answered - taken)
	m.stats.toSeen.Add(monoNanos() - answered)
}

// learnInto folds sample d (nanoseconds) into the moving average avg
// (weight 1/8), d clamped to [0, 2*limit]; a negative d counts as limit.
func learnInto(avg *atomic.Int64, d int64, limit time.Duration) {
	switch {
	case d < 0:
		d = int64(limit)
	case d > 2*int64(limit):
		d = 2 * int64(limit)
	}
	old := avg.Load()
	if old == 0 {
		avg.Store(d + 1) // 0 is "nothing learnt yet"
		return
	}
	avg.Store(old + (d-old)/8)
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
	resp, err := decodeAnswer(m.respArea(i)[:n], &m.names)
	if err != nil {
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
	// spin is how a worker polls the doorbell after an answer before it
	// sleeps (mailboxWorkers.poll); the zero policy never polls.
	spin spinPolicy
	// idleClass reports whether the runner runs in the idle scheduling
	// class, where its workers do not poll; nil: threadIdleClass.
	idleClass func() bool
	quit      atomic.Bool
	wg        sync.WaitGroup

	// serving counts the workers running a call.
	serving atomic.Int32
	// polling is held by the one worker that polls the doorbell; the
	// others sleep. One is enough to catch the next call, and more would
	// only take the cores a busy runner's other instances and the server
	// want (with allow_spinning, every idle worker of both instances of
	// a model polled, and 16 clients got 0.58x the default's answers;
	// with one poller a runner, 0.76x: BENCHMARKS.md).
	polling atomic.Bool
	// lastAnswer is when a worker last answered, and gapNs the recent
	// time from an answer to the next post (a moving average), both in
	// nanoseconds.
	lastAnswer atomic.Int64
	gapNs      atomic.Int64
	idle       idleCheck
	// stats counts what the workers' waits did, in the shared header
	// (workerStats); start sets it.
	stats *mailboxStats
}

// The workers' spin: after an answer, a worker whose next call usually
// comes within workerSpinCap polls the doorbell for that long before it
// sleeps, so that a call close behind the last one wakes no thread. Not
// while another worker of the runner runs a call (the CPU is its), nor in
// the idle scheduling class (a background runner), nor while polling is
// quiet (spinQuietUntil), nor when the recent gaps between an answer and
// the next post (gapNs, from the stamps) were longer than the cap.
const workerSpinCap = 40 * time.Microsecond

// maxMailboxSpin bounds --mailbox-spin: polling is for wake-ups, which
// cost tens of microseconds, not for waits a sleep serves as well.
const maxMailboxSpin = time.Millisecond

// start starts n workers.
func (w *mailboxWorkers) start(n int) {
	w.stats = w.workerStats()
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
			if w.poll(bell) {
				continue
			}
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
				w.stats.sleeps.Add(1)
				futexWait(w.doorbell(), bell, time.Second)
			}
			atomic.AddUint32(w.sleepers(), ^uint32(0))
			continue
		}
		next = (i + 1) % w.slots
		atomic.StoreInt64(w.takenAt(i), monoNanos())
		// The time from the last answer to this post, 0 when the call
		// was posted before it.
		learnInto(&w.gapNs, max(atomic.LoadInt64(w.postedAt(i))-w.lastAnswer.Load(), 0), max(w.spin.limit, workerSpinCap))
		w.serving.Add(1)
		w.serve(i)
		w.serving.Add(-1)
		w.lastAnswer.Store(monoNanos())
	}
}

// poll polls the doorbell, still at bell, for up to the cap when the
// next call is likely to come that soon and the CPU is not wanted
// elsewhere; true when it rang meanwhile.
func (w *mailboxWorkers) poll(bell uint32) bool {
	limit := w.spin.limit
	if gap := time.Duration(w.gapNs.Load()); limit <= 0 || gap <= 0 || gap > limit || w.serving.Load() > 0 || w.quit.Load() {
		return false
	}
	start := time.Now()
	if (w.spin.givesWay() && quiet()) || w.idle.idle(w.idleClass) {
		return false
	}
	if !w.polling.CompareAndSwap(false, true) {
		return false
	}
	defer w.polling.Store(false)
	w.stats.spins.Add(1)
	if !w.spin.poll(func() bool { return atomic.LoadUint32(w.doorbell()) != bell }, start, limit) {
		return false
	}
	w.stats.caught.Add(1)
	return true
}

// idleCheck caches whether the runner runs in the idle scheduling class:
// the limiter may move it there or out at any time, so the answer is
// read again every idleRecheck.
type idleCheck struct {
	at   atomic.Int64 // when it was last read (monoNanos)
	isIt atomic.Bool
}

const idleRecheck = 100 * time.Millisecond

func (c *idleCheck) idle(read func() bool) bool {
	if t := monoNanos(); t-c.at.Load() >= int64(idleRecheck) {
		if read == nil {
			read = threadIdleClass
		}
		c.isIt.Store(read())
		c.at.Store(t)
	}
	return c.isIt.Load()
}

// threadIdleClass reports whether the calling thread is in the idle
// scheduling class (SCHED_IDLE), as the unprivileged limiter puts every
// thread of a background runner.
func threadIdleClass() bool {
	attr, err := unix.SchedGetAttr(0, 0)
	return err == nil && attr.Policy == unix.SCHED_IDLE
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
			atomic.StoreInt64(w.answeredAt(i), monoNanos())
			// A caller polling for the answer needs no wake-up (see
			// mailbox.await for the order of the two words).
			if atomic.CompareAndSwapUint32(w.state(i), slotTaken, slotAnswered) && atomic.LoadUint32(w.waiting(i)) != 0 {
				w.stats.wakes.Add(1)
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
