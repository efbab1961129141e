package loadtest

import (
	"encoding/csv"
	"io"
	"math"
	"slices"
	"strconv"
	"time"
)

// TimelineRow is one model's second of the run.
type TimelineRow struct {
	Second int
	Model  string
	Class  string
	// Arrivals counts the records scheduled in this second.
	Arrivals int
	// The outcomes of the records sent in this second.
	Good, Late, Rejected, Dropped, Failed int
	// Goodput is Good per second of this second that lies in the window:
	// Good itself, except in a last, partial second.
	Goodput float64
	// Latency percentiles (nearest rank) of the answered requests sent in
	// this second; 0 if none.
	P50ms, P99ms float64
	// ComputeShare, TargetShare, ForecastRate, PredictedMs and ObservedMs
	// come from the model's last share sample at or before the end of this
	// second, carried forward from earlier seconds; all -1 before the first
	// sample. A ComputeShare of 0 means unlimited.
	ComputeShare float64
	TargetShare  float64
	ForecastRate float64
	PredictedMs  float64
	ObservedMs   float64
	// Events counts the model's adjuster events (of any kind) in this second.
	Events int
}

// Timeline cuts a run into seconds: a row for every model and every second
// of [0, ceil(Duration)), ordered by second, then by model index. Like
// Summarize, it keeps to the window [0, Duration): records scheduled (for
// Arrivals) or sent (for outcomes) outside it are left out, and so are
// events outside it; share samples before 0 still carry into second 0.
func Timeline(r *Run) []TimelineRow {
	nm := len(r.Models)
	ns := timelineSeconds(r.Duration)
	rows := make([]TimelineRow, ns*nm)
	if len(rows) == 0 {
		return rows
	}
	row := func(at time.Duration, model int) *TimelineRow {
		return &rows[int(at/time.Second)*nm+model]
	}
	for s := range ns {
		for m, info := range r.Models {
			rows[s*nm+m] = TimelineRow{Second: s, Model: info.Name, Class: info.Class}
		}
	}

	latencies := make([][]float64, len(rows))
	for _, rec := range r.Records {
		if rec.Model < 0 || rec.Model >= nm {
			continue
		}
		if summaryInWindow(rec.Scheduled, r.Duration) {
			row(rec.Scheduled, rec.Model).Arrivals++
		}
		if !summaryInWindow(rec.Sent, r.Duration) {
			continue
		}
		tr := row(rec.Sent, rec.Model)
		o := summaryOutcome(rec.Outcome)
		switch o {
		case Good:
			tr.Good++
		case Late:
			tr.Late++
		case Rejected:
			tr.Rejected++
		case Dropped:
			tr.Dropped++
		case Failed:
			tr.Failed++
		}
		if o.Answered() {
			i := int(rec.Sent/time.Second)*nm + rec.Model
			latencies[i] = append(latencies[i], summaryMs(rec.Latency))
		}
	}
	for i := range rows {
		tr := &rows[i]
		tr.Goodput = float64(tr.Good) / timelineSecondLength(tr.Second, r.Duration)
		if lat := latencies[i]; len(lat) > 0 {
			slices.Sort(lat)
			tr.P50ms = summaryPercentile(lat, 500)
			tr.P99ms = summaryPercentile(lat, 990)
		}
	}

	for _, e := range r.Events {
		if e.Model >= 0 && e.Model < nm && summaryInWindow(e.At, r.Duration) {
			row(e.At, e.Model).Events++
		}
	}

	for m, samples := range summarySharesByModel(r) {
		next := 0 // the first sample not yet applied
		var last *ShareSample
		for s := range ns {
			end := min(time.Duration(s+1)*time.Second, r.Duration)
			for next < len(samples) && samples[next].At <= end {
				last = &samples[next]
				next++
			}
			tr := &rows[s*nm+m]
			if last == nil {
				tr.ComputeShare, tr.TargetShare, tr.ForecastRate, tr.PredictedMs, tr.ObservedMs = -1, -1, -1, -1, -1
				continue
			}
			tr.ComputeShare = last.Compute
			tr.TargetShare = last.Target
			tr.ForecastRate = last.ForecastRate
			tr.PredictedMs = last.PredictedMs
			tr.ObservedMs = last.ObservedMs
		}
	}
	return rows
}

// timelineSeconds is the number of seconds, whole or partial, in [0, d).
func timelineSeconds(d time.Duration) int {
	if d <= 0 {
		return 0
	}
	return int((d + time.Second - 1) / time.Second)
}

// timelineSecondLength is how much of second s lies in [0, d), in seconds.
func timelineSecondLength(s int, d time.Duration) float64 {
	start := time.Duration(s) * time.Second
	return (min(start+time.Second, d) - start).Seconds()
}

// timelineColumns are the CSV header of WriteTimelineCSV.
var timelineColumns = []string{
	"second", "model", "class", "arrivals",
	"good", "late", "rejected", "dropped", "failed",
	"goodput", "p50_ms", "p99_ms",
	"compute_share", "target_share", "forecast_rate", "predicted_ms", "observed_ms",
	"events",
}

// WriteTimelineCSV writes rows as CSV with a header line. Floats are rounded
// to three decimals and written without trailing zeros.
func WriteTimelineCSV(w io.Writer, rows []TimelineRow) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(timelineColumns); err != nil {
		return err
	}
	for _, r := range rows {
		rec := []string{
			strconv.Itoa(r.Second), r.Model, r.Class, strconv.Itoa(r.Arrivals),
			strconv.Itoa(r.Good), strconv.Itoa(r.Late), strconv.Itoa(r.Rejected), strconv.Itoa(r.Dropped), strconv.Itoa(r.Failed),
			timelineFloat(r.Goodput), timelineFloat(r.P50ms), timelineFloat(r.P99ms),
			timelineFloat(r.ComputeShare), timelineFloat(r.TargetShare), timelineFloat(r.ForecastRate),
			timelineFloat(r.PredictedMs), timelineFloat(r.ObservedMs),
			strconv.Itoa(r.Events),
		}
		if err := cw.Write(rec); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// timelineFloat formats a float for the CSV: three decimals at most; NaN and
// infinities, which a row should never hold, become empty cells.
func timelineFloat(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return ""
	}
	v = math.Round(v*1000) / 1000
	if v == 0 {
		v = 0 // no "-0"
	}
	return strconv.FormatFloat(v, 'f', -1, 64)
}
