// Package api is the wire: the Open Inference Protocol v2 over REST (gin) and
// gRPC, and ModelMesh's model-runtime SPI. It decodes requests into runtime
// tensors, calls the Backend (the ModelMesh interface for the SPI), and
// encodes results; protocol status codes are chosen here and nowhere else.
//
// It owns the protocol surface: routing, decoding and encoding, the
// server's own endpoints (control, shares, config reload, dashboard JSON and
// page), access control (TLS, bearer tokens, loopback-only admin calls),
// connection limits, and the clients' system shared-memory regions (the
// registry and mappings of Triton's extension, shm.go), which are protocol
// state: they say where a request's bytes are, not how it is served. It must not hold model or scheduling state, queue or
// order requests, or validate tensors against a model's metadata: it reaches
// the rest of the server only through Backend and ModelMesh. No other package may turn an
// error into an HTTP status or a gRPC code.
package api

import (
	"context"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/dashboard"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/runtime"
	"github.com/sloserve/sloserve/tracing"
)

// Backend is what the protocol handlers serve. The server package implements
// it; the request path's part (ModelReady to Statistics) is the model
// registry's own methods, so that a request goes from here to the registry
// with no layer between.
type Backend interface {
	// Live reports whether the server can answer requests at all.
	Live() bool
	// Ready reports whether the server is ready for inference.
	Ready() bool
	// ServerVersion is the sloserve version string.
	ServerVersion() string

	// ModelReady reports whether the model version ("" = the default
	// version) is ready; an unknown model or version is an error.
	ModelReady(name, version string) (bool, error)
	// Metadata describes a model, or one version of it.
	Metadata(name, version string) (models.Metadata, error)
	// ModelConfig is the config a model version ("" = the default
	// version) serves with, inputs and outputs complete; read only.
	ModelConfig(name, version string) (*configs.Model, error)
	// Infer runs one request on a model version ("" = the default version)
	// and returns the version that served it.
	Infer(ctx context.Context, name, version string, req *runtime.InferRequest) (*runtime.InferResponse, string, error)
	// Preadmit tells, before a request's body is read, whether a request
	// for the model version with this deadline (zero: the model's SLO)
	// would be refused now; nil promises nothing. A refusal is counted as
	// the request's outcome.
	Preadmit(ctx context.Context, name, version string, deadline time.Time) error
	// Statistics returns per-version statistics; name "" means all models,
	// version "" all versions.
	Statistics(name, version string) ([]models.Statistics, error)

	// RepositoryIndex lists the models in the repositories; readyOnly keeps
	// only those ready for inference.
	RepositoryIndex(ctx context.Context, readyOnly bool) ([]models.IndexEntry, error)
	// LoadModel loads or reloads a model and waits until it is ready or
	// failed. config, when not nil, is a Triton ModelConfig in JSON to
	// serve the model with instead of its folder's config (Triton's config
	// override); a config that does not check out is models.ErrBadConfig.
	LoadModel(ctx context.Context, name string, config []byte) error
	// UnloadModel unloads a model after in-flight requests finish.
	UnloadModel(ctx context.Context, name string) error
	// ReloadConfig rereads the server config from where it came from at
	// start, applies what can change while the server runs and says which
	// changed keys need a restart. An invalid config (configs.ErrInvalid)
	// changes nothing.
	ReloadConfig(ctx context.Context) (ReloadResult, error)
	// Control describes the control loop: policy, limiters, shares and
	// predictions.
	Control() ControlStatus
	// Limiters names the limiter of each started device (device -> kind).
	Limiters() map[string]string
	// ControlEvents returns the adjusters' decisions after since, oldest
	// first, at most limit.
	ControlEvents(since time.Time, limit int) []control.Event
	// PinShare pins the share of a model's default version; nil unpins.
	PinShare(ctx context.Context, name string, pin *limiter.Share) error
	// Dashboard is the models' history for the dashboard; nil when the
	// dashboard is disabled.
	Dashboard() *dashboard.Recorder
}

// ReloadResult is what a config reload did: the changed keys now in
// effect, and the changed keys that take effect at the next start.
type ReloadResult struct {
	Applied       []string
	RestartNeeded []string
}

// Limits bound what a request may make the server allocate.
type Limits struct {
	// MaxRequestBytes caps a request body (REST) or message (gRPC).
	MaxRequestBytes int64
	// MaxTensorElements caps the elements of any one tensor.
	MaxTensorElements int64
	// MaxHeaderBytes is the gRPC server's cap on a call's headers
	// (grpc.MaxHeaderListSize, which the caller sets); 0 means grpc-go's
	// default. A stream holds its headers for its life: it reserves them
	// (GRPCStreamBytes).
	MaxHeaderBytes int64
	// BodyTimeout bounds reading a REST request's body once its headers
	// are in, and over gRPC, on connections a LimitedListener accepted, a
	// unary call's message and end once its headers are in and a stream's
	// message once it began while its handler waits for it (over it the
	// connection is closed); 0 means no bound.
	BodyTimeout time.Duration
	// SharedMemory is the registry of clients' system shared-memory
	// regions, one for REST and gRPC together, bounded by its own limits;
	// nil turns the extension off.
	SharedMemory *SharedMemory
	// StreamInflight caps the requests of one ModelStreamInfer stream read
	// and not yet answered; 0 means DefaultStreamInflight.
	StreamInflight int
	// RefuseUnread, when set, is asked as a ModelInfer call's headers
	// arrive, before its message (and with it the model's name) is read:
	// an error refuses the call with RESOURCE_EXHAUSTED and its message
	// is never read (the server's limit on requests in flight,
	// qos.Gate.RefuseUnread). REST asks the model's Preadmit instead.
	RefuseUnread func() error
	// Memory is the server's memory budget for clients' traffic
	// (limits.max_memory): bodies and messages being read, their decoded
	// forms and the responses being written reserve their bytes from it
	// first; nil: no budget.
	Memory *MemoryBudget
	// WriteTimeout bounds writing a response (limits.write_timeout): a
	// client that does not read it in time loses its connection, and the
	// memory the response holds is given back (over gRPC, on connections
	// followed by GRPCCredentials: a connection with answers to write that
	// writes none of their bytes for this long); 0 means no bound.
	WriteTimeout time.Duration
	// SlowClients counts the bodies, messages and answers cut off at
	// BodyTimeout and WriteTimeout; nil: not counted.
	SlowClients *SlowClients
	// LogLevel is the level of the server's logger, which Triton's logging
	// extension (GET and POST /v2/logging) reads and sets; nil turns the
	// extension off.
	LogLevel *slog.LevelVar
	// Tracer makes the spans of inference requests (infer, answer; the
	// scheduler and the runner add theirs under them), with a client's W3C
	// traceparent (REST header, gRPC metadata) as their parent; nil: no
	// spans.
	Tracer trace.TracerProvider
	// Trace holds Triton's trace settings, which the trace extension (GET
	// and POST /v2/trace/setting, gRPC TraceSetting) reads and changes;
	// nil turns the extension off.
	Trace *tracing.Settings
}

// ServerName is the name sloserve gives in server metadata.
const ServerName = "sloserve"

// Extensions lists the protocol extensions sloserve supports, as named in
// server metadata.
var Extensions = []string{
	"binary_tensor_data",
	"model_configuration",
	"model_repository",
	"statistics",
	"sloserve_control",
}
