package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/device"
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
	if cfg.Device, err = f.sim.Device(rec.deviceFor(spec.Model, dev.Index())); err != nil {
		return nil, err
	}
	cfg.PlacedFor = dev
	var self atomic.Pointer[runtime.Simulated]
	cfg.OnExit = func(e runtime.Exit) {
		if spec.OnExit != nil {
			spec.OnExit(e)
		}
		if s := self.Load(); s != nil {
			rec.exited(s.Device().Index())
		} else {
			rec.exited(cfg.Device.Index())
		}
	}
	cfg.OnRestart = func(reason string) {
		if spec.OnRestart != nil {
			spec.OnRestart(reason)
		}
		if s := self.Load(); s != nil {
			rec.restarted(simulatedInstance{s, f.sim}, reason)
		}
	}
	s, err := runtime.StartSimulated(ctx, cfg)
	if err != nil {
		if errors.Is(err, simgpu.ErrOutOfMemory) {
			rec.startFailed(name, cfg.Device.Index(), err)
		}
		return nil, err
	}
	self.Store(s)
	si := simulatedInstance{s, f.sim}
	rec.track(si, spec.Config)
	if s.Gone() { // a fault before it was tracked
		rec.exited(s.Device().Index())
	}
	return recoveredInstance{s, si, rec}, nil
}

// simulatedDomains are the simulator's GPUs as the recovery knows them.
func simulatedDomains(sim *simgpu.Sim) []faultDomain {
	var out []faultDomain
	for _, d := range sim.Devices() {
		out = append(out, simulatedDomain{d})
	}
	return out
}

// simulatedDomain is a simulated GPU as the recovery knows it.
type simulatedDomain struct{ d *simgpu.Device }

func (s simulatedDomain) Index() int { return s.d.Index() }

func (s simulatedDomain) Fault() (deviceFault, bool) {
	err := s.d.Faulted()
	if err == nil {
		return deviceFault{}, false
	}
	f := deviceFault{Err: err}
	var fe *simgpu.FaultError
	if errors.As(err, &fe) {
		f.At, f.Client = fe.At, fe.Client
	}
	return f, true
}

// simulatedInstance is a simulated instance as the recovery knows it.
type simulatedInstance struct {
	s   *runtime.Simulated
	sim *simgpu.Sim
}

var _ recoverable = simulatedInstance{}

func (si simulatedInstance) Name() string  { return si.s.Name() }
func (si simulatedInstance) Device() int   { return si.s.Device().Index() }
func (si simulatedInstance) Gone() bool    { return si.s.Gone() }
func (si simulatedInstance) Failed() int64 { return si.s.Failed() }

func (si simulatedInstance) Recover(ctx context.Context, device int, reason string) error {
	d, err := si.sim.Device(device)
	if err != nil {
		return err
	}
	return si.s.Recover(ctx, d, reason)
}

// simDaemon restarts a simulated device's daemon directly: the handle of a
// device whose limiter is not MPS (the shared policy runs none).
type simDaemon struct{ d *simgpu.Device }

func (s simDaemon) RestartDaemon(ctx context.Context) error {
	s.d.RestartDaemon()
	return ctx.Err()
}

// daemonOf is the daemon handle of a simulated device by index: its
// limiter's when the limiter has one (MPS), else the simulator's.
func daemonOf(devs *device.Set, sim *simgpu.Sim) func(int) limiter.DaemonRestarter {
	return func(i int) limiter.DaemonRestarter {
		if d := devs.Lookup(fmt.Sprintf("cuda:%d", i)); d != nil {
			if r, ok := d.Limiter().(limiter.DaemonRestarter); ok {
				return r
			}
		}
		dev, err := sim.Device(i)
		if err != nil {
			return nil
		}
		return simDaemon{dev}
	}
}

// recoveredInstance is a simulated instance the device recovery tracks
// until it stops.
type recoveredInstance struct {
	*runtime.Simulated
	self simulatedInstance
	rec  *recovery
}

var (
	_ models.Instance   = recoveredInstance{}
	_ runtime.Suspecter = recoveredInstance{}
)

func (ri recoveredInstance) Stop(ctx context.Context) error {
	ri.rec.untrack(ri.self)
	return ri.Simulated.Stop(ctx)
}
