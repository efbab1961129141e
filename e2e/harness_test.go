package e2e

// End-to-end tests: the real sloserve binary, started as a separate process
// with the real ONNX Runtime and real models, driven over real sockets.

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
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

// repoModel is one model folder of a test repository.
type repoModel struct {
	name   string
	file   string // absolute path of the .onnx file
	config string // config.yaml without the name line
}

func testModel(t testing.TB, file string) string {
	return filepath.Join(need(t, "SLOSERVE_TESTMODELS"), file)
}

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

// freePort asks the kernel for an unused loopback port.
func freePort(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
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

type testServer struct {
	cmd         *exec.Cmd
	client      *http.Client // for http; TLS-aware when the server speaks TLS
	http        string       // base URL
	grpcAddr    string
	metrics     string // base URL
	log         *syncBuffer
	configPath  string // the --config file
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
}

type serverOption func(*serverSetup)

// withSet passes "key=value" overrides with --set, for keys of the sections
// the config already has (runtime, limits).
func withSet(kv ...string) serverOption {
	return func(s *serverSetup) { s.sets = append(s.sets, kv...) }
}

// startServer runs `sloserve serve` on free ports with the given extra
// config (YAML lines) and waits until it is ready.
func startServer(t testing.TB, repo string, extra string, opts ...serverOption) *testServer {
	t.Helper()
	lib := need(t, "SLOSERVE_ONNXRUNTIME_LIBRARY")
	s := &testServer{client: http.DefaultClient}
	for _, o := range opts {
		o(&s.setup)
	}
	httpAddr, grpcAddr, metricsAddr := freePort(t), freePort(t), freePort(t)
	listenAt := func(addr string) string {
		if s.setup.listenHost == "" {
			return addr
		}
		_, port, _ := net.SplitHostPort(addr)
		return net.JoinHostPort(s.setup.listenHost, port)
	}
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
	args := []string{"serve", "--config", s.configPath, "--log-level", "debug"}
	for _, kv := range s.setup.sets {
		args = append(args, "--set", kv)
	}
	s.cmd = exec.Command(sloserveBin, args...)
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	cmd, log, waitErr := s.cmd, s.log, s.waitErr
	go func() { waitErr <- cmd.Wait() }()
	t.Cleanup(func() {
		if s.cmd == cmd {
			if err := s.stop(); err != nil {
				t.Errorf("server exit: %v\n%s", err, log.String())
			}
		}
		if t.Failed() {
			t.Logf("server log (pid %d):\n%s", cmd.Process.Pid, log.String())
		}
	})
	deadline := time.Now().Add(90 * time.Second)
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
func (s *testServer) kill(t testing.TB) {
	t.Helper()
	s.stoppedOnce.Do(func() {
		if err := s.cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		<-s.waitErr
	})
}

// stop sends SIGTERM and waits for a clean exit.
func (s *testServer) stop() error {
	var err error
	s.stoppedOnce.Do(func() {
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err = <-s.waitErr:
		case <-time.After(30 * time.Second):
			_ = s.cmd.Process.Kill()
			err = fmt.Errorf("server did not stop within 30s of SIGTERM")
		}
	})
	return err
}

// do sends a request and returns status and body.
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

// runnerPids lists the server's child processes whose command line holds
// substr (the model file path), read from /proc.
func (s *testServer) runnerPids(t testing.TB, substr string) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
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
		f := strings.Fields(string(stat[i+1:]))
		if len(f) < 2 || f[1] != strconv.Itoa(s.cmd.Process.Pid) {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if bytes.Contains(cmdline, []byte(substr)) {
			pids = append(pids, pid)
		}
	}
	return pids
}

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
