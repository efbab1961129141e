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
	"sync/atomic"
	"time"

	"github.com/sloserve/sloserve/simgpu"
)

// SimulatedConfig starts an instance on a simulated GPU (package simgpu).
type SimulatedConfig struct {
	Name      string
	ModelPath string // read for its inputs and outputs only
	Device    *simgpu.Device
	Model     simgpu.Model
	// Env is the limiter's placement environment: the MPS client's
	// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
	// CUDA_MPS_PINNED_DEVICE_MEM_LIMIT and CUDA_MPS_CLIENT_PRIORITY are
	// read from it, as a CUDA client reads them at context creation.
	Env []string
	// PlacedFor is the device the limiter placed the client for, whose
	// entry of CUDA_MPS_PINNED_DEVICE_MEM_LIMIT applies (default Device):
	// a client started elsewhere (a risky model kept apart) keeps its
	// limit.
	PlacedFor *simgpu.Device
	// Batched says the first dimension of every input and output is the
	// batch (the model's max_batch_size > 0).
	Batched bool
	// OnExit is called once per client that is gone without Stop or a
	// restart: a fault on its device took it down.
	OnExit func(Exit)
	// OnRestart is called when the instance has replaced its client, with
	// the reason (a hung client found by Suspect, a recovery).
	OnRestart func(reason string)
	// Restarting, when set, is called before each replacement client
	// starts, and its ready with that client's pid once it is warm, before
	// it serves (RunnerConfig.Restarting): an error from ready fails the
	// restart, and the new client is closed.
	Restarting func() (ready func(pid int) error)
	// ProbeTimeout bounds the probe execution Suspect runs (default
	// DefaultProbeTimeout).
	ProbeTimeout time.Duration
	Logger       *slog.Logger
}

// DefaultProbeTimeout is SimulatedConfig.ProbeTimeout's default.
const DefaultProbeTimeout = 5 * time.Second

// Simulated is a model instance that runs on a simulated GPU as an MPS
// client: Infer waits for the simulated execution time and answers zeros
// of the model's output shapes and types. The outputs are not the model's:
// it is for exercising the GPU control path, not for answers.
//
// Like a runner, it replaces a client that hangs (Suspect probes it, and
// a probe without an answer restarts it); a client a device fault took
// down is replaced by Recover, which the server calls once the device's
// daemon is back.
type Simulated struct {
	cfg     SimulatedConfig
	spec    simgpu.ClientSpec
	inputs  []TensorSpec
	outputs []TensorSpec

	client atomic.Pointer[simgpu.Client]
	failed atomic.Int64  // calls answered ErrUnavailable
	done   atomic.Int64  // executions that finished: progress
	warm   atomic.Uint64 // bit b-1: batch size b (up to 64) has run

	restartMu sync.Mutex // serialises replacing the client

	mu       sync.Mutex
	device   *simgpu.Device
	state    string // why the instance does not serve though its client may; "" when it does
	checking bool
	stopped  bool
}

var (
	_ Instance                     = (*Simulated)(nil)
	_ interface{ Suspect(string) } = (*Simulated)(nil)
	_ Checker                      = (*Simulated)(nil)
	_ StarvationMeter              = (*Simulated)(nil)
	_ BatchCapacity                = (*Simulated)(nil)
)

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
	if cfg.ProbeTimeout <= 0 {
		cfg.ProbeTimeout = DefaultProbeTimeout
	}
	ins, outs, err := ReadSignature(cfg.ModelPath)
	if err != nil {
		return nil, err
	}
	spec := simgpu.ClientSpec{Name: cfg.Name, Model: cfg.Model}
	placed := cfg.PlacedFor
	if placed == nil {
		placed = cfg.Device
	}
	if spec.Percentage, spec.PinnedMemory, err = mpsLimits(cfg.Env, placed.Index()); err != nil {
		return nil, err
	}
	if spec.Priority, err = mpsPriority(cfg.Env); err != nil {
		return nil, err
	}
	s := &Simulated{cfg: cfg, spec: spec, inputs: ins, outputs: outs, device: cfg.Device}
	c, err := s.startClient(ctx, cfg.Device)
	if err != nil {
		return nil, err
	}
	s.client.Store(c)
	s.watch(c)
	return s, nil
}

// startClient starts a client of the instance's spec on dev.
func (s *Simulated) startClient(ctx context.Context, dev *simgpu.Device) (*simgpu.Client, error) {
	c, err := dev.StartClient(ctx, s.spec)
	if err != nil {
		return nil, fmt.Errorf("%w: starting the simulated client %s on device %d: %w", ErrUnavailable, s.cfg.Name, dev.Index(), err)
	}
	s.cfg.Logger.Info("simulated instance started", "device", dev.Index(), "percentage", s.spec.Percentage,
		"priority", s.spec.Priority.String(), "pinned_memory", s.spec.PinnedMemory, "pid", c.PID(), "memory", c.Memory())
	return c, nil
}

// watch reports c's end to OnExit when a fault took it down while it was
// the instance's client, as a runner's supervisor sees its process exit.
func (s *Simulated) watch(c *simgpu.Client) {
	go func() {
		<-c.Done()
		s.mu.Lock()
		current := !s.stopped && s.client.Load() == c
		s.mu.Unlock()
		if err := c.Err(); current && errors.Is(err, simgpu.ErrDeviceFault) && s.cfg.OnExit != nil {
			s.cfg.OnExit(Exit{Cause: err.Error()})
		}
	}()
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

// mpsPriority reads an MPS client's CUDA_MPS_CLIENT_PRIORITY from its
// environment: 0 (normal, also when unset) or 1 (below normal).
func mpsPriority(env []string) (simgpu.Priority, error) {
	p := simgpu.PriorityNormal
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		if k != "CUDA_MPS_CLIENT_PRIORITY" {
			continue
		}
		switch v {
		case "0":
			p = simgpu.PriorityNormal
		case "1":
			p = simgpu.PriorityBelowNormal
		default:
			return 0, fmt.Errorf("runtime: %s=%s: want 0 (normal) or 1 (below normal)", k, v)
		}
	}
	return p, nil
}

// MaxBatch is the largest batch whose arena fits the client's pinned
// memory limit beside its context and weights (the limit holds under an
// MPS daemon only); unbounded without a limit, for a model without a batch
// dimension, or one whose executions need no arena.
func (s *Simulated) MaxBatch() (int, bool) {
	c := s.client.Load()
	pinned, per := c.Spec().PinnedMemory, s.spec.Model.ActivationPerItem
	if pinned <= 0 || per <= 0 || !s.cfg.Batched || !c.Limited() {
		return 0, false
	}
	room := pinned - simgpu.ContextMemory - s.spec.Model.Weights
	return int(max(room, 0) / per), true
}

// Inputs are the model's inputs, from its file.
func (s *Simulated) Inputs() []TensorSpec { return slices.Clone(s.inputs) }

// Outputs are the model's outputs, from its file.
func (s *Simulated) Outputs() []TensorSpec { return slices.Clone(s.outputs) }

// Pid is the simulated client's process id, as the simulator's NVML
// readings report it.
func (s *Simulated) Pid() int { return s.client.Load().PID() }

// Client is the instance's current simulated client (for tests that
// raise faults or hangs in it).
func (s *Simulated) Client() *simgpu.Client { return s.client.Load() }

// Device is the simulated device the instance's client is on.
func (s *Simulated) Device() *simgpu.Device {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.device
}

// Name is the instance's name (its client's).
func (s *Simulated) Name() string { return s.cfg.Name }

// Failed is how many calls the instance answered with ErrUnavailable: its
// client gone, hung or being replaced.
func (s *Simulated) Failed() int64 { return s.failed.Load() }

// Status says whether the client serves, and if not why.
func (s *Simulated) Status() (bool, string) {
	s.mu.Lock()
	state := s.state
	s.mu.Unlock()
	if state != "" {
		return false, state
	}
	if err := s.client.Load().Err(); err != nil {
		return false, "simulated client: " + err.Error()
	}
	return true, ""
}

// Gone reports whether the instance's client is gone (a fault took it
// down) and has not been replaced.
func (s *Simulated) Gone() bool { return s.client.Load().Err() != nil }

// Stop ends the client and frees its device memory.
func (s *Simulated) Stop(context.Context) error {
	s.mu.Lock()
	s.stopped = true
	s.mu.Unlock()
	s.client.Load().Close()
	return nil
}

// errStopped is a restart of a stopped instance.
var errStopped = errors.New("runtime: the simulated instance is stopped")

// Recover replaces a client that is gone, on dev (nil: the device it was
// on), and returns once the new client serves or has failed to start
// (simgpu.ErrOutOfMemory, simgpu.ErrDaemonDown: the instance then reports
// why it is not ready). A client that still serves on dev is kept.
func (s *Simulated) Recover(ctx context.Context, dev *simgpu.Device, reason string) error {
	return s.replace(ctx, dev, reason, false, nil)
}

// replace starts a new client on dev (nil: the current device) and closes
// the old one; unless force, a client that serves on dev is kept.
func (s *Simulated) replace(ctx context.Context, dev *simgpu.Device, reason string, force bool, cost func() string) error {
	s.restartMu.Lock()
	defer s.restartMu.Unlock()
	s.mu.Lock()
	if s.stopped {
		s.mu.Unlock()
		return errStopped
	}
	if dev == nil {
		dev = s.device
	}
	old := s.client.Load()
	if !force && old.Err() == nil && dev == s.device && s.state == "" {
		s.mu.Unlock()
		return nil
	}
	s.state = "restarting its simulated client: " + reason
	s.mu.Unlock()
	old.Close()
	var ready func(int) error
	if s.cfg.Restarting != nil {
		ready = s.cfg.Restarting()
	}
	c, err := s.startClient(ctx, dev)
	if err == nil {
		err = s.warmUp(ctx, c)
	}
	if err == nil && ready != nil {
		if err = ready(c.PID()); err != nil {
			c.Close()
		}
	}
	s.mu.Lock()
	switch {
	case err != nil:
		s.state = "restarting its simulated client failed: " + err.Error()
		s.mu.Unlock()
		return err
	case s.stopped:
		s.mu.Unlock()
		c.Close()
		return errStopped
	}
	s.client.Store(c)
	s.device, s.state = dev, ""
	s.mu.Unlock()
	s.watch(c)
	if s.cfg.OnRestart != nil {
		if cost != nil {
			reason += "; " + cost()
		}
		s.cfg.OnRestart(reason)
	}
	return nil
}

// warmUp runs one execution on a new client at each batch size the
// instance has run, as a runner warms its session up before it serves: the
// first execution at a size pays cuDNN's search, which a request would
// otherwise pay (and the latency estimate learn). It closes c on failure.
func (s *Simulated) warmUp(ctx context.Context, c *simgpu.Client) error {
	for bits, b := s.warm.Load(), 1; bits != 0; bits, b = bits>>1, b+1 {
		if bits&1 == 0 {
			continue
		}
		if _, err := c.Execute(ctx, b); err != nil {
			c.Close()
			return fmt.Errorf("%w: warming the simulated client %s up at batch %d: %w", ErrUnavailable, s.cfg.Name, b, err)
		}
	}
	return nil
}

// Suspect tells the instance that a call on it got no answer in time (why
// says which). It stops serving, probes its client with one execution
// under ProbeTimeout, and serves again when the probe answers. A probe
// without an answer means a hung client, which is replaced on the same
// device, only when the client held SMs meanwhile and finished nothing:
// a hung kernel keeps its SMs. A client that held (on average) less than
// one SM over the probe was starved (a below-normal client that normal
// work leaves no SM), and one that finished an execution meanwhile made
// progress: neither is hung, and it is probed again, out of service (its
// calls wait for the check's end; see Checking), until it answers or
// is found hung. The rest of the device is left alone: a hang is not a
// fault.
func (s *Simulated) Suspect(why string) {
	s.mu.Lock()
	if s.stopped || s.checking || s.state != "" {
		s.mu.Unlock()
		return
	}
	s.checking = true
	s.state = "checking its simulated client: " + why
	s.mu.Unlock()
	since, failed := time.Now(), s.failed.Load()
	go func() {
		c := s.client.Load()
		var err error
		for probes := 1; ; probes++ {
			var starved bool
			var waits string
			starved, waits, err = s.probe(c)
			if err == nil || c.Err() != nil || !starved || s.isStopped() {
				break
			}
			if probes == 1 {
				s.cfg.Logger.Warn("simulated client did not answer its probe, but it was starved of SMs or made progress; not hung, checking again", "why", why, "probe", err, "waits", waits)
			}
		}
		s.mu.Lock()
		s.checking = false
		s.state = ""
		s.mu.Unlock()
		if err == nil || c.Err() != nil || s.isStopped() {
			return // it answers, or a fault took it down: Recover's
		}
		s.cfg.Logger.Warn("simulated client hung: replacing it", "why", why, "probe", err)
		cost := func() string {
			return fmt.Sprintf("serving again %s after the suspicion, %d calls failed meanwhile",
				time.Since(since).Round(time.Millisecond), s.failed.Load()-failed)
		}
		if err := s.replace(context.Background(), nil, "hung: "+why, true, cost); err != nil {
			s.cfg.Logger.Warn("replacing a hung simulated client", "err", err)
		}
	}()
}

// probe runs one execution on c under ProbeTimeout. When it gets no
// answer, starved says whether c is not hung all the same: it held less
// than one SM on average meanwhile (MPS hands out whole SMs, so a hung
// kernel holds at least one all along), or an execution of the
// instance's finished meanwhile.
func (s *Simulated) probe(c *simgpu.Client) (starved bool, waits string, err error) {
	start, sm0, done0 := time.Now(), c.SMSeconds(), s.done.Load()
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.ProbeTimeout)
	_, err = c.Execute(ctx, 1)
	cancel()
	if err == nil {
		s.done.Add(1)
		return false, "", nil
	}
	took := time.Since(start)
	held := (c.SMSeconds() - sm0) / max(took.Seconds(), 1e-9) * float64(c.Device().SMs())
	progress := s.done.Load() - done0
	return held < 1 || progress > 0, fmt.Sprintf("probe took %v, the client held %.2f SMs on average meanwhile, %d executions finished", took.Round(time.Millisecond), held, progress), err
}

func (s *Simulated) isStopped() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stopped
}

// Starved reports whether the client is starved of SMs over the window
// from now: it holds less than one SM on average and finishes no
// execution meanwhile (see probe). It returns early, false, when done is
// closed.
func (s *Simulated) Starved(window time.Duration, done <-chan struct{}) bool {
	c := s.client.Load()
	sm0, done0 := c.SMSeconds(), s.done.Load()
	t := time.NewTimer(window)
	defer t.Stop()
	select {
	case <-t.C:
	case <-done:
		return false
	case <-c.Done():
		return false
	}
	held := (c.SMSeconds() - sm0) / window.Seconds() * float64(c.Device().SMs())
	return held < 1 && s.done.Load() == done0
}

// Checking reports whether the instance is out of service for a check
// (Suspect's probe) only: alive, and back soon or replaced. A pool lets a
// call wait for the check's end rather than fail it at once.
func (s *Simulated) Checking() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.checking && !s.stopped
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
	// Being checked or restarted; a client that is gone fails in Execute.
	s.mu.Lock()
	why := s.state
	s.mu.Unlock()
	if why != "" {
		s.failed.Add(1)
		return nil, fmt.Errorf("%w: %s", ErrUnavailable, why)
	}
	took, err := s.client.Load().Execute(ctx, batch)
	switch {
	case err == nil:
		s.done.Add(1)
	case ctx.Err() != nil:
		return nil, ctx.Err()
	case errors.Is(err, simgpu.ErrOutOfMemory):
		return nil, fmt.Errorf("%w: %w", ErrInference, err)
	default:
		s.failed.Add(1)
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	if batch <= 64 {
		if bit := uint64(1) << (batch - 1); s.warm.Load()&bit == 0 {
			s.warm.Or(bit)
		}
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
