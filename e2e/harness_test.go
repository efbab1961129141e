package e2e

// The harness every end-to-end test and benchmark of this package uses. It
// owns the built binary, the environment checks, the model repositories,
// starting and stopping servers, the clients, and waiting.
//
// A new end-to-end test in ten lines:
//
//	func TestE2ESomething(t *testing.T) {
//		repo := t.TempDir()
//		writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
//		s := startServer(t, repo, "") // free ports, waits for ready; stopped and checked at cleanup
//		code, body, _ := s.do(t, "POST", "/v2/models/dyn/infer", dynBody)
//		if code != 200 {
//			t.Fatalf("infer: %d %s", code, body)
//		}
//	}
//
// What the harness gives:
//   - sloserveBin: the binary TestMain built once; runSloserve runs a
//     one-shot subcommand of it (loadtest, profile, version).
//   - need, skipUnless, requireChromium, needPrometheus, requireCgroups:
//     skip a test for want of something the machine lacks, or fail it
//     where `make test` sets SLOSERVE_REQUIRE_*.
//   - writeRepo, addModel, testModel, demoModel: a model repository in a
//     temporary folder, model files symlinked.
//   - startServer(t, repo, extraYAML, options...): `sloserve serve` on free
//     loopback ports with a config file, ready to use. Options: withSet
//     (--set overrides), withCommandLine (no config file: flags only, run
//     in a folder); the TLS fields of serverSetup for secured servers.
//   - dynBody and grpcDynRequest: valid REST and gRPC inference requests
//     for a model "dyn" of example_dynamic_axes.onnx, as above.
//   - on the server: do and json (REST), grpc (a gRPC client), scrape and
//     metricValue (the metrics endpoint), runnerPids, logHas, kill, launch
//     (start again after kill), stop.
//   - teardown: at the test's cleanup the server gets SIGTERM and must exit
//     0 within 30 s (else it is killed and the test fails), and it must
//     leave nothing behind: no runner alive, no socket folder, no cgroup
//     folder. A failed test logs the server's whole output.
//   - waitFor: poll a condition with a timeout.
//
// Helpers for one topic (a load driver, a Prometheus server, a browser)
// live in that topic's file. A test written against the harness of old in
// cmd/sloserve (package main) moves here with `git mv` and its package
// clause changed to e2e: the names are the same.

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/sloserve/sloserve/api/inference"
)

// The binary.

// sloserveBin is the sloserve binary TestMain built for this run.
var sloserveBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "sloserve-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	sloserveBin = filepath.Join(dir, "sloserve")
	build := exec.Command("go", "build", "-o", sloserveBin, "github.com/sloserve/sloserve/cmd/sloserve")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building sloserve:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	if code == 0 {
		// The tests' own clients must not leak either: every server a
		// test starts is stopped, every stream closed. Idle keep-alive
		// connections of the shared client are closed first.
		http.DefaultClient.CloseIdleConnections()
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// runSloserve runs a one-shot subcommand of the binary (loadtest, profile,
// version) to its end and returns what it wrote; err is its exit error, nil
// when it exited 0.
func runSloserve(args ...string) (stdout, stderr string, err error) {
	cmd := exec.Command(sloserveBin, args...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	return out.String(), errOut.String(), err
}

// The environment.

// need returns the value of a required environment variable, or skips the
// test (fails it when SLOSERVE_REQUIRE_ORT=1, as `make test` sets).
func need(t testing.TB, env string) string {
	t.Helper()
	v := os.Getenv(env)
	if v == "" {
		skipUnless(t, "SLOSERVE_REQUIRE_ORT", env+" is not set; run the tests with `make test`")
	}
	return v
}

// skipUnless skips the test for want of something the machine lacks, or
// fails it when the environment variable require is 1: `make test` sets
// the SLOSERVE_REQUIRE_* variables where the project's set-up provides it.
func skipUnless(t testing.TB, require, msg string) {
	t.Helper()
	if os.Getenv(require) == "1" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

const chromiumPath = "/usr/bin/chromium"

// requireChromium skips the test when Debian's chromium is not installed,
// or fails it when SLOSERVE_REQUIRE_CHROMIUM=1 (as `make test` sets).
func requireChromium(t *testing.T) string {
	t.Helper()
	if _, err := os.Stat(chromiumPath); err != nil {
		msg := fmt.Sprintf("the browser tests need Debian's chromium at %s (apt-get install chromium): %v", chromiumPath, err)
		skipUnless(t, "SLOSERVE_REQUIRE_CHROMIUM", msg)
	}
	return chromiumPath
}

// needPrometheus finds the prometheus and promtool binaries, or skips;
// SLOSERVE_REQUIRE_PROMETHEUS=1 (set by `make test`) fails instead.
func needPrometheus(t *testing.T) (prometheus, promtool string) {
	t.Helper()
	var missing []string
	paths := map[string]string{}
	for _, name := range []string{"prometheus", "promtool"} {
		p, err := exec.LookPath(name)
		if err != nil {
			missing = append(missing, name)
		}
		paths[name] = p
	}
	if len(missing) > 0 {
		msg := fmt.Sprintf("%s not installed; `make test-tools` (scripts/install-test-tools.sh) installs the Debian package", strings.Join(missing, " and "))
		skipUnless(t, "SLOSERVE_REQUIRE_PROMETHEUS", msg)
	}
	return paths["prometheus"], paths["promtool"]
}

// requireCgroups skips (or, with SLOSERVE_REQUIRE_CGROUPS=1, fails) when
// the server could not use cgroups; c is its /v2/control (s.control).
func requireCgroups(t *testing.T, c controlJSON) {
	t.Helper()
	if len(c.Devices) == 0 {
		t.Fatal("no device in /v2/control")
	}
	if l := c.Devices[0].Limiter; !strings.HasPrefix(l, "cgroup") {
		msg := fmt.Sprintf("the server's limiter is %q, not cgroups: %s", l, c.Devices[0].Detail)
		skipUnless(t, "SLOSERVE_REQUIRE_CGROUPS", msg)
	}
}

// Model repositories.

// repoModel is one model folder of a test repository.
type repoModel struct {
	name   string
	file   string // absolute path of the .onnx file
	config string // config.yaml without the name line
}

// testModel is the path of one of the test networks (deps/testmodels).
func testModel(t testing.TB, file string) string {
	return filepath.Join(need(t, "SLOSERVE_TESTMODELS"), file)
}

// demoModel is the path of a demo model's version 1 (demo-repository).
func demoModel(t testing.TB, name string) string {
	return filepath.Join(need(t, "SLOSERVE_DEMO_REPOSITORY"), name, "1", "model.onnx")
}

// writeRepo builds a model repository; model files are symlinked.
func writeRepo(t testing.TB, dir string, ms ...repoModel) {
	t.Helper()
	for _, m := range ms {
		addModel(t, dir, m, 1)
	}
}

// addModel adds version of model m to a repository, writing its config.
func addModel(t testing.TB, repo string, m repoModel, version int) {
	t.Helper()
	vd := filepath.Join(repo, m.name, strconv.Itoa(version))
	if err := os.MkdirAll(vd, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(m.file); err != nil {
		t.Fatalf("model file: %v", err)
	}
	if err := os.Symlink(m.file, filepath.Join(vd, "model.onnx")); err != nil {
		t.Fatal(err)
	}
	cfg := "name: " + m.name + "\n" + m.config
	if err := os.WriteFile(filepath.Join(repo, m.name, "config.yaml"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
}

// Servers.

// freePort asks the kernel for an unused loopback port.
func freePort(t testing.TB) string {
	t.Helper()
	return freePorts(t, 1)[0]
}

// freePorts returns n distinct free loopback addresses: the listeners stay
// open until all n are taken, so the kernel cannot hand out one port twice
// (a server's HTTP and metrics listeners once got the same port).
func freePorts(t testing.TB, n int) []string {
	t.Helper()
	addrs := make([]string, n)
	for i := range addrs {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		addrs[i] = ln.Addr().String()
	}
	return addrs
}

// syncBuffer collects a process's output for failure messages.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// testServer is one sloserve server process a test started.
type testServer struct {
	cmd         *exec.Cmd
	client      *http.Client // for http; TLS-aware when the server speaks TLS
	http        string       // base URL
	grpcAddr    string
	metrics     string // base URL
	log         *syncBuffer
	configPath  string // the --config file; "" with withCommandLine
	config      string // what startServer wrote there
	setup       serverSetup
	creds       credentials.TransportCredentials // the gRPC client's
	grpc        inference.GRPCInferenceServiceClient
	waitErr     chan error
	stoppedOnce sync.Once
}

// serverSetup is how startServer starts and reaches a server; options
// change it.
type serverSetup struct {
	listenHost  string      // the host the server listens on; "": 127.0.0.1
	tls         *tls.Config // the clients' TLS config; nil: plain TCP
	readyHeader []string    // header name, value pairs for the readiness probe
	metricsTLS  bool        // the metrics listener speaks TLS too (tls.metrics)
	sets        []string    // "key=value" overrides passed with --set
	commandLine bool        // no config file: flags only (withCommandLine)
	args        []string    // flags after the listen addresses (withCommandLine)
	flags       []string    // more flags of serve, after the config file (withFlags)
	dir         string      // the server's working folder; "": the test's
	// bin, wrap and env run the server as `wrap... bin serve ...` with env
	// added to its environment (withCommand); "" and nil: sloserveBin as is.
	bin  string
	wrap []string
	env  []string
}

type serverOption func(*serverSetup)

// withSet passes "key=value" overrides with --set, for keys of the sections
// the config already has (runtime, limits).
func withSet(kv ...string) serverOption {
	return func(s *serverSetup) { s.sets = append(s.sets, kv...) }
}

// withFlags passes more flags to `sloserve serve`, after the config file.
func withFlags(args ...string) serverOption {
	return func(s *serverSetup) { s.flags = append(s.flags, args...) }
}

// withCommandLine starts the server without a config file, as a user
// would type it: `sloserve serve --http-addr ... --grpc-addr ...
// --metrics-addr ... args...` in the folder dir. startServer's repo and
// extra are then unused; the embedded default config applies.
func withCommandLine(dir string, args ...string) serverOption {
	return func(s *serverSetup) { s.commandLine, s.dir, s.args = true, dir, args }
}

// withCommand runs the server binary bin (the test's build when "")
// through the command wrap (setpriv, taskset; they exec it, so the pid is
// the server's) with env added to its environment.
func withCommand(bin string, wrap []string, env ...string) serverOption {
	return func(s *serverSetup) { s.bin, s.wrap, s.env = bin, wrap, env }
}

// startServer runs `sloserve serve` on free ports with the given extra
// config (YAML lines) and waits until it is ready. The test's cleanup stops
// it and checks that it left nothing behind (see stop).
func startServer(t testing.TB, repo string, extra string, opts ...serverOption) *testServer {
	t.Helper()
	lib := need(t, "SLOSERVE_ONNXRUNTIME_LIBRARY")
	s := &testServer{client: http.DefaultClient}
	for _, o := range opts {
		o(&s.setup)
	}
	ports := freePorts(t, 3)
	httpAddr, grpcAddr, metricsAddr := ports[0], ports[1], ports[2]
	listenAt := func(addr string) string {
		if s.setup.listenHost == "" {
			return addr
		}
		_, port, _ := net.SplitHostPort(addr)
		return net.JoinHostPort(s.setup.listenHost, port)
	}
	if s.setup.commandLine {
		s.setup.args = append([]string{"--http-addr", httpAddr, "--grpc-addr", grpcAddr, "--metrics-addr", metricsAddr}, s.setup.args...)
	} else {
		cfg := fmt.Sprintf(`listen: {http: %q, grpc: %q, metrics: %q}
repositories: [%q]
runtime:
  onnxruntime_library: %q
  restart_backoff_initial: 100ms
limits:
  grace_period: 10s
%s`, listenAt(httpAddr), listenAt(grpcAddr), listenAt(metricsAddr), repo, lib, extra)
		cfgPath := filepath.Join(t.TempDir(), "server.yaml")
		if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
		s.configPath, s.config = cfgPath, cfg
	}
	s.http, s.grpcAddr, s.metrics = "http://"+httpAddr, grpcAddr, "http://"+metricsAddr
	s.creds = insecure.NewCredentials()
	if s.setup.tls != nil {
		s.client = &http.Client{Transport: &http.Transport{TLSClientConfig: s.setup.tls, ForceAttemptHTTP2: true}}
		s.http = "https://" + httpAddr
		if s.setup.metricsTLS {
			s.metrics = "https://" + metricsAddr
		}
		s.creds = credentials.NewTLS(s.setup.tls)
		t.Cleanup(s.client.CloseIdleConnections)
	}
	s.launch(t)
	return s
}

// launch starts the binary on s's config file and waits until it is ready.
// A server killed with kill may be launched again on the same config.
func (s *testServer) launch(t testing.TB) {
	t.Helper()
	s.log, s.waitErr, s.stoppedOnce = &syncBuffer{}, make(chan error, 1), sync.Once{}
	args := []string{"serve"}
	if s.setup.commandLine {
		args = append(args, s.setup.args...)
	} else {
		args = append(args, "--config", s.configPath, "--log-level", "debug")
		args = append(args, s.setup.flags...)
	}
	for _, kv := range s.setup.sets {
		args = append(args, "--set", kv)
	}
	bin := sloserveBin
	if s.setup.bin != "" {
		bin = s.setup.bin
	}
	argv := append(append(slices.Clone(s.setup.wrap), bin), args...)
	s.cmd = exec.Command(argv[0], argv[1:]...)
	s.cmd.Dir = s.setup.dir
	if len(s.setup.env) > 0 {
		s.cmd.Env = append(os.Environ(), s.setup.env...)
	}
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	cmd, log, waitErr := s.cmd, s.log, s.waitErr
	go func() { waitErr <- cmd.Wait() }()
	t.Cleanup(func() {
		if s.cmd == cmd {
			if err := s.stop(); err != nil {
				t.Errorf("server exit: %v", err)
			}
		}
		if t.Failed() {
			t.Logf("server log (pid %d):\n%s", cmd.Process.Pid, log.String())
		}
	})
	deadline := time.Now().Add(120 * time.Second)
	for {
		req, err := http.NewRequest("GET", s.http+"/v2/health/ready", nil)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i+1 < len(s.setup.readyHeader); i += 2 {
			req.Header.Set(s.setup.readyHeader[i], s.setup.readyHeader[i+1])
		}
		resp, err := s.client.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				break
			}
		}
		select {
		case err := <-waitErr:
			waitErr <- err
			t.Fatalf("server exited before ready: %v\n%s", err, log.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("server not ready in time\n%s", log.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	conn, err := grpc.NewClient(s.grpcAddr, grpc.WithTransportCredentials(s.creds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	s.grpc = inference.NewGRPCInferenceServiceClient(conn)
}

// kill ends the server with SIGKILL, as a crash would, and waits for it.
// What it leaves behind is the next server's to clean up, not checked.
func (s *testServer) kill(t testing.TB) {
	t.Helper()
	s.stoppedOnce.Do(func() {
		if err := s.cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		<-s.waitErr
	})
}

// stop sends SIGTERM and waits for a clean exit: exit status 0 within 30 s
// (else the server is killed), and nothing left behind: the runners it had
// have exited, its runner socket folder ($TMPDIR/sloserve-<pid>-*) and its
// sloserve-<pid> cgroup folders are gone. The test's cleanup calls it; a
// test may call it earlier to check the shutdown itself.
func (s *testServer) stop() error {
	var err error
	s.stoppedOnce.Do(func() {
		pid := s.cmd.Process.Pid
		runners := s.children()
		cgroups := cgroupDirs(pid)
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err = <-s.waitErr:
		case <-time.After(30 * time.Second):
			_ = s.cmd.Process.Kill()
			err = fmt.Errorf("server did not stop within 30s of SIGTERM")
		}
		if err == nil {
			err = leftBehind(pid, runners, cgroups)
		}
	})
	return err
}

// leftBehind waits a little for what a server that exited cleanly must
// have removed, and says what remains.
func leftBehind(pid int, runners []int, cgroups []string) error {
	var left []string
	deadline := time.Now().Add(10 * time.Second)
	for {
		left = left[:0]
		for _, r := range runners {
			if alive(r) {
				left = append(left, fmt.Sprintf("runner %d alive", r))
			}
		}
		sockets, _ := filepath.Glob(filepath.Join(os.TempDir(), fmt.Sprintf("sloserve-%d-*", pid)))
		for _, d := range append(sockets, cgroups...) {
			if _, err := os.Stat(d); err == nil {
				left = append(left, d)
			}
		}
		if len(left) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("the server exited but left behind: " + strings.Join(left, ", "))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Processes and cgroups.

// runnerPids lists the server's child processes whose command line holds
// substr (the model file path), read from /proc.
func (s *testServer) runnerPids(t testing.TB, substr string) []int {
	t.Helper()
	var pids []int
	for _, pid := range s.children() {
		cmdline, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
		if bytes.Contains(cmdline, []byte(substr)) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// children lists the server's child processes (its runners), from /proc.
func (s *testServer) children() []int {
	entries, _ := os.ReadDir("/proc")
	parent := strconv.Itoa(s.cmd.Process.Pid)
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// The fields after the command name, which is in parentheses.
		i := bytes.LastIndexByte(stat, ')')
		if i < 0 {
			continue
		}
		if f := strings.Fields(string(stat[i+1:])); len(f) >= 2 && f[1] == parent {
			pids = append(pids, pid)
		}
	}
	return pids
}

// alive reports whether a process exists and is not a zombie.
func alive(pid int) bool {
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(stat, ')')
	return i < 0 || i+2 >= len(stat) || stat[i+2] != 'Z'
}

func anyAlive(pids []int) bool { return slices.ContainsFunc(pids, alive) }

// serverCgroups lists the sloserve-<pid> cgroup folders of a server, in
// every hierarchy it has one; a server without one fails the test.
func serverCgroups(t *testing.T, pid int) []string {
	t.Helper()
	dirs := cgroupDirs(pid)
	if len(dirs) == 0 {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		t.Fatalf("no sloserve-%d cgroup folder found from /proc/%d/cgroup:\n%s", pid, pid, b)
	}
	return dirs
}

// cgroupDirs lists the sloserve-<pid> cgroup folders of a running server
// (none when it uses no cgroups), and the sloserve-<pid>-server folder it
// lives in (the cpu hierarchy's, beside its units' parent).
func cgroupDirs(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return nil
	}
	var dirs []string
	for line := range strings.SplitSeq(strings.TrimSpace(string(b)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		for _, ctrl := range strings.Split(parts[1], ",") {
			if ctrl == "" {
				continue
			}
			own, mine := parts[2], []string{fmt.Sprintf("sloserve-%d", pid)}
			if path.Base(own) == fmt.Sprintf("sloserve-%d-server", pid) {
				own, mine = path.Dir(own), append(mine, path.Base(own))
			}
			for _, m := range mine {
				real, err := filepath.EvalSymlinks(filepath.Join("/sys/fs/cgroup", ctrl, own, m))
				if err == nil && !slices.Contains(dirs, real) {
					dirs = append(dirs, real)
				}
			}
		}
	}
	return dirs
}

// requireServerCgroup checks that a running server on cgroups lives in
// sloserve-<pid>-server of the cpu hierarchy, beside its units' parent
// and at that parent's weight.
func requireServerCgroup(t *testing.T, pid int) {
	t.Helper()
	dir, v2 := cpuDir(t, pid)
	weight := "cpu.shares"
	if v2 {
		weight = "cpu.weight"
	}
	if want := fmt.Sprintf("sloserve-%d-server", pid); filepath.Base(dir) != want {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		t.Fatalf("server %d: cpu cgroup %s, want its own %s (/proc/%d/cgroup:\n%s)", pid, dir, want, pid, b)
	}
	units := filepath.Join(filepath.Dir(dir), fmt.Sprintf("sloserve-%d", pid))
	w1, err1 := os.ReadFile(filepath.Join(dir, weight))
	w2, err2 := os.ReadFile(filepath.Join(units, weight))
	if err1 != nil || err2 != nil || strings.TrimSpace(string(w1)) != strings.TrimSpace(string(w2)) {
		t.Errorf("server %d: %s %q (%v), units' parent %q (%v); want the same weight", pid, weight, w1, err1, w2, err2)
	}
}

// Clients.

// do sends a request and returns status and body. header holds name, value
// pairs; "Host" sets the request's host.
func (s *testServer) do(t *testing.T, method, path string, body []byte, header ...string) (int, []byte, http.Header) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, s.http+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		if header[i] == "Host" {
			req.Host = header[i+1]
			continue
		}
		req.Header.Set(header[i], header[i+1])
	}
	if body != nil && req.Header.Get("Content-Type") == "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := s.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b, resp.Header
}

// json sends body as JSON (none when nil), decodes the answer into out
// (when not nil) and returns the status.
func (s *testServer) json(t *testing.T, method, path string, body any, out any) int {
	t.Helper()
	var raw []byte
	if body != nil {
		var err error
		if raw, err = json.Marshal(body); err != nil {
			t.Fatal(err)
		}
	}
	code, b, _ := s.do(t, method, path, raw)
	if out != nil && len(b) > 0 {
		if err := json.Unmarshal(b, out); err != nil {
			t.Fatalf("%s %s: decoding %q: %v", method, path, b, err)
		}
	}
	return code
}

// logHas reports whether one line of the server log holds every substring.
func (s *testServer) logHas(subs ...string) bool {
	for line := range strings.SplitSeq(s.log.String(), "\n") {
		all := true
		for _, sub := range subs {
			if !strings.Contains(line, sub) {
				all = false
				break
			}
		}
		if all {
			return true
		}
	}
	return false
}

// Requests for the test networks.

// dynBody is a valid REST inference request for a "dyn" model of
// example_dynamic_axes.onnx: one row of 10.
var dynBody = []byte(`{"inputs":[{"name":"input_vectors","datatype":"FP32","shape":[1,10],"data":[1,2,3,4,5,6,7,8,9,10]}]}`)

// grpcDynRequest is a valid request for the dyn model: one row of 10.
func grpcDynRequest() *inference.ModelInferRequest {
	return &inference.ModelInferRequest{ModelName: "dyn", Inputs: []*inference.ModelInferRequest_InferInputTensor{{
		Name: "input_vectors", Datatype: "FP32", Shape: []int64{1, 10},
		Contents: &inference.InferTensorContents{Fp32Contents: []float32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}},
	}}}
}

// Metrics.

// scrape reads every series of the metrics endpoint, keyed by its name and
// labels as exposed.
func (s *testServer) scrape(tb testing.TB) map[string]float64 {
	tb.Helper()
	series, err := s.scrapeMetrics()
	if err != nil {
		tb.Fatal(err)
	}
	return series
}

// scrapeMetrics is scrape for goroutines other than the test's, which must
// not call Fatal.
func (s *testServer) scrapeMetrics() (map[string]float64, error) {
	resp, err := s.client.Get(s.metrics + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	series := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		i := strings.LastIndexByte(line, ' ')
		if strings.HasPrefix(line, "#") || i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			return nil, fmt.Errorf("metric %s: %w", line, err)
		}
		series[line[:i]] = v
	}
	return series, sc.Err()
}

// metricValue scrapes the metrics endpoint for one series' value.
func (s *testServer) metricValue(tb testing.TB, series string) (float64, bool) {
	tb.Helper()
	v, ok := s.scrape(tb)[series]
	return v, ok
}

// slowClients is the series of sloserve_slow_clients_total for protocol
// and limit, as the metrics listener writes it.
func slowClients(protocol, limit string) string {
	return fmt.Sprintf(`sloserve_slow_clients_total{limit=%q,protocol=%q}`, limit, protocol)
}

// Waiting.

// waitFor polls cond every 50 ms until it holds, or fails the test after
// timeout.
func waitFor(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// startTool starts a helper program (a collector, a Prometheus) in a
// process group of its own, and stops the group when the test ends:
// SIGTERM, then SIGKILL after 10 s. Its log is printed if the test failed.
// The returned channel is closed when the program has exited, with its
// exit error in *exitErr.
func startTool(t *testing.T, name string, cmd *exec.Cmd, log *syncBuffer) (exited <-chan struct{}, exitErr *error) {
	t.Helper()
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done, werr := make(chan struct{}), new(error)
	go func() { *werr = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
		if t.Failed() {
			t.Logf("%s log:\n%s", name, log.String())
		}
	})
	return done, werr
}
