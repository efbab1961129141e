// Package limiter enforces a model instance's share of a device on real
// resources: a cgroup per runner process on CPU (v2 cpu.max, cpu.weight
// and memory.max, or v1 CFS quota, cpu.shares and memory limit; a share's
// Mode makes it a hard cap, a work-conserving floor, or a cap in an
// idle-class parent for background work), MPS client limits and ONNX Runtime
// arena settings on GPU, and nothing but a thread count where neither is
// available. NVML telemetry (Telemetry) reports what GPUs are doing, from
// the driver or from any nvml.Interface (the simulator's); the MPS backend
// refuses at start a GPU whose shares MPS would not enforce, and measures
// each unit's use of its device from NVML's per-process utilisation
// (UsageReader).
//
// A backend makes one unit per runner start (Place), changes its share
// while it runs where the mechanism allows (Resize), and removes it when
// the runner is gone (Release). The runner joins its unit itself, before it
// loads the model, through the Placement it is started with.
//
// It must not choose shares (the qos adjuster does) nor start or stop
// runner processes (runtime does); it applies the share it is given, and
// says so when it cannot rather than pretending to.
package limiter

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"strconv"
	"strings"
	"time"
)

// Placement is how a runner process must start to run under a share.
type Placement struct {
	// JoinCgroups are cgroup.procs files the runner writes its own pid to
	// before it loads the model (runtime.RunnerConfig.JoinCgroups).
	JoinCgroups []string
	// Env is extra environment, "KEY=value" (MPS).
	Env []string
	// IntraOpThreads is the intra-op thread count that suits the share; 0
	// leaves the configured value.
	IntraOpThreads int
	// GPUMemLimit is the ORT CUDA provider's gpu_mem_limit; 0 = none.
	GPUMemLimit int64
	// ArenaExtendStrategy is "" or runtime.ArenaSameAsRequested (MPS).
	ArenaExtendStrategy string
	// CudnnConvAlgoSearch is "" (the model's config decides) or
	// runtime.ConvAlgoHeuristic (MPS: a shadow runner of a swap).
	CudnnConvAlgoSearch string
	// ProcessUnit is the directory of a process unit whose scheduling
	// class, CPU affinity and data rlimit the runner applies to itself
	// before it loads the model (runtime.RunnerConfig.ProcessUnit;
	// backend unprivileged).
	ProcessUnit string
}

// Stats is what a backend can read back about one instance.
type Stats struct {
	CPUSeconds       float64 // CPU time used by the instance's cgroup
	ThrottledSeconds float64 // time throttled by the quota
	MemoryBytes      int64   // current memory usage
	// MemoryPeak is the most memory the instance's unit has used since it
	// was placed (cgroup v2 memory.peak, v1 memory.max_usage_in_bytes);
	// 0 unknown.
	MemoryPeak  int64
	MemoryLimit int64  // enforced limit, 0 = none
	OOMKills    uint64 // processes killed for exceeding the memory limit
}

var (
	// ErrRestartRequired means Resize cannot change a running instance
	// (MPS): start a new runner with a new Placement.
	ErrRestartRequired = errors.New("limiter: the share of a running instance cannot change; start a new runner with a new placement")
	// ErrUnknownInstance means the id was never placed or was released.
	ErrUnknownInstance = errors.New("limiter: unknown instance")
)

// Backend kinds, as Kind reports them: for display (the API, logs).
// What a backend can do is Capabilities, not its kind.
const (
	KindCgroupV2 = "cgroup-v2"
	KindCgroupV1 = "cgroup-v1"
	KindMPS      = "mps"
	KindNone     = "none"
	// KindUnprivileged is the backend of hosts without a writable cgroup
	// tree: SCHED_IDLE, CPU affinity and RLIMIT_DATA (unprivileged.go).
	KindUnprivileged = "unprivileged"
)

// Limiter enforces shares for the instances of one device.
type Limiter interface {
	// Kind is "cgroup-v2", "cgroup-v1", "unprivileged", "mps" or "none",
	// for display: callers that adapt to the backend ask Capabilities.
	Kind() string
	// Describe is one line for the API and logs: what is enforced, where,
	// and why this backend was chosen.
	Describe() string
	// CPUs is the number of compute units a share is a fraction of: the
	// usable CPUs for the CPU device, 1 for a GPU.
	CPUs() int
	// Capabilities says what the backend enforces and can read back.
	Capabilities() Capabilities
	// Place creates the instance's unit at a share. id is unique per runner
	// start.
	Place(id string, s Share) (Placement, error)
	// Resize changes the share live; ErrRestartRequired when impossible.
	Resize(id string, s Share) error
	// Release removes the unit once its runner has stopped.
	Release(id string) error
	// Stats reads back the instance's usage.
	Stats(id string) (Stats, error)
	// Close releases every unit this limiter made, and their parent.
	Close() error
}

// Backends Options.Backend selects: the names control.limiter in the
// server config takes.
const (
	BackendAuto   = "auto"
	BackendCgroup = "cgroup"
	BackendMPS    = "mps"
	BackendNone   = "none"
	// BackendUnprivileged asks for the unprivileged backend even where a
	// cgroup tree is writable.
	BackendUnprivileged = "unprivileged"
)

// DefaultRoot is where the cgroup filesystem is mounted.
const DefaultRoot = "/sys/fs/cgroup"

// DefaultPeriod is the CFS period. A quota is handed out per period: with
// 100 ms (the kernel's default) a quarter-core instance may run flat out
// for 25 ms and then stall for 75, so a request's latency depends on where
// in the period it lands. 10 ms periods keep the stalls short and latency
// smooth at a small cost in scheduler overhead.
const DefaultPeriod = 10 * time.Millisecond

// Options configures New.
type Options struct {
	Backend string        // "auto" (default), "cgroup", "mps", "none"
	Device  string        // "cpu" (default) or "cuda:N"
	Root    string        // cgroup filesystem root; default DefaultRoot
	Period  time.Duration // CFS period; default DefaultPeriod
	Logger  *slog.Logger  // default slog.Default()
	// Telemetry feeds the mps backend's start-up check and Stats; default
	// NewTelemetry.
	Telemetry Telemetry
	// MPSDaemon reports whether an MPS control daemon serves a GPU (nil
	// when one does); default: its control pipe in
	// CUDA_MPS_PIPE_DIRECTORY. The simulator answers for simulated GPUs.
	MPSDaemon func(device int) error
	// RestartMPSDaemon restarts the MPS control daemon of a GPU after a
	// fatal fault took its clients down (see DaemonRestarter); nil: the
	// limiter cannot, and says so. The simulator does it for simulated
	// GPUs.
	RestartMPSDaemon func(ctx context.Context, device int) error
}

// device is a parsed Options.Device.
type device struct {
	gpu   bool
	index int
}

func (d device) String() string {
	if d.gpu {
		return "cuda:" + strconv.Itoa(d.index)
	}
	return "cpu"
}

func parseDevice(s string) (device, error) {
	switch {
	case s == "" || s == "cpu":
		return device{}, nil
	case strings.HasPrefix(s, "cuda:"):
		n, err := strconv.Atoi(strings.TrimPrefix(s, "cuda:"))
		if err != nil || n < 0 {
			return device{}, fmt.Errorf("limiter: device %q: want cuda:N with N >= 0", s)
		}
		return device{gpu: true, index: n}, nil
	}
	return device{}, fmt.Errorf("limiter: device %q: want cpu or cuda:N", s)
}

// New picks and starts a backend. For "cpu" with "auto": cgroup v2 if the
// root is a unified hierarchy whose cpu and memory controllers the server
// can use, else cgroup v1 if the cpu and memory hierarchies are writable,
// else a delegated cgroup v2 subtree (delegate.go), else unprivileged
// (SCHED_IDLE, CPU affinity, RLIMIT_DATA: unprivileged.go), else none;
// Describe says which and why. For "cuda:N" with "auto": mps, which
// refuses (ErrMPSUnavailable) a GPU it cannot share: no driver, no MPS
// control daemon, MIG mode, a compute mode that refuses clients. Backend
// "cgroup" fails with an error that says why cgroups are not usable;
// "unprivileged" skips the cgroups; "none" never enforces anything. New first removes units left by servers
// that died without Close (CleanupStale).
func New(opts Options) (Limiter, error) {
	return newLimiter(opts, hostEnv())
}

func newLimiter(opts Options, env hostEnvironment) (Limiter, error) {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Root == "" {
		opts.Root = DefaultRoot
	}
	if opts.Period <= 0 {
		opts.Period = DefaultPeriod
	}
	if opts.Period < time.Millisecond || opts.Period > time.Second {
		return nil, fmt.Errorf("limiter: CFS period %s is outside 1ms..1s", opts.Period)
	}
	if opts.Backend == "" {
		opts.Backend = BackendAuto
	}
	dev, err := parseDevice(opts.Device)
	if err != nil {
		return nil, err
	}
	log := opts.Logger.With("component", "limiter", "device", dev.String())

	switch opts.Backend {
	case BackendNone:
		return newNone(dev, env.cpus(opts.Root, log), "backend none requested"), nil
	case BackendUnprivileged:
		if dev.gpu {
			return nil, fmt.Errorf("limiter: backend unprivileged limits CPU shares; device %s needs mps or none", dev)
		}
		return startUnprivileged("backend unprivileged requested", log)
	case BackendMPS:
		if !dev.gpu {
			return nil, fmt.Errorf("limiter: backend mps needs a cuda:N device, not %s", dev)
		}
		return startMPS(dev, opts, log)
	case BackendCgroup, BackendAuto:
	default:
		return nil, fmt.Errorf("limiter: unknown backend %q (want auto, cgroup, unprivileged, mps or none)", opts.Backend)
	}
	if dev.gpu {
		if opts.Backend == BackendCgroup {
			return nil, fmt.Errorf("limiter: backend cgroup limits CPU shares; device %s needs mps or none", dev)
		}
		return startMPS(dev, opts, log)
	}

	if n, err := cleanupStale(opts.Root, env, log); err != nil {
		log.Warn("removing stale cgroups", "removed", n, "err", err)
	} else if n > 0 {
		log.Info("removed cgroups of servers that died without cleaning up", "removed", n)
	}
	l, err := newCgroup(opts, env, "", log)
	if err == nil {
		log.Info("limiter ready", "kind", l.Kind(), "describe", l.Describe())
		return l, nil
	}
	// Not writable as a whole: a subtree delegated to the server's user.
	d, errD := newDelegated(opts, env, writable, log)
	if errD == nil {
		d.describe += fmt.Sprintf(" (the tree is not writable above it: %v)", err)
		log.Info("limiter ready", "kind", d.Kind(), "describe", d.Describe())
		return d, nil
	}
	if opts.Backend == BackendCgroup {
		return nil, fmt.Errorf("limiter: cgroups are not usable: %w; delegated cgroup v2: %w", err, errD)
	}
	reason := fmt.Sprintf("%v; delegated cgroup v2: %v", err, errD)
	u, errU := startUnprivileged(reason, log)
	if errU == nil {
		return u, nil
	}
	reason += "; unprivileged: " + errU.Error()
	none := newNone(dev, env.cpus(opts.Root, log), reason)
	log.Warn("no cgroups; compute shares only set thread counts", "describe", none.Describe())
	return none, nil
}

// startUnprivileged is newUnprivileged on the server's CPUs as a Limiter:
// nil on error.
func startUnprivileged(reason string, log *slog.Logger) (Limiter, error) {
	cpus, err := serverCPUs()
	if err != nil {
		return nil, err
	}
	l, err := newUnprivileged(unitsBase(), cpus, reason, log)
	if err != nil {
		return nil, err
	}
	log.Info("limiter ready", "kind", l.Kind(), "describe", l.Describe())
	return l, nil
}

// startMPS is newMPS as a Limiter: nil, not a nil *mpsLimiter, on error.
func startMPS(dev device, opts Options, log *slog.Logger) (Limiter, error) {
	l, err := newMPS(dev, opts.Telemetry, opts.MPSDaemon, log)
	if err != nil {
		return nil, err
	}
	l.restart = opts.RestartMPSDaemon
	log.Info("limiter ready", "kind", l.Kind(), "describe", l.Describe())
	return l, nil
}

// unitName turns an instance id into a directory name: safe characters
// are kept, others become '_', and a hash of the id keeps two ids that
// differ only in unsafe characters apart.
func unitName(id string) (string, error) {
	if id == "" {
		return "", errors.New("limiter: empty instance id")
	}
	var b strings.Builder
	for _, r := range id {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '.':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
	}
	name := b.String()
	if len(name) > 64 {
		name = name[:64]
	}
	if name != id || strings.HasPrefix(name, ".") || strings.HasPrefix(name, "cgroup.") || strings.HasPrefix(name, "sloserve-") {
		h := fnv.New32a()
		h.Write([]byte(id))
		name = fmt.Sprintf("i%s-%08x", name, h.Sum32())
	}
	return name, nil
}

// unitTable holds a backend's placed instances by id; the backend's mutex
// guards it.
type unitTable[T any] map[string]T

// free checks that id may be placed: not empty, not placed already.
func (t unitTable[T]) free(id string) error {
	if id == "" {
		return errors.New("limiter: empty instance id")
	}
	if _, ok := t[id]; ok {
		return fmt.Errorf("limiter: instance %q is placed already", id)
	}
	return nil
}

// get returns a placed instance, or ErrUnknownInstance.
func (t unitTable[T]) get(id string) (T, error) {
	u, ok := t[id]
	if !ok {
		return u, fmt.Errorf("%w: %q", ErrUnknownInstance, id)
	}
	return u, nil
}
