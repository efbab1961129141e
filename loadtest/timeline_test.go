package loadtest

import (
	"bytes"
	"encoding/csv"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"
)

// timelineTestRun has two models over 2.5 s: three seconds, the last one
// half in the window.
func timelineTestRun() *Run {
	ms := summaryTestMs
	return &Run{
		Duration: 2500 * time.Millisecond,
		Models: []ModelInfo{
			{Name: "det", Class: LatencyCritical, SLO: 50 * time.Millisecond},
			{Name: "bert", Class: BestEffort, SLO: time.Second},
		},
		Records: []Record{
			// Scheduled in second 0, sent in second 1.
			{Model: 0, Scheduled: ms(900), Sent: ms(1100), Latency: ms(10), Outcome: Good},
			{Model: 0, Scheduled: ms(100), Sent: ms(100), Latency: ms(30), Outcome: Good},
			{Model: 0, Scheduled: ms(200), Sent: ms(200), Latency: ms(70), Outcome: Late},
			{Model: 0, Scheduled: ms(300), Sent: ms(300), Latency: ms(1), Outcome: Rejected},
			{Model: 0, Scheduled: ms(400), Sent: ms(400), Latency: ms(20), Outcome: Good},
			{Model: 0, Scheduled: ms(2100), Sent: ms(2200), Latency: ms(5), Outcome: Good},
			// Scheduled in the window, sent after it: an arrival only.
			{Model: 0, Scheduled: ms(2400), Sent: ms(2600), Latency: ms(5), Outcome: Good},
			// Outside the window altogether.
			{Model: 0, Scheduled: ms(2700), Sent: ms(2700), Outcome: Good},
			{Model: 0, Scheduled: -ms(10), Sent: -ms(5), Outcome: Good},
			{Model: 1, Scheduled: ms(1500), Sent: ms(1500), Latency: ms(2000), Outcome: Dropped},
			{Model: 1, Scheduled: ms(1600), Sent: ms(1600), Outcome: Failed},
			{Model: 5, Scheduled: ms(100), Sent: ms(100), Outcome: Good}, // no such model
		},
		Shares: []ShareSample{
			// A sample at the very end of second 0 belongs to it.
			{Model: 0, At: time.Second, Compute: 0.25, Target: 0.3, ForecastRate: 4, PredictedMs: 12, ObservedMs: 14},
			{Model: 0, At: ms(1500), Compute: 0.4, Target: 0.4, ForecastRate: 5, PredictedMs: 10, ObservedMs: 11},
			{Model: 0, At: ms(2600), Compute: 0.9}, // after the window
			{Model: 1, At: ms(2200), Compute: 0, Target: 0.5},
		},
		Events: []Event{
			{Model: 0, At: ms(1500), Kind: "resize"},
			{Model: 0, At: ms(1600), Kind: "pin"},
			{Model: 1, At: ms(100), Kind: "evict"},
			{Model: -1, At: ms(100), Kind: "resize"},
			{Model: 0, At: ms(2500), Kind: "resize"}, // at the end: outside
		},
	}
}

func TestTimeline(t *testing.T) {
	rows := Timeline(timelineTestRun())
	none := func(r TimelineRow) TimelineRow {
		r.ComputeShare, r.TargetShare, r.ForecastRate, r.PredictedMs, r.ObservedMs = -1, -1, -1, -1, -1
		return r
	}
	want := []TimelineRow{
		{Second: 0, Model: "det", Class: LatencyCritical, Arrivals: 5, Good: 2, Late: 1, Rejected: 1, Goodput: 2, P50ms: 30, P99ms: 70,
			ComputeShare: 0.25, TargetShare: 0.3, ForecastRate: 4, PredictedMs: 12, ObservedMs: 14},
		none(TimelineRow{Second: 0, Model: "bert", Class: BestEffort, Events: 1}),
		{Second: 1, Model: "det", Class: LatencyCritical, Arrivals: 0, Good: 1, Goodput: 1, P50ms: 10, P99ms: 10,
			ComputeShare: 0.4, TargetShare: 0.4, ForecastRate: 5, PredictedMs: 10, ObservedMs: 11, Events: 2},
		none(TimelineRow{Second: 1, Model: "bert", Class: BestEffort, Arrivals: 2, Dropped: 1, Failed: 1}),
		// Half a second in the window: one good request is 2 per second.
		{Second: 2, Model: "det", Class: LatencyCritical, Arrivals: 2, Good: 1, Goodput: 2, P50ms: 5, P99ms: 5,
			ComputeShare: 0.4, TargetShare: 0.4, ForecastRate: 5, PredictedMs: 10, ObservedMs: 11},
		{Second: 2, Model: "bert", Class: BestEffort, ComputeShare: 0, TargetShare: 0.5},
	}
	if len(rows) != len(want) {
		t.Fatalf("%d rows, want %d", len(rows), len(want))
	}
	for i := range want {
		if !reflect.DeepEqual(rows[i], want[i]) {
			t.Errorf("row %d\n got %+v\nwant %+v", i, rows[i], want[i])
		}
	}
}

func TestTimelineShape(t *testing.T) {
	tests := []struct {
		name     string
		duration time.Duration
		models   int
		rows     int
	}{
		{"no duration", 0, 2, 0},
		{"no models", 3 * time.Second, 0, 0},
		{"one second", time.Second, 1, 1},
		{"a nanosecond over", time.Second + 1, 3, 6},
		{"just under", 1999 * time.Millisecond, 2, 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &Run{Duration: tt.duration}
			for range tt.models {
				r.Models = append(r.Models, ModelInfo{Name: "m"})
			}
			rows := Timeline(r)
			if len(rows) != tt.rows {
				t.Fatalf("%d rows, want %d", len(rows), tt.rows)
			}
			for i, row := range rows {
				if row.Second != i/tt.models {
					t.Errorf("row %d is second %d, want %d", i, row.Second, i/tt.models)
				}
				if row.ComputeShare != -1 {
					t.Errorf("row %d compute share %v without samples, want -1", i, row.ComputeShare)
				}
			}
		})
	}
}

func TestWriteTimelineCSV(t *testing.T) {
	rows := Timeline(timelineTestRun())
	rows[0].P99ms = 70.123456 // rounded to 3 decimals
	rows[1].Model = `odd, "name"`
	var buf bytes.Buffer
	if err := WriteTimelineCSV(&buf, rows); err != nil {
		t.Fatal(err)
	}
	recs, err := csv.NewReader(&buf).ReadAll()
	if err != nil {
		t.Fatalf("reading the CSV back: %v", err)
	}
	wantHeader := "second,model,class,arrivals,good,late,rejected,dropped,failed,goodput,p50_ms,p99_ms," +
		"compute_share,target_share,forecast_rate,predicted_ms,observed_ms,events"
	if got := strings.Join(recs[0], ","); got != wantHeader {
		t.Errorf("header\n got %s\nwant %s", got, wantHeader)
	}
	if len(recs) != 1+len(rows) {
		t.Fatalf("%d records, want %d", len(recs), 1+len(rows))
	}
	tests := []struct {
		row  int
		want string
	}{
		{1, "0,det,latency-critical,5,2,1,1,0,0,2,30,70.123,0.25,0.3,4,12,14,0"},
		{2, `0,"odd, ""name""",best-effort,0,0,0,0,0,0,0,0,0,-1,-1,-1,-1,-1,1`},
		{5, "2,det,latency-critical,2,1,0,0,0,0,2,5,5,0.4,0.4,5,10,11,0"},
	}
	for _, tt := range tests {
		want, err := csv.NewReader(strings.NewReader(tt.want)).Read()
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(recs[tt.row], want) {
			t.Errorf("record %d\n got %q\nwant %q", tt.row, recs[tt.row], want)
		}
	}
}

func TestTimelineFloat(t *testing.T) {
	tests := []struct {
		in   float64
		want string
	}{
		{0, "0"},
		{-1, "-1"},
		{0.1 + 0.2, "0.3"},
		{1234567.891, "1234567.891"},
		{2.0006, "2.001"},
		{-0.0001, "0"},
		{math.NaN(), ""},
	}
	for _, tt := range tests {
		if got := timelineFloat(tt.in); got != tt.want {
			t.Errorf("timelineFloat(%v) = %q, want %q", tt.in, got, tt.want)
		}
	}
}
