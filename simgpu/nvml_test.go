package simgpu

import (
	"math"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// smUtil reads per-process utilisation through the simulator's NVML, as
// the limiter does: percent by pid, and the newest sample's timestamp.
func smUtil(t *testing.T, lib nvml.Interface, lastSeen uint64) (map[int]uint32, uint64, nvml.Return) {
	t.Helper()
	dev, ret := lib.DeviceGetHandleByIndex(0)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	samples, ret := dev.GetProcessUtilization(lastSeen)
	out := map[int]uint32{}
	var newest uint64
	for _, s := range samples {
		if s.TimeStamp <= lastSeen {
			t.Errorf("sample %+v is not newer than %d", s, lastSeen)
		}
		out[int(s.Pid)] = s.SmUtil
		newest = max(newest, s.TimeStamp)
	}
	return out, newest, ret
}

// One client at 50% of the SMs (a model that can use them), busy half of
// the window, used a quarter of the device; the next window, idle, none.
func TestProcessUtilizationHalfCapHalfBusy(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sim := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30})
		d, lib := sim.Devices()[0], sim.NVML()
		c := start(t, d, ClientSpec{Name: "a", Percentage: 50, Model: flat})
		execute(t, c, 1) // warm-up
		_, seen, ret := smUtil(t, lib, 0)
		if ret != nvml.SUCCESS {
			t.Fatal(ret)
		}
		d.Utilization() // the device-wide window starts here too
		took := execute(t, c, 1)
		time.Sleep(took) // as long idle as busy
		util, seen2, ret := smUtil(t, lib, seen)
		if ret != nvml.SUCCESS || len(util) != 1 || util[c.PID()] != 25 {
			t.Errorf("per-process SM utilisation %v (%v), want {%d: 25}", util, ret, c.PID())
		}
		gpu, _ := d.Utilization()
		if math.Abs(gpu-0.5) > 0.01 {
			t.Errorf("device utilisation %.3f, want 0.5 (a kernel ran half the time)", gpu)
		}
		time.Sleep(time.Second)
		if util, _, ret := smUtil(t, lib, seen2); ret != nvml.SUCCESS || util[c.PID()] != 0 {
			t.Errorf("idle window: %v (%v), want {%d: 0}", util, ret, c.PID())
		}
		// Nothing newer than now: NVML's NOT_FOUND.
		if _, _, ret := smUtil(t, lib, uint64(time.Now().UnixMicro())); ret != nvml.ERROR_NOT_FOUND {
			t.Errorf("no newer sample: %v, want ERROR_NOT_FOUND", ret)
		}
	})
}

// Two clients at 60% each, running together, oversubscribe the SMs: MPS
// splits them in proportion, so each holds half the device, and the sum of
// the per-process readings is the device's utilisation (it was full).
// A client that closed is still reported for the window it ran in.
func TestProcessUtilizationOversubscribed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sim := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30})
		d, lib := sim.Devices()[0], sim.NVML()
		m := flat
		m.Saturation = 1
		a := start(t, d, ClientSpec{Name: "a", Percentage: 60, Model: m})
		b := start(t, d, ClientSpec{Name: "b", Percentage: 60, Model: m})
		execute(t, a, 1)
		execute(t, b, 1)
		_, seen, _ := smUtil(t, lib, 0)
		d.Utilization()
		var wg sync.WaitGroup
		for _, c := range []*Client{a, b} {
			wg.Go(func() { execute(t, c, 1) })
		}
		wg.Wait()
		b.Close()
		util, _, ret := smUtil(t, lib, seen)
		if ret != nvml.SUCCESS || util[a.PID()] != 50 || util[b.PID()] != 50 {
			t.Errorf("per-process SM utilisation %v (%v), want 50 each for %d and %d", util, ret, a.PID(), b.PID())
		}
		gpu, _ := d.Utilization()
		if sum := float64(util[a.PID()]+util[b.PID()]) / 100; math.Abs(gpu-sum) > 0.01 {
			t.Errorf("device utilisation %.3f, per-process sum %.3f: want them equal on a full device", gpu, sum)
		}
	})
}

// Without a daemon, clients time-slice: each holds its SMs half the time.
func TestProcessUtilizationTimeSliced(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sim := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30, NoDaemon: true})
		d := sim.Devices()[0]
		m := flat
		m.Saturation = 1
		a := start(t, d, ClientSpec{Name: "a", Model: m})
		b := start(t, d, ClientSpec{Name: "b", Model: m})
		execute(t, a, 1)
		execute(t, b, 1)
		_, at := d.ProcessUtilization(time.Time{})
		var wg sync.WaitGroup
		for _, c := range []*Client{a, b} {
			wg.Go(func() { execute(t, c, 1) })
		}
		wg.Wait()
		util, _ := d.ProcessUtilization(at)
		if math.Abs(util[a.PID()]-0.5) > 0.01 || math.Abs(util[b.PID()]-0.5) > 0.01 {
			t.Errorf("time-sliced utilisation %v, want 0.5 each", util)
		}
	})
}
