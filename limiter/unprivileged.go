package limiter

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/sloserve/sloserve/runtime"
)

// unprivLimiter enforces shares with what an unprivileged process may do
// to its own children, where no cgroup tree is writable (non-root, a
// container with a read-only cgroup mount): a best-effort runner's threads
// run in the idle scheduling class (SCHED_IDLE, the per-thread counterpart
// of the cgroup backend's cpu.idle parent), a cap keeps a runner's threads
// on ceil(share x CPUs) CPUs (sched_setaffinity), and a memory share is the
// runner's soft RLIMIT_DATA. Latency-critical runners and the server stay
// at normal priority.
//
// Each instance gets a process unit (see runtime/sched_linux.go), a
// directory under <tmp>/sloserve-<uid>/sloserve-<server pid>: the runner
// applies the unit's limits to itself before it loads the model, and
// Resize rewrites them and applies them to the unit's live processes. A
// thread may enter the idle class but, without privilege, not leave it:
// a resize out of ModeBackground is ErrRestartRequired.
type unprivLimiter struct {
	allowed []int  // the CPUs the server may use
	dir     string // this server's parent of units
	reason  string // why there are no cgroups
	log     *slog.Logger
	// apply applies limits to a live process (runtime.ApplyProcessLimits;
	// tests fake it).
	apply func(pid int, l runtime.ProcessLimits) error
	// member reports whether pid is a live process of the unit in dir
	// (unitMember; tests fake it).
	member func(pid int, dir string) bool

	mu     sync.Mutex
	units  unitTable[*procUnit]
	closed bool
}

var (
	_ Limiter       = (*unprivLimiter)(nil)
	_ ComputeLifter = (*unprivLimiter)(nil)
)

// procUnit is one instance's process unit.
type procUnit struct {
	dir    string
	share  Share
	limits runtime.ProcessLimits
	// cpu is the last CPU time read of each process, by pid; gone holds
	// the CPU time of the unit's processes that have ended.
	cpu  map[int]float64
	gone float64
}

// unitsBase is where the process units of the user's servers live.
func unitsBase() string {
	return filepath.Join(os.TempDir(), "sloserve-"+strconv.Itoa(os.Getuid()))
}

// DataReserve is what a runner's RLIMIT_DATA holds beside its memory
// share: the share is a working set (what a cgroup charges: resident
// memory), while RLIMIT_DATA counts private writable mappings whether
// touched or not. Measured on the demo detector with 1 intra-op thread:
// about 120 MiB of data mapped beyond the resident set at rest (each
// thread's 8 MiB stack, Go's heap arenas and glibc's per-thread malloc
// arenas), see docs/control-loop.md.
const DataReserve = 256 << 20

// newUnprivileged makes the units' parent under base (unitsBase() for
// New) on the CPUs in allowed, and removes the parents of servers that
// are gone.
func newUnprivileged(base string, allowed []int, reason string, log *slog.Logger) (*unprivLimiter, error) {
	if len(allowed) == 0 {
		return nil, errors.New("no CPU in the affinity mask")
	}
	if err := os.MkdirAll(base, 0o700); err != nil {
		return nil, fmt.Errorf("process units: %w", err)
	}
	// The base is the user's: a directory someone else made there could
	// hand our runners limits of theirs.
	var st unix.Stat_t
	if err := unix.Lstat(base, &st); err != nil {
		return nil, fmt.Errorf("process units: %w", err)
	}
	if int(st.Uid) != os.Getuid() || st.Mode&unix.S_IFMT != unix.S_IFDIR || st.Mode&0o022 != 0 {
		return nil, fmt.Errorf("process units: %s is not a directory of uid %d writable only by it", base, os.Getuid())
	}
	if n := cleanupStaleUnits(base, processAlive, log); n > 0 {
		log.Info("removed process units of servers that died without cleaning up", "removed", n)
	}
	dir := filepath.Join(base, parentName(os.Getpid()))
	err := os.Mkdir(dir, 0o700)
	if errors.Is(err, os.ErrNotExist) {
		// Another server's Close took the empty base away meanwhile.
		if err = os.Mkdir(base, 0o700); err == nil || errors.Is(err, os.ErrExist) {
			err = os.Mkdir(dir, 0o700)
		}
	}
	if err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("process units: %w", err)
	}
	return &unprivLimiter{allowed: slices.Clone(allowed), dir: dir, reason: reason, log: log,
		apply: runtime.ApplyProcessLimits, member: unitMember, units: unitTable[*procUnit]{}}, nil
}

// unitMember reports whether pid is a live runner started in the unit
// in dir: its command line names the unit. A pid in a procs file may have
// ended and been reused by another process of the user since, which
// must not be resized or counted.
func unitMember(pid int, dir string) bool {
	if !processAlive(pid) {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return err == nil && bytes.Contains(b, []byte("\x00--process-unit\x00"+dir+"\x00"))
}

// cleanupStaleUnits removes the units' parents of servers that are gone.
// Their runners died with them (a runner's parent-death signal), so no
// process is killed: a pid in a stale procs file may be someone else's
// by now.
func cleanupStaleUnits(base string, alive func(int) bool, log *slog.Logger) int {
	entries, err := os.ReadDir(base)
	if err != nil {
		return 0
	}
	n := 0
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), "sloserve-")
		pid, err := strconv.Atoi(rest)
		if !ok || err != nil || !e.IsDir() || pid == os.Getpid() || alive(pid) {
			continue
		}
		if err := os.RemoveAll(filepath.Join(base, e.Name())); err != nil {
			log.Warn("removing stale process units", "dir", e.Name(), "err", err)
			continue
		}
		n++
	}
	return n
}

// serverCPUs is the server's CPU affinity.
func serverCPUs() ([]int, error) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return nil, err
	}
	var cpus []int
	for c := range 64 * len(set) {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return cpus, nil
}

func (l *unprivLimiter) Kind() string { return KindUnprivileged }

func (l *unprivLimiter) Describe() string {
	return fmt.Sprintf("unprivileged (no writable cgroup: %s): best-effort runners' threads in SCHED_IDLE (yielding to every process of the host), caps as CPU affinity in whole CPUs of %d (%s), memory as RLIMIT_DATA (share + %d MiB), units at %s",
		l.reason, len(l.allowed), cpuList(l.allowed), DataReserve>>20, l.dir)
}

func (l *unprivLimiter) CPUs() int { return len(l.allowed) }

// Capabilities: shares are enforced (affinity caps, RLIMIT_DATA), a
// background unit runs in SCHED_IDLE, and a unit's use is the CPU time of
// its process read from /proc.
func (l *unprivLimiter) Capabilities() Capabilities {
	return Capabilities{Enforces: true, Background: true, Metering: MeterCPUTime}
}

// limitsFor is the limits of a share for the unit u (which may be new):
// a limited share's CPUs are the ones the other limited units claim
// least of, the last ones first (the server and the kernel's work tend to
// the first).
func (l *unprivLimiter) limitsFor(u *procUnit, s Share) runtime.ProcessLimits {
	pl := runtime.ProcessLimits{Idle: s.Mode == ModeBackground, CPUs: slices.Clone(l.allowed)}
	if s.Memory > 0 {
		pl.DataLimit = s.Memory + DataReserve
	}
	if !s.limited() {
		return pl
	}
	n := ThreadsFor(s, len(l.allowed))
	claim := map[int]float64{}
	for _, o := range l.units {
		if o == u || !o.share.limited() || len(o.limits.CPUs) == 0 {
			continue
		}
		each := o.share.Compute * float64(len(l.allowed)) / float64(len(o.limits.CPUs))
		for _, c := range o.limits.CPUs {
			claim[c] += each
		}
	}
	order := slices.Clone(l.allowed)
	slices.SortStableFunc(order, func(a, b int) int {
		if d := claim[a] - claim[b]; math.Abs(d) > 1e-9 {
			if d < 0 {
				return -1
			}
			return 1
		}
		return b - a
	})
	pl.CPUs = order[:n]
	slices.Sort(pl.CPUs)
	return pl
}

func (l *unprivLimiter) Place(id string, s Share) (Placement, error) {
	if err := validShare(s); err != nil {
		return Placement{}, err
	}
	name, err := unitName(id)
	if err != nil {
		return Placement{}, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return Placement{}, errors.New("limiter: closed")
	}
	if err := l.units.free(id); err != nil {
		return Placement{}, err
	}
	u := &procUnit{dir: filepath.Join(l.dir, name), share: s, cpu: map[int]float64{}}
	u.limits = l.limitsFor(u, s)
	if err := os.Mkdir(u.dir, 0o700); err != nil {
		return Placement{}, fmt.Errorf("limiter: create process unit for %s: %w", id, err)
	}
	err = os.WriteFile(filepath.Join(u.dir, runtime.UnitProcsFile), nil, 0o600)
	if err == nil {
		err = runtime.WriteProcessLimits(u.dir, u.limits)
	}
	if err != nil {
		os.RemoveAll(u.dir)
		return Placement{}, fmt.Errorf("limiter: place %s: %w", id, err)
	}
	l.units[id] = u
	l.log.Debug("instance placed", "id", id, "share", s, "limits", u.limits.String(), "unit", u.dir)
	return Placement{IntraOpThreads: ThreadsFor(s, len(l.allowed)), ProcessUnit: u.dir}, nil
}

// Resize writes the unit's new limits, then applies them to its live
// processes. Leaving ModeBackground needs a new process (the kernel keeps
// an unprivileged thread in the idle class): ErrRestartRequired, and the
// unit keeps its share.
func (l *unprivLimiter) Resize(id string, s Share) error {
	if err := validShare(s); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	u, err := l.units.get(id)
	if err != nil {
		return err
	}
	old := u.limits
	next := l.limitsFor(u, s)
	if err := runtime.WriteProcessLimits(u.dir, next); err != nil {
		return fmt.Errorf("limiter: resize %s: %w", id, err)
	}
	pids, err := readUnitPids(u.dir)
	if err != nil {
		return fmt.Errorf("limiter: resize %s: %w", id, err)
	}
	var errs []error
	for _, pid := range pids {
		if !l.member(pid, u.dir) {
			continue
		}
		err := l.apply(pid, next)
		switch {
		case errors.Is(err, runtime.ErrLeaveIdle):
			// Nothing was changed: the class is the first thing set, and
			// every thread is in the same one. Back to the old limits.
			if werr := runtime.WriteProcessLimits(u.dir, old); werr != nil {
				return fmt.Errorf("limiter: resize %s: %w", id, werr)
			}
			return fmt.Errorf("%w: %s: %w", ErrRestartRequired, id, err)
		case err != nil && l.member(pid, u.dir):
			errs = append(errs, fmt.Errorf("process %d: %w", pid, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("limiter: resize %s: %w", id, err)
	}
	l.log.Debug("instance resized", "id", id, "from", u.share, "to", s, "limits", next.String())
	u.share, u.limits = s, next
	return nil
}

// LiftCompute widens a capped unit's affinity to every allowed CPU, its
// memory limit and class unchanged (an unprivileged thread cannot leave
// SCHED_IDLE): for a runner about to stop.
func (l *unprivLimiter) LiftCompute(id string) error {
	l.mu.Lock()
	u, err := l.units.get(id)
	var s Share
	if err == nil {
		s = Share{Memory: u.share.Memory, Mode: u.share.Mode}
	}
	limited := err == nil && u.share.limited()
	l.mu.Unlock()
	if err != nil || !limited {
		return err
	}
	return l.Resize(id, s)
}

// readUnitPids reads a unit's procs file.
func readUnitPids(dir string) ([]int, error) {
	return readPids(filepath.Join(dir, runtime.UnitProcsFile))
}

// Stats reads the unit's processes from /proc: CPU time (user and system,
// every thread's, of the processes that have ended too), resident memory
// and its peak (VmRSS, VmHWM), and the allocations that failed under the
// data limit as OOM kills (the runner ends itself on one).
func (l *unprivLimiter) Stats(id string) (Stats, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	u, err := l.units.get(id)
	if err != nil {
		return Stats{}, err
	}
	pids, err := readUnitPids(u.dir)
	if err != nil {
		return Stats{}, fmt.Errorf("limiter: stats of %s: %w", id, err)
	}
	st := Stats{MemoryLimit: u.share.Memory}
	for _, pid := range pids {
		last := u.cpu[pid]
		if last < 0 {
			continue // ended, counted in gone
		}
		if !l.member(pid, u.dir) {
			u.gone += last // its time up to the last reading
			u.cpu[pid] = -1
			continue
		}
		if cpu, err := processCPU(pid); err == nil {
			last = max(last, cpu)
		}
		u.cpu[pid] = last
		st.CPUSeconds += last
		if m, err := readStatus(pid); err == nil {
			st.MemoryBytes += m["VmRSS"]
			st.MemoryPeak += m["VmHWM"]
		}
	}
	st.CPUSeconds += u.gone
	st.OOMKills = unitOOMs(u.dir)
	return st, nil
}

// unitOOMs counts a unit's out-of-memory ends: allocations ONNX Runtime
// reported failed (the oom file), and Go's fatal errors that say out of
// memory (the crash file: "fatal error: runtime: out of memory" where a
// mapping failed, "fatal error: out of memory" where the heap could not
// grow, and the like).
func unitOOMs(dir string) uint64 {
	var n uint64
	if b, err := os.ReadFile(filepath.Join(dir, runtime.UnitOOMFile)); err == nil {
		n += uint64(bytes.Count(b, []byte("\n")))
	}
	if b, err := os.ReadFile(filepath.Join(dir, runtime.UnitCrashFile)); err == nil {
		for line := range strings.Lines(string(b)) {
			if strings.HasPrefix(line, "fatal error:") && strings.Contains(line, "out of memory") {
				n++
			}
		}
	}
	return n
}

// readStatus reads the kB fields of /proc/<pid>/status as bytes.
func readStatus(pid int) (map[string]int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return nil, err
	}
	m := map[string]int64{}
	for line := range strings.Lines(string(b)) {
		k, v, ok := strings.Cut(line, ":")
		f := strings.Fields(v)
		if !ok || len(f) != 2 || f[1] != "kB" {
			continue
		}
		if n, err := strconv.ParseInt(f[0], 10, 64); err == nil {
			m[k] = n << 10
		}
	}
	return m, nil
}

func (l *unprivLimiter) Release(id string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	u, err := l.units.get(id)
	if err != nil {
		return err
	}
	if err := os.RemoveAll(u.dir); err != nil {
		return fmt.Errorf("limiter: release %s: %w", id, err)
	}
	delete(l.units, id)
	l.log.Debug("instance released", "id", id)
	return nil
}

func (l *unprivLimiter) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	clear(l.units)
	if err := os.RemoveAll(l.dir); err != nil {
		return fmt.Errorf("limiter: close: %w", err)
	}
	// The base goes too once no server of the user has units there.
	_ = os.Remove(filepath.Dir(l.dir))
	return nil
}

// cpuList renders CPUs as the kernel's list format: "0-3,6".
func cpuList(cpus []int) string {
	var b strings.Builder
	for i := 0; i < len(cpus); {
		j := i
		for j+1 < len(cpus) && cpus[j+1] == cpus[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(cpus[i]))
		if j > i {
			b.WriteString("-" + strconv.Itoa(cpus[j]))
		}
		i = j + 1
	}
	return b.String()
}
