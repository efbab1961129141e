package simgpu

import (
	"fmt"
	"sort"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

// NVML is the machine as go-nvml's nvml.Interface shows a real one: device
// count, handles by index, and per device its name, UUID, memory, MIG
// mode, compute mode, utilisation rates, per-process utilisation and
// compute processes. The calls
// not listed panic (go-nvml's mock does that for calls with no function
// set); the limiter's telemetry makes only these.
func (s *Sim) NVML() nvml.Interface {
	handles := make([]nvml.Device, len(s.devices))
	for i, d := range s.devices {
		handles[i] = d.nvmlDevice(s.spec.Name)
	}
	return &mock.Interface{
		InitFunc:           func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc:       func() nvml.Return { return nvml.SUCCESS },
		DeviceGetCountFunc: func() (int, nvml.Return) { return len(handles), nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			if i < 0 || i >= len(handles) {
				return nil, nvml.ERROR_INVALID_ARGUMENT
			}
			return handles[i], nvml.SUCCESS
		},
	}
}

func (d *Device) nvmlDevice(name string) nvml.Device {
	return &mock.Device{
		GetNameFunc: func() (string, nvml.Return) { return name, nvml.SUCCESS },
		GetUUIDFunc: func() (string, nvml.Return) {
			return fmt.Sprintf("GPU-5106d000-0000-4000-8000-%012x", d.index), nvml.SUCCESS
		},
		GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) {
			used := d.MemoryUsed()
			return nvml.Memory{Total: uint64(d.memory), Used: uint64(used), Free: uint64(d.memory - used)}, nvml.SUCCESS
		},
		GetMigModeFunc: func() (int, int, nvml.Return) {
			if d.MIG() {
				return nvml.DEVICE_MIG_ENABLE, nvml.DEVICE_MIG_ENABLE, nvml.SUCCESS
			}
			return nvml.DEVICE_MIG_DISABLE, nvml.DEVICE_MIG_DISABLE, nvml.SUCCESS
		},
		GetComputeModeFunc: func() (nvml.ComputeMode, nvml.Return) {
			// NVIDIA's MPS documentation recommends EXCLUSIVE_PROCESS
			// under a daemon: only the daemon holds a context.
			if d.DaemonRunning() {
				return nvml.COMPUTEMODE_EXCLUSIVE_PROCESS, nvml.SUCCESS
			}
			return nvml.COMPUTEMODE_DEFAULT, nvml.SUCCESS
		},
		GetUtilizationRatesFunc: func() (nvml.Utilization, nvml.Return) {
			g, m := d.Utilization()
			return nvml.Utilization{Gpu: uint32(g*100 + 0.5), Memory: uint32(m*100 + 0.5)}, nvml.SUCCESS
		},
		GetProcessUtilizationFunc: func(lastSeen uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
			// NVML's timestamps are microseconds since the epoch: a
			// reading seen is one whose microsecond is not after
			// lastSeen.
			util, at := d.ProcessUtilization(time.UnixMicro(int64(lastSeen) + 1).Add(-time.Nanosecond))
			if len(util) == 0 {
				// NVML answers NOT_FOUND when no sample is newer.
				return nil, nvml.ERROR_NOT_FOUND
			}
			out := make([]nvml.ProcessUtilizationSample, 0, len(util))
			for pid, u := range util {
				out = append(out, nvml.ProcessUtilizationSample{
					Pid: uint32(pid), TimeStamp: uint64(at.UnixMicro()), SmUtil: uint32(u*100 + 0.5),
				})
			}
			sort.Slice(out, func(i, j int) bool { return out[i].Pid < out[j].Pid })
			return out, nvml.SUCCESS
		},
		GetComputeRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) {
			mem := d.ProcessMemory()
			out := make([]nvml.ProcessInfo, 0, len(mem))
			for pid, n := range mem {
				out = append(out, nvml.ProcessInfo{Pid: uint32(pid), UsedGpuMemory: uint64(n)})
			}
			sort.Slice(out, func(i, j int) bool { return out[i].Pid < out[j].Pid })
			return out, nvml.SUCCESS
		},
	}
}
