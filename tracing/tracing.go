// Package tracing owns the server's OpenTelemetry traces: Triton's trace
// settings (trace_level, trace_rate, trace_count), which the trace extension
// reads and changes while the server runs, the sampler that applies them to
// each request, and the provider that exports the spans over OTLP/HTTP.
//
// The request path makes its spans through the OpenTelemetry API from the
// context it is handed (api: infer and answer; qos: queue and batch;
// runtime: runner); without a provider (tracing off) they are no-ops.
// Nothing here imports another sloserve package.
package tracing

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"sync"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// Triton's trace levels sloserve has: OFF traces nothing; TIMESTAMPS
// traces the sampled requests' stages.
const (
	LevelOff        = "OFF"
	LevelTimestamps = "TIMESTAMPS"
)

// ErrInvalid marks a trace setting that cannot be applied.
var ErrInvalid = errors.New("invalid trace setting")

// Values are Triton's trace settings.
type Values struct {
	Level string // LevelOff or LevelTimestamps
	Rate  int64  // one request in Rate is traced, >= 1
	Count int64  // requests still to trace; -1: no limit
}

// Change names the settings a request changes; nil leaves one as it is,
// Reset* sets it back to its value at start (Triton's null).
type Change struct {
	Level                             *string
	Rate, Count                       *int64
	ResetLevel, ResetRate, ResetCount bool
}

// Settings are the trace settings in force, shared by the sampler and the
// trace extension. The zero value is not usable; use NewSettings.
type Settings struct {
	start Values

	mu   sync.Mutex
	v    Values
	seen uint64 // requests offered to the sampler since the rate was set
}

// NewSettings starts at v, which must be valid.
func NewSettings(v Values) (*Settings, error) {
	if err := v.check(); err != nil {
		return nil, err
	}
	return &Settings{start: v, v: v}, nil
}

func (v Values) check() error {
	switch {
	case v.Level != LevelOff && v.Level != LevelTimestamps:
		return fmt.Errorf("%w: trace_level must be %s or %s, got %q", ErrInvalid, LevelOff, LevelTimestamps, v.Level)
	case v.Rate < 1:
		return fmt.Errorf("%w: trace_rate must be >= 1, got %d", ErrInvalid, v.Rate)
	case v.Count < -1:
		return fmt.Errorf("%w: trace_count must be >= 0, or -1 for no limit, got %d", ErrInvalid, v.Count)
	}
	return nil
}

// Get returns the settings in force.
func (s *Settings) Get() Values {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.v
}

// Update applies c, all of it or, when a value is invalid (ErrInvalid),
// none of it, and returns the settings after it. A new rate starts its
// count of requests again.
func (s *Settings) Update(c Change) (Values, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	next := s.v
	switch {
	case c.ResetLevel:
		next.Level = s.start.Level
	case c.Level != nil:
		next.Level = *c.Level
	}
	switch {
	case c.ResetRate:
		next.Rate = s.start.Rate
	case c.Rate != nil:
		next.Rate = *c.Rate
	}
	switch {
	case c.ResetCount:
		next.Count = s.start.Count
	case c.Count != nil:
		next.Count = *c.Count
	}
	if err := next.check(); err != nil {
		return s.v, err
	}
	if next.Rate != s.v.Rate {
		s.seen = 0
	}
	s.v = next
	return s.v, nil
}

// take decides whether the next request is traced: the level is on, its
// turn in the rate has come and the count is not spent (then it is spent
// by one).
func (s *Settings) take() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.v.Level == LevelOff || s.v.Count == 0 {
		return false
	}
	s.seen++
	if (s.seen-1)%uint64(s.v.Rate) != 0 {
		return false
	}
	if s.v.Count > 0 {
		s.v.Count--
	}
	return true
}

// sampler applies the settings to the root span of each request, whether
// or not the client sent a traceparent: a client's span becomes the
// parent, but the client's sampled flag does not decide.
type sampler struct{ s *Settings }

var _ sdktrace.Sampler = sampler{}

func (sm sampler) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	psc := trace.SpanContextFromContext(p.ParentContext)
	res := sdktrace.SamplingResult{Decision: sdktrace.Drop, Tracestate: psc.TraceState()}
	if sm.s.take() {
		res.Decision = sdktrace.RecordAndSample
	}
	return res
}

func (sm sampler) Description() string { return "TritonTraceSettings" }

// Sampler is the provider's sampler: a request's own spans follow its root
// span's decision, and a root span (with or without a client's parent) is
// decided by the settings.
func (s *Settings) Sampler() sdktrace.Sampler {
	root := sampler{s}
	return sdktrace.ParentBased(root,
		sdktrace.WithRemoteParentSampled(root),
		sdktrace.WithRemoteParentNotSampled(root))
}

// Options configure the provider.
type Options struct {
	// Endpoint is the OTLP/HTTP collector's base URL; traces go to
	// /v1/traces on it unless it names a path.
	Endpoint    string
	ServiceName string
	Version     string
}

// Provider exports the sampled requests' spans.
type Provider struct {
	tp     *sdktrace.TracerProvider
	closed atomic.Bool
}

// NewProvider builds a provider that exports to opts.Endpoint in batches,
// sampling by s. Nothing is sent until a span ends.
func NewProvider(ctx context.Context, opts Options, s *Settings) (*Provider, error) {
	u, err := url.Parse(opts.Endpoint)
	if err != nil {
		return nil, fmt.Errorf("tracing: endpoint: %w", err)
	}
	if u.Path == "" || u.Path == "/" {
		u.Path = "/v1/traces"
	}
	exp, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(u.String()))
	if err != nil {
		return nil, fmt.Errorf("tracing: OTLP exporter: %w", err)
	}
	res := resource.NewSchemaless(
		attribute.String("service.name", opts.ServiceName),
		attribute.String("service.version", opts.Version),
	)
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp),
		sdktrace.WithSampler(s.Sampler()),
		sdktrace.WithResource(res),
	)
	return &Provider{tp: tp}, nil
}

// TracerProvider is what the request path makes its spans with.
func (p *Provider) TracerProvider() trace.TracerProvider { return p.tp }

// Shutdown exports the spans still buffered and stops; later spans are
// dropped. It may be called more than once.
func (p *Provider) Shutdown(ctx context.Context) error {
	if p.closed.Swap(true) {
		return nil
	}
	return p.tp.Shutdown(ctx)
}
