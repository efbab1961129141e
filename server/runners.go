package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync/atomic"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/device"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/runtime"
	"github.com/sloserve/sloserve/simgpu"
)

// newRunnerFactory finds the ONNX Runtime library and this executable and
// prepares the runners' socket folder: the configured one, or a temporary
// one (after removing those of dead servers) that cleanup removes.
// sim, when set, runs cuda models on simulated GPUs; rec, when set,
// recovers them from faults.
func newRunnerFactory(rt configs.Runtime, sim *simgpu.Sim, rec *device.Recovery, logger *slog.Logger) (f *runnerFactory, cleanup func(), err error) {
	lib, err := FindONNXRuntime(rt.ONNXRuntimeLibrary)
	if err != nil {
		return nil, nil, err
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, nil, fmt.Errorf("finding the sloserve executable for runners: %w", err)
	}
	cleanup = func() {}
	socketDir := rt.SocketDir
	if socketDir == "" {
		removeStaleSocketDirs(os.TempDir(), logger)
		if socketDir, err = makeServerDir(dirSockets, ""); err != nil {
			return nil, nil, fmt.Errorf("socket directory: %w", err)
		}
		cleanup = func() { os.RemoveAll(socketDir) }
	} else if err := os.MkdirAll(socketDir, 0o700); err != nil {
		return nil, nil, fmt.Errorf("socket directory: %w", err)
	}
	return &runnerFactory{executable: exe, library: lib, socketDir: socketDir, rt: rt, logger: logger, sim: sim, rec: rec}, cleanup, nil
}

// runnerFactory starts model instances as runner processes of this binary.
type runnerFactory struct {
	executable string
	library    string
	socketDir  string
	rt         configs.Runtime
	logger     *slog.Logger
	// sim, when set, runs cuda models on simulated GPUs; rec recovers
	// them from faults.
	sim *simgpu.Sim
	rec *device.Recovery
}

// start is the registry's NewInstance: one runner process per instance,
// or a session in this process for a model with execution.isolation
// in-process.
func (f *runnerFactory) start(ctx context.Context, spec models.InstanceSpec) (models.Instance, error) {
	name := fmt.Sprintf("%s/%d#%d", spec.Model, spec.Version, spec.Index)
	ex := spec.Config.Execution
	if ex.Isolation == configs.IsolationInProcess {
		return f.startInProcess(ctx, name, spec)
	}
	if f.sim != nil && ex.Provider == configs.ProviderCUDA {
		return f.startSimulated(ctx, spec, name)
	}
	cfg := runtime.RunnerConfig{
		Name:       name,
		ModelPath:  spec.Path,
		Library:    f.library,
		Executable: f.executable,
		SocketDir:  f.socketDir,
		Provider: runtime.ProviderOptions{
			Kind:              ex.Provider,
			DeviceID:          ex.DeviceID,
			IntraOpThreads:    spec.IntraOpThreads,
			InterOpThreads:    ex.InterOpThreads,
			GraphOptimization: ex.GraphOptimization,
			AllowSpinning:     ex.AllowSpinning,
		},
		ReadyTimeout:   f.rt.ReadyTimeout,
		HealthInterval: f.rt.HealthInterval,
		BackoffInitial: f.rt.RestartBackoffInitial,
		BackoffMax:     f.rt.RestartBackoffMax,
		MaxRestarts:    f.rt.MaxRestarts,
		ArenaSize:      arenaSize(f.rt.ArenaSize),
		MailboxSlots:   mailboxSlots(f.rt.CallMailbox),
		Calls:          max(1, ex.Concurrency),
		Logger:         f.logger.With("runner", name),
		OnRestart:      spec.OnRestart,
		OnExit:         spec.OnExit,
		MemoryEvents:   spec.MemoryEvents,
		Restarting:     spec.Restarting,
		JoinCgroups:    spec.Placement.JoinCgroups,
		ProcessUnit:    spec.Placement.ProcessUnit,
		Env:            spec.Placement.Env,
	}
	if c := ex.CUDA; c != nil {
		cfg.Provider.GPUMemLimit = int64(c.GPUMemLimit)
		cfg.Provider.ArenaExtendStrategy = c.ArenaExtendStrategy
		cfg.Provider.CudnnConvAlgoSearch = c.CuDNNConvAlgoSearch
	}
	// The share's GPU memory (MPS) narrows the configured arena limit.
	if pl := spec.Placement; pl.GPUMemLimit > 0 {
		if cfg.Provider.GPUMemLimit == 0 || pl.GPUMemLimit < cfg.Provider.GPUMemLimit {
			cfg.Provider.GPUMemLimit = pl.GPUMemLimit
		}
		if pl.ArenaExtendStrategy != "" {
			cfg.Provider.ArenaExtendStrategy = pl.ArenaExtendStrategy
		}
	}
	if pl := spec.Placement; pl.CudnnConvAlgoSearch != "" {
		cfg.Provider.CudnnConvAlgoSearch = pl.CudnnConvAlgoSearch
	}
	r, err := runtime.StartRunner(ctx, cfg)
	if err != nil {
		return nil, err
	}
	return runnerInstance{r}, nil
}

// startInProcess opens the model's session in the server process. The
// instance's limiter unit stays empty: its share sizes only its intra-op
// threads; no cgroup limit applies to it, and there is no process to
// restart (spec.Restarting is unused).
func (f *runnerFactory) startInProcess(ctx context.Context, name string, spec models.InstanceSpec) (models.Instance, error) {
	ex := spec.Config.Execution
	log := f.logger.With("instance", name)
	if len(spec.Placement.JoinCgroups) > 0 {
		log.Warn("in-process instance runs in the server's cgroup; its share's CPU and memory limits do not apply")
	}
	provider := runtime.ProviderOptions{
		Kind:              ex.Provider,
		DeviceID:          ex.DeviceID,
		IntraOpThreads:    spec.IntraOpThreads,
		InterOpThreads:    ex.InterOpThreads,
		GraphOptimization: ex.GraphOptimization,
		AllowSpinning:     ex.AllowSpinning,
	}
	if c := ex.CUDA; c != nil {
		provider.GPUMemLimit = int64(c.GPUMemLimit)
		provider.ArenaExtendStrategy = c.ArenaExtendStrategy
		provider.CudnnConvAlgoSearch = c.CuDNNConvAlgoSearch
	}
	ip, err := runtime.StartInProcess(ctx, runtime.InProcessConfig{
		Name:      name,
		ModelPath: spec.Path,
		Library:   f.library,
		Provider:  provider,
		Logger:    log,
	})
	if err != nil {
		return nil, err
	}
	return inProcessInstance{ip}, nil
}

// inProcessInstance adapts an in-process session to the registry's
// Instance. It reports no usage: its CPU and memory are the server's.
type inProcessInstance struct{ *runtime.InProcess }

var _ models.Instance = inProcessInstance{}

func (ii inProcessInstance) Status() (bool, string) {
	if ii.Ready() {
		return true, ""
	}
	return false, "in-process instance stopped"
}

// runnerInstance adapts a runner process to the registry's Instance.
type runnerInstance struct{ *runtime.Runner }

var (
	_ models.Instance = runnerInstance{}
	_ models.Usager   = runnerInstance{}
)

func (ri runnerInstance) Status() (bool, string) {
	if ri.State() == runtime.RunnerReady {
		return true, ""
	}
	return false, fmt.Sprintf("runner %s: %s", ri.State(), ri.Reason())
}

// arenaSize turns runtime.arena_size into RunnerConfig.ArenaSize, where 0
// means the default and a negative size none.
func arenaSize(n configs.ByteSize) int64 {
	if n <= 0 {
		return -1
	}
	return int64(n)
}

// mailboxSlots turns runtime.call_mailbox into RunnerConfig.MailboxSlots,
// where 0 means the default and a negative count none.
func mailboxSlots(on bool) int {
	if on {
		return 0
	}
	return -1
}

// startSimulated starts an instance of a cuda model on its simulated GPU
// (another one when the model is risky: recovery.deviceFor), known to the
// device recovery while it runs.
func (f *runnerFactory) startSimulated(ctx context.Context, spec models.InstanceSpec, name string) (models.Instance, error) {
	ex := spec.Config.Execution
	dev, err := f.sim.Device(ex.DeviceID)
	if err != nil {
		return nil, fmt.Errorf("execution.device_id %d: %w", ex.DeviceID, err)
	}
	m, err := ex.Simulated.Model()
	if err != nil {
		return nil, fmt.Errorf("execution.simulated: %w", err)
	}
	m.Name = spec.Model
	// A simulated client's share, as an MPS client's, is fixed at its
	// start, and a restart replaces the client at it: the Restarting hook
	// only tells a backend that accounts by process the new client's pid.
	cfg := runtime.SimulatedConfig{
		Name: name, ModelPath: spec.Path, Device: dev, Model: m,
		Env: spec.Placement.Env, Batched: spec.Config.MaxBatchSize > 0,
		OnExit: spec.OnExit, OnRestart: spec.OnRestart, Restarting: spec.Restarting,
		Logger: f.logger.With("instance", name),
	}
	rec := f.rec
	if rec == nil {
		return runtime.StartSimulated(ctx, cfg)
	}
	if cfg.Device, err = f.sim.Device(rec.DeviceFor(spec.Model, dev.Index())); err != nil {
		return nil, err
	}
	cfg.PlacedFor = dev
	var self atomic.Pointer[runtime.Simulated]
	cfg.OnExit = func(e runtime.Exit) {
		if spec.OnExit != nil {
			spec.OnExit(e)
		}
		if s := self.Load(); s != nil {
			rec.Exited(s.Device().Index())
		} else {
			rec.Exited(cfg.Device.Index())
		}
	}
	cfg.OnRestart = func(reason string) {
		if spec.OnRestart != nil {
			spec.OnRestart(reason)
		}
		if s := self.Load(); s != nil {
			rec.Restarted(simulatedInstance{s, f.sim}, reason)
		}
	}
	s, err := runtime.StartSimulated(ctx, cfg)
	if err != nil {
		if errors.Is(err, simgpu.ErrOutOfMemory) {
			rec.StartFailed(name, cfg.Device.Index(), err)
		}
		return nil, err
	}
	self.Store(s)
	si := simulatedInstance{s, f.sim}
	rec.Track(si, spec.Config)
	if s.Gone() { // a fault before it was tracked
		rec.Exited(s.Device().Index())
	}
	return recoveredInstance{s, si, rec}, nil
}

// FindONNXRuntime returns the ONNX Runtime library runners should load:
// the configured path, or the first that exists of the places the project's
// set-up and the container image put it.
func FindONNXRuntime(configured string) (string, error) {
	if configured != "" {
		if _, err := os.Stat(configured); err != nil {
			return "", fmt.Errorf("runtime.onnxruntime_library: %w", err)
		}
		return configured, nil
	}
	var candidates []string
	const rel = "deps/onnxruntime/libonnxruntime.so.1.30.0"
	candidates = append(candidates, rel)
	if exe, err := os.Executable(); err == nil {
		candidates = append(candidates, filepath.Join(filepath.Dir(exe), "..", rel))
	}
	candidates = append(candidates,
		"/opt/sloserve/lib/libonnxruntime.so.1.30.0",
		"/usr/local/lib/libonnxruntime.so",
		"/usr/lib/libonnxruntime.so",
	)
	for _, c := range candidates {
		if _, err := os.Stat(c); err == nil {
			return filepath.Abs(c)
		}
	}
	return "", fmt.Errorf("ONNX Runtime library not found (looked in %v); run `make setup` or set SLOSERVE_ONNXRUNTIME_LIBRARY", candidates)
}
