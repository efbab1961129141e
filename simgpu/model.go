package simgpu

import (
	"fmt"
	"math"
	"time"
)

// Model is how one model's executions behave on a simulated device: a
// calibrated curve of batch size and SM share, and its memory.
//
// An execution at batch b costs Launch (host side: kernel launches and
// copies, which no SM share speeds up) plus kernel work K(b) = Fixed +
// PerItem*b measured with enough SMs. A batch of b can use at most
// sat(b) = min(1, Saturation * b^SaturationGrowth) of the device; with a
// share s below that its kernels run at s/sat(b) of full speed, so alone
// on the device
//
//	t(b, s) = Launch + K(b) * max(1, sat(b)/s)
//
// The shape (a knee at a per-model share that moves right with the batch
// size, flat beyond it) is the one Gpulet (Choi et al., USENIX ATC 2022,
// "Serving Heterogeneous Machine Learning Models on Multi-GPU Servers with
// Spatio-Temporal Sharing", figures 2-3) and GSLICE (Dhakal et al., SoCC
// 2020, figure 2) measured for CNN and transformer inference under MPS
// percentages; the presets' numbers are assumptions in that shape, not
// their figures.
type Model struct {
	Name    string
	Launch  time.Duration // per execution, independent of the share
	Fixed   time.Duration // kernel time per execution at saturation
	PerItem time.Duration // kernel time per batch item at saturation
	// Saturation is the share of the device's SMs a batch of 1 can use;
	// SaturationGrowth how that grows with the batch size.
	Saturation       float64
	SaturationGrowth float64
	// Bandwidth is the fraction of the device's memory bandwidth the
	// model's kernels use while they run at their saturation (0..1); on
	// fewer SMs under MPS they use that part of it (Device.bandwidth).
	// Co-running kernels slow each other by the interference term (see
	// Interference).
	Bandwidth float64
	// Weights is the device memory of the loaded model; ActivationPerItem
	// the arena an execution needs per batch item (the arena keeps its
	// high-water mark, as ONNX Runtime's does).
	Weights           int64
	ActivationPerItem int64
	// Warmup is the extra time of the first execution at each batch size
	// in a client (cuDNN's algorithm search, arena growth).
	Warmup time.Duration
	// Block is how long one thread block of the model's kernels runs: a
	// normal-priority kernel that wants SMs this model's below-normal
	// kernels hold waits for their running blocks to end, at most Block
	// (see Priority). 0 is DefaultBlock.
	Block time.Duration
}

// DefaultBlock is Model.Block when a model does not say: an assumption of
// 200 µs (inference kernels run for tens of microseconds to a few
// milliseconds, in one or a few waves of blocks).
const DefaultBlock = 200 * time.Microsecond

// block is the model's block time in seconds.
func (m Model) block() float64 {
	if m.Block > 0 {
		return m.Block.Seconds()
	}
	return DefaultBlock.Seconds()
}

// Check reports a model the curve cannot use.
func (m Model) Check() error {
	switch {
	case m.Launch < 0 || m.Fixed < 0 || m.PerItem < 0 || m.Warmup < 0 || m.Block < 0:
		return fmt.Errorf("simgpu: model %q: negative time", m.Name)
	case m.Fixed+m.PerItem <= 0:
		return fmt.Errorf("simgpu: model %q: no kernel time (fixed and per_item are 0)", m.Name)
	case !(m.Saturation > 0 && m.Saturation <= 1):
		return fmt.Errorf("simgpu: model %q: saturation %v is not in (0, 1]", m.Name, m.Saturation)
	case m.SaturationGrowth < 0 || m.SaturationGrowth > 1:
		return fmt.Errorf("simgpu: model %q: saturation growth %v is not in [0, 1]", m.Name, m.SaturationGrowth)
	case m.Bandwidth < 0 || m.Bandwidth > 1:
		return fmt.Errorf("simgpu: model %q: bandwidth %v is not in [0, 1]", m.Name, m.Bandwidth)
	case m.Weights < 0 || m.ActivationPerItem < 0:
		return fmt.Errorf("simgpu: model %q: negative memory", m.Name)
	}
	return nil
}

// sat is the share of the device a batch of b can use.
func (m Model) sat(b int) float64 {
	return min(1, m.Saturation*math.Pow(float64(max(b, 1)), m.SaturationGrowth))
}

// kernel is K(b) in seconds.
func (m Model) kernel(b int) float64 {
	return (m.Fixed + time.Duration(max(b, 1))*m.PerItem).Seconds()
}

// Time is t(b, s): one execution at batch b with SM share s (0..1], alone
// on the device and warm.
func (m Model) Time(b int, s float64) time.Duration {
	s = min(max(s, 1e-3), 1)
	k := m.kernel(b) * max(1, m.sat(b)/s)
	return m.Launch + time.Duration(k*float64(time.Second))
}

// Arena is the activation memory of an execution at batch b.
func (m Model) Arena(b int) int64 { return int64(max(b, 1)) * m.ActivationPerItem }

const mib = 1 << 20

// Presets are models in the curve's shape, for configs and tests. Their
// numbers are assumptions of the right order for a V100/A100-class device
// (a ResNet-50 batch of 1 in a few milliseconds, a BERT-base sequence of
// 128 in several; weights as the ONNX files' sizes), not measurements.
var Presets = map[string]Model{
	"resnet50": {
		Name: "resnet50", Launch: 300 * time.Microsecond, Fixed: 1500 * time.Microsecond, PerItem: 400 * time.Microsecond,
		Saturation: 0.3, SaturationGrowth: 0.5, Bandwidth: 0.35,
		Weights: 100 * mib, ActivationPerItem: 25 * mib, Warmup: 400 * time.Millisecond, Block: 100 * time.Microsecond,
	},
	"bert-base": {
		Name: "bert-base", Launch: 400 * time.Microsecond, Fixed: 2 * time.Millisecond, PerItem: 1200 * time.Microsecond,
		Saturation: 0.4, SaturationGrowth: 0.5, Bandwidth: 0.5,
		Weights: 420 * mib, ActivationPerItem: 40 * mib, Warmup: 600 * time.Millisecond, Block: 300 * time.Microsecond,
	},
	"mobilenet": {
		Name: "mobilenet", Launch: 200 * time.Microsecond, Fixed: 500 * time.Microsecond, PerItem: 100 * time.Microsecond,
		Saturation: 0.1, SaturationGrowth: 0.6, Bandwidth: 0.2,
		Weights: 14 * mib, ActivationPerItem: 8 * mib, Warmup: 200 * time.Millisecond, Block: 50 * time.Microsecond,
	},
}
