package runtime

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// monoClockChild makes the test binary print its monoNanos and exit.
const monoClockChild = "monoclock"

// The mailbox's stamps are read by another process than the one that
// wrote them: a child process's monoNanos falls between the parent's
// readings before it started and after it ended, and the clock counts
// time as time.Since does.
func TestMonoNanosIsOneClockAcrossProcesses(t *testing.T) {
	for range 3 {
		before := monoNanos()
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), runnerChildEnv+"="+monoClockChild)
		out, err := cmd.Output()
		after := monoNanos()
		if err != nil {
			t.Fatalf("child: %v", err)
		}
		child, err := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64)
		if err != nil {
			t.Fatalf("child printed %q: %v", out, err)
		}
		if child < before || child > after {
			t.Errorf("the child read %d, outside the parent's %d .. %d", child, before, after)
		}
	}
	// Read inside time.Now's pair, monoNanos counts at least the sleep and
	// at most what time.Since counts around it.
	t0 := time.Now()
	start := monoNanos()
	time.Sleep(20 * time.Millisecond)
	got := time.Duration(monoNanos() - start)
	if want := time.Since(t0); got < 20*time.Millisecond || got > want {
		t.Errorf("monoNanos counted %v over a sleep of 20ms that time.Since counted as %v", got, want)
	}
}
