package rungroup

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// trace records what happened, in order.
type trace struct {
	mu  sync.Mutex
	got []string
}

func (t *trace) add(s string) { t.mu.Lock(); t.got = append(t.got, s); t.mu.Unlock() }
func (t *trace) list() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Clone(t.got)
}

// blocker is an actor that runs until interrupted.
func blocker(tr *trace, name string) (string, func() error, func(context.Context, error)) {
	stop := make(chan struct{})
	return name, func() error {
			<-stop
			tr.add(name + " returned")
			return nil
		}, func(context.Context, error) {
			tr.add(name + " interrupted")
			close(stop) // a second call would panic
		}
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// The end of Run's context stops the phases in the order they were
// added: each phase's actors first (interrupted, then returned), then its
// steps in order; no actor of a later phase is interrupted before an
// earlier phase's steps are done.
func TestPhasesStopInOrder(t *testing.T) {
	tr := &trace{}
	g := New(quiet())
	drain := g.Phase("drain", nil)
	drain.Add(blocker(tr, "rest"))
	drain.Do("stopping", func(context.Context, error) { tr.add("stopping") })
	loads := g.Phase("stop loads", nil)
	loads.Add(blocker(tr, "loads"))
	loads.Do("registry", func(context.Context, error) { tr.add("registry stopped") })
	loads.Do("metrics", func(context.Context, error) { tr.add("metrics closed") })
	loops := g.Phase("stop loops", nil)
	loops.Add(blocker(tr, "loops"))

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error)
	go func() { done <- g.Run(ctx) }()
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v, want nil when its context ends", err)
	}
	want := []string{
		"rest interrupted", "rest returned", "stopping",
		"loads interrupted", "loads returned", "registry stopped", "metrics closed",
		"loops interrupted", "loops returned",
	}
	if got := tr.list(); !slices.Equal(got, want) {
		t.Errorf("order\n got %q\nwant %q", got, want)
	}
}

// An actor that fails ends the run: Run returns its error, every actor's
// interrupt runs once (the failed one's too, so it can release what it
// holds), and every step sees the error as the cause.
func TestErrorEndsRunAndInterruptsAll(t *testing.T) {
	tr := &trace{}
	g := New(quiet())
	boom := errors.New("listen: address in use")
	var interrupts sync.Map
	count := func(name string) {
		n, _ := interrupts.LoadOrStore(name, new(int))
		*n.(*int)++
	}
	first := g.Phase("first", nil)
	first.Add("grpc", func() error { return boom }, func(context.Context, error) { count("grpc") })
	_, exec, intr := blocker(tr, "rest")
	first.Add("rest", exec, func(ctx context.Context, c error) { count("rest"); intr(ctx, c) })
	var causes []error
	first.Do("delay", func(_ context.Context, c error) { causes = append(causes, c) })
	second := g.Phase("second", nil)
	_, exec2, intr2 := blocker(tr, "loops")
	second.Add("loops", exec2, func(ctx context.Context, c error) { count("loops"); intr2(ctx, c) })
	second.Do("close", func(_ context.Context, c error) { causes = append(causes, c) })

	if err := g.Run(t.Context()); !errors.Is(err, boom) {
		t.Fatalf("Run: %v, want %v", err, boom)
	}
	for _, name := range []string{"grpc", "rest", "loops"} {
		n, ok := interrupts.Load(name)
		if !ok || *n.(*int) != 1 {
			t.Errorf("%s interrupted %v times, want once", name, n)
		}
	}
	if len(causes) != 2 || !errors.Is(causes[0], boom) || !errors.Is(causes[1], boom) {
		t.Errorf("steps saw causes %v, want %v twice", causes, boom)
	}
	if got := tr.list(); !slices.Contains(got, "loops returned") {
		t.Errorf("the second phase's actor did not return: %q", got)
	}
}

// Two actors failing together, and a second Run, interrupt nothing
// twice: each interrupt closes a channel, which would panic on a second
// call. The run's error is one of the two.
func TestDoubleFailureInterruptsOnce(t *testing.T) {
	tr := &trace{}
	g := New(quiet())
	a, b := errors.New("a failed"), errors.New("b failed")
	release := make(chan struct{})
	p := g.Phase("stop", nil)
	for _, e := range []error{a, b} {
		closed := make(chan struct{})
		p.Add(e.Error(), func() error { <-release; return e }, func(context.Context, error) { close(closed) })
	}
	p.Add(blocker(tr, "other"))
	close(release)
	err := g.Run(t.Context())
	if !errors.Is(err, a) && !errors.Is(err, b) {
		t.Fatalf("Run: %v, want %v or %v", err, a, b)
	}
	if err := g.Run(t.Context()); !errors.Is(err, ErrRan) {
		t.Errorf("second Run: %v, want ErrRan", err)
	}
	if got := tr.list(); !slices.Equal(got, []string{"other interrupted", "other returned"}) {
		t.Errorf("trace %q", got)
	}
}

// A phase whose actor ignores its interrupt ends at its deadline plus the
// slack: the group logs the phase and the part still running, and the
// next phases run. The interrupt's context ends at the deadline.
func TestHungPhaseIsBoundedByItsDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var logs bytes.Buffer
		g := New(slog.New(slog.NewTextHandler(&logs, nil)))
		g.Slack = 250 * time.Millisecond
		const deadline = 5 * time.Second
		hang := make(chan struct{})
		var interruptCtxEnded atomic.Int64
		start := time.Now()
		drain := g.Phase("drain listeners", func() time.Duration { return deadline })
		drain.Add("rest", func() error { <-hang; return nil }, func(ctx context.Context, _ error) {
			<-ctx.Done()
			interruptCtxEnded.Store(int64(time.Since(start)))
		})
		drain.Add("grpc", func() error { return nil }, nil)
		var closedAt time.Duration
		g.Phase("clean up", nil).Do("close", func(context.Context, error) { closedAt = time.Since(start) })

		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		if err := g.Run(ctx); err != nil {
			t.Fatalf("Run: %v", err)
		}
		if want := deadline + g.Slack; closedAt != want {
			t.Errorf("the next phase ran at %v, want at the deadline plus the slack, %v", closedAt, want)
		}
		if got := time.Duration(interruptCtxEnded.Load()); got != deadline {
			t.Errorf("the interrupt's context ended at %v, want %v", got, deadline)
		}
		line := logs.String()
		for _, want := range []string{`phase="drain listeners"`, "still_running=[rest]", "deadline=5s"} {
			if !strings.Contains(line, want) {
				t.Errorf("log %q lacks %q", line, want)
			}
		}
		close(hang)
		synctest.Wait()
	})
}

// A phase that finishes before its deadline does not wait for it, and
// logs nothing.
func TestPhaseWithinDeadlineDoesNotWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var logs bytes.Buffer
		g := New(slog.New(slog.NewTextHandler(&logs, nil)))
		start := time.Now()
		p := g.Phase("drain", func() time.Duration { return time.Minute })
		p.Add("rest", func() error { time.Sleep(3 * time.Second); return nil }, nil)
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		g.Run(ctx)
		if took := time.Since(start); took != 3*time.Second {
			t.Errorf("Run took %v, want the actor's 3s", took)
		}
		if logs.Len() != 0 {
			t.Errorf("logged %q", logs.String())
		}
	})
}

// lateDone is an ended context whose Done waits until the group's first
// actor has returned (and a moment more for Run's goroutine to hand it
// on), so that Run's select finds the context and the actor ready at
// once, as when a server is cancelled right after it started.
type lateDone struct {
	context.Context
	g *Group
}

func (c lateDone) Done() <-chan struct{} {
	<-c.g.actors[0].done
	time.Sleep(time.Millisecond)
	return c.Context.Done()
}

// An actor that ends because Run's context ended (it watches a child of
// it) does not end the run by itself: when Run's select finds both ready,
// the context is named, not the actor. A server cancelled right after it
// started logged "stopping: initial loads ended" (make test beside two
// CPU burners), its loads' context a child of the server's.
func TestContextEndingChildActorIsNotTheCause(t *testing.T) {
	for i := range 100 {
		var log bytes.Buffer
		g := New(slog.New(slog.NewTextHandler(&log, nil)))
		ctx, cancel := context.WithCancel(t.Context())
		child, stopChild := context.WithCancel(ctx)
		g.Phase("loads", nil).Add("loads", func() error { <-child.Done(); return nil },
			func(context.Context, error) { stopChild() })
		cancel()
		if err := g.Run(lateDone{ctx, g}); err != nil {
			t.Fatalf("run %d: Run = %v, want nil", i, err)
		}
		if strings.Contains(log.String(), "stopping:") {
			t.Fatalf("run %d: the actor was named as ending the run:\n%s", i, log.String())
		}
	}
}
