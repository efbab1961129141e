package runtime

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

func TestParseProcStat(t *testing.T) {
	// The command name may hold spaces and parentheses.
	stat := "4242 (my (odd) cmd) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 125 0 0 20 0 9 0 12345 1000000 500 18446744073709551615\n"
	got, err := parseProcStat([]byte(stat))
	if err != nil {
		t.Fatal(err)
	}
	if got != 3.75 {
		t.Errorf("cpu = %v s, want 3.75 (375 ticks)", got)
	}
	if _, err := parseProcStat([]byte("4242 (x) S 1 2")); err == nil {
		t.Error("short stat accepted")
	}
	if _, err := parseProcStat([]byte("garbage")); err == nil {
		t.Error("stat without command accepted")
	}
	pages, err := parseProcStatm([]byte("2000 512 100 10 0 300 0\n"))
	if err != nil || pages != 512 {
		t.Errorf("statm resident = %d, %v; want 512", pages, err)
	}
}

func TestProcUsageSelf(t *testing.T) {
	cpu, rss, err := procUsage(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if cpu < 0 || rss < 1<<20 {
		t.Errorf("usage of the test process = %v s, %d bytes", cpu, rss)
	}
}

func TestStripANSI(t *testing.T) {
	for in, want := range map[string]string{
		"plain":                           "plain",
		"\x1b[1;31m2026 [E:onnx] x\x1b[m": "2026 [E:onnx] x",
		"\x1b[m":                          "",
		"cut \x1b[1":                      "cut \x1b[1",
	} {
		if got := stripANSI(in); got != want {
			t.Errorf("stripANSI(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestOutputLog(t *testing.T) {
	var logged strings.Builder
	o := newOutputLog(slog.New(slog.NewTextHandler(&logged, nil)), 3)
	out, errw := o.writer("stdout"), o.writer("stderr")
	fmt.Fprint(out, "one\ntw")
	fmt.Fprint(out, "o\nthree\n")
	fmt.Fprint(errw, "four\nfive")
	o.flush()
	if got, want := o.Tail(10), "three\nfour\nfive"; got != want {
		t.Errorf("Tail(10) = %q, want %q", got, want)
	}
	if got, want := o.Tail(1), "five"; got != want {
		t.Errorf("Tail(1) = %q, want %q", got, want)
	}
	for _, want := range []string{"stream=stdout line=two", "stream=stderr line=five"} {
		if !strings.Contains(logged.String(), want) {
			t.Errorf("log lacks %q:\n%s", want, logged.String())
		}
	}
}

// The runner joins the configured cgroups before it loads the model: it
// writes its pid to each file, and a file it cannot write fails the start
// with the path in the error. Plain files stand in for cgroup.procs here;
// the limiter package tests the real thing.
func TestRunnerJoinCgroups(t *testing.T) {
	dir := t.TempDir()
	procs := []string{filepath.Join(dir, "cpu.procs"), filepath.Join(dir, "memory.procs")}
	for _, p := range procs {
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	cfg.JoinCgroups = procs
	r := startTestRunner(t, cfg)
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := string(b), strconv.Itoa(r.Pid()); got != want {
			t.Errorf("%s holds %q, want the runner's pid %s", p, got, want)
		}
	}

	cfg = testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	missing := filepath.Join(dir, "gone", "cgroup.procs")
	cfg.JoinCgroups = []string{missing}
	if r, err := StartRunner(t.Context(), cfg); err == nil {
		r.Stop(t.Context())
		t.Fatal("runner started although it could not join its cgroup")
	} else if !strings.Contains(err.Error(), "join cgroup") || !strings.Contains(err.Error(), missing) {
		t.Errorf("start error = %v, want it to name the cgroup file", err)
	}
}

func TestJoinCgroupFlags(t *testing.T) {
	args := []string{"--socket", "/tmp/s", "--model", "m.onnx", "--library", "lib.so",
		"--join-cgroup", "/a/cgroup.procs", "--join-cgroup", "/b/cgroup.procs"}
	f, err := parseRunnerFlags(args)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"/a/cgroup.procs", "/b/cgroup.procs"}; !slices.Equal(f.cgroups, want) {
		t.Errorf("cgroups = %q, want %q", f.cgroups, want)
	}
	if _, err := parseRunnerFlags(append(args, "--join-cgroup", "")); err == nil {
		t.Error("empty --join-cgroup accepted")
	}
}
