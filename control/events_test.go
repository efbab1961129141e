package control

import (
	"slices"
	"testing"
	"time"
)

// The log keeps events in time order (an event stamped before the newest
// takes its time), drops the oldest past its capacity, and answers the
// suffix at or after a time, the newest limit of it.
func TestEventLog(t *testing.T) {
	l := NewEventLog(3)
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l.Add(Event{Time: t0, Model: "a"})
	l.Add(Event{Time: t0.Add(2 * time.Second), Model: "b"})
	if got := l.Add(Event{Time: t0.Add(time.Second), Model: "c"}); !got.Time.Equal(t0.Add(2 * time.Second)) {
		t.Errorf("an event older than the newest kept its time %v", got.Time)
	}
	l.Add(Event{Time: t0.Add(3 * time.Second), Model: "d"})
	models := func(es []Event) []string {
		var out []string
		for _, e := range es {
			out = append(out, e.Model)
		}
		return out
	}
	if got := models(l.Since(time.Time{}, 0)); !slices.Equal(got, []string{"b", "c", "d"}) {
		t.Errorf("all: %v, want the newest 3 (b c d)", got)
	}
	if got := models(l.Since(t0.Add(2*time.Second), 0)); !slices.Equal(got, []string{"b", "c", "d"}) {
		t.Errorf("since 2s: %v", got)
	}
	if got := models(l.Since(t0.Add(3*time.Second), 0)); !slices.Equal(got, []string{"d"}) {
		t.Errorf("since 3s: %v", got)
	}
	if got := models(l.Since(time.Time{}, 2)); !slices.Equal(got, []string{"c", "d"}) {
		t.Errorf("limit 2: %v", got)
	}
	if e := NewEventLog(0).Add(Event{}); e.Time.IsZero() {
		t.Error("an event without a time was not stamped")
	}
	// What Since returns is a copy.
	got := l.Since(time.Time{}, 0)
	got[0].Model = "changed"
	if l.Since(time.Time{}, 0)[0].Model != "b" {
		t.Error("Since returned the log's own slice")
	}
}
