package runtime

import (
	"fmt"
	"log/slog"
	"os"
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
