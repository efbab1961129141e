package server

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/runtime"
)

// Cleanup is what CleanupStale removed.
type Cleanup struct {
	// Cgroups counts the sloserve-<pid> cgroup folders (per hierarchy, the
	// background parents included) of servers that are gone.
	Cgroups int
	// SocketDirs are the runner socket folders (and staged model
	// repositories) of servers that are gone.
	SocketDirs []string
}

// CleanupStale removes what servers killed without a chance to clean up
// (SIGKILL, a crash, the machine's OOM killer) left behind: their cgroups,
// after killing any process still in them, and their runners' socket
// folders in the temporary directory. Every server does it when it starts;
// `sloserve cleanup` does it without starting one. A live server's folders
// are never touched, nor any folder a server did not provably make (see
// removeStaleSocketDirs).
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

// socketDirPrefix starts the name of the temporary folders a server makes
// (its runners' sockets, its staged models); the server's pid follows it.
const socketDirPrefix = "sloserve-"

// The kinds of temporary folder a server makes, as its owner file names
// them.
const (
	dirSockets = "sockets" // runner sockets and the runners' own temporary folders
	dirModels  = "models"  // a staged repository (model_dir, ModelMesh)
)

// ownerFile is the file a server writes first into every temporary folder
// it makes: "sloserve <kind> pid <pid> start <start>\n", start being the
// process's start time in clock ticks since boot (/proc/<pid>/stat), so that
// a later process with the same pid is not taken for the server.
const ownerFile = ".sloserve-owner"

// makeServerDir makes a temporary folder sloserve-<pid>-<pattern> of the
// given kind for this process, with its owner file, mode 0700.
func makeServerDir(kind, pattern string) (string, error) {
	dir, err := os.MkdirTemp("", fmt.Sprintf("%s%d-%s", socketDirPrefix, os.Getpid(), pattern))
	if err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(dir, ownerFile), ownerLine(kind, os.Getpid(), processStart(os.Getpid())), 0o600); err != nil {
		os.RemoveAll(dir)
		return "", err
	}
	return dir, nil
}

func ownerLine(kind string, pid int, start string) []byte {
	return fmt.Appendf(nil, "sloserve %s pid %d start %s\n", kind, pid, start)
}

// processStart is a process's start time in clock ticks since boot, field
// 22 of /proc/<pid>/stat; "" when it cannot be read.
func processStart(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	// The command name (field 2) is in parentheses and may hold spaces.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return ""
	}
	fields := strings.Fields(string(b[i+1:]))
	if len(fields) < 20 {
		return ""
	}
	return fields[19] // field 22 of the line; fields[0] is field 3
}

// removeStaleSocketDirs removes the temporary folders of servers that died
// without cleaning up (SIGKILL) and returns those it removed. A folder goes
// only when everything says a server of ours made it and is gone:
//   - its name is sloserve-<pid>-..., it is a folder (not a link to one)
//     and this user owns it;
//   - its owner file (a regular file) names that pid and a folder kind;
//   - no process with that pid runs, or the one that does started at
//     another time than the owner file says (the pid was reused);
//   - it holds only what such a server leaves: for sockets, Unix sockets
//     and runner folders of plain files; for models, staged model folders
//     of links, folders and config files.
//
// Anything else (a folder made by hand, another program's, another user's)
// is left alone. The runners died with their server (a parent-death
// signal); removal never follows a link.
func removeStaleSocketDirs(tmp string, logger *slog.Logger) []string {
	entries, err := os.ReadDir(tmp)
	if err != nil {
		return nil
	}
	var removed []string
	for _, e := range entries {
		dir := filepath.Join(tmp, e.Name())
		pid, ok := staleServerDir(dir, e.Name())
		if !ok {
			continue
		}
		if err := os.RemoveAll(dir); err != nil {
			logger.Warn("cannot remove a dead server's socket folder", "dir", dir, "err", err)
			continue
		}
		logger.Info("removed a dead server's socket folder", "dir", dir, "pid", pid)
		removed = append(removed, dir)
	}
	return removed
}

// staleServerDir reports whether dir (named name) is the temporary folder
// of a server that is gone, as removeStaleSocketDirs says, and its pid.
func staleServerDir(dir, name string) (int, bool) {
	rest, ok := strings.CutPrefix(name, socketDirPrefix)
	if !ok {
		return 0, false
	}
	pidText, _, ok := strings.Cut(rest, "-")
	pid, err := strconv.Atoi(pidText)
	if !ok || err != nil || pid <= 0 || pid == os.Getpid() {
		return 0, false
	}
	if !ownedDir(dir) {
		return 0, false
	}
	marker := filepath.Join(dir, ownerFile)
	fi, err := os.Lstat(marker)
	if err != nil || !fi.Mode().IsRegular() || fi.Size() > 256 {
		return 0, false
	}
	line, err := os.ReadFile(marker)
	if err != nil {
		return 0, false
	}
	var kind string
	var start string
	for _, k := range []string{dirSockets, dirModels} {
		prefix := fmt.Sprintf("sloserve %s pid %d start ", k, pid)
		if s, ok := strings.CutPrefix(string(line), prefix); ok && strings.HasSuffix(s, "\n") {
			kind, start = k, strings.TrimSuffix(s, "\n")
		}
	}
	if kind == "" {
		return 0, false
	}
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		// A process with the pid runs: the server, unless it started at
		// another time (the pid was reused since).
		now := processStart(pid)
		if start == "" || now == "" || now == start {
			return 0, false
		}
	}
	if !onlyServerContents(dir, kind, 0) {
		return 0, false
	}
	return pid, true
}

// ownedDir reports whether path is a folder (not a link) this user owns.
func ownedDir(path string) bool {
	fi, err := os.Lstat(path)
	if err != nil || !fi.IsDir() {
		return false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && int(st.Uid) == os.Getuid()
}

// telemetryParts is the folders of runtime.RunnerTelemetryDir, outermost
// first; telemetryDepth how many they are.
var (
	telemetryParts = strings.Split(runtime.RunnerTelemetryDir, "/")
	telemetryDepth = len(telemetryParts)
)

// telemetryPart reports whether a folder called name, depth levels below
// the server's folder (1: inside a runner's own folder), is the next step
// of runtime.RunnerTelemetryDir.
func telemetryPart(depth int, name string) bool {
	return depth-1 < telemetryDepth && telemetryParts[depth-1] == name
}

// onlyServerContents reports whether folder dir, depth levels below a
// server's temporary folder of the given kind, holds only what such a
// server puts there.
func onlyServerContents(dir, kind string, depth int) bool {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return false
	}
	for _, e := range entries {
		p := filepath.Join(dir, e.Name())
		t := e.Type()
		switch {
		case depth == 0 && e.Name() == ownerFile:
		case kind == dirSockets && depth == 0 && t&fs.ModeSocket != 0:
		case kind == dirSockets && depth == 0 && strings.HasPrefix(e.Name(), runtime.RunnerTempPrefix) && t.IsDir():
			if !ownedDir(p) || !onlyServerContents(p, kind, depth+1) {
				return false
			}
		case kind == dirSockets && depth == 1 && t.IsRegular():
		case kind == dirSockets && depth >= 1 && t.IsDir() && telemetryPart(depth, e.Name()):
			// ONNX Runtime's telemetry database, the runner's
			// XDG_CACHE_HOME being its folder.
			if !ownedDir(p) || !onlyServerContents(p, kind, depth+1) {
				return false
			}
		case kind == dirSockets && depth == 1+telemetryDepth && t.IsRegular():
		case kind == dirModels && depth < 3 && t.IsDir():
			if !ownedDir(p) || !onlyServerContents(p, kind, depth+1) {
				return false
			}
		case kind == dirModels && depth > 0 && t&fs.ModeSymlink != 0:
		case kind == dirModels && depth == 1 && t.IsRegular() && e.Name() == "config.yaml":
		default:
			return false
		}
	}
	return true
}
