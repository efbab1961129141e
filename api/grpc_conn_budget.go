package api

import (
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sync"
	"time"
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
// calls reserved. When no call is being read and no stream is open
// (below) it holds nothing. Else what it holds is counted from above:
//
//   - On a connection whose HTTP/2 frames are followed (GRPCCredentials,
//     as the server's are; connWrites.read hands the client's frames,
//     after TLS, to clientReadLocked, clientFrameLocked and
//     clientPayloadLocked before grpc-go reads them): the DATA of the
//     streams the client opened that the server has not ended (neither
//     their trailers nor a reset written, connWrites.wrote, nor reset by
//     the client), less the messages its calls took whole (a health
//     Watch whose handler started counts none: its own reservation covers
//     its message). Every other byte read is not held: frame headers,
//     other frames, padding, and the DATA of streams ended, which grpc-go
//     drops as it arrives, calls refused at their headers included. What
//     was read below TLS and not yet parsed counts whole (the bytes read
//     are counted below TLS, the frames above: TLS's overhead only
//     grows the count, and is forgotten with it when nothing is being
//     read, but for tlsReadSlack). A message taken whole (stats.InPayload)
//     is given back at once, and taken off its stream's count when the
//     stream is known (the call's handler starts, or it ends: grpc-go
//     names the stream to neither the tap nor InPayload); until then, the
//     end of any stream gives back its DATA less the messages not yet
//     placed, so that nothing is given back twice. The DATA a live stream
//     counts is forgotten only with its stream (or as its messages are
//     taken), never with the drift when nothing is being read: it may be
//     the first bytes of a stream whose call is admitted after them.
//   - Without them (listeners of tests): the smaller of the bytes read
//     less those of the headers and messages its calls took whole (off
//     by the framing of other frames, which only grows it), and the
//     bytes read since the oldest call still being read began. This
//     counted the frames of calls refused at their headers that a client
//     sent before it heard, and of streams already ended: one connection
//     counted 202-234 MiB of a 246 MiB budget that grpc-go did not hold,
//     and another client's call was refused (TestE2EUnfinishedStreams'
//     failed runs, TestE2EGRPCRefusedFramesNotCounted).
//
// A call whose expected message does not fit in the budget, or whose
// connection already holds or may take its share (connReadingShare) while
// more than half of the budget is taken with it, is refused at its headers
// with RESOURCE_EXHAUSTED, as before. (Held to its quarter whatever the
// rest of the budget held, a fresh connection, each of whose calls may
// take the largest message, took 12 calls at once by default: a client
// that opened a channel and sent a burst of 16 concurrent calls had four
// refused on a server with gigabytes free, TestE2EGRPCFreshChannelBurst.
// While at most half of the budget is taken, one connection may go past
// its quarter, 25 such calls being read at once by default; past half,
// every connection keeps to its quarter, so that going past it never
// takes the budget beyond half.) A connection
// whose read would take the budget past limits.max_memory is closed: its
// calls end UNAVAILABLE and everything they held is given back. The budget
// is a real bound: nothing is handed to grpc-go unreserved. The share is
// not enforced on reads: a call's message may be larger than its
// connection expected from the last one, and closing a busy connection for
// it, under overload, would end every call on it; the budget bounds it.
//
// A call whose message does not arrive in time closes its connection
// (limits.body_timeout, as REST answers 408 and closes): a unary call from
// its headers until its handler starts (its message whole and the
// client's end of it in), and a stream's message from its first bytes to
// its last while the stream's handler waits for it. A stream idle between
// messages is not timed, nor a message its handler has not asked for (a
// ModelStreamInfer stream whose in-flight slots are taken reads nothing,
// and flow control stops its client mid-message: that wait is the
// server's). Without it, a client that sent its headers and part of its
// message held the call's reservation (64 MiB on a fresh connection) for
// as long as it kept the connection, pinging it alive (limits.idle_timeout
// counts connections without calls only): 64 of them held the default 4
// GiB and every other call was refused. grpc-go cannot end one stream from
// outside without breaking the connection's framing, so the connection is
// closed, as for limits.write_timeout: its calls end UNAVAILABLE and
// everything they held is given back; logged at WARN with the peer.
//
// Streams. A streaming call keeps its stream open for as long as its
// client likes, idle between messages, and limits.idle_timeout counts only
// connections without calls. It reserved the largest message for its whole
// life (the buffer of its next message): 64 idle ModelStreamInfer streams
// (one connection may open limits.grpc_max_streams, 256) held the default
// 4 GiB, and every other call was refused RESOURCE_EXHAUSTED for as long as
// their client kept them. So on a connection whose frames are followed a
// streaming call reserves from its headers only what grpc-go keeps for its
// stream for its life (GRPCStreamBytes: its state and stacks, and its
// headers, which grpc-go keeps decoded), and its messages are counted on
// the connection as their DATA arrives (admitStream): the connection is
// being read while it has a stream open, a message is given back once its
// handler has it whole (took, as RecvMsg returns: grpc-go frees the wire
// form then), and the DATA it still counts at the stream's end with the
// stream. A stream's message past the budget closes its connection, as a
// unary call's does; the streams' own reservations count in their
// connection's share, so that a connection's streams and unary calls are
// held to one quarter together. Health calls (a Watch gives its
// reservation back once its one message is in) and a streaming call whose
// stream cannot be read from grpc-go (grpcStreamID) reserve the largest
// message, as do calls on connections whose frames are not followed
// (connections the server did not accept through a LimitedListener:
// tests, in-memory listeners).

// connReadingShareDivisor: one connection may hold at most this fraction
// of the budget in messages being read (connReadingShare) once more than
// half of the budget is taken (connReadingShareSpare).
const connReadingShareDivisor = 4

// connReadingShareSpare reports whether a call that needs est bytes may go
// past its connection's share: whether the budget of limit bytes, used of
// which are taken, stays at most half taken with it.
func connReadingShareSpare(used, est, limit int64) bool {
	return used+est <= limit/2
}

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

// connReading accounts one connection's bytes of messages being read, and
// times the calls whose messages are being read (limits.body_timeout). Its
// zero value counts bytes only; it reserves from the first call that reads
// on it (admit).
type connReading struct {
	mu       sync.Mutex
	read     int64 // bytes read from the connection
	lastRead int64 // read before the latest read returned
	// Bytes read that grpc-go does not hold as messages being read:
	// without the client's frames, the headers and messages its calls
	// took whole; with them, every byte but the DATA of the streams it
	// counts (live), less the messages its calls took whole.
	consumed int64

	calls   []*grpcCall // the calls being read, oldest first; finished ones dropped lazily
	reading int         // calls in calls not finished
	covered int64       // what the calls being read reserved themselves
	// streams counts the streaming calls whose messages the connection
	// counts as they arrive (admitStream) that have not ended; each
	// reserved stream bytes itself.
	streams int
	stream  int64

	budget  *MemoryBudget // nil until the first call
	share   int64         // what the connection may hold (0: no limit)
	message int64         // the largest message allowed
	est     int64         // what a call reserves from its headers
	res     *Reservation  // what it holds beyond covered
	err     error         // why it was closed; then every read fails

	// The client's frames, followed after TLS (follow, from connWrites):
	// the streams it opened that the server has not ended, what of their
	// DATA is counted, and the messages unary calls took whole before
	// their streams were known (their handlers had not started).
	followed     bool
	slack        int64 // bytes below TLS that may be read and not yet parsed
	live         map[uint32]*liveStream
	lastOpened   uint32
	lost         bool     // a stream was not followed (live was full): DATA of streams not in live counts
	resets       []uint32 // streams the client reset, ended at its next read
	pad          int64    // the padding of the DATA frame being read
	liveIn       int64    // the live streams' in
	unattributed int64

	// limits.body_timeout: a call whose message (unary: and end) has not
	// arrived this long after its headers (stream: after its message
	// began, while its handler waits for it) closes the connection.
	timeout   time.Duration
	waiting   []*grpcCall // unary calls whose handlers have not started, oldest first; started ones dropped lazily
	nwaiting  int         // calls in waiting not started
	timer     *time.Timer
	logger    *slog.Logger
	closeConn func() error // closes the accepted connection
	peer      net.Addr
	slow      *SlowClients // counts the closes
}

// liveStream is a stream the client opened and the server has not ended,
// followed from the client's frames.
type liveStream struct {
	in int64 // its DATA bytes counted as held, less the messages taken whole
	// call is its streaming call once its handler started; own, when the
	// call's own reservation covers its messages (a health Watch): its
	// DATA is then not counted.
	call *grpcCall
	own  bool
	// The message arriving: bytes of its length prefix read (0 to 5), the
	// length they give, the bytes still to come, and when it began (zero
	// between messages).
	prefix int
	size   int64
	left   int64
	since  time.Time
	recv   time.Time // when its handler began waiting for a message; zero when not waiting
}

// maxLiveStreams bounds the streams a connection follows at once; past it
// (grpc_max_streams is 256 by default) the DATA of streams not followed
// is all counted, ended ones' included.
const maxLiveStreams = 1 << 14

// tlsReadSlack bounds the bytes below TLS read and not yet handed on as
// plaintext: crypto/tls reads a record or a few ahead (at most 16 KiB and
// some of its overhead each).
const tlsReadSlack = 128 << 10

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
	if a.err != nil || a.budget == nil || a.reading == 0 && a.streams == 0 {
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

// bytesRead is how many bytes were read from the connection so far.
func (a *connReading) bytesRead() int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.read
}

// settleLocked gives back what the connection holds beyond what it now
// counts (arrived reserved for bytes not yet parsed); mu is held.
func (a *connReading) settleLocked() {
	if a.err != nil || a.budget == nil || a.res.Size() == 0 {
		return
	}
	if excess := max(0, a.heldLocked()-a.covered); excess < a.res.Size() {
		a.res.ShrinkTo(excess)
	}
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
	if len(a.calls) > 2*a.reading+16 {
		a.calls = slices.DeleteFunc(a.calls, func(c *grpcCall) bool { return c.finished })
	}
	unary := a.reading > 0 && len(a.calls) > 0
	if !unary && a.liveIn == 0 {
		// No message is being read: what framing (or TLS) drifted into
		// read less consumed is forgotten, but for the latest read,
		// which may hold the headers and first frames of a call not yet
		// admitted (and below TLS, what may not be parsed yet). DATA the
		// live streams counted is kept: it may be the first of a stream
		// whose call is not admitted yet (or only now, admitStream), whose
		// messages are counted as they arrive.
		a.consumed = max(a.consumed, a.lastRead-a.slack)
	}
	switch {
	case !unary && a.streams == 0:
		return 0
	case a.followed:
		return max(0, a.read-a.consumed)
	case !unary:
		return 0
	}
	return max(0, min(a.read-a.consumed, a.read-a.calls[0].start))
}

// configure takes the limits of m, once.
func (a *connReading) configure(m *grpcMemory) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.configureLocked(m)
}

// configureLocked takes the limits of m, once; mu is held.
func (a *connReading) configureLocked(m *grpcMemory) {
	if a.budget != nil || m.budget == nil {
		return
	}
	a.budget, a.message = m.budget, m.message
	a.share = connReadingShare(m.budget.Limit(), m.message)
	a.est, a.stream = m.message, m.stream
	a.res, _ = m.budget.Reserve(0, "")
	a.timeout, a.logger, a.slow = m.bodyTimeout, m.logger, m.slow
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
	a.configureLocked(m)
	held := a.heldLocked()
	if err := a.shareLocked(held, a.est, "a gRPC message being read"); err != nil {
		return err
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
	a.awaitLocked(call)
	return nil
}

// shareLocked refuses (errMemory) a call that needs est bytes, what names
// them, when the connection's calls already hold or may take too much of
// its share with it: what it holds of messages being read (held), or what
// its unary calls being read reserved if more, and its streams' own
// reservations. Past its share, a call is still let in while the budget
// with it stays at most half taken (connReadingShareSpare); mu is held.
func (a *connReading) shareLocked(held, est int64, what string) error {
	if a.share <= 0 {
		return nil
	}
	if promised := max(held, a.covered) + int64(a.streams)*a.stream + est; promised > a.share {
		if connReadingShareSpare(a.budget.Used(), est, a.budget.Limit()) {
			return nil
		}
		a.budget.refuse()
		return fmt.Errorf("%w: %s needs %s, and this connection's calls being read hold or may take %s of the %s one connection may while more than half of the budget is taken (limits.max_memory / %d); retry later",
			errMemory, what, formatBytes(est), formatBytes(promised-est), formatBytes(a.share), connReadingShareDivisor)
	}
	return nil
}

// admitStream reserves the memory of call, a streaming call whose headers
// have arrived, from m's budget when the connection's frames are followed:
// what grpc-go keeps for a stream (m.stream); its messages are counted on
// the connection as they arrive, and each is given back once taken whole
// (took). It reports false, and reserves nothing, when the frames are not
// followed; it refuses the call (errMemory) when that does not fit in the
// budget or in the connection's share.
func (a *connReading) admitStream(call *grpcCall, m *grpcMemory) (bool, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.followed {
		return false, nil
	}
	if a.err != nil {
		return true, a.err
	}
	a.configureLocked(m)
	// Counted before the count is read: DATA of the stream read with its
	// headers is kept (heldLocked).
	a.streams++
	held := a.heldLocked()
	a.streams--
	if err := a.shareLocked(held, a.stream, "a gRPC stream"); err != nil {
		return true, err
	}
	a.streams++
	r, err := a.budget.Reserve(a.stream, "a gRPC stream's buffers")
	if err != nil {
		a.streams--
		return true, err
	}
	// What the connection read before the stream was admitted, DATA of
	// it included, is reserved now (arrived did not, nothing being read).
	if need := held - a.covered - a.res.Size(); need > 0 {
		if err := a.res.Grow(need, "gRPC messages being read on one connection"); err != nil {
			a.streams--
			r.Release()
			return true, err
		}
	}
	call.res, call.light, call.counted, call.message = r, true, true, m.message
	return true, nil
}

// await times call, a unary call whose headers have arrived and that
// admit did not reserve for (a health check), until its handler starts
// (begin) or it ends.
func (a *connReading) await(call *grpcCall, m *grpcMemory) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.configureLocked(m)
	a.awaitLocked(call)
}

func (a *connReading) awaitLocked(call *grpcCall) {
	call.readFrom, call.arrived = a, time.Now()
	if a.timeout <= 0 {
		return
	}
	a.waiting = append(a.waiting, call)
	a.nwaiting++
	a.wakeLocked()
}

// wakeLocked makes the body timer run; mu is held.
func (a *connReading) wakeLocked() {
	if a.timer == nil && a.timeout > 0 && a.closeConn != nil && a.err == nil {
		a.timer = time.AfterFunc(a.timeout, a.check)
	}
}

// begin notes that the handler of call, on stream id (known: false when
// it could not be read), has started: a unary call's message and end are
// in, and the message it took whole (finish) is the stream's.
func (a *connReading) begin(call *grpcCall, id uint32, known bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.begunLocked(call)
	if call.taken == 0 {
		return
	}
	if s := a.live[id]; known && s != nil {
		k := min(s.in, call.taken)
		s.in -= k
		a.liveIn -= k
	}
	a.unattributed -= call.taken
	call.taken = 0
}

func (a *connReading) begunLocked(call *grpcCall) {
	if call.begun {
		return
	}
	call.begun = true
	if call.arrived.IsZero() || a.timeout <= 0 {
		return
	}
	a.nwaiting--
	for len(a.waiting) > 0 && a.waiting[0].begun {
		a.waiting[0] = nil
		a.waiting = a.waiting[1:]
	}
	if len(a.waiting) > 2*a.nwaiting+16 {
		a.waiting = slices.DeleteFunc(a.waiting, func(c *grpcCall) bool { return c.begun })
	}
}

// streaming notes that the handler of call, a streaming call on stream id,
// has started: the call's own reservation covers its messages, which are
// no longer counted on the connection.
func (a *connReading) streaming(call *grpcCall, id uint32) {
	a.mu.Lock()
	defer a.mu.Unlock()
	s := a.live[id]
	if s == nil {
		return
	}
	s.call = call
	if call.light {
		return // its messages stay counted until each is taken (took)
	}
	s.own = true
	a.consumed += s.in
	a.liveIn -= s.in
	s.in = 0
	a.settleLocked()
}

// took gives back a message of wire bytes (its length prefix included)
// that the handler of the streaming call on stream id has taken whole.
func (a *connReading) took(id uint32, wire int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	s := a.live[id]
	if s == nil || s.own {
		return
	}
	k := min(s.in, wire)
	s.in -= k
	a.liveIn -= k
	a.consumed += k
	a.settleLocked()
}

// receiving notes that the handler of the streaming call on stream id
// waits for a message (on) or has it (off).
func (a *connReading) receiving(id uint32, on bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	s := a.live[id]
	if s == nil {
		return
	}
	if !on {
		s.recv = time.Time{}
		return
	}
	s.recv = time.Now()
	if !s.since.IsZero() {
		a.wakeLocked()
	}
}

// ended notes the end of call, on stream id (known: false when it could
// not be read), whatever ended it: a message it took whole whose handler
// did not start (a second one broke the call) is its stream's.
func (a *connReading) ended(call *grpcCall, id uint32, known bool) {
	a.begin(call, id, known)
	a.mu.Lock()
	defer a.mu.Unlock()
	if call.counted {
		// Its stream's DATA still counted is given back when the stream
		// ends (streamEnded).
		call.counted = false
		a.streams--
		a.settleLocked()
	}
}

// check closes the connection when a call has waited for its message for
// the body timeout; else it looks again when that could be so.
func (a *connReading) check() {
	a.mu.Lock()
	if a.err != nil || a.timer == nil {
		a.timer = nil
		a.mu.Unlock()
		return
	}
	since, method := a.oldestWaitLocked()
	if since.IsZero() {
		a.timer = nil
		a.mu.Unlock()
		return
	}
	if wait := a.timeout - time.Since(since); wait > 0 {
		a.timer.Reset(wait)
		a.mu.Unlock()
		return
	}
	a.timer = nil
	closeConn, logger, timeout := a.closeConn, a.logger, a.timeout
	a.mu.Unlock()
	a.slow.add(slowGRPC, slowBody)
	if logger != nil {
		logger.Warn("gRPC connection closed: a call's message did not arrive within limits.body_timeout; its calls end UNAVAILABLE",
			"peer", a.peer, "method", method, "body_timeout", timeout)
	}
	_ = closeConn() // its reads and writes fail; close gives back the rest
}

// oldestWaitLocked is since when the call that has waited longest for its
// message has, and its method; zero when none waits.
func (a *connReading) oldestWaitLocked() (since time.Time, method string) {
	for len(a.waiting) > 0 && a.waiting[0].begun {
		a.waiting[0] = nil
		a.waiting = a.waiting[1:]
	}
	if len(a.waiting) > 0 {
		since, method = a.waiting[0].arrived, a.waiting[0].method
	}
	for _, s := range a.live {
		if s.call == nil || s.recv.IsZero() || s.since.IsZero() {
			continue
		}
		if t := later(s.since, s.recv); since.IsZero() || t.Before(since) {
			since, method = t, s.call.method
		}
	}
	return since, method
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
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
	if !a.followed {
		a.consumed += header + http2FrameOverhead
		if wire > 0 {
			a.consumed += wire + http2FrameOverhead*((wire+http2MaxFrame-1)/http2MaxFrame)
		}
	} else if wire > 0 {
		// Its headers were counted as they were read; its message's
		// DATA is given back here, and taken off its stream's count
		// once the stream is known (begin).
		a.consumed += wire
		a.unattributed += wire
		call.taken = wire
	}
	if wire > 0 {
		a.est = min(a.message, max(wire, a.est/2, connReadingMinEstimate))
	}
	a.settleLocked()
	a.mu.Unlock()
	call.res.Release()
}

// follow makes the client's frames, read after TLS (slack: the bytes
// below TLS that may be read and not yet parsed), the count of what the
// connection holds: what was read before (a TLS handshake) is not held.
func (a *connReading) follow(slack int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.followed, a.slack = true, slack
	a.live = make(map[uint32]*liveStream)
	a.consumed = max(a.consumed, a.lastRead)
}

// clientReadLocked counts n bytes of the client's frames about to be
// parsed as not held, but for the DATA of the streams it follows
// (clientPayloadLocked); mu is held. The streams the client reset end
// now: grpc-go has handled the frames read before this.
func (a *connReading) clientReadLocked(n int) {
	for _, id := range a.resets {
		a.streamEndedLocked(id)
	}
	a.resets = a.resets[:0]
	a.consumed += int64(n)
}

// clientFrameLocked follows a frame header of the client's; mu is held.
func (a *connReading) clientFrameLocked(f frameHeader) {
	switch f.kind {
	case http2FrameHeaders:
		if f.stream <= a.lastOpened {
			return // trailers: grpc-go ends the connection
		}
		a.lastOpened = f.stream
		if len(a.live) >= maxLiveStreams {
			a.lost = true
			return
		}
		a.live[f.stream] = &liveStream{}
	case http2FrameData:
		a.pad = 0
	case http2FrameRSTStream:
		a.resets = append(a.resets, f.stream)
	}
}

// clientPayloadLocked follows a piece of a frame of the client's payload,
// at off in it; mu is held.
func (a *connReading) clientPayloadLocked(f frameHeader, off int64, piece []byte) {
	if f.kind != http2FrameData {
		return
	}
	first := int64(0)
	if f.flags&http2FlagPadded != 0 {
		first = 1
		if off == 0 {
			a.pad = int64(piece[0])
		}
	}
	lo, hi := max(off, first), min(off+int64(len(piece)), f.length-a.pad)
	if hi <= lo {
		return
	}
	data := piece[lo-off : hi-off]
	s := a.live[f.stream]
	if s == nil {
		if a.lost {
			a.consumed -= int64(len(data))
		}
		return // grpc-go drops it: the stream has ended
	}
	if !s.own {
		s.in += int64(len(data))
		a.liveIn += int64(len(data))
		a.consumed -= int64(len(data))
	}
	if s.frame(data) && !s.recv.IsZero() {
		a.wakeLocked()
	}
}

// frame follows data, bytes of the stream's messages, and reports whether
// a message began in them that is still arriving.
func (s *liveStream) frame(data []byte) (began bool) {
	for len(data) > 0 {
		if s.left > 0 {
			k := min(s.left, int64(len(data)))
			s.left -= k
			data = data[k:]
			if s.left == 0 {
				s.since = time.Time{}
			}
			continue
		}
		if s.prefix == 0 {
			s.since, began = time.Now(), true
		} else {
			s.size = s.size<<8 | int64(data[0])
		}
		s.prefix++
		data = data[1:]
		if s.prefix == 5 {
			s.prefix, s.left, s.size = 0, s.size, 0
			if s.left == 0 {
				s.since = time.Time{}
			}
		}
	}
	return began && !s.since.IsZero()
}

// streamEnded notes that the server has ended stream id (its trailers or
// a reset written): grpc-go holds nothing of it any more, and drops what
// the client sends on it.
func (a *connReading) streamEnded(id uint32) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.live[id]; ok {
		a.streamEndedLocked(id)
		a.settleLocked()
	}
}

func (a *connReading) streamEndedLocked(id uint32) {
	s := a.live[id]
	if s == nil {
		return
	}
	delete(a.live, id)
	a.liveIn -= s.in
	if s.call != nil {
		// A streaming call's messages were taken off its count (took).
		a.consumed += s.in
		return
	}
	// A message a unary call took whole may be this stream's, already
	// given back (finish): that much is not given back twice.
	a.consumed += max(0, s.in-a.unattributed)
}

// close gives back what the connection holds, once it is closed.
func (a *connReading) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.err == nil {
		a.err = net.ErrClosed
	}
	a.res.Release()
	if a.timer != nil {
		a.timer.Stop()
		a.timer = nil
	}
}
