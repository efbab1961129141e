package server

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/runtime"
	"github.com/sloserve/sloserve/simgpu"
)

// newRunnerFactory finds the ONNX Runtime library and this executable and
// prepares the runners' socket folder: the configured one, or a temporary
// one (after removing those of dead servers) that cleanup removes.
func newRunnerFactory(rt configs.Runtime, logger *slog.Logger) (f *runnerFactory, cleanup func(), err error) {
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
		if socketDir, err = os.MkdirTemp("", fmt.Sprintf("%s%d-", socketDirPrefix, os.Getpid())); err != nil {
			return nil, nil, fmt.Errorf("socket directory: %w", err)
		}
		cleanup = func() { os.RemoveAll(socketDir) }
	} else if err := os.MkdirAll(socketDir, 0o700); err != nil {
		return nil, nil, fmt.Errorf("socket directory: %w", err)
	}
	return &runnerFactory{executable: exe, library: lib, socketDir: socketDir, rt: rt, logger: logger}, cleanup, nil
}

// runnerFactory starts model instances as runner processes of this binary.
type runnerFactory struct {
	executable string
	library    string
	socketDir  string
	rt         configs.Runtime
	logger     *slog.Logger
	// sim, when set, runs cuda models on simulated GPUs.
	sim *simgpu.Sim
}

// start is the registry's NewInstance: one runner process per instance.
func (f *runnerFactory) start(ctx context.Context, spec models.InstanceSpec) (models.Instance, error) {
	name := fmt.Sprintf("%s/%d#%d", spec.Model, spec.Version, spec.Index)
	ex := spec.Config.Execution
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
		Logger:         f.logger.With("runner", name),
		OnRestart:      spec.OnRestart,
		OnExit:         spec.OnExit,
		MemoryEvents:   spec.MemoryEvents,
		JoinCgroups:    spec.Placement.JoinCgroups,
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
	r, err := runtime.StartRunner(ctx, cfg)
	if err != nil {
		return nil, err
	}
	return runnerInstance{r}, nil
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
