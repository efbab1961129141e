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
	// ErrInvalidTensor means the runner rejected the request's tensors: an
	// unknown or missing name, the wrong data type, a shape the model does
	// not accept, or data that does not match its shape. The request is at
	// fault. Errors that carry it also wrap ErrInference.
	ErrInvalidTensor = errors.New("invalid tensor")
	// ErrNoCUDA means the ONNX Runtime library has no CUDA provider.
	ErrNoCUDA = errors.New("ONNX Runtime library has no CUDA support")
)
