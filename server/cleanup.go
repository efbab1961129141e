package server

import (
	"log/slog"
	"os"

	"github.com/sloserve/sloserve/limiter"
)

// Cleanup is what CleanupStale removed.
type Cleanup struct {
	// Cgroups counts the sloserve-<pid> cgroup folders (per hierarchy, the
	// background parents included) of servers that are gone.
	Cgroups int
	// SocketDirs are the runner socket folders of servers that are gone.
	SocketDirs []string
}

// CleanupStale removes what servers killed without a chance to clean up
// (SIGKILL, a crash, the machine's OOM killer) left behind: their cgroups,
// after killing any process still in them, and their runners' socket
// folders in the temporary directory. Every server does it when it starts;
// `sloserve cleanup` does it without starting one. A live server's folders
// are never touched.
func CleanupStale(logger *slog.Logger) (Cleanup, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	var c Cleanup
	var err error
	c.Cgroups, err = limiter.CleanupStale("", logger)
	c.SocketDirs = removeStaleSocketDirs(os.TempDir(), logger)
	return c, err
}
