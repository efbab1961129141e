package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// confinement is the benchmark's own process confined to a CPU quota in a
// cgroup of its own (generatorCgroup).
type confinement struct {
	cpus  float64
	note  string                            // what was done, or why not
	usage func() (time.Duration, bool)      // CPU time the cgroup's tasks used; false: not known
	stats func() (throttled, periods int64) // quota periods throttled, of all; 0, 0 when not known
	leave func()                            // back to the cgroup it came from
}

// generatorCgroup confines the benchmark's own process (the load
// generator, with its prober and sampler) to cpus CPUs in a cgroup of its
// own, so that the generator's work is not counted against the server it
// measures: clients of a real server run on other machines. The servers
// the benchmark started before the call stay where they were; leave moves
// the process back and removes the cgroup. Its note says what it did, or
// the reason it could not (then the run goes on unconfined, and the report
// says so). usage reads the CPU time the cgroup has accounted to its
// tasks (cgroup v1 cpuacct.usage, v2 cpu.stat usage_usec), so that a run
// can check its generator was held to the quota.
func generatorCgroup(b testing.TB, cpus float64) *confinement {
	b.Helper()
	// A short period: the quota runs out in slices of at most half of
	// it, so a throttled generator stalls for milliseconds, not for the
	// 50 ms of the default period, which a latency-critical request near
	// its deadline would see as lateness that is not the server's.
	const period = 10_000 // µs
	quota := int(cpus * period)
	pid := strconv.Itoa(os.Getpid())
	name := "sloserve-bench-" + pid
	c := &confinement{
		cpus:  cpus,
		usage: func() (time.Duration, bool) { return 0, false },
		stats: func() (int64, int64) { return 0, 0 },
		leave: func() {},
	}
	unconfined := func(err error) *confinement {
		c.note = fmt.Sprintf("generator unconfined: %v", err)
		return c
	}
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		// v2: beside the process's own cgroup's parent would need
		// delegation; the root is what a benchmark machine gives.
		parent := "/sys/fs/cgroup"
		dir := filepath.Join(parent, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			return unconfined(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "cpu.max"), []byte(fmt.Sprintf("%d %d", quota, period)), 0o644); err != nil {
			os.Remove(dir)
			return unconfined(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(pid), 0o644); err != nil {
			os.Remove(dir)
			return unconfined(err)
		}
		stat := func(key string) (int64, bool) { return cgroupStat(filepath.Join(dir, "cpu.stat"), key) }
		c.usage = func() (time.Duration, bool) {
			us, ok := stat("usage_usec")
			return time.Duration(us) * time.Microsecond, ok
		}
		c.stats = func() (int64, int64) {
			t, _ := stat("nr_throttled")
			p, _ := stat("nr_periods")
			return t, p
		}
		c.leave = func() {
			_ = os.WriteFile(filepath.Join(parent, "cgroup.procs"), []byte(pid), 0o644)
			_ = os.Remove(dir)
		}
		c.note = fmt.Sprintf("generator confined to %.2g CPU (cgroup v2 cpu.max)", cpus)
		return c
	}
	// v1: the cpu hierarchy, beside the process's own cgroup, and the
	// cpuacct hierarchy for its usage (a hierarchy of its own on some
	// machines, the same as cpu's on others).
	own, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return unconfined(err)
	}
	rel := map[string]string{}
	for line := range strings.SplitSeq(string(own), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		for ctrl := range strings.SplitSeq(parts[1], ",") {
			rel[ctrl] = parts[2]
		}
	}
	if _, ok := rel["cpu"]; !ok {
		c.note = "generator unconfined: no cpu hierarchy in /proc/self/cgroup"
		return c
	}
	home := filepath.Join("/sys/fs/cgroup/cpu", rel["cpu"])
	dir := filepath.Join(home, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return unconfined(err)
	}
	for _, w := range []struct{ file, v string }{
		{"cpu.cfs_period_us", strconv.Itoa(period)},
		{"cpu.cfs_quota_us", strconv.Itoa(quota)},
		{"cgroup.procs", pid},
	} {
		if err := os.WriteFile(filepath.Join(dir, w.file), []byte(w.v), 0o644); err != nil {
			os.Remove(dir)
			return unconfined(fmt.Errorf("%s: %w", w.file, err))
		}
	}
	leaveCPU := func() {
		_ = os.WriteFile(filepath.Join(home, "cgroup.procs"), []byte(pid), 0o644)
		_ = os.Remove(dir)
	}
	c.leave = leaveCPU
	c.stats = func() (int64, int64) {
		t, _ := cgroupStat(filepath.Join(dir, "cpu.stat"), "nr_throttled")
		p, _ := cgroupStat(filepath.Join(dir, "cpu.stat"), "nr_periods")
		return t, p
	}
	c.note = fmt.Sprintf("generator confined to %.2g CPU (cgroup v1 cpu.cfs_quota_us)", cpus)
	acctDir := dir // cpu and cpuacct mounted together
	if _, err := os.Stat(filepath.Join(dir, "cpuacct.usage")); err != nil {
		acctRel, ok := rel["cpuacct"]
		if !ok {
			c.note += "; its usage unknown: no cpuacct hierarchy"
			return c
		}
		acctHome := filepath.Join("/sys/fs/cgroup/cpuacct", acctRel)
		acctDir = filepath.Join(acctHome, name)
		if err := os.Mkdir(acctDir, 0o755); err != nil {
			c.note += fmt.Sprintf("; its usage unknown: %v", err)
			return c
		}
		if err := os.WriteFile(filepath.Join(acctDir, "cgroup.procs"), []byte(pid), 0o644); err != nil {
			os.Remove(acctDir)
			c.note += fmt.Sprintf("; its usage unknown: %v", err)
			return c
		}
		c.leave = func() {
			leaveCPU()
			_ = os.WriteFile(filepath.Join(acctHome, "cgroup.procs"), []byte(pid), 0o644)
			_ = os.Remove(acctDir)
		}
	}
	c.usage = func() (time.Duration, bool) {
		raw, err := os.ReadFile(filepath.Join(acctDir, "cpuacct.usage"))
		if err != nil {
			return 0, false
		}
		ns, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
		return time.Duration(ns), err == nil
	}
	return c
}

// cgroupStat reads one "key value" line of a cgroup stat file.
func cgroupStat(path, key string) (int64, bool) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	for line := range strings.SplitSeq(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, key+" "); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

// generatorLoad is what the confined generator used over a load phase.
type generatorLoad struct {
	elapsed           time.Duration // wall time of the phase
	cgroup            time.Duration // CPU time the cgroup accounted
	cgroupKnown       bool
	process           time.Duration // CPU time of the whole process (/proc/self/stat)
	throttled, period int64         // quota periods throttled, of all
}

// cores is the cgroup's CPU time over the phase, in cores.
func (g generatorLoad) cores() float64 { return g.cgroup.Seconds() / g.elapsed.Seconds() }

// check says why the phase's generator was not held to its quota cpus, or
// nil: the cgroup used more than 10% over the quota, or the process used
// more than 10% over what its cgroup accounted (threads that ran
// elsewhere, or a confinement that did not take).
func (g generatorLoad) check(cpus float64) error {
	if cpus <= 0 || !g.cgroupKnown || g.elapsed <= 0 {
		return nil
	}
	if c := g.cores(); c > 1.1*cpus {
		return fmt.Errorf("the load generator used %.2f cores over the %v of the load, over its quota of %.2g by more than 10%%: its figures say nothing about the server", c, g.elapsed.Round(time.Millisecond), cpus)
	}
	if g.process > g.cgroup+g.cgroup/10+10*time.Millisecond {
		return fmt.Errorf("the load generator's process used %v of CPU over the load, its cgroup accounted only %v: part of it ran outside its confinement", g.process.Round(time.Millisecond), g.cgroup.Round(time.Millisecond))
	}
	return nil
}

// String reports the phase's generator CPU.
func (g generatorLoad) String() string {
	if !g.cgroupKnown {
		return fmt.Sprintf("generator %.2f cores (process, cgroup usage unknown)", g.process.Seconds()/g.elapsed.Seconds())
	}
	s := fmt.Sprintf("generator %.2f cores in its cgroup (process %.2f)", g.cores(), g.process.Seconds()/g.elapsed.Seconds())
	if g.period > 0 {
		s += fmt.Sprintf(", throttled in %.0f%% of its quota periods", 100*float64(g.throttled)/float64(g.period))
	}
	return s
}

// The overload benchmark fails when its generator was not held to its
// quota: the cgroup used over 10% more than the quota, or the process
// used more than its cgroup accounted.
func TestGeneratorLoadCheck(t *testing.T) {
	s := time.Second
	for _, tc := range []struct {
		name string
		g    generatorLoad
		want string // "" when held
	}{
		{"held", generatorLoad{elapsed: 20 * s, cgroup: 10 * s, cgroupKnown: true, process: 10 * s}, ""},
		{"at the margin", generatorLoad{elapsed: 20 * s, cgroup: 10900 * time.Millisecond, cgroupKnown: true, process: 10900 * time.Millisecond}, ""},
		{"over the quota", generatorLoad{elapsed: 20 * s, cgroup: 14 * s, cgroupKnown: true, process: 14 * s}, "used 0.70 cores over the 20s of the load, over its quota of 0.5"},
		{"outside its cgroup", generatorLoad{elapsed: 20 * s, cgroup: 8 * s, cgroupKnown: true, process: 14 * s}, "used 14s of CPU over the load, its cgroup accounted only 8s"},
		{"usage unknown", generatorLoad{elapsed: 20 * s, process: 14 * s}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.g.check(0.5)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("%v, want held", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("%v, want %q", err, tc.want)
			}
		})
	}
	// Unconfined runs are not checked.
	if err := (generatorLoad{elapsed: 20 * s, cgroup: 30 * s, cgroupKnown: true, process: 30 * s}).check(0); err != nil {
		t.Errorf("unconfined: %v", err)
	}
}
