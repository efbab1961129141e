package api

import (
	"context"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
)

// gRPC and the memory budget.
//
// grpc-go reads a call's message as it arrives, growing the buffer frame by
// frame up to the size its length prefix declares (at most
// limits.max_request_bytes), and grants the client flow-control window for
// all of it once the handler asks for the message; before that, up to the
// stream's window is buffered. No hook sees the declared size. A unary
// call on a connection the server's LimitedListener accepted reserves what
// a message on that connection is expected to take when its headers arrive
// (the tap handle, before anything is read), and the connection what it
// reads of unfinished messages beyond that (connReading, in
// grpc_conn_budget.go); any other call is given the most its received
// buffers can take, limits.max_request_bytes. A call that does not fit is
// refused there with RESOURCE_EXHAUSTED; one whose message does not arrive
// within limits.body_timeout closes its connection (connReading). What
// decoding adds once the message is in is reserved by the codec from the
// message itself: the copy that gathers a message received in pieces into
// one buffer, and the decoded structures with their copies of every bytes
// field (grpcDecodeCodec). A unary call gives back what its
// message did not take when the handler starts (the message is in). A
// stream on a connection whose frames are followed reserves its stream's
// buffers (GRPCStreamBytes) for its life and its connection counts each
// message as it arrives (connReading.admitStream); elsewhere a stream
// keeps the largest message for its whole life, as the buffer of the next
// message. Either reserves each message it holds on top. The stats handler
// gives everything back when the call ends, however it ends.

// grpcCallKey keys a call's grpcCall in its context.
type grpcCallKey struct{}

// grpcCall is what a call holds until it ends, whatever ends it: its
// memory reservation, and the ModelInferRequest the codec decoded for it,
// whose reservation waits in the codec for the handler (takeDecoded). A
// call refused between the two (an interceptor that refuses it, such as
// authentication) never runs its handler: the stats handler gives both
// back at the call's end.
type grpcCall struct {
	res     *Reservation
	headers *Reservation // a unary call's headers, held until it ends (reserve)
	infer   atomic.Pointer[inference.ModelInferRequest]

	// Set for a unary call on a connection whose reads are accounted
	// (connReading): where its bytes began in the connection's, what it
	// reserved from its headers, and whether its message is in.
	conn     *connReading
	start    int64
	est      int64
	finished bool  // guarded by conn.mu
	header   int64 // its headers' wire length

	// Set for a call on a connection a LimitedListener accepted: its
	// connection's accounting, and (guarded by readFrom.mu) for a unary
	// call when its headers arrived (limits.body_timeout counts from
	// then), whether its handler has started, and the wire length of the
	// message it took whole while its stream is not known.
	readFrom *connReading
	arrived  time.Time
	begun    bool
	taken    int64
	method   string

	// Set on a connection whose frames are followed (connWrites): its
	// stream, when its handler starts (grpcCallStream).
	writes   *connWrites
	stream   uint32
	followed bool // stream is known: its answers are followed

	// Set for a streaming call whose messages its connection counts as
	// they arrive (connReading.admitStream): it reserved its stream's
	// buffers only; message is the largest message, which it reserves if
	// its stream cannot be known. counted (guarded by readFrom.mu): it is
	// among its connection's streams. taking: the wire length of the
	// message its handler is taking whole, given back once it has it.
	light   bool
	counted bool
	message int64
	taking  atomic.Int64
}

// grpcCallStream notes the HTTP/2 stream of a call whose connection's
// frames are followed, before its handler runs: grpc-go's stats handler
// is not given the stream (but at stats.End), its interceptors are. It
// returns the call, or nil.
func grpcCallStream(ctx context.Context) *grpcCall {
	call, _ := ctx.Value(grpcCallKey{}).(*grpcCall)
	if call != nil && call.writes != nil {
		call.stream, call.followed = grpcStreamID(ctx)
	}
	return call
}

// grpcCallStreamUnary is grpcCallStream for unary calls: the call's
// message and end are in (connReading.begin).
func grpcCallStreamUnary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if call := grpcCallStream(ctx); call != nil && call.readFrom != nil {
		call.readFrom.begin(call, call.stream, call.followed)
	}
	return handler(ctx, req)
}

// grpcCallStreamStream is grpcCallStream for streaming calls: on a
// connection whose frames are followed, the call's own reservation covers
// its messages (connReading.streaming), and the time its handler waits
// for a message begun is timed (limits.body_timeout). A call that sends
// one message (a health Watch) is timed as a stream's from here.
func grpcCallStreamStream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if call := grpcCallStream(ss.Context()); call != nil && call.readFrom != nil {
		call.readFrom.begin(call, call.stream, call.followed)
		if call.followed {
			call.readFrom.streaming(call, call.stream)
			ss = &timedStream{ServerStream: ss, conn: call.readFrom, call: call}
		} else if call.light {
			// Its messages cannot be taken off its stream's count: it
			// reserves the largest, as on connections not followed.
			if err := call.res.Grow(call.message-call.res.Size(), "a gRPC message being read and decoded"); err != nil {
				return status.Error(codes.ResourceExhausted, err.Error())
			}
		}
	}
	return handler(srv, ss)
}

// timedStream tells its connection's accounting when its handler waits
// for a message, and when it has taken one whole.
type timedStream struct {
	grpc.ServerStream
	conn *connReading
	call *grpcCall
}

func (s *timedStream) RecvMsg(m any) error {
	s.conn.receiving(s.call.stream, true)
	defer s.conn.receiving(s.call.stream, false)
	err := s.ServerStream.RecvMsg(m)
	// grpc-go frees the message's wire form as RecvMsg returns, after
	// its stats.InPayload: it is given back from here.
	if wire := s.call.taking.Swap(0); wire > 0 {
		s.conn.took(s.call.stream, wire)
	}
	return err
}

// abandon gives back what call (nil: none) reserved from its headers,
// when it will not run.
func (call *grpcCall) abandon() {
	if call == nil {
		return
	}
	if call.conn != nil {
		call.conn.finish(call, 0, 0)
	}
	if call.readFrom != nil {
		call.readFrom.ended(call, 0, false)
	}
	call.res.Release()
	call.headers.Release()
}

// grpcCallMemory is the memory reservation of the call ctx belongs to, or
// nil.
func grpcCallMemory(ctx context.Context) *Reservation {
	if c, _ := ctx.Value(grpcCallKey{}).(*grpcCall); c != nil {
		return c.res
	}
	return nil
}

// grpcHealthPrefix is the standard health service's method prefix: its
// calls are not refused for memory (probes must answer while the server is
// at its budget) but at most grpcHealthReading of them are read at once.
const grpcHealthPrefix = "/grpc.health.v1.Health/"

// grpcHealthReading caps the health calls whose messages are being read at
// once, over the budget.
const grpcHealthReading = 16

// grpcMemory reserves the memory of gRPC calls in a budget.
type grpcMemory struct {
	budget  *MemoryBudget
	message int64 // the largest message a call may send
	reading int64 // what a call reserves while its message is read: message
	// stream is what a streaming call reserves for its life on a
	// connection that counts its messages as they arrive
	// (connReading.admitStream): GRPCStreamBytes.
	stream int64
	// bodyTimeout closes a connection whose call's message has not
	// arrived this long after its headers (limits.body_timeout; 0:
	// never), logged on logger.
	bodyTimeout time.Duration
	logger      *slog.Logger
	slow        *SlowClients // counts those closes

	// methods are the server's methods, set once the services are
	// registered: only their calls are reserved, since only they are
	// sure to end with a stats.End that gives the reservation back. The
	// value says whether the client streams messages.
	methods atomic.Pointer[map[string]bool]
	health  atomic.Int64 // health calls reserved now, over the budget
}

// newGRPCMemory reserves calls' memory in budget for messages of at most
// maxMessage bytes (<= 0: grpc-go's own cap) and headers of at most
// maxHeader bytes (grpc.MaxHeaderListSize; <= 0: grpc-go's default).
func newGRPCMemory(budget *MemoryBudget, maxMessage, maxHeader int64) *grpcMemory {
	m := &grpcMemory{budget: budget, message: maxMessage}
	if m.message <= 0 || m.message > math.MaxInt32 {
		m.message = math.MaxInt32 // grpc-go's own cap on a message
	}
	m.reading = m.message
	m.stream = GRPCStreamBytes(maxHeader)
	return m
}

// setMethods records the methods srv serves.
func (m *grpcMemory) setMethods(srv *grpc.Server) {
	methods := make(map[string]bool)
	for svc, info := range srv.GetServiceInfo() {
		for _, mi := range info.Methods {
			methods["/"+svc+"/"+mi.Name] = mi.IsClientStream
		}
	}
	m.methods.Store(&methods)
}

// reserve takes the memory of a call to method whose headers have arrived
// on the connection accounted by conn (nil: not accounted): for a unary
// call on an accounted connection what a message there is expected to take
// (connReading.admit), for a streaming call on a connection whose frames
// are followed its stream's buffers (connReading.admitStream), else the
// largest message it may send. A unary call (but a health check) also
// reserves, until it ends, what grpc-go holds of its headers, header
// bytes as HTTP/2 counts them (grpcHeaderBytes): a stream's are in its
// buffers. It returns ctx with the call's grpcCall, or errMemory.
func (m *grpcMemory) reserve(ctx context.Context, method string, conn *connReading, header int64) (context.Context, error) {
	if m == nil {
		return ctx, nil
	}
	methods := m.methods.Load()
	if methods == nil {
		return ctx, nil
	}
	streaming, known := (*methods)[method]
	if !known {
		return ctx, nil
	}
	call := &grpcCall{method: method}
	if conn != nil {
		call.readFrom = conn
	}
	switch {
	case m.budget == nil:
	case strings.HasPrefix(method, grpcHealthPrefix):
		if m.health.Add(1) > grpcHealthReading {
			m.health.Add(-1)
			return ctx, errMemoryHealth
		}
		var once sync.Once
		call.res = m.budget.force(m.reading, func() { once.Do(func() { m.health.Add(-1) }) })
		if conn != nil && !streaming {
			conn.await(call, m)
		}
	case conn != nil && !streaming:
		if err := conn.admit(call, m); err != nil {
			return ctx, err
		}
	default:
		counted := false
		if conn != nil {
			var err error
			if counted, err = conn.admitStream(call, m); err != nil {
				return ctx, err
			}
		}
		if counted {
			break
		}
		r, err := m.budget.Reserve(m.reading, "a gRPC message being read and decoded")
		if err != nil {
			return ctx, err
		}
		call.res = r
		if conn != nil {
			conn.configure(m) // for its messages' timeout
		}
	}
	if !streaming && m.budget != nil && header > 0 && !strings.HasPrefix(method, grpcHealthPrefix) {
		r, err := m.budget.Reserve(grpcHeaderHeld*header, "a gRPC call's headers")
		if err != nil {
			call.abandon()
			return ctx, err
		}
		call.headers = r
	}
	return context.WithValue(ctx, grpcCallKey{}, call), nil
}

// grpcHeaderHeld is how many times its headers' HTTP/2 size a call's
// headers take in grpc-go's decoded metadata, for its whole life: at most
// four (GRPCStreamBytes says why).
const grpcHeaderHeld = 4

// grpcHeaderBytes is the size of headers md as HTTP/2 counts them against
// a server's header list limit: each field's name and value and 32 bytes.
func grpcHeaderBytes(md metadata.MD) int64 {
	n := int64(0)
	for k, vs := range md {
		for _, v := range vs {
			n += int64(len(k) + len(v) + 32)
		}
	}
	return n
}

// grpcMemoryStats gives a call's reservations back when the call ends:
// its own, and that of the last ModelInferRequest the codec decoded for it
// if its handler did not take it. On a connection whose frames are
// followed, a call's own waits for its answer to be written (connWrites).
type grpcMemoryStats struct {
	codec *grpcDecodeCodec
	// write closes a connection that has answers to write and writes
	// nothing for limits.write_timeout.
	write writeLimit
}

var _ stats.Handler = grpcMemoryStats{}

func (grpcMemoryStats) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }
func (grpcMemoryStats) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}
func (grpcMemoryStats) HandleConn(context.Context, stats.ConnStats) {}
func (h grpcMemoryStats) HandleRPC(ctx context.Context, s stats.RPCStats) {
	call, _ := ctx.Value(grpcCallKey{}).(*grpcCall)
	if call == nil {
		return
	}
	switch s := s.(type) {
	case *stats.InHeader:
		call.header = int64(s.WireLength)
	case *stats.InPayload:
		if req, ok := s.Payload.(*inference.ModelInferRequest); ok {
			call.infer.Store(req)
		}
		if call.conn != nil {
			call.conn.finish(call, call.header, int64(s.WireLength))
		}
		if call.light {
			call.taking.Add(int64(s.WireLength)) // given back as RecvMsg returns (timedStream)
		}
	case *stats.OutPayload:
		if call.writes == nil {
			break
		}
		if call.followed {
			call.writes.queued(call.stream, int64(s.WireLength), h.write)
		}
	case *stats.End:
		if call.conn != nil {
			call.conn.finish(call, call.header, 0)
		}
		if call.readFrom != nil {
			// grpc-go's stream is in the context of the call's end.
			id, ok := grpcStreamID(ctx)
			call.readFrom.ended(call, id, ok)
		}
		// An answer still being written keeps its memory until it is.
		if call.followed {
			call.writes.ended(call.stream, call.res, h.write)
		} else {
			call.res.Release()
		}
		call.headers.Release()
		if req := call.infer.Swap(nil); req != nil {
			h.codec.discard(req)
		}
	}
}
