package runtime

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	goruntime "runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	ort "github.com/yalue/onnxruntime_go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// maxMessageSize bounds one message between server and runner (a gRPC
// message or a call's frame). The server enforces request limits before a
// request gets here.
const maxMessageSize = 1 << 30

// flowWindow is the HTTP/2 flow-control window of the runner connection,
// per stream and per connection. With gRPC's 64 KiB default a 5 MB tensor
// waits for dozens of window updates.
const flowWindow = 64 << 20

// ioBuffer is the size of the runner connection's read and write buffers:
// fewer, larger socket reads and writes for large tensors.
const ioBuffer = 1 << 20

// runnerStopGrace bounds how long a stopping runner waits for calls in
// flight before it cuts them off.
const runnerStopGrace = 5 * time.Second

// runnerFlags are the command-line options of the runner process.
type runnerFlags struct {
	socket   string
	model    string
	library  string
	provider ProviderOptions
	cgroups  pathList
	// unit is a process unit's directory (sched_linux.go); "": none.
	unit string
	// arenaFD and arenaSize name the shared-memory arena the server passed
	// down; arenaFD -1: none.
	arenaFD   int
	arenaSize int64
	// mailboxSlots is the size of the mailbox after the arena
	// (runner_mailbox.go); 0: none.
	mailboxSlots int
	// callsFD is the inherited end of the calls' socket pair
	// (runner_stream.go); -1: none, the runner then only describes itself.
	callsFD int
	// calls is how many calls the server runs at once (RunnerConfig.Calls);
	// 0: Go's default processors.
	calls int
	// mailboxSpin bounds how long a mailbox worker polls for the next
	// call after an answer (mailboxWorkers.poll); 0: it never does.
	// Unset (mailboxSpinSet false) it follows the provider's
	// AllowSpinning (runnerFlags.workerSpin).
	mailboxSpin    time.Duration
	mailboxSpinSet bool
	// procs, when positive, is the Go scheduler's processors
	// (GOMAXPROCS) instead of the ones goProcs derives from calls: for
	// measurements that compare the two.
	procs int
}

// goProcs is the runner's GOMAXPROCS, 0 leaving Go's default: one per
// call the server runs at once, at most the CPUs, and with a mailbox one
// more where the CPUs allow. A mailbox worker waits for its next call in
// a futex system call; were its processor the only one, Go's monitor
// would take it from the sleeping worker once it saw it asleep for a tick
// (no processor idle) and start a thread to look for work, which finds
// none and sleeps again, and the monitor, all processors idle, sleeps
// until the next call's entry into ONNX Runtime wakes it: thread wake-ups
// on every call, just as the server and its clients want the cores for
// the answer. With a processor idle the worker keeps its own while it
// waits (up to 10 ms; it yields now and then, see mailboxWorkers.work),
// and a call wakes the worker's thread. Not beyond the CPUs: a runner of
// 4 calls at once on 2 CPUs with a third processor answered 0.94x the
// calls of one with two (8 callers, the two runners' windows interleaved,
// median of 5), and a runner that busy keeps its processors busy anyway. Calls on the
// socket gain nothing from the spare (their goroutines start where the
// frame was read), so a runner without a mailbox has none.
func (f runnerFlags) goProcs() int {
	switch {
	case f.procs > 0:
		return f.procs
	case f.calls <= 0:
		return 0
	case f.mailboxSlots > 0:
		return min(f.calls+1, goruntime.NumCPU())
	default:
		return min(f.calls, goruntime.NumCPU())
	}
}

// pathList is a repeatable string flag.
type pathList []string

func (l *pathList) String() string { return strings.Join(*l, ",") }

func (l *pathList) Set(v string) error {
	if v == "" {
		return errors.New("empty path")
	}
	*l = append(*l, v)
	return nil
}

func parseRunnerFlags(args []string) (runnerFlags, error) {
	var f runnerFlags
	fs := flag.NewFlagSet("runner", flag.ContinueOnError)
	fs.StringVar(&f.socket, "socket", "", "Unix socket to serve on")
	fs.StringVar(&f.model, "model", "", "ONNX model file")
	fs.StringVar(&f.library, "library", "", "ONNX Runtime shared library")
	fs.StringVar(&f.provider.Kind, "provider", ProviderCPU, "execution provider: cpu or cuda")
	fs.IntVar(&f.provider.DeviceID, "device-id", 0, "CUDA device")
	fs.IntVar(&f.provider.IntraOpThreads, "intra-op-threads", 0, "intra-op threads (0: ONNX Runtime's default)")
	fs.BoolVar(&f.provider.AllowSpinning, "allow-spinning", false, "let idle intra-op threads spin between runs")
	fs.IntVar(&f.provider.InterOpThreads, "inter-op-threads", 0, "inter-op threads (0: ONNX Runtime's default)")
	fs.StringVar(&f.provider.GraphOptimization, "graph-optimization", GraphOptAll, "disable, basic, extended or all")
	fs.Int64Var(&f.provider.GPUMemLimit, "gpu-mem-limit", 0, "CUDA arena limit in bytes (0: unlimited)")
	fs.StringVar(&f.provider.ArenaExtendStrategy, "arena-extend-strategy", ArenaNextPowerOfTwo, "next_power_of_two or same_as_requested")
	fs.Var(&f.cgroups, "join-cgroup", "cgroup.procs file to write the runner's pid to before loading the model (repeatable)")
	fs.StringVar(&f.unit, "process-unit", "", "process unit directory whose scheduling class, affinity and data limit the runner applies to itself before loading the model")
	fs.IntVar(&f.arenaFD, "arena-fd", -1, "inherited descriptor of the shared-memory arena (-1: none)")
	fs.Int64Var(&f.arenaSize, "arena-size", 0, "size of the arena in bytes")
	fs.IntVar(&f.mailboxSlots, "mailbox-slots", 0, "slots of the call mailbox after the arena (0: none)")
	fs.DurationVar(&f.mailboxSpin, "mailbox-spin", workerSpinCap, "how long at most a mailbox worker polls for the next call after an answer before it sleeps (0: never; unset: 40µs, or 1ms with --allow-spinning)")
	fs.IntVar(&f.callsFD, "calls-fd", -1, "inherited descriptor of the calls' socket (-1: none)")
	fs.IntVar(&f.calls, "calls", 0, "calls run at once; the Go scheduler gets as many processors, at most the CPUs (0: Go's default)")
	fs.IntVar(&f.procs, "procs", 0, "the Go scheduler's processors (0: one per call, and one more with a mailbox, at most the CPUs)")
	fs.StringVar(&f.provider.CudnnConvAlgoSearch, "cudnn-conv-algo-search", ConvAlgoExhaustive, "exhaustive, heuristic or default")
	if err := fs.Parse(args); err != nil {
		return f, err
	}
	fs.Visit(func(fl *flag.Flag) { f.mailboxSpinSet = f.mailboxSpinSet || fl.Name == "mailbox-spin" })
	var errs []error
	if fs.NArg() > 0 {
		errs = append(errs, fmt.Errorf("unexpected arguments %q", fs.Args()))
	}
	for name, v := range map[string]string{"--socket": f.socket, "--model": f.model, "--library": f.library} {
		if v == "" {
			errs = append(errs, fmt.Errorf("%s is required", name))
		}
	}
	if f.calls < 0 {
		errs = append(errs, fmt.Errorf("--calls %d is negative", f.calls))
	}
	if f.procs < 0 {
		errs = append(errs, fmt.Errorf("--procs %d is negative", f.procs))
	}
	if f.arenaFD >= 0 && f.arenaSize <= 0 {
		errs = append(errs, errors.New("--arena-fd needs a positive --arena-size"))
	}
	if f.mailboxSlots < 0 || f.mailboxSlots > maxMailboxSlots {
		errs = append(errs, fmt.Errorf("--mailbox-slots %d out of range [0, %d]", f.mailboxSlots, maxMailboxSlots))
	}
	if f.mailboxSpin < 0 || f.mailboxSpin > maxMailboxSpin {
		errs = append(errs, fmt.Errorf("--mailbox-spin %v out of range [0, %v]", f.mailboxSpin, maxMailboxSpin))
	}
	if f.mailboxSlots > 0 && f.arenaFD < 0 {
		errs = append(errs, errors.New("--mailbox-slots needs --arena-fd"))
	}
	errs = append(errs, f.provider.Validate())
	return f, errors.Join(errs...)
}

// RunnerMain is the hidden `runner` subcommand: it hosts one ONNX Runtime
// session for one model and serves it over gRPC (runnerpb.Runner and
// grpc.health.v1) on a Unix socket until ctx is cancelled, then stops
// gracefully. The flags are --socket, --model, --library, --provider,
// --device-id, --intra-op-threads, --inter-op-threads,
// --graph-optimization, --gpu-mem-limit, --arena-extend-strategy and
// --cudnn-conv-algo-search, --join-cgroup (repeatable), --process-unit, and --arena-fd
// with --arena-size for the shared-memory arena it inherits.
//
// A runner does not watch for its parent: the parent starts it with a
// parent-death signal (see StartRunner).
func RunnerMain(ctx context.Context, args []string, logger *slog.Logger) error {
	f, err := parseRunnerFlags(args)
	if err != nil {
		return err
	}
	if n := f.goProcs(); n > 0 {
		// A call's goroutine starts where its frame was read; more
		// processors than calls only add threads to wake and to steal
		// work between (futex wake-ups on every call), except the
		// mailbox's spare (goProcs). A call in ONNX Runtime releases its
		// processor to the next within a sysmon tick, so a late call is
		// not stuck behind it.
		goruntime.GOMAXPROCS(n)
	}
	log := logger.With("model", f.model)
	// Join the instance's cgroups first: ONNX Runtime's threads and the
	// model's memory then belong to them from the start.
	if err := joinCgroups(f.cgroups); err != nil {
		return err
	}
	if len(f.cgroups) > 0 {
		log.Debug("runner joined cgroups", "cgroups", []string(f.cgroups))
	}
	unit, err := joinProcessUnit(f.unit)
	if err != nil {
		return err
	}
	if err := initORT(f.library); err != nil {
		return err
	}
	// A runner that stopped as asked does not tear down its session or
	// ONNX Runtime: the process ends as RunnerMain returns, and the
	// kernel takes its memory and threads back at once. The teardown cost
	// about as much CPU as the rest of the exit, most of it flushing ONNX
	// Runtime's telemetry into one SQLite database in the user's cache
	// folder under its file locks, which many runners stopping at once
	// queued on (TestRunnerStopWritesNoTelemetry). Nothing of it reaches a
	// user: the answers, the goodbye and the logs are out before, and the
	// caller's own clean-up (the Go profiles) runs after. Every other
	// return tears down as before.
	exiting := false
	defer func() {
		if exiting {
			return
		}
		if err := destroyORT(); err != nil {
			log.Warn("destroy ONNX Runtime environment", "err", err)
		}
	}()

	var (
		mem []byte
		box *mailboxMem
	)
	if f.arenaFD >= 0 {
		whole := f.arenaSize
		if f.mailboxSlots > 0 {
			whole = mailboxOffset(f.arenaSize) + mailboxBytes(f.mailboxSlots)
		}
		if mem, err = mapArena(f.arenaFD, whole); err != nil {
			return err
		}
		defer syscall.Munmap(mem)
		if f.mailboxSlots > 0 {
			bm, err := newMailboxMem(mem[mailboxOffset(f.arenaSize):], f.mailboxSlots)
			if err != nil {
				return err
			}
			box = &bm
		}
		mem = mem[:f.arenaSize:f.arenaSize]
	}

	loadStart := time.Now()
	sess, err := newORTSession(ortSessionConfig{ModelPath: f.model, Library: f.library, Provider: f.provider})
	if err != nil {
		unit.outOfMemory(err)
		if errors.Is(err, ErrNoCUDA) {
			return err
		}
		// The parent finds the sentinel's text in the output.
		return fmt.Errorf("%w: %w", ErrModelLoad, err)
	}
	defer func() {
		if !exiting {
			sess.destroy()
		}
	}()

	// Remove a socket left behind by a runner that was killed.
	if err := os.Remove(f.socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove stale socket: %w", err)
	}
	lis, err := net.Listen("unix", f.socket)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	if err := os.Chmod(f.socket, 0o600); err != nil {
		lis.Close()
		return fmt.Errorf("restrict socket: %w", err)
	}

	srv := grpc.NewServer(grpc.MaxRecvMsgSize(maxMessageSize), grpc.MaxSendMsgSize(maxMessageSize),
		grpc.InitialWindowSize(flowWindow), grpc.InitialConnWindowSize(flowWindow),
		grpc.ReadBufferSize(ioBuffer), grpc.WriteBufferSize(ioBuffer))
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	svc := &runnerService{
		sess:     sess,
		unit:     unit,
		log:      log,
		mem:      mem,
		stopping: make(chan struct{}),
		describe: &runnerpb.DescribeResponse{
			Inputs:             specsToProto(sess.io.inputs),
			Outputs:            specsToProto(sess.io.outputs),
			OnnxruntimeVersion: ort.GetVersion(),
			Provider:           f.provider.withDefaults().Kind,
			Pid:                int32(os.Getpid()),
		},
	}
	runnerpb.RegisterRunnerServer(srv, svc)
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus(runnerpb.Runner_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)

	var calls net.Conn
	if f.callsFD >= 0 {
		file := os.NewFile(uintptr(f.callsFD), "calls")
		calls, err = net.FileConn(file)
		file.Close()
		if err != nil {
			lis.Close()
			return fmt.Errorf("calls descriptor: %w", err)
		}
		defer calls.Close()
	}
	callsDone := make(chan struct{})
	if calls != nil {
		go func() {
			defer close(callsDone)
			svc.serveCalls(calls, box, max(1, f.calls), f.workerSpin())
		}()
	} else {
		close(callsDone)
	}

	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(lis) }()
	log.Info("runner ready",
		"socket", f.socket,
		"onnxruntime", ort.GetVersion(),
		"provider", f.provider.withDefaults().Kind,
		"inputs", sess.io.inputs,
		"outputs", sess.io.outputs,
		"procs", goruntime.GOMAXPROCS(0),
		"load", time.Since(loadStart))

	select {
	case err := <-serveErr:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	log.Info("runner stopping")
	hs.Shutdown()
	// The calls end once those in flight are answered.
	close(svc.stopping)
	stopped := make(chan struct{})
	go func() {
		<-callsDone
		srv.GracefulStop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(runnerStopGrace):
		log.Warn("calls still running after grace period; cutting them off", "grace", runnerStopGrace)
		if calls != nil {
			calls.Close()
		}
		srv.Stop()
		<-stopped
	}
	<-serveErr
	exiting = true
	return nil
}

// runnerService answers the runner protocol from an ONNX Runtime session.
type runnerService struct {
	runnerpb.UnimplementedRunnerServer
	sess     *ortSession
	unit     *processUnit // nil outside a process unit
	describe *runnerpb.DescribeResponse
	log      *slog.Logger
	// mem is the shared-memory arena; nil without one.
	mem []byte
	// stopping is closed when the runner stops: streams take no more calls
	// and end once the calls they started are answered.
	stopping chan struct{}
}

func (s *runnerService) Describe(context.Context, *runnerpb.DescribeRequest) (*runnerpb.DescribeResponse, error) {
	return s.describe, nil
}

// workerSpin is how the runner's mailbox workers poll for the next call
// after an answer (mailboxWorkers.poll). By default for up to
// workerSpinCap, and only while the CPU is not wanted elsewhere: a poll
// that loses its CPU turns polling off for a while. A model that lets its
// threads spin (execution.allow_spinning, --allow-spinning: a model that
// owns its cores and wants its latency before the CPU) has its workers
// poll for up to maxMailboxSpin, through the gap between one client's
// calls, and go on polling when they lose the CPU, as ONNX Runtime's own
// spinning threads do (and the server's calls to it poll for their
// answers the same way, startProcess): the wake-up of a sleeping worker,
// the larger part of a small model's hop on a virtual machine, is then
// not paid, at up to maxMailboxSpin of CPU a call (BENCHMARKS.md, "A
// model that owns its cores polls instead of sleeping"). Still never
// while another worker of the runner runs a call, in the idle class, or
// when the calls come further apart than the cap. An explicit
// --mailbox-spin sets the cap and keeps the default's yielding.
func (f runnerFlags) workerSpin() spinPolicy {
	switch {
	case f.mailboxSpinSet:
		return spinPolicy{limit: f.mailboxSpin, preempted: spinPreempted}
	case f.provider.AllowSpinning:
		return spinning
	default:
		return spinPolicy{limit: workerSpinCap, preempted: spinPreempted}
	}
}

// serveCalls answers the calls that come on conn, each in a goroutine of
// its own that writes its answer itself, and those posted in box (nil:
// none) by workers workers, who poll for the next call after an answer as
// spin says (runnerFlags.workerSpin), until the server closes conn or the
// runner stops; stopping, it takes no more calls, answers those it took
// and says goodbye (an empty frame).
func (s *runnerService) serveCalls(conn net.Conn, box *mailboxMem, workers int, spin spinPolicy) {
	w := &frameWriter{conn: conn}
	var mw *mailboxWorkers
	if box != nil {
		mw = &mailboxWorkers{
			mailboxMem: *box,
			answer:     s.infer,
			onSocket:   func(resp *runnerpb.InferResponse) error { return w.write(resp) },
			spin:       spin,
		}
		mw.start(workers)
	}
	var wg sync.WaitGroup
	received := make(chan struct{})
	go func() {
		defer close(received)
		fr := newFrameReader(conn)
		for {
			req := &runnerpb.InferRequest{}
			if err := fr.next(req); err != nil {
				select {
				case <-s.stopping: // the read deadline below
				default:
					if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
						s.log.Warn("reading calls", "err", err)
					}
				}
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := w.write(s.infer(req)); err != nil {
					s.log.Debug("send answer", "id", req.GetId(), "err", err)
				}
			}()
		}
	}()
	select {
	case <-received: // the server closed the connection
	case <-s.stopping:
		_ = conn.SetReadDeadline(time.Now())
		<-received
	}
	wg.Wait()
	if mw != nil {
		// The goodbye comes after every answer, the mailbox's too.
		mw.stop()
	}
	select {
	case <-s.stopping:
		if err := w.writeGoodbye(); err != nil {
			s.log.Debug("send goodbye", "err", err)
		}
	default:
	}
}

// infer answers one call; a failure travels as a status code and message.
func (s *runnerService) infer(req *runnerpb.InferRequest) *runnerpb.InferResponse {
	resp, err := s.sess.run(req, s.mem)
	if err != nil {
		s.unit.outOfMemory(err)
		st, _ := status.FromError(inferStatus(err))
		return &runnerpb.InferResponse{Id: req.GetId(), Code: int32(st.Code()), Message: st.Message()}
	}
	resp.Id = req.GetId()
	return resp
}

// inferStatus maps a session error to the gRPC status the server decodes:
// InvalidArgument when the request is at fault, Internal otherwise. The
// message is ONNX Runtime's or the check's.
func inferStatus(err error) error {
	if errors.Is(err, ErrInvalidTensor) {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

// joinCgroups moves this process (all its threads) into each cgroup by
// writing its pid to the cgroup.procs file.
func joinCgroups(files []string) error {
	pid := []byte(strconv.Itoa(os.Getpid()))
	for _, path := range files {
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			return fmt.Errorf("join cgroup: %w", err)
		}
		_, err = f.Write(pid)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("join cgroup: write pid %s to %s: %w", pid, path, err)
		}
	}
	return nil
}
