package device

import (
	"log/slog"
	"slices"
	"strings"
	"testing"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/predictor"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/simgpu"
)

func setOptions(t *testing.T, backend string, sim *simgpu.Sim) Options {
	t.Helper()
	cfg := configs.DefaultServer()
	cfg.Control.Limiter = backend
	pred, err := predictor.New(predictor.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return Options{QoS: cfg.QoS, Control: cfg.Control, Predictor: pred, Gate: qos.NewGate(0, 0), Sim: sim,
		Logger: slog.New(slog.DiscardHandler)}
}

// A server's devices are the CPU and each GPU, built together before any
// model loads: each has its limiter and scheduler, and its control loop
// once the models exist. A device no config or machine has is an error
// that names the devices there are.
func TestSetBuildsEveryDeviceAtStart(t *testing.T) {
	sim, err := simgpu.New(simgpu.Spec{Devices: 2, SMs: 108, Memory: 40 << 30})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := Names(sim, 5), []string{"cpu", "cuda:0", "cuda:1"}; !slices.Equal(got, want) {
		t.Errorf("Names with the simulator = %q, want %q (the simulated GPUs, not the machine's)", got, want)
	}
	if got, want := Names(nil, 1), []string{"cpu", "cuda:0"}; !slices.Equal(got, want) {
		t.Errorf("Names without the simulator = %q, want %q", got, want)
	}
	set := NewSet(Names(sim, 0), setOptions(t, limiter.BackendNone, sim))
	t.Cleanup(func() {
		if err := set.Close(); err != nil {
			t.Error(err)
		}
	})
	var built []string
	for _, d := range set.Devices() {
		built = append(built, d.Name())
		if s, err := set.Scheduler(d.Name()); err != nil || s != d.Scheduler() || set.Limiter(d.Name()) != d.Limiter() {
			t.Errorf("%s: scheduler %p, %v; limiter %v", d.Name(), s, err, set.Limiter(d.Name()))
		}
	}
	if want := []string{"cpu", "cuda:0", "cuda:1"}; !slices.Equal(built, want) {
		t.Fatalf("built %q before any model, want %q", built, want)
	}
	if _, err := set.Scheduler("cuda:2"); err == nil || !strings.Contains(err.Error(), "cpu, cuda:0, cuda:1") {
		t.Errorf("an unknown device: %v, want an error naming the devices", err)
	}
	if set.Limiter("cuda:2") != nil {
		t.Error("an unknown device has a limiter")
	}
	loops, err := NewLoops(set, &fakeModels{device: "cpu"})
	if err != nil {
		t.Fatal(err)
	}
	var looped []string
	for _, l := range loops.All() {
		looped = append(looped, l.Device().Name())
		if loops.Lookup(l.Device().Name()) != l || l.Adjuster() == nil {
			t.Errorf("%s: lookup or adjuster missing", l.Device().Name())
		}
	}
	if !slices.Equal(looped, built) {
		t.Errorf("loops on %q, want one per device, %q", looped, built)
	}
}

// A device that does not start is left out and answers its error to the
// models that would load on it; the others serve.
func TestSetKeepsAFailedDevicesError(t *testing.T) {
	sim, err := simgpu.New(simgpu.Spec{Devices: 1, SMs: 108, Memory: 40 << 30, NoDaemon: true})
	if err != nil {
		t.Fatal(err)
	}
	// MPS on a simulated GPU without its daemon does not start.
	set := NewSet([]string{"cuda:0"}, setOptions(t, limiter.BackendMPS, sim))
	defer set.Close()
	if len(set.Devices()) != 0 {
		t.Fatalf("devices %v, want none", set.Devices())
	}
	if _, err := set.Scheduler("cuda:0"); err == nil || !strings.Contains(err.Error(), "device cuda:0: limiter") {
		t.Errorf("scheduler of the failed device: %v, want its limiter's error", err)
	}
}

// A best-effort model starts in the background class on a device whose
// policy puts it there and whose limiter cannot change a running
// instance's class (MPS, simulated here), else in the default.
func TestSetBestEffortMode(t *testing.T) {
	sim, err := simgpu.New(simgpu.Spec{Devices: 1, SMs: 108, Memory: 40 << 30})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		policy string
		want   limiter.Mode
	}{
		{"adaptive", limiter.ModeBackground},
		{"static", limiter.ModeCap},
		{"shared", limiter.ModeCap},
	} {
		t.Run(tc.policy, func(t *testing.T) {
			opts := setOptions(t, limiter.BackendMPS, sim)
			opts.Control.Policy = tc.policy
			set := NewSet([]string{"cuda:0"}, opts)
			t.Cleanup(func() { _ = set.Close() })
			if set.Lookup("cuda:0") == nil {
				t.Fatal("cuda:0 did not start")
			}
			if got := set.BestEffortMode("cuda:0"); got != tc.want {
				t.Errorf("cuda:0: %v, want %v", got, tc.want)
			}
			if got := set.BestEffortMode("cuda:1"); got != limiter.ModeCap {
				t.Errorf("a device the set does not have: %v, want the default", got)
			}
		})
	}
}
