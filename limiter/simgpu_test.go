package limiter

import (
	"context"
	"errors"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/simgpu"
)

// The simulator's readings reach the limiter through the nvml.Interface
// real GPUs are read through: devices, utilisation, memory per process,
// and the start-up check.
func TestSimulatedGPUTelemetry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sim, err := simgpu.New(simgpu.Spec{Devices: 2, SMs: 108, Memory: 40 << 30, Name: "simulated A100"})
		if err != nil {
			t.Fatal(err)
		}
		tel, err := NewNVMLTelemetry(sim.NVML(), testLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		defer tel.Close()
		devs, err := tel.Devices()
		if err != nil || len(devs) != 2 || devs[1].MemoryTotal != 40<<30 || devs[1].Name != "simulated A100" ||
			devs[1].ComputeMode != ComputeExclusiveProcess || devs[1].MIGEnabled {
			t.Fatalf("devices %+v, %v", devs, err)
		}

		daemon := func(i int) error {
			d, err := sim.Device(i)
			if err != nil {
				return err
			}
			if !d.DaemonRunning() {
				return errors.New("simulated daemon stopped")
			}
			return nil
		}
		l, err := New(Options{Device: "cuda:1", Telemetry: tel, MPSDaemon: daemon, Logger: testLogger(t)})
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		if _, err := l.Place("bert-1", Share{Compute: 0.5, Memory: 2 << 30}); err != nil {
			t.Fatal(err)
		}
		dev := sim.Devices()[1]
		c, err := dev.StartClient(t.Context(), simgpu.ClientSpec{Name: "bert-1", Percentage: 50, PinnedMemory: 2 << 30, Model: simgpu.Presets["bert-base"]})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := l.(ProcessTracker).Track("bert-1", c.PID()); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Execute(t.Context(), 8); err != nil {
			t.Fatal(err)
		}
		st, err := l.Stats("bert-1")
		if err != nil || st.MemoryBytes != c.Memory() || st.MemoryLimit != 2<<30 {
			t.Errorf("stats %+v, %v; want %d bytes of a 2 GiB limit", st, err, c.Memory())
		}

		tel.Utilization(1) // start a window
		took, _ := c.Execute(t.Context(), 8)
		time.Sleep(3 * took)
		if gpu, _, err := tel.Utilization(1); err != nil || gpu < 0.2 || gpu > 0.3 {
			t.Errorf("utilisation %v, %v; want a quarter (busy one period in four)", gpu, err)
		}
		if gpu, _, _ := tel.Utilization(0); gpu != 0 {
			t.Errorf("idle device utilisation %v", gpu)
		}

		dev.SetDaemon(false)
		if _, err := New(Options{Device: "cuda:1", Telemetry: tel, MPSDaemon: daemon, Logger: testLogger(t)}); !errors.Is(err, ErrMPSUnavailable) || !strings.Contains(err.Error(), "simulated daemon stopped") {
			t.Errorf("without the simulated daemon: %v, want ErrMPSUnavailable", err)
		}
	})
}

func TestSimulatedMIGRefused(t *testing.T) {
	sim, err := simgpu.New(simgpu.Spec{Devices: 1, SMs: 108, Memory: 40 << 30, MIG: true})
	if err != nil {
		t.Fatal(err)
	}
	tel, err := NewNVMLTelemetry(sim.NVML(), testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	_, err = New(Options{Device: "cuda:0", Telemetry: tel, MPSDaemon: func(int) error { return nil }, Logger: testLogger(t)})
	if !errors.Is(err, ErrMPSUnavailable) || !strings.Contains(err.Error(), "MIG mode") {
		t.Errorf("MIG device: %v", err)
	}
}

// The MPS limiter restarts its device's daemon after a fault through
// Options.RestartMPSDaemon, and without one says it cannot.
func TestMPSDaemonRestart(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sim, err := simgpu.New(simgpu.Spec{Devices: 2, SMs: 108, Memory: 40 << 30})
		if err != nil {
			t.Fatal(err)
		}
		tel, err := NewNVMLTelemetry(sim.NVML(), testLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		defer tel.Close()
		var restarted []int
		opts := Options{Backend: BackendMPS, Device: "cuda:1", Telemetry: tel, MPSDaemon: func(int) error { return nil }, Logger: testLogger(t),
			RestartMPSDaemon: func(ctx context.Context, i int) error {
				restarted = append(restarted, i)
				d, _ := sim.Device(i)
				d.RestartDaemon()
				return nil
			}}
		l, err := New(opts)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		r, ok := l.(DaemonRestarter)
		if !ok {
			t.Fatalf("%T is no DaemonRestarter", l)
		}
		dev := sim.Devices()[1]
		dev.Fault(nil, "an uncorrectable ECC error")
		if err := r.RestartDaemon(t.Context()); err != nil || len(restarted) != 1 || restarted[0] != 1 || dev.Faulted() != nil {
			t.Errorf("restart: %v, restarted %v, fault %v", err, restarted, dev.Faulted())
		}
		opts.RestartMPSDaemon = nil
		l2, err := New(opts)
		if err != nil {
			t.Fatal(err)
		}
		defer l2.Close()
		if err := l2.(DaemonRestarter).RestartDaemon(t.Context()); !errors.Is(err, ErrNoDaemonRestart) {
			t.Errorf("without a restart handle: %v, want ErrNoDaemonRestart", err)
		}
	})
}
