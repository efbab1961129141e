package runtime

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// This file bounds the batches a pool runs by its members' memory: an MPS
// client's pinned memory is fixed when it starts, and a batch whose
// activations do not fit in it fails. The scheduler forms batches within
// MaxBatch; the pool runs a batch only on a member that holds it, and a
// replacement that holds less than its predecessor (a shrunk memory share)
// switches in only once the larger batches in flight have ended.

// BatchCapacity is implemented by members whose memory bounds the batch
// they can run (a simulated MPS client under its pinned memory limit).
type BatchCapacity interface {
	// MaxBatch is the largest batch the member's memory holds now, 0 when
	// not even one item fits; bounded is false when its memory sets no
	// bound it can tell.
	MaxBatch() (n int, bounded bool)
}

// ErrBatchOverMemory is a batch larger than any member's memory holds: the
// pool refuses it rather than run it into an out-of-memory failure. It
// wraps ErrUnavailable.
var ErrBatchOverMemory = fmt.Errorf("%w: the batch is larger than the instance's memory holds", ErrUnavailable)

// batchBound is the pool's record of the batches in flight and of the bound
// a replacement about to switch in sets.
type batchBound struct {
	mu       sync.Mutex
	pending  int // the bound of a replacement about to switch in; 0: none
	inflight map[int]int
}

// memberBatch is m's bound, or false when it has none.
func memberBatch(m Member) (int, bool) {
	if c, ok := m.(BatchCapacity); ok {
		return c.MaxBatch()
	}
	return 0, false
}

// MaxBatch is the largest batch every member's memory holds (so whichever
// member takes it runs it), and the bound of a replacement about to switch
// in; bounded is false when no member's memory bounds its batches. The
// scheduler forms batches within it.
func (p *Pool) MaxBatch() (n int, bounded bool) {
	p.bound.mu.Lock()
	defer p.bound.mu.Unlock()
	n, bounded = p.membersBatch()
	if pend := p.bound.pending; pend > 0 && (!bounded || pend < n) {
		n, bounded = pend, true
	}
	return n, bounded
}

// rows is a request's batch: the first dimension of its first input (1
// without one). Only batched models have bounded members.
func rows(req *InferRequest) int {
	if len(req.Inputs) > 0 && len(req.Inputs[0].Shape) > 0 {
		return int(max(1, req.Inputs[0].Shape[0]))
	}
	return 1
}

// fits reports whether m's memory holds a batch of b.
func fits(m Member, b int) bool {
	c, ok := memberBatch(m)
	return !ok || b <= c
}

// anyFits reports whether some member's memory holds a batch of b.
func (p *Pool) anyFits(b int) bool {
	p.mu.RLock()
	defer p.mu.RUnlock()
	for _, m := range p.members {
		if fits(m, b) {
			return true
		}
	}
	return false
}

func noLeave() {}

// enterBatch records a call of batch b in flight, or refuses it with
// ErrBatchOverMemory when no member holds it; a pool whose members' memory
// bounds no batch records nothing.
func (p *Pool) enterBatch(b int) (leave func(), err error) {
	p.bound.mu.Lock()
	defer p.bound.mu.Unlock()
	if _, bounded := p.membersBatch(); !bounded {
		return noLeave, nil // nothing to track: no member's memory bounds a batch
	}
	if !p.anyFits(b) {
		n, _ := p.membersBatch()
		return nil, fmt.Errorf("%w: a batch of %d, the members hold %d", ErrBatchOverMemory, b, n)
	}
	if p.bound.inflight == nil {
		p.bound.inflight = map[int]int{}
	}
	p.bound.inflight[b]++
	return func() {
		p.bound.mu.Lock()
		defer p.bound.mu.Unlock()
		if p.bound.inflight[b]--; p.bound.inflight[b] == 0 {
			delete(p.bound.inflight, b)
		}
	}, nil
}

// membersBatch is the largest batch every member's memory holds.
func (p *Pool) membersBatch() (n int, bounded bool) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	for _, m := range p.members {
		if c, ok := memberBatch(m); ok && (!bounded || c < n) {
			n, bounded = c, true
		}
	}
	return n, bounded
}

// holdFor sets the bound of fresh, a replacement about to switch in, and
// waits until no call in flight has a larger batch, so that no batch formed
// for its predecessor's memory reaches it. It waits at least one poll, for
// a batch formed just before the bound. The returned function clears the
// bound once fresh is a member (its own bound then counts).
func (p *Pool) holdFor(fresh Member) (clear func()) {
	n, ok := memberBatch(fresh)
	if !ok {
		return func() {}
	}
	p.bound.mu.Lock()
	if cur, bounded := p.membersBatch(); bounded && n >= cur {
		p.bound.mu.Unlock()
		return func() {} // it holds every batch its predecessor may run
	}
	p.bound.pending = max(n, 1)
	p.bound.mu.Unlock()
	clear = func() {
		p.bound.mu.Lock()
		p.bound.pending = 0
		p.bound.mu.Unlock()
	}
	for {
		time.Sleep(parkPoll)
		p.bound.mu.Lock()
		larger := false
		for b := range p.bound.inflight {
			larger = larger || b > n
		}
		p.bound.mu.Unlock()
		select {
		case <-p.stopped:
			return clear
		default:
		}
		if !larger {
			return clear
		}
	}
}

// pickFitting is pick for a batch of b: a member whose memory holds it.
// A member that does not hold it gives its slot back and the call waits a
// poll for one that does; none left is ErrBatchOverMemory.
func (p *Pool) pickFitting(ctx context.Context, b int, avoid Member) (Member, error) {
	for {
		m, err := p.pick(ctx, avoid)
		if err != nil || fits(m, b) {
			return m, err
		}
		p.idle <- m
		if !p.anyFits(b) {
			return nil, fmt.Errorf("%w: a batch of %d", ErrBatchOverMemory, b)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(parkPoll):
		}
	}
}
