package qos

import (
	"context"
	"log/slog"
	"math"
	"time"
	"unicode/utf8"
)

// plan is what admission predicted for a request: how long it would wait
// for its batch to begin, that batch's execution, and the room left for
// the predictions' error (0: none was asked for).
type plan struct {
	wait, own, room time.Duration
	// risk is the chance to be late the room's readings give the plan
	// (tail.risk), for a latency-critical request with a known plan
	// (risky); admission refuses behind a backlog where it passes the
	// normal tail at the room's deviations (z: about 2.3% at tailZ), as
	// the room does. Logged so that what admission expected can be set
	// against what came (scripts/late-causes.py).
	risk  float64
	risky bool
	// z is the standard deviations the room left (tail.z), where room
	// was read; atMargin, whether the request was admitted at the margin
	// (tail.atMargin), so that its outcome teaches the room.
	z        float64
	atMargin bool
}

// logFinishLocked writes, at debug level, one line per finished
// latency-critical request that ran or was refused on a prediction: what
// admission predicted against what happened, and the deadline's slack at
// the end (negative: late), so that requests admitted and then late can be
// told apart by cause (a slow execution, a long wait, a probe, an answer
// that left late) from the server's log.
func (s *Scheduler) logFinishLocked(m *model, r *request, e *execution, o outcome, now time.Time) {
	if m.spec.Class != ClassLatencyCritical || r.deadline.IsZero() ||
		!m.log.Enabled(context.Background(), slog.LevelDebug) {
		return // nothing built on the request path below debug
	}
	args := []any{"outcome", o.String(),
		"arrival", r.arrival.UnixMicro(),
		"slack_ms", logMillis(r.deadline.Sub(now)),
		"plan_wait_ms", logMillis(r.plan.wait), "plan_exec_ms", logMillis(r.plan.own), "plan_room_ms", logMillis(r.plan.room)}
	if r.req != nil && r.req.ID != "" {
		args = append(args, "id", logID(r.req.ID))
	}
	if !r.started.IsZero() {
		args = append(args, "wait_ms", logMillis(r.started.Sub(r.arrival)), "ran_ms", logMillis(now.Sub(r.started)))
	}
	if e != nil {
		args = append(args, "batch", e.size, "exec_predicted_ms", logMillis(e.predicted))
	}
	if r.probe {
		args = append(args, "probe", true)
	}
	if r.plan.risky {
		args = append(args, "plan_risk", math.Round(r.plan.risk*1e5)/1e5)
	}
	if r.plan.room > 0 { // z is set with the room
		args = append(args, "plan_room_z", math.Round(r.plan.z*1e3)/1e3, "at_margin", r.plan.atMargin)
	}
	s.logLocked(m.log, "request finished", args...)
}

// maxLoggedID bounds a request id in the debug lines: ids are the
// client's, of any length.
const maxLoggedID = 128

// logID is a request's id for a debug line, cut to maxLoggedID bytes (at a
// character's start) with a mark that it was cut.
func logID(id string) string {
	if len(id) <= maxLoggedID {
		return id
	}
	n := maxLoggedID
	for n > 0 && !utf8.RuneStart(id[n]) {
		n--
	}
	return id[:n] + "..."
}

// logMillis is d in milliseconds, to 0.01 ms, for log lines.
func logMillis(d time.Duration) float64 { return float64(d.Round(10*time.Microsecond)) / 1e6 }
