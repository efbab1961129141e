package device

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/predictor"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/simgpu"
)

// Placement wires control.Placer to the devices (gpu.placement): it reads
// the devices and the cuda models on them (the snapshot), places a model
// that names no device at load (the registry's Options.Place) and moves
// models through the registry (control.Mover).
type Placement struct {
	cfg    configs.GPUPlacement
	ctl    configs.Control
	sim    *simgpu.Sim
	pred   *predictor.Predictor
	placer *control.Placer
	log    *slog.Logger
	// risky, when set, marks the best-effort models placement keeps apart
	// from latency-critical ones (the device-fault recovery's isolation).
	risky control.RiskyModels
	// view is what placement reads and moves: the models and the
	// devices' loops. It is the one binding made after construction
	// (Bind, before any model loads): the registry places a loading model
	// through placement, and placement reads the registry and the
	// adjusters that are built on it.
	view atomic.Pointer[placementView]

	mu sync.Mutex
	// arrivals are each version's arrival count when the snapshot last
	// read it, for the rate under the policies whose adjusters forecast
	// none (static, shared).
	arrivals map[string]arrivalMark
}

// PlacedModels are the models placement reads and moves: the registry
// (models.Registry) implements it.
type PlacedModels interface {
	// Placements are the serving versions and where they run.
	Placements() []models.PlacedVersion
	// Move moves a serving version to another device by a warm shadow.
	Move(ctx context.Context, key, device string) error
}

var _ PlacedModels = (*models.Registry)(nil)

// placementView is what placement reads: the models and the loops of the
// devices they are on.
type placementView struct {
	reg   PlacedModels
	loops *Loops
}

// PlacementOptions configures NewPlacement.
type PlacementOptions struct {
	Config  configs.GPUPlacement
	Control configs.Control
	// Sim is the simulated machine whose GPUs placement places on.
	Sim       *simgpu.Sim
	Predictor *predictor.Predictor
	// Risky, when set, marks the models to keep apart from
	// latency-critical ones (the device-fault recovery's isolation).
	Risky  control.RiskyModels
	Logger *slog.Logger
}

// arrivalMark is a version's arrival count at a time, and the rate seen
// since the mark before.
type arrivalMark struct {
	at      time.Time
	arrived uint64
	rate    float64
}

// Prior demands of a model whose rate and latency nothing has measured
// yet (at load): assumptions, corrected by re-placement once forecasts
// exist.
const (
	priorDemandLC = 0.25
	priorDemandBE = 0.1
)

// NewPlacement returns the devices' placement, nil when gpu.placement is
// off. It places and moves once Bind has given it the models and the
// loops.
func NewPlacement(opts PlacementOptions) (*Placement, error) {
	cfg, log := opts.Config, opts.Logger
	if !cfg.Enabled {
		return nil, nil
	}
	if opts.Sim == nil {
		return nil, errors.New("gpu.placement: needs simulated GPUs (gpu.simulator.devices)")
	}
	p := &Placement{cfg: cfg, ctl: opts.Control, sim: opts.Sim, pred: opts.Predictor, risky: opts.Risky,
		log: log.With("component", "placement"), arrivals: map[string]arrivalMark{}}
	placer, err := control.NewPlacer(control.PlacerOptions{
		Period: cfg.Period, MinGain: cfg.MinGain, MinResidence: cfg.MinResidence,
		Snapshot: p.Snapshot, Mover: p, Logger: log,
	})
	if err != nil {
		return nil, err
	}
	p.placer = placer
	return p, nil
}

// Bind gives placement the models and the loops; once, before any model
// loads.
func (p *Placement) Bind(reg PlacedModels, loops *Loops) {
	p.view.Store(&placementView{reg: reg, loops: loops})
}

func (p *Placement) isRisky(model string) bool {
	if p.risky == nil {
		return false
	}
	_, ok := p.risky.Risky(model)
	return ok
}

// Run re-places until ctx ends.
func (p *Placement) Run(ctx context.Context) {
	if err := p.placer.Run(ctx); err != nil {
		p.log.Error("placement stopped", "err", err)
	}
}

// devices are the simulated GPUs.
func (p *Placement) devices() []control.PlacementDevice {
	spec := p.sim.Spec()
	out := make([]control.PlacementDevice, spec.Devices)
	for i := range out {
		out[i] = control.PlacementDevice{Name: fmt.Sprintf("cuda:%d", i), Memory: spec.Memory}
	}
	return out
}

// Place is the registry's Options.Place: the device of a cuda model
// loading without a device_id, from its class, the memory its instances
// pin at load (memory per instance, its first memory share; 0: its
// memory_limit) and a prior demand (nothing has forecast it yet). A model
// that names its device is counted there.
func (p *Placement) Place(model string, cfg *configs.Model, memory int64) (int, error) {
	if memory <= 0 {
		memory = int64(cfg.Resources.MemoryLimit)
	}
	m := control.PlacementModel{
		Name: model, Class: qos.Class(cfg.SLO.Class),
		Memory: memory * int64(max(1, cfg.Instances)),
		Risky:  p.isRisky(model),
	}
	m.Demand = priorDemandBE
	if m.Class == qos.ClassLatencyCritical {
		m.Demand = priorDemandLC
	}
	if cfg.Execution.DeviceGiven {
		m.Device, m.Pinned = fmt.Sprintf("cuda:%d", cfg.Execution.DeviceID), true
	}
	dev, err := p.placer.Place(m)
	if err != nil {
		return 0, err
	}
	var id int
	if _, err := fmt.Sscanf(dev, "cuda:%d", &id); err != nil {
		return 0, fmt.Errorf("placement chose %q: %w", dev, err)
	}
	return id, nil
}

// Snapshot is the Placer's view: the devices, and each cuda model on one
// with its demand and memory. A model's versions count together, on the
// device of its first.
func (p *Placement) Snapshot() ([]control.PlacementDevice, []control.PlacementModel) {
	v := p.view.Load()
	if v == nil {
		return p.devices(), nil
	}
	reg := v.reg
	byModel := map[string]*control.PlacementModel{}
	var order []string
	for _, v := range reg.Placements() {
		m, ok := byModel[v.Model]
		if !ok {
			m = &control.PlacementModel{Name: v.Model, Class: qos.Class(v.Config.SLO.Class), Device: v.Device,
				Pinned: v.Pinned, Risky: p.isRisky(v.Model)}
			// Best-effort work in the background (below normal MPS
			// priority under adaptive) fills what the others leave.
			if l := p.loop(v.Device); l != nil && m.Class != qos.ClassLatencyCritical {
				m.Yields = l.Adjuster().Policy().Backgrounds() && l.Device().Limiter().Capabilities().Background
			}
			byModel[v.Model] = m
			order = append(order, v.Model)
		}
		m.Demand += p.demand(v)
		// The memory share in effect: under the adaptive policy sized
		// from the working set, else the memory_limit.
		mem := v.MemoryLimit
		if v.Share.Memory > 0 {
			mem = v.Share.Memory
		}
		m.Memory += max(mem, v.MemoryUsed)
	}
	slices.Sort(order)
	out := make([]control.PlacementModel, 0, len(order))
	for _, name := range order {
		out = append(out, *byModel[name])
	}
	return p.devices(), out
}

// demand is the compute share a version needs at its forecast rate: its
// busy fraction at the whole device, the forecast rate times the predicted
// execution at share 1 (a best-effort request counted as a batch of
// max_batch_size), over the utilisation bound for a latency-critical one.
// Under the adaptive policy a latency-critical version's demand is its
// target share (the smallest its adjuster predicts meets its SLO) where
// shares are reserved; where every share is a cap (MPS) the target is a
// ceiling that keeps nothing from the others (often the knee of its
// largest batch), so there the demand is what it uses: NVML's measured SM
// use, or the busy fraction without a reading, over the utilisation bound,
// up to the target. Before any forecast, the prior.
func (p *Placement) demand(v models.PlacedVersion) float64 {
	lc := qos.Class(v.Config.SLO.Class) == qos.ClassLatencyCritical
	bound := max(p.ctl.MaxUtilization, 0.1) // a latency-critical model's utilisation bound
	target := 0.0
	if d := p.loop(v.Device); d != nil && lc && d.Adjuster().Policy().Forecasts() {
		for _, ms := range d.Adjuster().Shares() {
			if ms.Model == v.Key && ms.Target > 0 {
				target = min(ms.Target, 1)
			}
		}
		if target > 0 {
			if !d.Device().Limiter().Capabilities().CapsOnly {
				return target
			}
			if u, ok := d.Usage(v.Key); ok {
				return min(u/bound, target)
			}
		}
	}
	pred := p.pred
	rate := p.rate(v)
	batch := 1
	if !lc {
		batch = max(1, v.Config.MaxBatchSize)
	}
	lat, ok := pred.Latency(v.Key, batch, 1)
	if !ok {
		if lc {
			return priorDemandLC
		}
		return priorDemandBE
	}
	busy := rate * lat.Seconds()
	if lc {
		busy /= bound
	}
	if target > 0 {
		busy = min(busy, target)
	}
	return min(busy, 1)
}

// rate is a version's arrival rate: the one its adjuster forecasts under
// the adaptive policy, else the one seen since the last snapshot (the
// static and shared policies forecast nothing).
func (p *Placement) rate(v models.PlacedVersion) float64 {
	d := p.loop(v.Device)
	if d == nil {
		return 0
	}
	if d.Adjuster().Policy().Forecasts() {
		return p.pred.ForecastRate(v.Key, p.ctl.Period)
	}
	st, ok := d.Device().Scheduler().ModelState(v.Key)
	if !ok {
		return 0
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	mark, seen := p.arrivals[v.Key]
	now := time.Now()
	if seen && st.Arrived >= mark.arrived && now.Sub(mark.at) >= time.Second {
		mark.rate = float64(st.Arrived-mark.arrived) / now.Sub(mark.at).Seconds()
	} else if seen && st.Arrived >= mark.arrived {
		return mark.rate // read again within a second: keep the last rate
	}
	// A version that moved starts its count again on its new device.
	mark.at, mark.arrived = now, st.Arrived
	p.arrivals[v.Key] = mark
	return mark.rate
}

// Move is control.Mover: every serving version of the model moves to the
// device, one after the other.
func (p *Placement) Move(ctx context.Context, model, device string) error {
	view := p.view.Load()
	if view == nil {
		return errors.New("placement: no registry yet")
	}
	reg := view.reg
	var errs []error
	for _, v := range reg.Placements() {
		if v.Model == model && v.Device != device {
			if err := reg.Move(ctx, v.Key, device); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// loop is the control loop of a device, nil when it has none.
func (p *Placement) loop(name string) *Loop {
	if v := p.view.Load(); v != nil {
		return v.loops.Lookup(name)
	}
	return nil
}

// Events are the placement's events.
func (p *Placement) Events(since time.Time, limit int) []control.Event {
	return p.placer.Events(since, limit)
}

var _ control.Mover = (*Placement)(nil)
