package limiter

import (
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
	"syscall"
	"time"
)

// hierarchy is one mounted cgroup hierarchy the limiter makes units in.
// On cgroup v2 there is one, with every controller; on v1 one per
// controller, or one for co-mounted controllers such as cpu,cpuacct.
type hierarchy struct {
	controllers []string // of "cpu", "cpuacct", "memory" that this hierarchy carries
	own         string   // the server's cgroup directory in it
	parent      string   // own/sloserve-<pid>, where the units live
	// background is own/sloserve-<pid>-background, in the idle class (the
	// lowest weight without it), where background units live in a
	// hierarchy with the cpu controller; "" in the others.
	background string
	// server is own/sloserve-<pid>-server, where the server's process
	// (its own threads: ingress, scheduling, replies) lives beside the
	// units' parent at the same weight, in a hierarchy with the cpu
	// controller; "" in the others. serverFrom is the cgroup the server
	// was in, where Close moves it back.
	server, serverFrom string
}

func (h *hierarchy) has(c string) bool { return slices.Contains(h.controllers, c) }

// cgroupLimiter gives every instance a cgroup under the server's own
// cgroup, in a parent named sloserve-<server pid> (CleanupStale finds the
// parents of dead servers by that name).
type cgroupLimiter struct {
	v2       bool
	hier     []*hierarchy
	cpus     int
	periodUS int64
	// idleClass: the kernel has cpu.idle, so background units run in the
	// idle class; without it they get the lowest weight.
	idleClass bool
	env       hostEnvironment
	log       *slog.Logger
	describe  string
	// hostRoot is the server's cgroup where it is the root of the host's
	// cpu hierarchy (atHostRoot), else "".
	hostRoot string

	mu     sync.Mutex
	units  unitTable[*cgroupUnit]
	closed bool
}

var (
	_ Limiter          = (*cgroupLimiter)(nil)
	_ ComputeLifter    = (*cgroupLimiter)(nil)
	_ BackgroundLifter = (*cgroupLimiter)(nil)
)

// cgroupUnit is one instance's cgroup: the directory name in every
// hierarchy's parent, and its current share.
type cgroupUnit struct {
	name string
	// io is held while the unit's files are written outside the
	// limiter's lock (LiftCompute, Release), and by Resize: runners
	// stopping together lift their caps at once, not one after another.
	io    sync.Mutex
	share Share
	// bg: the unit's processes live in the background parent (its cpu
	// home); the unit has a directory in both parents of a hierarchy
	// with the cpu controller, so that a runner restarted with its first
	// placement still finds the directory it joins, and the limiter moves
	// it home (rehome).
	bg bool
}

// parentName is the directory under the server's cgroup that holds its
// units.
func parentName(pid int) string { return "sloserve-" + strconv.Itoa(pid) }

// serverName is the directory beside parentName that holds the server's
// own process.
func serverName(pid int) string { return parentName(pid) + "-server" }

// newCgroup sets up cgroup v2 if it is usable, else v1. Its error says
// why neither is. The server's process is moved from its own cgroup into
// serverName, or from serverFrom where that is not its own cgroup
// (newDelegated: the leaf it moved the server to).
func newCgroup(opts Options, env hostEnvironment, serverFrom string, log *slog.Logger) (*cgroupLimiter, error) {
	sc, err := env.ownCgroups()
	if err != nil {
		return nil, fmt.Errorf("read own cgroups: %w", err)
	}
	l := &cgroupLimiter{
		cpus:     env.cpus(opts.Root, log),
		periodUS: opts.Period.Microseconds(),
		env:      env,
		log:      log,
		units:    unitTable[*cgroupUnit]{},
	}
	errV2 := l.setupV2(opts.Root, sc)
	if errV2 == nil {
		l.v2 = true
		if err := l.setupWeights(serverFrom); err != nil {
			l.undoSetup()
			return nil, fmt.Errorf("cgroup v2: %w", err)
		}
		l.describe = fmt.Sprintf("cgroup v2 cpu.max (period %s of %d CPUs), cpu.weight, %s and memory.max at %s; %s",
			opts.Period, l.cpus, l.idleWord(), l.hier[0].parent, l.serverWords())
		l.warnHostRoot()
		return l, nil
	}
	errV1 := l.setupV1(opts.Root, sc)
	if errV1 == nil {
		if err := l.setupWeights(serverFrom); err != nil {
			l.undoSetup()
			return nil, fmt.Errorf("cgroup v1: %w", err)
		}
		var dirs []string
		for _, h := range l.hier {
			dirs = append(dirs, h.parent)
		}
		l.describe = fmt.Sprintf("cgroup v1 %s: CFS quota (period %s of %d CPUs), cpu.shares, %s and memory limit at %s; %s (v2 not used: %v)",
			strings.Join(l.controllers(), "+"), opts.Period, l.cpus, l.idleWord(), strings.Join(dirs, ", "), l.serverWords(), errV2)
		l.warnHostRoot()
		return l, nil
	}
	return nil, fmt.Errorf("cgroup v2: %w; cgroup v1: %w", errV2, errV1)
}

// atHostRoot reports whether dir is the root of its cgroup hierarchy on
// the host, not the root a container's cgroup namespace shows or a
// service's cgroup: only the host's root has release_agent on cgroup v1,
// and only it lacks cgroup.type on v2.
func atHostRoot(dir string, v2 bool) bool {
	if v2 {
		_, err := os.Stat(filepath.Join(dir, "cgroup.type"))
		return errors.Is(err, os.ErrNotExist)
	}
	_, err := os.Stat(filepath.Join(dir, "release_agent"))
	return err == nil
}

// warnHostRoot says, in Describe and once in the log, that the server's
// cgroup is the host's root: the background parent's siblings are then
// every process of the host, and best-effort units, in the idle class,
// run only on what all of them leave. In a container or a service they
// yield only to the processes of its own cgroup (docs/deploy.md).
func (l *cgroupLimiter) warnHostRoot() {
	if l.hostRoot == "" {
		return
	}
	l.describe += "; in the host's root cgroup: background units yield to every process of the host"
	l.log.Warn("the server runs in the host's root cgroup: best-effort models run in the idle class beside it and yield to every busy process of the host, not only to this server's work; run the server in a cgroup of its own (a container, a systemd service) for them to share what it is given",
		"cgroup", l.hostRoot)
}

// Scheduling weights, in units of the kernel's default weight (v1
// cpu.shares 1024, v2 cpu.weight 100).
const (
	// floorWeightPerCPU is the weight of a floor per CPU of its share: a
	// floor of half of 2 CPUs weighs as 8 busy default threads, so that it
	// gets its share against anything that is not itself a floor.
	floorWeightPerCPU = 8
	// parentWeightPerCPU is the weight of the units' parent per CPU, and
	// of the server's own cgroup beside it.
	parentWeightPerCPU = 4
)

// backgroundName is the parent of the background units beside
// parentName.
func backgroundName(pid int) string { return parentName(pid) + "-background" }

// idleWord says how background units are kept out of the way.
func (l *cgroupLimiter) idleWord() string {
	if l.idleClass {
		return "background units in an idle-class parent (cpu.idle)"
	}
	return "background units in a parent of the lowest weight (no cpu.idle in this kernel)"
}

// setupWeights orders the server's compute in three tiers. The units'
// parent weighs as parentWeightPerCPU busy threads per CPU, so that
// latency-critical runners come before the host's other processes; the
// server's own process moves into a cgroup beside it of the same weight
// (setupServer), so that its answer path (ingress, scheduling, reply
// encoding and writes) competes with the runners as a peer and is not
// left behind them; the background parent is in the idle class (the
// lowest weight without it), so best-effort runners get only what
// everything else, the server's own threads included, leaves, and yield
// at once.
func (l *cgroupLimiter) setupWeights(serverFrom string) error {
	for _, h := range l.hier {
		if !h.has("cpu") {
			continue
		}
		_, err := os.Stat(filepath.Join(h.parent, "cpu.idle"))
		l.idleClass = err == nil
		if err := writeFile(filepath.Join(h.parent, l.weightFile()), l.parentWeight()); err != nil {
			return fmt.Errorf("weighting the units' parent: %w", err)
		}
		if err := l.setupServer(h, serverFrom); err != nil {
			return err
		}
		if atHostRoot(h.own, l.v2) {
			l.hostRoot = h.own
		}
		bg := filepath.Join(h.own, backgroundName(l.env.pid))
		if err := l.env.mkdirUnit(bg); err != nil {
			return fmt.Errorf("%s is not writable: %w", h.own, errnoOf(err))
		}
		h.background = bg
		if l.v2 {
			if err := enableControllers(bg); err != nil {
				return err
			}
		}
		if l.idleClass {
			err = writeFile(filepath.Join(bg, "cpu.idle"), "1")
		} else {
			err = writeFile(filepath.Join(bg, l.weightFile()), l.weightValue(0))
		}
		if err != nil {
			return fmt.Errorf("making the background parent idle: %w", err)
		}
	}
	return nil
}

// serverCgroups counts the limiters of this process that use each
// server cgroup: a second limiter shares the first one's, and the last to
// close moves the server back and removes it.
var serverCgroups = struct {
	sync.Mutex
	users map[string]int
}{users: map[string]int{}}

// setupServer moves the server's process into its own cgroup beside the
// units' parent of h, weighted as that parent. Only the cpu hierarchy:
// the server's memory stays accounted where it was (on cgroup v2, where
// one hierarchy carries both, its memory.max is "max" and the server's
// former cgroup, now its parent, still bounds it). Runners the server
// starts begin here and join their units before they load a model.
func (l *cgroupLimiter) setupServer(h *hierarchy, from string) error {
	if from == "" {
		from = h.own
	}
	dir := filepath.Join(h.own, serverName(l.env.pid))
	serverCgroups.Lock()
	defer serverCgroups.Unlock()
	if err := l.env.mkdirUnit(dir); err != nil {
		return fmt.Errorf("%s is not writable: %w", h.own, errnoOf(err))
	}
	h.server, h.serverFrom = dir, from
	serverCgroups.users[dir]++
	if err := writeFile(filepath.Join(dir, l.weightFile()), l.parentWeight()); err != nil {
		return fmt.Errorf("weighting the server's cgroup: %w", err)
	}
	if err := l.env.join(filepath.Join(dir, "cgroup.procs"), l.env.pid); err != nil {
		return fmt.Errorf("moving the server into %s: %w", dir, err)
	}
	return nil
}

// closeServer moves the server's process back to where it came from and
// removes its cgroup in h, unless another limiter of this process still
// uses it. Anything else still in it (a runner that never joined its
// unit) goes there too, or is killed.
func (l *cgroupLimiter) closeServer(h *hierarchy) error {
	if h.server == "" {
		return nil
	}
	serverCgroups.Lock()
	defer serverCgroups.Unlock()
	if serverCgroups.users[h.server]--; serverCgroups.users[h.server] > 0 {
		return nil
	}
	delete(serverCgroups.users, h.server)
	evict := func(pid int) error {
		err := l.env.join(filepath.Join(h.serverFrom, "cgroup.procs"), pid)
		if err == nil || pid == l.env.pid {
			return err
		}
		l.log.Warn("process left in the server's cgroup could not be moved out; killing it", "pid", pid, "cgroup", h.server, "err", err)
		return l.env.kill(pid)
	}
	if err := removeCgroup(h.server, evict, l.env.rmdir, time.Second); err != nil {
		return fmt.Errorf("the server's cgroup: %w", err)
	}
	return nil
}

// serverWords says where the server's own threads are.
func (l *cgroupLimiter) serverWords() string {
	var dirs []string
	for _, h := range l.hier {
		if h.server != "" {
			dirs = append(dirs, h.server)
		}
	}
	return fmt.Sprintf("the server's own threads at the units' parent's weight in %s", strings.Join(dirs, ", "))
}

// undoSetup moves the server back and removes the cgroups a failed setup
// made.
func (l *cgroupLimiter) undoSetup() {
	for _, h := range slices.Backward(l.hier) {
		if err := l.closeServer(h); err != nil {
			l.log.Warn("undoing the cgroup setup", "err", err)
		}
		if h.background != "" {
			_ = l.env.rmdir(h.background)
		}
		_ = l.env.rmdir(h.parent)
	}
	l.hier = nil
}

func (l *cgroupLimiter) weightFile() string {
	if l.v2 {
		return "cpu.weight"
	}
	return "cpu.shares"
}

// weightValue is a weight in default units as the weight file takes it,
// within the kernel's range.
func (l *cgroupLimiter) weightValue(w float64) string {
	if l.v2 {
		return strconv.FormatInt(min(max(int64(math.Round(w*100)), 1), 10000), 10)
	}
	return strconv.FormatInt(min(max(int64(math.Round(w*1024)), 2), 262144), 10)
}

// weight is a share's scheduling weight in default units among its
// siblings: a floor's in proportion to its compute (a whole-device floor
// for an unlimited one), the default otherwise.
func (l *cgroupLimiter) weight(s Share) float64 {
	switch s.Mode {
	case ModeFloor:
		c := s.Compute
		if !s.fraction() {
			c = 1
		}
		return max(c*float64(l.cpus)*floorWeightPerCPU, 1)
	}
	return 1 // background units weigh alike inside their idle parent
}

func (l *cgroupLimiter) controllers() []string {
	var cs []string
	for _, h := range l.hier {
		cs = append(cs, h.controllers...)
	}
	slices.Sort(cs)
	return cs
}

// setupV2 makes the parent in the server's unified cgroup and enables the
// cpu and memory controllers for it and for its children.
func (l *cgroupLimiter) setupV2(root string, sc selfCgroups) error {
	if !isUnified(root) {
		return fmt.Errorf("%s is not a unified hierarchy", root)
	}
	own := ownDir(root, sc.unified)
	avail, err := os.ReadFile(filepath.Join(own, "cgroup.controllers"))
	if err != nil {
		return err
	}
	have := strings.Fields(string(avail))
	for _, c := range []string{"cpu", "memory"} {
		if !slices.Contains(have, c) {
			return fmt.Errorf("controller %s is not available in %s (cgroup.controllers: %q)", c, own, strings.TrimSpace(string(avail)))
		}
	}
	// The server's own cgroup must pass the controllers down. Outside the
	// root that fails with EBUSY while the cgroup holds processes (no
	// internal processes), unless they are already enabled.
	if err := enableControllers(own); err != nil {
		return fmt.Errorf("cannot delegate cpu and memory below the server's cgroup: %w", err)
	}
	parent := filepath.Join(own, parentName(l.env.pid))
	if err := l.env.mkdirUnit(parent); err != nil {
		return fmt.Errorf("%s is not writable: %w", own, errnoOf(err))
	}
	if err := enableControllers(parent); err != nil {
		_ = l.env.rmdir(parent)
		return err
	}
	l.hier = []*hierarchy{{controllers: []string{"cpu", "memory"}, own: own, parent: parent}}
	return nil
}

// enableControllers turns on cpu and memory for dir's children.
func enableControllers(dir string) error {
	file := filepath.Join(dir, "cgroup.subtree_control")
	b, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	on := strings.Fields(string(b))
	if slices.Contains(on, "cpu") && slices.Contains(on, "memory") {
		return nil
	}
	return writeFile(file, "+cpu +memory")
}

// setupV1 makes the parent in the server's cgroup of the cpu and memory
// hierarchies, and of cpuacct when that is a separate, writable one.
func (l *cgroupLimiter) setupV1(root string, sc selfCgroups) error {
	byID := map[string]*hierarchy{}
	var made []string
	undo := func() {
		for _, d := range slices.Backward(made) {
			_ = l.env.rmdir(d)
		}
	}
	for _, c := range []string{"cpu", "memory", "cpuacct"} {
		optional := c == "cpuacct"
		p, ok := sc.v1[c]
		if !ok {
			if optional {
				continue
			}
			undo()
			return fmt.Errorf("the %s controller is not in a v1 hierarchy (/proc/self/cgroup has no %s line)", c, c)
		}
		if h := byID[sc.hierarchy[c]]; h != nil {
			h.controllers = append(h.controllers, c)
			continue
		}
		mount := filepath.Join(root, c)
		if _, err := os.Stat(filepath.Join(mount, "cgroup.procs")); err != nil {
			if optional {
				continue
			}
			undo()
			return fmt.Errorf("no %s hierarchy mounted at %s", c, mount)
		}
		own := ownDir(mount, p)
		parent := filepath.Join(own, parentName(l.env.pid))
		if err := l.env.mkdirUnit(parent); err != nil {
			if optional {
				l.log.Debug("cpuacct hierarchy not writable; CPU time comes from the processes instead", "dir", own, "err", err)
				continue
			}
			undo()
			return fmt.Errorf("%s is not writable: %w", own, errnoOf(err))
		}
		made = append(made, parent)
		h := &hierarchy{controllers: []string{c}, own: own, parent: parent}
		byID[sc.hierarchy[c]] = h
		l.hier = append(l.hier, h)
	}
	return nil
}

// mkdirUnit makes a cgroup directory; one that exists already is fine (a
// second limiter in the same server shares the parent).
func (e hostEnvironment) mkdirUnit(dir string) error {
	err := e.mkdir(dir)
	if errors.Is(err, os.ErrExist) {
		return nil
	}
	return err
}

func (l *cgroupLimiter) Kind() string {
	if l.v2 {
		return KindCgroupV2
	}
	return KindCgroupV1
}

func (l *cgroupLimiter) Describe() string { return l.describe }
func (l *cgroupLimiter) CPUs() int        { return l.cpus }

// Capabilities: floors and caps on CPU time, background units in an
// idle-class (or lowest-weight) parent, CPU time read per unit.
func (l *cgroupLimiter) Capabilities() Capabilities {
	return Capabilities{Enforces: true, Background: true, Metering: MeterCPUTime}
}

// dir is the unit's directory in h: in the cpu hierarchy its home for
// its mode.
func (l *cgroupLimiter) dir(h *hierarchy, u *cgroupUnit) string {
	return l.home(h, u, u.bg)
}

// home is the unit's directory in h under the background parent (bg) or
// the units' parent; h's only one where it has none.
func (l *cgroupLimiter) home(h *hierarchy, u *cgroupUnit, bg bool) string {
	if bg && h.background != "" {
		return filepath.Join(h.background, u.name)
	}
	return filepath.Join(h.parent, u.name)
}

// homes are the unit's directories in h: two where h has a background
// parent.
func (l *cgroupLimiter) homes(h *hierarchy, u *cgroupUnit) []string {
	if h.background == "" {
		return []string{l.home(h, u, false)}
	}
	return []string{l.home(h, u, false), l.home(h, u, true)}
}

// rehome moves the unit's processes that are in its other home (a runner
// restarted with its first placement, or all of them after a change of
// mode) to the home of its mode.
func (l *cgroupLimiter) rehome(u *cgroupUnit) error { return l.moveHome(u, u.bg) }

// moveHome moves the unit's processes to its home under the background
// parent (bg) or the units' parent. It reads nothing of u but its name.
func (l *cgroupLimiter) moveHome(u *cgroupUnit, bg bool) error {
	var errs []error
	for _, h := range l.hier {
		if h.background == "" {
			continue
		}
		from, to := l.home(h, u, !bg), l.home(h, u, bg)
		pids, err := readPids(filepath.Join(from, "cgroup.procs"))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, pid := range pids {
			if err := writeFile(filepath.Join(to, "cgroup.procs"), strconv.Itoa(pid)); err != nil && !errors.Is(err, syscall.ESRCH) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

func (l *cgroupLimiter) Place(id string, s Share) (Placement, error) {
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
	u := &cgroupUnit{name: name, share: s, bg: s.Mode == ModeBackground}
	var pl Placement
	var made []string
	for _, h := range l.hier {
		for _, d := range l.homes(h, u) {
			if err := l.env.mkdirUnit(d); err != nil {
				for _, m := range made {
					_ = l.env.rmdir(m)
				}
				return Placement{}, fmt.Errorf("limiter: create cgroup for %s: %w", id, err)
			}
			made = append(made, d)
		}
		pl.JoinCgroups = append(pl.JoinCgroups, filepath.Join(l.dir(h, u), "cgroup.procs"))
	}
	if err := l.apply(u, s); err != nil {
		for _, m := range made {
			_ = l.env.rmdir(m)
		}
		return Placement{}, fmt.Errorf("limiter: place %s: %w", id, err)
	}
	l.units[id] = u
	pl.IntraOpThreads = ThreadsFor(s, l.cpus)
	l.log.Debug("instance placed", "id", id, "share", s, "cgroups", pl.JoinCgroups)
	return pl, nil
}

func (l *cgroupLimiter) Resize(id string, s Share) error {
	if err := validShare(s); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	u, err := l.units.get(id)
	if err != nil {
		return err
	}
	u.io.Lock()
	defer u.io.Unlock()
	if err := l.apply(u, s); err != nil {
		return fmt.Errorf("limiter: resize %s: %w", id, err)
	}
	l.log.Debug("instance resized", "id", id, "from", u.share, "to", s)
	u.share = s
	return nil
}

// parentWeight is the units' parent's weight, in the weight file's
// units: parentWeightPerCPU busy threads per CPU.
func (l *cgroupLimiter) parentWeight() string {
	return l.weightValue(parentWeightPerCPU * float64(l.cpus))
}

// quotaUS is the CFS quota for a share in microseconds per period, -1
// for no limit. The kernel refuses quotas under 1 ms.
func (l *cgroupLimiter) quotaUS(s Share) int64 {
	if !s.limited() {
		return -1
	}
	return max(int64(math.Round(s.Compute*float64(l.cpus)*float64(l.periodUS))), 1000)
}

// applyClass writes a unit's weight among its siblings.
func (l *cgroupLimiter) applyClass(d string, s Share) error {
	return writeFile(filepath.Join(d, l.weightFile()), l.weightValue(l.weight(s)))
}

// apply writes a share's limits into the unit's control files.
func (l *cgroupLimiter) apply(u *cgroupUnit, s Share) error {
	if err := l.applyTo(u, s); err != nil {
		return err
	}
	u.bg = s.Mode == ModeBackground
	return l.rehome(u)
}

// applyTo writes a share's limits into both homes of the unit, so that a
// process in either is limited as the share says.
func (l *cgroupLimiter) applyTo(u *cgroupUnit, s Share) error {
	for _, bg := range []bool{false, true} {
		if err := l.applyHome(u, s, bg); err != nil {
			return err
		}
	}
	return nil
}

// applyHome writes a share's limits into one home of the unit.
func (l *cgroupLimiter) applyHome(u *cgroupUnit, s Share, bg bool) error {
	quota := l.quotaUS(s)
	for _, h := range l.hier {
		if bg && h.background == "" {
			continue // one directory, written once
		}
		d := l.home(h, u, bg)
		if h.has("cpu") {
			if err := l.applyClass(d, s); err != nil {
				return err
			}
		}
		if l.v2 {
			cpuMax := "max " + strconv.FormatInt(l.periodUS, 10)
			if quota > 0 {
				cpuMax = strconv.FormatInt(quota, 10) + " " + strconv.FormatInt(l.periodUS, 10)
			}
			if err := writeFile(filepath.Join(d, "cpu.max"), cpuMax); err != nil {
				return err
			}
			mem := "max"
			if s.Memory > 0 {
				mem = strconv.FormatInt(s.Memory, 10)
			}
			if err := writeFile(filepath.Join(d, "memory.max"), mem); err != nil {
				return err
			}
			continue
		}
		if h.has("cpu") {
			// Lift the quota before changing the period, so that no
			// moment holds the old quota over a shorter period.
			if err := writeFile(filepath.Join(d, "cpu.cfs_quota_us"), "-1"); err != nil {
				return err
			}
			if err := writeFile(filepath.Join(d, "cpu.cfs_period_us"), strconv.FormatInt(l.periodUS, 10)); err != nil {
				return err
			}
			if quota > 0 {
				if err := writeFile(filepath.Join(d, "cpu.cfs_quota_us"), strconv.FormatInt(quota, 10)); err != nil {
					return err
				}
			}
		}
		if h.has("memory") {
			mem := "-1"
			if s.Memory > 0 {
				mem = strconv.FormatInt(s.Memory, 10)
			}
			if err := writeFile(filepath.Join(d, "memory.limit_in_bytes"), mem); err != nil {
				if errors.Is(err, syscall.EBUSY) {
					usage, _ := readInt(filepath.Join(d, "memory.usage_in_bytes"))
					return fmt.Errorf("memory limit %d bytes is below what the instance uses (%d bytes) and the kernel could not reclaim enough: %w", s.Memory, usage, err)
				}
				return err
			}
		}
	}
	return nil
}

func (l *cgroupLimiter) Stats(id string) (Stats, error) {
	l.mu.Lock()
	u, err := l.units.get(id)
	l.mu.Unlock()
	if err != nil {
		return Stats{}, err
	}
	var st Stats
	var errs []error
	l.mu.Lock()
	if err := l.rehome(u); err != nil {
		errs = append(errs, err)
	}
	// The unit's mode as its files are read below: a Resize may change it
	// meanwhile (a race the race detector saw, Stats beside a Resize).
	bg := u.bg
	l.mu.Unlock()
	if l.v2 {
		d := l.home(l.hier[0], u, bg)
		for _, home := range l.homes(l.hier[0], u) {
			if cpu, err := readKeyed(filepath.Join(home, "cpu.stat")); err == nil {
				st.CPUSeconds += float64(cpu["usage_usec"]) / 1e6
				st.ThrottledSeconds += float64(cpu["throttled_usec"]) / 1e6
			} else {
				errs = append(errs, err)
			}
		}
		cur, err := readInt(filepath.Join(d, "memory.current"))
		errs = append(errs, err)
		st.MemoryBytes = cur
		if peak, err := readInt(filepath.Join(d, "memory.peak")); err == nil {
			st.MemoryPeak = peak // kernels before 5.19 have none
		}
		if b, err := os.ReadFile(filepath.Join(d, "memory.max")); err == nil {
			if v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil {
				st.MemoryLimit = v
			}
		} else {
			errs = append(errs, err)
		}
		if ev, err := readKeyed(filepath.Join(d, "memory.events")); err == nil {
			st.OOMKills = uint64(ev["oom_kill"])
		} else {
			errs = append(errs, err)
		}
		return st, joinStatsErr(id, errs)
	}
	cpuFromAcct := false
	var procsFile string
	for _, h := range l.hier {
		d := l.home(h, u, bg)
		if h.has("cpuacct") {
			ns, err := readInt(filepath.Join(d, "cpuacct.usage"))
			errs = append(errs, err)
			st.CPUSeconds = float64(ns) / 1e9
			cpuFromAcct = err == nil
		}
		if h.has("cpu") {
			procsFile = filepath.Join(d, "cgroup.procs")
			for _, home := range l.homes(h, u) {
				if cpu, err := readKeyed(filepath.Join(home, "cpu.stat")); err == nil {
					st.ThrottledSeconds += float64(cpu["throttled_time"]) / 1e9
				} else {
					errs = append(errs, err)
				}
			}
		}
		if h.has("memory") {
			cur, err := readInt(filepath.Join(d, "memory.usage_in_bytes"))
			errs = append(errs, err)
			st.MemoryBytes = cur
			if peak, err := readInt(filepath.Join(d, "memory.max_usage_in_bytes")); err == nil {
				st.MemoryPeak = peak
			}
			lim, err := readInt(filepath.Join(d, "memory.limit_in_bytes"))
			errs = append(errs, err)
			// "No limit" reads back as the largest page-aligned int64.
			if lim > 0 && lim < math.MaxInt64/2 {
				st.MemoryLimit = lim
			}
			if oc, err := readKeyed(filepath.Join(d, "memory.oom_control")); err == nil {
				st.OOMKills = uint64(oc["oom_kill"])
			} else {
				errs = append(errs, err)
			}
		}
	}
	if !cpuFromAcct && procsFile != "" {
		// No cpuacct: add up the CPU time of the processes in the unit.
		// Processes that have exited are not counted.
		pids, err := readPids(procsFile)
		errs = append(errs, err)
		for _, pid := range pids {
			if s, err := processCPU(pid); err == nil {
				st.CPUSeconds += s
			}
		}
	}
	return st, joinStatsErr(id, errs)
}

func joinStatsErr(id string, errs []error) error {
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("limiter: stats of %s: %w", id, err)
	}
	return nil
}

// processCPU is a process's user plus system time from /proc, in seconds.
func processCPU(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, errors.New("no command name")
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, errors.New("short stat")
	}
	ut, err1 := strconv.ParseFloat(f[11], 64)
	st, err2 := strconv.ParseFloat(f[12], 64)
	if err1 != nil || err2 != nil {
		return 0, errors.New("bad utime or stime")
	}
	// USER_HZ is 100 on every Linux this runs on.
	return (ut + st) / 100, nil
}

// LiftCompute takes a unit out of the background parent and lifts its
// compute cap, its memory limit unchanged (a floor, which has neither, is
// left as it is): for a runner about to stop,
// which must get the CPU to exit even when many stop at once (capped in
// the idle class, 85 of 100 idle best-effort runners could not within the
// stop timeout). The unit's share is the lifted one until Resize or
// Release. A lift that fails leaves the unit's share as it was, so that
// a retry writes the files again (TestLiftComputeRetriesAfterFailure).
//
// The unit's files are written outside the limiter's lock: runners that
// stop together lift their caps at once. Under the lock, 40 stopping
// best-effort runners took their turns, 1.4-4.7 s each in all on a busy
// host, and their SIGTERMs came as late (TestLiftComputeInParallel).
func (l *cgroupLimiter) LiftCompute(id string) error {
	l.mu.Lock()
	u, err := l.units.get(id)
	if err != nil {
		l.mu.Unlock()
		return err
	}
	if u.share.Mode == ModeFloor || !u.share.limited() && u.share.Mode != ModeBackground {
		l.mu.Unlock()
		return nil // no cap, no idle class: a floor keeps its weight
	}
	old, oldBg := u.share, u.bg
	s := Share{Memory: u.share.Memory, Mode: ModeCap}
	// The share first: a Stats meanwhile moves the processes the same way.
	u.share, u.bg = s, false
	u.io.Lock()
	l.mu.Unlock()
	err = errors.Join(l.applyTo(u, s), l.moveHome(u, false))
	u.io.Unlock()
	if err == nil {
		return nil
	}
	// Back to the share the files were written for, unless a Resize has
	// set another meanwhile (the lock order is mu, then io).
	l.mu.Lock()
	if u.share == s && !u.bg {
		u.share, u.bg = old, oldBg
	}
	l.mu.Unlock()
	return fmt.Errorf("limiter: lift the compute cap of %s: %w", id, err)
}

// LiftBackground takes the background parents out of the idle class (the
// lowest weight without it) and weighs them as the units' parent: for a
// stopping server, whose best-effort runners, restarted ones included
// (they join their first placement's home under this parent), must finish
// what they admitted at a peer's speed (BackgroundLifter). Their units'
// caps are lifted one by one (LiftCompute); this is the parent above
// them. A second call writes the files again.
func (l *cgroupLimiter) LiftBackground() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	var errs []error
	for _, h := range l.hier {
		if h.background == "" {
			continue
		}
		if l.idleClass {
			errs = append(errs, writeFile(filepath.Join(h.background, "cpu.idle"), "0"))
		}
		errs = append(errs, writeFile(filepath.Join(h.background, l.weightFile()), l.parentWeight()))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("limiter: lift the background parent: %w", err)
	}
	return nil
}

// Release removes a unit. Its directories are removed outside the lock:
// each rmdir waits for the kernel (RCU), and units stopping together
// should not wait for one another's.
func (l *cgroupLimiter) Release(id string) error {
	l.mu.Lock()
	u, err := l.units.get(id)
	if err == nil {
		delete(l.units, id)
	}
	l.mu.Unlock()
	if err != nil {
		return err
	}
	u.io.Lock() // a lift still writing its files
	err = l.release(u)
	u.io.Unlock()
	if err != nil {
		// Kept, so that Close tries again.
		l.mu.Lock()
		if _, taken := l.units[id]; !taken && !l.closed {
			l.units[id] = u
		}
		l.mu.Unlock()
		return fmt.Errorf("limiter: release %s: %w", id, err)
	}
	l.log.Debug("instance released", "id", id)
	return nil
}

// release removes the unit's directories. The runner has stopped, so
// they should be empty; anything left is moved back to the server's
// cgroup (killed if that fails) before the directory goes.
func (l *cgroupLimiter) release(u *cgroupUnit) error {
	var errs []error
	for _, h := range l.hier {
		for _, d := range l.homes(h, u) {
			errs = append(errs, l.removeUnitDir(h, d))
		}
	}
	return errors.Join(errs...)
}

// removeUnitDir removes one directory of a unit in h.
func (l *cgroupLimiter) removeUnitDir(h *hierarchy, d string) error {
	evict := func(pid int) error {
		if err := writeFile(filepath.Join(h.own, "cgroup.procs"), strconv.Itoa(pid)); err != nil {
			l.log.Warn("process left in a released cgroup could not be moved out; killing it", "pid", pid, "cgroup", d, "err", err)
			return l.env.kill(pid)
		}
		l.log.Warn("process left in a released cgroup; moved it back to the server's cgroup", "pid", pid, "cgroup", d)
		return nil
	}
	return removeCgroup(d, evict, l.env.rmdir, time.Second)
}

// removeCgroup removes a cgroup directory and the cgroups below it. Each
// process still in one is passed to evict; rmdir is retried until wait
// has passed, since a killed process leaves its cgroup only once it has
// exited. A directory that is gone already is fine.
func removeCgroup(dir string, evict func(pid int) error, rmdir func(string) error, wait time.Duration) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		if e.IsDir() {
			errs = append(errs, removeCgroup(filepath.Join(dir, e.Name()), evict, rmdir, wait))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	pids, err := readPids(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return err
	}
	for _, pid := range pids {
		if err := evict(pid); err != nil && !errors.Is(err, syscall.ESRCH) {
			return fmt.Errorf("process %d in %s: %w", pid, dir, err)
		}
	}
	deadline := time.Now().Add(wait)
	delay := 5 * time.Millisecond
	for {
		err := rmdir(dir)
		if err == nil || errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if time.Now().After(deadline) {
			if pids, _ := readPids(filepath.Join(dir, "cgroup.procs")); len(pids) > 0 {
				return fmt.Errorf("remove %s: processes %v are still in it: %w", dir, pids, err)
			}
			return err
		}
		time.Sleep(delay)
		delay = min(2*delay, 100*time.Millisecond)
	}
}

func (l *cgroupLimiter) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	var errs []error
	for id, u := range l.units {
		if err := l.release(u); err != nil {
			errs = append(errs, fmt.Errorf("release %s: %w", id, err))
			continue
		}
		delete(l.units, id)
	}
	for _, h := range l.hier {
		if err := l.closeServer(h); err != nil {
			errs = append(errs, err)
		}
		for _, parent := range []string{h.parent, h.background} {
			if parent == "" {
				continue
			}
			err := l.env.rmdir(parent)
			switch {
			case err == nil, errors.Is(err, os.ErrNotExist):
			case hasSubdirs(parent) && len(errs) == 0:
				// Another limiter of this server still has units here;
				// the last one to close removes the parent.
				l.log.Debug("parent cgroup still in use", "dir", parent)
			default:
				errs = append(errs, err)
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("limiter: close: %w", err)
	}
	return nil
}

func hasSubdirs(dir string) bool {
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.IsDir() {
			return true
		}
	}
	return false
}
