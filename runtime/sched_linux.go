package runtime

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	goruntime "runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// This file holds what a runner process does to itself where no cgroup
// is writable (limiter "unprivileged"): its threads' scheduling class and
// CPU affinity and its data rlimit, all of which an unprivileged process
// may set on itself and on its own children. A process unit is a
// directory the limiter owns, the counterpart of a cgroup:
//
//	limits  the unit's current ProcessLimits (the limiter rewrites it)
//	procs   the pids of the unit's processes, one a line (each appends its own)
//	oom     one line per allocation that failed under the data limit
//	crash   Go's fatal-error output (runtime: out of memory among them)
//
// A runner appends its pid to procs before it reads limits, and reads
// limits again after applying them until they stay the same; the limiter
// writes limits before it reads procs. So a resize racing a runner's
// start reaches it either way.

// Files of a process unit.
const (
	UnitLimitsFile = "limits"
	UnitProcsFile  = "procs"
	UnitOOMFile    = "oom"
	UnitCrashFile  = "crash"
)

// ProcessLimits are a process unit's limits.
type ProcessLimits struct {
	// Idle puts every thread in the idle scheduling class (SCHED_IDLE);
	// otherwise SCHED_OTHER. An unprivileged thread may enter the idle
	// class, and leave it only as far as its RLIMIT_NICE allows (usually
	// not at all).
	Idle bool
	// CPUs is the affinity of every thread; empty leaves it as inherited.
	CPUs []int
	// DataLimit is the soft RLIMIT_DATA in bytes (private writable memory:
	// heap, anonymous mappings, thread stacks); 0 is none.
	DataLimit int64
}

// String is the limits file's one line: "idle=0 cpus=0,1 data=0".
func (l ProcessLimits) String() string {
	cpus := make([]string, len(l.CPUs))
	for i, c := range l.CPUs {
		cpus[i] = strconv.Itoa(c)
	}
	idle := "0"
	if l.Idle {
		idle = "1"
	}
	return fmt.Sprintf("idle=%s cpus=%s data=%d", idle, strings.Join(cpus, ","), l.DataLimit)
}

// ParseProcessLimits reads what String wrote.
func ParseProcessLimits(s string) (ProcessLimits, error) {
	var l ProcessLimits
	for f := range strings.FieldsSeq(s) {
		k, v, _ := strings.Cut(f, "=")
		switch k {
		case "idle":
			l.Idle = v == "1"
		case "cpus":
			for c := range strings.SplitSeq(v, ",") {
				if c == "" {
					continue
				}
				n, err := strconv.Atoi(c)
				if err != nil || n < 0 {
					return l, fmt.Errorf("process limits: bad cpu %q", c)
				}
				l.CPUs = append(l.CPUs, n)
			}
		case "data":
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 0 {
				return l, fmt.Errorf("process limits: bad data limit %q", v)
			}
			l.DataLimit = n
		default:
			return l, fmt.Errorf("process limits: unknown field %q", f)
		}
	}
	return l, nil
}

// WriteProcessLimits replaces a unit's limits file in one step.
func WriteProcessLimits(dir string, l ProcessLimits) error {
	tmp, err := os.CreateTemp(dir, ".limits-*")
	if err != nil {
		return err
	}
	_, err = tmp.WriteString(l.String() + "\n")
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(dir, UnitLimitsFile))
	}
	if err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("write process limits: %w", err)
	}
	return nil
}

// ReadProcessLimits reads a unit's limits file.
func ReadProcessLimits(dir string) (ProcessLimits, error) {
	b, err := os.ReadFile(filepath.Join(dir, UnitLimitsFile))
	if err != nil {
		return ProcessLimits{}, err
	}
	return ParseProcessLimits(string(b))
}

// ErrLeaveIdle is a thread the kernel will not take out of the idle
// scheduling class: an unprivileged one whose RLIMIT_NICE does not allow
// nice 0. Only a new process runs at normal priority then.
var ErrLeaveIdle = errors.New("the kernel does not let this process leave the idle scheduling class (RLIMIT_NICE)")

// ApplyProcessLimits applies l to every thread of process pid (and its
// data rlimit to the process). Threads made meanwhile inherit the class
// and affinity of the thread that makes them; the threads are listed
// again until a pass finds no new one.
func ApplyProcessLimits(pid int, l ProcessLimits) error {
	if err := setDataLimit(pid, l.DataLimit); err != nil {
		return err
	}
	done := map[int]bool{}
	for {
		tids, err := threadsOf(pid)
		if err != nil {
			return err
		}
		fresh := 0
		for _, tid := range tids {
			if done[tid] {
				continue
			}
			fresh++
			done[tid] = true
			err := setThread(tid, l)
			if errors.Is(err, syscall.ESRCH) {
				continue // the thread ended meanwhile
			}
			if err != nil {
				return fmt.Errorf("process %d thread %d: %w", pid, tid, err)
			}
		}
		if fresh == 0 {
			return nil
		}
	}
}

// threadsOf lists a process's threads from /proc.
func threadsOf(pid int) ([]int, error) {
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return nil, err
	}
	tids := make([]int, 0, len(entries))
	for _, e := range entries {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, tid)
		}
	}
	return tids, nil
}

// setThread sets one thread's class and affinity.
func setThread(tid int, l ProcessLimits) error {
	attr, err := unix.SchedGetAttr(tid, 0)
	if err != nil {
		return fmt.Errorf("sched_getattr: %w", err)
	}
	want := uint32(unix.SCHED_NORMAL)
	if l.Idle {
		want = unix.SCHED_IDLE
	}
	if attr.Policy != want {
		a := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: want}
		if err := unix.SchedSetAttr(tid, &a, 0); err != nil {
			if errors.Is(err, syscall.EPERM) && !l.Idle && attr.Policy == unix.SCHED_IDLE {
				return fmt.Errorf("%w: %w", ErrLeaveIdle, err)
			}
			return fmt.Errorf("sched_setattr: %w", err)
		}
	}
	if len(l.CPUs) > 0 {
		var set unix.CPUSet
		for _, c := range l.CPUs {
			set.Set(c)
		}
		if err := unix.SchedSetaffinity(tid, &set); err != nil {
			return fmt.Errorf("sched_setaffinity %v: %w", l.CPUs, err)
		}
	}
	return nil
}

// setDataLimit sets the soft RLIMIT_DATA of pid to limit (0: the hard
// limit), keeping the hard limit, so that the limiter can raise it again
// later without privilege.
func setDataLimit(pid int, limit int64) error {
	var old unix.Rlimit
	if err := unix.Prlimit(pid, unix.RLIMIT_DATA, nil, &old); err != nil {
		return fmt.Errorf("prlimit: %w", err)
	}
	cur := old.Max
	if limit > 0 {
		if uint64(limit) > old.Max {
			return fmt.Errorf("data limit %d bytes is above the hard limit %d", limit, old.Max)
		}
		cur = uint64(limit)
	}
	if cur == old.Cur {
		return nil
	}
	if err := unix.Prlimit(pid, unix.RLIMIT_DATA, &unix.Rlimit{Cur: cur, Max: old.Max}, nil); err != nil {
		return fmt.Errorf("prlimit RLIMIT_DATA %d: %w", cur, err)
	}
	return nil
}

// processUnit is the runner's side of a process unit.
type processUnit struct {
	dir string
	// limited: a data limit was set at start, so an allocation failure
	// is the limit's doing.
	limited bool
}

// joinProcessUnit enters the unit in dir: the runner's pid goes into its
// procs, its limits are applied to the runner until they stay the same,
// and Go's fatal errors are kept in its crash file.
func joinProcessUnit(dir string) (*processUnit, error) {
	if dir == "" {
		return nil, nil
	}
	f, err := os.OpenFile(filepath.Join(dir, UnitProcsFile), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return nil, fmt.Errorf("join process unit: %w", err)
	}
	_, err = fmt.Fprintf(f, "%d\n", os.Getpid())
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("join process unit: %w", err)
	}
	var applied ProcessLimits
	for first := true; ; first = false {
		l, err := ReadProcessLimits(dir)
		if err != nil {
			return nil, fmt.Errorf("join process unit: %w", err)
		}
		if !first && slices.Equal(l.CPUs, applied.CPUs) && l.Idle == applied.Idle && l.DataLimit == applied.DataLimit {
			break
		}
		if err := ApplyProcessLimits(os.Getpid(), l); err != nil {
			return nil, fmt.Errorf("join process unit: %w", err)
		}
		applied = l
	}
	crash, err := os.OpenFile(filepath.Join(dir, UnitCrashFile), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("join process unit: %w", err)
	}
	err = debug.SetCrashOutput(crash, debug.CrashOptions{})
	crash.Close()
	if err != nil {
		return nil, fmt.Errorf("join process unit: %w", err)
	}
	if applied.DataLimit > 0 {
		spareThreads(spareThreadCount)
	}
	return &processUnit{dir: dir, limited: applied.DataLimit > 0}, nil
}

// spareThreadCount is how many idle threads a runner under a data limit
// keeps for Go's scheduler.
const spareThreadCount = 4

// spareThreads makes n more OS threads for Go's scheduler while memory is
// plentiful. Go keeps an idle thread for reuse, so when an allocation
// under the data limit fails, the scheduler finds one instead of creating
// one: a thread whose stack cannot be mapped aborts the process
// (runtime/cgo: pthread_create failed) before the failure can be counted
// as out of memory. Each goroutine holds its thread until all of them run
// at once, so each runs on a thread of its own.
func spareThreads(n int) {
	var started, release sync.WaitGroup
	started.Add(n)
	release.Add(1)
	var done sync.WaitGroup
	for range n {
		done.Go(func() {
			goruntime.LockOSThread()
			started.Done()
			release.Wait()
			goruntime.UnlockOSThread()
		})
	}
	started.Wait()
	release.Done()
	done.Wait()
}

// allocationFailure reports whether an ONNX Runtime error is a failed
// allocation (std::bad_alloc, or its arena's own message).
func allocationFailure(err error) bool {
	if err == nil {
		return false
	}
	msg := strings.ToLower(err.Error())
	for _, s := range []string{"bad_alloc", "bad allocation", "failed to allocate memory", "out of memory"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// outOfMemory ends the runner as the kernel's OOM killer would end it in
// a cgroup, when err is an allocation that failed under the unit's data
// limit: the failure is counted in the unit's oom file (the limiter's
// Stats.OOMKills) and the process kills itself, so that the server sees
// an out-of-memory death and answers the call in flight ErrOutOfMemory.
// Other errors, and runners without a data limit, go on.
func (u *processUnit) outOfMemory(err error) {
	if u == nil || !u.limited || !allocationFailure(err) {
		return
	}
	// Room to record it: the failed allocation's neighbours may still
	// hold what the limit allowed.
	_ = setDataLimit(os.Getpid(), 0)
	if f, ferr := os.OpenFile(filepath.Join(u.dir, UnitOOMFile), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600); ferr == nil {
		fmt.Fprintf(f, "%d %s\n", os.Getpid(), strings.ReplaceAll(err.Error(), "\n", " "))
		f.Close()
	}
	fmt.Fprintf(os.Stderr, "sloserve runner: out of memory under the unit's data limit: %v\n", err)
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // the signal is on its way
}
