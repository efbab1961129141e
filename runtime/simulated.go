package runtime

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/sloserve/sloserve/simgpu"
)

// SimulatedConfig starts an instance on a simulated GPU (package simgpu).
type SimulatedConfig struct {
	Name      string
	ModelPath string // read for its inputs and outputs only
	Device    *simgpu.Device
	Model     simgpu.Model
	// Env is the limiter's placement environment: the MPS client's
	// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and
	// CUDA_MPS_PINNED_DEVICE_MEM_LIMIT are read from it, as a CUDA client
	// reads them at context creation.
	Env []string
	// Batched says the first dimension of every input and output is the
	// batch (the model's max_batch_size > 0).
	Batched bool
	// OnExit is called once when the instance's client is gone without
	// Stop: a fault on its device.
	OnExit func(Exit)
	Logger *slog.Logger
}

// Simulated is a model instance that runs on a simulated GPU as an MPS
// client: Infer waits for the simulated execution time and answers zeros
// of the model's output shapes and types. The outputs are not the model's:
// it is for exercising the GPU control path, not for answers.
type Simulated struct {
	cfg     SimulatedConfig
	client  *simgpu.Client
	inputs  []TensorSpec
	outputs []TensorSpec

	exitOnce sync.Once
}

var _ Instance = (*Simulated)(nil)

// StartSimulated reads the model file's signature and starts an MPS client
// for it on the device: context creation and weight loading take their
// simulated time, and a client that does not fit the device's memory or
// its pinned limit fails with simgpu.ErrOutOfMemory.
func StartSimulated(ctx context.Context, cfg SimulatedConfig) (*Simulated, error) {
	if cfg.Device == nil {
		return nil, errors.New("runtime: simulated instance without a device")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	ins, outs, err := ReadSignature(cfg.ModelPath)
	if err != nil {
		return nil, err
	}
	spec := simgpu.ClientSpec{Name: cfg.Name, Model: cfg.Model}
	if spec.Percentage, spec.PinnedMemory, err = mpsLimits(cfg.Env, cfg.Device.Index()); err != nil {
		return nil, err
	}
	c, err := cfg.Device.StartClient(ctx, spec)
	if err != nil {
		return nil, fmt.Errorf("%w: starting the simulated client %s on device %d: %w", ErrUnavailable, cfg.Name, cfg.Device.Index(), err)
	}
	cfg.Logger.Info("simulated instance started", "device", cfg.Device.Index(), "percentage", spec.Percentage,
		"pinned_memory", spec.PinnedMemory, "pid", c.PID(), "memory", c.Memory())
	return &Simulated{cfg: cfg, client: c, inputs: ins, outputs: outs}, nil
}

// mpsLimits reads an MPS client's limits from its environment: the
// percentage (0 when unset) and the pinned memory limit for the device in
// bytes ("<device>=<size>" entries, size with a M or G suffix; 0 when
// unset).
func mpsLimits(env []string, device int) (pct int, pinned int64, err error) {
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE":
			if pct, err = strconv.Atoi(v); err != nil || pct < 1 || pct > 100 {
				return 0, 0, fmt.Errorf("runtime: %s=%s: want 1..100", k, v)
			}
		case "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT":
			for entry := range strings.SplitSeq(v, ",") {
				dev, size, ok := strings.Cut(entry, "=")
				if !ok || dev != strconv.Itoa(device) {
					continue
				}
				unit := int64(1)
				switch {
				case strings.HasSuffix(size, "M"):
					unit, size = 1<<20, strings.TrimSuffix(size, "M")
				case strings.HasSuffix(size, "G"):
					unit, size = 1<<30, strings.TrimSuffix(size, "G")
				}
				n, err := strconv.ParseInt(size, 10, 64)
				if err != nil || n < 1 {
					return 0, 0, fmt.Errorf("runtime: %s=%s: want <device>=<size>[M|G]", k, v)
				}
				pinned = n * unit
			}
		}
	}
	return pct, pinned, nil
}

// Inputs are the model's inputs, from its file.
func (s *Simulated) Inputs() []TensorSpec { return slices.Clone(s.inputs) }

// Outputs are the model's outputs, from its file.
func (s *Simulated) Outputs() []TensorSpec { return slices.Clone(s.outputs) }

// Pid is the simulated client's process id, as the simulator's NVML
// readings report it.
func (s *Simulated) Pid() int { return s.client.PID() }

// Status says whether the client serves, and if not why.
func (s *Simulated) Status() (bool, string) {
	if err := s.client.Err(); err != nil {
		return false, "simulated client: " + err.Error()
	}
	return true, ""
}

// Stop ends the client and frees its device memory.
func (s *Simulated) Stop(context.Context) error {
	s.exitOnce.Do(func() {}) // a stop is no unexpected exit
	s.client.Close()
	return nil
}

// Infer checks the request against the model's inputs, waits for the
// simulated execution and answers zeros of the output shapes. A fault on
// the device is ErrUnavailable; device memory that runs out for the
// batch's activations is ErrInference, as ONNX Runtime's failed
// allocation would be.
func (s *Simulated) Infer(ctx context.Context, req *InferRequest) (*InferResponse, error) {
	batch, err := s.check(req)
	if err != nil {
		return nil, err
	}
	took, err := s.client.Execute(ctx, batch)
	switch {
	case err == nil:
	case ctx.Err() != nil:
		return nil, ctx.Err()
	case errors.Is(err, simgpu.ErrOutOfMemory):
		return nil, fmt.Errorf("%w: %w", ErrInference, err)
	default:
		if errors.Is(err, simgpu.ErrDeviceFault) && s.cfg.OnExit != nil {
			s.exitOnce.Do(func() { s.cfg.OnExit(Exit{Cause: err.Error()}) })
		}
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	resp := &InferResponse{Timing: Timing{Infer: took}}
	for _, o := range s.outputs {
		if len(req.Outputs) > 0 && !slices.Contains(req.Outputs, o.Name) {
			continue
		}
		shape := make([]int64, len(o.Shape))
		for i, d := range o.Shape {
			switch {
			case d >= 0:
				shape[i] = d
			case i == 0 && s.cfg.Batched:
				shape[i] = int64(batch)
			default:
				shape[i] = 1
			}
		}
		n, err := ElementCount(shape, 1<<28)
		if err != nil {
			return nil, fmt.Errorf("%w: output %s: %w", ErrInference, o.Name, err)
		}
		size := o.DataType.ByteSize(n)
		if o.DataType == Bytes {
			size = 4 * n // each element an empty string
		}
		resp.Outputs = append(resp.Outputs, Tensor{Name: o.Name, DataType: o.DataType, Shape: shape, Data: make([]byte, size)})
	}
	return resp, nil
}

// check validates the request's tensors as a runner would and returns
// its batch size.
func (s *Simulated) check(req *InferRequest) (int, error) {
	batch := 1
	if len(req.Inputs) != len(s.inputs) {
		return 0, fmt.Errorf("%w: %w: %d inputs, the model has %d", ErrInference, ErrInvalidTensor, len(req.Inputs), len(s.inputs))
	}
	for i, t := range req.Inputs {
		j := slices.IndexFunc(s.inputs, func(in TensorSpec) bool { return in.Name == t.Name })
		if j < 0 {
			return 0, fmt.Errorf("%w: %w: unknown input %q", ErrInference, ErrInvalidTensor, t.Name)
		}
		in := s.inputs[j]
		if t.DataType != in.DataType {
			return 0, fmt.Errorf("%w: %w: input %s is %s, the model wants %s", ErrInference, ErrInvalidTensor, t.Name, t.DataType, in.DataType)
		}
		if in.Shape != nil && len(t.Shape) != len(in.Shape) {
			return 0, fmt.Errorf("%w: %w: input %s has rank %d, the model wants %d", ErrInference, ErrInvalidTensor, t.Name, len(t.Shape), len(in.Shape))
		}
		if i == 0 && s.cfg.Batched && len(t.Shape) > 0 {
			batch = int(max(1, t.Shape[0]))
		}
	}
	return batch, nil
}
