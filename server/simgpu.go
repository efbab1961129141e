package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

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

// simulatedDomains are the simulator's GPUs as the recovery knows them.
func simulatedDomains(sim *simgpu.Sim) []device.FaultDomain {
	var out []device.FaultDomain
	for _, d := range sim.Devices() {
		out = append(out, simulatedDomain{d})
	}
	return out
}

// simulatedDomain is a simulated GPU as the recovery knows it.
type simulatedDomain struct{ d *simgpu.Device }

func (s simulatedDomain) Index() int { return s.d.Index() }

func (s simulatedDomain) Fault() (device.DeviceFault, bool) {
	err := s.d.Faulted()
	if err == nil {
		return device.DeviceFault{}, false
	}
	f := device.DeviceFault{Err: err}
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

var _ device.Recoverable = simulatedInstance{}

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
	rec  *device.Recovery
}

var (
	_ models.Instance   = recoveredInstance{}
	_ runtime.Suspecter = recoveredInstance{}
)

func (ri recoveredInstance) Stop(ctx context.Context) error {
	ri.rec.Untrack(ri.self)
	return ri.Simulated.Stop(ctx)
}
