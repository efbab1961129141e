package limiter

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// A delegated cgroup v2 subtree is a cgroup the server's user owns though
// the tree above it is not writable: systemd's Delegate=yes (a user
// service, or `systemd-run --user --scope -p Delegate=yes`), or a
// container with a private, writable cgroup namespace. The server may
// make cgroups below it and move its own processes between them, which is
// all the cgroup backend needs, but cgroup v2's "no internal processes"
// rule keeps a cgroup that holds processes from handing controllers to its
// children. So the server first moves every process of its cgroup into a
// leaf beside the units' parents, then enables cpu and memory there, and
// the cgroup backend works below it as on a writable tree.

// delegatedLeaf is the child of the delegated cgroup the server's
// processes move to.
const delegatedLeaf = "sloserve-server"

// findDelegated returns the server's own cgroup v2 directory when it is a
// subtree the server may use (writable by it, with cpu and memory
// available), or why it is not. access is access(2) with W_OK.
func findDelegated(root string, env hostEnvironment, access func(path string) error) (string, error) {
	if !isUnified(root) {
		return "", fmt.Errorf("%s is not a unified (cgroup v2) hierarchy", root)
	}
	sc, err := env.ownCgroups()
	if err != nil {
		return "", fmt.Errorf("read own cgroup: %w", err)
	}
	if sc.unified == "" {
		return "", errors.New("/proc/self/cgroup has no cgroup v2 (0::) line")
	}
	own := ownDir(root, sc.unified)
	// A server that was moved into the leaf already (an earlier limiter
	// of this server) owns the leaf's parent.
	if filepath.Base(own) == delegatedLeaf && own != root {
		own = filepath.Dir(own)
	}
	avail, err := os.ReadFile(filepath.Join(own, "cgroup.controllers"))
	if err != nil {
		return "", err
	}
	have := strings.Fields(string(avail))
	for _, c := range []string{"cpu", "memory"} {
		if !slices.Contains(have, c) {
			return "", fmt.Errorf("controller %s is not delegated to %s (cgroup.controllers: %q)", c, own, strings.TrimSpace(string(avail)))
		}
	}
	for _, p := range []string{own, filepath.Join(own, "cgroup.procs"), filepath.Join(own, "cgroup.subtree_control")} {
		if err := access(p); err != nil {
			return "", fmt.Errorf("%s is not writable by uid %d: %w", p, os.Getuid(), errnoOf(err))
		}
	}
	return own, nil
}

// writable is access(2) with W_OK.
func writable(path string) error { return unix.Access(path, unix.W_OK) }

// newDelegated moves the server's processes into a leaf of its delegated
// cgroup and starts the cgroup v2 backend on that cgroup.
func newDelegated(opts Options, env hostEnvironment, access func(string) error, log *slog.Logger) (*cgroupLimiter, error) {
	own, err := findDelegated(opts.Root, env, access)
	if err != nil {
		return nil, err
	}
	leaf := filepath.Join(own, delegatedLeaf)
	if err := env.mkdirUnit(leaf); err != nil {
		return nil, fmt.Errorf("make %s: %w", leaf, errnoOf(err))
	}
	moved, err := moveProcs(own, leaf)
	if err != nil {
		_, _ = moveProcs(leaf, own)
		_ = env.rmdir(leaf)
		return nil, fmt.Errorf("move the server's processes to %s: %w", leaf, err)
	}
	rel, err := filepath.Rel(opts.Root, own)
	if err != nil {
		return nil, err
	}
	// The cgroup backend takes the delegated cgroup for the server's own.
	denv := env
	denv.selfCgroup = func() ([]byte, error) { return []byte("0::" + filepath.Join("/", rel) + "\n"), nil }
	if n, err := cleanupStale(opts.Root, denv, log); err != nil {
		log.Warn("removing stale cgroups", "removed", n, "err", err)
	}
	l, err := newCgroup(opts, denv, leaf, log)
	if err != nil {
		_, _ = moveProcs(leaf, own)
		_ = env.rmdir(leaf)
		return nil, err
	}
	l.describe = fmt.Sprintf("delegated cgroup v2 subtree %s (the server's %d process(es) moved to %s): %s", own, moved, delegatedLeaf, l.describe)
	return l, nil
}

// moveProcs moves every process in from's cgroup.procs to to's; it
// returns how many moved. A process that ended meanwhile is fine.
func moveProcs(from, to string) (int, error) {
	pids, err := readPids(filepath.Join(from, "cgroup.procs"))
	if err != nil {
		return 0, err
	}
	n := 0
	for _, pid := range pids {
		err := writeFile(filepath.Join(to, "cgroup.procs"), strconv.Itoa(pid))
		if err != nil && !errors.Is(err, unix.ESRCH) {
			return n, err
		}
		n++
	}
	return n, nil
}
