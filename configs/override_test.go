package configs

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestKeys(t *testing.T) {
	want := []string{
		"listen.http", "listen.grpc", "listen.metrics", "listen.modelmesh",
		"repositories", "model_control", "poll_interval", "startup_models", "model_dir", "model_name", "modelmesh_dir",
		"runtime.onnxruntime_library", "runtime.socket_dir", "runtime.ready_timeout",
		"runtime.health_interval", "runtime.restart_backoff_initial", "runtime.restart_backoff_max",
		"runtime.max_restarts", "runtime.call_timeout", "runtime.arena_size", "runtime.call_mailbox",
		"limits.max_request_bytes", "limits.max_tensor_elements", "limits.max_batch_size", "limits.max_inflight_requests", "limits.max_inflight_bytes",
		"limits.grace_period", "limits.shutdown_delay", "limits.max_connections", "limits.header_timeout", "limits.body_timeout",
		"limits.idle_timeout", "limits.max_header_bytes", "limits.grpc_max_streams", "limits.grpc_stream_inflight", "limits.grpc_connection_timeout",
		"limits.grpc_keepalive_min_time", "limits.max_shared_memory_regions", "limits.max_shared_memory_bytes",
		"limits.max_memory", "limits.gc_percent", "limits.write_timeout",
		"qos.policy", "qos.best_effort_floor", "qos.device_slots", "qos.window", "qos.max_best_effort_execution", "qos.overlap_slowdown",
		"control.policy", "control.period", "control.headroom", "control.quantile", "control.max_utilization",
		"control.scale_down_after", "control.cooldown", "control.step", "control.min_share",
		"control.memory_budget", "control.keep_alive", "control.limiter", "control.cfs_period",
		"control.profile.enabled", "control.profile.cache_dir", "control.profile.budget", "control.profile.runs",
		"gpu.simulator.devices", "gpu.simulator.sms", "gpu.simulator.memory", "gpu.simulator.mps_daemon", "gpu.simulator.mig",
		"gpu.placement.enabled", "gpu.placement.period", "gpu.placement.min_gain", "gpu.placement.min_residence",
		"dashboard.enabled", "dashboard.resolution", "dashboard.retention", "dashboard.window",
		"dashboard.attainment_target",
		"tls.cert_file", "tls.key_file", "tls.client_ca_file", "tls.client_auth", "tls.min_version", "tls.metrics",
		"auth.inference_token_file", "auth.admin_token_file", "auth.inference_token", "auth.admin_token",
		"auth.require_token_for_health", "auth.require_token_for_metrics", "auth.allowed_hosts",
		"log.format", "log.level",
		"tracing.endpoint", "tracing.rate", "tracing.count", "tracing.service_name",
	}
	keys := Keys()
	if !slices.Equal(keys, want) {
		t.Errorf("Keys() =\n%q\nwant\n%q", keys, want)
	}
	keys[0] = "changed"
	if Keys()[0] != "listen.http" {
		t.Error("Keys returns its internal slice")
	}
	envs := map[string]string{}
	for _, k := range Keys() {
		env := EnvVar(k)
		if other, dup := envs[env]; dup {
			t.Errorf("%s and %s share the environment variable %s", k, other, env)
		}
		envs[env] = k
		if _, alias := envAliases[env]; alias {
			t.Errorf("alias %s is also the variable of %s", env, k)
		}
	}
	if got := EnvVar("limits.max_request_bytes"); got != "SLOSERVE_LIMITS_MAX_REQUEST_BYTES" {
		t.Errorf("EnvVar = %s", got)
	}
}

func TestSet(t *testing.T) {
	tests := []struct {
		key, value string
		check      func(s *Server) bool
	}{
		{"listen.http", "127.0.0.1:9000", func(s *Server) bool { return s.Listen.HTTP == "127.0.0.1:9000" }},
		{"listen.metrics", "", func(s *Server) bool { return s.Listen.Metrics == "" }},
		{"repositories", "a, b/c ,,/d", func(s *Server) bool { return slices.Equal(s.Repositories, []string{"a", "b/c", "/d"}) }},
		{"startup_models", "", func(s *Server) bool { return s.StartupModels != nil && len(s.StartupModels) == 0 }},
		{"model_control", "poll", func(s *Server) bool { return s.ModelControl == ModelControlPoll }},
		{"poll_interval", "1m30s", func(s *Server) bool { return s.PollInterval == 90*time.Second }},
		{"runtime.onnxruntime_library", "/opt/ort/lib/libonnxruntime.so", func(s *Server) bool {
			return s.Runtime.ONNXRuntimeLibrary == "/opt/ort/lib/libonnxruntime.so"
		}},
		{"runtime.max_restarts", "0", func(s *Server) bool { return s.Runtime.MaxRestarts == 0 }},
		{"limits.max_request_bytes", "1GiB", func(s *Server) bool { return s.Limits.MaxRequestBytes == GiB }},
		{"limits.max_request_bytes", "1048576", func(s *Server) bool { return s.Limits.MaxRequestBytes == MiB }},
		{"limits.max_tensor_elements", "1e6", func(s *Server) bool { return s.Limits.MaxTensorElements == 1e6 }},
		{"limits.max_inflight_requests", " 12 ", func(s *Server) bool { return s.Limits.MaxInflightRequests == 12 }},
		{"log.level", "debug", func(s *Server) bool { return s.Log.Level == "debug" }},
	}
	for _, tt := range tests {
		t.Run(tt.key+"="+tt.value, func(t *testing.T) {
			s := DefaultServer()
			if err := s.Set(tt.key, tt.value); err != nil {
				t.Fatal(err)
			}
			if !tt.check(s) {
				t.Errorf("after Set: %+v", s)
			}
		})
	}
}

func TestSetErrors(t *testing.T) {
	tests := []struct {
		key, value string
		want       string
	}{
		{"listen.htp", ":1", `unknown config key "listen.htp"`},
		{"listen", ":1", `unknown config key "listen"`},
		{"File", "x", `unknown config key "File"`},
		{"poll_interval", "5", `poll_interval: want a duration such as "500ms" or "2s", got 5`},
		{"poll_interval", "soon", `poll_interval: want a duration such as "500ms" or "2s", got "soon"`},
		{"limits.max_request_bytes", "lots", `limits.max_request_bytes: want a byte size such as 1024, "64MiB" or "1GiB", got "lots"`},
		{"limits.max_request_bytes", "-1", "limits.max_request_bytes: want a byte size such as 1024, \"64MiB\" or \"1GiB\", got -1: must not be negative"},
		{"limits.max_inflight_requests", "1.5", "limits.max_inflight_requests: want an integer, got 1.5"},
		{"limits.max_inflight_requests", "many many", `limits.max_inflight_requests: want an integer, got "many many"`},
		{"runtime.max_restarts", "", `runtime.max_restarts: want a single value, got ""`},
		{"runtime.max_restarts", "null", `runtime.max_restarts: want a single value, got "null"`},
		{"runtime.max_restarts", "[1, 2]", `runtime.max_restarts: want a single value, got "[1, 2]"`},
		{"runtime.max_restarts", "{", `runtime.max_restarts: invalid value "{"`},
	}
	for _, tt := range tests {
		t.Run(tt.key+"="+tt.value, func(t *testing.T) {
			s := DefaultServer()
			before := *s
			err := s.Set(tt.key, tt.value)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Set(%q, %q) = %v, want %q", tt.key, tt.value, err, tt.want)
			}
			if strings.Contains(tt.want, "unknown config key") != errors.Is(err, ErrUnknownKey) {
				t.Errorf("errors.Is(err, ErrUnknownKey) wrong for %v", err)
			}
			if !errors.Is(err, ErrUnknownKey) && !errors.Is(err, ErrInvalid) {
				t.Errorf("bad value error does not wrap ErrInvalid: %v", err)
			}
			if strings.Contains(err.Error(), "line 1") {
				t.Errorf("error mentions a line: %v", err)
			}
			s.origin = nil
			if !slicesEqualServer(s, &before) {
				t.Errorf("failed Set changed the config: %+v", s)
			}
		})
	}
}

func slicesEqualServer(a, b *Server) bool {
	return a.Listen == b.Listen && a.Runtime == b.Runtime && a.Limits == b.Limits && a.Log == b.Log && a.QoS == b.QoS &&
		a.ModelControl == b.ModelControl && a.PollInterval == b.PollInterval &&
		slices.Equal(a.Repositories, b.Repositories) && slices.Equal(a.StartupModels, b.StartupModels)
}

func TestSetEveryKey(t *testing.T) {
	// A value each key accepts, so every key in Keys is reachable by Set.
	values := map[string]string{
		"repositories": "r", "model_control": "explicit", "startup_models": "a,b",
		"log.format": "json", "log.level": "warn",
		"qos.policy": "fifo", "qos.best_effort_floor": "0.5", "qos.window": "3s", "qos.max_best_effort_execution": "50ms", "qos.overlap_slowdown": "2",
		"control.policy": "static", "control.period": "2s", "control.scale_down_after": "0s",
		"control.cooldown": "1s", "control.keep_alive": "1m", "control.cfs_period": "5ms",
		"control.profile.enabled": "false", "control.profile.budget": "5s", "control.limiter": "none",
		"dashboard.enabled": "false", "dashboard.resolution": "2s", "dashboard.retention": "1h",
		"dashboard.window": "30s", "dashboard.attainment_target": "0.9",
		"tls.metrics": "true", "auth.require_token_for_health": "true", "auth.require_token_for_metrics": "true",
		"limits.max_header_bytes": "8KiB", "auth.allowed_hosts": "a.example,b.example",
		"runtime.arena_size": "16MiB", "runtime.call_mailbox": "false",
		"gpu.simulator.mps_daemon": "false", "gpu.simulator.mig": "true",
		"gpu.placement.enabled": "false", "gpu.placement.period": "3s", "gpu.placement.min_residence": "3s",
	}
	for _, key := range Keys() {
		s := DefaultServer()
		v, ok := values[key]
		if !ok {
			switch {
			case strings.HasPrefix(key, "listen."):
				v = ":0"
			case strings.HasPrefix(key, "runtime.") && !strings.HasSuffix(key, "max_restarts") &&
				!strings.HasSuffix(key, "_library") && !strings.HasSuffix(key, "_dir"):
				v = "3s"
			case key == "poll_interval", key == "limits.grace_period", key == "limits.shutdown_delay",
				strings.HasSuffix(key, "_timeout"), strings.HasSuffix(key, "_time"):
				v = "3s"
			default:
				v = "3"
			}
		}
		if err := s.Set(key, v); err != nil {
			t.Errorf("Set(%q, %q): %v", key, v, err)
		}
	}
}

func TestApplyEnv(t *testing.T) {
	s := DefaultServer()
	err := s.ApplyEnv([]string{
		"PATH=/usr/bin",
		"SLOSERVE_LISTEN_HTTP=:9000",
		"SLOSERVE_LIMITS_MAX_REQUEST_BYTES=128MiB",
		"SLOSERVE_REPOSITORIES=a,b",
		"SLOSERVE_ONNXRUNTIME_LIBRARY=/alias/libonnxruntime.so",
		"SLOSERVE_NOT_A_KEY=1",
		"SLOSERVE_LOG_LEVEL=debug",
		"SLOSERVE_LISTEN_METRICS=",
		"SLOSERVE_BROKEN",
		"sloserve_log_format=json",
	})
	if err != nil {
		t.Fatal(err)
	}
	if s.Listen.HTTP != ":9000" || s.Listen.Metrics != "" || s.Limits.MaxRequestBytes != 128*MiB ||
		!slices.Equal(s.Repositories, []string{"a", "b"}) || s.Log.Level != "debug" || s.Log.Format != "text" ||
		s.Runtime.ONNXRuntimeLibrary != "/alias/libonnxruntime.so" {
		t.Errorf("after ApplyEnv: %+v", s)
	}
	if err := s.Validate(); err != nil {
		t.Error(err)
	}

	t.Run("canonical name wins over alias", func(t *testing.T) {
		for _, env := range [][]string{
			{"SLOSERVE_RUNTIME_ONNXRUNTIME_LIBRARY=/canonical.so", "SLOSERVE_ONNXRUNTIME_LIBRARY=/alias.so"},
			{"SLOSERVE_ONNXRUNTIME_LIBRARY=/alias.so", "SLOSERVE_RUNTIME_ONNXRUNTIME_LIBRARY=/canonical.so"},
		} {
			s := DefaultServer()
			if err := s.ApplyEnv(env); err != nil {
				t.Fatal(err)
			}
			if s.Runtime.ONNXRuntimeLibrary != "/canonical.so" {
				t.Errorf("%q: library = %q", env, s.Runtime.ONNXRuntimeLibrary)
			}
		}
	})

	t.Run("errors name the variable", func(t *testing.T) {
		s := DefaultServer()
		err := s.ApplyEnv([]string{"SLOSERVE_POLL_INTERVAL=5", "SLOSERVE_LIMITS_MAX_INFLIGHT_REQUESTS=x", "SLOSERVE_LOG_LEVEL=debug"})
		checkBadNoFile(t, err,
			"SLOSERVE_POLL_INTERVAL: poll_interval: want a duration",
			`SLOSERVE_LIMITS_MAX_INFLIGHT_REQUESTS: limits.max_inflight_requests: want an integer, got "x"`)
		if s.Log.Level != "debug" {
			t.Error("a bad variable stopped the good ones")
		}
	})

	t.Run("validation says where a value came from", func(t *testing.T) {
		s, err := LoadServer("")
		if err != nil {
			t.Fatal(err)
		}
		if err := s.ApplyEnv([]string{"SLOSERVE_LISTEN_GRPC=:8000"}); err != nil {
			t.Fatal(err)
		}
		if err := s.Set("runtime.restart_backoff_max", "1ms"); err != nil {
			t.Fatal(err)
		}
		checkBadNoFile(t, s.Validate(),
			DefaultServerFile+`: listen.grpc: ":8000" conflicts with listen.http ":8000" (set by SLOSERVE_LISTEN_GRPC)`,
			"runtime.restart_backoff_max: must be >= runtime.restart_backoff_initial (200ms), got 1ms (set by override)")
	})
}
