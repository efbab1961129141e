package server

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/configs"
)

// security wires the tls and auth sections: TLS listeners whose
// certificate follows its files, and the access control of the api package.
type security struct {
	auth *api.Auth
	tls  *certFiles // nil: plain TCP
	cfg  configs.TLS
	// listenHost is the listen.http host (a restart changes it), which
	// admin calls may name in Host.
	listenHost string
}

func newSecurity(cfg *configs.Server, reg prometheus.Registerer, logger *slog.Logger) (*security, error) {
	listenHost, _, _ := net.SplitHostPort(cfg.Listen.HTTP)
	opts, err := authOptions(cfg.Auth, listenHost)
	if err != nil {
		return nil, err
	}
	auth, err := api.NewAuth(opts, reg, logger.With("component", "auth"))
	if err != nil {
		return nil, err
	}
	s := &security{auth: auth, cfg: cfg.TLS, listenHost: listenHost}
	if (opts.InferenceToken != "" || opts.AdminToken != "") && !cfg.TLS.Enabled() {
		logger.Warn("bearer tokens are configured but the listeners do not speak TLS: tokens cross the network in clear text unless a TLS proxy terminates in front; set tls.cert_file and tls.key_file")
	}
	if cfg.TLS.Enabled() {
		if s.tls, err = newCertFiles(cfg.TLS, reg, logger.With("component", "tls")); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// authOptions reads the tokens of an auth section; the host names admin
// calls may name are its allowed_hosts and the listen host.
func authOptions(a configs.Auth, listenHost string) (api.AuthOptions, error) {
	inference, admin, err := a.Tokens()
	if err != nil {
		return api.AuthOptions{}, err
	}
	hosts := slices.Clone(a.AllowedHosts)
	if listenHost != "" {
		hosts = append(hosts, listenHost)
	}
	return api.AuthOptions{
		InferenceToken: inference, AdminToken: admin,
		RequireTokenForHealth: a.RequireTokenForHealth, RequireTokenForMetrics: a.RequireTokenForMetrics,
		AllowedHosts: hosts,
	}, nil
}

// listener wraps ln in TLS offering protos (ALPN) when TLS is on.
func (s *security) listener(ln net.Listener, protos ...string) net.Listener {
	if s.tls == nil {
		return ln
	}
	return tls.NewListener(ln, s.tls.serverConfig(protos...))
}

// metricsListener is listener for the metrics port, TLS only with
// tls.metrics.
func (s *security) metricsListener(ln net.Listener) net.Listener {
	if !s.cfg.Metrics {
		return ln
	}
	return s.listener(ln, "http/1.1")
}

// grpcOptions are the gRPC server's transport credentials and access
// control interceptors.
func (s *security) grpcOptions() []grpc.ServerOption {
	opts := s.auth.ServerOptions()
	var tc credentials.TransportCredentials
	if s.tls != nil {
		tc = credentials.NewTLS(s.tls.serverConfig("h2"))
	}
	// The connections' frames are followed, so that answers a client
	// does not read are reserved and cut off (limits.write_timeout).
	return append(opts, grpc.Creds(api.GRPCCredentials(tc)))
}

// prepare reads a reloaded auth section's tokens from their files again,
// before anything of the reload is applied, as it may fail.
func (s *security) prepare(next configs.Auth) (api.AuthOptions, error) {
	opts, err := authOptions(next, s.listenHost)
	if err != nil {
		return opts, fmt.Errorf("auth: %w", err)
	}
	return opts, nil
}

// apply puts prepared auth options in effect and has the certificate
// files looked at on the next handshake.
func (s *security) apply(opts api.AuthOptions) {
	s.auth.Set(opts)
	if s.tls != nil {
		s.tls.recheck()
	}
}

// certCheckInterval is the least time between two looks at the
// certificate files' modification times.
const certCheckInterval = time.Second

// certFiles holds the server certificate and the client CAs and reads their
// files again when they change: on a handshake, at most once per
// certCheckInterval, their size and modification time are compared with
// the last read. A pair that does not load is logged and counted, and the
// one before keeps serving.
type certFiles struct {
	cfg    configs.TLS
	log    *slog.Logger
	expiry prometheus.Gauge
	loads  *prometheus.CounterVec
	// every is the least time between two looks at the files.
	every time.Duration

	mu      sync.Mutex
	checked time.Time
	stamps  []fileStamp
	cert    *tls.Certificate
	pool    *x509.CertPool
}

type fileStamp struct {
	size int64
	mod  time.Time
	err  bool
}

func newCertFiles(cfg configs.TLS, reg prometheus.Registerer, log *slog.Logger) (*certFiles, error) {
	f := &certFiles{
		cfg: cfg, log: log, every: certCheckInterval,
		expiry: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "sloserve_tls_certificate_expiry_timestamp_seconds",
			Help: "When the server certificate in use expires (Unix seconds).",
		}),
		loads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sloserve_tls_certificate_reloads_total",
			Help: "Reads of the certificate files after they changed, by result: success, or failure (the previous certificate keeps serving).",
		}, []string{"result"}),
	}
	if err := reg.Register(f.expiry); err != nil {
		return nil, errors.Join(errors.New("server: registering TLS metrics"), err)
	}
	if err := reg.Register(f.loads); err != nil {
		return nil, errors.Join(errors.New("server: registering TLS metrics"), err)
	}
	f.loads.WithLabelValues("success")
	f.loads.WithLabelValues("failure")
	f.stamps = f.stat()
	if err := f.load(); err != nil {
		return nil, err
	}
	f.checked = time.Now()
	return f, nil
}

func (f *certFiles) files() []string {
	files := []string{f.cfg.CertFile, f.cfg.KeyFile}
	if f.cfg.ClientCAFile != "" {
		files = append(files, f.cfg.ClientCAFile)
	}
	return files
}

func (f *certFiles) stat() []fileStamp {
	var out []fileStamp
	for _, name := range f.files() {
		st, err := os.Stat(name)
		if err != nil {
			out = append(out, fileStamp{err: true})
			continue
		}
		out = append(out, fileStamp{size: st.Size(), mod: st.ModTime()})
	}
	return out
}

// load reads the files; the caller holds mu (or owns f).
func (f *certFiles) load() error {
	cert, err := configs.LoadKeyPair(f.cfg.CertFile, f.cfg.KeyFile)
	if err != nil {
		return fmt.Errorf("tls.cert_file: %w", err)
	}
	var pool *x509.CertPool
	if f.cfg.ClientCAFile != "" {
		if pool, err = configs.LoadCertPool(f.cfg.ClientCAFile); err != nil {
			return fmt.Errorf("tls.client_ca_file: %w", err)
		}
	}
	f.cert, f.pool = cert, pool
	if leaf := cert.Leaf; leaf != nil {
		f.expiry.Set(float64(leaf.NotAfter.Unix()))
		f.log.Info("TLS certificate loaded", "file", f.cfg.CertFile, "subject", leaf.Subject.String(),
			"dns_names", leaf.DNSNames, "ip_addresses", leaf.IPAddresses, "not_after", leaf.NotAfter)
		if time.Now().After(leaf.NotAfter) {
			f.log.Warn("the TLS certificate has expired", "file", f.cfg.CertFile, "not_after", leaf.NotAfter)
		}
	}
	return nil
}

// recheck has the next handshake look at the files.
func (f *certFiles) recheck() {
	f.mu.Lock()
	f.checked = time.Time{}
	f.mu.Unlock()
}

// current returns the certificate and CAs in effect, reading the files
// again when they changed.
func (f *certFiles) current() (*tls.Certificate, *x509.CertPool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if now := time.Now(); now.Sub(f.checked) >= f.every {
		f.checked = now
		if stamps := f.stat(); !sameStamps(stamps, f.stamps) {
			f.stamps = stamps
			if err := f.load(); err != nil {
				f.loads.WithLabelValues("failure").Inc()
				f.log.Error("TLS files changed but do not load; the previous certificate keeps serving", "err", err)
			} else {
				f.loads.WithLabelValues("success").Inc()
			}
		}
	}
	return f.cert, f.pool
}

func sameStamps(a, b []fileStamp) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].size != b[i].size || !a[i].mod.Equal(b[i].mod) || a[i].err != b[i].err {
			return false
		}
	}
	return true
}

// serverConfig is the TLS config of one listener: every handshake gets the
// current certificate and client CAs.
func (f *certFiles) serverConfig(protos ...string) *tls.Config {
	var clientAuth tls.ClientAuthType
	switch f.cfg.ClientAuthMode() {
	case configs.ClientAuthRequest:
		clientAuth = tls.VerifyClientCertIfGiven
	case configs.ClientAuthRequire:
		clientAuth = tls.RequireAndVerifyClientCert
	}
	minVersion := f.cfg.MinTLSVersion()
	return &tls.Config{
		MinVersion: minVersion,
		NextProtos: protos,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			cert, pool := f.current()
			return &tls.Config{
				MinVersion:   minVersion,
				NextProtos:   protos,
				Certificates: []tls.Certificate{*cert},
				ClientAuth:   clientAuth,
				ClientCAs:    pool,
			}, nil
		},
	}
}
