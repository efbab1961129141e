package runtime

import (
	"fmt"
	goruntime "runtime"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// The tests of the mailbox's polling (mailbox.poll, mailboxWorkers.poll)
// give it wide limits and never count a pause as preemption: they are
// about what polls and what sleeps, not about this machine's timings.

// waitCounts are a rig's sleeps and wake-ups over some calls.
type waitCounts struct {
	callerSleeps, callerPolls, callerCaught int64 // the server's callers
	answerWakes                             int64 // workers waking a caller
	doorbellWakes                           int64 // callers waking a worker
	workerSleeps, workerPolls               int64
}

func (r *mailboxRig) counts() waitCounts {
	return waitCounts{
		callerSleeps: r.box.stats.sleeps.Load(), callerPolls: r.box.stats.spins.Load(), callerCaught: r.box.stats.caught.Load(),
		answerWakes: r.workers.stats.wakes.Load(), doorbellWakes: r.box.stats.wakes.Load(),
		workerSleeps: r.workers.stats.sleeps.Load(), workerPolls: r.workers.stats.spins.Load(),
	}
}

func (c waitCounts) sub(o waitCounts) waitCounts {
	return waitCounts{c.callerSleeps - o.callerSleeps, c.callerPolls - o.callerPolls, c.callerCaught - o.callerCaught,
		c.answerWakes - o.answerWakes, c.doorbellWakes - o.doorbellWakes, c.workerSleeps - o.workerSleeps, c.workerPolls - o.workerPolls}
}

// echoCalls makes n calls one after the other and returns what the waits
// did meanwhile.
func (r *mailboxRig) echoCalls(t *testing.T, n int, between time.Duration) waitCounts {
	t.Helper()
	before := r.counts()
	for i := range n {
		if between > 0 {
			time.Sleep(between)
		}
		if err := echoCall(t.Context(), r.c, fmt.Sprint("x", i), []byte(fmt.Sprint(i))); err != nil {
			t.Fatal(err)
		}
	}
	return r.counts().sub(before)
}

// wideSpin polls for long and never takes a pause for preemption.
var wideSpin = spinPolicy{limit: 20 * time.Millisecond, preempted: time.Hour}

// notIdle is an idle-class check that says the runner is not in it.
func notIdle() bool { return false }

// Calls one after the other, whose answers come soon: the caller polls
// for its answer and the worker for the next call, so that neither sleeps
// nor wakes the other (no futex system calls); without polling the worker
// sleeps after every call and each call wakes it. On a busy machine a
// poll can miss (a side loses its CPU): the best of three rounds counts.
func TestMailboxPollingTakesTheWakeUpsOff(t *testing.T) {
	spinQuietUntil.Store(0)
	const calls = 200
	off := newMailboxRigSpin(t, 4, 1, echo, spinPolicy{}, notIdle)
	off.box.spin = spinPolicy{}
	off.echoCalls(t, 20, 0)
	base := off.echoCalls(t, calls, 0)
	t.Logf("without polling: %+v", base)
	if base.callerPolls != 0 || base.workerPolls != 0 {
		t.Fatalf("polling off, yet %+v", base)
	}
	// Without polling the worker sleeps whenever it finds no call, and
	// each sleep takes a wake-up: about once a call on a quiet machine. On
	// a busy one the worker often loses its CPU right after an answer and
	// finds the next call already there (72 sleeps in 200 calls beside a
	// -race suite and two burners): the rig's check is only that it sleeps
	// and is woken, the comparison is with polling below.
	if base.doorbellWakes < calls/10 || base.workerSleeps < calls/10 {
		t.Fatalf("without polling the worker slept %d times and was woken %d times in %d calls; want a tenth at least",
			base.workerSleeps, base.doorbellWakes, calls)
	}
	on := newMailboxRigSpin(t, 4, 1, echo, wideSpin, notIdle)
	on.box.spin = wideSpin
	on.echoCalls(t, 20, 0) // learn how soon answers and calls come
	var best waitCounts
	for round := range 3 {
		got := on.echoCalls(t, calls, 0)
		t.Logf("round %d: %+v", round, got)
		if round == 0 || got.callerSleeps+got.answerWakes+got.doorbellWakes < best.callerSleeps+best.answerWakes+best.doorbellWakes {
			best = got
		}
	}
	if best.callerPolls < calls/2 || best.callerCaught < calls/2 {
		t.Errorf("%d of %d callers polled and %d caught their answer, want most", best.callerPolls, calls, best.callerCaught)
	}
	for _, c := range []struct {
		what string
		n    int64
	}{
		{"caller sleeps", best.callerSleeps},
		{"wake-ups of callers", best.answerWakes},
		{"worker sleeps", best.workerSleeps},
		{"wake-ups of workers", best.doorbellWakes},
	} {
		if c.n*4 > calls {
			t.Errorf("%s: %d in %d calls with polling, want at most a quarter", c.what, c.n, calls)
		}
	}
	if best.doorbellWakes >= base.doorbellWakes {
		t.Errorf("workers were woken %d times in %d calls with polling, %d without: want fewer", best.doorbellWakes, calls, base.doorbellWakes)
	}
	if n := on.box.freeSlots(); n != 4 {
		t.Errorf("%d free slots after the calls, want 4", n)
	}
}

// A caller polls by default for an answer that takes a worker's wake-up
// and a small model's run: in ServerOverhead the answers took about 61 µs
// from the post, over the 60 µs the caller's cap used to be, so that no
// caller polled. The budget is twice the recent answer time, within the
// cap, and none when the answers take longer than the cap. (Whether a
// poll catches its answer is TestMailboxPollingTakesTheWakeUpsOff's; on a
// machine with no free CPU a poll slows the answer it waits for, which
// the pause for preemption turns polling off for.)
func TestMailboxCallerPollsForAWakeUpAndARun(t *testing.T) {
	ar, err := newArena("test", 4096, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer ar.close()
	m := ar.box
	for _, tt := range []struct {
		answers, want time.Duration
	}{
		{20 * time.Microsecond, 40 * time.Microsecond},
		{61 * time.Microsecond, 122 * time.Microsecond}, // ServerOverhead's
		{100 * time.Microsecond, callerSpinCap},
		{callerSpinCap + time.Microsecond, 0},
	} {
		m.answerNs.Store(int64(tt.answers))
		if got := m.spinBudget(); got != tt.want {
			t.Errorf("answers in %v: the caller polls for %v, want %v (cap %v)", tt.answers, got, tt.want, callerSpinCap)
		}
	}
}

// Each side polls only when what it waits for came within its limit
// lately: a caller whose answers take longer, or a worker whose next call
// comes later, sleeps at once; once answers and calls come soon again,
// both poll again.
func TestMailboxPollingAdapts(t *testing.T) {
	spinQuietUntil.Store(0)
	pol := spinPolicy{limit: 2 * time.Millisecond, preempted: time.Hour}
	var slow atomic.Bool
	rig := newMailboxRigSpin(t, 4, 1, func(req *runnerpb.InferRequest) *runnerpb.InferResponse {
		if slow.Load() {
			time.Sleep(2 * pol.limit)
		}
		return echo(req)
	}, pol, notIdle)
	rig.box.spin = pol

	slow.Store(true)
	if got := rig.echoCalls(t, 10, 0); got.callerPolls != 0 {
		t.Errorf("answers of twice the limit: %d of 10 callers polled, want none", got.callerPolls)
	}
	slow.Store(false)
	rig.echoCalls(t, 40, 0) // the answer time comes down
	// On a busy host a call preempted past the limit has its side sleep
	// (beside two CPU burners 13 workers of 20 polled): polling is back
	// when one round of a few has nearly all of both.
	var got waitCounts
	for range 5 {
		if got = rig.echoCalls(t, 20, 0); got.callerPolls >= 15 && got.workerPolls >= 15 {
			break
		}
	}
	if got.callerPolls < 15 || got.workerPolls < 15 {
		t.Errorf("answers and calls back to back again: %d callers and %d workers of 20 polled in the last of 5 rounds, want nearly all", got.callerPolls, got.workerPolls)
	}
	// Calls spaced by twice the worker's limit: the worker sleeps at once.
	rig.echoCalls(t, 10, 2*pol.limit) // the gap goes up
	if got := rig.echoCalls(t, 10, 2*pol.limit); got.workerPolls != 0 {
		t.Errorf("calls spaced by twice the limit: the worker polled %d times in 10 calls, want 0", got.workerPolls)
	}
}

// Polling gives way when the CPUs have other work: a caller polls only
// when its call is the only mailbox call in flight, a worker only when no
// other worker of its runner runs a call and the runner is not in the
// idle scheduling class.
func TestMailboxNoPollingWhenBusy(t *testing.T) {
	spinQuietUntil.Store(0)
	t.Run("another call in flight", func(t *testing.T) {
		gate := make(chan struct{})
		held := make(chan struct{})
		rig := newMailboxRigSpin(t, 4, 2, func(req *runnerpb.InferRequest) *runnerpb.InferResponse {
			if req.GetInputs()[0].GetName() == "held" {
				close(held)
				<-gate
			}
			return echo(req)
		}, wideSpin, notIdle)
		rig.box.spin = wideSpin
		rig.echoCalls(t, 20, 0) // both sides have learnt to poll
		waits := func() int64 { return rig.box.stats.spins.Load() + rig.box.stats.sleeps.Load() }
		before := waits()
		errs := make(chan error, 1)
		go func() { errs <- echoCall(t.Context(), rig.c, "held", []byte("x")) }()
		<-held
		// The held call's caller, alone when it posted, polls: a worker
		// can take the call before its caller starts to, and that poll
		// is not one of the calls below.
		for waits() == before {
			time.Sleep(100 * time.Microsecond)
		}
		got := rig.echoCalls(t, 20, 0)
		close(gate)
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
		// A side checks whether it is alone, then counts its poll and
		// polls: one whose check ran before the held call began, and
		// which lost its CPU before it counted (beside two CPU burners),
		// counts in the calls below. More than one is polling beside a
		// running call.
		if got.callerPolls > 1 || got.workerPolls > 1 {
			t.Errorf("with a call running beside them %d callers and %d workers polled, want none (one at most that checked before it began)", got.callerPolls, got.workerPolls)
		}
		if got := rig.echoCalls(t, 20, 0); got.callerPolls == 0 {
			t.Errorf("alone again, no caller polled: %+v", got)
		}
	})
	t.Run("idle class", func(t *testing.T) {
		rig := newMailboxRigSpin(t, 4, 1, echo, wideSpin, func() bool { return true })
		rig.box.spin = wideSpin
		rig.echoCalls(t, 20, 0)
		if got := rig.echoCalls(t, 50, 0); got.workerPolls != 0 {
			t.Errorf("a runner in the idle class: its worker polled %d times in 50 calls, want 0", got.workerPolls)
		}
	})
}

// A poll that loses its processor for longer than its policy's preempted
// stops at once and turns polling off for spinQuiet; while it is off
// nobody polls.
func TestMailboxPollPreemptedGoesQuiet(t *testing.T) {
	spinQuietUntil.Store(0)
	defer spinQuietUntil.Store(0)
	prev := goruntime.GOMAXPROCS(1)
	defer goruntime.GOMAXPROCS(prev)
	// The budget is long against the pause the hog causes, so that only a
	// poll that gives up for the pause returns before it.
	p := spinPolicy{limit: 400 * 50 * time.Microsecond, preempted: 50 * time.Microsecond}
	hogged := make(chan struct{})
	// Runs when the poll yields, and keeps the only processor for twenty
	// of the pauses the policy allows.
	hogThen(20*p.preempted, func() { close(hogged) })
	if p.poll(func() bool { return false }, time.Now(), p.limit) {
		t.Fatal("a poll of a word nobody writes ended as answered")
	}
	select {
	case <-hogged:
	default:
		t.Fatal("the poll never let the other goroutine run")
	}
	if !quiet() {
		t.Fatal("polling not turned off after a poll lost its processor")
	}

	ar, err := newArena("test", 4096, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer ar.close()
	m := ar.box
	m.spin = wideSpin
	m.answerNs.Store(int64(time.Microsecond))
	atomic.StoreUint32(m.state(0), slotAnswered)
	var dead atomic.Bool
	if _, ok := m.poll(0, &dead, true); ok || m.stats.spins.Load() != 0 {
		t.Errorf("a caller polled while polling is off (polls %d)", m.stats.spins.Load())
	}
	spinQuietUntil.Store(0)
	if s, ok := m.poll(0, &dead, true); !ok || s != slotAnswered || m.stats.caught.Load() != 1 {
		t.Errorf("polling on again: poll = %d, %v (caught %d), want the answer", s, ok, m.stats.caught.Load())
	}
	if _, ok := m.poll(0, &dead, false); ok {
		t.Error("a caller polled with another call in flight")
	}
}

// threadIdleClass sees the idle scheduling class of the calling thread,
// as the unprivileged limiter sets it on a background runner's threads.
func TestThreadIdleClass(t *testing.T) {
	if threadIdleClass() {
		t.Skip("the test itself runs in the idle class")
	}
	type result struct {
		idle bool
		err  error
	}
	done := make(chan result, 1)
	go func() {
		// The thread stays locked: it ends with the goroutine, and its
		// class with it.
		goruntime.LockOSThread()
		a := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}
		if err := unix.SchedSetAttr(0, &a, 0); err != nil {
			done <- result{err: err}
			return
		}
		done <- result{idle: threadIdleClass()}
	}()
	r := <-done
	if r.err != nil {
		t.Skipf("cannot enter the idle class here: %v", r.err)
	}
	if !r.idle {
		t.Error("a thread in SCHED_IDLE is not seen in the idle class")
	}
}

// The moving average learns from each sample, counts a stall as at most
// twice the limit and never returns to "nothing learnt".
func TestLearnInto(t *testing.T) {
	var avg atomic.Int64
	const limit = 100 * time.Microsecond
	learnInto(&avg, int64(time.Second), limit)
	if got := time.Duration(avg.Load()); got > 2*limit+1 || got < 2*limit {
		t.Errorf("first sample of a second: average %v, want twice the limit %v", got, 2*limit)
	}
	for range 100 {
		learnInto(&avg, 0, limit)
	}
	if got := avg.Load(); got <= 0 || time.Duration(got) > time.Microsecond {
		t.Errorf("after 100 samples of 0: average %d ns, want a little above 0", got)
	}
	learnInto(&avg, -5, limit)
	if got := time.Duration(avg.Load()); got < limit/8-time.Microsecond || got > limit/8+time.Microsecond {
		t.Errorf("a sample out of order counts as the limit: average %v, want about %v", got, limit/8)
	}
}

// A poll whose policy never gives way (a model that allows spinning)
// goes on polling through a pause that would end the default's, catches
// what it waits for after it, and leaves polling on.
func TestMailboxPollNeverPreemptedPollsOn(t *testing.T) {
	spinQuietUntil.Store(0)
	defer spinQuietUntil.Store(0)
	prev := goruntime.GOMAXPROCS(1)
	defer goruntime.GOMAXPROCS(prev)
	p := spinPolicy{limit: time.Minute, preempted: neverPreempted}
	var rung atomic.Bool
	// Keeps the only processor for twenty of the default's pauses, then
	// rings.
	hogThen(20*spinPreempted, func() { rung.Store(true) })
	if !p.poll(rung.Load, time.Now(), p.limit) {
		t.Fatal("a poll that never gives way ended before what it waited for")
	}
	if quiet() {
		t.Error("a poll that never gives way turned polling off")
	}
}

// The workers' poll follows the model's spinning: the default's cap and
// yielding, a millisecond without yielding for a model that allows
// spinning, and an explicit --mailbox-spin over either.
func TestRunnerWorkerSpin(t *testing.T) {
	base := []string{"--socket", "s", "--model", "m", "--library", "l"}
	for _, c := range []struct {
		name string
		args []string
		want spinPolicy
	}{
		{"default", nil, spinPolicy{limit: workerSpinCap, preempted: spinPreempted}},
		{"allow spinning", []string{"--allow-spinning"}, spinPolicy{limit: maxMailboxSpin, preempted: neverPreempted}},
		{"explicit", []string{"--mailbox-spin", "100us"}, spinPolicy{limit: 100 * time.Microsecond, preempted: spinPreempted}},
		{"explicit over spinning", []string{"--allow-spinning", "--mailbox-spin", "0"}, spinPolicy{limit: 0, preempted: spinPreempted}},
	} {
		f, err := parseRunnerFlags(append(slices.Clone(base), c.args...))
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if got := f.workerSpin(); got != c.want {
			t.Errorf("%s: worker spin %+v, want %+v", c.name, got, c.want)
		}
	}
}

// While polling is off in the process (another poll lost its CPU), a
// mailbox whose model allows spinning still polls on both sides; one
// whose polls give way does not.
func TestMailboxSpinningPollsWhileQuiet(t *testing.T) {
	defer spinQuietUntil.Store(0)
	for _, c := range []struct {
		name string
		pol  spinPolicy
		poll bool
	}{{"spinning", spinning, true}, {"giving way", wideSpin, false}} {
		spinQuietUntil.Store(0)
		rig := newMailboxRigSpin(t, 4, 1, echo, c.pol, notIdle)
		rig.box.spin = c.pol
		rig.echoCalls(t, 20, 0) // learns the answer time and the gap
		spinQuietUntil.Store(monoNanos() + int64(time.Hour))
		got := rig.echoCalls(t, 50, 0)
		t.Logf("%s, polling off: %+v", c.name, got)
		if polled := got.callerPolls > 0 && got.workerPolls > 0; polled != c.poll {
			t.Errorf("%s: caller polled %d times and worker %d times in 50 calls while polling was off; want polls: %v",
				c.name, got.callerPolls, got.workerPolls, c.poll)
		}
		if !quiet() {
			t.Errorf("%s: polling was turned back on", c.name)
		}
	}
}

// One worker of a runner polls at a time: while another holds the poll,
// an idle worker sleeps instead (four workers, calls back to back).
func TestMailboxOneWorkerPolls(t *testing.T) {
	spinQuietUntil.Store(0)
	defer spinQuietUntil.Store(0)
	rig := newMailboxRigSpin(t, 4, 4, echo, wideSpin, notIdle)
	rig.box.spin = spinPolicy{}
	rig.echoCalls(t, 20, 0) // learns the gap
	// Held as another worker's poll would hold it (taken once a poll of
	// the warm-up has given it back).
	for !rig.workers.polling.CompareAndSwap(false, true) {
		time.Sleep(time.Millisecond)
	}
	if got := rig.echoCalls(t, 50, 0); got.workerPolls != 0 {
		t.Errorf("workers polled %d times in 50 calls while another held the poll, want 0", got.workerPolls)
	}
	rig.workers.polling.Store(false)
	if got := rig.echoCalls(t, 50, 0); got.workerPolls == 0 {
		t.Errorf("no worker polled in 50 calls back to back once the poll was free: %+v", got)
	}
	// The last poll ends within its limit and gives the poll back.
	for deadline := time.Now().Add(time.Minute); rig.workers.polling.Load(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the poll still held a minute after the last call")
		}
	}
}

// hogThen starts a goroutine that keeps its processor busy for d, then
// calls then.
func hogThen(d time.Duration, then func()) {
	go func() {
		for t0 := time.Now(); time.Since(t0) < d; {
		}
		then()
	}()
}
