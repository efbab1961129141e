package api

import "sync/atomic"

// SlowClients counts what the server cut off because a client was too
// slow: a REST body or a gRPC call's message that did not arrive within
// limits.body_timeout (REST answers 408, gRPC closes the connection), a
// response the client did not take within limits.write_timeout (the
// connection is closed), and a connection whose start did not arrive in
// time (REST: its request line and headers within limits.header_timeout;
// gRPC: its HTTP/2 preface within limits.grpc_connection_timeout; a TLS
// handshake on either; the connection is closed). Each is logged at WARN
// too (a connection's start at most once a second); the counts are what
// an operator graphs. A nil *SlowClients counts nothing.
type SlowClients struct {
	counts [len(slowProtocols)][len(slowLimits)]atomic.Int64
}

// The protocols and limits SlowClients counts, as their metric labels.
var (
	slowProtocols = [...]string{"rest", "grpc"}
	slowLimits    = [...]string{"body_timeout", "write_timeout", "header_timeout", "grpc_connection_timeout"}
)

// slowCounted says which limits each protocol has: a connection's start
// is limits.header_timeout's on REST, limits.grpc_connection_timeout's on
// gRPC.
var slowCounted = [len(slowProtocols)][len(slowLimits)]bool{
	slowREST: {slowBody: true, slowWrite: true, slowHeaders: true},
	slowGRPC: {slowBody: true, slowWrite: true, slowHandshake: true},
}

const (
	slowREST = iota
	slowGRPC
)

const (
	slowBody = iota
	slowWrite
	slowHeaders   // REST: limits.header_timeout
	slowHandshake // gRPC: limits.grpc_connection_timeout
)

// NewSlowClients is a SlowClients at zero.
func NewSlowClients() *SlowClients { return &SlowClients{} }

// add counts one client of protocol cut off at limit.
func (s *SlowClients) add(protocol, limit int) {
	if s != nil {
		s.counts[protocol][limit].Add(1)
	}
}

// SlowClientCount is one of SlowClients' counts, labelled.
type SlowClientCount struct {
	Protocol, Limit string
	// Count reads the count now.
	Count func() int64
}

// Counts are every count s keeps, for the metrics: each protocol at each
// of its limits, at zero until it happens.
func (s *SlowClients) Counts() []SlowClientCount {
	var out []SlowClientCount
	for p, protocol := range slowProtocols {
		for l, limit := range slowLimits {
			if !slowCounted[p][l] {
				continue
			}
			c := &s.counts[p][l]
			out = append(out, SlowClientCount{protocol, limit, c.Load})
		}
	}
	return out
}
