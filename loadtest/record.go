// Package loadtest is sloserve's load generator and benchmark report: open-
// and closed-loop arrivals driven by rate schedules or replayed traces, sent
// to several models at once over REST JSON, REST binary or gRPC; every
// request recorded; a JSON summary, a per-second timeline and an HTML report;
// and a comparison of the server's share policies on one scenario.
//
// The data flows one way: a Scenario (scenario.go) and its schedules
// (schedule.go, arrival.go, trace.go) give each model's send times; the
// runner (run.go) sends them through a Client (client.go) and keeps a Record
// per request and the server's shares over time in a Run; summary.go,
// timeline.go and html.go turn Runs into reports.
//
// It talks to the server only over its public protocols, as any client
// would: it reuses api's JSON types for /v2/control and the generated gRPC
// client of api/inference, and must not import models, qos, runtime or
// server. The server must not import it; only cmd/sloserve does.
package loadtest

import (
	"cmp"
	"encoding/csv"
	"fmt"
	"io"
	"slices"
	"strconv"
	"time"
)

// Outcome is how one request ended, as the client saw it.
type Outcome uint8

const (
	// Good: answered successfully within the model's SLO.
	Good Outcome = iota
	// Late: answered successfully, after the SLO.
	Late
	// Rejected: refused by admission (HTTP 429, gRPC RESOURCE_EXHAUSTED).
	Rejected
	// Dropped: never answered in time: dropped from the server's queue at
	// its deadline (HTTP 504, gRPC DEADLINE_EXCEEDED), timed out in the
	// client, or not sent by the generator (Pacer): it had too many
	// requests in flight, or came to the arrival more than the request's
	// timeout after its time. The server never saw those.
	Dropped
	// Failed: any other error (5xx, transport errors, 4xx other than 429).
	Failed
	numOutcomes
)

// Outcomes lists every outcome, in order.
var Outcomes = [numOutcomes]Outcome{Good, Late, Rejected, Dropped, Failed}

func (o Outcome) String() string {
	switch o {
	case Good:
		return "good"
	case Late:
		return "late"
	case Rejected:
		return "rejected"
	case Dropped:
		return "dropped"
	case Failed:
		return "failed"
	}
	return fmt.Sprintf("outcome(%d)", uint8(o))
}

// Answered reports whether the server returned a successful response.
func (o Outcome) Answered() bool { return o == Good || o == Late }

// Record is one request. Offsets are from the start of the run.
type Record struct {
	Model     int           // index into Run.Models
	Scheduled time.Duration // when the arrival process wanted it sent
	Sent      time.Duration // when the client started sending it
	Latency   time.Duration // from Sent to the end of the response (or the error)
	Outcome   Outcome
	// Detail names a failure for the report: an HTTP status or gRPC code and
	// the first words of the error ("503: model not ready"). Empty when
	// answered.
	Detail string
	// ID is the request's id as sent (Client.InferID): how many requests
	// to its model had been sent with it, from 1, warmup included, over
	// every entry of the scenario that drives the model; 0 for an arrival
	// the generator dropped unsent.
	ID int64
}

// Lag is how late the generator sent a request.
func (r Record) Lag() time.Duration { return r.Sent - r.Scheduled }

// Class names of the server's SLO classes.
const (
	LatencyCritical = "latency-critical"
	BestEffort      = "best-effort"
)

// ModelInfo is one model as a run drove it.
type ModelInfo struct {
	Name     string        `json:"name"`
	Class    string        `json:"class"` // latency-critical or best-effort
	SLO      time.Duration `json:"-"`
	Protocol string        `json:"protocol"` // rest, rest-binary or grpc
	// Load describes the arrivals for people: "diurnal 1-12 req/s, peak at
	// 0.25 of 2m0s, gamma cv 1.5" or "closed loop, 4 clients".
	Load string `json:"load"`
}

// ShareSample is a model's share as the server reported it (GET
// /v2/control) at one moment of the run.
type ShareSample struct {
	At           time.Duration // offset from the start of the run
	Model        int           // index into Run.Models
	Compute      float64       // the model's compute share; 0: unlimited
	Target       float64       // the adjuster's target compute share
	ForecastRate float64       // the predictor's forecast, requests/s
	PredictedMs  float64       // predicted execution latency, ms
	ObservedMs   float64       // observed execution latency, ms
}

// Event is one of the server's adjuster decisions during the run.
type Event struct {
	At     time.Duration // offset from the start of the run
	Model  int           // index into Run.Models; -1 for a model not driven
	Kind   string        // resize, evict, pin, unpin, error
	Old    float64       // compute share before
	New    float64       // compute share after
	Reason string
}

// Run is everything one run of a scenario against one server produced.
type Run struct {
	Scenario string    // the scenario's name
	Policy   string    // the server's share policy (GET /v2/control); "" if unknown
	Started  time.Time // wall clock at offset 0
	// Duration is the measured window: records are sent in [0, Duration).
	Duration time.Duration
	Models   []ModelInfo
	Records  []Record // in no particular order
	Shares   []ShareSample
	Events   []Event
	// Unfilled names the parts of the report the server could not fill
	// (UnfilledWithoutControl against a server that is not sloserve); nil:
	// all filled.
	Unfilled []string
	// ClientCPU says where the load generator's CPU time came from when
	// it started the server (joinPeerCgroup); "" against a server it did
	// not start.
	ClientCPU string
}

// WriteRecordsCSV writes every record of a run, one row per request, in
// send order: model, scheduled_ms, sent_ms, latency_ms, outcome, detail,
// id (the request's id, empty for one never sent: sloserve's debug line
// for a request names it by its id, scripts/late-causes.py).
func WriteRecordsCSV(w io.Writer, r *Run) error {
	recs := slices.Clone(r.Records)
	slices.SortStableFunc(recs, func(a, b Record) int { return cmp.Compare(a.Sent, b.Sent) })
	cw := csv.NewWriter(w)
	cw.Write([]string{"model", "scheduled_ms", "sent_ms", "latency_ms", "outcome", "detail", "id"})
	ms := func(d time.Duration) string {
		return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', 3, 64)
	}
	for _, rec := range recs {
		name := ""
		if rec.Model >= 0 && rec.Model < len(r.Models) {
			name = r.Models[rec.Model].Name
		}
		id := ""
		if rec.ID > 0 {
			id = strconv.FormatInt(rec.ID, 10)
		}
		cw.Write([]string{name, ms(rec.Scheduled), ms(rec.Sent), ms(rec.Latency), rec.Outcome.String(), rec.Detail, id})
	}
	cw.Flush()
	return cw.Error()
}
