package api

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
)

// errMemory marks a request refused because the memory its wire form would
// take (a body or message being read, its decoded form, its encoded
// response) does not fit in the server's memory budget (limits.max_memory).
var errMemory = errors.New("server memory limit reached")

// errMemoryHealth refuses a health call while too many others are read.
var errMemoryHealth = fmt.Errorf("%w: too many health calls are being read at once", errMemory)

// MemoryBudget is the one ceiling on the memory clients' traffic holds at
// once, REST and gRPC alike: bodies and messages being read, the structures
// decoding builds from them, responses being encoded and written. Whoever
// would allocate for a client reserves the bytes first and is refused
// (errMemory: 429, RESOURCE_EXHAUSTED) when they do not fit; nothing waits
// for memory. A nil budget has no limit.
//
// It lives in api, not in qos.Gate: what it counts is the wire's own
// memory, most of it before the model is known (an unread body, a gRPC
// message still arriving) or after the outcome is counted (a response
// being written), where the scheduler has no say.
type MemoryBudget struct {
	limit   int64
	used    atomic.Int64
	peak    atomic.Int64
	refused atomic.Uint64
}

// NewMemoryBudget returns a budget of limit bytes (<= 0: no limit).
func NewMemoryBudget(limit int64) *MemoryBudget {
	return &MemoryBudget{limit: max(limit, 0)}
}

// Limit is the budget's size in bytes (0: no limit).
func (b *MemoryBudget) Limit() int64 {
	if b == nil {
		return 0
	}
	return b.limit
}

// Used is the bytes reserved now.
func (b *MemoryBudget) Used() int64 {
	if b == nil {
		return 0
	}
	return b.used.Load()
}

// Peak is the most bytes reserved at once so far.
func (b *MemoryBudget) Peak() int64 {
	if b == nil {
		return 0
	}
	return b.peak.Load()
}

// Refused is how many reservations did not fit.
func (b *MemoryBudget) Refused() uint64 {
	if b == nil {
		return 0
	}
	return b.refused.Load()
}

// refuse counts a refusal decided outside the budget's own arithmetic (a
// connection's share of it), so sloserve_memory_refused_total counts every
// request refused for memory.
func (b *MemoryBudget) refuse() {
	if b != nil {
		b.refused.Add(1)
	}
}

// take adds n bytes when they fit (or always, with force); what names
// them in the refusal, built only then.
func (b *MemoryBudget) take(n int64, what func() string, force bool) error {
	if b == nil || n <= 0 {
		return nil
	}
	used := b.used.Add(n)
	if b.limit > 0 && used > b.limit && !force {
		b.used.Add(-n)
		b.refused.Add(1)
		return fmt.Errorf("%w: %s needs %s, and clients' requests and responses hold %s of the %s allowed (limits.max_memory); retry later",
			errMemory, what(), formatBytes(n), formatBytes(used-n), formatBytes(b.limit))
	}
	for {
		p := b.peak.Load()
		if used <= p || b.peak.CompareAndSwap(p, used) {
			break
		}
	}
	return nil
}

func (b *MemoryBudget) give(n int64) {
	if b != nil && n > 0 {
		b.used.Add(-n)
	}
}

// Reserve takes n bytes for what (named in the refusal) and returns the
// reservation, which the caller must Release; or errMemory when they do not
// fit. A nil budget reserves nothing and never refuses.
func (b *MemoryBudget) Reserve(n int64, what string) (*Reservation, error) {
	return b.reserveFunc(n, func() string { return what })
}

// reserveFunc is Reserve with what built only for a refusal.
func (b *MemoryBudget) reserveFunc(n int64, what func() string) (*Reservation, error) {
	if err := b.take(n, what, false); err != nil {
		return nil, err
	}
	return &Reservation{b: b, n: max(n, 0)}, nil
}

// Reservation is memory taken from a budget for one request or response.
// Its methods are safe for concurrent use; Release may be called more than
// once. A nil reservation holds nothing.
type Reservation struct {
	mu   sync.Mutex
	b    *MemoryBudget
	n    int64
	done func() // called once, when released
}

// force reserves n bytes whether they fit or not, for memory whose number
// is bounded elsewhere; done, if set, runs when it is released.
func (b *MemoryBudget) force(n int64, done func()) *Reservation {
	_ = b.take(n, nil, true)
	if b == nil {
		n = 0
	}
	return &Reservation{b: b, n: max(n, 0), done: done}
}

// Grow takes n more bytes, or returns errMemory and keeps what it held.
func (r *Reservation) Grow(n int64, what string) error {
	if r == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.b.take(n, func() string { return what }, false); err != nil {
		return err
	}
	r.n += max(n, 0)
	return nil
}

// Size is the bytes held.
func (r *Reservation) Size() int64 {
	if r == nil {
		return 0
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n
}

// ShrinkTo gives back what the reservation holds over n bytes.
func (r *Reservation) ShrinkTo(n int64) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if n < r.n {
		r.b.give(r.n - max(n, 0))
		r.n = max(n, 0)
	}
	if n <= 0 && r.done != nil {
		r.done()
		r.done = nil
	}
}

// Release gives back everything the reservation holds.
func (r *Reservation) Release() { r.ShrinkTo(0) }

// formatBytes writes a byte count in the largest binary unit that keeps one
// decimal, as people read memory sizes.
func formatBytes(n int64) string {
	const units = "KMGTPE"
	if n < 1024 {
		return strconv.FormatInt(n, 10) + "B"
	}
	v, i := float64(n)/1024, 0
	for v >= 1024 && i < len(units)-1 {
		v /= 1024
		i++
	}
	return strconv.FormatFloat(v, 'f', 1, 64) + units[i:i+1] + "iB"
}
