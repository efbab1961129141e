package configs

import (
	"slices"
	"testing"
	"time"
)

func TestServerChanged(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(s *Server)
		want   []string
	}{
		{"nothing", func(*Server) {}, nil},
		{"empty list for none", func(s *Server) { s.StartupModels = nil }, nil},
		{"repositories", func(s *Server) { s.Repositories = append(s.Repositories, "more") }, []string{"repositories"}},
		{"nested and several, in file order", func(s *Server) {
			s.Log.Level = "debug"
			s.Listen.GRPC = ":9001"
			s.PollInterval = time.Second
			s.Limits.MaxRequestBytes = MiB
		}, []string{"listen.grpc", "poll_interval", "limits.max_request_bytes", "log.level"}},
		{"deep", func(s *Server) { s.Control.Profile.Runs = 7 }, []string{"control.profile.runs"}},
		{"not a setting", func(s *Server) { s.File = "other.yaml" }, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := DefaultServer(), DefaultServer()
			tc.change(b)
			if got := a.Changed(b); !slices.Equal(got, tc.want) {
				t.Errorf("Changed = %v, want %v", got, tc.want)
			}
			if got := b.Changed(a); !slices.Equal(got, tc.want) {
				t.Errorf("Changed the other way = %v, want %v", got, tc.want)
			}
		})
	}
}
