package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/qos"
)

// Reloading says how a running server rereads its config: on every value
// from Signals (SIGHUP) and on POST /v2/config/reload.
type Reloading struct {
	// Load reads the config again from the sources it came from at start
	// (file or embedded default, environment, flags) and validates it.
	// Nil makes every reload fail.
	Load func() (*configs.Server, error)
	// Signals asks for a reload on each receive; nil asks for none.
	Signals <-chan os.Signal
	// LogLevel is the level of the server's logger, which a reload sets;
	// nil makes log.level a setting that needs a restart.
	LogLevel *slog.LevelVar
}

// liveKeys are the settings a reload applies while the server runs. Any
// other changed key takes effect at the next start.
var liveKeys = []string{
	"repositories",
	"poll_interval",
	"limits.max_inflight_requests",
	"limits.max_inflight_bytes",
	"limits.grace_period",
	"log.level",
	"auth.inference_token_file",
	"auth.admin_token_file",
	"auth.inference_token",
	"auth.admin_token",
	"auth.require_token_for_health",
	"auth.require_token_for_metrics",
	"auth.allowed_hosts",
}

// reloader applies config reloads, one at a time. It keeps the settings in
// effect: the start's, with the live keys of later reloads, so a key that
// needs a restart is reported by every reload until the restart.
type reloader struct {
	opts    Reloading
	reg     *models.Registry
	gate    *qos.Gate // the schedulers' limits on requests in flight
	log     *slog.Logger
	metrics *reloadMetrics
	// security, when set, rereads the tokens on every reload (their files
	// may have changed under the same names) and the certificates.
	security *security

	mu      sync.Mutex
	running *configs.Server
}

func newReloader(opts Reloading, cfg *configs.Server, reg *models.Registry, gate *qos.Gate, sec *security, promReg prometheus.Registerer, log *slog.Logger) (*reloader, error) {
	m, err := newReloadMetrics(promReg)
	if err != nil {
		return nil, err
	}
	running := *cfg
	return &reloader{opts: opts, reg: reg, gate: gate, security: sec, log: log, metrics: m, running: &running}, nil
}

// current returns the settings in effect.
func (rl *reloader) current() configs.Server {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	return *rl.running
}

// watch reloads on each signal until ctx ends.
func (rl *reloader) watch(ctx context.Context) {
	if rl.opts.Signals == nil {
		return
	}
	for {
		select {
		case <-ctx.Done():
			return
		case sig := <-rl.opts.Signals:
			rl.log.Info("rereading the config", "signal", sig.String())
			_, _ = rl.reload() // the outcome is logged and counted
		}
	}
}

// reload reads the config again and applies what can change while the
// server runs: the repositories (followed by a pass over them), the poll
// interval, the in-flight limit, the grace period and the log level. In
// poll and none modes it also asks the registry for a pass over the
// repositories at once, so model folders changed on disk load, reload or
// unload now. An invalid config, or a repository that is not a readable
// directory, changes nothing; the error wraps configs.ErrInvalid.
func (rl *reloader) reload() (api.ReloadResult, error) {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	res, err := rl.apply()
	if err != nil {
		if !errors.Is(err, configs.ErrInvalid) {
			err = fmt.Errorf("%w: %w", configs.ErrInvalid, err)
		}
		rl.metrics.reloads.WithLabelValues("failure").Inc()
		rl.metrics.lastOK.Set(0)
		rl.log.Error("config reload failed; nothing changed", "err", err)
		return api.ReloadResult{}, err
	}
	rl.metrics.reloads.WithLabelValues("success").Inc()
	rl.metrics.lastOK.Set(1)
	rl.metrics.lastSuccess.SetToCurrentTime()
	restart := 0.0
	for _, key := range res.RestartNeeded {
		restart = 1
		rl.log.Warn("config change needs a restart to take effect; the running value stays", "key", key)
	}
	rl.metrics.restartRequired.Set(restart)
	rl.log.Info("config reloaded", "applied", res.Applied, "restart_needed", res.RestartNeeded)
	rl.reg.Rescan()
	return res, nil
}

// apply reads the config and puts the live keys that changed in effect.
// The caller holds mu.
func (rl *reloader) apply() (api.ReloadResult, error) {
	res := api.ReloadResult{Applied: []string{}, RestartNeeded: []string{}}
	if rl.opts.Load == nil {
		return res, errors.New("this server was started without a config source to reread")
	}
	next, err := rl.opts.Load()
	if err != nil {
		return res, err
	}
	for _, key := range rl.running.Changed(next) {
		live := slices.Contains(liveKeys, key) && (key != "log.level" || rl.opts.LogLevel != nil) &&
			(!strings.HasPrefix(key, "auth.") || rl.security != nil)
		if live {
			res.Applied = append(res.Applied, key)
		} else {
			res.RestartNeeded = append(res.RestartNeeded, key)
		}
	}
	// The changes that can still fail go first.
	var auth api.AuthOptions
	if rl.security != nil {
		if auth, err = rl.security.prepare(next.Auth); err != nil {
			return res, fmt.Errorf("%s: %w", next.File, err)
		}
	}
	if slices.Contains(res.Applied, "repositories") {
		if err := rl.reg.SetRepositories(next.Repositories); err != nil {
			return res, fmt.Errorf("%s: repositories: %w", next.File, err)
		}
	}
	r := rl.running
	if rl.security != nil {
		rl.security.apply(auth)
		r.Auth = next.Auth
	}
	for _, key := range res.Applied {
		switch key {
		case "repositories":
			r.Repositories = slices.Clone(next.Repositories)
		case "poll_interval":
			r.PollInterval = next.PollInterval
			rl.reg.SetPollInterval(next.PollInterval)
		case "limits.max_inflight_requests":
			r.Limits.MaxInflightRequests = next.Limits.MaxInflightRequests
			rl.gate.SetLimits(r.Limits.MaxInflightRequests, int64(r.Limits.MaxInflightBytes))
		case "limits.max_inflight_bytes":
			r.Limits.MaxInflightBytes = next.Limits.MaxInflightBytes
			rl.gate.SetLimits(r.Limits.MaxInflightRequests, int64(r.Limits.MaxInflightBytes))
		case "limits.grace_period":
			r.Limits.GracePeriod = next.Limits.GracePeriod
			rl.reg.SetDrainTimeout(next.Limits.GracePeriod)
		case "log.level":
			r.Log.Level = next.Log.Level
			rl.opts.LogLevel.Set(next.Log.SlogLevel())
		}
	}
	return res, nil
}

// reloadMetrics count config reloads, as Prometheus counts its own.
type reloadMetrics struct {
	reloads         *prometheus.CounterVec
	lastOK          prometheus.Gauge
	lastSuccess     prometheus.Gauge
	restartRequired prometheus.Gauge
}

func newReloadMetrics(reg prometheus.Registerer) (*reloadMetrics, error) {
	m := &reloadMetrics{
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sloserve_config_reloads_total",
			Help: "Server config reloads (SIGHUP or POST /v2/config/reload) by result: success or failure (the config was invalid; nothing changed).",
		}, []string{"result"}),
		lastOK: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "sloserve_config_last_reload_successful",
			Help: "1 when the last config reload succeeded (or none was tried), 0 when it failed.",
		}),
		lastSuccess: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "sloserve_config_last_reload_success_timestamp_seconds",
			Help: "When the config was last read successfully: the start or the last successful reload (Unix seconds).",
		}),
		restartRequired: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "sloserve_config_restart_required",
			Help: "1 when the config read at the last successful reload changes settings that take effect only at the next start.",
		}),
	}
	for _, c := range []prometheus.Collector{m.reloads, m.lastOK, m.lastSuccess, m.restartRequired} {
		if err := reg.Register(c); err != nil {
			return nil, errors.Join(errors.New("server: registering config reload metrics"), err)
		}
	}
	// Both results exist from the start, so rate() and alerts see them.
	m.reloads.WithLabelValues("success")
	m.reloads.WithLabelValues("failure")
	m.lastOK.Set(1)
	m.lastSuccess.Set(float64(time.Now().UnixNano()) / 1e9)
	return m, nil
}
