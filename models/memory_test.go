package models

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/runtime"
)

// peakLimiter is the fake limiter whose units read a peak and a current
// memory the test sets.
type peakLimiter struct {
	*fakeLimiter
	peak, current atomic.Int64
}

func (l *peakLimiter) Stats(id string) (limiter.Stats, error) {
	st, err := l.fakeLimiter.Stats(id)
	if err != nil {
		return st, err
	}
	st.MemoryPeak, st.MemoryBytes = l.peak.Load(), l.current.Load()
	return st, nil
}

// The profile run reads the instance's peak memory after each point (the
// working set the predictor keeps per batch size), and InstanceMemory
// reads what it holds now.
func TestProfileReadsPeakMemory(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+
		"execution: {intra_op_threads: 1}\nresources: {memory_limit: 1GiB}\nprofile: {batch_sizes: [1, 4]}\n", 1)
	lim := &peakLimiter{fakeLimiter: newFakeLimiter(2)}
	var read []int64
	r, _ := newShareRegistry(t, repo, lim, func(ctx context.Context, run ProfileRun) error {
		if run.Memory == nil {
			return fmt.Errorf("the profile run has no memory reading")
		}
		for _, b := range run.BatchSizes {
			lim.peak.Store(int64(b) << 20) // what the instance reached running b
			if _, err := run.Measure(ctx, b, 0.5, 1); err != nil {
				return err
			}
			read = append(read, run.Memory())
		}
		return nil
	})
	if len(read) != 2 || read[0] != 1<<20 || read[1] != 4<<20 {
		t.Errorf("peaks read %v, want [1MiB 4MiB]", read)
	}
	lim.current.Store(3 << 20)
	if got := r.InstanceMemory("sum/1"); got != 3<<20 {
		t.Errorf("InstanceMemory = %d, want 3MiB", got)
	}
	if got := r.InstanceMemory("nobody/1"); got != 0 {
		t.Errorf("InstanceMemory of an unknown model = %d, want 0", got)
	}
}

// A version with an input dynamic in more than the batch records no
// working set: a request larger than its profile.shapes would need more
// than any profiled batch.
func TestWorkingSetOnlyForFixedShapes(t *testing.T) {
	fixed := &version{inputs: []runtime.TensorSpec{{Name: "x", DataType: runtime.FP32, Shape: []int64{-1, 4}}}, maxBatch: 4}
	if fixed.workingSetReader() == nil {
		t.Error("a version fixed apart from the batch has no memory reading")
	}
	dynamic := &version{inputs: []runtime.TensorSpec{{Name: "x", DataType: runtime.FP32, Shape: []int64{-1, 3, -1, -1}}}, maxBatch: 4}
	if dynamic.workingSetReader() != nil {
		t.Error("a version with dynamic image sides reads working sets")
	}
}
