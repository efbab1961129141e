package limiter

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// DeviceInfo describes one GPU.
type DeviceInfo struct {
	Index       int
	Name        string
	UUID        string
	MemoryTotal int64 // bytes
	MIGEnabled  bool  // MIG mode is on (current, not pending)
	// ComputeMode is NVML's compute mode: ComputeDefault,
	// ComputeExclusiveProcess, ComputeProhibited, ComputeExclusiveThread,
	// or "" when the driver does not say.
	ComputeMode string
}

// Compute modes, as DeviceInfo.ComputeMode reports them.
const (
	ComputeDefault          = "default"
	ComputeExclusiveProcess = "exclusive_process"
	ComputeExclusiveThread  = "exclusive_thread"
	ComputeProhibited       = "prohibited"
)

// Telemetry reports what the GPUs are doing. NewTelemetry returns NVML's
// view when the driver is there and a null source otherwise.
type Telemetry interface {
	// Devices lists the GPUs.
	Devices() ([]DeviceInfo, error)
	// Utilization is the fraction of the last sample period in which a
	// kernel ran (gpu) and device memory was read or written (memory),
	// each 0..1.
	Utilization(device int) (gpu, memory float64, err error)
	// ProcessMemory is the device memory each compute process uses, by pid.
	ProcessMemory(device int) (map[int]int64, error)
	// ProcessUtilization is the fraction of the device's SMs each
	// process's kernels held on average since the given time (NVML's
	// per-process SmUtil over the samples newer than it), by pid, 0..1,
	// and the newest sample's time: the since of the next call. A
	// process with no sample is absent; an empty map means none ran. A
	// nil map and no error mean the driver cannot say (NOT_SUPPORTED):
	// unknown, not a failure.
	ProcessUtilization(device int, since time.Time) (map[int]float64, time.Time, error)
	Close() error
}

// ErrNoDriver is what the null source answers.
var ErrNoDriver = errors.New("no NVIDIA driver")

// NewTelemetry opens NVML. When its library does not load or does not
// initialise, it logs why and returns a null source: no devices, and
// errors that say "no NVIDIA driver".
func NewTelemetry(logger *slog.Logger) Telemetry {
	if logger == nil {
		logger = slog.Default()
	}
	t, err := newNVMLTelemetry(defaultNVML(), logger)
	if err != nil {
		logger.Info("GPU telemetry off", "reason", err)
		return nullTelemetry{reason: err.Error()}
	}
	return t
}

// NewNVMLTelemetry reads telemetry through lib, any nvml.Interface: the
// simulator's (simgpu.Sim.NVML) in tests and demos. Its error says why lib
// is not usable (ErrNoDriver when there is no driver).
func NewNVMLTelemetry(lib nvml.Interface, logger *slog.Logger) (Telemetry, error) {
	if logger == nil {
		logger = slog.Default()
	}
	t, err := newNVMLTelemetry(lib, logger)
	if err != nil {
		return nil, err
	}
	return t, nil
}

// nullTelemetry is the source for machines without an NVIDIA driver.
type nullTelemetry struct{ reason string }

var _ Telemetry = nullTelemetry{}

func (n nullTelemetry) err() error {
	if n.reason == "" {
		return ErrNoDriver
	}
	return fmt.Errorf("%w (%s)", ErrNoDriver, n.reason)
}

func (nullTelemetry) Devices() ([]DeviceInfo, error) { return nil, nil }

func (n nullTelemetry) Utilization(device int) (float64, float64, error) {
	return 0, 0, fmt.Errorf("gpu %d: %w", device, n.err())
}

func (n nullTelemetry) ProcessMemory(device int) (map[int]int64, error) {
	return nil, fmt.Errorf("gpu %d: %w", device, n.err())
}

func (n nullTelemetry) ProcessUtilization(device int, since time.Time) (map[int]float64, time.Time, error) {
	return nil, since, fmt.Errorf("gpu %d: %w", device, n.err())
}

func (nullTelemetry) Close() error { return nil }
