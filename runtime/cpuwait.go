package runtime

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"time"
)

// A health check that fails because the runner did not get a CPU in time
// says nothing about a hang: on a busy host a live runner can miss check
// after check, and a best-effort runner in the idle class gets no CPU at
// all while anything else wants it. The kernel counts, per thread, the
// time it ran on a CPU and the time it was runnable but waiting for one
// (the first two fields of /proc/<pid>/task/<tid>/schedstat; a throttled
// cgroup's waiting counts too). A frozen or deadlocked process has no
// runnable thread, so its run delay stands still; a starved one's grows
// with the wait, or it has a thread runnable still waiting. A process
// that spins without answering (a livelock) runs: it gets CPU time.

// starvedShare: a failed check whose process waited for a CPU for at
// least 1/starvedShare of the check's time, and ran for less than that,
// was starved, not hung.
const starvedShare = 4

// cpuWait is the time the threads of process pid (os.Getpid() for the
// server) have spent runnable but waiting for a CPU, summed over the
// threads alive now; false when the kernel does not say.
func cpuWait(pid int) (time.Duration, bool) {
	_, wait, ok := cpuTimes(pid)
	return wait, ok
}

// cpuTimes is the time the threads of process pid have run on a CPU and
// waited for one, summed over the threads alive now; false when the
// kernel does not say.
func cpuTimes(pid int) (run, wait time.Duration, ok bool) {
	paths, err := filepath.Glob("/proc/" + strconv.Itoa(pid) + "/task/*/schedstat")
	if err != nil || len(paths) == 0 {
		return 0, 0, false
	}
	for _, path := range paths {
		b, err := os.ReadFile(path)
		if err != nil {
			continue // the thread ended
		}
		r, w, err := parseSchedstat(b)
		if err != nil {
			continue
		}
		run += r
		wait += w
		ok = true
	}
	return run, wait, ok
}

// parseSchedstat reads the time on a CPU and the run delay, in
// nanoseconds, from a schedstat line: "<on-CPU ns> <run delay ns> <time
// slices>".
func parseSchedstat(b []byte) (run, wait time.Duration, err error) {
	fields := bytes.Fields(b)
	if len(fields) < 3 {
		return 0, 0, fmt.Errorf("schedstat %q: want 3 fields", b)
	}
	r, err1 := strconv.ParseInt(string(fields[0]), 10, 64)
	w, err2 := strconv.ParseInt(string(fields[1]), 10, 64)
	if err1 != nil || err2 != nil || r < 0 || w < 0 {
		return 0, 0, fmt.Errorf("schedstat %q: bad times", b)
	}
	return time.Duration(r), time.Duration(w), nil
}

// starvation measures the CPU time and wait of a runner process and the
// wait of the server across one health check (or one call).
type starvation struct {
	pid         int
	start       time.Time
	ran, waited time.Duration
	self        time.Duration
	answers     func() int64 // the runner's answers so far; nil: not counted
	answered    int64
	ok          bool
}

// startStarvation samples the CPU times before a check of pid; answers,
// when not nil, counts the calls the runner has answered (its progress).
func startStarvation(pid int, answers func() int64) starvation {
	r, w, ok1 := cpuTimes(pid)
	s, ok2 := cpuWait(os.Getpid())
	st := starvation{pid: pid, start: time.Now(), ran: r, waited: w, self: s, ok: ok1 && ok2, answers: answers}
	if answers != nil {
		st.answered = answers()
	}
	return st
}

// starved says, after a failed check, whether the runner was starved of
// CPU meanwhile rather than hung, and how long it and the server waited
// for a CPU, for the log. It was when it made progress (answered a call
// meanwhile), or when it got less than 1/starvedShare of a CPU and waited
// for one at least that long or has a thread runnable now: the kernel
// adds a wait to the run delay only when the thread gets its CPU, so a
// thread that has waited all along shows none yet. So a runner is found
// hung only when it had the CPU and answered nothing (a livelock), or had
// no runnable thread (frozen, deadlocked). Only the runner decides: a
// server busy on a busy host waits for a CPU all the time, and a frozen
// runner beside it must still be found hung. When the kernel does not
// say, no check is starved: every failed one counts, as it always did.
func (s starvation) starved() (bool, string) {
	took := time.Since(s.start)
	progress := int64(0)
	if s.answers != nil {
		progress = s.answers() - s.answered
	}
	r, w, ok := cpuTimes(s.pid)
	self, ok2 := cpuWait(os.Getpid())
	if !s.ok || !ok || !ok2 {
		return progress > 0, fmt.Sprintf("check took %v, CPU times unknown, %d calls answered meanwhile", took.Round(time.Millisecond), progress)
	}
	// Threads that ended took their counts along: a sum may shrink.
	dr, dw, ds := max(r-s.ran, 0), max(w-s.waited, 0), max(self-s.self, 0)
	run := runnable(s.pid)
	starved := dr*starvedShare < took && (dw*starvedShare >= took || run)
	return starved || progress > 0, fmt.Sprintf("check took %v, the runner ran %v and waited %v for a CPU meanwhile (a thread runnable at the end: %v), answered %d calls; the server waited %v",
		took.Round(time.Millisecond), dr.Round(time.Millisecond), dw.Round(time.Millisecond), run, progress, ds.Round(time.Millisecond))
}

// readyClock is a context for a process pid's start that ends once the
// process has had timeout of time in which it was not starved of CPU
// (see starvation; measured a tick at a time), or when ctx ends: a runner
// in the idle class beside busy processes loads its model when it gets a
// CPU, and must not be killed as too slow to start meanwhile. starved
// says how long the clock stood still.
func readyClock(ctx context.Context, pid int, timeout time.Duration) (_ context.Context, cancel context.CancelFunc, starved func() time.Duration) {
	ctx, cancelCause := context.WithCancelCause(ctx)
	tick := min(timeout/starvedShare, time.Second)
	var stood atomic.Int64
	go func() {
		left := timeout
		for left > 0 {
			s := startStarvation(pid, nil)
			t := time.NewTimer(min(tick, left))
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			took := time.Since(s.start)
			if ok, _ := s.starved(); ok {
				stood.Add(int64(took))
				continue
			}
			left -= took
		}
		cancelCause(context.DeadlineExceeded)
	}()
	return ctx, func() { cancelCause(context.Canceled) }, func() time.Duration { return time.Duration(stood.Load()) }
}

// runnable reports whether a thread of process pid is runnable (state R:
// running or waiting for a CPU).
func runnable(pid int) bool {
	run, _, _ := threadStates(pid)
	return run
}

// threadStates reports whether a thread of process pid is runnable (state
// R) and whether one is stopped (T, t: a frozen process); ok is false
// when the kernel says nothing of its threads.
func threadStates(pid int) (run, stopped, ok bool) {
	paths, _ := filepath.Glob("/proc/" + strconv.Itoa(pid) + "/task/*/stat")
	for _, path := range paths {
		b, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		ok = true
		// The state follows the command name, which ends at the last ')'.
		if i := bytes.LastIndexByte(b, ')'); i >= 0 && i+2 < len(b) {
			switch b[i+2] {
			case 'R':
				run = true
			case 'T', 't':
				stopped = true
			}
		}
	}
	return run, stopped, ok
}
