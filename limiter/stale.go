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
	"time"
)

// CleanupStale removes the units of servers that died without Close
// (SIGKILL, a crash): in the server's own cgroup of each hierarchy the
// limiter uses, every sloserve-<pid> directory (and the -background and
// -server ones beside it, and the -loadtest one a load generator makes
// beside a server's: loadtest's joinPeerCgroup) whose pid is not a live
// process is removed,
// after its remaining processes are killed with SIGKILL. It removes the unprivileged backend's units of servers that
// are gone too ($TMPDIR/sloserve-<uid>/sloserve-<pid>). It returns how many
// such sloserve-<pid> directories it removed. New calls it.
func CleanupStale(root string, logger *slog.Logger) (int, error) {
	if logger == nil {
		logger = slog.Default()
	}
	if root == "" {
		root = DefaultRoot
	}
	// The unprivileged backend's process units of servers that are gone.
	units := cleanupStaleUnits(unitsBase(), processAlive, logger)
	n, err := cleanupStale(root, hostEnv(), logger)
	return units + n, err
}

func cleanupStale(root string, env hostEnvironment, log *slog.Logger) (int, error) {
	sc, err := env.ownCgroups()
	if err != nil {
		return 0, fmt.Errorf("limiter: read own cgroups: %w", err)
	}
	var scan []string
	if isUnified(root) {
		scan = append(scan, ownDir(root, sc.unified))
	} else {
		for _, c := range []string{"cpu", "cpuacct", "memory"} {
			p, ok := sc.v1[c]
			if !ok {
				continue
			}
			mount := filepath.Join(root, c)
			if _, err := os.Stat(mount); err != nil {
				continue
			}
			dir := ownDir(mount, p)
			// Co-mounted controllers reach one directory by two names.
			if real, err := filepath.EvalSymlinks(dir); err == nil {
				dir = real
			}
			if !slices.Contains(scan, dir) {
				scan = append(scan, dir)
			}
		}
	}
	kill := func(pid int) error {
		log.Warn("killing a process left in the cgroup of a dead server", "pid", pid)
		return env.kill(pid)
	}
	removed := 0
	var errs []error
	for _, dir := range scan {
		entries, err := os.ReadDir(dir)
		if err != nil {
			if !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
			continue
		}
		for _, e := range entries {
			rest, ok := strings.CutPrefix(e.Name(), "sloserve-")
			if !ok || !e.IsDir() {
				continue
			}
			for _, suffix := range []string{"-background", "-server", "-loadtest"} {
				rest = strings.TrimSuffix(rest, suffix)
			}
			pid, err := strconv.Atoi(rest)
			if err != nil || pid <= 0 || pid == env.pid || env.alive(pid) {
				continue
			}
			stale := filepath.Join(dir, e.Name())
			if err := removeCgroup(stale, kill, env.rmdir, 2*time.Second); err != nil {
				errs = append(errs, fmt.Errorf("remove stale %s: %w", stale, err))
				continue
			}
			log.Info("removed the cgroups of a server that is gone", "dir", stale, "pid", pid)
			removed++
		}
	}
	if err := errors.Join(errs...); err != nil {
		return removed, fmt.Errorf("limiter: cleanup: %w", err)
	}
	return removed, nil
}
