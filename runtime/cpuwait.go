package runtime

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// A health check that fails because the runner did not get a CPU in time
// says nothing about a hang: on a busy host a live
// runner can miss check after check. The kernel counts, per thread, the
// time it was runnable but waiting for a CPU (the run delay, the second
// field of /proc/<pid>/task/<tid>/schedstat; a throttled cgroup's waiting
// counts too). A frozen or deadlocked process has no runnable thread, so
// its run delay stands still; a starved one's grows with the wait, or it
// has a thread runnable still waiting.

// starvedShare: a failed check whose process waited for a CPU for at
// least 1/starvedShare of the check's time was starved, not hung.
const starvedShare = 4

// cpuWait is the time the threads of process pid (os.Getpid() for the
// server) have spent runnable but waiting for a CPU, summed over the
// threads alive now; false when the kernel does not say.
func cpuWait(pid int) (time.Duration, bool) {
	paths, err := filepath.Glob("/proc/" + strconv.Itoa(pid) + "/task/*/schedstat")
	if err != nil || len(paths) == 0 {
		return 0, false
	}
	var sum time.Duration
	read := false
	for _, path := range paths {
		b, err := os.ReadFile(path)
		if err != nil {
			continue // the thread ended
		}
		d, err := parseSchedstat(b)
		if err != nil {
			continue
		}
		sum += d
		read = true
	}
	return sum, read
}

// parseSchedstat reads the run delay, in nanoseconds, from a schedstat
// line: "<on-CPU ns> <run delay ns> <time slices>".
func parseSchedstat(b []byte) (time.Duration, error) {
	fields := bytes.Fields(b)
	if len(fields) < 3 {
		return 0, fmt.Errorf("schedstat %q: want 3 fields", b)
	}
	ns, err := strconv.ParseInt(string(fields[1]), 10, 64)
	if err != nil || ns < 0 {
		return 0, fmt.Errorf("schedstat %q: bad run delay", b)
	}
	return time.Duration(ns), nil
}

// starvation measures the CPU wait of a runner process and of the server
// across one health check.
type starvation struct {
	pid          int
	start        time.Time
	runner, self time.Duration
	ok           bool
}

// startStarvation samples the CPU waits before a check of pid.
func startStarvation(pid int) starvation {
	r, ok1 := cpuWait(pid)
	s, ok2 := cpuWait(os.Getpid())
	return starvation{pid: pid, start: time.Now(), runner: r, self: s, ok: ok1 && ok2}
}

// starved says, after a failed check, whether the runner was starved of
// CPU meanwhile, and how long it and the server waited for a CPU, for the
// log. It was when it waited for at least 1/starvedShare of the check's
// time, or when one of its threads is runnable now: the kernel adds a wait
// to the run delay only when the thread gets its CPU, so a thread that
// has waited all along shows none yet. Only the runner decides: a server
// busy on a busy host waits for a CPU all the time, and a frozen runner
// beside it must still be found hung. When the kernel does not say, no
// check is starved: every failed one counts, as it always did.
func (s starvation) starved() (bool, string) {
	took := time.Since(s.start)
	r, ok := cpuWait(s.pid)
	self, ok2 := cpuWait(os.Getpid())
	if !s.ok || !ok || !ok2 {
		return false, fmt.Sprintf("check took %v, CPU waits unknown", took.Round(time.Millisecond))
	}
	// Threads that ended took their counts along: a sum may shrink.
	dr, ds := max(r-s.runner, 0), max(self-s.self, 0)
	run := runnable(s.pid)
	return dr*starvedShare >= took || run, fmt.Sprintf("check took %v, the runner waited %v for a CPU meanwhile (a thread runnable at the end: %v), the server %v",
		took.Round(time.Millisecond), dr.Round(time.Millisecond), run, ds.Round(time.Millisecond))
}

// runnable reports whether a thread of process pid is runnable (state R:
// running or waiting for a CPU).
func runnable(pid int) bool {
	paths, _ := filepath.Glob("/proc/" + strconv.Itoa(pid) + "/task/*/stat")
	for _, path := range paths {
		b, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		// The state follows the command name, which ends at the last ')'.
		if i := bytes.LastIndexByte(b, ')'); i >= 0 && i+2 < len(b) && b[i+2] == 'R' {
			return true
		}
	}
	return false
}
