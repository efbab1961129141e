package runtime

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// runnerChildEnv makes the test binary act as a runner process.
const runnerChildEnv = "SLOSERVE_RUNNER_CHILD"

func TestMain(m *testing.M) {
	switch os.Getenv(runnerChildEnv) {
	case "1":
		os.Exit(runChild())
	case describeFailsChild:
		os.Exit(runDescribeFailsChild())
	case describeOnceLostChild:
		os.Exit(runDescribeOnceLostChild())
	case monoClockChild:
		fmt.Println(monoNanos())
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

// runChild is the test binary's stand-in for `sloserve runner`.
func runChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	args := os.Args[1:]
	if len(args) > 0 && args[0] == "runner" {
		args = args[1:]
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil)).With("pid", os.Getpid())
	if err := RunnerMain(ctx, args, logger); err != nil {
		fmt.Fprintf(os.Stderr, "sloserve runner: %v\n", err)
		return 1
	}
	return 0
}

// describeFailsChild makes the test binary a runner that serves gRPC on
// its socket but not the runner service: Describe fails at once
// (Unimplemented), with the process alive.
const describeFailsChild = "describe-fails"

func runDescribeFailsChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var socket string
	for i, a := range os.Args {
		if a == "--socket" && i+1 < len(os.Args) {
			socket = os.Args[i+1]
		}
	}
	lis, err := net.Listen("unix", socket)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	srv := grpc.NewServer()
	go func() {
		<-ctx.Done()
		srv.Stop()
	}()
	_ = srv.Serve(lis)
	return 0
}

// describeOnceLostChild makes the test binary a runner whose first
// Describe loses its connection: the server is stopped under the call,
// as a connection closed by the client would end it, and a new one then
// answers on the same socket. It holds its call stream open and ends on
// SIGTERM.
const describeOnceLostChild = "describe-once-lost"

type onceLostRunner struct {
	runnerpb.UnimplementedRunnerServer
	asked atomic.Bool
	held  chan struct{} // closed when the first Describe arrives
}

func (s *onceLostRunner) Describe(ctx context.Context, _ *runnerpb.DescribeRequest) (*runnerpb.DescribeResponse, error) {
	if s.asked.CompareAndSwap(false, true) {
		close(s.held)
		<-ctx.Done() // until the server stops under the call
		return nil, ctx.Err()
	}
	return &runnerpb.DescribeResponse{OnnxruntimeVersion: "test", Provider: "cpu"}, nil
}

func runDescribeOnceLostChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var socket string
	for i, a := range os.Args {
		if a == "--socket" && i+1 < len(os.Args) {
			socket = os.Args[i+1]
		}
	}
	svc := &onceLostRunner{held: make(chan struct{})}
	serve := func() (*grpc.Server, error) {
		_ = os.Remove(socket)
		lis, err := net.Listen("unix", socket)
		if err != nil {
			return nil, err
		}
		srv := grpc.NewServer()
		runnerpb.RegisterRunnerServer(srv, svc)
		go srv.Serve(lis)
		return srv, nil
	}
	srv, err := serve()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	select {
	case <-svc.held:
	case <-ctx.Done():
		srv.Stop()
		return 0
	}
	srv.Stop() // closes the connection under the first call
	if srv, err = serve(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	<-ctx.Done()
	srv.Stop()
	return 0
}

// skipWithoutORT skips a test that needs ONNX Runtime or its test models,
// or fails it when SLOSERVE_REQUIRE_ORT=1 (as `make test` sets).
func skipWithoutORT(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv("SLOSERVE_REQUIRE_ORT") == "1" {
		t.Fatalf("%s, and SLOSERVE_REQUIRE_ORT=1 demands it (run `make setup`)", msg)
	}
	t.Skipf("%s; run `make setup` or set the variable to run this test", msg)
}

// ortLibrary is the ONNX Runtime library for tests: $SLOSERVE_ONNXRUNTIME_LIBRARY,
// else the one `make setup` fetches.
func ortLibrary(t testing.TB) string {
	t.Helper()
	if p := os.Getenv("SLOSERVE_ONNXRUNTIME_LIBRARY"); p != "" {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("SLOSERVE_ONNXRUNTIME_LIBRARY: %v", err)
		}
		return p
	}
	p, err := filepath.Abs(filepath.Join("..", "deps", "onnxruntime", "libonnxruntime.so.1.30.0"))
	if err == nil {
		if _, err = os.Stat(p); err == nil {
			return p
		}
	}
	skipWithoutORT(t, "no ONNX Runtime library: SLOSERVE_ONNXRUNTIME_LIBRARY is unset and %s is missing", p)
	return ""
}

// testModel finds a test network in $SLOSERVE_TESTMODELS, else in the
// folder `make setup` fills, else in the onnxruntime_go module's test_data.
func testModel(t testing.TB, name string) string {
	t.Helper()
	var dirs []string
	if d := os.Getenv("SLOSERVE_TESTMODELS"); d != "" {
		dirs = append(dirs, d)
	} else {
		dirs = append(dirs, filepath.Join("..", "deps", "testmodels"))
	}
	dirs = append(dirs, moduleTestData())
	for _, d := range dirs {
		if d == "" {
			continue
		}
		p, err := filepath.Abs(filepath.Join(d, name))
		if err != nil {
			continue
		}
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	skipWithoutORT(t, "test model %s not found in %q", name, dirs)
	return ""
}

var moduleTestData = sync.OnceValue(func() string {
	cache := os.Getenv("GOMODCACHE")
	if cache == "" {
		out, err := exec.Command("go", "env", "GOMODCACHE").Output()
		if err != nil {
			return ""
		}
		cache = strings.TrimSpace(string(out))
	}
	return filepath.Join(cache, "github.com", "yalue", "onnxruntime_go@v1.27.0", "test_data")
})

// testLogger logs into the test's output, shown with -v or on failure.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// testRunnerConfig runs the test binary itself as the runner child.
func testRunnerConfig(t testing.TB, model string) RunnerConfig {
	t.Helper()
	return RunnerConfig{
		Name:       "test/" + strings.TrimSuffix(filepath.Base(model), ".onnx"),
		ModelPath:  model,
		Library:    ortLibrary(t),
		Executable: os.Args[0],
		// The race detector's default 1 s pause at exit would slow every stop.
		Env:            []string{runnerChildEnv + "=1", "GORACE=atexit_sleep_ms=0"},
		SocketDir:      t.TempDir(),
		Provider:       ProviderOptions{IntraOpThreads: 1, InterOpThreads: 1},
		ReadyTimeout:   30 * time.Second,
		HealthInterval: time.Second,
		BackoffInitial: 50 * time.Millisecond,
		BackoffMax:     200 * time.Millisecond,
		MaxRestarts:    3,
		Logger:         testLogger(t),
	}
}

// startTestRunner starts a runner and stops it when the test ends.
func startTestRunner(t testing.TB, cfg RunnerConfig) *Runner {
	t.Helper()
	r, err := StartRunner(t.Context(), cfg)
	if err != nil {
		t.Fatalf("StartRunner: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := r.Stop(ctx); err != nil {
			t.Errorf("Stop: %v", err)
		}
	})
	return r
}

// waitFor polls cond until it holds or the timeout passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// processGone reports whether pid no longer exists (reaped, not a zombie).
func processGone(pid int) bool {
	return syscall.Kill(pid, 0) == syscall.ESRCH
}

// freeze stops pid with SIGSTOP and waits until every thread has stopped, so
// a call sent next cannot be answered before the stop takes hold.
func freeze(t testing.TB, pid int) {
	t.Helper()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the runner to stop", func() bool { return allThreadsStopped(pid) })
}

// allThreadsStopped reports whether every thread of pid is stopped by a
// signal: kill(SIGSTOP) returns before the threads actually stop.
func allThreadsStopped(pid int) bool {
	stats, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
	for _, path := range stats {
		b, err := os.ReadFile(path)
		if err != nil {
			return false
		}
		i := strings.LastIndexByte(string(b), ')')
		if i < 0 || i+2 >= len(b) || b[i+2] != 'T' {
			return false
		}
	}
	return len(stats) > 0
}
