package server

import (
	"context"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/tracing"
)

// serverTracing is the trace settings and, when tracing.endpoint is set,
// the provider that exports the spans.
type serverTracing struct {
	settings *tracing.Settings // nil: tracing off
	provider *tracing.Provider
	log      *slog.Logger
}

// startTracing builds the tracing of cfg; with no endpoint it is off (no
// spans, no trace extension).
func startTracing(ctx context.Context, cfg configs.Tracing, version string, log *slog.Logger) (*serverTracing, error) {
	t := &serverTracing{log: log.With("component", "tracing")}
	if cfg.Endpoint == "" {
		return t, nil
	}
	st, err := tracing.NewSettings(tracing.Values{Level: tracing.LevelTimestamps, Rate: cfg.Rate, Count: cfg.Count})
	if err != nil {
		return nil, err
	}
	p, err := tracing.NewProvider(ctx, tracing.Options{Endpoint: cfg.Endpoint, ServiceName: cfg.ServiceName, Version: version}, st)
	if err != nil {
		return nil, err
	}
	t.settings, t.provider = st, p
	t.log.Info("tracing requests", "endpoint", cfg.Endpoint, "rate", cfg.Rate, "count", cfg.Count)
	return t, nil
}

// tracer is what the api makes spans with; nil when tracing is off.
func (t *serverTracing) tracer() trace.TracerProvider {
	if t.provider == nil {
		return nil
	}
	return t.provider.TracerProvider()
}

// stop exports the spans still buffered, waiting at most grace.
func (t *serverTracing) stop(grace time.Duration) {
	if t.provider == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), max(grace, time.Second))
	defer cancel()
	if err := t.provider.Shutdown(ctx); err != nil {
		t.log.Warn("exporting the last spans", "err", err)
	}
}
