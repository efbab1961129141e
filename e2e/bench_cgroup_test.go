package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// generatorCgroup confines the benchmark's own process (the load
// generator, with its prober and sampler) to cpus CPUs in a cgroup of its
// own, so that the generator's work is not counted against the server it
// measures: clients of a real server run on other machines. The servers
// the benchmark started before the call stay where they were; leave moves
// the process back and removes the cgroup. It returns a note of what it
// did, or the reason it could not (then the run goes on unconfined, and
// the report says so).
func generatorCgroup(b testing.TB, cpus float64) (leave func(), note string) {
	b.Helper()
	// A short period: the quota runs out in slices of at most half of
	// it, so a throttled generator stalls for milliseconds, not for the
	// 50 ms of the default period, which a latency-critical request near
	// its deadline would see as lateness that is not the server's.
	const period = 10_000 // µs
	quota := int(cpus * period)
	pid := strconv.Itoa(os.Getpid())
	name := "sloserve-bench-" + pid
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		// v2: beside the process's own cgroup's parent would need
		// delegation; the root is what a benchmark machine gives.
		parent := "/sys/fs/cgroup"
		dir := filepath.Join(parent, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			return func() {}, fmt.Sprintf("generator unconfined: %v", err)
		}
		if err := os.WriteFile(filepath.Join(dir, "cpu.max"), []byte(fmt.Sprintf("%d %d", quota, period)), 0o644); err != nil {
			os.Remove(dir)
			return func() {}, fmt.Sprintf("generator unconfined: %v", err)
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(pid), 0o644); err != nil {
			os.Remove(dir)
			return func() {}, fmt.Sprintf("generator unconfined: %v", err)
		}
		return func() {
			_ = os.WriteFile(filepath.Join(parent, "cgroup.procs"), []byte(pid), 0o644)
			_ = os.Remove(dir)
		}, fmt.Sprintf("generator confined to %.2g CPU (cgroup v2 cpu.max)", cpus)
	}
	// v1: the cpu hierarchy, beside the process's own cgroup.
	own, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return func() {}, fmt.Sprintf("generator unconfined: %v", err)
	}
	var rel string
	for line := range strings.SplitSeq(string(own), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && (parts[1] == "cpu" || strings.Contains(parts[1], "cpu,") || strings.HasSuffix(parts[1], ",cpu")) {
			rel = parts[2]
		}
	}
	mount := "/sys/fs/cgroup/cpu"
	if rel == "" {
		return func() {}, "generator unconfined: no cpu hierarchy in /proc/self/cgroup"
	}
	home := filepath.Join(mount, rel)
	dir := filepath.Join(home, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return func() {}, fmt.Sprintf("generator unconfined: %v", err)
	}
	for _, w := range []struct{ file, v string }{
		{"cpu.cfs_period_us", strconv.Itoa(period)},
		{"cpu.cfs_quota_us", strconv.Itoa(quota)},
		{"cgroup.procs", pid},
	} {
		if err := os.WriteFile(filepath.Join(dir, w.file), []byte(w.v), 0o644); err != nil {
			os.Remove(dir)
			return func() {}, fmt.Sprintf("generator unconfined: %s: %v", w.file, err)
		}
	}
	return func() {
		_ = os.WriteFile(filepath.Join(home, "cgroup.procs"), []byte(pid), 0o644)
		_ = os.Remove(dir)
	}, fmt.Sprintf("generator confined to %.2g CPU (cgroup v1 cpu.cfs_quota_us)", cpus)
}
