package limiter

import (
	"math"
	"testing"
	"testing/synctest"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"

	"github.com/sloserve/sloserve/simgpu"
)

// The MPS limiter reads the simulator's per-process utilisation through
// NVML once per call and gives each tracked unit its process's: a client at
// half the SMs, busy one period in four, used an eighth of the device; an
// idle tracked client none; the next window starts where the last ended.
func TestSimulatedGPUUsage(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sim, err := simgpu.New(simgpu.Spec{Devices: 1, SMs: 108, Memory: 40 << 30})
		if err != nil {
			t.Fatal(err)
		}
		tel, err := NewNVMLTelemetry(sim.NVML(), testLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		defer tel.Close()
		l, err := New(Options{Device: "cuda:0", Telemetry: tel, MPSDaemon: func(int) error { return nil }, Logger: testLogger(t)})
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		dev := sim.Devices()[0]
		m := simgpu.Presets["bert-base"] // batch 8 can use every SM: the cap binds
		var clients []*simgpu.Client
		for _, id := range []string{"busy", "idle", "untracked"} {
			if _, err := l.Place(id, Share{Compute: 0.5, Memory: 4 << 30}); err != nil {
				t.Fatal(err)
			}
			c, err := dev.StartClient(t.Context(), simgpu.ClientSpec{Name: id, Percentage: 50, PinnedMemory: 4 << 30, Model: m})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if id != "untracked" {
				if err := l.(ProcessTracker).Track(id, c.PID()); err != nil {
					t.Fatal(err)
				}
			}
			clients = append(clients, c)
		}
		if _, err := clients[0].Execute(t.Context(), 8); err != nil { // warm-up
			t.Fatal(err)
		}
		r := l.(UsageReader)
		if _, err := r.Usage(); err != nil { // the window starts here
			t.Fatal(err)
		}
		took, err := clients[0].Execute(t.Context(), 8)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(3 * took)
		use, err := r.Usage()
		// Half the SMs for the kernels' part of a quarter of the time
		// (the launch holds none): a little under 12.5%, read in whole
		// percent.
		if err != nil || len(use) != 2 || math.Abs(use["busy"]-0.125) > 0.01 || use["idle"] != 0 {
			t.Errorf("usage %v, %v; want busy 0.12 or 0.13 (half the SMs a quarter of the time), idle 0", use, err)
		}
		time.Sleep(time.Second)
		if use, err := r.Usage(); err != nil || use["busy"] != 0 {
			t.Errorf("usage of an idle window %v, %v; want busy 0", use, err)
		}
	})
}

// A driver that cannot report per-process utilisation (NOT_SUPPORTED, or a
// mock with no such call) gives unknown, not an error; NOT_FOUND (no sample
// newer) is nothing ran; NVML's several samples per process average.
func TestNVMLProcessUtilization(t *testing.T) {
	server := dgxa100.New()
	dev0 := server.Devices[0].(*dgxa100.Device)
	dev1 := server.Devices[1].(*dgxa100.Device)
	dev2 := server.Devices[2].(*dgxa100.Device)
	var asked uint64
	dev0.GetProcessUtilizationFunc = func(lastSeen uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
		asked = lastSeen
		return []nvml.ProcessUtilizationSample{
			{Pid: 100, TimeStamp: lastSeen, SmUtil: 90}, // already seen: ignored
			{Pid: 100, TimeStamp: lastSeen + 100, SmUtil: 20},
			{Pid: 100, TimeStamp: lastSeen + 200, SmUtil: 40},
			{Pid: 200, TimeStamp: lastSeen + 300, SmUtil: 10},
		}, nvml.SUCCESS
	}
	dev1.GetProcessUtilizationFunc = func(uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	dev2.GetProcessUtilizationFunc = func(uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
		return nil, nvml.ERROR_NOT_FOUND
	}
	tel, err := newNVMLTelemetry(server, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer tel.Close()
	since := time.UnixMicro(1_000_000)
	util, at, err := tel.ProcessUtilization(0, since)
	if err != nil || asked != 1_000_000 || len(util) != 2 || math.Abs(util[100]-0.3) > 1e-9 || util[200] != 0.1 || !at.Equal(time.UnixMicro(1_000_300)) {
		t.Errorf("ProcessUtilization(0) = %v, %v, %v (asked since %d); want {100: 0.3, 200: 0.1} at the newest sample", util, at, err, asked)
	}
	if util, at, err := tel.ProcessUtilization(1, since); err != nil || util != nil || !at.Equal(since) {
		t.Errorf("NOT_SUPPORTED: %v, %v, %v; want unknown (nil), no error", util, at, err)
	}
	if util, _, err := tel.ProcessUtilization(2, since); err != nil || util == nil || len(util) != 0 {
		t.Errorf("NOT_FOUND: %v, %v; want an empty map", util, err)
	}
	// dgxa100's device 3 has no GetProcessUtilizationFunc: go-nvml's mock
	// panics, read as unknown.
	if util, _, err := tel.ProcessUtilization(3, since); err != nil || util != nil {
		t.Errorf("no such call: %v, %v; want unknown", util, err)
	}
	if _, _, err := tel.ProcessUtilization(8, since); err == nil {
		t.Error("ProcessUtilization(8) succeeded")
	}
	if _, _, err := (nullTelemetry{}).ProcessUtilization(0, since); err == nil {
		t.Error("the null source answered")
	}
}
