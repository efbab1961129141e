package limiter

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// defaultNVML is the system's NVML (libnvidia-ml.so.1), loaded lazily by
// Init.
func defaultNVML() nvml.Interface { return nvml.New() }

// nvmlTelemetry reads GPU telemetry through an nvml.Interface: the driver's
// library in production, go-nvml's mocks in tests.
type nvmlTelemetry struct {
	lib nvml.Interface
	log *slog.Logger

	mu     sync.Mutex
	closed bool
}

var _ Telemetry = (*nvmlTelemetry)(nil)

// newNVMLTelemetry initialises lib. Its error says why NVML is not usable.
func newNVMLTelemetry(lib nvml.Interface, logger *slog.Logger) (t *nvmlTelemetry, err error) {
	// Without the library, go-nvml reports ERROR_LIBRARY_NOT_FOUND; some
	// versions panic instead. Either way there is no driver.
	defer func() {
		if r := recover(); r != nil {
			t, err = nil, fmt.Errorf("%w: NVML: %v", ErrNoDriver, r)
		}
	}()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		if ret == nvml.ERROR_LIBRARY_NOT_FOUND || ret == nvml.ERROR_DRIVER_NOT_LOADED {
			return nil, fmt.Errorf("%w: NVML init: %v", ErrNoDriver, ret)
		}
		return nil, fmt.Errorf("NVML init: %v", ret)
	}
	return &nvmlTelemetry{lib: lib, log: logger}, nil
}

// nvmlError turns an NVML return code into an error naming the call.
func nvmlError(what string, ret nvml.Return) error {
	if ret == nvml.SUCCESS {
		return nil
	}
	return fmt.Errorf("NVML %s: %v", what, ret)
}

func (t *nvmlTelemetry) device(index int) (nvml.Device, error) {
	t.mu.Lock()
	closed := t.closed
	t.mu.Unlock()
	if closed {
		return nil, errors.New("NVML telemetry is closed")
	}
	d, ret := t.lib.DeviceGetHandleByIndex(index)
	if err := nvmlError(fmt.Sprintf("device %d", index), ret); err != nil {
		return nil, err
	}
	return d, nil
}

func (t *nvmlTelemetry) Devices() ([]DeviceInfo, error) {
	n, ret := t.lib.DeviceGetCount()
	if err := nvmlError("device count", ret); err != nil {
		return nil, err
	}
	out := make([]DeviceInfo, 0, n)
	for i := range n {
		d, err := t.device(i)
		if err != nil {
			return nil, err
		}
		info := DeviceInfo{Index: i}
		var ret nvml.Return
		if info.Name, ret = d.GetName(); ret != nvml.SUCCESS {
			return nil, nvmlError(fmt.Sprintf("device %d name", i), ret)
		}
		if info.UUID, ret = d.GetUUID(); ret != nvml.SUCCESS {
			return nil, nvmlError(fmt.Sprintf("device %d UUID", i), ret)
		}
		mem, ret := d.GetMemoryInfo()
		if ret != nvml.SUCCESS {
			return nil, nvmlError(fmt.Sprintf("device %d memory", i), ret)
		}
		info.MemoryTotal = int64(mem.Total)
		// Devices without MIG answer NOT_SUPPORTED: MIG is off.
		switch cur, _, ret := d.GetMigMode(); ret {
		case nvml.SUCCESS:
			info.MIGEnabled = cur == nvml.DEVICE_MIG_ENABLE
		case nvml.ERROR_NOT_SUPPORTED:
		default:
			return nil, nvmlError(fmt.Sprintf("device %d MIG mode", i), ret)
		}
		info.ComputeMode = computeMode(d)
		out = append(out, info)
	}
	return out, nil
}

// computeMode reads a device's compute mode; "" when the driver (or a
// mock without the call) cannot say.
func computeMode(d nvml.Device) (mode string) {
	defer func() {
		if recover() != nil {
			mode = ""
		}
	}()
	m, ret := d.GetComputeMode()
	if ret != nvml.SUCCESS {
		return ""
	}
	switch m {
	case nvml.COMPUTEMODE_DEFAULT:
		return ComputeDefault
	case nvml.COMPUTEMODE_EXCLUSIVE_PROCESS:
		return ComputeExclusiveProcess
	case nvml.COMPUTEMODE_EXCLUSIVE_THREAD:
		return ComputeExclusiveThread
	case nvml.COMPUTEMODE_PROHIBITED:
		return ComputeProhibited
	}
	return ""
}

func (t *nvmlTelemetry) Utilization(device int) (gpu, memory float64, err error) {
	d, err := t.device(device)
	if err != nil {
		return 0, 0, err
	}
	u, ret := d.GetUtilizationRates()
	if err := nvmlError(fmt.Sprintf("device %d utilization", device), ret); err != nil {
		return 0, 0, err
	}
	return float64(u.Gpu) / 100, float64(u.Memory) / 100, nil
}

func (t *nvmlTelemetry) ProcessMemory(device int) (map[int]int64, error) {
	d, err := t.device(device)
	if err != nil {
		return nil, err
	}
	procs, ret := d.GetComputeRunningProcesses()
	if err := nvmlError(fmt.Sprintf("device %d processes", device), ret); err != nil {
		return nil, err
	}
	m := make(map[int]int64, len(procs))
	for _, p := range procs {
		// NVML_VALUE_NOT_AVAILABLE (all ones) when the driver cannot tell.
		if p.UsedGpuMemory == math.MaxUint64 {
			m[int(p.Pid)] += 0
			continue
		}
		m[int(p.Pid)] += int64(p.UsedGpuMemory)
	}
	return m, nil
}

func (t *nvmlTelemetry) ProcessUtilization(device int, since time.Time) (map[int]float64, time.Time, error) {
	d, err := t.device(device)
	if err != nil {
		return nil, since, err
	}
	var lastSeen uint64
	if since.UnixMicro() > 0 {
		lastSeen = uint64(since.UnixMicro())
	}
	samples, ret, ok := processUtilization(d, lastSeen)
	switch {
	case !ok, ret == nvml.ERROR_NOT_SUPPORTED:
		return nil, since, nil // the driver (or a mock) cannot say
	case ret == nvml.ERROR_NOT_FOUND:
		return map[int]float64{}, since, nil // no sample newer: nothing ran
	case ret != nvml.SUCCESS:
		return nil, since, nvmlError(fmt.Sprintf("device %d process utilization", device), ret)
	}
	// NVML may return several samples per process, one per sample
	// period: their mean is the process's use over the window.
	sum, n := map[int]float64{}, map[int]int{}
	newest := lastSeen
	for _, s := range samples {
		if s.TimeStamp <= lastSeen {
			continue
		}
		sum[int(s.Pid)] += float64(min(s.SmUtil, 100)) / 100
		n[int(s.Pid)]++
		newest = max(newest, s.TimeStamp)
	}
	for pid := range sum {
		sum[pid] /= float64(n[pid])
	}
	at := since
	if newest > lastSeen {
		at = time.UnixMicro(int64(newest))
	}
	return sum, at, nil
}

// processUtilization calls GetProcessUtilization; ok is false when the
// device has no such call (a go-nvml mock without it panics).
func processUtilization(d nvml.Device, lastSeen uint64) (samples []nvml.ProcessUtilizationSample, ret nvml.Return, ok bool) {
	defer func() {
		if recover() != nil {
			samples, ret, ok = nil, nvml.ERROR_NOT_SUPPORTED, false
		}
	}()
	samples, ret = d.GetProcessUtilization(lastSeen)
	return samples, ret, true
}

func (t *nvmlTelemetry) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	return nvmlError("shutdown", t.lib.Shutdown())
}
