package loadtest

import (
	"cmp"
	"encoding/json"
	"io"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/sloserve/sloserve/control"
)

// Stats are the numbers of a set of requests over a window.
//
// Every number is finite, so a Stats always encodes to JSON: a rate over an
// empty window is 0, and so is the attainment of no requests.
type Stats struct {
	// Requests counts every record in the window, whatever its outcome.
	Requests int `json:"requests"`
	// Outcomes counts the records by Outcome.String(); all five keys are
	// always present. A record with an outcome out of range counts as
	// failed.
	Outcomes map[string]int `json:"outcomes"`
	// Goodput is good requests per second of the window.
	Goodput float64 `json:"goodput"`
	// Throughput is answered (good and late) requests per second.
	Throughput float64 `json:"throughput"`
	// OfferedRate is requests per second, whatever became of them.
	OfferedRate float64 `json:"offered_rate"`
	// Attainment is good / requests: rejected, dropped and failed requests
	// count as misses. It is 0, not undefined, when there were no requests.
	Attainment float64 `json:"attainment"`
	// Latency percentiles (nearest rank), mean and maximum of the answered
	// requests only: rejections come back fast and would hide the tail. All
	// 0 when nothing was answered.
	P50ms  float64 `json:"p50_ms"`
	P90ms  float64 `json:"p90_ms"`
	P99ms  float64 `json:"p99_ms"`
	P999ms float64 `json:"p999_ms"`
	MeanMs float64 `json:"mean_ms"`
	MaxMs  float64 `json:"max_ms"`
	// Errors counts the Detail of the records that were not answered. At
	// most summaryMaxErrors keys: when there are more distinct details, the
	// most frequent ones are kept and the rest are added up under "other".
	Errors map[string]int `json:"errors,omitempty"`
}

// ModelSummary is one model's numbers over the run.
type ModelSummary struct {
	ModelInfo
	SLOms float64 `json:"slo_ms"`
	Stats
	// The model's compute share over the window, from Run.Shares: the mean
	// weighted by how long each sample held (until the model's next sample
	// or the end of the window), the smallest and the largest. Samples that
	// reported an unlimited share (0) are left out; all three are 0 when the
	// model was never limited or never sampled.
	ShareMean float64 `json:"share_mean"`
	ShareMin  float64 `json:"share_min"`
	ShareMax  float64 `json:"share_max"`
	// ShareChanges counts the model's "resize" events in the window.
	ShareChanges int `json:"share_changes"`
}

// ClassSummary adds up the models of one SLO class; its percentiles are over
// all answered requests of the class.
type ClassSummary struct {
	Class  string `json:"class"`
	Models int    `json:"models"`
	Stats
}

// Generator describes how well the load generator kept to its schedule:
// the lag is Record.Lag, over every record in the window.
type Generator struct {
	LagP50ms float64 `json:"lag_p50_ms"`
	LagP99ms float64 `json:"lag_p99_ms"`
	LagMaxms float64 `json:"lag_max_ms"`
	// Late counts records sent more than generatorLateLag after their
	// schedule.
	Late int `json:"late"`
	// Dropped counts the arrivals the generator never sent (too many in
	// flight, or behind schedule by more than the request's timeout): they
	// are among the dropped requests, and the server never saw them.
	Dropped int `json:"dropped"`
	// ClientTimeouts counts the requests dropped at the client's own
	// timeout: the server saw them and counts them as whatever became of
	// them (often late or dropped). The other dropped requests are the
	// server's (504 / DEADLINE_EXCEEDED).
	ClientTimeouts int `json:"client_timeouts"`
	// CPU says where the generator's own CPU time came from (Run.ClientCPU).
	CPU string `json:"cpu,omitempty"`
	// Behind is set when the p99 lag is over generatorLateLag: the
	// generator, not the server, may have limited the run.
	Behind bool `json:"behind"`
}

// generatorLateLag is the lag past which a request counts as sent late.
const generatorLateLag = 10 * time.Millisecond

// summaryMaxErrors caps the distinct keys of Stats.Errors.
const summaryMaxErrors = 20

// Summary is a run's numbers: per model, per class, in total, and the
// generator's own lag.
type Summary struct {
	Scenario  string         `json:"scenario"`
	Policy    string         `json:"policy"`
	Started   time.Time      `json:"started"`
	DurationS float64        `json:"duration_s"`
	Models    []ModelSummary `json:"models"`
	// Classes holds the classes of the run's models, latency-critical first,
	// then best-effort, then any other class by name.
	Classes   []ClassSummary `json:"classes"`
	Total     Stats          `json:"total"`
	Generator Generator      `json:"generator"`
	// Unfilled names what the server could not report (Run.Unfilled):
	// those fields are zero, not measured.
	Unfilled []string `json:"unfilled,omitempty"`
}

// Summarize computes a run's summary over its window, [0, r.Duration):
// records sent before 0 or at or after Duration are ignored, as are share
// samples and events outside the window and records of a model index the
// run does not have.
func Summarize(r *Run) *Summary {
	s := &Summary{
		Scenario:  r.Scenario,
		Policy:    r.Policy,
		Unfilled:  slices.Clone(r.Unfilled),
		Started:   r.Started,
		DurationS: r.Duration.Seconds(),
		Models:    make([]ModelSummary, len(r.Models)),
		Classes:   []ClassSummary{},
	}

	byModel := make([][]Record, len(r.Models))
	var all []Record
	for _, rec := range r.Records {
		if !summaryInWindow(rec.Sent, r.Duration) || rec.Model < 0 || rec.Model >= len(r.Models) {
			continue
		}
		byModel[rec.Model] = append(byModel[rec.Model], rec)
		all = append(all, rec)
	}

	samples := summarySharesByModel(r)
	changes := make([]int, len(r.Models))
	for _, e := range r.Events {
		if e.Kind == "resize" && e.Model >= 0 && e.Model < len(r.Models) && summaryInWindow(e.At, r.Duration) {
			changes[e.Model]++
		}
	}

	byClass := map[string][]Record{}
	classModels := map[string]int{}
	for i, m := range r.Models {
		ms := ModelSummary{
			ModelInfo:    m,
			SLOms:        summaryMs(m.SLO),
			Stats:        summaryStats(byModel[i], r.Duration),
			ShareChanges: changes[i],
		}
		ms.ShareMean, ms.ShareMin, ms.ShareMax = summaryShare(samples[i], r.Duration)
		s.Models[i] = ms
		byClass[m.Class] = append(byClass[m.Class], byModel[i]...)
		classModels[m.Class]++
	}

	classes := make([]string, 0, len(classModels))
	for c := range classModels {
		classes = append(classes, c)
	}
	slices.SortFunc(classes, func(a, b string) int {
		return cmp.Or(cmp.Compare(summaryClassRank(a), summaryClassRank(b)), cmp.Compare(a, b))
	})
	for _, c := range classes {
		s.Classes = append(s.Classes, ClassSummary{Class: c, Models: classModels[c], Stats: summaryStats(byClass[c], r.Duration)})
	}

	s.Total = summaryStats(all, r.Duration)
	s.Generator = summaryGenerator(all)
	s.Generator.CPU = r.ClientCPU
	return s
}

// WriteJSON writes the summary as indented JSON.
func (s *Summary) WriteJSON(w io.Writer) error {
	return summaryWriteJSON(w, s)
}

func summaryWriteJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// summaryInWindow reports whether an offset falls in [0, d).
func summaryInWindow(at, d time.Duration) bool { return at >= 0 && at < d }

func summaryMs(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// summaryClassRank orders classes: latency-critical, best-effort, the rest.
func summaryClassRank(class string) int {
	switch class {
	case LatencyCritical:
		return 0
	case BestEffort:
		return 1
	}
	return 2
}

// summaryOutcome maps an outcome out of range to Failed.
func summaryOutcome(o Outcome) Outcome {
	if o >= numOutcomes {
		return Failed
	}
	return o
}

// summaryStats computes the Stats of records already filtered to a window
// of length d.
func summaryStats(recs []Record, d time.Duration) Stats {
	st := Stats{Requests: len(recs), Outcomes: make(map[string]int, numOutcomes)}
	for _, o := range Outcomes {
		st.Outcomes[o.String()] = 0
	}
	var lat []float64
	details := map[string]int{}
	for _, rec := range recs {
		o := summaryOutcome(rec.Outcome)
		st.Outcomes[o.String()]++
		if o.Answered() {
			lat = append(lat, summaryMs(rec.Latency))
		} else if rec.Detail != "" {
			details[rec.Detail]++
		}
	}
	good := st.Outcomes[Good.String()]
	if secs := d.Seconds(); secs > 0 {
		st.Goodput = float64(good) / secs
		st.Throughput = float64(len(lat)) / secs
		st.OfferedRate = float64(len(recs)) / secs
	}
	if len(recs) > 0 {
		st.Attainment = float64(good) / float64(len(recs))
	}
	if len(lat) > 0 {
		slices.Sort(lat)
		st.P50ms = summaryPercentile(lat, 500)
		st.P90ms = summaryPercentile(lat, 900)
		st.P99ms = summaryPercentile(lat, 990)
		st.P999ms = summaryPercentile(lat, 999)
		var sum float64
		for _, v := range lat {
			sum += v
		}
		st.MeanMs = sum / float64(len(lat))
		st.MaxMs = lat[len(lat)-1]
	}
	st.Errors = summaryErrors(details)
	return st
}

// summaryPercentile is the nearest-rank percentile of sorted values, the
// percentile given in thousandths (990 for p99): the smallest value with at
// least that fraction of the values at or below it. Integer arithmetic keeps
// the rank exact. 0 for no values.
func summaryPercentile(sorted []float64, perMille int) float64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	rank := (n*perMille + 999) / 1000
	rank = min(max(rank, 1), n)
	return sorted[rank-1]
}

// summaryErrors caps the distinct details at summaryMaxErrors: the most
// frequent (ties by name) are kept, the rest go under "other".
func summaryErrors(details map[string]int) map[string]int {
	if len(details) == 0 {
		return nil
	}
	if len(details) <= summaryMaxErrors {
		return details
	}
	keys := make([]string, 0, len(details))
	for k := range details {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b string) int {
		return cmp.Or(cmp.Compare(details[b], details[a]), cmp.Compare(a, b))
	})
	out := make(map[string]int, summaryMaxErrors)
	for i, k := range keys {
		if i < summaryMaxErrors-1 {
			out[k] += details[k]
		} else {
			out["other"] += details[k]
		}
	}
	return out
}

// summarySharesByModel splits the run's share samples by model, each in
// time order, dropping samples of unknown models.
func summarySharesByModel(r *Run) [][]ShareSample {
	out := make([][]ShareSample, len(r.Models))
	for _, s := range r.Shares {
		if s.Model >= 0 && s.Model < len(r.Models) {
			out[s.Model] = append(out[s.Model], s)
		}
	}
	for _, ss := range out {
		slices.SortStableFunc(ss, func(a, b ShareSample) int { return cmp.Compare(a.At, b.At) })
	}
	return out
}

// summaryShare is the time-weighted mean, minimum and maximum of the limited
// (non-zero) compute shares among one model's samples (in time order) that
// fall in the window [0, d). Each sample holds until the next one or the end
// of the window. When the limited samples hold for no time at all (several
// at one instant), the mean is their plain mean.
func summaryShare(samples []ShareSample, d time.Duration) (mean, lo, hi float64) {
	var in []ShareSample
	for _, s := range samples {
		if summaryInWindow(s.At, d) {
			in = append(in, s)
		}
	}
	var weighted, weight, sum float64
	n := 0
	for i, s := range in {
		if s.Compute <= 0 || math.IsNaN(s.Compute) || math.IsInf(s.Compute, 0) {
			continue
		}
		end := d
		if i+1 < len(in) {
			end = in[i+1].At
		}
		w := (end - s.At).Seconds()
		weighted += w * s.Compute
		weight += w
		sum += s.Compute
		if n == 0 || s.Compute < lo {
			lo = s.Compute
		}
		if n == 0 || s.Compute > hi {
			hi = s.Compute
		}
		n++
	}
	switch {
	case n == 0:
		return 0, 0, 0
	case weight > 0:
		mean = weighted / weight
	default:
		mean = sum / float64(n)
	}
	return mean, lo, hi
}

// summaryGenerator computes the generator's lag over records in the window.
func summaryGenerator(recs []Record) Generator {
	var g Generator
	if len(recs) == 0 {
		return g
	}
	lags := make([]float64, len(recs))
	for i, rec := range recs {
		lags[i] = summaryMs(rec.Lag())
		if rec.Lag() > generatorLateLag {
			g.Late++
		}
		switch {
		case rec.Outcome == Dropped && strings.HasPrefix(rec.Detail, "generator: "):
			g.Dropped++
		case rec.Outcome == Dropped && rec.Detail == "client timeout":
			g.ClientTimeouts++
		}
	}
	slices.Sort(lags)
	g.LagP50ms = summaryPercentile(lags, 500)
	g.LagP99ms = summaryPercentile(lags, 990)
	g.LagMaxms = lags[len(lags)-1]
	g.Behind = g.LagP99ms > summaryMs(generatorLateLag)
	return g
}

// Comparison sets several runs of one scenario (one per policy) side by
// side.
type Comparison struct {
	// Scenario is the first run's; Compare does not check that the others
	// share it.
	Scenario string     `json:"scenario"`
	Runs     []*Summary `json:"runs"` // in the order given
	// Ratios compares every "adaptive" run with every run of another
	// policy; without an "adaptive" run, the first run with every other.
	Ratios []Ratio `json:"ratios"`
}

// Ratio divides one run's headline numbers by another's: Of / Over.
//
// A ratio whose denominator is 0 is undefined (Inf or NaN, neither of which
// JSON can carry): it is reported as 0 and its JSON name is listed in
// Undefined, so that a reader can tell an undefined ratio from a real 0.
type Ratio struct {
	Of   string `json:"of"`   // the numerator's policy
	Over string `json:"over"` // the denominator's policy
	// LCGoodput divides the goodput summed over latency-critical models.
	LCGoodput float64 `json:"lc_goodput"`
	// TotalGoodput divides the goodput summed over all models.
	TotalGoodput float64 `json:"total_goodput"`
	// BEThroughput divides the throughput summed over best-effort models.
	BEThroughput float64 `json:"be_throughput"`
	// Undefined names the ratios above ("lc_goodput", "total_goodput",
	// "be_throughput") whose denominator was 0.
	Undefined []string `json:"undefined,omitempty"`
}

// Compare sets summaries side by side and computes the ratios of their
// headline numbers.
func Compare(runs []*Summary) *Comparison {
	c := &Comparison{Runs: runs, Ratios: []Ratio{}}
	if c.Runs == nil {
		c.Runs = []*Summary{}
	}
	if len(runs) == 0 {
		return c
	}
	c.Scenario = runs[0].Scenario

	var of []*Summary
	for _, s := range runs {
		if s.Policy == control.SharePolicyAdaptive {
			of = append(of, s)
		}
	}
	if len(of) == 0 {
		of = runs[:1]
	}
	for _, a := range of {
		for _, b := range runs {
			if b == a || b.Policy == control.SharePolicyAdaptive && a.Policy == control.SharePolicyAdaptive {
				continue
			}
			c.Ratios = append(c.Ratios, compareRatio(a, b))
		}
	}
	return c
}

// WriteJSON writes the comparison as indented JSON.
func (c *Comparison) WriteJSON(w io.Writer) error {
	return summaryWriteJSON(w, c)
}

// compareHeadline holds the numbers a Ratio divides.
type compareHeadline struct {
	lcGoodput, totalGoodput, beThroughput float64
}

func compareHeadlineOf(s *Summary) compareHeadline {
	var h compareHeadline
	for _, m := range s.Models {
		h.totalGoodput += m.Goodput
		switch m.Class {
		case LatencyCritical:
			h.lcGoodput += m.Goodput
		case BestEffort:
			h.beThroughput += m.Throughput
		}
	}
	return h
}

func compareRatio(a, b *Summary) Ratio {
	ha, hb := compareHeadlineOf(a), compareHeadlineOf(b)
	r := Ratio{Of: a.Policy, Over: b.Policy}
	div := func(name string, x, y float64) float64 {
		q := x / y
		if y == 0 || math.IsNaN(q) || math.IsInf(q, 0) {
			r.Undefined = append(r.Undefined, name)
			return 0
		}
		return q
	}
	r.LCGoodput = div("lc_goodput", ha.lcGoodput, hb.lcGoodput)
	r.TotalGoodput = div("total_goodput", ha.totalGoodput, hb.totalGoodput)
	r.BEThroughput = div("be_throughput", ha.beThroughput, hb.beThroughput)
	return r
}
