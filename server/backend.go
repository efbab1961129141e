package server

import (
	"context"
	"slices"
	"sync/atomic"
	"time"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/dashboard"
	"github.com/sloserve/sloserve/device"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/predictor"
)

// Version is the sloserve version, set at build time with -ldflags.
var Version = "dev"

// backend serves the protocol handlers. The request path's methods
// (ModelReady, Metadata, ModelConfig, Infer, Preadmit, Statistics) are the
// registry's own, promoted: api calls the registry directly.
type backend struct {
	*models.Registry
	ctl     configs.Control
	devs    *device.Set
	loops   *device.Loops
	pred    *predictor.Predictor
	rec     *device.Recovery    // nil: no simulated GPUs
	place   *device.Placement   // nil: gpu.placement off
	dash    *dashboard.Recorder // nil: disabled
	reloads *reloader
	// state is starting, ready (the initial loads are done) or shutting
	// down; once shutting down it stays so.
	state    atomic.Int32
	stopping atomic.Bool
}

// The backend's states.
const (
	stateStarting int32 = iota
	stateReady
	stateShuttingDown
)

// markReady says the initial loads are done; false when the shutdown has
// begun first (the server then never says ready).
func (b *backend) markReady() bool { return b.state.CompareAndSwap(stateStarting, stateReady) }

// shutdown makes readiness false for good.
func (b *backend) shutdown() { b.state.Store(stateShuttingDown) }

var _ api.Backend = (*backend)(nil)

func (b *backend) Live() bool { return !b.stopping.Load() }
func (b *backend) Ready() bool {
	return b.state.Load() == stateReady && !b.stopping.Load() && singleModelReady(b.reloads.current(), b.Registry)
}

func (b *backend) ServerVersion() string { return Version }

func (b *backend) RepositoryIndex(ctx context.Context, readyOnly bool) ([]models.IndexEntry, error) {
	return b.Registry.Index(readyOnly), nil
}

func (b *backend) LoadModel(ctx context.Context, name string, config []byte) error {
	if config != nil {
		return b.Registry.LoadWithConfig(ctx, name, config)
	}
	return b.Registry.Load(ctx, name)
}

func (b *backend) UnloadModel(ctx context.Context, name string) error {
	return b.Registry.Unload(ctx, name)
}

func (b *backend) ReloadConfig(ctx context.Context) (api.ReloadResult, error) {
	return b.reloads.reload()
}

func (b *backend) Control() api.ControlStatus {
	ctl := b.ctl
	st := api.ControlStatus{Policy: ctl.Policy, Period: ctl.Period.String(), Devices: []api.DeviceControl{}}
	for _, l := range b.loops.All() {
		d := l.Device()
		dc := api.DeviceControl{
			Device: d.Name(), Limiter: d.Limiter().Kind(), LimiterDetail: d.Limiter().Describe(), CPUs: d.Limiter().CPUs(),
			Models: []api.ModelControl{},
		}
		for _, ms := range l.Adjuster().Shares() {
			acc := b.pred.Accuracy(ms.Model)
			us := b.Registry.UnitStats(ms.Model)
			var pending *float64
			if ms.Pending != nil {
				pending = new(ms.Pending.Compute)
			}
			dc.Models = append(dc.Models, api.ModelControl{
				PendingShare: pending,
				Model:        ms.Model, Class: string(ms.Class), SLOms: api.Milliseconds(ms.SLO),
				ComputeShare: ms.Share.Compute, MemoryShare: ms.Share.Memory, TargetShare: ms.Target,
				TargetMemory: ms.MemoryTarget, MemoryReason: ms.MemoryReason,
				Source: ms.Source, Pinned: ms.Pinned,
				ForecastRate: ms.ForecastRate, ObservedRate: acc.ObservedRate, Attainment: ms.Attainment,
				PredictedMs: api.Milliseconds(acc.Predicted), ObservedMs: api.Milliseconds(acc.Observed),
				MAPE: acc.MAPE, MAPEFloor: acc.MAPEFloor, ProfileMAPE: acc.ProfileMAPE, Correction: acc.Correction, Interference: acc.Interference,
				PlannedLatencyMs: api.Milliseconds(ms.PredictedLatency), PredictionSamples: acc.Samples,
				MemoryUsedBytes: us.MemoryBytes, ThrottledSeconds: us.ThrottledSeconds, CPUSeconds: us.CPUSeconds,
				Risky: b.rec.Risky(ms.Model),
			})
		}
		st.Devices = append(st.Devices, dc)
	}
	return st
}

func (b *backend) Limiters() map[string]string {
	out := map[string]string{}
	for _, d := range b.devs.Devices() {
		out[d.Name()] = d.Limiter().Kind()
	}
	return out
}

func (b *backend) ControlEvents(since time.Time, limit int) []control.Event {
	var all []control.Event
	for _, l := range b.loops.All() {
		all = append(all, l.Adjuster().Events(since, limit)...)
	}
	if b.rec != nil {
		all = append(all, b.rec.Events(since, limit)...)
	}
	if b.place != nil {
		all = append(all, b.place.Events(since, limit)...)
	}
	slices.SortStableFunc(all, func(a, b control.Event) int { return a.Time.Compare(b.Time) })
	if len(all) > limit {
		all = all[len(all)-limit:]
	}
	return all
}

func (b *backend) PinShare(ctx context.Context, name string, pin *limiter.Share) error {
	key, device, err := b.Registry.VersionKey(name, "")
	if err != nil {
		return err
	}
	l := b.loops.Lookup(device)
	if l == nil {
		_, err := b.devs.Scheduler(device) // why the device has no loop
		return err
	}
	return l.Adjuster().Pin(key, pin)
}
