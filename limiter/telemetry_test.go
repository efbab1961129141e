package limiter

import (
	"errors"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
)

// NVML telemetry against go-nvml's DGX A100 mock: eight 40 GB A100s.
func TestNVMLTelemetry(t *testing.T) {
	server := dgxa100.New()
	server.Devices[2].(*dgxa100.Device).MigMode = nvml.DEVICE_MIG_ENABLE
	dev0 := server.Devices[0].(*dgxa100.Device)
	dev0.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
		return nvml.Utilization{Gpu: 37, Memory: 12}, nvml.SUCCESS
	}
	dev0.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
		return []nvml.ProcessInfo{
			{Pid: 100, UsedGpuMemory: 512 << 20},
			{Pid: 200, UsedGpuMemory: 2 << 30},
			{Pid: 100, UsedGpuMemory: 256 << 20, GpuInstanceId: 1}, // a second context of pid 100
			{Pid: 300, UsedGpuMemory: ^uint64(0)},                  // not available
		}, nvml.SUCCESS
	}
	var shutdowns int
	server.ShutdownFunc = func() nvml.Return { shutdowns++; return nvml.SUCCESS }

	tel, err := newNVMLTelemetry(server, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	devs, err := tel.Devices()
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != 8 {
		t.Fatalf("%d devices, want 8", len(devs))
	}
	for i, d := range devs {
		mockDev := server.Devices[i].(*dgxa100.Device)
		want := DeviceInfo{Index: i, Name: "Mock NVIDIA A100-SXM4-40GB", UUID: mockDev.UUID, MemoryTotal: 42949672960, MIGEnabled: i == 2}
		if d != want || !strings.HasPrefix(d.UUID, "GPU-") {
			t.Errorf("device %d = %+v, want %+v", i, d, want)
		}
	}

	gpu, mem, err := tel.Utilization(0)
	if err != nil || gpu != 0.37 || mem != 0.12 {
		t.Errorf("Utilization(0) = %v, %v, %v; want 0.37, 0.12", gpu, mem, err)
	}
	if _, _, err := tel.Utilization(8); err == nil || !strings.Contains(err.Error(), "device 8") {
		t.Errorf("Utilization(8) = %v, want an error naming the device", err)
	}
	procs, err := tel.ProcessMemory(0)
	if err != nil {
		t.Fatal(err)
	}
	if want := map[int]int64{100: 768 << 20, 200: 2 << 30, 300: 0}; len(procs) != len(want) || procs[100] != want[100] || procs[200] != want[200] || procs[300] != 0 {
		t.Errorf("ProcessMemory(0) = %v, want %v", procs, want)
	}

	if err := tel.Close(); err != nil || shutdowns != 1 {
		t.Errorf("Close = %v after %d shutdowns", err, shutdowns)
	}
	if err := tel.Close(); err != nil || shutdowns != 1 {
		t.Errorf("second Close = %v, %d shutdowns; want one", err, shutdowns)
	}
	if _, _, err := tel.Utilization(0); err == nil {
		t.Error("Utilization after Close succeeded")
	}
}

// A device without MIG answers NOT_SUPPORTED: MIG is off, not an error.
func TestNVMLTelemetryNoMIG(t *testing.T) {
	server := dgxa100.New()
	for _, d := range server.Devices {
		d.(*dgxa100.Device).GetMigModeFunc = func() (int, int, nvml.Return) { return 0, 0, nvml.ERROR_NOT_SUPPORTED }
	}
	tel, err := newNVMLTelemetry(server, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer tel.Close()
	devs, err := tel.Devices()
	if err != nil || len(devs) != 8 || devs[0].MIGEnabled {
		t.Errorf("Devices = %+v, %v", devs, err)
	}
}

func TestNVMLInitFails(t *testing.T) {
	for _, tc := range []struct {
		ret      nvml.Return
		noDriver bool
	}{
		{nvml.ERROR_LIBRARY_NOT_FOUND, true},
		{nvml.ERROR_DRIVER_NOT_LOADED, true},
		{nvml.ERROR_NO_PERMISSION, false},
	} {
		lib := &mock.Interface{InitFunc: func() nvml.Return { return tc.ret }}
		_, err := newNVMLTelemetry(lib, testLogger(t))
		if err == nil || errors.Is(err, ErrNoDriver) != tc.noDriver {
			t.Errorf("Init %v: error %v, want no-driver %v", tc.ret, err, tc.noDriver)
		}
	}
}

// These machines have no NVIDIA driver: NewTelemetry is the null source.
func TestNewTelemetryWithoutDriver(t *testing.T) {
	tel := NewTelemetry(testLogger(t))
	defer tel.Close()
	if _, ok := tel.(*nvmlTelemetry); ok {
		t.Skip("an NVIDIA driver is installed; the null source is not in use")
	}
	devs, err := tel.Devices()
	if err != nil || len(devs) != 0 {
		t.Errorf("Devices = %v, %v; want none", devs, err)
	}
	if _, _, err := tel.Utilization(0); !errors.Is(err, ErrNoDriver) || !strings.Contains(err.Error(), "no NVIDIA driver") {
		t.Errorf("Utilization = %v, want it to say no NVIDIA driver", err)
	}
	if _, err := tel.ProcessMemory(0); !errors.Is(err, ErrNoDriver) {
		t.Errorf("ProcessMemory = %v, want ErrNoDriver", err)
	}
}
