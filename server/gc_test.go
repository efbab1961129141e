package server

import (
	"testing"

	"github.com/sloserve/sloserve/configs"
)

// The collector's settings come from limits.gc_percent unless the
// environment names them; a percentage above Go's 100 comes with a soft
// memory limit at the traffic's budget plus the server's own room.
func TestCollectorSettings(t *testing.T) {
	def := configs.DefaultServer().Limits
	for _, tc := range []struct {
		name        string
		gcPercent   int
		env         map[string]string
		wantPercent int
		wantLimit   int64
	}{
		{name: "default", gcPercent: def.GCPercent, wantPercent: 400, wantLimit: int64(def.MaxMemory) + 256<<20},
		{name: "GOGC set", gcPercent: 400, env: map[string]string{"GOGC": "200"}, wantPercent: -1, wantLimit: -1},
		{name: "GOMEMLIMIT set", gcPercent: 400, env: map[string]string{"GOMEMLIMIT": "1GiB"}, wantPercent: 400, wantLimit: -1},
		{name: "Go's own", gcPercent: 0, wantPercent: -1, wantLimit: -1},
		{name: "at Go's 100, no limit", gcPercent: 100, wantPercent: 100, wantLimit: -1},
	} {
		l := def
		l.GCPercent = tc.gcPercent
		percent, limit := collectorSettings(l, func(k string) string { return tc.env[k] })
		if percent != tc.wantPercent || limit != tc.wantLimit {
			t.Errorf("%s: percent %d, limit %d; want %d, %d", tc.name, percent, limit, tc.wantPercent, tc.wantLimit)
		}
	}
}
