package api

import "sync/atomic"

// SlowClients counts what the server cut off because a client was too
// slow: a REST body or a gRPC call's message that did not arrive within
// limits.body_timeout (REST answers 408, gRPC closes the connection), and
// a response the client did not take within limits.write_timeout (the
// connection is closed). Each is logged at WARN too; the counts are what
// an operator graphs. A nil *SlowClients counts nothing.
type SlowClients struct {
	counts [len(slowProtocols)][len(slowLimits)]atomic.Int64
}

// The protocols and limits SlowClients counts, as their metric labels.
var (
	slowProtocols = [...]string{"rest", "grpc"}
	slowLimits    = [...]string{"body_timeout", "write_timeout"}
)

const (
	slowREST = iota
	slowGRPC
)

const (
	slowBody = iota
	slowWrite
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
// limit, at zero until it happens.
func (s *SlowClients) Counts() []SlowClientCount {
	var out []SlowClientCount
	for p, protocol := range slowProtocols {
		for l, limit := range slowLimits {
			c := &s.counts[p][l]
			out = append(out, SlowClientCount{protocol, limit, c.Load})
		}
	}
	return out
}
