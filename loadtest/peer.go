package loadtest

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// A load generator on the server's own machine reads every answer on a
// CPU the server's runners also want. The cgroup limiter weighs the
// server's own threads and its runners' parent as several busy threads
// per CPU each; a generator left at the default weight then waits behind
// both, and the time an answer sits unread in its socket counts against
// the request's SLO although a client on another machine would have read
// it at once. (On the colocation day, adaptive's late requests were 1.9%
// and 2.7% with the generator weighted as the server, and 7.5-13.3% in
// runs beside it at the default weight, beside other work.)
//
// joinPeerCgroup puts this process in a cpu cgroup beside the server's
// own, at the server's weight, when the server runs in one (the cgroup
// limiter's sloserve-<pid>-server); the cgroup is named after this
// process, sloserve-<pid>-loadtest, so that a server's start removes it
// if this process dies without leave. It returns leave, which moves this
// process back and removes the cgroup, and a description for the report.
// Where the server has no cgroup of its own, or this process may not
// make one (not root, no delegation), it does nothing and says why.
func joinPeerCgroup(serverPid int) (leave func() error, desc string) {
	nothing := func() error { return nil }
	server, ok := cpuCgroupOf(serverPid)
	if !ok {
		return nothing, "default weight: the server's cpu cgroup is unknown"
	}
	if !strings.HasPrefix(filepath.Base(server.rel), "sloserve-") || !strings.HasSuffix(server.rel, "-server") {
		return nothing, "default weight: the server has no cpu cgroup of its own (no cgroup limiter)"
	}
	self, ok := cpuCgroupOf(os.Getpid())
	if !ok || self.mount != server.mount {
		return nothing, "default weight: this process's cpu cgroup is unknown"
	}
	weight, err := os.ReadFile(filepath.Join(server.dir(), server.weightFile()))
	if err != nil {
		return nothing, fmt.Sprintf("default weight: %v", err)
	}
	dir := filepath.Join(filepath.Dir(server.dir()), "sloserve-"+strconv.Itoa(os.Getpid())+"-loadtest")
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nothing, fmt.Sprintf("default weight: %v", err)
	}
	pid := []byte(strconv.Itoa(os.Getpid()))
	back := func() error {
		err := os.WriteFile(filepath.Join(self.dir(), "cgroup.procs"), pid, 0)
		return errors.Join(err, os.Remove(dir))
	}
	if err := os.WriteFile(filepath.Join(dir, server.weightFile()), bytes.TrimSpace(weight), 0); err != nil {
		back()
		return nothing, fmt.Sprintf("default weight: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), pid, 0); err != nil {
		back()
		return nothing, fmt.Sprintf("default weight: %v", err)
	}
	return back, fmt.Sprintf("%s %s in %s, beside the server's %s", server.weightFile(), bytes.TrimSpace(weight), dir, server.dir())
}

// cpuCgroup is where a process's cpu cgroup is: the hierarchy's mount
// and the path in it.
type cpuCgroup struct {
	mount, rel string
	v2         bool
}

func (c cpuCgroup) dir() string { return filepath.Join(c.mount, c.rel) }

func (c cpuCgroup) weightFile() string {
	if c.v2 {
		return "cpu.weight"
	}
	return "cpu.shares"
}

// cpuCgroupOf reads /proc/<pid>/cgroup: the v1 hierarchy holding the cpu
// controller where there is one, else the v2 one.
func cpuCgroupOf(pid int) (cpuCgroup, bool) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cgroup"))
	if err != nil {
		return cpuCgroup{}, false
	}
	return parseCPUCgroup(b, "/sys/fs/cgroup", func(p string) bool {
		_, err := os.Stat(p)
		return err == nil
	})
}

// parseCPUCgroup finds the cpu cgroup in a /proc/<pid>/cgroup file's
// contents, with cgroup file systems under root (exists says whether a
// path is there: a v1 hierarchy is mounted under its controllers' names).
func parseCPUCgroup(b []byte, root string, exists func(string) bool) (cpuCgroup, bool) {
	var v2 string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		id, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		ctrls, path, ok := strings.Cut(rest, ":")
		if !ok {
			continue
		}
		if id == "0" && ctrls == "" {
			v2 = path
			continue
		}
		names := strings.Split(ctrls, ",")
		if !slices.Contains(names, "cpu") {
			continue
		}
		for _, m := range []string{ctrls, "cpu"} {
			if mount := filepath.Join(root, m); exists(filepath.Join(mount, "cpu.shares")) {
				return cpuCgroup{mount: mount, rel: path}, true
			}
		}
		return cpuCgroup{}, false
	}
	if v2 != "" && exists(filepath.Join(root, "cgroup.controllers")) {
		return cpuCgroup{mount: root, rel: v2, v2: true}, true
	}
	return cpuCgroup{}, false
}
