package loadtest

import (
	"cmp"
	"context"
	"sync"
	"time"
)

// Details of the arrivals the generator did not send (Pacer.Drop).
const (
	// generatorDetail: every request it may have in flight was in flight.
	generatorDetail = "generator: too many requests in flight"
	// generatorLateDetail: it came to the arrival too late to send it.
	generatorLateDetail = "generator: behind schedule by more than the timeout"
)

// Pacer sends an open loop's requests at their times and never keeps more
// of them than it may have in flight: when it falls behind (a slow server,
// too little CPU), an arrival it cannot send now is dropped, not queued, so
// its memory is bounded by MaxInFlight requests whatever the schedule.
type Pacer struct {
	// Start is offset 0 of the arrivals.
	Start time.Time
	// MaxInFlight bounds the requests sent and not yet ended; 0: 2048.
	MaxInFlight int
	// MaxLag, when above 0, is how late an arrival may be sent: one the
	// generator comes to later than that after its time is dropped (a
	// request sent later than its timeout after its time cannot be good).
	MaxLag time.Duration
	// Send sends arrival i, due at offset at, and returns when it has
	// ended; it runs on a goroutine of its own.
	Send func(i int, at time.Duration)
	// Drop records arrival i, which was not sent, with why: "generator:
	// too many requests in flight" or "generator: behind schedule by more
	// than the timeout".
	Drop func(i int, at time.Duration, detail string)
}

// Run goes through arrivals (offsets from Start, in order) until they end or
// ctx does, and returns when every request it sent has ended.
func (p *Pacer) Run(ctx context.Context, arrivals []time.Duration) {
	slots := make(chan struct{}, cmp.Or(p.MaxInFlight, 2048))
	var wg sync.WaitGroup
	defer wg.Wait()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for i, at := range arrivals {
		due := p.Start.Add(at)
		if wait := time.Until(due); wait > 0 {
			timer.Reset(wait)
			select {
			case <-ctx.Done():
				return
			case <-timer.C:
			}
		} else if ctx.Err() != nil {
			return
		}
		if p.MaxLag > 0 && time.Since(due) > p.MaxLag {
			p.Drop(i, at, generatorLateDetail)
			continue
		}
		select {
		case slots <- struct{}{}:
		default:
			p.Drop(i, at, generatorDetail)
			continue
		}
		wg.Go(func() {
			defer func() { <-slots }()
			p.Send(i, at)
		})
	}
}
