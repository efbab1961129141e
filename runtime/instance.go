package runtime

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Timing is the time a runner spent on one call: copying inputs into ONNX
// Runtime, running the session, and copying outputs back.
type Timing struct {
	Input  time.Duration
	Infer  time.Duration
	Output time.Duration
}

// Instance is one running copy of a model that can execute requests.
type Instance interface {
	Infer(ctx context.Context, req *InferRequest) (*InferResponse, error)
}

var (
	// ErrUnavailable means the instance cannot take requests now: its runner
	// is starting, restarting, stopped, or died during the call.
	ErrUnavailable = errors.New("model instance unavailable")
	// ErrInference means ONNX Runtime refused or failed the call.
	ErrInference = errors.New("inference failed")
	// ErrInvalidTensor means the runner rejected the request's tensors: an
	// unknown or missing name, the wrong data type, a shape the model does
	// not accept, or data that does not match its shape. The request is at
	// fault. Errors that carry it also wrap ErrInference.
	ErrInvalidTensor = errors.New("invalid tensor")
	// ErrNoCUDA means the ONNX Runtime library has no CUDA provider.
	ErrNoCUDA = errors.New("ONNX Runtime library has no CUDA support")
	// ErrModelLoad means ONNX Runtime could not load the model file: it is
	// not ONNX, truncated, or uses operators or types the library lacks.
	// The model is at fault, not the server.
	ErrModelLoad = errors.New("model file does not load")
	// ErrOutOfMemory means the kernel killed the runner for exceeding the
	// memory limit of its cgroup. Errors that carry it also wrap
	// ErrUnavailable.
	ErrOutOfMemory = fmt.Errorf("%w: out of memory", ErrUnavailable)
)
