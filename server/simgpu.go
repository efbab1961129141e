package server

import (
	"context"
	"fmt"
	"log/slog"
	goruntime "runtime"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/runtime"
	"github.com/sloserve/sloserve/simgpu"
)

// newSimulator starts the simulated GPUs gpu.simulator asks for; nil when
// it is off.
func newSimulator(g configs.GPU, log *slog.Logger) (*simgpu.Sim, error) {
	spec := g.Simulator.Spec()
	if spec == nil {
		return nil, nil
	}
	sim, err := simgpu.New(*spec)
	if err != nil {
		return nil, fmt.Errorf("gpu.simulator: %w", err)
	}
	log.Warn("cuda models run on simulated GPUs: their outputs are zeros of the right shapes, not the models' answers",
		"devices", spec.Devices, "sms", spec.SMs, "memory", spec.Memory, "mps_daemon", !spec.NoDaemon, "mig", spec.MIG)
	return sim, nil
}

// simulatedDevice is the simulated GPU behind a device name ("cuda:N"),
// nil when the device is not simulated.
func simulatedDevice(sim *simgpu.Sim, device string) *simgpu.Device {
	n, ok := strings.CutPrefix(device, "cuda:")
	if sim == nil || !ok {
		return nil
	}
	i, err := strconv.Atoi(n)
	if err != nil {
		return nil
	}
	d, err := sim.Device(i)
	if err != nil {
		return nil
	}
	return d
}

// simulatedLimiterOptions reads a simulated GPU's telemetry and MPS daemon
// through the simulator, as a real GPU's are read through NVML and the
// daemon's pipe.
func simulatedLimiterOptions(sim *simgpu.Sim, opts *limiter.Options) error {
	tel, err := limiter.NewNVMLTelemetry(sim.NVML(), opts.Logger)
	if err != nil {
		return err
	}
	opts.Telemetry = tel
	opts.RestartMPSDaemon = simulatedRestart(sim)
	opts.MPSDaemon = func(i int) error {
		d, err := sim.Device(i)
		if err != nil {
			return err
		}
		if !d.DaemonRunning() {
			return fmt.Errorf("the simulated device %d has no MPS control daemon (gpu.simulator.mps_daemon is false, or it is recovering from a fault)", i)
		}
		return nil
	}
	return nil
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
	cfg := runtime.SimulatedConfig{
		Name: name, ModelPath: spec.Path, Device: dev, Model: m,
		Env: spec.Placement.Env, Batched: spec.Config.MaxBatchSize > 0,
		OnExit: spec.OnExit, OnRestart: spec.OnRestart, Logger: f.logger.With("instance", name),
	}
	rec := f.rec
	if rec == nil {
		return runtime.StartSimulated(ctx, cfg)
	}
	cfg.Device, cfg.PlacedFor = rec.deviceFor(spec.Model, dev), dev
	var self atomic.Pointer[runtime.Simulated]
	cfg.OnExit = func(e runtime.Exit) {
		if spec.OnExit != nil {
			spec.OnExit(e)
		}
		if s := self.Load(); s != nil {
			rec.exited(s.Device())
		} else {
			rec.exited(cfg.Device)
		}
	}
	cfg.OnRestart = func(reason string) {
		if spec.OnRestart != nil {
			spec.OnRestart(reason)
		}
		if s := self.Load(); s != nil {
			rec.restarted(s, reason)
		}
	}
	s, err := runtime.StartSimulated(ctx, cfg)
	if err != nil {
		rec.startFailed(name, cfg.Device, err)
		return nil, err
	}
	self.Store(s)
	rec.track(s, spec.Config)
	if s.Gone() { // a fault before it was tracked
		rec.exited(s.Device())
	}
	return recoveredInstance{s, rec}, nil
}

// recoveredInstance is a simulated instance the device recovery tracks
// until it stops.
type recoveredInstance struct {
	*runtime.Simulated
	rec *recovery
}

var (
	_ models.Instance   = recoveredInstance{}
	_ runtime.Suspecter = recoveredInstance{}
)

func (ri recoveredInstance) Stop(ctx context.Context) error {
	ri.rec.untrack(ri.Simulated)
	return ri.Simulated.Stop(ctx)
}

// mpsClients is how many executions a GPU under MPS runs at once: one per
// client, up to the 48 clients an MPS server takes per device since Volta
// (NVIDIA's MPS documentation, "Limitations", as we remember it; newer
// drivers may take more: check before relying on it). Each model's own slots
// (instances × concurrency) bound its share of them.
const mpsClients = 48

// deviceSlots is how many executions a device runs at once across its
// models. CPU: qos.device_slots, else one per core. GPU: the clients of an
// MPS server run their kernels at once, each within its percentage, so a
// GPU whose limiter is MPS, or a simulated GPU whose daemon runs (the
// shared policy's unlimited clients), takes mpsClients; a GPU without MPS
// time-slices its contexts and takes one.
func deviceSlots(name string, configured int, lim limiter.Limiter, sim *simgpu.Sim) int {
	if !strings.HasPrefix(name, "cuda:") {
		if configured > 0 {
			return configured
		}
		return goruntime.NumCPU()
	}
	if lim.Kind() == limiter.KindMPS {
		return mpsClients
	}
	if d := simulatedDevice(sim, name); d != nil && d.DaemonRunning() {
		return mpsClients
	}
	return 1
}
