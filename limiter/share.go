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
}

// limited reports whether the share limits compute.
func (s Share) limited() bool { return s.Compute > 0 && s.Compute < 1 }

// LogValue logs a share as its two numbers.
func (s Share) LogValue() slog.Value {
	return slog.GroupValue(slog.Float64("compute", s.Compute), slog.Int64("memory", s.Memory))
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
	return nil
}
