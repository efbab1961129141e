package limiter

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

// mpsLimiter shares a GPU through CUDA MPS: a runner starts as an MPS
// client with an active-thread percentage and a pinned device memory
// limit, and ONNX Runtime's CUDA arena is capped to the same memory and
// grows only by what is asked. None of that can change in a running
// client, so Resize asks for a new runner.
type mpsLimiter struct {
	dev       device
	telemetry Telemetry
	ownsTelem bool
	log       *slog.Logger
	memory    int64                                       // the device's memory, from the start-up check
	restart   func(ctx context.Context, device int) error // Options.RestartMPSDaemon

	mu    sync.Mutex
	units unitTable[*mpsUnit]
	// usageSince is the newest per-process utilisation sample Usage has
	// read.
	usageSince time.Time
}

type mpsUnit struct {
	share Share
	pid   int // 0 until Track
	// unseen: NVML listed processes on the device but not pid, said once.
	unseen bool
}

var (
	_ Limiter         = (*mpsLimiter)(nil)
	_ ProcessTracker  = (*mpsLimiter)(nil)
	_ DaemonRestarter = (*mpsLimiter)(nil)
	_ UsageReader     = (*mpsLimiter)(nil)
)

// Device memory outside ONNX Runtime's arena, which a runner's pinned limit
// (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, the whole process) must hold beside
// the arena (gpu_mem_limit). Assumptions, not measurements: no GPU has run
// sloserve.
const (
	// MPSContextReserve is the CUDA context of one MPS client with cuDNN
	// and cuBLAS handles loaded: an assumption of 300 MiB (a few hundred
	// MiB on recent drivers; since Volta each MPS client has a context of
	// its own). The simulator's simgpu.ContextMemory makes the same one.
	MPSContextReserve = 300 << 20
	// MPSWorkspaceReserve is what cuDNN and cuBLAS allocate outside the
	// arena (their handles' workspaces; cuBLAS keeps a workspace per
	// handle and stream): an assumption of 128 MiB.
	MPSWorkspaceReserve = 128 << 20
	// mpsMinArena is the least arena a memory share must leave: an
	// assumption of 64 MiB, below which no model of ours would run.
	mpsMinArena = 64 << 20
	// MPSMinMemory is the least memory share a runner under MPS may have:
	// its context, the workspaces and the least arena. The adaptive
	// policy sizes no memory share below it on an MPS device.
	MPSMinMemory = MPSContextReserve + MPSWorkspaceReserve + mpsMinArena
)

// ErrMemoryShareTooSmall is a memory share that cannot hold a CUDA context,
// its workspaces and an arena.
var ErrMemoryShareTooSmall = errors.New("limiter: memory share too small for a CUDA context, its workspaces and an arena")

// ErrDeviceMemoryFull is a placement whose pinned memory would not fit
// beside the pinned limits of the runners already on the device: during a
// swap, the shadow's memory must fit beside the old runner's, so a swap
// that would not fit is refused (the old runner keeps serving) instead of
// running the device out of memory.
var ErrDeviceMemoryFull = errors.New("limiter: the device's memory is pinned by its runners")

// ErrNoDaemonRestart is a daemon the limiter cannot restart itself.
var ErrNoDaemonRestart = errors.New("limiter: restarting the MPS control daemon is not automated here")

// RestartDaemon restarts the device's MPS control daemon through
// Options.RestartMPSDaemon; without one it fails with ErrNoDaemonRestart
// (on a real GPU: quit and start nvidia-cuda-mps-control by hand).
func (l *mpsLimiter) RestartDaemon(ctx context.Context) error {
	if l.restart == nil {
		return fmt.Errorf("%w (%s): run nvidia-cuda-mps-control -d", ErrNoDaemonRestart, l.dev)
	}
	return l.restart(ctx, l.dev.index)
}

// ErrMPSUnavailable is a GPU whose shares MPS cannot enforce: no driver,
// no control daemon, MIG mode, or a compute mode that refuses clients.
var ErrMPSUnavailable = errors.New("limiter: MPS cannot enforce shares on this device")

// newMPS checks that MPS can enforce shares on the device before it
// places anything: without a control daemon CUDA ignores
// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and the clients time-slice the GPU, so
// a limiter that started anyway would report shares nobody enforces.
func newMPS(dev device, t Telemetry, daemon func(device int) error, log *slog.Logger) (*mpsLimiter, error) {
	l := &mpsLimiter{dev: dev, telemetry: t, log: log, units: unitTable[*mpsUnit]{}}
	if t == nil {
		l.telemetry = NewTelemetry(log)
		l.ownsTelem = true
	}
	if daemon == nil {
		daemon = mpsPipeDaemon
	}
	if err := l.check(daemon); err != nil {
		if l.ownsTelem {
			l.telemetry.Close()
		}
		return nil, err
	}
	return l, nil
}

// check refuses a device MPS cannot share: it must be there, out of MIG
// mode (MPS would then run inside a MIG instance, which cuda:N does not
// name), in a compute mode that admits the daemon's context, and served
// by a running control daemon.
func (l *mpsLimiter) check(daemon func(device int) error) error {
	const without = "set control.limiter: none to run without GPU shares"
	devs, err := l.telemetry.Devices()
	if err != nil {
		return fmt.Errorf("%w: %s: reading the device: %w; %s", ErrMPSUnavailable, l.dev, err, without)
	}
	var info *DeviceInfo
	for i := range devs {
		if devs[i].Index == l.dev.index {
			info = &devs[i]
		}
	}
	switch {
	case len(devs) == 0:
		return fmt.Errorf("%w: %s: no GPU found (%v); %s", ErrMPSUnavailable, l.dev, ErrNoDriver, without)
	case info == nil:
		return fmt.Errorf("%w: %s: the machine has %d GPU(s), cuda:0..cuda:%d; set execution.device_id to one of them or %s", ErrMPSUnavailable, l.dev, len(devs), len(devs)-1, without)
	case info.MIGEnabled:
		return fmt.Errorf("%w: %s is in MIG mode: sloserve shares whole GPUs through MPS and does not address MIG instances; "+
			"disable MIG (nvidia-smi -i %d -mig 0) or %s", ErrMPSUnavailable, l.dev, l.dev.index, without)
	case info.ComputeMode == ComputeProhibited || info.ComputeMode == ComputeExclusiveThread:
		return fmt.Errorf("%w: %s is in compute mode %s, which refuses the MPS daemon's clients; "+
			"set EXCLUSIVE_PROCESS (nvidia-smi -i %d -c EXCLUSIVE_PROCESS) or %s", ErrMPSUnavailable, l.dev, info.ComputeMode, l.dev.index, without)
	}
	if err := daemon(l.dev.index); err != nil {
		return fmt.Errorf("%w: %s: no MPS control daemon: %w; start one (nvidia-cuda-mps-control -d) or %s", ErrMPSUnavailable, l.dev, err, without)
	}
	l.memory = info.MemoryTotal
	return nil
}

// mpsPipeDaemon finds a running control daemon by its control pipe in
// CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps), as CUDA clients do.
func mpsPipeDaemon(int) error {
	dir := os.Getenv("CUDA_MPS_PIPE_DIRECTORY")
	if dir == "" {
		dir = "/tmp/nvidia-mps"
	}
	fi, err := os.Stat(filepath.Join(dir, "control"))
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeNamedPipe == 0 {
		return fmt.Errorf("%s is not a named pipe", filepath.Join(dir, "control"))
	}
	return nil
}

func (l *mpsLimiter) Kind() string { return KindMPS }

func (l *mpsLimiter) Describe() string {
	return fmt.Sprintf("mps on %s: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT per runner, CUDA_MPS_CLIENT_PRIORITY below normal for background shares, ONNX Runtime gpu_mem_limit that limit less %d MiB (context and workspaces) with arena %s; a resize restarts the runner, the new one with heuristic cuDNN search", l.dev, (MPSContextReserve+MPSWorkspaceReserve)>>20, runtime.ArenaSameAsRequested)
}

func (l *mpsLimiter) CPUs() int { return 1 }

// MPSClients is how many executions a GPU under MPS runs at once: one per
// client, up to the 48 clients an MPS server takes per device since Volta
// (NVIDIA's MPS documentation, "Limitations", as we remember it; newer
// drivers may take more: check before relying on it).
const MPSClients = 48

// Capabilities: every share is a cap fixed for the client's life; a
// background share is a client below normal priority (mpsPriority), whose
// kernels run on the SMs normal clients leave; a client needs its context,
// workspaces and an arena; use is per process (NVML) or execution time
// times cap.
func (l *mpsLimiter) Capabilities() Capabilities {
	return Capabilities{Enforces: true, CapsOnly: true, Background: true, MinMemory: MPSMinMemory, Clients: MPSClients, Metering: MeterDeviceTime}
}

// MPS client priorities, as CUDA_MPS_CLIENT_PRIORITY takes them (NVIDIA's
// MPS documentation, environment variables): 0 NORMAL, 1 BELOW NORMAL.
const (
	mpsPriorityNormal      = "0"
	mpsPriorityBelowNormal = "1"
)

// mpsPriority is the client priority for a share: below normal for a
// background share (best-effort work: its pending thread blocks go after
// every normal client's, so it runs on the SMs they leave and gives them
// back as its running blocks end), normal otherwise. Set explicitly, so
// that a value in the server's own environment does not leak into the
// runner.
func mpsPriority(s Share) string {
	if s.Mode == ModeBackground {
		return mpsPriorityBelowNormal
	}
	return mpsPriorityNormal
}

// mpsPercentage is the active thread percentage for a share: no limit is
// 100, set explicitly so that a value in the server's own environment
// does not leak into the runner.
func mpsPercentage(s Share) int {
	if !s.fraction() {
		return 100
	}
	return min(max(int(math.Round(s.Compute*100)), 1), 100)
}

// Placement for a share: the MPS client environment and the matching
// ONNX Runtime CUDA options. The pinned limit is the whole process's, so
// the arena gets what the context and the workspaces leave of it
// (MPSContextReserve, MPSWorkspaceReserve). A shadow (a new runner of an
// instance whose runner still serves: a swap) searches cuDNN's algorithms
// by heuristic: an exhaustive search times every algorithm at every batch
// size while the other clients run beside it, which makes the swap slow
// and its timings noisy.
func (l *mpsLimiter) placement(s Share, shadow bool) Placement {
	p := Placement{Env: []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=" + strconv.Itoa(mpsPercentage(s))}}
	if s.Memory > 0 {
		mib := (s.Memory + 1<<20 - 1) >> 20 // never below what was asked
		p.Env = append(p.Env, fmt.Sprintf("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%d=%dM", l.dev.index, mib))
		p.GPUMemLimit = s.Memory - MPSContextReserve - MPSWorkspaceReserve
	}
	p.Env = append(p.Env, "CUDA_MPS_CLIENT_PRIORITY="+mpsPriority(s))
	p.ArenaExtendStrategy = runtime.ArenaSameAsRequested
	if shadow {
		p.CudnnConvAlgoSearch = runtime.ConvAlgoHeuristic
	}
	return p
}

// instanceOf is the instance a unit id belongs to: the id without its
// last "-" part. The registry names the units of one instance
// "model-version-instance-sequence", so the units of a swap (the serving
// runner and its shadow) share it.
func instanceOf(id string) string {
	if i := strings.LastIndexByte(id, '-'); i > 0 {
		return id[:i]
	}
	return id
}

// Place refuses a memory share too small for a context, its workspaces
// and an arena (ErrMemoryShareTooSmall), and one whose pinned memory does
// not fit beside the pinned limits of the device's other runners
// (ErrDeviceMemoryFull): a swap's shadow is placed while the runner it
// replaces still holds its memory, so this keeps room for it or refuses
// the swap. Runners without a memory share pin nothing and are not
// counted; their memory is whatever the device has.
func (l *mpsLimiter) Place(id string, s Share) (Placement, error) {
	if err := validShare(s); err != nil {
		return Placement{}, err
	}
	if s.Memory > 0 && s.Memory < MPSMinMemory {
		return Placement{}, fmt.Errorf("%w: %s: %d MiB asked, at least %d MiB needed (context %d MiB, workspaces %d MiB, arena %d MiB)",
			ErrMemoryShareTooSmall, id, s.Memory>>20, MPSMinMemory>>20,
			MPSContextReserve>>20, MPSWorkspaceReserve>>20, mpsMinArena>>20)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.units.free(id); err != nil {
		return Placement{}, err
	}
	var pinned int64
	shadow := false
	for other, u := range l.units {
		pinned += u.share.Memory
		shadow = shadow || instanceOf(other) == instanceOf(id)
	}
	if s.Memory > 0 && l.memory > 0 && pinned+s.Memory > l.memory {
		return Placement{}, fmt.Errorf("%w: %s: %d MiB would join %d MiB pinned on %s of %d MiB; refused (a runner it would replace keeps serving)",
			ErrDeviceMemoryFull, id, s.Memory>>20, pinned>>20, l.dev, l.memory>>20)
	}
	l.units[id] = &mpsUnit{share: s}
	return l.placement(s, shadow), nil
}

// Resize accepts only the share the instance has: an MPS client's limits
// are fixed when it starts.
func (l *mpsLimiter) Resize(id string, s Share) error {
	if err := validShare(s); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	u, err := l.units.get(id)
	if err != nil {
		return err
	}
	if u.share == s {
		return nil
	}
	return fmt.Errorf("resize %s from %v to %v: %w", id, u.share, s, ErrRestartRequired)
}

// Track records the runner process of an instance, for Stats.
func (l *mpsLimiter) Track(id string, pid int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	u, err := l.units.get(id)
	if err != nil {
		return err
	}
	u.pid = pid
	return nil
}

func (l *mpsLimiter) Release(id string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, err := l.units.get(id); err != nil {
		return err
	}
	delete(l.units, id)
	return nil
}

// Stats reports the memory limit, and the device memory of the tracked
// process when telemetry has it (matched by pid; 0, unknown, when NVML
// does not list the pid). CPU time and throttling are not
// measured on a GPU.
func (l *mpsLimiter) Stats(id string) (Stats, error) {
	l.mu.Lock()
	u, err := l.units.get(id)
	var share Share
	var pid int
	if err == nil {
		share, pid = u.share, u.pid
	}
	l.mu.Unlock()
	if err != nil {
		return Stats{}, err
	}
	st := Stats{MemoryLimit: share.Memory}
	if pid == 0 {
		return st, nil
	}
	mem, err := l.telemetry.ProcessMemory(l.dev.index)
	if err != nil {
		return st, fmt.Errorf("limiter: stats of %s: %w", id, err)
	}
	n, ok := mem[pid]
	if !ok && len(mem) > 0 {
		// NVML names processes by the host's pids: a runner in another
		// pid namespace (a container) is not found under its own, and an
		// MPS server may account its clients' memory to itself. Memory
		// is then unknown (0), never another process's.
		l.mu.Lock()
		if u, err := l.units.get(id); err == nil && !u.unseen {
			u.unseen = true
			l.log.Warn("NVML lists no process with the runner's pid (pid namespaces differ, or the MPS server holds the memory): its device memory is unknown",
				"unit", id, "pid", pid, "processes", len(mem))
		}
		l.mu.Unlock()
	}
	st.MemoryBytes = n
	return st, nil
}

// Usage reads the device's per-process utilisation once and gives each
// tracked unit its process's.
func (l *mpsLimiter) Usage() (map[string]float64, error) {
	l.mu.Lock()
	since := l.usageSince
	l.mu.Unlock()
	util, at, err := l.telemetry.ProcessUtilization(l.dev.index, since)
	if err != nil {
		return nil, fmt.Errorf("limiter: device %d usage: %w", l.dev.index, err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.usageSince = at
	if util == nil {
		return nil, nil
	}
	out := map[string]float64{}
	for id, u := range l.units {
		if v, ok := util[u.pid]; ok && u.pid != 0 {
			out[id] = v
		}
	}
	return out, nil
}

func (l *mpsLimiter) Close() error {
	l.mu.Lock()
	clear(l.units)
	l.mu.Unlock()
	if l.ownsTelem {
		return l.telemetry.Close()
	}
	return nil
}
