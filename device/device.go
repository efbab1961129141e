package device

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	goruntime "runtime"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/predictor"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/simgpu"
)

// Models is what a device reads of the models on it and how its adjuster's
// shares reach them: the registry (models.Registry) implements it, and
// answers models.ErrMoving for a version moving between devices.
type Models interface {
	control.AsyncActuator
	control.InstanceMemoryReader
	control.MemoryBatchBounder
	// VersionKey resolves a model version to its key and the device it
	// runs on.
	VersionKey(name, version string) (key, device string, err error)
	// Share is the share a loaded version runs at; an error once it is
	// unloaded.
	Share(key string) (limiter.Share, error)
	// UnitStats sums what the limiter reads of the version's units.
	UnitStats(key string) limiter.Stats
	// MeasuredUsage sums a version's units' use of the device in byUnit
	// (limiter.UsageReader's reading); false when none of them has one.
	MeasuredUsage(key string, byUnit map[string]float64) (float64, bool)
}

// Options configures New.
type Options struct {
	Name    string // "cpu" or "cuda:N"
	QoS     configs.QoS
	Control configs.Control
	// Predictor serves every device (model keys are unique).
	Predictor *predictor.Predictor
	// Gate is the one admission limit on requests in flight, shared by
	// every device's scheduler.
	Gate *qos.Gate
	// Sim, when set, is the simulated machine cuda devices are on: the
	// limiter reads its NVML and MPS daemon.
	Sim        *simgpu.Sim
	Registerer prometheus.Registerer
	// UseGauge is sloserve_device_use (NewUseGauge); nil: not exported.
	UseGauge *prometheus.GaugeVec
	Logger   *slog.Logger // the server's; each part adds its component and the device
}

// Device is one execution device: its limiter and its QoS scheduler,
// what the models on it need to load and to serve. Its control loop
// (Loop) is built on it once the models exist.
type Device struct {
	name  string
	opts  Options
	log   *slog.Logger
	lim   limiter.Limiter
	sched *qos.Scheduler
}

// New starts the device's limiter as the control config says and builds
// its scheduler; Run runs the scheduler, Close removes the limiter's
// units.
func New(opts Options) (*Device, error) {
	name := opts.Name
	log := opts.Logger.With("device", name)
	floor := opts.QoS.BestEffortFloor
	if floor == 0 {
		floor = -1 // configs says 0 means none; qos reads 0 as its default
	}
	beBound := opts.QoS.MaxBestEffortExecution
	if beBound == 0 {
		beBound = -1 // the same
	}
	lim, err := NewLimiter(opts.Control, name, opts.Sim, opts.Logger)
	if err != nil {
		return nil, fmt.Errorf("device %s: limiter: %w", name, err)
	}
	slots := Slots(name, opts.QoS.DeviceSlots, lim, opts.Sim)
	log.Info("limiter", "kind", lim.Kind(), "detail", lim.Describe())
	sched, err := qos.NewScheduler(qos.Options{
		Policy:                 opts.QoS.Policy,
		BestEffortFloor:        floor,
		DeviceSlots:            slots,
		MaxBestEffortExecution: beBound,
		OverlapSlowdown:        overlapSlowdown(name, opts.QoS.OverlapSlowdown),
		SeparateClasses:        backgroundsBestEffort(opts.Control.Policy, lim),
		Estimator:              opts.Predictor,
		Logger:                 log, // qos adds its component
		Registerer:             opts.Registerer,
		Device:                 name,
		Window:                 opts.QoS.Window,
		Gate:                   opts.Gate,
	})
	if err != nil {
		lim.Close()
		return nil, err
	}
	log.Info("device started", "policy", opts.QoS.Policy, "slots", slots)
	return &Device{name: name, opts: opts, log: log, sched: sched, lim: lim}, nil
}

// Run runs the device's scheduler until ctx ends.
func (d *Device) Run(ctx context.Context) {
	if err := d.sched.Run(ctx); err != nil {
		d.log.Error("scheduler stopped", "err", err)
	}
}

// Close removes the limiter's units; call it once Run and the device's
// Loop.Run have returned.
func (d *Device) Close() error { return d.lim.Close() }

func (d *Device) Name() string              { return d.name }
func (d *Device) Limiter() limiter.Limiter  { return d.lim }
func (d *Device) Scheduler() *qos.Scheduler { return d.sched }

// NewLimiter starts a device's limiter as the control config says. The
// shared policy sets no limits, so under auto it gets none. On a simulated
// GPU it reads the simulator's NVML and MPS daemon. log is the server's:
// the limiter adds its component and the device.
func NewLimiter(ctl configs.Control, device string, sim *simgpu.Sim, log *slog.Logger) (limiter.Limiter, error) {
	backend := ctl.Limiter
	if p, err := control.PolicyNamed(ctl.Policy); err == nil && !p.Limits() && backend == limiter.BackendAuto {
		backend = limiter.BackendNone
	}
	opts := limiter.Options{Backend: backend, Device: device, Period: ctl.CFSPeriod, Logger: log}
	if Simulated(sim, device) != nil {
		if err := simulatedLimiterOptions(sim, &opts); err != nil {
			return nil, err
		}
	}
	return limiter.New(opts)
}

// backgroundsBestEffort reports whether the device runs best-effort work
// behind latency-critical work: a policy that puts best-effort runners in
// the background (limiter.ModeBackground; adaptive), on a limiter that has
// a background class, so the scheduler may give each class slots of its
// own.
func backgroundsBestEffort(policy string, lim limiter.Limiter) bool {
	p, err := control.PolicyNamed(policy)
	return err == nil && p.Backgrounds() && lim.Capabilities().Background
}

// Slots is how many executions a device runs at once across its models.
// CPU: qos.device_slots, else one per core. GPU: the clients of an MPS
// server run their kernels at once, each within its percentage, so a GPU
// takes the clients its limiter runs at once (MPS: limiter.MPSClients), a
// simulated GPU whose daemon runs (the shared policy's unlimited clients)
// as many; a GPU without MPS time-slices its contexts and takes one. Each
// model's own slots (instances × concurrency) bound its share of them.
func Slots(name string, configured int, lim limiter.Limiter, sim *simgpu.Sim) int {
	if !strings.HasPrefix(name, "cuda:") {
		if configured > 0 {
			return configured
		}
		return goruntime.NumCPU()
	}
	if c := lim.Capabilities().Clients; c > 0 {
		return c
	}
	if d := Simulated(sim, name); d != nil && d.DaemonRunning() {
		return limiter.MPSClients
	}
	return 1
}

// overlapSlowdown is the qos.overlap_slowdown a device's scheduler holds
// batches by: the CPU's, as configured; none on a GPU, where what
// co-running executions cost is learned by the predictor from the
// device's measured use (predictor.SetCoRunning) and the hold was never
// measured.
func overlapSlowdown(name string, configured float64) float64 {
	if strings.HasPrefix(name, "cuda:") {
		return 0
	}
	return configured
}

// Simulated is the simulated GPU behind a device name ("cuda:N"), nil
// when the device is not simulated.
func Simulated(sim *simgpu.Sim, device string) *simgpu.Device {
	n, ok := strings.CutPrefix(device, "cuda:")
	if sim == nil || !ok {
		return nil
	}
	i, err := strconv.Atoi(n)
	if err != nil {
		return nil
	}
	d, err := sim.Device(i)
	if err != nil {
		return nil
	}
	return d
}

// simulatedLimiterOptions reads a simulated GPU's telemetry and MPS daemon
// through the simulator, as a real GPU's are read through NVML and the
// daemon's pipe.
func simulatedLimiterOptions(sim *simgpu.Sim, opts *limiter.Options) error {
	tel, err := limiter.NewNVMLTelemetry(sim.NVML(), opts.Logger)
	if err != nil {
		return err
	}
	opts.Telemetry = tel
	opts.RestartMPSDaemon = SimulatedRestart(sim)
	opts.MPSDaemon = func(i int) error {
		d, err := sim.Device(i)
		if err != nil {
			return err
		}
		if !d.DaemonRunning() {
			return fmt.Errorf("the simulated device %d has no MPS control daemon (gpu.simulator.mps_daemon is false, or it is recovering from a fault)", i)
		}
		return nil
	}
	return nil
}

// SimulatedRestart is limiter.Options.RestartMPSDaemon for simulated GPUs.
func SimulatedRestart(sim *simgpu.Sim) func(context.Context, int) error {
	return func(ctx context.Context, i int) error {
		d, err := sim.Device(i)
		if err != nil {
			return err
		}
		d.RestartDaemon()
		return ctx.Err()
	}
}

// actuator is a device's adjuster's actuator (an asynchronous one, as the
// registry is): the models, for the versions that run on the device. A
// version that moved away answers control.ErrElsewhere, so that the old
// device's adjuster, which may see it until its queue there has drained,
// does not resize or evict it on its new device.
type actuator struct {
	models Models
	device string
}

var (
	_ control.AsyncActuator        = actuator{}
	_ control.InstanceMemoryReader = actuator{}
)

func (a actuator) here(key string) error {
	name, ver, _ := strings.Cut(key, "/")
	_, dev, err := a.models.VersionKey(name, ver)
	if err == nil && dev != a.device {
		return fmt.Errorf("%w: %s is on %s", control.ErrElsewhere, key, dev)
	}
	return nil
}

// elsewhere reports a version moving between devices (models.ErrMoving)
// as control.ErrElsewhere.
func (a actuator) elsewhere(err error) error {
	if errors.Is(err, models.ErrMoving) {
		return fmt.Errorf("%w: %w", control.ErrElsewhere, err)
	}
	return err
}

func (a actuator) SetShare(ctx context.Context, key string, s limiter.Share) error {
	if err := a.here(key); err != nil {
		return err
	}
	return a.elsewhere(a.models.SetShare(ctx, key, s))
}

func (a actuator) RequestShare(key string, s limiter.Share) error {
	if err := a.here(key); err != nil {
		return err
	}
	return a.elsewhere(a.models.RequestShare(key, s))
}

func (a actuator) ShareInEffect(key string) (limiter.Share, bool, error) {
	return a.models.ShareInEffect(key)
}

func (a actuator) Evict(ctx context.Context, key string) error {
	if err := a.here(key); err != nil {
		return err
	}
	return a.models.Evict(ctx, key)
}

func (a actuator) MemoryUsage(key string) int64 {
	if a.here(key) != nil {
		return 0
	}
	return a.models.MemoryUsage(key)
}

func (a actuator) BoundsBatchesByMemory(key string) bool {
	return a.here(key) == nil && a.models.BoundsBatchesByMemory(key)
}

func (a actuator) InstanceMemory(key string) int64 {
	if a.here(key) != nil {
		return 0
	}
	return a.models.InstanceMemory(key)
}

var (
	_ Models                     = (*models.Registry)(nil)
	_ control.MemoryBatchBounder = actuator{}
)
