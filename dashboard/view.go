package dashboard

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"
)

// Status says at a glance how a model does against its SLO.
const (
	StatusOK          = "ok"          // attainment at target and p99 within the SLO
	StatusMissing     = "missing"     // attainment below target or p99 over the SLO
	StatusIdle        = "idle"        // no request ended in the window
	StatusNoSLO       = "no-slo"      // the model declares no SLO
	StatusUnavailable = "unavailable" // not serving
)

// ModelOverview is one model version's current state: the latest point,
// what it is configured with, and a verdict. JSON field names are the
// dashboard API's.
type ModelOverview struct {
	Key     string `json:"key"` // "name/version"; "" for a model that serves no version
	Name    string `json:"name"`
	Version string `json:"version"`
	State   string `json:"state"`
	Reason  string `json:"reason"`
	Device  string `json:"device"`
	Class   string `json:"class"`
	SLOms   Value  `json:"slo_ms"`
	Status  string `json:"status"`
	Why     string `json:"why"`

	P50ms        Value `json:"p50_ms"`
	P90ms        Value `json:"p90_ms"`
	P99ms        Value `json:"p99_ms"`
	Attainment   Value `json:"attainment"`
	Goodput      Value `json:"goodput"`
	Throughput   Value `json:"throughput"`
	ArrivalRate  Value `json:"arrival_rate"`
	ForecastRate Value `json:"forecast_rate"`

	ComputeShare Value  `json:"compute_share"`
	TargetShare  Value  `json:"target_compute_share"`
	MemoryShare  Value  `json:"memory_share_bytes"`
	MemoryUsed   Value  `json:"memory_used_bytes"`
	ShareSource  string `json:"share_source"`
	Pinned       bool   `json:"pinned"`

	PredictedMs Value `json:"predicted_ms"`
	ObservedMs  Value `json:"observed_ms"`
	PlannedMs   Value `json:"planned_ms"`

	QueueDepth        Value `json:"queue_depth"`
	RejectedDeadline  Value `json:"rejected_deadline"` // over the window
	RejectedQueueFull Value `json:"rejected_queue_full"`
	Dropped           Value `json:"dropped"`
	Failed            Value `json:"failed"`

	Totals *Totals `json:"totals"` // since the version was loaded
}

// Totals are a model version's counters since it was loaded.
type Totals struct {
	Arrived  uint64 `json:"arrived"`
	Good     uint64 `json:"good"`
	Late     uint64 `json:"late"`
	Rejected uint64 `json:"rejected"`
	Dropped  uint64 `json:"dropped"`
	Failed   uint64 `json:"failed"`
	Canceled uint64 `json:"canceled"`
}

// Overview is every model's current state and each device's split
// between them, from the latest sample.
type Overview struct {
	Time             time.Time       `json:"time"`
	ResolutionS      float64         `json:"resolution_s"`
	WindowS          float64         `json:"window_s"`
	RetentionS       float64         `json:"retention_s"`
	AttainmentTarget float64         `json:"attainment_target"`
	Policy           string          `json:"policy"`
	Models           []ModelOverview `json:"models"`
	Devices          []DeviceSplit   `json:"devices"`
}

// DeviceSplit is how a device is divided between its serving models.
type DeviceSplit struct {
	Device  string       `json:"device"`
	Limiter string       `json:"limiter"`
	CPUs    int          `json:"cpus"`
	Shares  []ShareSplit `json:"shares"`
}

// ShareSplit is one model version's part of a device.
type ShareSplit struct {
	Key        string `json:"key"`
	Compute    Value  `json:"compute"` // 0 = no limit
	Memory     Value  `json:"memory_bytes"`
	MemoryUsed Value  `json:"memory_used_bytes"`
}

// History is one model version's points, as columns.
type History struct {
	Name             string        `json:"name"`
	Key              string        `json:"key"`
	ResolutionS      float64       `json:"resolution_s"`
	WindowS          float64       `json:"window_s"`
	AttainmentTarget float64       `json:"attainment_target"`
	Model            ModelOverview `json:"model"`
	// Series holds "t" (unix seconds) and one column per value, each as
	// long as "t".
	Series Columns `json:"series"`
}

// Columns are named columns of equal length.
type Columns struct {
	T      []float64
	Values [numFields][]Value
}

// MarshalJSON writes {"t": [...], "p50_ms": [...], ...}, appending the
// numbers directly: a history holds thousands.
func (c Columns) MarshalJSON() ([]byte, error) {
	b := make([]byte, 0, 16*(int(numFields)+1)*(len(c.T)+1))
	b = append(b, `{"t":[`...)
	for i, t := range c.T {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendFloat(b, t, 'f', -1, 64)
	}
	b = append(b, ']')
	for f := range numFields {
		b = append(b, `,"`...)
		b = append(b, fieldNames[f]...)
		b = append(b, `":[`...)
		for i, v := range c.Values[f] {
			if i > 0 {
				b = append(b, ',')
			}
			b = v.appendJSON(b)
		}
		b = append(b, ']')
	}
	return append(b, '}'), nil
}

// Column returns the column named name ("p99_ms", ...); nil if none.
func (c Columns) Column(name string) []Value {
	if i := slices.Index(fieldNames[:], name); i >= 0 {
		return c.Values[i]
	}
	return nil
}

// ColumnNames lists the value columns a history holds, besides "t".
func ColumnNames() []string { return slices.Clone(fieldNames[:]) }

// ErrUnknownModel: the history has no such model.
var ErrUnknownModel = errors.New("unknown model")

// Overview returns every model's latest point: serving versions first by
// status (missing first), then the models that serve nothing.
func (r *Recorder) Overview() Overview {
	r.mu.Lock()
	defer r.mu.Unlock()
	ov := r.header()
	serving := map[string]bool{}
	for key, s := range r.series {
		if s.seen != r.last {
			continue // not in the latest snapshot: unloaded
		}
		ov.Models = append(ov.Models, r.overviewOf(key, s))
		serving[s.sample.Name] = true
	}
	for _, st := range r.states {
		if serving[st.Name] || st.State == "READY" {
			continue
		}
		ov.Models = append(ov.Models, unavailable(st))
		serving[st.Name] = true // one row per model
	}
	slices.SortFunc(ov.Models, func(a, b ModelOverview) int {
		return cmp.Or(cmp.Compare(statusOrder(a.Status), statusOrder(b.Status)), cmp.Compare(a.Name, b.Name),
			cmp.Compare(len(a.Version), len(b.Version)), cmp.Compare(a.Version, b.Version))
	})
	for _, d := range r.devices {
		split := DeviceSplit{Device: d.Name, Limiter: d.Limiter, CPUs: d.CPUs, Shares: []ShareSplit{}}
		for _, m := range ov.Models {
			if m.Device == d.Name && m.Key != "" {
				split.Shares = append(split.Shares, ShareSplit{Key: m.Key, Compute: m.ComputeShare, Memory: m.MemoryShare, MemoryUsed: m.MemoryUsed})
			}
		}
		ov.Devices = append(ov.Devices, split)
	}
	return ov
}

func (r *Recorder) header() Overview {
	return Overview{
		Time: r.last, ResolutionS: r.opts.Resolution.Seconds(), WindowS: r.opts.Window.Seconds(),
		RetentionS: r.opts.Retention.Seconds(), AttainmentTarget: r.opts.AttainmentTarget,
		Policy: r.policy, Models: []ModelOverview{}, Devices: []DeviceSplit{},
	}
}

func statusOrder(s string) int {
	return slices.Index([]string{StatusMissing, StatusUnavailable, StatusOK, StatusIdle, StatusNoSLO}, s)
}

// History returns up to last of a model's history, only the points after
// since when since is set. version "" picks the highest serving version.
func (r *Recorder) History(name, version string, since time.Time, last time.Duration) (History, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	key, s := r.find(name, version)
	if s == nil {
		return History{}, fmt.Errorf("%w: %q has no history (version %q)", ErrUnknownModel, name, cmp.Or(version, "any"))
	}
	h := History{
		Name: name, Key: key, ResolutionS: r.opts.Resolution.Seconds(), WindowS: r.opts.Window.Seconds(),
		AttainmentTarget: r.opts.AttainmentTarget, Model: r.overviewOf(key, s),
	}
	from := r.last.Add(-last)
	if since.After(from) {
		from = since
	}
	n := s.points.len()
	first := n
	for first > 0 && s.points.at(first-1).t.After(from) {
		first--
	}
	h.Series.T = make([]float64, 0, n-first)
	for f := range numFields {
		h.Series.Values[f] = make([]Value, 0, n-first)
	}
	for i := first; i < n; i++ {
		p := s.points.at(i)
		h.Series.T = append(h.Series.T, float64(p.t.UnixMilli())/1000)
		for f := range numFields {
			h.Series.Values[f] = append(h.Series.Values[f], Value(p.v[f]))
		}
	}
	return h, nil
}

// find picks a model's series: the version asked for, else the highest
// version still serving, else the highest version with history.
func (r *Recorder) find(name, version string) (string, *series) {
	if version != "" {
		key := name + "/" + version
		return key, r.series[key]
	}
	var bestKey string
	var best *series
	for key, s := range r.series {
		if s.sample.Name != name {
			continue
		}
		if best == nil || newer(s, best, r.last) {
			bestKey, best = key, s
		}
	}
	return bestKey, best
}

// newer reports whether a should be shown before b: serving beats not
// serving, then the higher version number.
func newer(a, b *series, last time.Time) bool {
	if (a.seen == last) != (b.seen == last) {
		return a.seen == last
	}
	va, _ := strconv.ParseInt(a.sample.Version, 10, 64)
	vb, _ := strconv.ParseInt(b.sample.Version, 10, 64)
	return va > vb
}

// overviewOf builds a model version's overview from its latest point.
func (r *Recorder) overviewOf(key string, s *series) ModelOverview {
	m := &s.sample
	st := &m.Stats
	o := ModelOverview{
		Key: key, Name: m.Name, Version: m.Version, State: "READY", Device: m.Device, Class: string(st.Class),
		SLOms: Null, ShareSource: m.ShareSource, Pinned: m.Pinned,
		Totals: &Totals{
			Arrived: st.Arrived, Good: st.Good, Late: st.Late, Rejected: st.Rejected,
			Dropped: st.Dropped, Failed: st.Failed, Canceled: st.Canceled,
		},
	}
	if s.seen != r.last {
		o.State = "UNAVAILABLE"
	}
	for _, e := range r.states {
		if e.Name == m.Name && e.Version == m.Version {
			o.State, o.Reason = e.State, e.Reason
		}
	}
	if st.SLO > 0 {
		o.SLOms = Value(ms(st.SLO))
	}
	var p point
	if lp := s.points.last(); lp != nil {
		p = *lp
	}
	o.setPoint(&p)
	// Rejections over the window, to go with the window's rates: the
	// points whose counts fall in it (each counts the step before it).
	o.RejectedDeadline, o.RejectedQueueFull, o.Dropped, o.Failed = 0, 0, 0, 0
	for i := s.points.len() - 1; i >= 0; i-- {
		q := s.points.at(i)
		if p.t.Sub(q.t) > r.opts.Window-r.opts.Resolution/2 {
			break
		}
		add := func(dst *Value, f field) {
			if x := q.v[f]; !math.IsNaN(x) {
				*dst += Value(x)
			}
		}
		add(&o.RejectedDeadline, fRejectedDeadline)
		add(&o.RejectedQueueFull, fRejectedQueueFull)
		add(&o.Dropped, fDropped)
		add(&o.Failed, fFailed)
	}
	o.Status, o.Why = diagnose(&o, m, r.opts.AttainmentTarget, r.opts.Window)
	return o
}

// unavailable is the overview of a model that serves no version.
func unavailable(st ModelState) ModelOverview {
	o := ModelOverview{
		Name: st.Name, Version: st.Version, State: st.State, Reason: st.Reason, Status: StatusUnavailable, SLOms: Null,
	}
	o.setPoint(&unknownPoint)
	o.Why = "not serving"
	if st.Reason != "" {
		o.Why = "not serving: " + st.Reason
	}
	return o
}

// unknownPoint has every value unknown.
var unknownPoint = func() point {
	var p point
	for i := range p.v {
		p.v[i] = math.NaN()
	}
	return p
}()

// setPoint sets the overview's numbers from a point: the current values,
// and the rejection counts of that step (overviewOf sums them over the
// window).
func (o *ModelOverview) setPoint(p *point) {
	v := func(f field) Value { return Value(p.v[f]) }
	o.P50ms, o.P90ms, o.P99ms = v(fP50), v(fP90), v(fP99)
	o.Attainment, o.Goodput, o.Throughput = v(fAttainment), v(fGoodput), v(fThroughput)
	o.ArrivalRate, o.ForecastRate = v(fArrivalRate), v(fForecastRate)
	o.ComputeShare, o.TargetShare, o.MemoryShare, o.MemoryUsed = v(fComputeShare), v(fTargetShare), v(fMemoryShare), v(fMemoryUsed)
	o.PredictedMs, o.ObservedMs, o.PlannedMs = v(fPredicted), v(fObserved), v(fPlanned)
	o.QueueDepth = v(fQueueDepth)
	o.RejectedDeadline, o.RejectedQueueFull, o.Dropped, o.Failed = v(fRejectedDeadline), v(fRejectedQueueFull), v(fDropped), v(fFailed)
}
