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
	"sync"

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
	restart   func(ctx context.Context, device int) error // Options.RestartMPSDaemon

	mu    sync.Mutex
	units unitTable[*mpsUnit]
}

type mpsUnit struct {
	share Share
	pid   int // 0 until Track
}

var (
	_ Limiter         = (*mpsLimiter)(nil)
	_ ProcessTracker  = (*mpsLimiter)(nil)
	_ DaemonRestarter = (*mpsLimiter)(nil)
)

// DaemonRestarter is a limiter whose device has a control daemon a fatal
// fault can take down with every client (MPS): RestartDaemon brings it
// back, so that new clients can start, and returns once it serves.
type DaemonRestarter interface {
	RestartDaemon(ctx context.Context) error
}

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
	return fmt.Sprintf("mps on %s: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT per runner, ONNX Runtime gpu_mem_limit with arena %s; a resize restarts the runner", l.dev, runtime.ArenaSameAsRequested)
}

func (l *mpsLimiter) CPUs() int { return 1 }

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
// ONNX Runtime CUDA options.
func (l *mpsLimiter) placement(s Share) Placement {
	p := Placement{Env: []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=" + strconv.Itoa(mpsPercentage(s))}}
	if s.Memory > 0 {
		mib := (s.Memory + 1<<20 - 1) >> 20 // never below what was asked
		p.Env = append(p.Env, fmt.Sprintf("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%d=%dM", l.dev.index, mib))
		p.GPUMemLimit = s.Memory
	}
	p.ArenaExtendStrategy = runtime.ArenaSameAsRequested
	return p
}

func (l *mpsLimiter) Place(id string, s Share) (Placement, error) {
	if err := validShare(s); err != nil {
		return Placement{}, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.units.free(id); err != nil {
		return Placement{}, err
	}
	l.units[id] = &mpsUnit{share: s}
	return l.placement(s), nil
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
// process when telemetry has it. CPU time and throttling are not
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
	st.MemoryBytes = mem[pid]
	return st, nil
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
