package api

import (
	"fmt"
	"net"
	"sync"
)

// gRPC messages being read, counted on their connection.
//
// grpc-go buffers a unary call's message as its frames arrive, and says
// nothing of it until the message is whole (stats.InPayload). Reserving
// the largest message a call may send (limits.max_request_bytes) from its
// headers is a sure bound, but 64 calls whose 1.2 MB messages arrive slowly
// under overload then hold the whole 4 GiB budget and every other call,
// latency-critical ones included, is refused at its headers.
//
// The connection, though, is ours (LimitedListener), and what grpc-go holds
// of messages not yet whole was read from it. So on a connection the
// listener accepted, a unary call reserves from its headers what a message
// on that connection is expected to take (connReading.est: at first the
// largest allowed; then the last message completed on it, or half the
// previous estimate if that is more),
// and the connection reserves, as each read returns and before grpc-go sees
// the bytes, whatever it holds of messages not yet whole beyond what its
// calls reserved. What it holds is counted from above two ways, and the
// smaller is taken: the bytes read less those of the headers and messages
// its calls took whole (off by the framing of other frames, which only
// grows it), and the bytes read since the oldest call still being read
// began. When no call is being read it holds nothing.
//
// A call whose expected message does not fit in the budget, or whose
// connection already holds or may take its share (connReadingShare), is
// refused at its headers with RESOURCE_EXHAUSTED, as before. A connection
// whose read would take the budget past limits.max_memory is closed: its
// calls end UNAVAILABLE and everything they held is given back. The budget
// is a real bound: nothing is handed to grpc-go unreserved. The share is
// not enforced on reads: the count from above grows with the frames of
// calls refused from their headers that a client sent before it heard
// (grpc-go drops them as they arrive), and closing a busy connection for
// them, under overload, would end every call on it.
//
// Calls on connections the server did not accept through a LimitedListener
// (tests, in-memory listeners), streams (which keep the buffer of their
// next message for their whole life) and health calls reserve the largest
// message from their headers, as before.

// connReadingShareDivisor: one connection may hold at most this fraction
// of the budget in messages being read (connReadingShare).
const connReadingShareDivisor = 4

// connReadingMinEstimate is the least a call on an accounted connection
// reserves from its headers: its frames' buffers.
const connReadingMinEstimate = 64 << 10

// connReadingShare is what one connection may hold of messages being read
// in a budget of limit bytes (0: no limit) with messages of at most message
// bytes: a quarter of the budget, at least two messages, at most the
// budget.
func connReadingShare(limit, message int64) int64 {
	if limit <= 0 {
		return 0
	}
	return min(limit, max(limit/connReadingShareDivisor, 2*message))
}

// connReading accounts one connection's bytes of messages being read. Its
// zero value counts bytes only; it reserves from the first call that
// reads on it (admit).
type connReading struct {
	mu       sync.Mutex
	read     int64 // bytes read from the connection
	lastRead int64 // read before the latest read returned
	consumed int64 // bytes of headers and messages its calls took whole

	calls   []*grpcCall // the calls being read, oldest first; finished ones dropped lazily
	reading int         // calls in calls not finished
	covered int64       // what the calls being read reserved themselves

	budget  *MemoryBudget // nil until the first call
	share   int64         // what the connection may hold (0: no limit)
	message int64         // the largest message allowed
	est     int64         // what a call reserves from its headers
	res     *Reservation  // what it holds beyond covered
	err     error         // why it was closed; then every read fails
}

// connAddr is the remote address of a connection a LimitedListener
// accepted, carrying the connection's accounting to gRPC (the peer's
// address is all grpc-go passes on from the connection). It prints as the
// address it wraps.
type connAddr struct {
	net.Addr
	reading *connReading
	writes  *connWrites
}

// connReadingOf is the accounting of the connection whose remote address
// is addr, or nil.
func connReadingOf(addr net.Addr) *connReading {
	if a, ok := addr.(*connAddr); ok {
		return a.reading
	}
	return nil
}

// arrived counts n bytes read, and reserves what the connection now holds
// of messages being read; an error closes the connection.
func (a *connReading) arrived(n int) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.lastRead = a.read
	a.read += int64(n)
	if a.err != nil || a.budget == nil || a.reading == 0 {
		return a.err
	}
	held := a.heldLocked()
	if need := held - a.covered - a.res.Size(); need > 0 {
		if err := a.res.Grow(need, "gRPC messages being read on one connection"); err != nil {
			return a.failLocked(fmt.Errorf("%w; connection closed", err))
		}
	}
	return nil
}

// failLocked marks the connection closed for err and gives back what it
// held; its calls give back their own as they end.
func (a *connReading) failLocked(err error) error {
	a.err = err
	a.res.Release()
	return err
}

// heldLocked is what the connection holds of messages being read, from
// above.
func (a *connReading) heldLocked() int64 {
	for len(a.calls) > 0 && a.calls[0].finished {
		a.calls[0] = nil
		a.calls = a.calls[1:]
	}
	if a.reading == 0 || len(a.calls) == 0 {
		// Nothing is being read: what framing drifted into read less
		// consumed is forgotten, but for the latest read, which may hold
		// the headers and first frames of a call not yet admitted.
		a.consumed = max(a.consumed, a.lastRead)
		return 0
	}
	return max(0, min(a.read-a.consumed, a.read-a.calls[0].start))
}

// admit reserves the memory of call, whose headers have arrived, from m's
// budget: what a message on this connection is expected to take. It
// refuses the call (errMemory) when that does not fit in the budget or in
// the connection's share.
func (a *connReading) admit(call *grpcCall, m *grpcMemory) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.err != nil {
		return a.err
	}
	if a.budget == nil {
		a.budget, a.message = m.budget, m.message
		a.share = connReadingShare(m.budget.Limit(), m.message)
		a.est = m.message
		a.res, _ = m.budget.Reserve(0, "")
	}
	held := a.heldLocked()
	if a.share > 0 {
		if promised := max(held, a.covered) + a.est; promised > a.share {
			a.budget.refuse()
			return fmt.Errorf("%w: a gRPC message being read needs %s, and this connection's calls being read hold or may take %s of the %s one connection may (limits.max_memory / %d); retry later",
				errMemory, formatBytes(a.est), formatBytes(promised-a.est), formatBytes(a.share), connReadingShareDivisor)
		}
	}
	r, err := a.budget.Reserve(a.est, "a gRPC message being read and decoded")
	if err != nil {
		return err
	}
	call.res, call.conn, call.start, call.est = r, a, a.lastRead, a.est
	a.calls = append(a.calls, call)
	a.reading++
	a.covered += a.est
	if excess := max(0, held-a.covered); excess < a.res.Size() {
		a.res.ShrinkTo(excess)
	}
	return nil
}

// http2FrameOverhead is an HTTP/2 frame's header; frames of a message carry
// at most http2MaxFrame bytes each (the default SETTINGS_MAX_FRAME_SIZE,
// which grpc-go's server keeps).
const (
	http2FrameOverhead = 9
	http2MaxFrame      = 16 << 10
)

// finish ends the reading of call: header is its headers' wire length,
// wire its message's (0 when it ended without one). It gives back what the
// call reserved from its headers: the message is now in its decoded form,
// which the codec reserved.
func (a *connReading) finish(call *grpcCall, header, wire int64) {
	a.mu.Lock()
	if call.finished {
		a.mu.Unlock()
		return
	}
	call.finished = true
	a.reading--
	a.covered -= call.est
	a.consumed += header + http2FrameOverhead
	if wire > 0 {
		a.consumed += wire + http2FrameOverhead*((wire+http2MaxFrame-1)/http2MaxFrame)
		a.est = min(a.message, max(wire, a.est/2, connReadingMinEstimate))
	}
	if a.err == nil {
		if excess := max(0, a.heldLocked()-a.covered); excess < a.res.Size() {
			a.res.ShrinkTo(excess)
		}
	}
	a.mu.Unlock()
	call.res.Release()
}

// close gives back what the connection holds, once it is closed.
func (a *connReading) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.err == nil {
		a.err = net.ErrClosed
	}
	a.res.Release()
}
