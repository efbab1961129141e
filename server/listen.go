package server

import (
	"fmt"
	"log/slog"
	"net"
	"net/http"
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
// to limits.max_connections (plus overflow health-only ones), exporting how
// many are open and how many were refused, labelled with name.
func listenLimited(name, addr string, lim configs.Limits, overflow int, reg prometheus.Registerer) (*api.LimitedListener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	l := api.NewLimitedListener(ln, lim.MaxConnections, overflow)
	labels := prometheus.Labels{"listener": name}
	open := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name:        "sloserve_connections_open",
		Help:        "Connections open on a listener, those over limits.max_connections that only answer health probes included.",
		ConstLabels: labels,
	}, func() float64 { return float64(l.Open()) })
	refused := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name:        "sloserve_connections_refused_total",
		Help:        "Connections closed as soon as they were accepted because the listener had limits.max_connections open (and its health-only overflow full).",
		ConstLabels: labels,
	}, func() float64 { return float64(l.Refused()) })
	for _, c := range []prometheus.Collector{open, refused} {
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

// newMemoryBudget is the server's memory budget for clients' traffic
// (limits.max_memory), with its use exported.
func newMemoryBudget(lim configs.Limits, reg prometheus.Registerer) (*api.MemoryBudget, error) {
	b := api.NewMemoryBudget(int64(lim.MaxMemory))
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
			Help: "limits.max_memory: the memory clients' requests and responses may hold at once.",
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
