package control

import (
	"slices"
	"sync"
	"time"
)

// EventLog keeps the newest events of one source (an adjuster, the
// placer, the device-fault recovery) in time order, up to a capacity. It
// is safe for concurrent use. Each source counts and logs its events in
// its own words; the log only keeps them.
type EventLog struct {
	capacity int

	mu     sync.Mutex
	events []Event // oldest first, at most capacity
}

// NewEventLog returns a log that keeps the newest capacity events
// (DefaultEventCapacity when capacity <= 0).
func NewEventLog(capacity int) *EventLog {
	if capacity <= 0 {
		capacity = DefaultEventCapacity
	}
	return &EventLog{capacity: capacity}
}

// Add keeps e and returns it as kept: stamped now when its Time is zero,
// and never before the newest event kept, so that the log stays in time
// order. The oldest event goes when the log is full.
func (l *EventLog) Add(e Event) Event {
	if e.Time.IsZero() {
		e.Time = time.Now()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if n := len(l.events); n > 0 && e.Time.Before(l.events[n-1].Time) {
		e.Time = l.events[n-1].Time
	}
	l.events = append(l.events, e)
	if over := len(l.events) - l.capacity; over > 0 {
		l.events = slices.Delete(l.events, 0, over)
	}
	return e
}

// Since returns the kept events at or after since (zero: all), oldest
// first; with limit > 0, only the newest limit of them.
func (l *EventLog) Since(since time.Time, limit int) []Event {
	l.mu.Lock()
	defer l.mu.Unlock()
	// The events are in time order, so the ones at or after since are a
	// suffix; the search finds its first.
	i, _ := slices.BinarySearchFunc(l.events, since, func(e Event, t time.Time) int { return e.Time.Compare(t) })
	out := l.events[i:]
	if limit > 0 && len(out) > limit {
		out = out[len(out)-limit:]
	}
	return slices.Clone(out)
}
