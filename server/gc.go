package server

import (
	"log/slog"
	"os"
	"runtime/debug"
	"runtime/metrics"

	"github.com/sloserve/sloserve/configs"
)

// serverOwnMemory is the server process's memory beside its clients'
// traffic (limits.max_memory): what the deploy manifests leave it
// (deploy_test.go), and the room the collector's soft limit gives past
// the traffic's budget.
const serverOwnMemory = 256 << 20

// collectorSettings is what the server sets its Go collector to from the
// config: the GOGC percentage and the soft memory limit in bytes, -1 for
// a setting left as the process has it (GOGC or GOMEMLIMIT in getenv, or
// limits.gc_percent 0). A limit is set only with a percentage above Go's
// 100, to hold the larger heap it allows within the memory the server
// plans for.
func collectorSettings(l configs.Limits, getenv func(string) string) (percent int, limit int64) {
	percent, limit = -1, -1
	if getenv("GOGC") == "" && l.GCPercent > 0 {
		percent = l.GCPercent
	}
	if getenv("GOMEMLIMIT") == "" && percent > 100 {
		limit = int64(l.MaxMemory) + serverOwnMemory
	}
	return percent, limit
}

// setCollector applies collectorSettings to this process and says so.
func setCollector(l configs.Limits, log *slog.Logger) {
	percent, limit := collectorSettings(l, os.Getenv)
	if percent > 0 {
		debug.SetGCPercent(percent)
	}
	if limit > 0 {
		debug.SetMemoryLimit(limit)
	}
	// Read back through runtime/metrics: debug.SetGCPercent(-1) would turn
	// the collector off.
	got := []metrics.Sample{{Name: "/gc/gogc:percent"}, {Name: "/gc/gomemlimit:bytes"}}
	metrics.Read(got)
	from := "the environment or Go's default"
	if percent > 0 {
		from = "limits.gc_percent"
	}
	log.Info("Go collector", "gc_percent", got[0].Value.Uint64(), "soft_memory_limit_bytes", got[1].Value.Uint64(), "from", from)
}
