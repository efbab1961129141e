package runtime

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	ort "github.com/yalue/onnxruntime_go"
)

// This file runs a model inside the server process, for small trusted
// models whose latency matters more than isolation: no process hop, no
// copies between processes. The trade: a crash in ONNX Runtime takes the
// server down, the instance's memory and CPU count against the server's
// own cgroup (no limiter unit applies), and nothing restarts it.

// ortEnv is the process's one ONNX Runtime environment. ONNX Runtime can
// be initialised once per process: every in-process instance shares it,
// and it is never torn down, since it could not be created again.
var ortEnv struct {
	mu      sync.Mutex
	library string // the library it was initialised from; "" until then
}

// sharedORT initialises ONNX Runtime in this process from library, once.
// Later calls with the same library do nothing; a different library is an
// error, as one process can load only one.
func sharedORT(library string) error {
	ortEnv.mu.Lock()
	defer ortEnv.mu.Unlock()
	if ortEnv.library != "" {
		if library != ortEnv.library && !sameFile(library, ortEnv.library) {
			return fmt.Errorf("ONNX Runtime is already initialised in this process from %s; cannot load %s too", ortEnv.library, library)
		}
		return nil
	}
	if ort.IsInitialized() {
		// Initialised by someone else in this process (a test's direct
		// session); take it as it is.
		ortEnv.library = library
		return nil
	}
	if err := initORT(library); err != nil {
		return err
	}
	ortEnv.library = library
	return nil
}

func sameFile(a, b string) bool {
	ra, errA := filepath.EvalSymlinks(a)
	rb, errB := filepath.EvalSymlinks(b)
	return errA == nil && errB == nil && ra == rb
}

// InProcessConfig configures an instance that runs in the server process.
type InProcessConfig struct {
	Name      string // for logs and errors; default the model file name
	ModelPath string // the model.onnx file; required
	Library   string // libonnxruntime; required, the same for every instance
	Provider  ProviderOptions
	Logger    *slog.Logger // default slog.Default()
}

// InProcess is a model instance whose ONNX Runtime session lives in the
// server process. It has the Runner's Instance interface; it has no
// process to supervise, restart or check, and no arena: requests reach
// ONNX Runtime over the caller's own memory.
type InProcess struct {
	cfg  InProcessConfig
	log  *slog.Logger
	sess *ortSession

	mu      sync.RWMutex
	stopped bool
	calls   sync.WaitGroup // calls that still use the session

	// runNs is the recent time of a run in nanoseconds, a moving average
	// (0: none yet); it decides whether a call runs on its caller's
	// goroutine (Infer).
	runNs atomic.Int64
}

var _ Instance = (*InProcess)(nil)

// StartInProcess initialises ONNX Runtime in this process if no instance
// has yet, and opens the model's session. A model ONNX Runtime cannot load
// fails with ErrModelLoad; Stop must be called on success.
func StartInProcess(ctx context.Context, cfg InProcessConfig) (*InProcess, error) {
	var errs []error
	if cfg.ModelPath == "" {
		errs = append(errs, errors.New("in-process config: ModelPath is required"))
	}
	if cfg.Library == "" {
		errs = append(errs, errors.New("in-process config: Library is required"))
	}
	if err := cfg.Provider.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("in-process config: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if cfg.Name == "" {
		cfg.Name = filepath.Base(cfg.ModelPath)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default().With("instance", cfg.Name)
	}
	if err := sharedORT(cfg.Library); err != nil {
		return nil, fmt.Errorf("in-process %s: %w", cfg.Name, err)
	}
	start := time.Now()
	sess, err := newORTSession(ortSessionConfig{ModelPath: cfg.ModelPath, Library: cfg.Library, Provider: cfg.Provider})
	if err != nil {
		if errors.Is(err, ErrNoCUDA) {
			return nil, fmt.Errorf("in-process %s: %w", cfg.Name, err)
		}
		return nil, fmt.Errorf("in-process %s: %w: %w", cfg.Name, ErrModelLoad, err)
	}
	cfg.Logger.Info("in-process instance started",
		"model", cfg.ModelPath,
		"provider", cfg.Provider.withDefaults().Kind,
		"onnxruntime", ort.GetVersion(),
		"load", time.Since(start))
	return &InProcess{cfg: cfg, log: cfg.Logger, sess: sess}, nil
}

// Infer runs one request on the session in this process. The caller's
// context ends the wait, not the run: ONNX Runtime finishes it, as a
// runner process would. A call whose runs take little time against its
// deadline (inlineRun) runs on the caller's goroutine instead, without a
// goroutine and a hand-off: its wait ends with the run, a short time
// after a cancellation at most. A stopped instance fails with
// ErrUnavailable.
func (ip *InProcess) Infer(ctx context.Context, req *InferRequest) (*InferResponse, error) {
	ip.mu.RLock()
	if ip.stopped {
		ip.mu.RUnlock()
		return nil, fmt.Errorf("%w: in-process %s is stopped", ErrUnavailable, ip.cfg.Name)
	}
	ip.calls.Add(1)
	ip.mu.RUnlock()

	if ip.inlineRun(ctx) {
		defer ip.calls.Done()
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("in-process %s: %w", ip.cfg.Name, err)
		}
		return ip.timedRun(req)
	}
	type result struct {
		resp *InferResponse
		err  error
	}
	done := make(chan result, 1)
	go func() {
		defer ip.calls.Done()
		resp, err := ip.timedRun(req)
		done <- result{resp, err}
	}()
	select {
	case r := <-done:
		return r.resp, r.err
	case <-ctx.Done():
		return nil, fmt.Errorf("in-process %s: %w", ip.cfg.Name, ctx.Err())
	}
}

// inlineMax bounds the recent run time of a call that runs on its
// caller's goroutine; inlineShare is the most of the time left to its
// deadline that it may take.
const (
	inlineMax   = time.Millisecond
	inlineShare = 4
)

// inlineRun reports whether a call with ctx runs on its caller's
// goroutine: the recent runs were short (at most inlineMax), and a
// quarter of the time left to ctx's deadline (if any) is more than one
// of them. The first call, with nothing learnt, takes a goroutine.
func (ip *InProcess) inlineRun(ctx context.Context) bool {
	est := time.Duration(ip.runNs.Load())
	if est <= 0 || est > inlineMax {
		return false
	}
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) < inlineShare*est {
		return false
	}
	return true
}

// timedRun is run, with its time folded into runNs.
func (ip *InProcess) timedRun(req *InferRequest) (*InferResponse, error) {
	start := time.Now()
	resp, err := ip.run(req)
	learnInto(&ip.runNs, int64(time.Since(start)), inlineMax)
	return resp, err
}

// run is one session run with the runner's checks and errors. A panic in
// the Go binding becomes an error; a crash inside ONNX Runtime cannot be
// caught and takes the server down (the documented trade).
func (ip *InProcess) run(req *InferRequest) (resp *InferResponse, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("%w: in-process %s: panic: %v", ErrInference, ip.cfg.Name, p)
		}
	}()
	// ONNX Runtime reads the inputs where they lie, outside Go: a fault
	// there could not be caught, so a client's mapping is copied first.
	own, err := ownInputs(req)
	if err != nil {
		return nil, fmt.Errorf("in-process %s: %w", ip.cfg.Name, err)
	}
	pb, err := ip.sess.run(requestToProto(own), nil)
	if err != nil {
		if errors.Is(err, ErrInvalidTensor) {
			return nil, fmt.Errorf("%w: %w", ErrInference, err)
		}
		return nil, fmt.Errorf("%w: in-process %s: %v", ErrInference, ip.cfg.Name, err)
	}
	out, err := responseFromProto(pb)
	if err != nil {
		return nil, fmt.Errorf("%w: in-process %s: %v", ErrInference, ip.cfg.Name, err)
	}
	return out, nil
}

// Inputs describes the model's inputs.
func (ip *InProcess) Inputs() []TensorSpec { return slices.Clone(ip.sess.io.inputs) }

// Outputs describes the model's outputs.
func (ip *InProcess) Outputs() []TensorSpec { return slices.Clone(ip.sess.io.outputs) }

// Ready reports whether the instance takes requests: until Stop.
func (ip *InProcess) Ready() bool {
	ip.mu.RLock()
	defer ip.mu.RUnlock()
	return !ip.stopped
}

// Stop refuses new calls, waits for the calls running (until ctx is done)
// and closes the session. The ONNX Runtime environment stays. Calls after
// the first return nil.
func (ip *InProcess) Stop(ctx context.Context) error {
	ip.mu.Lock()
	if ip.stopped {
		ip.mu.Unlock()
		return nil
	}
	ip.stopped = true
	ip.mu.Unlock()
	idle := make(chan struct{})
	go func() {
		ip.calls.Wait()
		close(idle)
	}()
	select {
	case <-idle:
	case <-ctx.Done():
		// A run cannot be cut off in this process: leave the session to
		// the calls still in it rather than free it under them.
		ip.log.Warn("in-process calls still running at stop; the session is left open", "err", context.Cause(ctx))
		return fmt.Errorf("in-process %s: calls still running at stop: %w", ip.cfg.Name, context.Cause(ctx))
	}
	if err := ip.sess.destroy(); err != nil {
		return fmt.Errorf("in-process %s: close session: %w", ip.cfg.Name, err)
	}
	return nil
}
