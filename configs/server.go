package configs

import (
	_ "embed"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/url"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/simgpu"
)

// Model control modes.
const (
	ModelControlNone     = "none"     // load every model at start, never change
	ModelControlExplicit = "explicit" // load and unload through the API
	ModelControlPoll     = "poll"     // follow the repositories on disk
)

// Log formats.
const (
	LogFormatText = "text"
	LogFormatJSON = "json"
)

// DefaultServerFile is the name the embedded default config has in messages.
const DefaultServerFile = "built-in default.yaml"

//go:embed default.yaml
var defaultServerYAML []byte

// DefaultServerYAML returns the embedded default server config, which is
// also the documented reference example.
func DefaultServerYAML() []byte { return slices.Clone(defaultServerYAML) }

// Server is the server config. See default.yaml and examples/server.yaml.
type Server struct {
	Listen        Listen        `yaml:"listen"`
	Repositories  []string      `yaml:"repositories"`
	ModelControl  string        `yaml:"model_control"`
	PollInterval  time.Duration `yaml:"poll_interval"`
	StartupModels []string      `yaml:"startup_models"` // explicit mode only; "*" means all
	// ModelDir, when set, serves the one model in that folder, named
	// ModelName, in place of the repositories: what KServe hands a serving
	// runtime (the model mounted at /mnt/models). See server's single-model
	// staging for the layouts it accepts.
	ModelDir  string `yaml:"model_dir"`
	ModelName string `yaml:"model_name"`
	// ModelMeshDir is the folder ModelMesh's puller fills (with
	// listen.modelmesh): the SPI loads and sizes models only from paths
	// inside it, links resolved.
	ModelMeshDir string    `yaml:"modelmesh_dir"`
	Runtime      Runtime   `yaml:"runtime"`
	Limits       Limits    `yaml:"limits"`
	QoS          QoS       `yaml:"qos"`
	Control      Control   `yaml:"control"`
	GPU          GPU       `yaml:"gpu"`
	Dashboard    Dashboard `yaml:"dashboard"`
	TLS          TLS       `yaml:"tls"`
	Auth         Auth      `yaml:"auth"`
	Log          Log       `yaml:"log"`
	Tracing      Tracing   `yaml:"tracing"`

	File string `yaml:"-"` // the config file, as named in error messages

	// origin maps keys set by Set or ApplyEnv to where the value came
	// from, so validation can say so.
	origin map[string]string
}

// QoS configures per-request scheduling.
type QoS struct {
	// Policy is QoSPolicyQoS (deadlines, admission, earliest deadline
	// first, best-effort in the gaps) or QoSPolicyFIFO (the plain baseline).
	Policy string `yaml:"policy"`
	// BestEffortFloor is the share of executions best-effort models keep
	// under latency-critical load, 0..1.
	BestEffortFloor float64 `yaml:"best_effort_floor"`
	// DeviceSlots is how many executions run at once on the CPU across all
	// models; 0 means one per CPU core.
	DeviceSlots int `yaml:"device_slots"`
	// Window is the sliding window of goodput and SLO attainment.
	Window time.Duration `yaml:"window"`
	// MaxBestEffortExecution bounds the predicted duration of a
	// best-effort batch, so that best-effort work yields at batch
	// boundaries at least this often; 0 means no bound.
	MaxBestEffortExecution time.Duration `yaml:"max_best_effort_execution"`
	// OverlapSlowdown is how much slower a latency-critical execution on
	// the CPU is taken to run while another starts beside it: above 1, a
	// latency-critical batch waits for a running one that it would make
	// late, when it can afford to (qos.Options.OverlapSlowdown); 0 or 1
	// is off.
	OverlapSlowdown float64 `yaml:"overlap_slowdown"`
}

// GPU says what cuda models run on: the machine's GPUs, or simulated ones.
type GPU struct {
	// Simulator, with Devices > 0, runs every cuda model on simulated
	// GPUs with MPS semantics (package simgpu) instead of the machine's:
	// for tests, benchmarks and demos on machines without a GPU. The
	// outputs are zeros of the right shapes and types, not the model's.
	Simulator GPUSimulator `yaml:"simulator"`
	// Placement places cuda models across the devices and moves them
	// when the mix drifts.
	Placement GPUPlacement `yaml:"placement"`
}

// GPUPlacement configures placement across GPUs: a cuda model whose
// config names no device_id is placed by the server at load, and models
// are moved between devices (by a warm shadow on the target) when their
// predicted demand drifts. Models that name a device stay there.
type GPUPlacement struct {
	Enabled bool `yaml:"enabled"`
	// Period is the time between two re-placement passes.
	Period time.Duration `yaml:"period"`
	// MinGain is the least improvement of the placement's cost a move
	// must bring (hysteresis); see docs/gpu.md.
	MinGain float64 `yaml:"min_gain"`
	// MinResidence is the least time a model stays on a device before it
	// may move again.
	MinResidence time.Duration `yaml:"min_residence"`
}

// GPUSimulator is the simulated machine's spec.
type GPUSimulator struct {
	Devices int      `yaml:"devices"` // 0: off, the machine's GPUs
	SMs     int      `yaml:"sms"`     // per device
	Memory  ByteSize `yaml:"memory"`  // per device
	// MPSDaemon starts the devices with an MPS control daemon running;
	// false shows what the server does without one.
	MPSDaemon bool `yaml:"mps_daemon"`
	// MIG starts the devices in MIG mode (the server refuses them).
	MIG bool `yaml:"mig"`
}

// Spec is the simulator's spec, nil when the simulator is off.
func (g GPUSimulator) Spec() *simgpu.Spec {
	if g.Devices == 0 {
		return nil
	}
	return &simgpu.Spec{Devices: g.Devices, SMs: g.SMs, Memory: int64(g.Memory), NoDaemon: !g.MPSDaemon, MIG: g.MIG, Name: "simgpu"}
}

// Control configures the control loop: how each model's share of its
// device is chosen (Policy), enforced (Limiter) and predicted (Profile).
type Control struct {
	// Policy is control.SharePolicyAdaptive, control.SharePolicyStatic or
	// control.SharePolicyShared.
	Policy string `yaml:"policy"`
	// Period is the time between two passes of the adjuster.
	Period time.Duration `yaml:"period"`
	// Headroom: a latency-critical model's predicted latency must stay
	// under slo.latency_ms × (1 - Headroom).
	Headroom float64 `yaml:"headroom"`
	// Quantile is the share of a latency-critical model's requests that
	// must meet its SLO: shares are sized for the latency at this quantile,
	// and grow while the observed attainment is below it.
	Quantile float64 `yaml:"quantile"`
	// MaxUtilization bounds a model's predicted busy fraction at its share.
	MaxUtilization float64 `yaml:"max_utilization"`
	// ScaleDownAfter is how long a model must have had more than it needs
	// before its share shrinks; Cooldown is the least time between two
	// shrinks. Growth is immediate.
	ScaleDownAfter time.Duration `yaml:"scale_down_after"`
	Cooldown       time.Duration `yaml:"cooldown"`
	// Step is the granularity of shares; MinShare the least compute share a
	// model gets.
	Step     float64 `yaml:"step"`
	MinShare float64 `yaml:"min_share"`
	// MemoryBudget is the memory all models of a device may use; 0 means
	// no budget. Over budget, models idle for KeepAlive are unloaded; they
	// load again when a request comes.
	MemoryBudget ByteSize      `yaml:"memory_budget"`
	KeepAlive    time.Duration `yaml:"keep_alive"`
	// Limiter is how shares are enforced: limiter.BackendAuto (cgroups
	// when writable, else a delegated cgroup v2 subtree, else unprivileged
	// scheduling classes, affinity and rlimits; MPS on GPUs),
	// limiter.BackendCgroup (fail without cgroups),
	// limiter.BackendUnprivileged or limiter.BackendNone. The names are
	// limiter's.
	Limiter string `yaml:"limiter"`
	// CFSPeriod is the CPU quota period of the cgroup limiter.
	CFSPeriod time.Duration `yaml:"cfs_period"`
	Profile   Profile       `yaml:"profile"`
}

// Dashboard configures the built-in dashboard (/dashboard on the REST
// port) and the history it shows.
type Dashboard struct {
	Enabled bool `yaml:"enabled"`
	// Resolution is the time between two points of a model's history.
	Resolution time.Duration `yaml:"resolution"`
	// Retention is how much history each model keeps.
	Retention time.Duration `yaml:"retention"`
	// Window is the trailing span each point's rates, attainment and
	// latency quantiles are computed over.
	Window time.Duration `yaml:"window"`
	// AttainmentTarget is the SLO attainment below which a model is shown
	// as missing its SLO.
	AttainmentTarget float64 `yaml:"attainment_target"`
}

// maxDashboardPoints bounds a model's history: 6 hours at 1 s resolution
// is 21,600 points of 184 bytes, about 4 MB.
const maxDashboardPoints = 1_000_000

// Profile configures the predictor's profiling sweep at model load.
type Profile struct {
	Enabled  bool          `yaml:"enabled"`
	CacheDir string        `yaml:"cache_dir"` // "": the user cache directory
	Budget   time.Duration `yaml:"budget"`    // the longest one model's sweep may take
	Runs     int           `yaml:"runs"`      // measured runs per point
}

// QoS policies.
const (
	QoSPolicyQoS  = "qos"
	QoSPolicyFIFO = "fifo"
)

// Listen holds the listen addresses; "" disables a listener.
type Listen struct {
	HTTP    string `yaml:"http"`
	GRPC    string `yaml:"grpc"`
	Metrics string `yaml:"metrics"`
	// ModelMesh is ModelMesh's model-runtime SPI; "" is off.
	ModelMesh string `yaml:"modelmesh"`
}

// Runtime configures the runner processes.
// MaxArenaSize bounds runtime.arena_size.
const MaxArenaSize = 64 * GiB

type Runtime struct {
	ONNXRuntimeLibrary    string        `yaml:"onnxruntime_library"` // "": auto-detect
	SocketDir             string        `yaml:"socket_dir"`          // "": a temporary directory
	ReadyTimeout          time.Duration `yaml:"ready_timeout"`
	HealthInterval        time.Duration `yaml:"health_interval"`
	RestartBackoffInitial time.Duration `yaml:"restart_backoff_initial"`
	RestartBackoffMax     time.Duration `yaml:"restart_backoff_max"`
	MaxRestarts           int           `yaml:"max_restarts"` // consecutive failures before a model is marked failed
	CallTimeout           time.Duration `yaml:"call_timeout"` // longest one call to a runner may go unanswered
	// ArenaSize is the shared memory between the server and each runner
	// process that tensors travel through; 0 turns it off (every tensor
	// inline on the socket).
	ArenaSize ByteSize `yaml:"arena_size"`
	// CallMailbox sends calls that fit to a runner through shared memory
	// after the arena, woken by futexes, instead of the socket; false sends
	// every call on the socket. Without an arena there is no mailbox.
	CallMailbox bool `yaml:"call_mailbox"`
}

// Limits bounds what clients may ask of the server.
type Limits struct {
	MaxRequestBytes   ByteSize `yaml:"max_request_bytes"`
	MaxTensorElements int64    `yaml:"max_tensor_elements"`
	// MaxBatchSize caps the batch dimension of every request: a model whose
	// max_batch_size is larger does not load.
	MaxBatchSize        int `yaml:"max_batch_size"`
	MaxInflightRequests int `yaml:"max_inflight_requests"`
	// MaxInflightBytes bounds the input bytes of all requests in flight,
	// so that memory stays bounded whatever the requests' sizes.
	MaxInflightBytes ByteSize      `yaml:"max_inflight_bytes"`
	GracePeriod      time.Duration `yaml:"grace_period"`
	ShutdownDelay    time.Duration `yaml:"shutdown_delay"` // not ready but serving, before the listeners close
	// MaxConnections caps the open connections of each listener (REST,
	// gRPC). Over it, REST answers health probes and refuses the rest with
	// 503 on a small overflow allowance, and gRPC closes new connections.
	MaxConnections int `yaml:"max_connections"`
	// HeaderTimeout bounds reading a REST request's line and headers;
	// BodyTimeout reading its body once the headers are in (gRPC: a unary
	// call's message once its headers are in, a stream's message once it
	// began; over it the connection closes); IdleTimeout how
	// long a connection with no request in progress stays open (REST
	// keep-alive, gRPC connections with no call).
	HeaderTimeout time.Duration `yaml:"header_timeout"`
	BodyTimeout   time.Duration `yaml:"body_timeout"`
	IdleTimeout   time.Duration `yaml:"idle_timeout"`
	// MaxHeaderBytes caps a REST request's headers and a gRPC call's
	// metadata.
	MaxHeaderBytes ByteSize `yaml:"max_header_bytes"`
	// GRPCMaxStreams caps the calls one gRPC connection may have open at
	// once.
	GRPCMaxStreams int `yaml:"grpc_max_streams"`
	// GRPCStreamInflight caps the requests of one ModelStreamInfer stream
	// that are read and not yet answered; the stream reads no more until
	// one is answered.
	GRPCStreamInflight int `yaml:"grpc_stream_inflight"`
	// GRPCConnectionTimeout bounds a new gRPC connection's handshake.
	GRPCConnectionTimeout time.Duration `yaml:"grpc_connection_timeout"`
	// GRPCKeepaliveMinTime is the shortest interval between keepalive pings
	// a gRPC client may use; clients that ping more often are disconnected.
	GRPCKeepaliveMinTime time.Duration `yaml:"grpc_keepalive_min_time"`
	// MaxSharedMemoryRegions caps the system shared-memory regions clients
	// may have registered at once; 0 turns the extension off.
	MaxSharedMemoryRegions int `yaml:"max_shared_memory_regions"`
	// MaxSharedMemoryBytes caps the bytes of those regions mapped at once.
	MaxSharedMemoryBytes ByteSize `yaml:"max_shared_memory_bytes"`
	// MaxMemory is the one ceiling on the memory clients' traffic holds at
	// once, REST and gRPC alike: bodies and messages being read (each gRPC
	// call being read counts as 2 x MaxRequestBytes), their decoded forms and
	// the responses being written, and the connections' buffers (a share
	// of their own, at most a quarter, set aside at start). Past it
	// requests are refused (429, RESOURCE_EXHAUSTED) and new connections
	// closed; nothing waits for memory.
	MaxMemory ByteSize `yaml:"max_memory"`
	// GCPercent is the server process's Go collector target (GOGC): the
	// heap may grow to (1 + GCPercent/100) x what is live before the next
	// collection. Tensors of megabytes pass through the server many times a
	// second; at Go's 100 the server collected 5 times a second on the
	// colocation day, taking one of its processors each time. Above 100 the
	// heap is also held under limits.max_memory + 256 MiB (a soft limit:
	// the collector runs more often near it). 0 leaves Go's own; GOGC and
	// GOMEMLIMIT in the environment win.
	GCPercent int `yaml:"gc_percent"`
	// WriteTimeout bounds writing a response: a client that does not read
	// it in time loses its connection (REST, metrics; gRPC: a connection
	// with answers to write that writes none of their bytes for this long).
	WriteTimeout time.Duration `yaml:"write_timeout"`
}

// Bounds of limits.gc_percent: below 50 the collector runs more than Go's
// own setting would by half; past 10000 the heap between collections is
// bounded only by the soft limit.
const (
	minGCPercent = 50
	maxGCPercent = 10000
)

// minMemoryRequests is how many requests of MaxRequestBytes
// limits.max_memory must hold at least: one request's body, decoded form
// and response take several times its size.
const minMemoryRequests = 4

// Bounds of the limits that have a hard ceiling.
const (
	// maxTensorElementsCeiling keeps a tensor's byte size (elements × 8, the
	// widest element) within int64.
	maxTensorElementsCeiling = math.MaxInt64 / 8
	minHeaderBytes           = 4 * KiB
	// maxSharedMemoryRegionsCeiling keeps the mappings (and open files) of
	// client regions well under the kernel's per-process map count.
	maxSharedMemoryRegionsCeiling = 4096
	maxHeaderBytesCeiling         = 16 * MiB
	// maxStreamInflight bounds the responses one stream may hold unsent.
	maxStreamInflight = 4096
)

// Log configures logging.
type Log struct {
	Format string `yaml:"format"`
	Level  string `yaml:"level"`
}

// Tracing configures OpenTelemetry traces of inference requests, exported
// over OTLP/HTTP, and the starting values of Triton's trace settings
// (/v2/trace/setting changes them while the server runs).
type Tracing struct {
	// Endpoint is the OTLP/HTTP collector's base URL (http://host:4318;
	// traces go to its /v1/traces, unless the URL names a path); empty
	// turns tracing off.
	Endpoint string `yaml:"endpoint"`
	// Rate traces one request in Rate (Triton's trace_rate): a sampling
	// ratio of 1/Rate.
	Rate int64 `yaml:"rate"`
	// Count is how many requests to trace before stopping (Triton's
	// trace_count); -1 is no limit.
	Count int64 `yaml:"count"`
	// ServiceName is the service.name of the traces.
	ServiceName string `yaml:"service_name"`
}

// SlogLevel is Level as a slog.Level (info when Level is not valid).
func (l Log) SlogLevel() slog.Level {
	var lv slog.Level
	if lv.UnmarshalText([]byte(l.Level)) != nil {
		return slog.LevelInfo
	}
	return lv
}

// DefaultServer returns the defaults, the same values default.yaml holds.
func DefaultServer() *Server {
	return &Server{
		Listen:        Listen{HTTP: ":8000", GRPC: ":8001", Metrics: ":8002"},
		Repositories:  []string{"demo-repository"},
		ModelControl:  ModelControlNone,
		ModelMeshDir:  "/models",
		PollInterval:  5 * time.Second,
		StartupModels: []string{},
		Runtime: Runtime{
			ReadyTimeout:          60 * time.Second,
			HealthInterval:        2 * time.Second,
			RestartBackoffInitial: 200 * time.Millisecond,
			RestartBackoffMax:     30 * time.Second,
			MaxRestarts:           5,
			CallTimeout:           30 * time.Second,
			ArenaSize:             64 * MiB,
			CallMailbox:           true,
		},
		Limits: Limits{
			MaxRequestBytes:       64 * MiB,
			MaxTensorElements:     16 << 20,
			MaxBatchSize:          1024,
			MaxInflightRequests:   1024,
			MaxInflightBytes:      GiB,
			GracePeriod:           30 * time.Second,
			MaxConnections:        4096,
			HeaderTimeout:         10 * time.Second,
			BodyTimeout:           time.Minute,
			IdleTimeout:           2 * time.Minute,
			MaxHeaderBytes:        64 * KiB,
			GRPCMaxStreams:        256,
			GRPCStreamInflight:    16,
			GRPCConnectionTimeout: 10 * time.Second,
			GRPCKeepaliveMinTime:  10 * time.Second,

			MaxSharedMemoryRegions: 64,
			MaxSharedMemoryBytes:   GiB,
			MaxMemory:              4 * GiB,
			GCPercent:              400,
			WriteTimeout:           time.Minute,
		},
		QoS: QoS{Policy: QoSPolicyQoS, BestEffortFloor: 0.05, Window: 10 * time.Second, MaxBestEffortExecution: 200 * time.Millisecond, OverlapSlowdown: 3},
		Control: Control{
			Policy:         control.SharePolicyAdaptive,
			Period:         time.Second,
			Headroom:       0.1,
			Quantile:       0.99,
			MaxUtilization: 0.8,
			ScaleDownAfter: 10 * time.Second,
			Cooldown:       5 * time.Second,
			Step:           0.05,
			MinShare:       0.05,
			KeepAlive:      5 * time.Minute,
			Limiter:        limiter.BackendAuto,
			CFSPeriod:      10 * time.Millisecond,
			Profile:        Profile{Enabled: true, Budget: 20 * time.Second, Runs: 3},
		},
		GPU: GPU{
			Simulator: GPUSimulator{SMs: 108, Memory: 40 << 30, MPSDaemon: true},
			Placement: GPUPlacement{Period: 10 * time.Second, MinGain: 0.1, MinResidence: 2 * time.Minute},
		},
		Dashboard: Dashboard{
			Enabled:          true,
			Resolution:       time.Second,
			Retention:        6 * time.Hour,
			Window:           10 * time.Second,
			AttainmentTarget: 0.99,
		},
		TLS:     TLS{MinVersion: TLSVersion12},
		Auth:    Auth{AllowedHosts: []string{}},
		Log:     Log{Format: LogFormatText, Level: "info"},
		Tracing: Tracing{Rate: 1000, Count: -1, ServiceName: "sloserve"},
	}
}

// LoadServer reads the server config at path, or the embedded default.yaml
// when path is "", applies the defaults, decodes strictly and validates.
func LoadServer(path string) (*Server, error) {
	if path == "" {
		return ParseServer(DefaultServerFile, defaultServerYAML)
	}
	data, err := ReadFile(path)
	if err != nil {
		return nil, err
	}
	return ParseServer(path, data)
}

// ParseServer decodes and validates a server config; file is used only in
// error messages.
func ParseServer(file string, data []byte) (*Server, error) {
	s := DefaultServer()
	s.File = file
	idx, decoded, ok := decodeStrict(data, s)
	var validated problems
	if ok {
		validated = s.validate()
	}
	if errs := finish(file, idx, decoded, validated); len(errs) > 0 {
		return nil, errs.join()
	}
	return s, nil
}

// Validate checks values and cross-field rules. Call it again after Set or
// ApplyEnv; problems with overridden values say where the value came from.
func (s *Server) Validate() error {
	p := s.validate()
	for _, e := range p {
		e.File = s.File
		if from, ok := s.origin[e.Path]; ok {
			e.Msg += " (set by " + from + ")"
		}
	}
	return p.join()
}

func (s *Server) validate() problems {
	var p problems
	s.Listen.validate(&p)

	if len(s.Repositories) == 0 {
		p.add("repositories", "must list at least one model repository")
	}
	seen := map[string]int{}
	for i, r := range s.Repositories {
		path := fmt.Sprintf("repositories[%d]", i)
		if r == "" {
			p.add(path, "must not be empty")
			continue
		}
		if j, dup := seen[filepath.Clean(r)]; dup {
			p.add(path, "duplicate of repositories[%d] (%q)", j, s.Repositories[j])
			continue
		}
		seen[filepath.Clean(r)] = i
	}

	p.oneOf("model_control", s.ModelControl, ModelControlNone, ModelControlExplicit, ModelControlPoll)
	p.oneOf("qos.policy", s.QoS.Policy, QoSPolicyQoS, QoSPolicyFIFO)
	if f := s.QoS.BestEffortFloor; !(f >= 0 && f <= 1) {
		p.add("qos.best_effort_floor", "must be between 0 and 1, got %v", f)
	}
	if s.QoS.DeviceSlots < 0 {
		p.add("qos.device_slots", "must be >= 0, got %d", s.QoS.DeviceSlots)
	}
	if s.QoS.Window <= 0 {
		p.add("qos.window", "must be > 0, got %v", s.QoS.Window)
	}
	if s.QoS.MaxBestEffortExecution < 0 {
		p.add("qos.max_best_effort_execution", "must be >= 0 (0: no bound), got %v", s.QoS.MaxBestEffortExecution)
	}
	if f := s.QoS.OverlapSlowdown; !(f >= 0 && f <= 100) {
		p.add("qos.overlap_slowdown", "must be between 0 and 100 (0 or 1: off), got %v", f)
	}
	s.Control.validate(&p)
	if g := s.GPU.Simulator; g.Devices < 0 {
		p.add("gpu.simulator.devices", "must be >= 0 (0 = off), got %d", g.Devices)
	} else if spec := g.Spec(); spec != nil {
		if err := spec.Check(); err != nil {
			p.add("gpu.simulator", "%s", strings.TrimPrefix(err.Error(), "simgpu: "))
		}
	}
	if pl := s.GPU.Placement; pl.Period <= 0 || pl.MinResidence < 0 || !(pl.MinGain >= 0) {
		p.add("gpu.placement", "period must be > 0, min_residence >= 0 and min_gain >= 0, got %v, %v and %v", pl.Period, pl.MinResidence, pl.MinGain)
	} else if pl.Enabled && s.GPU.Simulator.Devices == 0 {
		p.add("gpu.placement.enabled", "placement runs on simulated GPUs only for now (set gpu.simulator.devices); on real GPUs give each model its device_id")
	}
	s.Dashboard.validate(&p)
	s.TLS.validate(&p)
	s.Auth.validate(&p)
	if s.PollInterval <= 0 {
		p.add("poll_interval", "must be > 0, got %v", s.PollInterval)
	}
	switch {
	case s.ModelDir == "" && s.ModelName != "":
		p.add("model_name", "only allowed with model_dir")
	case s.ModelDir != "" && s.ModelName == "":
		p.add("model_name", "required with model_dir")
	case s.ModelDir != "" && !modelNameRE.MatchString(s.ModelName):
		p.add("model_name", "%q is not a model name (letters, digits, '.', '_', '-'; starting with a letter or digit)", s.ModelName)
	}
	if s.Listen.ModelMesh != "" {
		if s.ModelControl != ModelControlExplicit {
			p.add("model_control", "must be %q with listen.modelmesh (ModelMesh loads and unloads the models), got %q", ModelControlExplicit, s.ModelControl)
		}
		if s.Control.MemoryBudget <= 0 {
			p.add("control.memory_budget", "must be > 0 with listen.modelmesh: it is the capacity ModelMesh fills")
		}
		if s.ModelDir != "" {
			p.add("model_dir", "cannot be set with listen.modelmesh")
		}
		if !filepath.IsAbs(s.ModelMeshDir) || filepath.Clean(s.ModelMeshDir) == "/" {
			p.add("modelmesh_dir", "must be an absolute folder other than / with listen.modelmesh (where ModelMesh's puller writes models), got %q", s.ModelMeshDir)
		}
		// The SPI loads and unloads without a token: only the ModelMesh
		// container of the same pod, on loopback, may reach it.
		if host, _, err := net.SplitHostPort(s.Listen.ModelMesh); err == nil {
			if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
				p.add("listen.modelmesh", "must be a loopback address such as \"127.0.0.1:8085\" (the SPI has no authentication), got %q", s.Listen.ModelMesh)
			}
		}
	}
	if s.ModelDir != "" && s.ModelControl != ModelControlNone {
		p.add("model_control", "must be %q with model_dir (the one model loads at start and stays), got %q", ModelControlNone, s.ModelControl)
	}
	if len(s.StartupModels) > 0 && s.ModelControl != ModelControlExplicit {
		p.add("startup_models", "only allowed with model_control explicit (model_control is %q)", s.ModelControl)
	} else {
		names := map[string]bool{}
		for i, m := range s.StartupModels {
			path := fmt.Sprintf("startup_models[%d]", i)
			switch {
			case m == "":
				p.add(path, "must not be empty")
			case m == "*" && len(s.StartupModels) > 1:
				p.add(path, `"*" (all models) must be the only entry`)
			case names[m]:
				p.add(path, "duplicate model %q", m)
			}
			names[m] = true
		}
	}

	r := &s.Runtime
	positive := func(path string, d time.Duration) {
		if d <= 0 {
			p.add(path, "must be > 0, got %v", d)
		}
	}
	positive("runtime.ready_timeout", r.ReadyTimeout)
	positive("runtime.health_interval", r.HealthInterval)
	positive("runtime.restart_backoff_initial", r.RestartBackoffInitial)
	if r.RestartBackoffMax < r.RestartBackoffInitial {
		p.add("runtime.restart_backoff_max", "must be >= runtime.restart_backoff_initial (%v), got %v", r.RestartBackoffInitial, r.RestartBackoffMax)
	}
	if r.MaxRestarts < 0 {
		p.add("runtime.max_restarts", "must be >= 0, got %d", r.MaxRestarts)
	}
	positive("runtime.call_timeout", r.CallTimeout)
	if r.ArenaSize < 0 || r.ArenaSize > MaxArenaSize {
		p.add("runtime.arena_size", "must be between 0 and %d (64GiB), got %d", int64(MaxArenaSize), r.ArenaSize)
	}

	l := &s.Limits
	if l.MaxRequestBytes <= 0 {
		p.add("limits.max_request_bytes", "must be > 0, got %d", l.MaxRequestBytes)
	}
	if l.MaxTensorElements <= 0 || l.MaxTensorElements > maxTensorElementsCeiling {
		p.add("limits.max_tensor_elements", "must be > 0 and at most %d (its bytes must fit in int64), got %d", int64(maxTensorElementsCeiling), l.MaxTensorElements)
	}
	if l.MaxBatchSize <= 0 {
		p.add("limits.max_batch_size", "must be > 0, got %d", l.MaxBatchSize)
	}
	if l.MaxInflightRequests <= 0 {
		p.add("limits.max_inflight_requests", "must be > 0, got %d", l.MaxInflightRequests)
	}
	if l.MaxInflightBytes <= 0 {
		p.add("limits.max_inflight_bytes", "must be > 0, got %d", l.MaxInflightBytes)
	}
	if l.GracePeriod < 0 {
		p.add("limits.grace_period", "must be >= 0, got %v", l.GracePeriod)
	}
	if l.ShutdownDelay < 0 {
		p.add("limits.shutdown_delay", "must be >= 0, got %v", l.ShutdownDelay)
	}
	l.validateConnections(&p)
	if l.MaxSharedMemoryRegions < 0 || l.MaxSharedMemoryRegions > maxSharedMemoryRegionsCeiling {
		p.add("limits.max_shared_memory_regions", "must be between 0 (off) and %d, got %d", maxSharedMemoryRegionsCeiling, l.MaxSharedMemoryRegions)
	}
	if l.MaxSharedMemoryBytes <= 0 {
		p.add("limits.max_shared_memory_bytes", "must be > 0, got %d", l.MaxSharedMemoryBytes)
	}
	if l.GCPercent != 0 && (l.GCPercent < minGCPercent || l.GCPercent > maxGCPercent) {
		p.add("limits.gc_percent", "must be 0 (Go's own) or between %d and %d, got %d", minGCPercent, maxGCPercent, l.GCPercent)
	}
	if l.MaxRequestBytes > 0 && (l.MaxMemory < minMemoryRequests*l.MaxRequestBytes || l.MaxMemory/minMemoryRequests < l.MaxRequestBytes) {
		p.add("limits.max_memory", "must be at least %d x limits.max_request_bytes (%d), got %d", minMemoryRequests, minMemoryRequests*l.MaxRequestBytes, l.MaxMemory)
	}

	p.oneOf("log.format", s.Log.Format, LogFormatText, LogFormatJSON)
	p.oneOf("log.level", s.Log.Level, "debug", "info", "warn", "error")
	s.Tracing.validate(&p)
	return p
}

// validateConnections checks the limits on connections and their timing.
func (l *Limits) validateConnections(p *problems) {
	if l.MaxConnections <= 0 {
		p.add("limits.max_connections", "must be > 0, got %d", l.MaxConnections)
	}
	positive := func(path string, d time.Duration) {
		if d <= 0 {
			p.add(path, "must be > 0, got %v", d)
		}
	}
	positive("limits.header_timeout", l.HeaderTimeout)
	positive("limits.body_timeout", l.BodyTimeout)
	positive("limits.idle_timeout", l.IdleTimeout)
	positive("limits.write_timeout", l.WriteTimeout)
	positive("limits.grpc_connection_timeout", l.GRPCConnectionTimeout)
	if l.MaxHeaderBytes < minHeaderBytes || l.MaxHeaderBytes > maxHeaderBytesCeiling {
		p.add("limits.max_header_bytes", "must be between %v and %v, got %d", minHeaderBytes, maxHeaderBytesCeiling, l.MaxHeaderBytes)
	}
	if l.GRPCMaxStreams <= 0 || l.GRPCMaxStreams > math.MaxInt32 {
		p.add("limits.grpc_max_streams", "must be > 0 and at most %d, got %d", math.MaxInt32, l.GRPCMaxStreams)
	}
	if l.GRPCStreamInflight <= 0 || l.GRPCStreamInflight > maxStreamInflight {
		p.add("limits.grpc_stream_inflight", "must be > 0 and at most %d, got %d", maxStreamInflight, l.GRPCStreamInflight)
	}
	positive("limits.grpc_keepalive_min_time", l.GRPCKeepaliveMinTime)
}

func (c *Control) validate(p *problems) {
	p.oneOf("control.policy", c.Policy, control.SharePolicyAdaptive, control.SharePolicyStatic, control.SharePolicyShared)
	// The backends a config may name; a new backend adds its name here.
	p.oneOf("control.limiter", c.Limiter, limiter.BackendAuto, limiter.BackendCgroup, limiter.BackendUnprivileged, limiter.BackendNone)
	if !(c.Headroom >= 0 && c.Headroom < 1) { // false for NaN
		p.add("control.headroom", "must be in [0, 1), got %v", c.Headroom)
	}
	if !(c.Quantile >= 0.5 && c.Quantile < 1) {
		p.add("control.quantile", "must be in [0.5, 1), got %v", c.Quantile)
	}
	if !(c.MaxUtilization > 0 && c.MaxUtilization <= 1) {
		p.add("control.max_utilization", "must be > 0 and <= 1, got %v", c.MaxUtilization)
	}
	if !(c.Step > 0 && c.Step < 1) {
		p.add("control.step", "must be in (0, 1), got %v", c.Step)
	}
	if !(c.MinShare >= 0 && c.MinShare < 1) {
		p.add("control.min_share", "must be in [0, 1), got %v", c.MinShare)
	}
	positive := func(path string, d time.Duration) {
		if d <= 0 {
			p.add(path, "must be > 0, got %v", d)
		}
	}
	nonNegative := func(path string, d time.Duration) {
		if d < 0 {
			p.add(path, "must be >= 0, got %v", d)
		}
	}
	positive("control.period", c.Period)
	nonNegative("control.scale_down_after", c.ScaleDownAfter)
	nonNegative("control.cooldown", c.Cooldown)
	nonNegative("control.keep_alive", c.KeepAlive)
	positive("control.cfs_period", c.CFSPeriod)
	positive("control.profile.budget", c.Profile.Budget)
	if c.CFSPeriod > 0 && (c.CFSPeriod < time.Millisecond || c.CFSPeriod > time.Second) {
		p.add("control.cfs_period", "must be between 1ms and 1s (the kernel's range), got %v", c.CFSPeriod)
	}
	if c.MemoryBudget < 0 {
		p.add("control.memory_budget", "must be >= 0, got %d", c.MemoryBudget)
	}
	if c.Profile.Runs < 1 {
		p.add("control.profile.runs", "must be >= 1, got %d", c.Profile.Runs)
	}
}

func (d *Dashboard) validate(p *problems) {
	if d.Resolution < 100*time.Millisecond || d.Resolution > time.Minute {
		p.add("dashboard.resolution", "must be between 100ms and 1m, got %v", d.Resolution)
		return
	}
	if d.Retention < d.Resolution {
		p.add("dashboard.retention", "must be >= dashboard.resolution (%v), got %v", d.Resolution, d.Retention)
	} else if n := d.Retention / d.Resolution; n > maxDashboardPoints {
		p.add("dashboard.retention", "keeps %d points per model at resolution %v; at most %d", n, d.Resolution, maxDashboardPoints)
	}
	if d.Window < d.Resolution || d.Window > 10*time.Minute {
		p.add("dashboard.window", "must be between dashboard.resolution (%v) and 10m, got %v", d.Resolution, d.Window)
	}
	if t := d.AttainmentTarget; !(t > 0 && t <= 1) {
		p.add("dashboard.attainment_target", "must be in (0, 1], got %v", t)
	}
}

func (l *Listen) validate(p *problems) {
	if l.HTTP == "" && l.GRPC == "" {
		p.add("listen", "http and grpc cannot both be empty")
	}
	type addr struct {
		path, addr, host string
		port             int
	}
	var ok []addr
	for _, a := range []addr{{path: "listen.http", addr: l.HTTP}, {path: "listen.grpc", addr: l.GRPC}, {path: "listen.metrics", addr: l.Metrics}, {path: "listen.modelmesh", addr: l.ModelMesh}} {
		if a.addr == "" {
			continue
		}
		host, port, err := net.SplitHostPort(a.addr)
		if err != nil {
			p.add(a.path, "want host:port such as \":8000\" or \"127.0.0.1:8000\", got %q", a.addr)
			continue
		}
		n, err := strconv.Atoi(port)
		if err != nil || n < 0 || n > 65535 {
			p.add(a.path, "port must be a number from 0 to 65535, got %q", port)
			continue
		}
		a.host, a.port = host, n
		for _, b := range ok {
			if a.port == b.port && a.port != 0 && (a.host == b.host || wildcard(a.host) || wildcard(b.host)) {
				p.add(a.path, "%q conflicts with %s %q", a.addr, b.path, b.addr)
			}
		}
		ok = append(ok, a)
	}
}

func wildcard(host string) bool {
	return host == "" || host == "0.0.0.0" || host == "::"
}

func (t *Tracing) validate(p *problems) {
	if t.Endpoint != "" {
		u, err := url.Parse(t.Endpoint)
		switch {
		case err != nil:
			p.add("tracing.endpoint", "not a URL: %v", err)
		case u.Scheme != "http" && u.Scheme != "https", u.Host == "":
			p.add("tracing.endpoint", "must be an http:// or https:// URL with a host (the OTLP/HTTP collector), got %q", t.Endpoint)
		case u.RawQuery != "" || u.Fragment != "" || u.User != nil:
			p.add("tracing.endpoint", "must have no user, query or fragment, got %q", t.Endpoint)
		}
	}
	if t.Rate < 1 {
		p.add("tracing.rate", "must be >= 1 (one request in rate is traced), got %d", t.Rate)
	}
	if t.Count < -1 {
		p.add("tracing.count", "must be >= 0, or -1 for no limit, got %d", t.Count)
	}
	if t.ServiceName == "" {
		p.add("tracing.service_name", "must not be empty")
	}
}
