package runtime

import (
	"context"
	"errors"
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
	// ErrNoCUDA means the ONNX Runtime library has no CUDA provider.
	ErrNoCUDA = errors.New("ONNX Runtime library has no CUDA support")
)
