package models

import (
	"errors"
	"fmt"
	"time"

	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// Errors returned by the registry. The api package maps them to protocol
// status codes; everything else wraps one of these or a runtime error.
var (
	ErrModelNotFound   = errors.New("model not found")
	ErrVersionNotFound = errors.New("model version not found")
	ErrNotReady        = errors.New("model not ready")
	ErrInvalidInput    = errors.New("invalid inference request")
	ErrTooLarge        = errors.New("request too large")
	ErrBadConfig       = errors.New("invalid model configuration")
	ErrModelControl    = errors.New("operation not allowed in this model control mode")
)

// State is a model version's lifecycle state, named as in Triton's
// repository index.
type State string

const (
	StateUnavailable State = "UNAVAILABLE"
	StateLoading     State = "LOADING"
	StateReady       State = "READY"
	StateUnloading   State = "UNLOADING"
)

// Metadata is what the protocol's model metadata endpoint returns.
type Metadata struct {
	Name     string
	Versions []string
	Platform string
	Inputs   []runtime.TensorSpec
	Outputs  []runtime.TensorSpec
}

// IndexEntry is one row of the repository index.
type IndexEntry struct {
	Name    string
	Version string
	State   State
	Reason  string
}

// Duration is a count of events and their total time, as the scheduler
// counts them.
type Duration = qos.Duration

// Statistics is one model version's inference statistics, in the shape of
// Triton's statistics extension.
type Statistics struct {
	Name           string
	Version        string
	LastInference  time.Time
	InferenceCount uint64 // inferences, counting each batch element
	ExecutionCount uint64 // runner executions (a merged batch is one)
	Success        Duration
	Fail           Duration
	Queue          Duration
	ComputeInput   Duration
	ComputeInfer   Duration
	ComputeOutput  Duration
	// Batches counts executions by batch size, ascending, with their times
	// in the runner (Triton's batch_stats).
	Batches []BatchStatistics
	// SLO is the version's SLO accounting from its scheduler; nil while
	// the version is not scheduled yet.
	SLO *SLOStatistics
}

// BatchStatistics is the executions of one batch size and their times.
type BatchStatistics struct {
	BatchSize     int
	ComputeInput  Duration
	ComputeInfer  Duration
	ComputeOutput Duration
}

// SLOStatistics is one version's SLO accounting: outcome counts since it
// was loaded, and goodput and attainment over the scheduler's window.
type SLOStatistics struct {
	Class                                                    string
	LatencyTarget                                            time.Duration // 0: none
	Arrived, Good, Late, Rejected, Dropped, Failed, Canceled uint64
	// Invalid counts the requests refused as invalid (inputs that do not
	// match the model): not arrivals, but failed requests in Fail.
	Invalid        uint64
	QueueDepth     int
	Goodput        float64 // good requests per second over the window
	Attainment     float64 // good / settled over the window
	MeanQueueDelay time.Duration
}

// notFoundError is ErrModelNotFound or ErrVersionNotFound worded first as
// Triton words it, since clients and scripts match those words (Triton
// core's model_repository_manager.cc: "Request for unknown model: 'X' is
// not found", "... 'X' version N is not found"), then sloserve's own.
type notFoundError struct {
	sentinel error
	msg      string
}

func (e *notFoundError) Error() string { return e.msg }
func (e *notFoundError) Unwrap() error { return e.sentinel }

// tritonName is a client's model name in Triton's words, cut when long
// (the whole name follows in sloserve's).
func tritonName(name string) string {
	const max = 256
	if len(name) > max {
		return name[:max] + "..."
	}
	return name
}

// modelNotFound is ErrModelNotFound for name; detail, when not empty,
// says more.
func modelNotFound(name, detail string) error {
	msg := fmt.Sprintf("Request for unknown model: '%s' is not found (%v: %q", tritonName(name), ErrModelNotFound, name)
	if detail != "" {
		msg += "; " + detail
	}
	return &notFoundError{ErrModelNotFound, msg + ")"}
}

// versionNotFound is ErrVersionNotFound for a version of the model name.
func versionNotFound(name, ver string) error {
	return &notFoundError{ErrVersionNotFound, fmt.Sprintf("Request for unknown model: '%s' version %s is not found (%v: %q version %q)",
		tritonName(name), tritonName(ver), ErrVersionNotFound, name, ver)}
}
