// Package rungroup runs a server's components together and stops them in
// named phases, in order.
//
// Each component is an actor: an execute function that runs until the
// component ends (a listener's Serve, a loop) and an interrupt that makes
// execute return (a listener's Shutdown, a context's cancel). Run starts
// every actor at once; the first actor to return, or the end of Run's
// context, ends the run. Then the phases run one after the other: a phase
// interrupts all of its actors at once, waits for each to return, and
// then runs its steps in the order they were added. A phase with a
// deadline gives its interrupts and steps a context that ends there; what
// has not returned by the deadline (and a short slack after it) is logged
// by name and left behind, and the next phase starts. Every actor is
// interrupted exactly once, also when it returned by itself or when
// several failed together.
//
// The idea is oklog's run.Group (execute/interrupt pairs, the first
// return interrupts all) with the interrupts ordered into phases, so that
// a staged shutdown reads as a list: not ready, delay, drain the
// listeners, stop the loads, stop the registry, stop the loops, clean up.
package rungroup

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// ErrRan is Run's answer when the group has run before: a group runs once.
var ErrRan = errors.New("rungroup: the group has run already")

// DefaultSlack is how long past a phase's deadline the group still waits
// for the phase's parts before it calls them hung: an interrupt bounded by
// the same deadline (http.Server.Shutdown) returns right after it.
const DefaultSlack = time.Second

// Group is a set of actors and the phases that stop them. Build it with
// New, add phases and actors, then Run it once.
type Group struct {
	log *slog.Logger
	// Slack is how long the group waits past a phase's deadline before it
	// logs what is still running and moves on.
	Slack  time.Duration
	phases []*Phase
	actors []*actor
	ran    atomic.Bool
}

// New returns an empty group that logs to log.
func New(log *slog.Logger) *Group {
	return &Group{log: log, Slack: DefaultSlack}
}

// Phase is one named stage of the stop.
type Phase struct {
	g       *Group
	name    string
	timeout func() time.Duration
	actors  []*actor
	steps   []step
}

type step struct {
	name string
	fn   func(ctx context.Context, cause error)
}

type actor struct {
	name      string
	execute   func() error
	interrupt func(ctx context.Context, cause error)
	once      sync.Once
	done      chan struct{} // closed when execute has returned
	err       error         // execute's, once done is closed
}

// Phase appends a phase to the stop. timeout, read when the phase starts
// (a reload may change it), bounds the phase; nil or a result <= 0: no
// bound.
func (g *Group) Phase(name string, timeout func() time.Duration) *Phase {
	p := &Phase{g: g, name: name, timeout: timeout}
	g.phases = append(g.phases, p)
	return p
}

// Add adds an actor that this phase stops: interrupt must make execute
// return. interrupt may be nil when execute ends by itself in this phase
// (its context ended by a step of an earlier phase).
func (p *Phase) Add(name string, execute func() error, interrupt func(ctx context.Context, cause error)) {
	if interrupt == nil {
		interrupt = func(context.Context, error) {}
	}
	a := &actor{name: name, execute: execute, interrupt: interrupt, done: make(chan struct{})}
	p.actors = append(p.actors, a)
	p.g.actors = append(p.g.actors, a)
}

// Do adds a step that runs in this phase once its actors have returned,
// after the steps added before it. cause is the error that ended the run
// (nil when Run's context ended it or an actor returned nil).
func (p *Phase) Do(name string, fn func(ctx context.Context, cause error)) {
	p.steps = append(p.steps, step{name: name, fn: fn})
}

// Run starts every actor, waits for the first to return or for ctx to
// end, then runs the phases in order. It returns the error of the actor
// that ended the run, nil when ctx ended it.
func (g *Group) Run(ctx context.Context) error {
	if !g.ran.CompareAndSwap(false, true) {
		return ErrRan
	}
	first := make(chan *actor, len(g.actors))
	for _, a := range g.actors {
		go func() {
			a.err = a.execute()
			close(a.done)
			first <- a
		}()
	}
	var cause error
	select {
	case a := <-first:
		cause = a.err
		switch {
		case cause != nil:
			g.log.Error("stopping: "+a.name+" failed", "err", cause)
		case ctx.Err() != nil:
			// The actor ended because Run's context did (its own is a
			// child), and the select happened to take its return
			// first: the context ended the run, not the actor.
		default:
			g.log.Info("stopping: " + a.name + " ended")
		}
	case <-ctx.Done():
	}
	for _, p := range g.phases {
		p.stop(cause)
	}
	return cause
}

// stop interrupts the phase's actors, waits for them, then runs its steps,
// all within its deadline.
func (p *Phase) stop(cause error) {
	ctx, cancel := context.Background(), context.CancelFunc(func() {})
	var timeout time.Duration
	if p.timeout != nil {
		timeout = p.timeout()
	}
	if timeout > 0 {
		ctx, cancel = context.WithTimeout(ctx, timeout)
	}
	defer cancel()
	start := time.Now()
	var (
		mu      sync.Mutex
		running = map[string]int{} // parts not yet returned, by name
	)
	enter := func(name string) { mu.Lock(); running[name]++; mu.Unlock() }
	leave := func(name string) {
		mu.Lock()
		if running[name]--; running[name] == 0 {
			delete(running, name)
		}
		mu.Unlock()
	}
	finished := make(chan struct{})
	for _, a := range p.actors {
		enter(a.name)
	}
	for _, s := range p.steps {
		enter(s.name)
	}
	go func() {
		defer close(finished)
		var wg sync.WaitGroup
		for _, a := range p.actors {
			wg.Go(func() {
				a.once.Do(func() { a.interrupt(ctx, cause) })
				<-a.done
				leave(a.name)
			})
		}
		wg.Wait()
		for _, s := range p.steps {
			s.fn(ctx, cause)
			leave(s.name)
		}
	}()
	if timeout <= 0 {
		<-finished
		return
	}
	select {
	case <-finished:
		return
	case <-ctx.Done():
	}
	slack := time.NewTimer(p.g.Slack)
	defer slack.Stop()
	select {
	case <-finished:
		return
	case <-slack.C:
	}
	mu.Lock()
	hung := make([]string, 0, len(running))
	for name := range running {
		hung = append(hung, name)
	}
	mu.Unlock()
	slices.Sort(hung)
	p.g.log.Error("shutdown phase over its deadline; going on without it", "phase", p.name,
		"deadline", timeout, "waited", time.Since(start).Round(time.Millisecond), "still_running", hung)
}
