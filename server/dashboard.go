package server

import (
	"cmp"
	"strings"
	"time"

	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/dashboard"
)

// dashboardSnapshot reads what the dashboard records once a resolution
// step: each device's scheduler counters joined with the adjuster's shares,
// the predictor's view and the limiter's readings, and the repository index
// for the models that do not serve.
func (b *backend) dashboardSnapshot() dashboard.Snapshot {
	snap := dashboard.Snapshot{Time: time.Now(), Policy: b.ctl.Policy}
	for _, l := range b.loops.All() {
		d := l.Device()
		snap.Devices = append(snap.Devices, dashboard.Device{Name: d.Name(), Limiter: d.Limiter().Kind(), CPUs: d.Limiter().CPUs()})
		shares := map[string]control.ModelShare{}
		for _, ms := range l.Adjuster().Shares() {
			shares[ms.Model] = ms
		}
		for _, st := range d.Scheduler().AllStats() {
			ms := shares[st.Model]
			acc := b.pred.Accuracy(st.Model)
			us := b.Registry.UnitStats(st.Model)
			name, version, _ := strings.Cut(st.Model, "/")
			snap.Models = append(snap.Models, dashboard.ModelSample{
				Key: st.Model, Name: name, Version: version, Device: d.Name(), Stats: st,
				ComputeShare: ms.Share.Compute, TargetShare: ms.Target, MemoryShare: ms.Share.Memory,
				MemoryUsed: us.MemoryBytes, ShareSource: ms.Source, Pinned: ms.Pinned,
				ForecastRate: cmp.Or(ms.ForecastRate, acc.ForecastRate),
				Predicted:    acc.Predicted, Observed: acc.Observed, Planned: ms.PredictedLatency,
				Interference: acc.Interference,
			})
		}
	}
	for _, e := range b.Registry.IndexKnown(false) {
		snap.States = append(snap.States, dashboard.ModelState{Name: e.Name, Version: e.Version, State: string(e.State), Reason: e.Reason})
	}
	return snap
}

func (b *backend) Dashboard() *dashboard.Recorder { return b.dash }
