package qos

import (
	"fmt"
	"strconv"
	"sync/atomic"

	"github.com/sloserve/sloserve/runtime"
)

// Gate bounds the requests in flight, and their input bytes, across every
// scheduler that shares it (Options.Gate): one gate per server, whatever
// the device. A request enters at Submit and leaves with its outcome; one
// that would pass a limit is refused with ErrOverloaded and counted as
// rejected. The zero limits mean none; SetLimits changes them while the
// schedulers run.
type Gate struct {
	maxRequests, maxBytes atomic.Int64 // 0: no limit
	requests, bytes       atomic.Int64 // in flight now
	unread                atomic.Uint64
}

// NewGate returns a gate with the given limits (0: none).
func NewGate(maxRequests int, maxBytes int64) *Gate {
	g := &Gate{}
	g.SetLimits(maxRequests, maxBytes)
	return g
}

// SetLimits changes the limits from the next request on.
func (g *Gate) SetLimits(maxRequests int, maxBytes int64) {
	g.maxRequests.Store(int64(max(maxRequests, 0)))
	g.maxBytes.Store(max(maxBytes, 0))
}

// Limits are the limits in effect (0: none).
func (g *Gate) Limits() (maxRequests int, maxBytes int64) {
	return int(g.maxRequests.Load()), g.maxBytes.Load()
}

// InFlight is the number of requests in flight and their input bytes.
func (g *Gate) InFlight() (requests int, bytes int64) {
	return int(g.requests.Load()), g.bytes.Load()
}

// enter takes a request of size input bytes in, or says why it cannot
// enter. A request over the byte limit still enters when nothing else is in
// flight: one request within the request size limit always gets through.
// A nil gate lets everything in.
func (g *Gate) enter(size int64) (leave func(), err error) {
	if g == nil {
		return func() {}, nil
	}
	if limit := g.maxRequests.Load(); limit > 0 {
		if n := g.requests.Add(1); n > limit {
			g.requests.Add(-1)
			return nil, fmt.Errorf("%w: limit %d", ErrOverloaded, limit)
		}
	} else {
		g.requests.Add(1)
	}
	if limit := g.maxBytes.Load(); limit > 0 {
		if n := g.bytes.Add(size); n > limit && n != size {
			g.bytes.Add(-size)
			g.requests.Add(-1)
			return nil, fmt.Errorf("%w: the requests in flight hold %s of inputs, over limits.max_inflight_bytes (%s)",
				ErrOverloaded, formatBytes(n-size), formatBytes(limit))
		}
	} else {
		g.bytes.Add(size)
	}
	return func() {
		g.requests.Add(-1)
		g.bytes.Add(-size)
	}, nil
}

// full says why a request would be refused now for the number of requests
// in flight, or nil (Preadmit: the size of the request is not known yet).
func (g *Gate) full() error {
	if g == nil {
		return nil
	}
	if limit := g.maxRequests.Load(); limit > 0 && g.requests.Load() >= limit {
		return fmt.Errorf("%w: limit %d", ErrOverloaded, limit)
	}
	return nil
}

// RefuseUnread says why a request whose model is not known yet (a gRPC
// call whose message has not been read) would be refused now for the
// number of requests in flight, and counts the refusal (RefusedUnread), or
// returns nil. A refusal here is no model's: no scheduler counts it.
func (g *Gate) RefuseUnread() error {
	err := g.full()
	if err != nil {
		g.unread.Add(1)
	}
	return err
}

// RefusedUnread is how many requests RefuseUnread refused.
func (g *Gate) RefusedUnread() uint64 {
	if g == nil {
		return 0
	}
	return g.unread.Load()
}

// formatBytes writes a byte count as the config does: in the largest
// binary unit it is a whole multiple of (1GiB), else in bytes.
func formatBytes(n int64) string {
	if n > 0 {
		for _, u := range []struct {
			shift uint
			name  string
		}{{50, "PiB"}, {40, "TiB"}, {30, "GiB"}, {20, "MiB"}, {10, "KiB"}} {
			if n%(1<<u.shift) == 0 {
				return strconv.FormatInt(n>>u.shift, 10) + u.name
			}
		}
	}
	return strconv.FormatInt(n, 10)
}

// inputBytes is the size of a request's input tensors.
func inputBytes(inputs []runtime.Tensor) int64 {
	var n int64
	for _, t := range inputs {
		n += int64(len(t.Data))
	}
	return n
}
