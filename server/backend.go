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
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/runtime"
)

// backend serves the protocol handlers from the model registry.
type backend struct {
	reg      *models.Registry
	devs     *devices
	dash     *dashboard.Recorder // nil: disabled
	reloads  *reloader
	ready    atomic.Bool // initial loads done and not shutting down
	stopping atomic.Bool
}

var _ api.Backend = (*backend)(nil)

func (b *backend) Live() bool            { return !b.stopping.Load() }
func (b *backend) Ready() bool           { return b.ready.Load() && !b.stopping.Load() }
func (b *backend) ServerVersion() string { return Version }

func (b *backend) ModelReady(name, version string) (bool, error) {
	return b.reg.ModelReady(name, version)
}

func (b *backend) ModelMetadata(name, version string) (models.Metadata, error) {
	return b.reg.Metadata(name, version)
}

func (b *backend) ModelConfig(name, version string) (*configs.Model, error) {
	return b.reg.ModelConfig(name, version)
}

func (b *backend) Infer(ctx context.Context, name, version string, req *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	return b.reg.Infer(ctx, name, version, req)
}

func (b *backend) Preadmit(ctx context.Context, name, version string, deadline time.Time) error {
	return b.reg.Preadmit(ctx, name, version, deadline)
}

func (b *backend) Statistics(name, version string) ([]models.Statistics, error) {
	return b.reg.Statistics(name, version)
}

func (b *backend) RepositoryIndex(ctx context.Context, readyOnly bool) ([]models.IndexEntry, error) {
	return b.reg.Index(readyOnly), nil
}

func (b *backend) LoadModel(ctx context.Context, name string) error {
	return b.reg.Load(ctx, name)
}

func (b *backend) UnloadModel(ctx context.Context, name string) error {
	return b.reg.Unload(ctx, name)
}

func (b *backend) ReloadConfig(ctx context.Context) (api.ReloadResult, error) {
	return b.reloads.reload()
}

func (b *backend) Control() api.ControlStatus {
	st := api.ControlStatus{Policy: b.devs.ctl.Policy, Period: b.devs.ctl.Period.String(), Devices: []api.DeviceControl{}}
	for _, d := range b.devs.all() {
		dc := api.DeviceControl{
			Device: d.name, Limiter: d.lim.Kind(), LimiterDetail: d.lim.Describe(), CPUs: d.lim.CPUs(),
			Models: []api.ModelControl{},
		}
		for _, ms := range d.adj.Shares() {
			acc := b.devs.pred.Accuracy(ms.Model)
			us := b.reg.UnitStats(ms.Model)
			dc.Models = append(dc.Models, api.ModelControl{
				Model: ms.Model, Class: string(ms.Class), SLOms: api.Milliseconds(ms.SLO),
				ComputeShare: ms.Share.Compute, MemoryShare: ms.Share.Memory, TargetShare: ms.Target,
				Source: ms.Source, Pinned: ms.Pinned,
				ForecastRate: ms.ForecastRate, ObservedRate: acc.ObservedRate, Attainment: ms.Attainment,
				PredictedMs: api.Milliseconds(acc.Predicted), ObservedMs: api.Milliseconds(acc.Observed),
				MAPE: acc.MAPE, ProfileMAPE: acc.ProfileMAPE, Correction: acc.Correction, Interference: acc.Interference,
				PlannedLatencyMs: api.Milliseconds(ms.PredictedLatency), PredictionSamples: acc.Samples,
				MemoryUsedBytes: us.MemoryBytes, ThrottledSeconds: us.ThrottledSeconds, CPUSeconds: us.CPUSeconds,
			})
		}
		st.Devices = append(st.Devices, dc)
	}
	return st
}

func (b *backend) Limiters() map[string]string {
	out := map[string]string{}
	for _, d := range b.devs.all() {
		out[d.name] = d.lim.Kind()
	}
	return out
}

func (b *backend) ControlEvents(since time.Time, limit int) []control.Event {
	var all []control.Event
	for _, d := range b.devs.all() {
		all = append(all, d.adj.Events(since, limit)...)
	}
	if b.devs.place != nil {
		all = append(all, b.devs.place.events(since, limit)...)
	}
	slices.SortStableFunc(all, func(a, b control.Event) int { return a.Time.Compare(b.Time) })
	if len(all) > limit {
		all = all[len(all)-limit:]
	}
	return all
}

func (b *backend) PinShare(ctx context.Context, name string, pin *limiter.Share) error {
	key, device, err := b.reg.VersionKey(name, "")
	if err != nil {
		return err
	}
	d, err := b.devs.get(device)
	if err != nil {
		return err
	}
	return d.adj.Pin(key, pin)
}
