package loadtest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"
)

// summaryTestMs turns milliseconds into a Duration.
func summaryTestMs(ms float64) time.Duration { return time.Duration(ms * float64(time.Millisecond)) }

// summaryTestOutcomes builds an Outcomes map from good, late, rejected,
// dropped and failed counts.
func summaryTestOutcomes(g, l, r, d, f int) map[string]int {
	return map[string]int{"good": g, "late": l, "rejected": r, "dropped": d, "failed": f}
}

// summaryTestClose compares floats to within 1e-9.
func summaryTestClose(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

func TestSummaryPercentile(t *testing.T) {
	hundred := make([]float64, 100)
	for i := range hundred {
		hundred[i] = float64(i + 1)
	}
	thousand := make([]float64, 1000)
	for i := range thousand {
		thousand[i] = float64(i + 1)
	}
	tests := []struct {
		name     string
		sorted   []float64
		perMille int
		want     float64
	}{
		{"empty", nil, 500, 0},
		{"one value p50", []float64{7}, 500, 7},
		{"one value p99.9", []float64{7}, 999, 7},
		{"two values p50 is the lower", []float64{1, 2}, 500, 1},
		{"two values p51 is the upper", []float64{1, 2}, 510, 2},
		{"1..100 p50", hundred, 500, 50},
		{"1..100 p90", hundred, 900, 90},
		{"1..100 p99", hundred, 990, 99},
		{"1..100 p99.9", hundred, 999, 100},
		{"1..1000 p99.9", thousand, 999, 999},
		{"1..1000 p99", thousand, 990, 990},
		{"p100 is the max", hundred, 1000, 100},
		{"p0 is the min", hundred, 0, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := summaryPercentile(tt.sorted, tt.perMille); got != tt.want {
				t.Errorf("summaryPercentile(%d) = %v, want %v", tt.perMille, got, tt.want)
			}
		})
	}
}

func TestSummarizeStats(t *testing.T) {
	lc := ModelInfo{Name: "det", Class: LatencyCritical, SLO: 100 * time.Millisecond, Protocol: "grpc", Load: "constant"}

	// 1..100 ms answered, in a scrambled order; every third good, the rest
	// late (the outcome does not depend on the latency here: the
	// percentiles only look at answered requests).
	var hundred []Record
	for i := range 100 {
		lat := (i*37)%100 + 1
		o := Good
		if i%3 != 0 {
			o = Late
		}
		hundred = append(hundred, Record{Sent: summaryTestMs(float64(i * 10)), Scheduled: summaryTestMs(float64(i * 10)), Latency: summaryTestMs(float64(lat)), Outcome: o})
	}

	tests := []struct {
		name     string
		duration time.Duration
		records  []Record
		want     Stats
	}{
		{
			name:     "no records",
			duration: 10 * time.Second,
			want:     Stats{Outcomes: summaryTestOutcomes(0, 0, 0, 0, 0)},
		},
		{
			name:     "zero window",
			duration: 0,
			records:  []Record{{Sent: 0, Outcome: Good, Latency: time.Millisecond}},
			want:     Stats{Outcomes: summaryTestOutcomes(0, 0, 0, 0, 0)},
		},
		{
			name:     "latencies 1..100 ms",
			duration: 10 * time.Second,
			records:  hundred,
			want: Stats{
				Requests: 100, Outcomes: summaryTestOutcomes(34, 66, 0, 0, 0),
				Goodput: 3.4, Throughput: 10, OfferedRate: 10, Attainment: 0.34,
				P50ms: 50, P90ms: 90, P99ms: 99, P999ms: 100, MeanMs: 50.5, MaxMs: 100,
			},
		},
		{
			name:     "misses count against attainment, not in the percentiles",
			duration: 2 * time.Second,
			records: []Record{
				{Sent: 0, Latency: 20 * time.Millisecond, Outcome: Good},
				{Sent: 100 * time.Millisecond, Latency: 40 * time.Millisecond, Outcome: Good},
				{Sent: 200 * time.Millisecond, Latency: 300 * time.Millisecond, Outcome: Late},
				{Sent: 300 * time.Millisecond, Latency: time.Millisecond, Outcome: Rejected, Detail: "429: queue full"},
				{Sent: 400 * time.Millisecond, Latency: time.Millisecond, Outcome: Rejected, Detail: "429: queue full"},
				{Sent: 500 * time.Millisecond, Latency: 2 * time.Second, Outcome: Dropped, Detail: "504: deadline"},
				{Sent: 600 * time.Millisecond, Latency: 5 * time.Millisecond, Outcome: Failed, Detail: "503: model not ready"},
				{Sent: 700 * time.Millisecond, Latency: 5 * time.Millisecond, Outcome: Failed},
			},
			want: Stats{
				Requests: 8, Outcomes: summaryTestOutcomes(2, 1, 2, 1, 2),
				Goodput: 1, Throughput: 1.5, OfferedRate: 4, Attainment: 0.25,
				P50ms: 40, P90ms: 300, P99ms: 300, P999ms: 300, MeanMs: 120, MaxMs: 300,
				Errors: map[string]int{"429: queue full": 2, "504: deadline": 1, "503: model not ready": 1},
			},
		},
		{
			name:     "records outside the window are ignored",
			duration: time.Second,
			records: []Record{
				{Sent: -time.Millisecond, Latency: time.Millisecond, Outcome: Good},
				{Sent: 0, Latency: 10 * time.Millisecond, Outcome: Good},
				{Sent: 999 * time.Millisecond, Latency: 30 * time.Millisecond, Outcome: Late},
				{Sent: time.Second, Latency: time.Millisecond, Outcome: Failed, Detail: "after"},
				{Sent: 5 * time.Second, Latency: time.Millisecond, Outcome: Good},
			},
			want: Stats{
				Requests: 2, Outcomes: summaryTestOutcomes(1, 1, 0, 0, 0),
				Goodput: 1, Throughput: 2, OfferedRate: 2, Attainment: 0.5,
				P50ms: 10, P90ms: 30, P99ms: 30, P999ms: 30, MeanMs: 20, MaxMs: 30,
			},
		},
		{
			name:     "an outcome out of range counts as failed",
			duration: time.Second,
			records:  []Record{{Sent: 0, Outcome: Outcome(42), Detail: "odd"}},
			want: Stats{
				Requests: 1, Outcomes: summaryTestOutcomes(0, 0, 0, 0, 1), OfferedRate: 1,
				Errors: map[string]int{"odd": 1},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &Run{Duration: tt.duration, Models: []ModelInfo{lc}, Records: tt.records}
			s := Summarize(r)
			if len(s.Models) != 1 {
				t.Fatalf("%d model summaries, want 1", len(s.Models))
			}
			got := s.Models[0].Stats
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("model stats\n got %+v\nwant %+v", got, tt.want)
			}
			if !reflect.DeepEqual(s.Total, tt.want) {
				t.Errorf("total stats\n got %+v\nwant %+v", s.Total, tt.want)
			}
			if _, err := json.Marshal(s); err != nil {
				t.Errorf("json.Marshal: %v", err)
			}
		})
	}
}

func TestSummarizeModelsAndClasses(t *testing.T) {
	r := &Run{
		Scenario: "mix",
		Policy:   "adaptive",
		Started:  time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC),
		Duration: 10 * time.Second,
		Models: []ModelInfo{
			{Name: "bert", Class: BestEffort, SLO: time.Second},
			{Name: "det", Class: LatencyCritical, SLO: 50 * time.Millisecond},
			{Name: "cls", Class: LatencyCritical, SLO: 20 * time.Millisecond},
		},
		Records: []Record{
			{Model: 0, Sent: time.Second, Latency: 500 * time.Millisecond, Outcome: Good},
			{Model: 1, Sent: time.Second, Latency: 10 * time.Millisecond, Outcome: Good},
			{Model: 1, Sent: 2 * time.Second, Latency: 30 * time.Millisecond, Outcome: Good},
			{Model: 2, Sent: 3 * time.Second, Latency: 20 * time.Millisecond, Outcome: Good},
			{Model: 2, Sent: 4 * time.Second, Latency: 40 * time.Millisecond, Outcome: Late},
			{Model: 2, Sent: 5 * time.Second, Outcome: Rejected, Detail: "429"},
			{Model: 7, Sent: 5 * time.Second, Outcome: Good}, // no such model
		},
		Shares: []ShareSample{
			// det: 0.2 for 4 s, unlimited for 2 s, 0.5 for 4 s: mean 0.35.
			{Model: 1, At: 0, Compute: 0.2},
			{Model: 1, At: 6 * time.Second, Compute: 0.5},
			{Model: 1, At: 4 * time.Second, Compute: 0},
			{Model: 1, At: 12 * time.Second, Compute: 0.9}, // after the window
			{Model: 1, At: -time.Second, Compute: 0.01},    // before it
			// cls: 0.2 for 8 s, 0.6 for 2 s: mean 0.28.
			{Model: 2, At: 0, Compute: 0.2},
			{Model: 2, At: 8 * time.Second, Compute: 0.6},
			{Model: 9, At: 0, Compute: 0.7}, // no such model
		},
		Events: []Event{
			{Model: 1, At: time.Second, Kind: "resize"},
			{Model: 1, At: 2 * time.Second, Kind: "resize"},
			{Model: 1, At: 3 * time.Second, Kind: "evict"},
			{Model: 2, At: 10 * time.Second, Kind: "resize"}, // at the end: outside
			{Model: -1, At: time.Second, Kind: "resize"},
		},
	}
	s := Summarize(r)

	if s.Scenario != "mix" || s.Policy != "adaptive" || !s.Started.Equal(r.Started) || s.DurationS != 10 {
		t.Errorf("header = %q %q %v %v", s.Scenario, s.Policy, s.Started, s.DurationS)
	}

	type modelWant struct {
		name         string
		slo          float64
		requests     int
		mean, lo, hi float64
		changes      int
	}
	wantModels := []modelWant{
		{"bert", 1000, 1, 0, 0, 0, 0},
		{"det", 50, 2, 0.35, 0.2, 0.5, 2},
		{"cls", 20, 3, 0.28, 0.2, 0.6, 0},
	}
	if len(s.Models) != len(wantModels) {
		t.Fatalf("%d models, want %d", len(s.Models), len(wantModels))
	}
	for i, w := range wantModels {
		m := s.Models[i]
		if m.Name != w.name || m.SLOms != w.slo || m.Requests != w.requests {
			t.Errorf("model %d = %s slo %v requests %d, want %s %v %d", i, m.Name, m.SLOms, m.Requests, w.name, w.slo, w.requests)
		}
		if !summaryTestClose(m.ShareMean, w.mean) || m.ShareMin != w.lo || m.ShareMax != w.hi {
			t.Errorf("%s share mean/min/max = %v/%v/%v, want %v/%v/%v", m.Name, m.ShareMean, m.ShareMin, m.ShareMax, w.mean, w.lo, w.hi)
		}
		if m.ShareChanges != w.changes {
			t.Errorf("%s share changes = %d, want %d", m.Name, m.ShareChanges, w.changes)
		}
	}

	// Latency-critical first although the best-effort model comes first;
	// the class's percentiles run over det and cls together: 10, 20, 30, 40.
	wantClasses := []ClassSummary{
		{Class: LatencyCritical, Models: 2, Stats: Stats{
			Requests: 5, Outcomes: summaryTestOutcomes(3, 1, 1, 0, 0),
			Goodput: 0.3, Throughput: 0.4, OfferedRate: 0.5, Attainment: 0.6,
			P50ms: 20, P90ms: 40, P99ms: 40, P999ms: 40, MeanMs: 25, MaxMs: 40,
			Errors: map[string]int{"429": 1},
		}},
		{Class: BestEffort, Models: 1, Stats: Stats{
			Requests: 1, Outcomes: summaryTestOutcomes(1, 0, 0, 0, 0),
			Goodput: 0.1, Throughput: 0.1, OfferedRate: 0.1, Attainment: 1,
			P50ms: 500, P90ms: 500, P99ms: 500, P999ms: 500, MeanMs: 500, MaxMs: 500,
		}},
	}
	if !reflect.DeepEqual(s.Classes, wantClasses) {
		t.Errorf("classes\n got %+v\nwant %+v", s.Classes, wantClasses)
	}
	if s.Total.Requests != 6 || s.Total.Outcomes["good"] != 4 {
		t.Errorf("total = %d requests, %d good; want 6 and 4 (the record of an unknown model left out)", s.Total.Requests, s.Total.Outcomes["good"])
	}
}

func TestSummarizeClassOrder(t *testing.T) {
	tests := []struct {
		name    string
		classes []string
		want    []string
	}{
		{"no models", nil, nil},
		{"best-effort only", []string{BestEffort, BestEffort}, []string{BestEffort}},
		{"both", []string{BestEffort, LatencyCritical}, []string{LatencyCritical, BestEffort}},
		{"an unknown class last", []string{"batch", BestEffort, LatencyCritical, "archive"}, []string{LatencyCritical, BestEffort, "archive", "batch"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &Run{Duration: time.Second}
			for i, c := range tt.classes {
				r.Models = append(r.Models, ModelInfo{Name: fmt.Sprint("m", i), Class: c})
			}
			var got []string
			for _, c := range Summarize(r).Classes {
				got = append(got, c.Class)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("classes = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestSummarizeGenerator(t *testing.T) {
	lags := func(ms ...float64) []Record {
		var recs []Record
		for i, l := range ms {
			at := time.Duration(i) * time.Millisecond
			recs = append(recs, Record{Scheduled: at, Sent: at + summaryTestMs(l), Outcome: Rejected})
		}
		return recs
	}
	var zeroTo99 []float64
	for i := range 100 {
		zeroTo99 = append(zeroTo99, float64(99-i))
	}
	tests := []struct {
		name    string
		records []Record
		want    Generator
	}{
		{"no records", nil, Generator{}},
		{"on time", lags(1, 1, 2, 0.5), Generator{LagP50ms: 1, LagP99ms: 2, LagMaxms: 2}},
		{"exactly 10 ms is not late", lags(10, 10, 10), Generator{LagP50ms: 10, LagP99ms: 10, LagMaxms: 10}},
		{"0..99 ms", lags(zeroTo99...), Generator{LagP50ms: 49, LagP99ms: 98, LagMaxms: 99, Late: 89, Behind: true}},
		{"a few late ones do not make it behind", lags(append(make([]float64, 99), 500)...), Generator{LagMaxms: 500, Late: 1}},
		{"who dropped", []Record{
			{Outcome: Dropped, Detail: generatorDetail},
			{Outcome: Dropped, Detail: generatorLateDetail},
			{Outcome: Dropped, Detail: "client timeout"},
			{Outcome: Dropped, Detail: "504: request dropped"},
			{Outcome: Failed, Detail: "transport: EOF"},
		}, Generator{Dropped: 2, ClientTimeouts: 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &Run{Duration: time.Minute, Models: []ModelInfo{{Name: "m"}}, Records: tt.records}
			if got := Summarize(r).Generator; got != tt.want {
				t.Errorf("generator = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestSummarizeErrorsLumped(t *testing.T) {
	tests := []struct {
		name     string
		distinct int
	}{
		{"none", 0},
		{"at the cap: all kept", 20},
		{"over the cap: the rarest lumped", 25},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Detail d%02d occurs 100-i times, so the order by count is
			// the order by name.
			var recs []Record
			want := map[string]int{}
			for i := range tt.distinct {
				d := fmt.Sprintf("d%02d", i)
				for range 100 - i {
					recs = append(recs, Record{Outcome: Failed, Detail: d})
				}
				if tt.distinct <= summaryMaxErrors || i < summaryMaxErrors-1 {
					want[d] = 100 - i
				} else {
					want["other"] += 100 - i
				}
			}
			// Answered records and empty details never count.
			recs = append(recs, Record{Outcome: Good, Detail: "ignored"}, Record{Outcome: Failed})
			if len(want) == 0 {
				want = nil
			}
			got := Summarize(&Run{Duration: time.Second, Models: []ModelInfo{{Name: "m"}}, Records: recs}).Total.Errors
			if !reflect.DeepEqual(got, want) {
				t.Errorf("errors = %v, want %v", got, want)
			}
			if len(got) > summaryMaxErrors {
				t.Errorf("%d error keys, more than %d", len(got), summaryMaxErrors)
			}
		})
	}
	// Spelled out once: of 25 details, d00..d18 are kept and d19..d24
	// (81..76 times) lumped.
	var recs []Record
	for i := range 25 {
		for range 100 - i {
			recs = append(recs, Record{Outcome: Dropped, Detail: fmt.Sprintf("d%02d", i)})
		}
	}
	got := Summarize(&Run{Duration: time.Second, Models: []ModelInfo{{Name: "m"}}, Records: recs}).Total.Errors
	if got["other"] != 81+80+79+78+77+76 || got["d18"] != 82 || len(got) != 20 {
		t.Errorf("errors = %v, want d00..d18 and other = %d", got, 81+80+79+78+77+76)
	}
}

func TestSummaryWriteJSON(t *testing.T) {
	r := &Run{
		Scenario: "json", Policy: "static", Duration: 2 * time.Second,
		Models:  []ModelInfo{{Name: "det", Class: LatencyCritical, SLO: 25 * time.Millisecond, Protocol: "rest", Load: "1 req/s"}},
		Records: []Record{{Sent: 0, Latency: 5 * time.Millisecond, Outcome: Good}},
	}
	var buf bytes.Buffer
	if err := Summarize(r).WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(buf.String(), "\n  \"scenario\": \"json\"") {
		t.Errorf("not indented:\n%s", buf.String())
	}
	var doc struct {
		DurationS float64 `json:"duration_s"`
		Models    []map[string]any
		Total     map[string]any
	}
	if err := json.Unmarshal(buf.Bytes(), &doc); err != nil {
		t.Fatalf("decoding: %v\n%s", err, buf.String())
	}
	if doc.DurationS != 2 || len(doc.Models) != 1 {
		t.Fatalf("decoded %+v", doc)
	}
	m := doc.Models[0]
	for key, want := range map[string]any{
		"name": "det", "class": LatencyCritical, "protocol": "rest", "load": "1 req/s",
		"slo_ms": 25.0, "requests": 1.0, "goodput": 0.5, "p50_ms": 5.0, "p999_ms": 5.0, "share_mean": 0.0, "share_changes": 0.0,
	} {
		if m[key] != want {
			t.Errorf("model %q = %v, want %v", key, m[key], want)
		}
	}
	if _, ok := m["SLO"]; ok {
		t.Error("the model's SLO Duration leaked into the JSON")
	}
	if _, ok := m["errors"]; ok {
		t.Error("empty errors not omitted")
	}
	if outcomes, _ := doc.Total["outcomes"].(map[string]any); len(outcomes) != 5 {
		t.Errorf("total outcomes = %v, want five keys", doc.Total["outcomes"])
	}
}

// compareTestSummary builds a summary with two latency-critical models and
// one best-effort model.
func compareTestSummary(policy string, lc1, lc2, beGoodput, beThroughput float64) *Summary {
	return &Summary{Scenario: "diurnal", Policy: policy, Models: []ModelSummary{
		{ModelInfo: ModelInfo{Name: "a", Class: LatencyCritical}, Stats: Stats{Goodput: lc1, Throughput: lc1}},
		{ModelInfo: ModelInfo{Name: "b", Class: LatencyCritical}, Stats: Stats{Goodput: lc2, Throughput: lc2 + 1}},
		{ModelInfo: ModelInfo{Name: "c", Class: BestEffort}, Stats: Stats{Goodput: beGoodput, Throughput: beThroughput}},
	}}
}

func TestCompare(t *testing.T) {
	static := compareTestSummary("static", 10, 5, 5, 20)       // LC 15, total 20, BE 20
	shared := compareTestSummary("shared", 4, 2, 14, 40)       // LC 6, total 20, BE 40
	adaptive := compareTestSummary("adaptive", 20, 10, 10, 30) // LC 30, total 40, BE 30
	idle := compareTestSummary("idle", 0, 0, 0, 0)

	tests := []struct {
		name string
		runs []*Summary
		want []Ratio
	}{
		{"none", nil, []Ratio{}},
		{"one run", []*Summary{static}, []Ratio{}},
		{
			"adaptive over the others, wherever it is",
			[]*Summary{static, shared, adaptive},
			[]Ratio{
				{Of: "adaptive", Over: "static", LCGoodput: 2, TotalGoodput: 2, BEThroughput: 1.5},
				{Of: "adaptive", Over: "shared", LCGoodput: 5, TotalGoodput: 2, BEThroughput: 0.75},
			},
		},
		{
			"without adaptive, the first over the others",
			[]*Summary{shared, static},
			[]Ratio{{Of: "shared", Over: "static", LCGoodput: 0.4, TotalGoodput: 1, BEThroughput: 2}},
		},
		{
			"zero denominators are undefined, reported as 0",
			[]*Summary{adaptive, idle},
			[]Ratio{{Of: "adaptive", Over: "idle", Undefined: []string{"lc_goodput", "total_goodput", "be_throughput"}}},
		},
		{
			"zero over zero is undefined too; zero over something is 0",
			[]*Summary{idle, static},
			[]Ratio{{Of: "idle", Over: "static"}},
		},
		{
			"0/0",
			[]*Summary{idle, compareTestSummary("idle2", 0, 0, 0, 0)},
			[]Ratio{{Of: "idle", Over: "idle2", Undefined: []string{"lc_goodput", "total_goodput", "be_throughput"}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := Compare(tt.runs)
			if len(tt.runs) > 0 && c.Scenario != "diurnal" {
				t.Errorf("scenario = %q", c.Scenario)
			}
			if len(c.Runs) != len(tt.runs) {
				t.Errorf("%d runs, want %d", len(c.Runs), len(tt.runs))
			}
			if len(c.Ratios) != len(tt.want) {
				t.Fatalf("ratios = %+v, want %+v", c.Ratios, tt.want)
			}
			for i, got := range c.Ratios {
				w := tt.want[i]
				if got.Of != w.Of || got.Over != w.Over ||
					!summaryTestClose(got.LCGoodput, w.LCGoodput) || !summaryTestClose(got.TotalGoodput, w.TotalGoodput) ||
					!summaryTestClose(got.BEThroughput, w.BEThroughput) || !reflect.DeepEqual(got.Undefined, w.Undefined) {
					t.Errorf("ratio %d = %+v, want %+v", i, got, w)
				}
			}
			// NaN or Inf anywhere would make json.Marshal fail.
			b, err := json.Marshal(c)
			if err != nil {
				t.Fatalf("json.Marshal: %v", err)
			}
			if !bytes.Contains(b, []byte(`"ratios":[`)) {
				t.Errorf("ratios not a JSON array: %s", b)
			}
			var buf bytes.Buffer
			if err := c.WriteJSON(&buf); err != nil {
				t.Errorf("WriteJSON: %v", err)
			}
		})
	}
}

func TestCompareRunsFromEmptyRuns(t *testing.T) {
	// Summaries of runs with nothing in them compare without NaN.
	var sums []*Summary
	for _, p := range []string{"static", "shared", "adaptive"} {
		sums = append(sums, Summarize(&Run{Policy: p, Models: []ModelInfo{{Name: "m", Class: LatencyCritical}}}))
	}
	c := Compare(sums)
	if len(c.Ratios) != 2 {
		t.Fatalf("ratios = %+v", c.Ratios)
	}
	if _, err := json.Marshal(c); err != nil {
		t.Fatalf("json.Marshal: %v", err)
	}
	// A sanity check of the test: an Inf does make json.Marshal fail.
	if _, err := json.Marshal(Ratio{LCGoodput: math.Inf(1)}); err == nil {
		t.Error("json.Marshal accepted +Inf")
	}
}
