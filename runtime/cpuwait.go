package runtime

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
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
	selfAt      time.Time    // when self was read (at most selfWaitEvery before start)
	answers     func() int64 // the runner's answers so far; nil: not counted
	answered    int64
	ok          bool
	// busy says whether the runner has a call in flight (one the server
	// still waits for, so inside its call timeout); nil: not asked, and
	// throttling is not read.
	busy func() bool
	// throttled is how many times a CPU quota throttled the runner's
	// cgroup or one above it (cgroupThrottled); throttleOK false when the
	// kernel does not say.
	throttled  uint64
	throttleOK bool
}

// selfWaitEvery is how often at most the server's own CPU wait is read
// for the starvation measures (selfWait).
const selfWaitEvery = 100 * time.Millisecond

// selfWaitSample is the server's CPU wait as last read.
var selfWaitSample struct {
	sync.Mutex
	at   time.Time
	wait time.Duration
	ok   bool
}

// selfWait is the server's own CPU wait (cpuWait of this process), and
// when it was read: at most once per selfWaitEvery and shared by every measure: it only
// goes into the log, and reading it costs a file per thread of the
// server. With 40 idle-class runners on a busy host every health check
// outlasts checkQuiet and is measured, and reading the server's threads
// twice per check took 60% of the server's CPU (perf, while 40 such
// runners stopped: 1.5 of 2.4 CPU-seconds in the measures).
func selfWait() (time.Duration, time.Time, bool) {
	s := &selfWaitSample
	s.Lock()
	defer s.Unlock()
	if now := time.Now(); now.Sub(s.at) >= selfWaitEvery {
		s.wait, s.ok = cpuWait(os.Getpid())
		s.at = now
	}
	return s.wait, s.at, s.ok
}

// startStarvation samples the CPU times before a check of pid; answers,
// when not nil, counts the calls the runner has answered (its progress);
// busy, when not nil, says whether it has a call in flight, and the
// throttling of its cgroup is sampled too (see starved).
func startStarvation(pid int, answers func() int64, busy func() bool) starvation {
	r, w, ok1 := cpuTimes(pid)
	s, at, ok2 := selfWait()
	st := starvation{pid: pid, start: time.Now(), ran: r, waited: w, self: s, selfAt: at, ok: ok1 && ok2, answers: answers, busy: busy}
	if answers != nil {
		st.answered = answers()
	}
	if busy != nil {
		st.throttled, st.throttleOK = cgroupThrottled(pid)
	}
	return st
}

// starved says, after a failed check, whether the runner was starved of
// CPU meanwhile rather than hung, and how long it and the server waited
// for a CPU, for the log. It was when it made progress (answered a call
// meanwhile), or when the measures of the check say so (checkMeasure).
// When the kernel does not say, no check is starved: every failed one
// counts, as it always did.
func (s starvation) starved() (bool, string) {
	took := time.Since(s.start)
	progress := int64(0)
	if s.answers != nil {
		progress = s.answers() - s.answered
	}
	r, w, ok := cpuTimes(s.pid)
	self, _, ok2 := selfWait()
	if !s.ok || !ok || !ok2 {
		return progress > 0, fmt.Sprintf("check took %v, CPU times unknown, %d calls answered meanwhile", took.Round(time.Millisecond), progress)
	}
	// Threads that ended took their counts along: a sum may shrink.
	m := checkMeasure{took: took, ran: max(r-s.ran, 0), waited: max(w-s.waited, 0)}
	m.runnable, m.stopped, _ = threadStates(s.pid)
	quota := ""
	if s.busy != nil {
		m.busy, m.busyKnown = s.busy(), true
		quota = fmt.Sprintf(", a call in flight: %v", m.busy)
		if th, ok := cgroupThrottled(s.pid); ok && s.throttleOK {
			m.throttled = th - min(th, s.throttled)
			quota = fmt.Sprintf(", throttled by a CPU quota %d times with a call in flight: %v", m.throttled, m.busy)
		}
	}
	server := fmt.Sprintf("the server waited %v", max(self-s.self, 0).Round(time.Millisecond))
	if m.asleepInCall() {
		// Only here is the server's own wait read afresh (it costs a file
		// per thread of the server), from the last shared sample on.
		if now, ok := cpuWait(os.Getpid()); ok {
			m.serverWaited, m.serverWindow, m.serverKnown = max(now-s.self, 0), time.Since(s.selfAt), true
			server = fmt.Sprintf("the server waited %v over the last %v", m.serverWaited.Round(time.Millisecond), m.serverWindow.Round(time.Millisecond))
		}
	}
	return m.starved() || progress > 0, fmt.Sprintf("check took %v, the runner ran %v and waited %v for a CPU meanwhile (a thread runnable at the end: %v%s), answered %d calls; %s",
		took.Round(time.Millisecond), m.ran.Round(time.Millisecond), m.waited.Round(time.Millisecond), m.runnable, quota, progress, server)
}

// checkMeasure is what the kernel said of a runner (and of the server)
// over one failed check.
type checkMeasure struct {
	took        time.Duration // the check's time
	ran, waited time.Duration // the runner's threads' time on a CPU and waiting for one, summed
	// runnable: a thread of the runner was runnable at the end; stopped:
	// one was stopped (a frozen process).
	runnable, stopped bool
	// busy: the runner had a call in flight (busyKnown: asked); throttled:
	// how many times a CPU quota throttled its cgroup meanwhile (0 when
	// the kernel does not say).
	busy, busyKnown bool
	throttled       uint64
	// serverWaited: the server's threads' wait for a CPU over
	// serverWindow (which holds the check); read only when asleepInCall.
	serverWaited, serverWindow time.Duration
	serverKnown                bool
}

// starved says whether a runner that failed a check with measures m was
// starved of CPU rather than hung. It was when:
//   - it got less than 1/starvedShare of a CPU and waited for one at least
//     that long or has a thread runnable now: the kernel adds a wait to
//     the run delay only when the thread gets its CPU, so a thread that
//     has waited all along shows none yet;
//   - it waited for a CPU at least as long as it ran, and at least
//     1/starvedShare of the check's time, and no CPU quota throttled it
//     meanwhile (a quota's throttling shows as waiting too: a process
//     spinning at half a CPU's quota with no call in flight, a livelock,
//     "ran 205ms and waited 205ms", must still be found; the next case
//     excuses a quota's wait only with a call in flight): a runner whose threads wanted a
//     CPU as much as they got one is short of CPU, whatever it got (on a
//     busy host with a call in flight, "ran 15ms and waited 43ms" in a
//     7 ms check: the threads' times are summed, and a running thread's
//     count moves in scheduler ticks, so that a short check can show more
//     run time than its own length);
//   - with a call in flight, it waited for a CPU at least 1/starvedShare
//     of the check's time while a CPU quota throttled its cgroup (or one
//     above it): a runner that runs a call at its quota's limit gets all
//     the CPU it may have, more than 1/starvedShare of one under a quota
//     of half a CPU, and is busy, not hung;
//   - with a call in flight, no thread of it ran or waited for a quarter
//     of the check and none is runnable or stopped, while the server
//     itself waited for a CPU at least as long as the window measured
//     (one of its threads waiting all along, on average): the runner
//     sleeps because the call is with the server (its request not yet
//     handed over, or its answer not yet taken), and the check's request
//     and answer are the server's to send and read. Under two CPU
//     burners such a runner slept in futex and epoll waits, all its
//     threads, while the server ran 11 ms and waited 366 ms in a 110 ms
//     check (TestRunnerAtItsQuotaIsNotHung).
//
// So a runner is found hung only when it had the CPU and answered nothing
// (a livelock: no call in flight, or no throttling, and it ran more than
// it waited), or had no runnable thread while the server could run
// (deadlocked), or was frozen. A livelock under a quota during a call is
// found once the call's timeout abandons the call. The server's wait
// excuses nothing else: a server busy on a busy host waits for a CPU much
// of the time, and a runner deadlocked with no call in flight beside it
// must still be found.
func (m checkMeasure) starved() bool {
	share := m.took / starvedShare
	if m.ran < share && (m.waited >= share || m.runnable) {
		return true
	}
	if m.waited >= m.ran && m.waited >= share && m.throttled == 0 {
		return true
	}
	if m.busyKnown && m.busy && m.throttled > 0 && m.waited >= share {
		return true
	}
	return m.asleepInCall() && m.serverKnown && m.serverWaited >= m.serverWindow
}

// asleepInCall says whether the runner slept through the check with a
// call in flight: no thread runnable or stopped at the end, and less than
// 1/starvedShare of the check's time run and waited.
func (m checkMeasure) asleepInCall() bool {
	share := m.took / starvedShare
	return m.busyKnown && m.busy && !m.runnable && !m.stopped && m.ran < share && m.waited < share
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
			s := startStarvation(pid, nil, nil)
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

// cgroupThrottled is how many times CFS bandwidth control (a CPU quota:
// cgroup v1 cpu.cfs_quota_us, v2 cpu.max) has throttled the cpu cgroup of
// process pid and each cgroup above it, summed (nr_throttled in each
// cpu.stat); false when the kernel does not say. A quota on a parent
// throttles the processes below it, but only the parent counts it.
func cgroupThrottled(pid int) (uint64, bool) {
	dir, ok := cpuCgroupDir(pid)
	if !ok {
		return 0, false
	}
	var n uint64
	found := false
	for d := dir.path; ; d = filepath.Dir(d) {
		if b, err := os.ReadFile(filepath.Join(d, "cpu.stat")); err == nil {
			if v, ok := statField(b, "nr_throttled"); ok {
				n += v
				found = true
			}
		}
		if d == dir.mount || len(d) <= len(dir.mount) {
			break
		}
	}
	return n, found
}

// cgroupDir is a cgroup's directory and the mount point of its hierarchy.
type cgroupDir struct{ path, mount string }

// cpuCgroupDir is the directory of the cgroup of process pid that the cpu
// controller enforces: the cgroup v1 hierarchy with cpu, else the v2 one.
func cpuCgroupDir(pid int) (cgroupDir, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return cgroupDir{}, false
	}
	return cpuCgroupDirIn(cgroupMounts(), b)
}

// cpuCgroupDirIn is cpuCgroupDir for a process whose /proc/<pid>/cgroup
// reads b, among mounts.
func cpuCgroupDirIn(mounts []cgroupMount, b []byte) (cgroupDir, bool) {
	var v2 string
	v2ok := false
	for line := range bytes.Lines(b) {
		// hierarchy-ID:controller-list:cgroup-path
		f := bytes.SplitN(bytes.TrimRight(line, "\n"), []byte(":"), 3)
		if len(f) != 3 {
			continue
		}
		path := string(f[2])
		if len(f[1]) == 0 && string(f[0]) == "0" {
			v2, v2ok = path, true
			continue
		}
		for c := range bytes.SplitSeq(f[1], []byte(",")) {
			if string(c) != "cpu" {
				continue
			}
			for _, m := range mounts {
				if !m.v2 && m.cpu {
					if d, ok := m.dir(path); ok {
						return d, true
					}
				}
			}
		}
	}
	if v2ok {
		for _, m := range mounts {
			if m.v2 {
				if d, ok := m.dir(v2); ok {
					return d, true
				}
			}
		}
	}
	return cgroupDir{}, false
}

// cgroupMount is one mounted cgroup hierarchy.
type cgroupMount struct {
	root, point string // the mounted cgroup's path in the hierarchy, and where
	v2, cpu     bool   // cgroup2; a v1 hierarchy with the cpu controller
}

// dir is the directory of the cgroup at path (as /proc/<pid>/cgroup says
// it) under m; false when m does not hold it.
func (m cgroupMount) dir(path string) (cgroupDir, bool) {
	rel, ok := strings.CutPrefix(path, m.root)
	// A cgroup outside this process's cgroup namespace reads "/../x".
	if !ok || (rel != "" && m.root != "/" && !strings.HasPrefix(rel, "/")) || slices.Contains(strings.Split(path, "/"), "..") {
		return cgroupDir{}, false
	}
	return cgroupDir{path: filepath.Join(m.point, rel), mount: m.point}, true
}

// cgroupMounts are the cgroup hierarchies mounted in this process's mount
// namespace, read once (/proc/self/mountinfo).
var cgroupMounts = sync.OnceValue(func() []cgroupMount {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	return parseCgroupMounts(b)
})

// parseCgroupMounts reads the cgroup mounts of a mountinfo file: "ID
// parent major:minor root mount-point options [optional...] - type source
// super-options".
func parseCgroupMounts(b []byte) []cgroupMount {
	var out []cgroupMount
	for line := range bytes.Lines(b) {
		pre, post, ok := bytes.Cut(bytes.TrimRight(line, "\n"), []byte(" - "))
		if !ok {
			continue
		}
		f, g := bytes.Fields(pre), bytes.Fields(post)
		if len(f) < 5 || len(g) < 3 {
			continue
		}
		m := cgroupMount{root: unescapeMount(string(f[3])), point: unescapeMount(string(f[4]))}
		switch string(g[0]) {
		case "cgroup2":
			m.v2 = true
		case "cgroup":
			for o := range bytes.SplitSeq(g[2], []byte(",")) {
				m.cpu = m.cpu || string(o) == "cpu"
			}
			if !m.cpu {
				continue
			}
		default:
			continue
		}
		out = append(out, m)
	}
	return out
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// statField is the value of key in a "key value" per line file (cpu.stat).
func statField(b []byte, key string) (uint64, bool) {
	for line := range bytes.Lines(b) {
		k, v, ok := bytes.Cut(bytes.TrimSpace(line), []byte(" "))
		if ok && string(k) == key {
			n, err := strconv.ParseUint(string(v), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}
