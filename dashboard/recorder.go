// Package dashboard keeps the history the built-in dashboard shows: once a
// resolution step it samples every model's counters, latencies, shares and
// predictions, turns them into rates and quantiles over a trailing window,
// and keeps the points in a ring buffer per model for the retention period.
// It also holds the dashboard page's files. The api package serves both.
//
// It must not change anything it observes (it reads the scheduler's
// counters and the shares, predictions and readings it is given) and must
// not serve HTTP: api serves its JSON and its files. Its numbers are the QoS
// scheduler's own counters, never a second count of outcomes.
package dashboard

import (
	"cmp"
	"context"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/sloserve/sloserve/qos"
)

// Options configure a Recorder.
type Options struct {
	// Resolution is the time between two samples.
	Resolution time.Duration
	// Retention is how much history each model keeps.
	Retention time.Duration
	// Window is the trailing span each point's rates, attainment and
	// latency quantiles are computed over.
	Window time.Duration
	// AttainmentTarget is the SLO attainment below which a model is
	// reported as missing its SLO.
	AttainmentTarget float64
}

// ModelSample is what the server reads about one serving model version at
// a sampling instant.
type ModelSample struct {
	Key     string // "name/version", the scheduler's name
	Name    string
	Version string
	Device  string
	// Stats are the scheduler's cumulative counters and latencies.
	Stats qos.Stats

	ComputeShare float64 // applied; 0 = no limit
	TargetShare  float64
	MemoryShare  int64 // bytes; 0 = no limit
	MemoryUsed   int64
	ShareSource  string // adaptive, static, shared, pinned, config
	Pinned       bool

	ForecastRate float64       // requests/s, 0 = unknown
	Predicted    time.Duration // mean prediction of recent executions, 0 = unknown
	Observed     time.Duration // mean observed execution time, 0 = unknown
	Planned      time.Duration // latency the adjuster planned at the share, 0 = unknown
	Interference float64
}

// ModelState is a repository index entry: a model version's state even
// when it does not serve.
type ModelState struct {
	Name, Version, State, Reason string
}

// Device is an execution device as the dashboard shows it.
type Device struct {
	Name    string
	Limiter string // cgroup-v2, cgroup-v1, mps or none
	CPUs    int    // compute units a share is a fraction of
}

// Snapshot is one sampling instant.
type Snapshot struct {
	Time    time.Time
	Policy  string // the share policy
	Devices []Device
	Models  []ModelSample
	States  []ModelState
}

// Source reads a Snapshot.
type Source func() Snapshot

// Recorder keeps every model's history. It is safe for concurrent use.
type Recorder struct {
	opts Options

	mu      sync.Mutex
	series  map[string]*series // by key
	states  []ModelState
	policy  string
	devices []Device
	last    time.Time // of the latest sample
}

// series is one model version's history.
type series struct {
	sample ModelSample // the latest
	seen   time.Time   // when it was last in a snapshot
	points *ring[point]
	// recent are the cumulative readings of the last window, oldest
	// first, to difference against.
	recent *ring[reading]
}

// reading is a model's cumulative counters at one instant.
type reading struct {
	t                                                                   time.Time
	arrived, good, late, rejected, queueFull, dropped, failed, canceled uint64
	latency                                                             qos.LatencyHistogram
}

func readingOf(t time.Time, st *qos.Stats) reading {
	return reading{
		t: t, arrived: st.Arrived, good: st.Good, late: st.Late, rejected: st.Rejected, queueFull: st.QueueFull,
		dropped: st.Dropped, failed: st.Failed, canceled: st.Canceled, latency: st.Latency,
	}
}

// settled counts the requests that have ended.
func (r *reading) settled() uint64 {
	return r.good + r.late + r.rejected + r.dropped + r.failed + r.canceled
}

// before reports whether any counter of r is below the same counter of
// prev: the model was removed and added again, and its counters restarted.
func (r *reading) before(prev *reading) bool {
	return r.arrived < prev.arrived || r.settled() < prev.settled() || r.queueFull < prev.queueFull ||
		r.latency.Count() < prev.latency.Count()
}

// New returns a Recorder; zero options take the defaults (1 s resolution,
// 6 h retention, 10 s window, 0.99 attainment target).
func New(opts Options) *Recorder {
	opts.Resolution = cmp.Or(opts.Resolution, time.Second)
	opts.Retention = max(cmp.Or(opts.Retention, 6*time.Hour), opts.Resolution)
	opts.Window = max(cmp.Or(opts.Window, 10*time.Second), opts.Resolution)
	opts.AttainmentTarget = cmp.Or(opts.AttainmentTarget, 0.99)
	return &Recorder{opts: opts, series: map[string]*series{}}
}

// Options returns the options in effect, defaults filled in.
func (r *Recorder) Options() Options { return r.opts }

// Run samples src once a resolution step until ctx ends.
func (r *Recorder) Run(ctx context.Context, src Source) {
	t := time.NewTicker(r.opts.Resolution)
	defer t.Stop()
	for {
		r.Record(src())
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Record adds one snapshot's points. Series of versions absent for longer
// than the retention are forgotten.
func (r *Recorder) Record(snap Snapshot) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := snap.Time
	if !r.last.IsZero() && now.Before(r.last) {
		return // a clock step back; the next sample catches up
	}
	r.last = now
	r.states = slices.Clone(snap.States)
	r.policy, r.devices = snap.Policy, slices.Clone(snap.Devices)
	for i := range snap.Models {
		m := &snap.Models[i]
		s, ok := r.series[m.Key]
		if !ok {
			s = &series{
				points: newRing[point](int(r.opts.Retention / r.opts.Resolution)),
				recent: newRing[reading](int(r.opts.Window/r.opts.Resolution) + 1),
			}
			r.series[m.Key] = s
		}
		s.sample = *m
		s.seen = now
		s.points.push(r.pointOf(s, now))
	}
	for key, s := range r.series {
		if now.Sub(s.seen) > r.opts.Retention {
			delete(r.series, key)
		}
	}
}

// pointOf records the model's reading and computes its point: rates and
// quantiles over the trailing window, counts since the previous reading.
func (r *Recorder) pointOf(s *series, now time.Time) point {
	m := &s.sample
	cur := readingOf(now, &m.Stats)
	if prev := s.recent.last(); prev != nil && cur.before(prev) {
		s.recent.reset()
	}
	p := unknownPoint
	p.t = now
	p.v[fComputeShare] = m.ComputeShare
	p.v[fTargetShare] = m.TargetShare
	p.v[fMemoryShare] = float64(m.MemoryShare)
	p.v[fMemoryUsed] = float64(m.MemoryUsed)
	p.v[fQueueDepth] = float64(m.Stats.QueueDepth)
	p.v[fForecastRate] = positive(m.ForecastRate)
	p.v[fPredicted] = positive(ms(m.Predicted))
	p.v[fObserved] = positive(ms(m.Observed))
	p.v[fPlanned] = positive(ms(m.Planned))

	if prev := s.recent.last(); prev != nil {
		p.v[fRejectedDeadline] = float64((cur.rejected - cur.queueFull) - (prev.rejected - prev.queueFull))
		p.v[fRejectedQueueFull] = float64(cur.queueFull - prev.queueFull)
		p.v[fDropped] = float64(cur.dropped - prev.dropped)
		p.v[fFailed] = float64(cur.failed - prev.failed)
	}
	// The window's base is the oldest reading no older than the window,
	// give or take half a step of sampling jitter.
	var base *reading
	for i := range s.recent.len() {
		if b := s.recent.at(i); now.Sub(b.t) <= r.opts.Window+r.opts.Resolution/2 {
			base = b
			break
		}
	}
	if base != nil {
		if span := now.Sub(base.t).Seconds(); span > 0 {
			p.v[fArrivalRate] = float64(cur.arrived-base.arrived) / span
			p.v[fGoodput] = float64(cur.good-base.good) / span
			p.v[fThroughput] = float64(cur.good+cur.late-base.good-base.late) / span
		}
		if settled := cur.settled() - base.settled(); settled > 0 {
			p.v[fAttainment] = float64(cur.good-base.good) / float64(settled)
		}
		lat := cur.latency.Sub(&base.latency)
		if lat.Count() > 0 {
			p.v[fP50] = ms(lat.Quantile(0.5))
			p.v[fP90] = ms(lat.Quantile(0.9))
			p.v[fP99] = ms(lat.Quantile(0.99))
		}
	}
	s.recent.push(cur)
	return p
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// positive maps the "unknown" zero to NaN.
func positive(x float64) float64 {
	if x > 0 {
		return x
	}
	return math.NaN()
}

// splitKey splits "name/version".
func splitKey(key string) (name, version string) {
	name, version, _ = strings.Cut(key, "/")
	return name, version
}
