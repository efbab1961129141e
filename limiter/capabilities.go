package limiter

import "context"

// This file says what a backend can do. Callers that must adapt to the
// backend (the device's scheduler slots, the adjuster's caps and memory
// floor, usage sampling, profiling, fault recovery) ask for a capability:
// a field of Capabilities, or one of the optional interfaces below found by
// a type assertion. Nobody outside this package compares Kind, which is
// for display only; a new backend is a new file here, a case in New, and
// its name among the ones configs accepts.

// Capabilities is what a backend enforces and can read back, as Limiter's
// Capabilities method reports it. The zero value is a backend that
// enforces nothing and measures nothing (none).
type Capabilities struct {
	// Enforces: shares are enforced on the device. False where a share
	// only sizes a runner's thread count (none); a profile of shares
	// measured there would measure nothing.
	Enforces bool
	// CapsOnly: every compute share is a hard cap fixed for the unit's
	// life (MPS percentages): there are no work-conserving floors, a unit
	// takes no idle capacity beyond its cap, and caps may add up to more
	// than the device.
	CapsOnly bool
	// Background: a unit placed with ModeBackground runs in a class that
	// gives the device up to every other unit (an idle-class cgroup
	// parent, SCHED_IDLE at once; an MPS client below normal priority as
	// its running thread blocks end), so best-effort work may run beside
	// latency-critical work without slowing it, and may be given a cap
	// as large as the device to fill what the others leave.
	Background bool
	// MinMemory is the least memory share a unit may have, in bytes (MPS:
	// a CUDA context, its workspaces and an arena); 0 when the backend
	// needs no least of its own.
	MinMemory int64
	// Clients is how many executions the device runs at once across its
	// units (MPS: one per client, up to the clients an MPS server takes);
	// 0 leaves it to the caller (on a CPU, one per core).
	Clients int
	// Metering says how a unit's use of its device is known.
	Metering Metering
}

// Metering is how a unit's use of its device is known.
type Metering int

const (
	// MeterNone: nothing reads a unit's use back (none).
	MeterNone Metering = iota
	// MeterCPUTime: Stats(id).CPUSeconds is the CPU time of the unit's
	// processes; over a period and CPUs() it is the unit's use of the
	// device (cgroup).
	MeterCPUTime
	// MeterDeviceTime: the device is not the CPU, so no CPU time measures
	// a unit's use of it. A backend that is a UsageReader measures it
	// per process; otherwise it is a unit's execution time times its
	// cap (MPS).
	MeterDeviceTime
)

// ProcessTracker is implemented by backends that account by process
// rather than by cgroup (mps): the caller reports each runner process of
// an instance once it has started, so that Stats can find its usage.
type ProcessTracker interface {
	Track(id string, pid int) error
}

// UsageReader is implemented by backends that measure each instance's use
// of its device (mps: NVML's per-process SM utilisation of the processes
// Track reported).
type UsageReader interface {
	// Usage is the fraction of the device each unit's process used since
	// the previous call (since the device's first sample on the first),
	// by unit id, 0..1. A unit whose process has no sample is absent;
	// nil and no error when the device cannot say.
	Usage() (map[string]float64, error)
}

// ComputeLifter is implemented by backends that can lift a unit's compute
// cap (and, where the kernel allows, its idle class) while keeping its
// memory limit: for a runner about to stop, which must get the CPU to exit
// even when many stop at once (cgroup, unprivileged).
type ComputeLifter interface {
	LiftCompute(id string) error
}

// BackgroundLifter is implemented by backends that keep best-effort units
// under a background parent in the idle class (cgroup): LiftBackground
// takes that parent out of the idle class, at the units' parent's weight,
// for a stopping server. A unit's cap is lifted by LiftCompute, but a
// runner restarted from then on joins the home of its first placement,
// under the background parent, and loaded its model there, behind every
// busy process of the host (a stop held 2 s beside two CPU burners).
type BackgroundLifter interface {
	LiftBackground() error
}

// DaemonRestarter is implemented by backends whose device has a control
// daemon a fatal fault can take down with every client (MPS):
// RestartDaemon brings it back, so that new clients can start, and returns
// once it serves.
type DaemonRestarter interface {
	RestartDaemon(ctx context.Context) error
}
