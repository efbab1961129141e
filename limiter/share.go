package limiter

import (
	"fmt"
	"log/slog"
	"math"
)

// Share is what one model instance may use of its device.
type Share struct {
	// Compute is the fraction of the device's compute: for the CPU device,
	// of all CPUs the server may use (so 0.25 on 2 CPUs is half a core).
	// 0 or >= 1 means no compute limit.
	Compute float64
	// Memory is in bytes; 0 means no memory limit.
	Memory int64
	// Mode says how Compute is enforced on CPU (ModeCap by default). GPU
	// backends read Compute as a fixed percentage whatever the mode.
	Mode Mode
}

// LimitedOrWhole is a compute share with no limit (0 or >= 1) counted as
// the whole device.
func LimitedOrWhole(compute float64) float64 {
	if compute <= 0 || compute >= 1 {
		return 1
	}
	return compute
}

// Mode is how a CPU compute share is enforced.
type Mode uint8

const (
	// ModeCap makes Compute a hard quota (CFS quota, cpu.max): the
	// instance never uses more, even while cores sit idle, like a
	// dedicated slice. The static policy's mode.
	ModeCap Mode = iota
	// ModeFloor makes Compute a work-conserving guarantee: no quota, and
	// a scheduling weight (cpu.shares, cpu.weight) in proportion to
	// Compute and well above the default, so the instance takes idle
	// cores at once and, on a busy device, at least its share. For
	// latency-critical models.
	ModeFloor
	// ModeBackground makes Compute a hard quota and puts the instance in
	// the idle scheduling class (cpu.idle; the lowest weight where the
	// kernel has no cpu.idle): it runs on what the other instances and
	// the server leave, and yields the CPU the moment they want it. For
	// best-effort models.
	ModeBackground
)

func (m Mode) String() string {
	switch m {
	case ModeCap:
		return "cap"
	case ModeFloor:
		return "floor"
	case ModeBackground:
		return "background"
	}
	return fmt.Sprintf("mode(%d)", uint8(m))
}

// fraction reports whether Compute is a fraction of the device, whatever
// the mode.
func (s Share) fraction() bool { return s.Compute > 0 && s.Compute < 1 }

// limited reports whether the share caps compute on CPU. A floor is not a
// limit: it guarantees, and caps nothing.
func (s Share) limited() bool { return s.Mode != ModeFloor && s.Compute > 0 && s.Compute < 1 }

// LogValue logs a share as its two numbers.
func (s Share) LogValue() slog.Value {
	return slog.GroupValue(slog.Float64("compute", s.Compute), slog.Int64("memory", s.Memory), slog.String("mode", s.Mode.String()))
}

// ThreadsFor is the intra-op thread count for a compute share on cpus
// CPUs: ceil(share*cpus), at least 1; cpus when there is no limit.
func ThreadsFor(s Share, cpus int) int {
	cpus = max(cpus, 1)
	if !s.limited() {
		return cpus
	}
	// Guard against 0.5*2 = 1.0000000000000002 style round-up.
	n := int(math.Ceil(s.Compute*float64(cpus) - 1e-9))
	return min(max(n, 1), cpus)
}

// validShare rejects shares no backend can mean.
func validShare(s Share) error {
	if math.IsNaN(s.Compute) || s.Compute < 0 {
		return fmt.Errorf("limiter: compute share %v is not a fraction", s.Compute)
	}
	if s.Memory < 0 {
		return fmt.Errorf("limiter: memory share %d is negative", s.Memory)
	}
	if s.Mode > ModeBackground {
		return fmt.Errorf("limiter: unknown share mode %d", s.Mode)
	}
	return nil
}
