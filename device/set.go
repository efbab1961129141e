package device

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/simgpu"
)

// Names are a server's devices: the CPU, then each GPU, cuda:0 first:
// the simulated ones when sim is set, else the gpus the machine has
// (NVML's count; 0 without a driver).
func Names(sim *simgpu.Sim, gpus int) []string {
	names := []string{"cpu"}
	if sim != nil {
		gpus = len(sim.Devices())
	}
	for i := range gpus {
		names = append(names, fmt.Sprintf("cuda:%d", i))
	}
	return names
}

// Set is a server's devices, built together at start (NewSet) and closed
// together in reverse (Close). It is what the models need of the devices:
// a scheduler and a limiter by device name.
type Set struct {
	devs   []*Device // in the order built
	byName map[string]*Device
	failed map[string]error // devices that did not start, and why
}

// NewSet builds a device for each name with opts (Options.Name is set
// per device). A device whose limiter or scheduler does not start is
// logged and left out: models on it fail to schedule with its error,
// as they would on a device that does not exist.
func NewSet(names []string, opts Options) *Set {
	s := &Set{byName: map[string]*Device{}, failed: map[string]error{}}
	for _, name := range names {
		o := opts
		o.Name = name
		d, err := New(o)
		if err != nil {
			opts.Logger.Error("device not started; its models cannot load", "device", name, "err", err)
			s.failed[name] = err
			continue
		}
		s.devs = append(s.devs, d)
		s.byName[name] = d
	}
	return s
}

// Scheduler is the scheduler of a device (models.Options.Scheduler).
func (s *Set) Scheduler(name string) (*qos.Scheduler, error) {
	if d, ok := s.byName[name]; ok {
		return d.Scheduler(), nil
	}
	if err, ok := s.failed[name]; ok {
		return nil, err
	}
	return nil, fmt.Errorf("device %s: not on this server (it has %s)", name, strings.Join(s.names(), ", "))
}

// Limiter is the limiter of a device (models.Options.Limiter); nil when
// the device did not start or does not exist: the model's instances then
// start unlimited and its scheduling fails with Scheduler's error.
func (s *Set) Limiter(name string) limiter.Limiter {
	if d, ok := s.byName[name]; ok {
		return d.Limiter()
	}
	return nil
}

// BestEffortMode is the class a best-effort model's instances start in on
// a device (models.Options.BestEffortMode): the background class where
// the device's policy runs best-effort work behind the rest on a limiter
// that has one and cannot change a running instance's class (CapsOnly:
// MPS, where a change is a new client), else the default (ModeCap). A
// CPU limiter moves a running instance between classes in place.
func (s *Set) BestEffortMode(name string) limiter.Mode {
	if d, ok := s.byName[name]; ok && d.lim.Capabilities().CapsOnly && backgroundsBestEffort(d.opts.Control.Policy, d.lim) {
		return limiter.ModeBackground
	}
	return limiter.ModeCap
}

// Lookup is a device by name, nil when there is none.
func (s *Set) Lookup(name string) *Device { return s.byName[name] }

// Devices are the devices that started, in the order built.
func (s *Set) Devices() []*Device { return slices.Clone(s.devs) }

func (s *Set) names() []string {
	out := make([]string, len(s.devs))
	for i, d := range s.devs {
		out[i] = d.Name()
	}
	return out
}

// Close removes every device's limiter units, the last built first; call
// it once the devices' and their loops' Run have returned.
func (s *Set) Close() error {
	var errs []error
	for _, d := range slices.Backward(s.devs) {
		if err := d.Close(); err != nil {
			errs = append(errs, fmt.Errorf("device %s: closing the limiter: %w", d.Name(), err))
		}
	}
	return errors.Join(errs...)
}

// Loops are the control loops of a Set's devices, one each.
type Loops struct {
	all    []*Loop
	byName map[string]*Loop
}

// NewLoops builds the control loop of each device of s over models.
func NewLoops(s *Set, models Models) (*Loops, error) {
	ls := &Loops{byName: map[string]*Loop{}}
	for _, d := range s.devs {
		l, err := NewLoop(d, models)
		if err != nil {
			return nil, err
		}
		ls.all = append(ls.all, l)
		ls.byName[d.Name()] = l
	}
	return ls, nil
}

// All are the loops in the order of their devices.
func (ls *Loops) All() []*Loop { return slices.Clone(ls.all) }

// Lookup is the loop of a device, nil when it has none.
func (ls *Loops) Lookup(name string) *Loop { return ls.byName[name] }
