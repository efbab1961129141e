package dashboard

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"
	"time"
)

// field is one value of a point; the JSON names are the series' names in
// the history API.
type field int

const (
	fP50 field = iota
	fP90
	fP99
	fAttainment
	fGoodput
	fThroughput
	fArrivalRate
	fForecastRate
	fComputeShare
	fTargetShare
	fMemoryShare
	fMemoryUsed
	fPredicted
	fObserved
	fPlanned
	fQueueDepth
	fRejectedDeadline
	fRejectedQueueFull
	fDropped
	fFailed
	numFields
)

var fieldNames = [numFields]string{
	"p50_ms", "p90_ms", "p99_ms", "attainment", "goodput", "throughput",
	"arrival_rate", "forecast_rate", "compute_share", "target_compute_share",
	"memory_share_bytes", "memory_used_bytes", "predicted_ms", "observed_ms", "planned_ms",
	"queue_depth", "rejected_deadline", "rejected_queue_full", "dropped", "failed",
}

// point is one model's values at one sampling instant; NaN is unknown.
type point struct {
	t time.Time
	v [numFields]float64
}

// Value is a number that is null in JSON when unknown (NaN).
type Value float64

// Null is the unknown Value.
var Null = Value(math.NaN())

// Known reports whether v holds a number.
func (v Value) Known() bool { return !math.IsNaN(float64(v)) && !math.IsInf(float64(v), 0) }

// MarshalJSON writes null for an unknown value.
func (v Value) MarshalJSON() ([]byte, error) { return v.appendJSON(nil), nil }

// appendJSON appends v as JSON: null when unknown, whole numbers exact,
// fractions to six significant digits.
func (v Value) appendJSON(b []byte) []byte {
	if !v.Known() {
		return append(b, "null"...)
	}
	x := float64(v)
	if x == math.Trunc(x) && math.Abs(x) < 1e21 {
		return strconv.AppendFloat(b, x, 'f', -1, 64)
	}
	return strconv.AppendFloat(b, round(x), 'g', -1, 64)
}

// UnmarshalJSON reads null as unknown.
func (v *Value) UnmarshalJSON(b []byte) error {
	if bytes.Equal(b, []byte("null")) {
		*v = Null
		return nil
	}
	var f float64
	if err := json.Unmarshal(b, &f); err != nil {
		return err
	}
	*v = Value(f)
	return nil
}

// round keeps six significant digits of fractions: enough for a chart,
// and the history stays small on the wire. Whole numbers (bytes, counts)
// stay exact.
func round(x float64) float64 {
	if x == math.Trunc(x) {
		return x
	}
	f, _ := strconv.ParseFloat(strconv.FormatFloat(x, 'g', 6, 64), 64)
	return f
}
