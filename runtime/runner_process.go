package runtime

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// outputTailLines is how many lines of a runner's output are kept for
// error messages.
const outputTailLines = 20

// RunnerTempPrefix starts the name of a runner process's own temporary
// folder, made in the socket folder and given to it as TMPDIR and
// XDG_CACHE_HOME. The folder goes when the process ends; the server's
// clean-up of a dead server's socket folder expects it. Runners keep ONNX
// Runtime's telemetry off (TelemetryEnv); where an operator turns it on,
// what it writes (mat-debug and .ses files in TMPDIR, a SQLite database
// under XDG_CACHE_HOME, at every start) stays in this folder: not in the
// user's home, where every runner queued on one file, and a read-only home
// left a ":memory:.ses" file in the server's working folder
// (TestRunnerWritesNothingUnderHome).
const RunnerTempPrefix = "runner-tmp-"

// RunnerTelemetryDir is where, inside its RunnerTempPrefix folder, a
// runner's ONNX Runtime keeps its telemetry database when it is on: the
// one nested folder the clean-up of a dead server's socket folder accepts
// there.
const RunnerTelemetryDir = "Microsoft/DeveloperTools/.onnxruntime"

// process is one runner child process and the client connection to it.
// A Runner replaces its process, never reuses it.
type process struct {
	cmd    *exec.Cmd
	pid    int
	socket string
	output *outputLog

	conn   *grpc.ClientConn
	runner runnerpb.RunnerClient
	health healthpb.HealthClient
	// arena is the shared memory of this process's calls; nil when the
	// runner has none (ArenaSize < 0). stream carries the calls once the
	// process is ready.
	arena  *arena
	calls  net.Conn // the server's end of the calls' socket pair
	stream *callStream

	// exited is closed once the process has been reaped; exitErr is
	// cmd.Wait's result and may be read after that. exitCtx is cancelled
	// just after exited is closed.
	exited  chan struct{}
	exitErr error
	// oomBase is the cgroup's out-of-memory kill count before the process
	// started.
	oomBase uint64
	// inflight counts the calls sent to the process and not yet answered
	// (a failed call counts until it has looked at the process's end);
	// inflightAtExit is its value when the process was reaped, read after
	// exited is closed. answered is set by the first call answered.
	inflight       atomic.Int64
	inflightAtExit int64
	answered       atomic.Bool
	answers        atomic.Int64 // calls answered: the runner's progress
	exitCtx        context.Context
	exitCancel     context.CancelFunc
	// tmp is the process's TMPDIR (RunnerTempPrefix), removed by run once
	// the process has been reaped.
	tmp string
}

// startProcess starts a runner child serving on socket and connects a
// client to it; it does not wait for the runner to be ready.
func startProcess(cfg *RunnerConfig, socket string) (*process, error) {
	args := append([]string(nil), cfg.Args...)
	args = append(args, "--socket", socket, "--model", cfg.ModelPath, "--library", cfg.Library)
	args = append(args, cfg.Provider.args()...)
	for _, path := range cfg.JoinCgroups {
		args = append(args, "--join-cgroup", path)
	}
	if cfg.ProcessUnit != "" {
		args = append(args, "--process-unit", cfg.ProcessUnit)
	}
	// The arena goes to the child as an inherited descriptor, not over the
	// socket: it is in place before the child runs, with no handshake, and
	// every process gets a fresh one. The server's own descriptor is
	// close-on-exec, so no other runner inherits it.
	var ar *arena
	var extra []*os.File
	if cfg.ArenaSize > 0 {
		var err error
		// The mailbox lives after the arena in the same memfd
		// (runner_mailbox.go).
		slots := max(0, cfg.MailboxSlots)
		if ar, err = newArena(filepath.Base(socket), cfg.ArenaSize, slots); err != nil {
			return nil, err
		}
		if ar.box != nil && cfg.Provider.AllowSpinning {
			// The model owns its cores: its calls poll for their
			// answers as its runner's workers poll for the calls.
			ar.box.spin = spinning
		}
		args = append(args, "--arena-fd", strconv.Itoa(arenaFD), "--arena-size", strconv.FormatInt(cfg.ArenaSize, 10))
		if slots > 0 {
			args = append(args, "--mailbox-slots", strconv.Itoa(slots))
		}
		extra = append(extra, ar.file)
	}
	// So do the calls: one end of a socket pair, made fresh for each
	// process (runner_stream.go).
	calls, theirs, err := newCallPair()
	if err != nil {
		if ar != nil {
			ar.file.Close()
			ar.close()
		}
		return nil, err
	}
	args = append(args, "--calls-fd", strconv.Itoa(3+len(extra)), "--calls", strconv.Itoa(max(1, cfg.Calls)))
	extra = append(extra, theirs)
	tmp, err := os.MkdirTemp(filepath.Dir(socket), RunnerTempPrefix)
	if err != nil {
		calls.Close()
		theirs.Close()
		if ar != nil {
			ar.file.Close()
			ar.close()
		}
		return nil, fmt.Errorf("runner temporary folder: %w", err)
	}
	cmd := exec.Command(cfg.Executable, args...)
	cmd.ExtraFiles = extra
	// XDG_CACHE_HOME before cfg.Env, which may name another.
	cmd.Env = append(append(append(os.Environ(), "XDG_CACHE_HOME="+tmp), cfg.Env...), "TMPDIR="+tmp)
	// Its own process group keeps a terminal's Ctrl-C away from the runner:
	// the server stops runners itself, in order. Pdeathsig kills the runner
	// when the server dies without stopping it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	out := newOutputLog(cfg.Logger, outputTailLines)
	cmd.Stdout = out.writer("stdout")
	cmd.Stderr = out.writer("stderr")
	cmd.WaitDelay = time.Second

	p := &process{cmd: cmd, socket: socket, output: out, exited: make(chan struct{}), arena: ar, calls: calls, tmp: tmp}
	p.exitCtx, p.exitCancel = context.WithCancel(context.Background())
	started := make(chan error, 1)
	go p.run(started)
	err = <-started
	// The child has its copies; the mapping keeps the memory.
	theirs.Close()
	if ar != nil {
		ar.file.Close()
	}
	if err != nil {
		calls.Close()
		if ar != nil {
			ar.close()
		}
		return nil, err
	}

	conn, err := grpc.NewClient("unix:"+socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMessageSize), grpc.MaxCallSendMsgSize(maxMessageSize)),
		// Tensors are megabytes: windows this large let a whole request
		// travel without waiting for flow-control updates.
		grpc.WithInitialWindowSize(flowWindow),
		grpc.WithInitialConnWindowSize(flowWindow),
		grpc.WithReadBufferSize(ioBuffer), grpc.WithWriteBufferSize(ioBuffer),
		// The socket appears once the model is loaded; until then connection
		// attempts fail at once and cost nothing, so retry them often.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 5 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 50 * time.Millisecond},
			MinConnectTimeout: time.Second,
		}),
	)
	if err != nil {
		p.kill()
		<-p.exited
		calls.Close()
		if ar != nil {
			ar.close()
		}
		return nil, fmt.Errorf("connect to runner: %w", err)
	}
	p.conn = conn
	p.runner = runnerpb.NewRunnerClient(conn)
	p.health = healthpb.NewHealthClient(conn)
	return p, nil
}

// run starts the child and reaps it. Pdeathsig fires when the thread that
// forked the child exits, not the process; locking this goroutine to that
// thread for the child's whole life keeps other goroutines from locking
// the thread and taking it down with them (golang/go#27505).
func (p *process) run(started chan<- error) {
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	if err := p.cmd.Start(); err != nil {
		started <- fmt.Errorf("start %s: %w", p.cmd.Path, err)
		p.removeTemp()
		close(p.exited)
		p.exitCancel()
		return
	}
	p.pid = p.cmd.Process.Pid
	started <- nil
	p.exitErr = p.cmd.Wait()
	p.inflightAtExit = p.inflight.Load()
	p.output.flush()
	p.removeTemp()
	close(p.exited)
	p.exitCancel()
}

// removeTemp removes the process's temporary folder and what the process
// left in it.
func (p *process) removeTemp() {
	if err := os.RemoveAll(p.tmp); err != nil {
		p.output.log.Warn("remove the runner's temporary folder", "dir", p.tmp, "err", err)
	}
}

// busy reports whether the process has a call in flight: one the server
// still waits for, so inside its call timeout (or its extension while
// starved) and its deadline.
func (p *process) busy() bool { return p.inflight.Load() > 0 }

// hasExited reports whether the process has been reaped.
func (p *process) hasExited() bool {
	select {
	case <-p.exited:
		return true
	default:
		return false
	}
}

func (p *process) signal(sig os.Signal) {
	if p.hasExited() {
		return
	}
	// Process.Signal goes through a pidfd: no risk of hitting a reused pid.
	_ = p.cmd.Process.Signal(sig)
}

func (p *process) kill() { p.signal(syscall.SIGKILL) }

// checkHealth asks the runner's health service whether it is serving. The
// check ends early when ctx is done or the process exits.
func (p *process) checkHealth(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	stop := context.AfterFunc(p.exitCtx, cancel)
	defer stop()
	resp, err := p.health.Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		return err
	}
	if s := resp.GetStatus(); s != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("runner reports %s", s)
	}
	return nil
}

// exitStatus describes how the process ended; call it after exited.
func (p *process) exitStatus() string {
	if p.exitErr == nil {
		return "exit status 0"
	}
	return p.exitErr.Error()
}

// openStream opens the call stream once the process is ready. A stream
// that ends, or a runner that breaks its protocol, takes the process out
// of service: it is killed, and the supervisor replaces it.
func (p *process) openStream() error {
	var box *mailbox
	if p.arena != nil {
		box = p.arena.box
	}
	p.stream = openStream(p.calls, box,
		func(c *pendingCall) {
			if c.hasSlot {
				p.arena.free(c.slot)
			}
		},
		func(err error) {
			if p.arena != nil {
				// The process may still write into any slot it was given.
				p.arena.retire()
			}
			if errors.Is(err, io.EOF) {
				// The runner ended the stream because it is stopping: give
				// it the time it takes to finish.
				time.AfterFunc(runnerStopGrace+time.Second, p.kill)
				return
			}
			if !p.hasExited() && p.exitCtx.Err() == nil {
				p.output.log.Warn("runner's call stream ended; killing the process", "pid", p.pid, "err", err)
			}
			p.kill()
		})
	return nil
}

// close releases the stream, the connection, the arena and the socket
// file; call it after exited. The arena is unmapped once the last call
// using it has returned.
func (p *process) close() {
	if p.stream != nil {
		p.stream.close()
	} else {
		p.calls.Close()
	}
	if p.conn != nil {
		p.conn.Close()
	}
	if p.arena != nil {
		p.arena.close()
	}
	if err := os.Remove(p.socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		p.output.log.Warn("remove runner socket", "socket", p.socket, "err", err)
	}
}

// usage reads the process's CPU time and resident memory from /proc.
func (p *process) usage() (cpuSeconds float64, rssBytes int64, err error) {
	return procUsage(p.pid)
}

// userHZ is the unit of the CPU times in /proc/<pid>/stat. It is fixed at
// 100 in the Linux ABI for user space, whatever the kernel's HZ.
const userHZ = 100

func procUsage(pid int) (cpuSeconds float64, rssBytes int64, err error) {
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, err
	}
	cpu, err := parseProcStat(stat)
	if err != nil {
		return 0, 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	statm, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/statm")
	if err != nil {
		return 0, 0, err
	}
	pages, err := parseProcStatm(statm)
	if err != nil {
		return 0, 0, fmt.Errorf("/proc/%d/statm: %w", pid, err)
	}
	return cpu, pages * int64(os.Getpagesize()), nil
}

// parseProcStat returns user plus system CPU seconds from /proc/<pid>/stat.
// The command name, field 2, is in parentheses and may hold spaces and
// parentheses itself, so the fields are counted from the last ')'.
func parseProcStat(stat []byte) (float64, error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, errors.New("no command name")
	}
	// After ") " come fields 3 (state) onwards; utime and stime are 14, 15.
	fields := strings.Fields(string(stat[i+1:]))
	if len(fields) < 13 {
		return 0, fmt.Errorf("only %d fields after the command name", len(fields))
	}
	utime, err := strconv.ParseUint(fields[11], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("utime: %w", err)
	}
	stime, err := strconv.ParseUint(fields[12], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("stime: %w", err)
	}
	return float64(utime+stime) / userHZ, nil
}

// parseProcStatm returns the resident pages from /proc/<pid>/statm.
func parseProcStatm(statm []byte) (int64, error) {
	fields := strings.Fields(string(statm))
	if len(fields) < 2 {
		return 0, fmt.Errorf("only %d fields", len(fields))
	}
	return strconv.ParseInt(fields[1], 10, 64)
}

// outputLog logs a runner's stdout and stderr line by line and keeps the
// last lines for error messages.
type outputLog struct {
	log *slog.Logger

	mu      sync.Mutex
	tail    []string // ring of the last lines
	next    int
	writers []*lineWriter
}

func newOutputLog(log *slog.Logger, lines int) *outputLog {
	return &outputLog{log: log, tail: make([]string, 0, lines)}
}

// writer returns the io.Writer for one stream. os/exec copies the child's
// stream into it from one goroutine.
func (o *outputLog) writer(stream string) *lineWriter {
	w := &lineWriter{o: o, stream: stream}
	o.mu.Lock()
	o.writers = append(o.writers, w)
	o.mu.Unlock()
	return w
}

func (o *outputLog) line(stream, line string) {
	line = stripANSI(line)
	o.log.Info("runner output", "stream", stream, "line", line)
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.tail) < cap(o.tail) {
		o.tail = append(o.tail, line)
		return
	}
	o.tail[o.next] = line
	o.next = (o.next + 1) % len(o.tail)
}

// flush logs what is left of unterminated lines; call it once the writers
// are done (after cmd.Wait).
func (o *outputLog) flush() {
	o.mu.Lock()
	writers := o.writers
	o.mu.Unlock()
	for _, w := range writers {
		if len(w.partial) > 0 {
			o.line(w.stream, string(w.partial))
			w.partial = nil
		}
	}
}

// Tail returns the last n lines, oldest first, joined by newlines.
func (o *outputLog) Tail(n int) string {
	o.mu.Lock()
	defer o.mu.Unlock()
	lines := append(append([]string(nil), o.tail[o.next:]...), o.tail[:o.next]...)
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// maxLine bounds a line held back while waiting for its newline.
const maxLine = 64 << 10

type lineWriter struct {
	o       *outputLog
	stream  string
	partial []byte
}

func (w *lineWriter) Write(b []byte) (int, error) {
	w.partial = append(w.partial, b...)
	rest := w.partial
	for {
		i := bytes.IndexByte(rest, '\n')
		if i < 0 {
			break
		}
		w.o.line(w.stream, string(rest[:i]))
		rest = rest[i+1:]
	}
	if len(rest) > maxLine {
		w.o.line(w.stream, string(rest))
		rest = nil
	}
	w.partial = append(w.partial[:0], rest...)
	return len(b), nil
}

// stripANSI removes terminal escape sequences (ONNX Runtime colours its log
// lines) so that logs and error messages stay plain text.
func stripANSI(s string) string {
	if !strings.Contains(s, "\x1b[") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == 0x1b && i+1 < len(s) && s[i+1] == '[' {
			j := i + 2
			for j < len(s) && (s[j] >= '0' && s[j] <= '9' || s[j] == ';') {
				j++
			}
			if j < len(s) {
				i = j // skip the final byte too
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
