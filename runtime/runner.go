package runtime

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// RunnerConfig configures a supervised runner process for one model
// instance. Zero values take the defaults noted.
type RunnerConfig struct {
	Name       string   // for logs and errors, e.g. "ocr-det/1#0"; default the model file name
	ModelPath  string   // the model.onnx file; required
	Library    string   // libonnxruntime path passed to the child; required
	Executable string   // default os.Executable()
	Args       []string // leading arguments before the runner flags; nil: []string{"runner"}
	Env        []string // extra environment for the child, "KEY=value"
	SocketDir  string   // where the Unix socket lives; default os.TempDir()
	Provider   ProviderOptions
	// JoinCgroups are cgroup.procs files (from limiter.Placement) the
	// child writes its own pid to before it loads ONNX Runtime, so that the
	// model's memory and threads are charged to the instance's cgroup from
	// the start. A restarted process joins them again.
	JoinCgroups []string
	// ProcessUnit is a process unit's directory (limiter.Placement; see
	// sched_linux.go): the child adds its pid there and applies the unit's
	// scheduling class, CPU affinity and data rlimit to itself before it
	// loads ONNX Runtime. A restarted process does it again, with the
	// unit's limits of the moment.
	ProcessUnit string
	// ArenaSize is the shared memory between the server and each runner
	// process, in bytes: a call's inputs and outputs travel through it when
	// they fit in what is free, inline on the socket otherwise. 0 means
	// DefaultArenaSize; negative, no arena (everything inline).
	ArenaSize int64
	// MailboxSlots is how many calls at once can cross to each runner
	// process through shared memory instead of the socket
	// (runner_mailbox.go): the slots live after the arena, so there is
	// none without one. 0 means DefaultMailboxSlots; negative, none (every
	// call on the socket).
	MailboxSlots int
	// Calls is how many calls the server runs on the process at once
	// (execution.concurrency); 0 means 1. The runner's Go scheduler gets
	// as many processors (GOMAXPROCS), and one more with a call mailbox
	// (a worker asleep in it keeps its own), at most the machine's CPUs:
	// a call then runs where its frame was read, with no other thread to
	// wake.
	Calls int

	ReadyTimeout   time.Duration // how long a start may take; default 2m
	HealthInterval time.Duration // between health checks; default 5s
	BackoffInitial time.Duration // first restart delay; default 500ms, doubling
	BackoffMax     time.Duration // restart delay cap; default 30s
	// MaxRestarts is how many restarts may be tried in a row, counting
	// crashes and failed starts, before the runner is Failed. A process
	// that stays ready for max(BackoffMax, 4×HealthInterval) (the stable
	// period), or answers a call, earns the full count back; by answering,
	// at most once per stable period. An out-of-memory kill while a call
	// was in flight is charged to that call (it fails with ErrOutOfMemory)
	// and does not count. 0 means 5; negative means never restart.
	MaxRestarts int

	// Logger receives the runner's events and the child's output lines. It
	// should already carry the runner's name; if nil, slog.Default() with
	// "runner"=Name is used.
	Logger *slog.Logger
	// OnRestart is called from the supervising goroutine after each
	// successful restart, with a short cause of the previous process's end
	// ("process signal: killed", "hung: ..."), for metrics. It may be nil.
	OnRestart func(reason string)
	// OnExit is called from the supervising goroutine each time a process
	// ends unexpectedly (crash, kill, hang, out of memory), before any
	// restart. It may be nil.
	OnExit func(Exit)
	// MemoryEvents, when set, reads the kernel's count of processes killed
	// in the instance's cgroup for exceeding its memory limit, and that
	// limit in bytes (0: none). The runner reads it as each process starts
	// and when it dies, to tell an out-of-memory kill from other deaths.
	MemoryEvents func() (oomKills uint64, limit int64, err error)
	// Restarting, when set, is called from the supervising goroutine
	// before each restart's process is spawned (not before the first
	// start, which the caller prepares itself), so that the caller can
	// ready the process's limits for its load (a limiter unit started
	// uncapped). It returns ready (nil: nothing to do), called with the
	// new process's pid once that process answers, before it serves: an
	// error from ready fails the start, as a process that never got ready
	// does (the process is killed, and the restart counts toward
	// MaxRestarts).
	Restarting func() (ready func(pid int) error)
}

// Exit describes an unexpected end of a runner process.
type Exit struct {
	Cause string // why it ended, as the runner's reason reports it
	OOM   bool   // killed by the kernel for exceeding its memory limit
}

const (
	defaultReadyTimeout   = 2 * time.Minute
	defaultHealthInterval = 5 * time.Second
	defaultBackoffInitial = 500 * time.Millisecond
	defaultBackoffMax     = 30 * time.Second
	defaultMaxRestarts    = 5
	// hungAfter consecutive failed health checks of a live process mean
	// it is hung. A check failed while the process was starved of CPU
	// or made progress (see starvation) does not count: a runner is
	// found hung only when it had the CPU and answered nothing.
	hungAfter = 3
	// maxHealthTimeout caps one health check.
	maxHealthTimeout = 2 * time.Second
	// defaultStopGrace applies when Stop's context has no deadline.
	defaultStopGrace = 10 * time.Second
	// maxSocketPath is the room in sockaddr_un.sun_path, NUL included.
	maxSocketPath = 108
)

func (c RunnerConfig) withDefaults() (RunnerConfig, error) {
	var errs []error
	if c.ModelPath == "" {
		errs = append(errs, errors.New("runner config: ModelPath is required"))
	}
	if c.Library == "" {
		errs = append(errs, errors.New("runner config: Library is required"))
	}
	if err := c.Provider.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("runner config: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		return c, err
	}
	if c.Name == "" {
		c.Name = filepath.Base(c.ModelPath)
	}
	if c.Executable == "" {
		exe, err := os.Executable()
		if err != nil {
			return c, fmt.Errorf("runner config: find own executable: %w", err)
		}
		c.Executable = exe
	}
	if c.Args == nil {
		c.Args = []string{"runner"}
	}
	if c.SocketDir == "" {
		c.SocketDir = os.TempDir()
	}
	setDefault := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	if c.ArenaSize == 0 {
		c.ArenaSize = DefaultArenaSize
	}
	switch {
	case c.MailboxSlots == 0:
		c.MailboxSlots = DefaultMailboxSlots
	case c.MailboxSlots > maxMailboxSlots:
		return c, fmt.Errorf("runner %s: %d mailbox slots, at most %d", c.Name, c.MailboxSlots, maxMailboxSlots)
	}
	setDefault(&c.ReadyTimeout, defaultReadyTimeout)
	setDefault(&c.HealthInterval, defaultHealthInterval)
	setDefault(&c.BackoffInitial, defaultBackoffInitial)
	setDefault(&c.BackoffMax, defaultBackoffMax)
	c.BackoffMax = max(c.BackoffMax, c.BackoffInitial)
	switch {
	case c.MaxRestarts == 0:
		c.MaxRestarts = defaultMaxRestarts
	case c.MaxRestarts < 0:
		c.MaxRestarts = 0
	}
	if c.Logger == nil {
		c.Logger = slog.Default().With("runner", c.Name)
	}
	return c, nil
}

// RunnerState is where a Runner is in its life.
type RunnerState int

// The states of a Runner. Only a Ready runner takes requests.
const (
	RunnerStarting RunnerState = iota
	RunnerReady
	RunnerRestarting
	RunnerFailed
	RunnerStopped
	// RunnerChecking: a call got no answer in time; the runner takes no
	// requests while a health check decides whether it hangs.
	RunnerChecking
)

// String names the state in lower case, as in logs and status messages.
func (s RunnerState) String() string {
	switch s {
	case RunnerStarting:
		return "starting"
	case RunnerReady:
		return "ready"
	case RunnerRestarting:
		return "restarting"
	case RunnerFailed:
		return "failed"
	case RunnerStopped:
		return "stopped"
	case RunnerChecking:
		return "checking"
	}
	return fmt.Sprintf("RunnerState(%d)", int(s))
}

// Runner is a model instance served by a child process (the hidden
// `runner` subcommand, see RunnerMain) over gRPC on a Unix socket. One
// supervising goroutine owns the process: it restarts it with backoff when
// it dies, kills and restarts it when health checks say it hangs, and
// stops it on Stop.
type Runner struct {
	cfg     RunnerConfig
	log     *slog.Logger
	inputs  []TensorSpec
	outputs []TensorSpec
	// outRatio is the largest ratio of output to input bytes seen so far,
	// as float64 bits: how much of the arena a call reserves for its
	// outputs.
	outRatio atomic.Uint64

	// serving is the process that takes requests; nil unless Ready.
	serving atomic.Pointer[process]
	// live is the current process, ready or not; nil between processes.
	live atomic.Pointer[process]

	// ctx is cancelled by Stop.
	ctx    context.Context
	cancel context.CancelFunc
	// done is closed when the supervisor has returned.
	done chan struct{}

	// suspect wakes the supervisor after Suspect has paused the serving
	// process; why says what the call saw.
	suspect chan struct{}

	mu       sync.Mutex
	state    RunnerState
	reason   string
	restarts int
	why      string // what made Suspect pause the runner
	stopping bool
	stopCtx  context.Context // Stop's context, for the grace period
	stopErr  error
}

var _ Instance = (*Runner)(nil)

// StartRunner starts a runner process and waits until it answers Describe,
// for at most cfg.ReadyTimeout. If the process dies or times out first,
// the error carries its exit status and the last lines of its output. ctx
// bounds the start only; the runner then lives until Stop, which must be
// called.
func StartRunner(ctx context.Context, cfg RunnerConfig) (*Runner, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	r := &Runner{cfg: cfg, log: cfg.Logger, done: make(chan struct{}), state: RunnerStarting, suspect: make(chan struct{}, 1)}
	r.outRatio.Store(math.Float64bits(1))
	r.ctx, r.cancel = context.WithCancel(context.Background())
	p, desc, err := r.spawn(ctx)
	if err != nil {
		r.cancel()
		return nil, err
	}
	if r.inputs, err = specsFromProto(desc.GetInputs()); err == nil {
		r.outputs, err = specsFromProto(desc.GetOutputs())
	}
	if err != nil {
		r.cancel()
		r.terminate(p, nil)
		p.close()
		return nil, fmt.Errorf("runner %s: %w", cfg.Name, err)
	}
	r.log.Info("runner started",
		"pid", p.pid,
		"model", cfg.ModelPath,
		"provider", desc.GetProvider(),
		"onnxruntime", desc.GetOnnxruntimeVersion())
	r.setReady(p)
	go r.supervise(p)
	return r, nil
}

// socketSeq numbers sockets so that each process gets a fresh one.
var socketSeq atomic.Uint64

// spawn starts a process and waits until it is ready. On failure nothing of
// the process is left.
func (r *Runner) spawn(ctx context.Context) (*process, *runnerpb.DescribeResponse, error) {
	socket := filepath.Join(r.cfg.SocketDir, fmt.Sprintf("sloserve-%d-%d.sock", os.Getpid(), socketSeq.Add(1)))
	if len(socket) >= maxSocketPath {
		return nil, nil, fmt.Errorf("runner %s: socket path %s is longer than %d bytes; use a shorter SocketDir", r.cfg.Name, socket, maxSocketPath-1)
	}
	start := time.Now()
	oomBase, _ := r.oomKills()
	p, err := startProcess(&r.cfg, socket)
	if err != nil {
		return nil, nil, fmt.Errorf("runner %s: %w", r.cfg.Name, err)
	}
	p.oomBase = oomBase
	r.live.Store(p)
	r.log.Debug("runner process started", "pid", p.pid, "socket", socket)

	// The ready timeout runs only while the process is not starved of
	// CPU (readyClock).
	readyCtx, cancel, stood := readyClock(ctx, p.pid, r.cfg.ReadyTimeout)
	defer cancel()
	stop := context.AfterFunc(p.exitCtx, cancel)
	defer stop()
	desc, err := p.runner.Describe(readyCtx, &runnerpb.DescribeRequest{}, grpc.WaitForReady(true))
	// A call whose connection was lost under it (Unavailable) while the
	// process lives and the clock runs is asked again on a new one: on a
	// starved host (40 runners starting beside two CPU burners) the
	// client's new connection was closed with Describe already sent on it
	// ("use of closed network connection"), and the start failed.
	for err != nil && status.Code(err) == codes.Unavailable && readyCtx.Err() == nil && !p.hasExited() {
		r.log.Debug("runner's connection lost during Describe; asking again", "pid", p.pid, "err", err)
		desc, err = p.runner.Describe(readyCtx, &runnerpb.DescribeRequest{}, grpc.WaitForReady(true))
	}
	if err == nil {
		err = p.openStream()
	}
	if err == nil {
		r.log.Debug("runner process ready", "pid", p.pid, "took", time.Since(start))
		return p, desc, nil
	}

	exitedFirst := p.hasExited()
	// Whether the ready clock ran out is read before the kill: the kill
	// ends readyCtx too (it ends with the process), and a call that failed
	// for any other reason would then read as a timeout.
	timedOut := errors.Is(context.Cause(readyCtx), context.DeadlineExceeded) && ctx.Err() == nil
	p.kill()
	<-p.exited
	p.close()
	r.live.Store(nil)
	tail := p.output.Tail(10)
	if tail != "" {
		tail = "; last output:\n" + tail
	}
	oom, limit := r.oomKilled(p)
	switch {
	case exitedFirst && oom:
		err = fmt.Errorf("runner %s was killed for exceeding its memory limit (%s) before it was ready: %w%s", r.cfg.Name, formatBytes(limit), ErrOutOfMemory, tail)
	case exitedFirst && strings.Contains(p.output.Tail(outputTailLines), ErrModelLoad.Error()):
		err = fmt.Errorf("runner %s exited before it was ready (%s): %w%s", r.cfg.Name, p.exitStatus(), ErrModelLoad, tail)
	case exitedFirst && strings.Contains(p.output.Tail(outputTailLines), ErrNoCUDA.Error()):
		// The runner's own error, printed as it exited, names the sentinel.
		err = fmt.Errorf("runner %s exited before it was ready (%s): %w%s", r.cfg.Name, p.exitStatus(), ErrNoCUDA, tail)
	case exitedFirst:
		err = fmt.Errorf("runner %s exited before it was ready (%s)%s", r.cfg.Name, p.exitStatus(), tail)
	case ctx.Err() != nil:
		err = fmt.Errorf("runner %s: start abandoned: %w", r.cfg.Name, context.Cause(ctx))
	case timedOut:
		starved := ""
		if d := stood(); d > 0 {
			starved = fmt.Sprintf(" of time it had the CPU (and %s starved of CPU besides)", d.Round(time.Millisecond))
		}
		err = fmt.Errorf("runner %s not ready within %s%s (pid %d killed)%s", r.cfg.Name, r.cfg.ReadyTimeout, starved, p.pid, tail)
	default:
		err = fmt.Errorf("runner %s: describe: %w%s", r.cfg.Name, err, tail)
	}
	return nil, nil, err
}

// respawn starts a process in place of one that ended, around the
// config's Restarting hook: the process serves only once ready has
// passed. On failure nothing of the process is left.
func (r *Runner) respawn() (*process, error) {
	var ready func(pid int) error
	if r.cfg.Restarting != nil {
		ready = r.cfg.Restarting()
	}
	p, _, err := r.spawn(r.ctx)
	if err != nil || ready == nil {
		return p, err
	}
	if err := ready(p.pid); err != nil {
		p.kill()
		<-p.exited
		p.close()
		r.live.Store(nil)
		return nil, fmt.Errorf("runner %s: started, but not readied to serve (pid %d killed): %w", r.cfg.Name, p.pid, err)
	}
	return p, nil
}

// supervise owns the runner's processes from the first ready one on.
func (r *Runner) supervise(p *process) {
	defer close(r.done)
	failures := 0
	delay := r.cfg.BackoffInitial
	stable := max(r.cfg.BackoffMax, hungAfter*r.cfg.HealthInterval+r.cfg.HealthInterval)
	var earned time.Time // when the restart count was last earned back
	for {
		readySince := time.Now()
		cause, tail, stopped := r.watch(p)
		r.mu.Lock()
		// Out of service and no longer ready in one step, so that no caller
		// sees a ready runner without a process.
		r.serving.Store(nil)
		if !stopped && r.state == RunnerReady {
			r.state, r.reason = RunnerRestarting, cause
		}
		r.mu.Unlock()
		p.close()
		r.live.Store(nil)
		if stopped {
			r.setState(RunnerStopped, "stopped")
			return
		}
		// A process that stayed up long enough, or answered a call, shows
		// the model can stay up: it earns the full restart count back. By
		// answering, at most once per stable period: a model that dies
		// after every call it answers must still run out of restarts.
		if up := time.Since(readySince) >= stable; up || (p.answered.Load() && time.Since(earned) >= stable) {
			failures, delay, earned = 0, r.cfg.BackoffInitial, time.Now()
		}
		exit := Exit{Cause: cause}
		// An out-of-memory kill with a call in flight is that call's doing
		// (the call is answered ErrOutOfMemory): it does not count toward
		// MaxRestarts, so no client can fail the model for good.
		charged := false
		if oom, limit := r.oomKilled(p); oom {
			exit = Exit{Cause: fmt.Sprintf("out of memory: killed by the kernel for exceeding the memory limit of %s (%s)", formatBytes(limit), cause), OOM: true}
			cause = exit.Cause
			charged = p.inflightAtExit > 0
			r.log.Error("runner killed for exceeding its memory limit", "pid", p.pid, "limit_bytes", limit, "calls_in_flight", p.inflightAtExit, "output", tail)
		} else {
			r.log.Warn("runner process ended unexpectedly", "pid", p.pid, "cause", cause, "output", tail)
		}
		if r.cfg.OnExit != nil {
			r.cfg.OnExit(exit)
		}
		// reason is what the state reports: the cause, then the latest
		// failed start.
		reason := cause
		if tail != "" {
			reason += "; last output:\n" + tail
		}

		for {
			wait := delay
			if charged {
				// Neither counted nor backed off; a failed start after it
				// counts as usual.
				charged, wait = false, r.cfg.BackoffInitial
			} else {
				failures++
				if failures > r.cfg.MaxRestarts {
					reason = fmt.Sprintf("gave up after %d restarts in a row; last: %s", r.cfg.MaxRestarts, reason)
					r.log.Error("runner failed", "reason", reason)
					r.setState(RunnerFailed, reason)
					return
				}
				delay = min(2*delay, r.cfg.BackoffMax)
			}
			r.setState(RunnerRestarting, reason)
			select {
			case <-time.After(wait):
			case <-r.ctx.Done():
				r.setState(RunnerStopped, "stopped")
				return
			}
			np, err := r.respawn()
			if err != nil {
				if r.ctx.Err() != nil {
					r.setState(RunnerStopped, "stopped")
					return
				}
				r.log.Warn("runner restart failed", "attempt", failures, "err", err)
				reason = err.Error()
				continue
			}
			if !r.setReady(np) {
				// Stop came while the process started.
				r.terminate(np, r.stopContext())
				np.close()
				r.live.Store(nil)
				r.setState(RunnerStopped, "stopped")
				return
			}
			p = np
			r.mu.Lock()
			r.restarts++
			n := r.restarts
			r.mu.Unlock()
			r.log.Info("runner restarted", "pid", p.pid, "restarts", n, "cause", cause)
			if r.cfg.OnRestart != nil {
				r.cfg.OnRestart(cause)
			}
			break
		}
	}
}

// watch waits until the process ends or Stop asks it to. Meanwhile it
// checks the runner's health and kills a runner that stops answering. It
// returns why the process ended and the last lines of its output.
func (r *Runner) watch(p *process) (cause, tail string, stopped bool) {
	ticker := time.NewTicker(r.cfg.HealthInterval)
	defer ticker.Stop()
	timeout := min(r.cfg.HealthInterval, maxHealthTimeout)
	failed := 0
	starvedRun := 0 // failed checks in a row while starved of CPU
	hung := ""
	for {
		select {
		case <-p.exited:
			cause = "process " + p.exitStatus()
			if hung != "" {
				cause = hung
			}
			return cause, p.output.Tail(5), false
		case <-r.ctx.Done():
			r.terminate(p, r.stopContext())
			return "", "", true
		case <-r.suspect:
			why, paused := r.suspicion()
			if hung != "" || !paused {
				continue // stale: an earlier process was suspected
			}
			// A runner starved of CPU is checked again until it answers or
			// fails a check it had the CPU for: it is out of service
			// meanwhile, but alive.
			var err error
			for checks := 1; ; checks++ {
				var starved bool
				var waits string
				starved, waits, err = r.check(p, timeout)
				if err == nil || p.hasExited() || r.ctx.Err() != nil || !starved {
					break
				}
				level := slog.LevelDebug
				if checks == 1 || checks%10 == 0 {
					level = slog.LevelWarn
				}
				r.log.Log(r.ctx, level, "runner health check failed, but the runner was starved of CPU; checking again", "pid", p.pid, "call", why, "checks", checks, "err", err, "waits", waits)
				// A check that failed at once must not make this a busy loop.
				select {
				case <-p.exited:
				case <-r.ctx.Done():
				case <-time.After(timeout / 4):
				}
			}
			if err == nil {
				r.log.Info("runner answered its health check after a call got no answer; serving again", "pid", p.pid, "call", why)
				r.resume(p)
				failed = 0
				continue
			}
			// A process that died (the call saw its connection break) fails
			// the check too: give its exit a moment to be reaped, so that
			// it is reported as what it is, not as a hang.
			select {
			case <-p.exited:
				continue
			case <-time.After(exitGrace):
			}
			if r.ctx.Err() != nil {
				continue
			}
			hung = fmt.Sprintf("hung: %s, and a health check failed (%v); killed", why, err)
			r.log.Error("runner hung; killing it", "pid", p.pid, "call", why, "err", err)
			p.kill()
		case <-ticker.C:
			if hung != "" {
				continue
			}
			starved, waits, err := r.check(p, timeout)
			if err == nil {
				failed, starvedRun = 0, 0
				continue
			}
			if p.hasExited() || r.ctx.Err() != nil {
				continue // the other cases of the select handle these
			}
			if starved {
				// Neither a sign of a hang nor of life: not counted.
				starvedRun++
				r.log.Warn("runner health check failed, but the runner was starved of CPU; not counted", "pid", p.pid, "failures", failed, "starved", starvedRun, "err", err, "waits", waits)
				continue
			}
			starvedRun = 0
			failed++
			r.log.Warn("runner health check failed", "pid", p.pid, "failures", failed, "err", err, "waits", waits)
			if failed >= hungAfter {
				hung = fmt.Sprintf("hung: %d health checks in a row failed (last: %v); killed", failed, err)
				r.log.Error("runner hung; killing it", "pid", p.pid, "failures", failed)
				r.serving.Store(nil)
				p.kill()
			}
		}
	}
}

// check runs one health check of p. When it fails, starved says whether
// p was starved of CPU meanwhile (see starvation), and waits how long p
// and the server waited for a CPU, for the log.
//
// The CPU times are read only for a check still unanswered after
// checkQuiet (a quarter of the timeout at most): reading them costs a
// file per thread of the runner and of the server, and nearly every check
// is answered in well under a millisecond. Starvation is then measured
// over the rest of the check (a quarter of its timeout at least, after it
// when the server itself was too late to look sooner); a check that
// fails sooner (refused, not serving) is no sign of starvation, only
// progress (an answered call) excuses it. A check that fails after
// checkQuiet is measured whichever of its end and the timer this server
// saw first: a server late to both (on a busy host) saw them ready
// together and took either, and one judged a check that timed out as
// failed at once, unmeasured, half the time.
func (r *Runner) check(p *process, timeout time.Duration) (starved bool, waits string, err error) {
	return r.checkWith(p, timeout, func() error { return p.checkHealth(r.ctx, timeout) }, nil)
}

// checkWith is check with the health call given; late, if not nil, runs
// between the start of the quiet time and the wait for the check, as a
// server descheduled there would (tests).
func (r *Runner) checkWith(p *process, timeout time.Duration, health func() error, late func()) (starved bool, waits string, err error) {
	answered := p.answers.Load()
	res := make(chan error, 1)
	go func() { res <- health() }()
	quietFor := min(checkQuiet, timeout/starvedShare)
	begun := time.Now()
	quiet := time.NewTimer(quietFor)
	if late != nil {
		late()
	}
	select {
	case err = <-res:
		quiet.Stop()
		if err == nil {
			return false, "", nil
		}
		if time.Since(begun) < quietFor {
			progress := p.answers.Load() - answered
			return progress > 0, fmt.Sprintf("check failed at once, %d calls answered meanwhile", progress), err
		}
		res <- err // failed late: measured below, as one that ends as its measure begins
	case <-quiet.C:
	}
	s := startStarvation(p.pid, p.answers.Load, p.busy)
	s.answered = answered
	if err = <-res; err != nil {
		if rest := timeout/starvedShare - time.Since(s.start); rest > 0 {
			// The check ended as its measure began (this server was late
			// to its timer): the runner is measured a little longer,
			// after it, rather than judged on nothing.
			select {
			case <-time.After(rest):
			case <-r.ctx.Done():
			case <-p.exited:
			}
		}
		starved, waits = s.starved()
	}
	return starved, waits, err
}

// checkQuiet is how long a health check runs before the runner's CPU
// times are read for it (see check).
const checkQuiet = 50 * time.Millisecond

// terminate stops a process: SIGTERM, then SIGKILL once ctx is done (or
// after defaultStopGrace if ctx has no deadline; at once if ctx is nil).
func (r *Runner) terminate(p *process, ctx context.Context) {
	if ctx == nil {
		p.kill()
		<-p.exited
		return
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultStopGrace)
		defer cancel()
	}
	p.signal(syscall.SIGTERM)
	select {
	case <-p.exited:
		return
	case <-ctx.Done():
	}
	r.log.Warn("runner did not stop in time; killing it", "pid", p.pid)
	p.kill()
	<-p.exited
	r.mu.Lock()
	r.stopErr = fmt.Errorf("runner %s did not stop in time and was killed: %w", r.cfg.Name, context.Cause(ctx))
	r.mu.Unlock()
}

// Stop stops the runner: SIGTERM to the process, which finishes the calls
// in flight, then SIGKILL when ctx is done (after 10 s if ctx has no
// deadline). It removes the socket, ends the supervisor and restarts
// nothing afterwards. Calls after the first wait for the first to finish
// and return nil.
func (r *Runner) Stop(ctx context.Context) error {
	r.mu.Lock()
	first := !r.stopping
	if first {
		r.stopping = true
		r.stopCtx = ctx
		r.serving.Store(nil)
		r.cancel()
	}
	r.mu.Unlock()
	<-r.done
	r.setState(RunnerStopped, "stopped")
	if !first {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stopErr
}

func (r *Runner) stopContext() context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stopCtx
}

// setReady makes p the serving process unless Stop has begun.
func (r *Runner) setReady(p *process) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stopping {
		return false
	}
	r.state, r.reason = RunnerReady, ""
	r.serving.Store(p)
	return true
}

func (r *Runner) setState(s RunnerState, reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.state == s && r.reason == reason {
		return
	}
	r.state, r.reason = s, reason
	r.log.Debug("runner state", "state", s, "reason", reason)
}

// Suspect tells the runner that a call on it got no answer in time (why
// says which). The runner takes no more requests from the moment Suspect
// returns until a health check, made at once, passes; a runner that fails
// it is killed and restarted as a hung one, without waiting for the
// periodic checks. Reports that come while a check is pending are merged.
func (r *Runner) Suspect(why string) { r.suspectProcess(nil, why) }

// suspectProcess is Suspect for the serving process, or only for p when p
// is not nil: a call that failed on a process already replaced says
// nothing about its successor.
func (r *Runner) suspectProcess(only *process, why string) {
	r.mu.Lock()
	p := r.serving.Load()
	if r.stopping || p == nil || r.state != RunnerReady || (only != nil && p != only) {
		r.mu.Unlock()
		return
	}
	r.serving.Store(nil)
	r.state, r.reason = RunnerChecking, "checking its health: "+why
	r.why = why
	r.mu.Unlock()
	select {
	case r.suspect <- struct{}{}:
	default: // a wake-up is pending; it finds this pause
	}
}

var (
	_ Checker         = (*Runner)(nil)
	_ StarvationMeter = (*Runner)(nil)
)

// Starved reports whether the serving process is starved of CPU over the
// window from now: over the window it runs for less than a quarter of it
// while it waits for a CPU at least that long or has a thread still
// runnable at the end, or waits for a CPU at least as long as it runs and
// a quarter of the window (checkMeasure.starved, no call in flight
// asked). A frozen (stopped) process is not starved, and is
// told at once; a deadlocked one has no runnable thread and is not, after
// the window; one that spins has the CPU and is not. A process with no
// runnable thread at the window's start is measured all the same: a Go
// runner's call can sit for a moment between two of its threads (queued
// while the thread holding the processor is in a system call), and one
// look at that moment once took a starved runner for a hung one. It
// returns false at once without a serving process or when the kernel does
// not say, and early, false, when done is closed.
func (r *Runner) Starved(window time.Duration, done <-chan struct{}) bool {
	p := r.live.Load()
	if p == nil {
		return false
	}
	if _, stopped, ok := threadStates(p.pid); !ok || stopped {
		return false
	}
	s := startStarvation(p.pid, nil, nil)
	t := time.NewTimer(window)
	defer t.Stop()
	select {
	case <-t.C:
	case <-done:
		return false
	case <-p.exited:
		return false
	}
	starved, why := s.starved()
	r.log.Debug("runner starvation over the window", "pid", p.pid, "window", window, "starved", starved, "why", why)
	return starved
}

// Checking reports whether the runner is out of service only while a
// health check decides whether it hangs (see Suspect): a pool lets a call
// wait for the check's end rather than fail it at once.
func (r *Runner) Checking() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.state == RunnerChecking && !r.stopping
}

// suspicion says why the runner was paused for a check, and whether it
// still is.
func (r *Runner) suspicion() (string, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.why, r.state == RunnerChecking && !r.stopping
}

// resume puts p back in service after a passed check, unless Stop has
// begun.
func (r *Runner) resume(p *process) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stopping || r.state != RunnerChecking {
		return
	}
	r.state, r.reason = RunnerReady, ""
	r.serving.Store(p)
}

// oomKills reads the cgroup's out-of-memory kill count; 0 without
// MemoryEvents.
func (r *Runner) oomKills() (uint64, int64) {
	if r.cfg.MemoryEvents == nil {
		return 0, 0
	}
	n, limit, err := r.cfg.MemoryEvents()
	if err != nil {
		return 0, 0
	}
	return n, limit
}

// oomKilled reports whether the kernel killed a process of the runner's
// cgroup for memory since p started, and the memory limit. Call it after
// p has ended.
func (r *Runner) oomKilled(p *process) (bool, int64) {
	if r.cfg.MemoryEvents == nil {
		return false, 0
	}
	n, limit, err := r.cfg.MemoryEvents()
	if err != nil {
		r.log.Debug("reading the cgroup's memory events", "err", err)
		return false, 0
	}
	return n > p.oomBase, limit
}

// formatBytes renders a memory size in binary units.
func formatBytes(n int64) string {
	switch {
	case n <= 0:
		return "none"
	case n%(1<<30) == 0:
		return fmt.Sprintf("%dGiB", n>>30)
	case n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<20:
		return fmt.Sprintf("%.1fMiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%dB", n)
}

// Inputs describes the model's inputs as the runner reported them.
func (r *Runner) Inputs() []TensorSpec { return slices.Clone(r.inputs) }

// Outputs describes the model's outputs as the runner reported them.
func (r *Runner) Outputs() []TensorSpec { return slices.Clone(r.outputs) }

// State is the runner's current state.
func (r *Runner) State() RunnerState {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.state
}

// Reason says why the runner is not ready: the end of its last process
// while restarting or failed; empty when ready.
func (r *Runner) Reason() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.reason
}

// Pid is the process id of the current runner process, 0 if there is none.
func (r *Runner) Pid() int {
	if p := r.live.Load(); p != nil {
		return p.pid
	}
	return 0
}

// Restarts counts the successful restarts so far.
func (r *Runner) Restarts() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.restarts
}

// Usage reports the current process's CPU time (user plus system) and
// resident memory, from /proc.
func (r *Runner) Usage() (cpuSeconds float64, rssBytes int64, err error) {
	p := r.live.Load()
	if p == nil {
		return 0, 0, fmt.Errorf("%w: runner %s has no process", ErrUnavailable, r.cfg.Name)
	}
	return p.usage()
}

// LogValue identifies the runner in logs.
func (r *Runner) LogValue() slog.Value {
	return slog.GroupValue(
		slog.String("name", r.cfg.Name),
		slog.Int("pid", r.Pid()),
		slog.String("state", r.State().String()),
	)
}

// Infer runs one request on the runner. It fails at once with
// ErrUnavailable unless the runner is Ready, and with ErrUnavailable when
// the process dies during the call. A request the runner rejects fails
// with ErrInvalidTensor (and ErrInference); an ONNX Runtime failure with
// ErrInference. Both keep the runner's message.
func (r *Runner) Infer(ctx context.Context, req *InferRequest) (resp *InferResponse, err error) {
	if parent := trace.SpanFromContext(ctx); parent.IsRecording() {
		var span trace.Span
		ctx, span = parent.TracerProvider().Tracer("github.com/sloserve/sloserve/runtime").Start(ctx, "runner",
			trace.WithAttributes(attribute.String("sloserve.runner", r.cfg.Name)))
		defer func() { endRunnerSpan(span, resp, err) }()
	}
	p, err := r.servingProcess()
	if err != nil {
		return nil, err
	}
	// The call counts as in flight until inferError has looked at how the
	// process ended, so the supervisor charges an out-of-memory kill to it.
	p.inflight.Add(1)
	defer p.inflight.Add(-1)
	var mem []byte
	if p.arena != nil && p.arena.acquire() {
		defer p.arena.release()
		mem = p.arena.mem
	}
	msg, call, region, err := r.newCall(p, req, mem)
	if err != nil {
		// A client's mapping faulted while its bytes were copied: this
		// request fails, nothing was sent.
		if call.hasSlot {
			p.arena.free(call.slot)
		}
		return nil, fmt.Errorf("runner %s: %w", r.cfg.Name, err)
	}
	reply, err := p.stream.call(ctx, msg, call)
	if call.hasSlot && !call.abandoned {
		// Read the outputs before the slot can be handed out again.
		defer p.arena.free(call.slot)
	}
	if err == nil {
		err = replyStatus(reply)
	}
	if err != nil {
		return nil, r.inferError(ctx, p, err)
	}
	p.answered.Store(true)
	p.answers.Add(1)
	out, err := readResponse(reply, mem, region)
	if err != nil {
		// A runner that answers with descriptors outside its call's region
		// is broken; it is not trusted with further calls.
		r.log.Error("runner answered with a bad descriptor; killing it", "pid", p.pid, "err", err)
		p.kill()
		return nil, fmt.Errorf("%w: runner %s: %v", ErrInference, r.cfg.Name, err)
	}
	r.learnOutputs(req, out)
	return out, nil
}

// newCall builds the stream message for req. With an arena it reserves one
// slot for the inputs, copied in, followed by room for the outputs; what
// does not fit in the free part of the arena travels inline. Inputs in a
// client's mapping (Tensor.Mapped) are copied under GuardMapped, into the
// arena or, inline, into memory of the server's own first, so that the
// encoder never reads the mapping; a fault fails the call with
// ErrMappedFault (call is still returned, its slot to be freed).
func (r *Runner) newCall(p *process, req *InferRequest, mem []byte) (*runnerpb.InferRequest, *pendingCall, *runnerpb.ArenaSlice, error) {
	var (
		call    *pendingCall
		msg     *runnerpb.InferRequest
		tensors []runnerpb.Tensor
		slices  []runnerpb.ArenaSlice // one per input, then the output region
	)
	if len(req.Inputs) == 1 {
		// The common case in one allocation.
		one := new(oneInputCall)
		call, msg, tensors, slices = &one.call, &one.msg, one.tensor[:], one.slices[:]
		msg.Inputs = one.ptr[:]
	} else {
		call, msg = &pendingCall{}, &runnerpb.InferRequest{Inputs: make([]*runnerpb.Tensor, len(req.Inputs))}
		tensors = make([]runnerpb.Tensor, len(req.Inputs))
		slices = make([]runnerpb.ArenaSlice, len(req.Inputs)+1)
	}
	msg.Outputs = req.Outputs
	for i, t := range req.Inputs {
		tensors[i].Name, tensors[i].Datatype, tensors[i].Shape, tensors[i].Data = t.Name, string(t.DataType), t.Shape, t.Data
		msg.Inputs[i] = &tensors[i]
	}
	inline := func() (*runnerpb.InferRequest, *pendingCall, *runnerpb.ArenaSlice, error) {
		own, err := ownInputs(req)
		if err != nil {
			return msg, call, nil, err
		}
		for i, t := range own.Inputs {
			msg.Inputs[i].Data = t.Data
		}
		return msg, call, nil, nil
	}
	if mem == nil {
		return inline()
	}
	var in uint64
	for _, t := range req.Inputs {
		in += uint64(len(t.Data)) + arenaAlign
	}
	reserve := r.outputReserve(req, in)
	off, ok := p.arena.slot(in + reserve)
	if !ok && reserve > 0 {
		reserve = 0
		off, ok = p.arena.slot(in)
	}
	if !ok {
		return inline()
	}
	call.slot, call.hasSlot = off, true
	at := off
	for i, t := range req.Inputs {
		n := uint64(len(t.Data))
		if !t.Mapped {
			copy(mem[at:at+n], t.Data)
		} else if _, err := CopyMapped(mem[at:at+n], t.Data); err != nil {
			return msg, call, nil, fmt.Errorf("input %q: %w", t.Name, err)
		}
		msg.Inputs[i].Data = nil
		slices[i].Offset, slices[i].Length = at, n
		msg.Inputs[i].Arena = &slices[i]
		at, _ = alignUp(at + n)
	}
	var region *runnerpb.ArenaSlice
	if reserve > 0 {
		region = &slices[len(req.Inputs)]
		region.Offset, region.Length = off+in, reserve
		msg.Output = region
	}
	return msg, call, region, nil
}

// oneInputCall is what a call of one input needs, allocated at once.
type oneInputCall struct {
	call   pendingCall
	msg    runnerpb.InferRequest
	ptr    [1]*runnerpb.Tensor
	tensor [1]runnerpb.Tensor
	slices [2]runnerpb.ArenaSlice
}

// errDynamicShape marks an output whose size is not known in advance.
var errDynamicShape = errors.New("not a fixed shape")

// outputReserve is the room a call of in input bytes reserves for its
// outputs: the exact size when every requested output has a fixed shape,
// else in times the largest output-to-input ratio seen.
func (r *Runner) outputReserve(req *InferRequest, in uint64) uint64 {
	var exact uint64
	for _, spec := range r.outputs {
		if len(req.Outputs) > 0 && !slices.Contains(req.Outputs, spec.Name) {
			continue
		}
		var n int64
		err := errDynamicShape
		if len(spec.Shape) > 0 && isStatic(spec.Shape) && spec.DataType != Bytes {
			// Only a fixed shape is counted: counting a dynamic one
			// builds an error on every call.
			n, err = ElementCount(spec.Shape, 1<<40)
		}
		if err != nil {
			ratio := math.Float64frombits(r.outRatio.Load())
			return uint64(min(ratio*float64(in), float64(DefaultArenaSize<<4))) + arenaAlign*uint64(len(r.outputs))
		}
		exact += uint64(spec.DataType.ByteSize(n)) + arenaAlign
	}
	return exact
}

// learnOutputs raises the output-to-input ratio that later calls reserve
// room by, when this call's outputs were larger.
func (r *Runner) learnOutputs(req *InferRequest, resp *InferResponse) {
	var in, out float64
	for _, t := range req.Inputs {
		in += float64(len(t.Data))
	}
	for _, t := range resp.Outputs {
		out += float64(len(t.Data))
	}
	if in == 0 {
		return
	}
	for {
		old := r.outRatio.Load()
		if out/in <= math.Float64frombits(old) {
			return
		}
		if r.outRatio.CompareAndSwap(old, math.Float64bits(out/in)) {
			return
		}
	}
}

// servingProcess is the process to send a call to; a runner that is not
// ready fails the call at once with ErrUnavailable and its state's reason.
func (r *Runner) servingProcess() (*process, error) {
	if p := r.serving.Load(); p != nil {
		return p, nil
	}
	r.mu.Lock()
	msg := r.state.String()
	if r.reason != "" {
		msg += ": " + r.reason
	}
	r.mu.Unlock()
	return nil, fmt.Errorf("%w: runner %s is %s", ErrUnavailable, r.cfg.Name, msg)
}

// inferError turns a failed call into the package's errors.
func (r *Runner) inferError(ctx context.Context, p *process, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return fmt.Errorf("runner %s: %w", r.cfg.Name, ctxErr)
	}
	st := status.Convert(err)
	switch st.Code() {
	case codes.InvalidArgument:
		return fmt.Errorf("%w: %w", ErrInference, remoteError{kind: ErrInvalidTensor, msg: st.Message()})
	case codes.Unavailable, codes.Canceled:
		// The connection broke or was closed under the call: the process
		// died or is being replaced.
		if oom, limit := r.diedOfOOM(p); oom {
			return fmt.Errorf("%w: runner %s was killed by the kernel for exceeding its memory limit of %s while running this request", ErrOutOfMemory, r.cfg.Name, formatBytes(limit))
		}
		// Out of service until a health check passes, before the caller
		// retries: a process that died (its exit not yet reaped) must not
		// be picked again, by this call's retry or any other call.
		r.suspectProcess(p, "a call could not reach it ("+st.Message()+")")
		return fmt.Errorf("%w: runner %s: %s", ErrUnavailable, r.cfg.Name, st.Message())
	}
	if p.hasExited() {
		r.suspectProcess(p, "it died during a call ("+st.Message()+")")
		return fmt.Errorf("%w: runner %s died during the call: %s", ErrUnavailable, r.cfg.Name, st.Message())
	}
	return fmt.Errorf("%w: runner %s: %s", ErrInference, r.cfg.Name, st.Message())
}

// exitGrace is how long a suspected process that failed its health check
// may take to be reaped before it is taken for hung.
const exitGrace = 250 * time.Millisecond

// oomWait bounds how long a failed call waits for its process to be reaped
// before it looks at the cgroup's out-of-memory count.
const oomWait = 500 * time.Millisecond

// diedOfOOM reports whether p, whose connection broke under a call, was
// killed for exceeding its memory limit.
func (r *Runner) diedOfOOM(p *process) (bool, int64) {
	if r.cfg.MemoryEvents == nil {
		return false, 0
	}
	select {
	case <-p.exited:
	case <-time.After(oomWait):
		return false, 0 // alive: the connection broke for another reason
	}
	return r.oomKilled(p)
}

// remoteError carries a runner's message under one of the package's
// sentinels. The runner's messages for rejected tensors already begin
// with the sentinel's text.
type remoteError struct {
	kind error
	msg  string
}

func (e remoteError) Error() string { return e.msg }
func (e remoteError) Unwrap() error { return e.kind }

// endRunnerSpan ends the span of one call to a runner with the times the
// runner measured: copying the inputs in, the session's run, copying the
// outputs out (Triton's compute_input, compute_infer, compute_output).
func endRunnerSpan(span trace.Span, resp *InferResponse, err error) {
	if err != nil {
		span.SetStatus(otelcodes.Error, err.Error())
	} else if resp != nil {
		span.SetAttributes(
			attribute.Int64("sloserve.compute_input_us", resp.Timing.Input.Microseconds()),
			attribute.Int64("sloserve.compute_infer_us", resp.Timing.Infer.Microseconds()),
			attribute.Int64("sloserve.compute_output_us", resp.Timing.Output.Microseconds()),
		)
	}
	span.End()
}
