package server

import (
	"strings"
	"testing"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/configs"
)

// TestConnMemoryPlan: the listeners' connections get their need out of
// limits.max_memory when it fits in a quarter, a quarter split in
// proportion (with a warning) when not, and a config error when a listener
// could not hold one connection.
func TestConnMemoryPlan(t *testing.T) {
	cfg := configs.DefaultServer()
	plans, total, warning, err := connMemoryPlan(cfg)
	if err != nil || warning != "" {
		t.Fatalf("default config: %v, warning %q", err, warning)
	}
	grpc, rest := plans["grpc"], plans["rest"]
	if grpc.holds() != int64(cfg.Limits.MaxConnections) || rest.holds() != int64(cfg.Limits.MaxConnections) {
		t.Fatalf("default config: grpc holds %d, rest %d connections, want %d each", grpc.holds(), rest.holds(), cfg.Limits.MaxConnections)
	}
	want := int64(cfg.Limits.MaxConnections)*(api.GRPCConnectionBytes+api.RESTConnectionBytes) +
		restOverflowConnections*api.RESTConnectionBytes + metricsMaxConnections*api.RESTConnectionBytes
	if total != want || total > int64(cfg.Limits.MaxMemory)/connShareDivisor {
		t.Fatalf("default config: connections take %d, want %d (within a quarter of %d)", total, want, cfg.Limits.MaxMemory)
	}

	// 64 MiB: the quarter holds fewer connections than max_connections.
	cfg.Limits.MaxMemory = 64 * configs.MiB
	plans, total, warning, err = connMemoryPlan(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if total > int64(cfg.Limits.MaxMemory)/connShareDivisor || total < int64(cfg.Limits.MaxMemory)/connShareDivisor-3*api.GRPCConnectionBytes {
		t.Fatalf("64 MiB: connections take %d, want just under a quarter (%d)", total, cfg.Limits.MaxMemory/connShareDivisor)
	}
	grpc, rest = plans["grpc"], plans["rest"]
	if grpc.holds() >= int64(cfg.Limits.MaxConnections) || grpc.holds() != rest.holds() || grpc.holds() < 1 {
		t.Fatalf("64 MiB: grpc holds %d, rest %d connections; want as many, fewer than %d", grpc.holds(), rest.holds(), cfg.Limits.MaxConnections)
	}
	if !strings.Contains(warning, "limits.max_connections") || !strings.Contains(warning, "grpc ") {
		t.Fatalf("64 MiB: warning %q, want one naming limits.max_connections and what each listener holds", warning)
	}

	// A budget too small for one connection per listener.
	cfg.Limits.MaxMemory = 1 * configs.MiB
	if _, _, _, err = connMemoryPlan(cfg); err == nil || !strings.Contains(err.Error(), "limits.max_memory") {
		t.Fatalf("1 MiB: %v, want an error naming limits.max_memory", err)
	}
}
