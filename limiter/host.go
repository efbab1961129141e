package limiter

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path"
	"path/filepath"
	goruntime "runtime"
	"strconv"
	"strings"
	"syscall"
)

// hostEnvironment is what the cgroup code reads from and does to the
// host besides the cgroup files: the server's own cgroups, its pid, and
// other processes. Tests swap in a fake one to work on a fake root.
type hostEnvironment struct {
	selfCgroup func() ([]byte, error) // contents of /proc/self/cgroup
	pid        int                    // the server's pid
	alive      func(pid int) bool     // whether a process is live (not gone, not a zombie)
	kill       func(pid int) error    // SIGKILL
	numCPU     int                    // CPUs the affinity mask allows
	// mkdir and rmdir make and remove a cgroup directory; the kernel fills
	// a new one with its control files.
	mkdir func(dir string) error
	rmdir func(dir string) error
	// join moves a process (all its threads) into the cgroup whose
	// cgroup.procs file is given.
	join func(procs string, pid int) error
}

func hostEnv() hostEnvironment {
	return hostEnvironment{
		selfCgroup: func() ([]byte, error) { return os.ReadFile("/proc/self/cgroup") },
		pid:        os.Getpid(),
		alive:      processAlive,
		kill:       func(pid int) error { return syscall.Kill(pid, syscall.SIGKILL) },
		numCPU:     goruntime.NumCPU(),
		mkdir:      func(dir string) error { return os.Mkdir(dir, 0o755) },
		rmdir:      os.Remove,
		join:       func(procs string, pid int) error { return writeFile(procs, strconv.Itoa(pid)) },
	}
}

// ownCgroups is /proc/self/cgroup parsed, with the server's own cgroup
// (serverName, where a cgroup limiter moved the server's process) taken
// back to its parent: the cgroup the server came from, where the units'
// parents and the server's cgroup live side by side.
func (e hostEnvironment) ownCgroups() (selfCgroups, error) {
	b, err := e.selfCgroup()
	if err != nil {
		return selfCgroups{}, err
	}
	sc := parseSelfCgroup(b)
	up := func(p string) string {
		if path.Base(p) == serverName(e.pid) {
			return path.Dir(p)
		}
		return p
	}
	for c, p := range sc.v1 {
		sc.v1[c] = up(p)
	}
	if sc.unified != "" {
		sc.unified = up(sc.unified)
	}
	return sc, nil
}

// processAlive reports whether pid is a live process. A zombie is not:
// it has exited and only waits for its parent to reap it.
func processAlive(pid int) bool {
	if pid <= 0 {
		return false
	}
	if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return !errors.Is(err, os.ErrNotExist)
	}
	i := bytes.LastIndexByte(stat, ')')
	return i < 0 || i+2 >= len(stat) || stat[i+2] != 'Z'
}

// selfCgroups is /proc/self/cgroup parsed: for cgroup v1 the path of each
// controller's hierarchy and an id shared by co-mounted controllers; for
// v2 the unified path.
type selfCgroups struct {
	v1        map[string]string // controller -> path
	hierarchy map[string]string // controller -> hierarchy id
	unified   string            // "" if there is no "0::" line
}

func parseSelfCgroup(b []byte) selfCgroups {
	sc := selfCgroups{v1: map[string]string{}, hierarchy: map[string]string{}}
	for line := range strings.Lines(string(b)) {
		id, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok {
			continue
		}
		ctrls, p, ok := strings.Cut(rest, ":")
		if !ok {
			continue
		}
		if id == "0" && ctrls == "" {
			sc.unified = p
			continue
		}
		for c := range strings.SplitSeq(ctrls, ",") {
			if c != "" {
				sc.v1[c] = p
				sc.hierarchy[c] = id
			}
		}
	}
	return sc
}

// ownDir is the server's cgroup directory under mount, or mount itself
// when that path does not exist there (a container that sees the host's
// paths in /proc/self/cgroup but has only its own cgroup mounted).
func ownDir(mount, p string) string {
	dir := filepath.Join(mount, path.Clean("/"+p))
	if st, err := os.Stat(dir); err == nil && st.IsDir() {
		return dir
	}
	return mount
}

// isUnified reports whether root is a cgroup v2 (unified) hierarchy:
// only its root carries cgroup.controllers.
func isUnified(root string) bool {
	_, err := os.Stat(filepath.Join(root, "cgroup.controllers"))
	return err == nil
}

// cpus is the number of CPUs the server may use: the affinity mask,
// further bounded by a CPU quota on the server's cgroup or its ancestors.
func (e hostEnvironment) cpus(root string, log *slog.Logger) int {
	n := max(e.numCPU, 1)
	sc, err := e.ownCgroups()
	if err != nil {
		return n
	}
	var dirs []string
	var quota func(dir string) (float64, bool)
	switch {
	case isUnified(root):
		quota = quotaV2
		dirs = ancestors(root, ownDir(root, sc.unified))
	case sc.v1["cpu"] != "":
		quota = quotaV1
		mount := filepath.Join(root, "cpu")
		dirs = ancestors(mount, ownDir(mount, sc.v1["cpu"]))
	}
	for _, d := range dirs {
		if q, ok := quota(d); ok {
			if c := int(math.Ceil(q - 1e-9)); c < n {
				log.Debug("CPU quota bounds usable CPUs", "cgroup", d, "cpus", q)
				n = max(c, 1)
			}
		}
	}
	return n
}

// ancestors lists dir and its parents up to and including top.
func ancestors(top, dir string) []string {
	var out []string
	for {
		out = append(out, dir)
		if dir == top || !strings.HasPrefix(dir, top) {
			return out
		}
		dir = filepath.Dir(dir)
	}
}

// quotaV2 reads cpu.max as a number of CPUs.
func quotaV2(dir string) (float64, bool) {
	b, err := os.ReadFile(filepath.Join(dir, "cpu.max"))
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(b))
	if len(f) != 2 || f[0] == "max" {
		return 0, false
	}
	q, err1 := strconv.ParseFloat(f[0], 64)
	p, err2 := strconv.ParseFloat(f[1], 64)
	if err1 != nil || err2 != nil || q <= 0 || p <= 0 {
		return 0, false
	}
	return q / p, true
}

// quotaV1 reads cpu.cfs_quota_us over cpu.cfs_period_us as CPUs.
func quotaV1(dir string) (float64, bool) {
	q, err1 := readInt(filepath.Join(dir, "cpu.cfs_quota_us"))
	p, err2 := readInt(filepath.Join(dir, "cpu.cfs_period_us"))
	if err1 != nil || err2 != nil || q <= 0 || p <= 0 {
		return 0, false
	}
	return float64(q) / float64(p), true
}

// readInt reads a file that holds one integer.
func readInt(file string) (int64, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, err
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", file, err)
	}
	return v, nil
}

// readKeyed reads a "key value" per line file (cpu.stat, memory.events,
// memory.oom_control) into a map.
func readKeyed(file string) (map[string]int64, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	m := map[string]int64{}
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		if v, err := strconv.ParseInt(f[1], 10, 64); err == nil {
			m[f[0]] = v
		}
	}
	return m, nil
}

// writeFile writes a control file. Control files take one write; the
// kernel's error (EBUSY, EINVAL) is what the caller needs to see.
func writeFile(file, value string) error {
	f, err := os.OpenFile(file, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(value)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %q to %s: %w", value, file, err)
	}
	return nil
}

// readPids reads a cgroup.procs file. A missing file reads as empty.
func readPids(file string) ([]int, error) {
	b, err := os.ReadFile(file)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var pids []int
	for f := range strings.FieldsSeq(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil && pid > 0 {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// errnoOf returns the bare system error of err ("permission denied"),
// or err itself.
func errnoOf(err error) error {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno
	}
	return err
}
