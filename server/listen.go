package server

import (
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/configs"
)

// restOverflowConnections is how many connections past limits.max_connections
// a REST listener still accepts to answer health probes on.
const restOverflowConnections = 64

// listenLimited listens on addr and limits the listener's open connections
// to limits.max_connections (plus overflow health-only ones) and their
// buffers to the listener's share of limits.max_memory (plan), exporting
// how many are open, how many were refused and the memory they hold,
// labelled with name.
func listenLimited(name, addr string, lim configs.Limits, overflow int, plan connMemory, reg prometheus.Registerer, logger *slog.Logger) (*api.LimitedListener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	l := api.NewLimitedListener(ln, lim.MaxConnections, overflow)
	l.ReserveMemory(api.NewMemoryBudget(plan.reserve), plan.perConn, logger)
	labels := prometheus.Labels{"listener": name}
	open := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name:        "sloserve_connections_open",
		Help:        "Connections open on a listener, those over limits.max_connections that only answer health probes included.",
		ConstLabels: labels,
	}, func() float64 { return float64(l.Open()) })
	refused := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name:        "sloserve_connections_refused_total",
		Help:        "Connections closed as soon as they were accepted because the listener had limits.max_connections open, or their buffers did not fit in its share of limits.max_memory (and its health-only overflow was full).",
		ConstLabels: labels,
	}, func() float64 { return float64(l.Refused()) })
	memRefused := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name:        "sloserve_connections_refused_memory_total",
		Help:        "Connections refused (or taken as health-only overflow ones on REST) because their buffers did not fit in the listener's share of limits.max_memory; counted in sloserve_connections_refused_total too when closed.",
		ConstLabels: labels,
	}, func() float64 { return float64(l.MemoryRefused()) })
	memReserved := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name:        "sloserve_connections_memory_reserved_bytes",
		Help:        "Memory the listener's open connections hold reserved for their buffers, out of sloserve_connections_memory_limit_bytes.",
		ConstLabels: labels,
	}, func() float64 { return float64(l.MemoryReserved()) })
	memLimit := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name:        "sloserve_connections_memory_limit_bytes",
		Help:        "The listener's share of limits.max_memory for its connections' buffers, its health-only overflow ones included.",
		ConstLabels: labels,
	}, func() float64 { return float64(plan.total()) })
	for _, c := range []prometheus.Collector{open, refused, memRefused, memReserved, memLimit} {
		if err := reg.Register(c); err != nil {
			ln.Close()
			return nil, fmt.Errorf("connection metrics: %w", err)
		}
	}
	return l, nil
}

// newRESTServer is the REST listener's http.Server with the configured
// header, idle and size limits. The body's own deadline
// (limits.body_timeout) is set by the handler, not here: http.Server's
// ReadTimeout would also end the requests that run longer than it. The
// server's own complaints about connections (failed TLS handshakes from
// scanners or plain-HTTP clients, broken requests) go to logger at debug.
func newRESTServer(h http.Handler, lim configs.Limits, ln *api.LimitedListener, logger *slog.Logger) *http.Server {
	return &http.Server{
		Handler:           h,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelDebug),
		ReadHeaderTimeout: lim.HeaderTimeout,
		IdleTimeout:       lim.IdleTimeout,
		MaxHeaderBytes:    int(lim.MaxHeaderBytes),
		ConnContext:       ln.ConnContext,
		// HTTP/2 (over TLS) keeps the buffer of the largest frame read
		// for the connection's life: api.RESTHTTP2Bytes counts it.
		HTTP2: &http.HTTP2Config{MaxReadFrameSize: api.RESTMaxReadFrameSize},
	}
}

// grpcLimitOptions are the gRPC server's limits: calls per connection,
// handshake time, metadata size, keepalive enforcement and idle connections.
func grpcLimitOptions(lim configs.Limits) []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.MaxConcurrentStreams(uint32(lim.GRPCMaxStreams)),
		grpc.ConnectionTimeout(lim.GRPCConnectionTimeout),
		grpc.MaxHeaderListSize(uint32(lim.MaxHeaderBytes)),
		// Pings are allowed without calls in progress (many clients keep
		// idle connections alive), but no more often than MinTime.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
			MinTime:             lim.GRPCKeepaliveMinTime,
			PermitWithoutStream: true,
		}),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: lim.IdleTimeout}),
	}
}

// metricsMaxConnections caps the metrics listener's open connections: its
// clients are a few scrapers, and each connection held open is a file
// descriptor the runners need too. Past it, new connections are closed at
// once.
const metricsMaxConnections = 64

// metricsHeaderTimeout bounds reading a scrape's request line and headers.
const metricsHeaderTimeout = 10 * time.Second

// newMetricsServer is the metrics listener's http.Server: header and idle
// timeouts as on REST, and a write timeout, so that neither an idle nor a
// stalled scraper holds its connection for ever.
func newMetricsServer(h http.Handler, lim configs.Limits) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: min(lim.HeaderTimeout, metricsHeaderTimeout),
		IdleTimeout:       lim.IdleTimeout,
		WriteTimeout:      lim.WriteTimeout,
	}
}

// newMemoryBudget is the server's memory budget for clients' requests and
// responses: limits.max_memory less the connections' share (connections),
// with its use exported.
func newMemoryBudget(lim configs.Limits, connections int64, reg prometheus.Registerer) (*api.MemoryBudget, error) {
	b := api.NewMemoryBudget(int64(lim.MaxMemory) - connections)
	for _, c := range []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "sloserve_memory_reserved_bytes",
			Help: "Memory reserved now by clients' requests and responses (bodies and messages being read, their decoded forms, responses), out of limits.max_memory.",
		}, func() float64 { return float64(b.Used()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "sloserve_memory_reserved_peak_bytes",
			Help: "The most memory clients' requests and responses held reserved at once since the start.",
		}, func() float64 { return float64(b.Peak()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "sloserve_memory_limit_bytes",
			Help: "The memory clients' requests and responses may hold at once: limits.max_memory less the connections' share (sloserve_connections_memory_limit_bytes).",
		}, func() float64 { return float64(b.Limit()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "sloserve_memory_refused_total",
			Help: "Requests, messages and responses refused because their memory did not fit in limits.max_memory.",
		}, func() float64 { return float64(b.Refused()) }),
	} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("memory metrics: %w", err)
		}
	}
	return b, nil
}

// newSlowClients counts what the server cuts off because a client was
// too slow (api.SlowClients), exported as
// sloserve_slow_clients_total{protocol, limit}.
func newSlowClients(reg prometheus.Registerer) (*api.SlowClients, error) {
	s := api.NewSlowClients()
	for _, c := range s.Counts() {
		m := prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "sloserve_slow_clients_total",
			Help:        "Clients cut off for slowness: a REST body (answered 408) or a gRPC call's message (its connection closed) that did not arrive within limits.body_timeout, a response not taken within limits.write_timeout (its connection closed), a connection whose REST request headers did not arrive within limits.header_timeout or whose gRPC HTTP/2 preface did not within limits.grpc_connection_timeout (a TLS handshake included; closed).",
			ConstLabels: prometheus.Labels{"protocol": c.Protocol, "limit": c.Limit},
		}, func() float64 { return float64(c.Count()) })
		if err := reg.Register(m); err != nil {
			return nil, fmt.Errorf("slow clients' metrics: %w", err)
		}
	}
	return s, nil
}

// Connections' memory.
//
// Every connection a listener accepts holds buffers for its whole life
// (api.ConnectionBytes: 192 KiB for gRPC, 24 KiB for REST), whatever it
// sends: 4,096 idle gRPC connections hold 768 MiB. They are counted in
// limits.max_memory as a share of their own, set aside at start: each
// listener gets (max_connections + its health-only overflow) x its
// connection's bytes, and clients' requests and responses get the rest.
// A separate share, not one pool, so that neither starves the other: a
// flood of idle connections cannot take the memory requests need, and
// requests filling their budget cannot stop a health probe's connection.
//
// The share is at most a quarter of limits.max_memory
// (connShareDivisor). When the listeners' connections need more (a small
// max_memory beside the default max_connections), the share is a
// quarter, split over the listeners in proportion to their need (but the
// metrics listener's, whose 64 connections are its own bound), and a
// warning at start says how many connections each can then hold: past
// them, new connections are refused for memory (REST: taken as
// health-only overflow connections while those are free). A share too
// small for one connection per listener is a config error.

// connShareDivisor: the connections' buffers take at most this fraction of
// limits.max_memory.
const connShareDivisor = 4

// connMemory is one listener's share of limits.max_memory.
type connMemory struct {
	name     string
	conns    int   // normal connections (limits.max_connections)
	overflow int   // health-only ones, never refused for memory
	fixed    bool  // conns is small and fixed: never clamped (metrics)
	perConn  int64 // one connection's bytes
	reserve  int64 // what its normal connections may hold
}

// total is the listener's share, its overflow connections' included.
func (c connMemory) total() int64 { return c.reserve + int64(c.overflow)*c.perConn }

// holds is how many normal connections fit in the share.
func (c connMemory) holds() int64 {
	if c.perConn <= 0 {
		return 0
	}
	return c.reserve / c.perConn
}

// planConnMemory splits the connections' share of maxMemory over the
// listeners (name, connections, overflow, bytes each). It returns the
// share of each, in the order given, their sum, and a warning when the
// share was clamped (their connections need more than a quarter of
// maxMemory); an error when a listener cannot hold one connection.
func planConnMemory(maxMemory int64, listeners []connMemory) (plans []connMemory, total int64, warning string, err error) {
	limit := maxMemory / connShareDivisor
	var fixed, normal int64
	for _, l := range listeners {
		fixed += int64(l.overflow) * l.perConn
		if l.fixed {
			fixed += int64(l.conns) * l.perConn
		} else {
			normal += int64(l.conns) * l.perConn
		}
	}
	plans = make([]connMemory, len(listeners))
	if fixed+normal <= limit {
		for i, l := range listeners {
			l.reserve = int64(l.conns) * l.perConn
			plans[i] = l
			total += l.total()
		}
		return plans, total, "", nil
	}
	if fixed > limit {
		return nil, 0, "", fmt.Errorf("limits.max_memory: a quarter of it (%d bytes) does not hold the buffers of the health-only and metrics connections (%d bytes); raise limits.max_memory", limit, fixed)
	}
	scale := float64(limit-fixed) / float64(normal)
	var held []string
	for i, l := range listeners {
		n := int64(max(0, float64(l.conns)*scale))
		if l.fixed {
			n = int64(l.conns)
		}
		if n < 1 {
			return nil, 0, "", fmt.Errorf("limits.max_memory: a quarter of it (%d bytes) holds the buffers of no connection on the %s listener (%d bytes each, %d bytes for all of limits.max_connections on every listener); raise limits.max_memory or lower limits.max_connections",
				limit, l.name, l.perConn, fixed+normal)
		}
		l.reserve = n * l.perConn
		plans[i] = l
		total += l.total()
		held = append(held, fmt.Sprintf("%s %d", l.name, n))
	}
	warning = fmt.Sprintf("limits.max_connections: the connections' buffers (%d bytes for all listeners) do not fit in a quarter of limits.max_memory (%d bytes); listeners hold at most %s connections, and refuse more",
		fixed+normal, limit, strings.Join(held, ", "))
	return plans, total, warning, nil
}

// connMemoryPlan is planConnMemory for the listeners cfg opens.
func connMemoryPlan(cfg *configs.Server) (map[string]connMemory, int64, string, error) {
	tls := cfg.TLS.Enabled()
	var ls []connMemory
	if cfg.Listen.HTTP != "" {
		ls = append(ls, connMemory{name: "rest", conns: cfg.Limits.MaxConnections, overflow: restOverflowConnections, perConn: api.ConnectionBytes("rest", tls)})
	}
	if cfg.Listen.GRPC != "" {
		ls = append(ls, connMemory{name: "grpc", conns: cfg.Limits.MaxConnections, perConn: api.ConnectionBytes("grpc", tls)})
	}
	if cfg.Listen.Metrics != "" {
		ls = append(ls, connMemory{name: "metrics", conns: metricsMaxConnections, fixed: true, perConn: api.ConnectionBytes("metrics", tls && cfg.TLS.Metrics)})
	}
	if cfg.Listen.ModelMesh != "" {
		ls = append(ls, connMemory{name: "modelmesh", conns: cfg.Limits.MaxConnections, perConn: api.ConnectionBytes("modelmesh", false)})
	}
	plans, total, warning, err := planConnMemory(int64(cfg.Limits.MaxMemory), ls)
	if err != nil {
		return nil, 0, "", err
	}
	m := make(map[string]connMemory, len(plans))
	for _, p := range plans {
		m[p.name] = p
	}
	return m, total, warning, nil
}
