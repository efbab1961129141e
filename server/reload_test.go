package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/qos"
)

func TestReloader(t *testing.T) {
	repo, other := t.TempDir(), t.TempDir()
	yaml := func(extra string) string {
		return fmt.Sprintf("repositories: [%q]\nmodel_control: poll\n%s", repo, extra)
	}
	var next string // what Load reads
	load := func() (*configs.Server, error) { return configs.ParseServer("server.yaml", []byte(next)) }

	start, err := configs.ParseServer("server.yaml", []byte(yaml("")))
	if err != nil {
		t.Fatal(err)
	}
	promReg := prometheus.NewRegistry()
	reg, err := models.New(models.Options{
		Repositories: start.Repositories, Control: models.ControlPoll, PollInterval: time.Hour,
		NewInstance: func(context.Context, models.InstanceSpec) (models.Instance, error) {
			return nil, errors.New("no instances in this test")
		},
		Registerer: promReg,
	})
	if err != nil {
		t.Fatal(err)
	}
	level := new(slog.LevelVar)
	gate := qos.NewGate(start.Limits.MaxInflightRequests, int64(start.Limits.MaxInflightBytes))
	rl, err := newReloader(Reloading{Load: load, LogLevel: level}, start, reg, gate, nil, promReg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	counts := func() (success, failure, lastOK, restart float64) {
		return testutil.ToFloat64(rl.metrics.reloads.WithLabelValues("success")),
			testutil.ToFloat64(rl.metrics.reloads.WithLabelValues("failure")),
			testutil.ToFloat64(rl.metrics.lastOK), testutil.ToFloat64(rl.metrics.restartRequired)
	}

	// Live keys apply; the others are reported, and stay as they run.
	next = yaml("poll_interval: 250ms\nlog: {level: debug}\nlimits: {max_inflight_requests: 7}\nlisten: {http: \":9100\"}\n")
	res, err := rl.reload()
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"poll_interval", "limits.max_inflight_requests", "log.level"}; !slices.Equal(res.Applied, want) {
		t.Errorf("applied %v, want %v", res.Applied, want)
	}
	if want := []string{"listen.http"}; !slices.Equal(res.RestartNeeded, want) {
		t.Errorf("restart needed %v, want %v", res.RestartNeeded, want)
	}
	cur := rl.current()
	if level.Level() != slog.LevelDebug || cur.PollInterval != 250*time.Millisecond ||
		cur.Limits.MaxInflightRequests != 7 || cur.Listen.HTTP != start.Listen.HTTP {
		t.Errorf("after reload: level %v, running %+v", level.Level(), cur)
	}
	if n, b := gate.Limits(); n != 7 || b != int64(start.Limits.MaxInflightBytes) {
		t.Errorf("after reload the gate's limits are %d requests, %d bytes; want 7, %d", n, b, start.Limits.MaxInflightBytes)
	}
	if s, f, ok, r := counts(); s != 1 || f != 0 || ok != 1 || r != 1 {
		t.Errorf("metrics: success %v failure %v last ok %v restart required %v", s, f, ok, r)
	}

	// The same file again: nothing new applies, the restart is still needed.
	res, err = rl.reload()
	if err != nil || len(res.Applied) != 0 || !slices.Equal(res.RestartNeeded, []string{"listen.http"}) {
		t.Errorf("second reload: %+v, %v", res, err)
	}

	// Invalid: nothing changes.
	for _, tc := range []struct{ name, yaml, want string }{
		{"bad value", yaml("poll_interval: 0s\n"), "server.yaml: poll_interval: must be > 0"},
		{"unknown key", yaml("pol_interval: 1s\n"), "pol_interval"},
		{"missing repository", fmt.Sprintf("repositories: [%q]\nmodel_control: poll\npoll_interval: 1s\n", filepath.Join(other, "missing")), "not a readable directory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			next = tc.yaml
			_, err := rl.reload()
			if !errors.Is(err, configs.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want configs.ErrInvalid saying %q", err, tc.want)
			}
			if cur := rl.current(); cur.PollInterval != 250*time.Millisecond || !slices.Equal(cur.Repositories, []string{repo}) {
				t.Errorf("a failed reload changed the running config: %+v", cur)
			}
			if _, _, ok, _ := counts(); ok != 0 {
				t.Error("sloserve_config_last_reload_successful is not 0 after a failure")
			}
		})
	}
	if _, f, _, _ := counts(); f != 3 {
		t.Errorf("failures = %v, want 3", f)
	}

	// A new repository list applies.
	next = fmt.Sprintf("repositories: [%q, %q]\nmodel_control: poll\npoll_interval: 250ms\nlog: {level: debug}\nlimits: {max_inflight_requests: 7}\n", repo, other)
	res, err = rl.reload()
	if err != nil || !slices.Equal(res.Applied, []string{"repositories"}) || len(res.RestartNeeded) != 0 {
		t.Errorf("repositories reload: %+v, %v", res, err)
	}
	if s, _, ok, r := counts(); s != 3 || ok != 1 || r != 0 {
		t.Errorf("after the fix: success %v last ok %v restart required %v", s, ok, r)
	}

	// Without a source, a reload fails clearly.
	bare, err := newReloader(Reloading{}, start, reg, gate, nil, prometheus.NewRegistry(), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bare.reload(); !errors.Is(err, configs.ErrInvalid) || !strings.Contains(err.Error(), "without a config source") {
		t.Errorf("reload without a source: %v", err)
	}
}
