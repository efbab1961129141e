package dashboard

import (
	"encoding/json"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/sloserve/sloserve/qos"
)

var t0 = time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC)

// traffic drives one model's cumulative stats a second at a time.
type traffic struct {
	st qos.Stats
}

// second adds one second of requests: good ones answered in goodLat, late
// ones in lateLat, and rejections.
func (tr *traffic) second(good, late int, goodLat, lateLat time.Duration, rejected, queueFull, dropped int) {
	tr.st.Arrived += uint64(good + late + rejected + dropped)
	tr.st.Good += uint64(good)
	tr.st.Late += uint64(late)
	tr.st.Rejected += uint64(rejected)
	tr.st.QueueFull += uint64(queueFull)
	tr.st.Dropped += uint64(dropped)
	for range good {
		tr.st.Latency.Observe(goodLat)
	}
	for range late {
		tr.st.Latency.Observe(lateLat)
	}
}

func sample(key string, st qos.Stats) ModelSample {
	name, version := splitKey(key)
	return ModelSample{Key: key, Name: name, Version: version, Device: "cpu", Stats: st,
		ComputeShare: 0.4, TargetShare: 0.4, ShareSource: "adaptive", ForecastRate: 10,
		Predicted: 20 * time.Millisecond, Observed: 21 * time.Millisecond}
}

func newTestRecorder() *Recorder {
	return New(Options{Resolution: time.Second, Retention: time.Minute, Window: 5 * time.Second})
}

func TestRecorderRatesAndQuantiles(t *testing.T) {
	r := newTestRecorder()
	tr := &traffic{st: qos.Stats{Model: "a/1", Class: qos.ClassLatencyCritical, SLO: 100 * time.Millisecond}}
	// 20 s of 9 good in 10ms and 1 late in 300ms per second.
	for i := range 20 {
		if i > 0 {
			tr.second(9, 1, 10*time.Millisecond, 300*time.Millisecond, 0, 0, 0)
		}
		r.Record(Snapshot{Time: t0.Add(time.Duration(i) * time.Second), Models: []ModelSample{sample("a/1", tr.st)}})
	}
	ov := r.Overview()
	if len(ov.Models) != 1 {
		t.Fatalf("overview models = %+v", ov.Models)
	}
	m := ov.Models[0]
	near := func(what string, got Value, want float64) {
		t.Helper()
		if !got.Known() || math.Abs(float64(got)-want) > 1e-9*max(1, want) {
			t.Errorf("%s = %v, want %v", what, float64(got), want)
		}
	}
	near("goodput", m.Goodput, 9)
	near("throughput", m.Throughput, 10)
	near("arrival rate", m.ArrivalRate, 10)
	near("attainment", m.Attainment, 0.9)
	// p50 is a 10ms request, p99 (the 50th of 50 in the window) a 300ms one;
	// bucket bounds err high by at most 5%.
	within := func(what string, got Value, want float64) {
		t.Helper()
		if float64(got) < want || float64(got) > want*1.05 {
			t.Errorf("%s = %v, want %v (+5%%)", what, float64(got), want)
		}
	}
	within("p50", m.P50ms, 10)
	within("p90", m.P90ms, 10) // 45 of 50 are 10ms
	within("p99", m.P99ms, 300)
	if m.Status != StatusMissing || !strings.Contains(m.Why, "attainment 90.0% is below the 99.0% target") ||
		!strings.Contains(m.Why, "over the 100 ms SLO") {
		t.Errorf("status %q, why %q", m.Status, m.Why)
	}
	if m.Totals.Good != 171 || m.Totals.Late != 19 {
		t.Errorf("totals = %+v", *m.Totals)
	}

	h, err := r.History("a", "", time.Time{}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if len(h.Series.T) != 20 || h.Key != "a/1" {
		t.Fatalf("history: key %q, %d points", h.Key, len(h.Series.T))
	}
	if g := h.Series.Column("goodput"); g[0].Known() || float64(g[1]) != 9 || float64(g[19]) != 9 {
		t.Errorf("goodput column starts %v %v, ends %v: want unknown, then 9 (the window holds what there is)", g[0], g[1], g[19])
	}
	// Incremental: only the points after since.
	h, _ = r.History("a", "", t0.Add(17*time.Second), time.Hour)
	if len(h.Series.T) != 2 || h.Series.T[0] != float64(t0.Add(18*time.Second).Unix()) {
		t.Errorf("since 17s: t = %v", h.Series.T)
	}
	// last bounds the span.
	h, _ = r.History("a", "", time.Time{}, 5*time.Second)
	if len(h.Series.T) != 5 {
		t.Errorf("last 5s: %d points", len(h.Series.T))
	}
	if _, err := r.History("nope", "", time.Time{}, time.Hour); err == nil {
		t.Error("history of an unknown model: no error")
	}
}

// The ring keeps the retention's worth of points, and a model whose
// counters restart (removed and added again) starts its window afresh
// instead of showing negative rates.
func TestRecorderRetentionAndRestart(t *testing.T) {
	r := newTestRecorder()
	tr := &traffic{st: qos.Stats{Model: "a/1", Class: qos.ClassBestEffort, SLO: time.Second}}
	for i := range 90 {
		tr.second(5, 0, time.Millisecond, 0, 0, 0, 0)
		r.Record(Snapshot{Time: t0.Add(time.Duration(i) * time.Second), Models: []ModelSample{sample("a/1", tr.st)}})
	}
	h, _ := r.History("a", "1", time.Time{}, time.Hour)
	if len(h.Series.T) != 60 || h.Series.T[0] != float64(t0.Add(30*time.Second).Unix()) {
		t.Fatalf("retention 1m at 1s: %d points from %v", len(h.Series.T), h.Series.T[0])
	}
	restarted := &traffic{st: qos.Stats{Model: "a/1", Class: qos.ClassBestEffort, SLO: time.Second}}
	restarted.second(2, 0, time.Millisecond, 0, 0, 0, 0)
	r.Record(Snapshot{Time: t0.Add(90 * time.Second), Models: []ModelSample{sample("a/1", restarted.st)}})
	restarted.second(2, 0, time.Millisecond, 0, 0, 0, 0)
	r.Record(Snapshot{Time: t0.Add(91 * time.Second), Models: []ModelSample{sample("a/1", restarted.st)}})
	m := r.Overview().Models[0]
	if float64(m.Goodput) != 2 || m.Status != StatusOK {
		t.Errorf("after a restart: goodput %v, status %q", float64(m.Goodput), m.Status)
	}
	// Gone from the snapshots: listed as not serving from the index, and
	// forgotten once absent for the retention.
	r.Record(Snapshot{Time: t0.Add(92 * time.Second), States: []ModelState{{Name: "a", Version: "1", State: "UNAVAILABLE", Reason: "unloaded"}}})
	ov := r.Overview()
	if len(ov.Models) != 1 || ov.Models[0].Status != StatusUnavailable || ov.Models[0].Why != "not serving: unloaded" {
		t.Errorf("unloaded model: %+v", ov.Models)
	}
	if _, err := r.History("a", "", time.Time{}, time.Hour); err != nil {
		t.Errorf("history right after the unload: %v", err)
	}
	r.Record(Snapshot{Time: t0.Add(200 * time.Second)})
	if _, err := r.History("a", "", time.Time{}, time.Hour); err == nil {
		t.Error("history kept past the retention")
	}
}

func TestOverviewOrderAndJSON(t *testing.T) {
	r := newTestRecorder()
	good := &traffic{st: qos.Stats{Class: qos.ClassLatencyCritical, SLO: 50 * time.Millisecond}}
	bad := &traffic{st: qos.Stats{Class: qos.ClassLatencyCritical, SLO: 50 * time.Millisecond}}
	idle := qos.Stats{Class: qos.ClassBestEffort, SLO: 50 * time.Millisecond}
	for i := range 3 {
		good.second(10, 0, 5*time.Millisecond, 0, 0, 0, 0)
		bad.second(5, 0, 5*time.Millisecond, 0, 4, 1, 1)
		r.Record(Snapshot{Time: t0.Add(time.Duration(i) * time.Second),
			Models: []ModelSample{sample("good/1", good.st), sample("zbad/2", bad.st), sample("idle/1", idle)},
			States: []ModelState{{Name: "broken", Version: "1", State: "UNAVAILABLE", Reason: "model.onnx: truncated"}}})
	}
	ov := r.Overview()
	var order []string
	for _, m := range ov.Models {
		order = append(order, m.Name+":"+m.Status)
	}
	if got := strings.Join(order, " "); got != "zbad:missing broken:unavailable good:ok idle:idle" {
		t.Errorf("order = %s", got)
	}
	bm := ov.Models[0]
	if float64(bm.RejectedDeadline) != 6 || float64(bm.RejectedQueueFull) != 2 || float64(bm.Dropped) != 2 {
		t.Errorf("rejections over the window: deadline %v, queue full %v, dropped %v",
			float64(bm.RejectedDeadline), float64(bm.RejectedQueueFull), float64(bm.Dropped))
	}
	if !strings.Contains(bm.Why, "6 rejected at admission (deadline unreachable), 2 rejected (queue full), 2 dropped in the queue in the last 5s") {
		t.Errorf("why = %q", bm.Why)
	}
	b, err := json.Marshal(ov)
	if err != nil {
		t.Fatal(err)
	}
	var back struct {
		Models []map[string]any `json:"models"`
	}
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if back.Models[1]["p99_ms"] != nil || back.Models[1]["reason"] != "model.onnx: truncated" || back.Models[3]["attainment"] != nil {
		t.Errorf("unknown values must be null: %s", b)
	}
	h, _ := r.History("good", "", time.Time{}, time.Hour)
	hb, _ := json.Marshal(h)
	var cols map[string]any
	if err := json.Unmarshal(hb, &cols); err != nil {
		t.Fatal(err)
	}
	series := cols["series"].(map[string]any)
	if len(series) != len(ColumnNames())+1 {
		t.Errorf("series columns = %d, want %d", len(series), len(ColumnNames())+1)
	}
	for name, col := range series {
		if n := len(col.([]any)); n != 3 {
			t.Errorf("column %s has %d values, want 3", name, n)
		}
	}
}

func TestDiagnose(t *testing.T) {
	base := func() (ModelOverview, ModelSample) {
		return ModelOverview{
				SLOms: 100, P50ms: 20, P99ms: 80, Attainment: 1, ArrivalRate: 10, ForecastRate: 10,
				ComputeShare: 0.4, TargetShare: 0.4, PredictedMs: 20, ObservedMs: 20, PlannedMs: 60,
			},
			ModelSample{ShareSource: "adaptive", Interference: 1}
	}
	cases := []struct {
		name   string
		edit   func(o *ModelOverview, m *ModelSample)
		status string
		why    []string
	}{
		{"ok", func(o *ModelOverview, m *ModelSample) {}, StatusOK, nil},
		{"no slo", func(o *ModelOverview, m *ModelSample) { o.SLOms = Null }, StatusNoSLO, nil},
		{"idle", func(o *ModelOverview, m *ModelSample) { o.Attainment, o.P99ms = Null, Null }, StatusIdle, nil},
		{"share held back", func(o *ModelOverview, m *ModelSample) { o.P99ms, o.TargetShare = 140, 0.7 },
			StatusMissing, []string{"p99 140 ms is over the 100 ms SLO", "compute share 0.40 is below the 0.70 the adjuster wants"}},
		{"pinned", func(o *ModelOverview, m *ModelSample) { o.Attainment, m.Pinned = 0.5, true },
			StatusMissing, []string{"attainment 50.0% is below the 99.0% target", "pinned at 0.40"}},
		{"static", func(o *ModelOverview, m *ModelSample) { o.Attainment, m.ShareSource = 0.9, "static" },
			StatusMissing, []string{"the static policy holds its compute share at 0.40"}},
		{"shared", func(o *ModelOverview, m *ModelSample) { o.Attainment, o.ComputeShare, m.ShareSource = 0.9, 0, "shared" },
			StatusMissing, []string{"no compute limit: it contends"}},
		{"slow", func(o *ModelOverview, m *ModelSample) { o.P99ms, o.ObservedMs, m.Interference = 120, 40, 1.6 },
			StatusMissing, []string{"runs slower than predicted (40.0 ms observed vs 20.0 ms predicted, interference x1.60)"}},
		{"above forecast", func(o *ModelOverview, m *ModelSample) { o.P99ms, o.ArrivalRate = 120, 20 },
			StatusMissing, []string{"load 20 req/s is above the 10 req/s forecast"}},
		{"queueing", func(o *ModelOverview, m *ModelSample) { o.P99ms, o.P50ms, o.QueueDepth = 120, 70, 4 },
			StatusMissing, []string{"requests wait: p50 70.0 ms against 20.0 ms of execution, 4 queued"}},
		{"all refused", func(o *ModelOverview, m *ModelSample) { o.Attainment, o.P99ms, o.RejectedDeadline = Null, Null, 3 },
			StatusMissing, []string{"attainment 0.0% is below", "3 rejected at admission"}},
		{"unreachable", func(o *ModelOverview, m *ModelSample) { o.P99ms, o.PlannedMs = 120, 130 },
			StatusMissing, []string{"even its largest share is predicted to take 130 ms"}},
	}
	for _, c := range cases {
		o, m := base()
		c.edit(&o, &m)
		status, why := diagnose(&o, &m, 0.99, 10*time.Second)
		if status != c.status {
			t.Errorf("%s: status %q, want %q (why %q)", c.name, status, c.status, why)
		}
		for _, w := range c.why {
			if !strings.Contains(why, w) {
				t.Errorf("%s: why %q lacks %q", c.name, why, w)
			}
		}
		if c.why == nil && why != "" {
			t.Errorf("%s: why %q, want none", c.name, why)
		}
	}
}

func TestValueJSON(t *testing.T) {
	for _, c := range []struct {
		v    Value
		want string
	}{
		{Null, "null"}, {Value(math.Inf(1)), "null"}, {0, "0"}, {536870912, "536870912"},
		{0.123456789, "0.123457"}, {136.77812, "136.778"}, {-2.5, "-2.5"},
	} {
		b, err := json.Marshal(c.v)
		if err != nil || string(b) != c.want {
			t.Errorf("%v: %s %v, want %s", float64(c.v), b, err, c.want)
		}
	}
	var v Value
	if err := json.Unmarshal([]byte("null"), &v); err != nil || v.Known() {
		t.Errorf("null reads as %v, %v", float64(v), err)
	}
}

func TestRing(t *testing.T) {
	r := newRing[int](3)
	if r.last() != nil {
		t.Error("empty ring has a last value")
	}
	for i := range 5 {
		r.push(i)
	}
	if r.len() != 3 || *r.at(0) != 2 || *r.at(2) != 4 || *r.last() != 4 {
		t.Errorf("ring holds %d: %d..%d", r.len(), *r.at(0), *r.at(2))
	}
	r.reset()
	if r.len() != 0 {
		t.Error("reset ring not empty")
	}
}

// Samples come a little late or early; the window's rejections and its
// attainment still cover the same requests.
func TestRecorderJitterKeepsWindowsAligned(t *testing.T) {
	r := newTestRecorder() // 5s window
	tr := &traffic{st: qos.Stats{Class: qos.ClassLatencyCritical, SLO: 50 * time.Millisecond}}
	jitter := []time.Duration{0, 300, -200, 400, 100, -300, 250, 0, 350, -100}
	for i, j := range jitter {
		if i < 4 {
			tr.second(0, 0, 0, 0, 2, 0, 0) // two rejections a second, then nothing
		}
		r.Record(Snapshot{Time: t0.Add(time.Duration(i)*time.Second + j*time.Millisecond), Models: []ModelSample{sample("a/1", tr.st)}})
		m := r.Overview().Models[0]
		refused := float64(m.RejectedDeadline)
		switch {
		case refused > 0 && !m.Attainment.Known():
			t.Errorf("step %d: %v rejections in the window but no attainment", i, refused)
		case refused == 0 && m.Attainment.Known():
			t.Errorf("step %d: attainment %v but no rejections in the window", i, float64(m.Attainment))
		case refused > 0 && m.Status != StatusMissing:
			t.Errorf("step %d: status %q with %v rejections", i, m.Status, refused)
		}
	}
}
