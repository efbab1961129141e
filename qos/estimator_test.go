package qos

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

func TestEWMAEstimator(t *testing.T) {
	ms := time.Millisecond
	tests := []struct {
		name     string
		observed map[int][]time.Duration // batch -> observations in order
		batch    int
		want     time.Duration
		known    bool
	}{
		{"nothing known", nil, 1, 0, false},
		{"first observation", map[int][]time.Duration{1: {10 * ms}}, 1, 10 * ms, true},
		{"moving average", map[int][]time.Duration{1: {10 * ms, 20 * ms}}, 1, 15 * ms, true},
		{"one size scales proportionally", map[int][]time.Duration{2: {10 * ms}}, 6, 30 * ms, true},
		{"one size scales down", map[int][]time.Duration{4: {8 * ms}}, 1, 2 * ms, true},
		{"interpolation", map[int][]time.Duration{1: {10 * ms}, 5: {30 * ms}}, 3, 20 * ms, true},
		{"extrapolation", map[int][]time.Duration{1: {10 * ms}, 2: {15 * ms}}, 8, 45 * ms, true},
		// c = 48/14 ms, a = 6 ms.
		{"least squares", map[int][]time.Duration{1: {10 * ms}, 2: {12 * ms}, 4: {20 * ms}}, 8, time.Duration((6 + 8*48.0/14) * float64(ms)), true},
		// t = 12ms - 1ms*b fits; a bigger batch is never faster than the largest known.
		{"decreasing fit clamped up", map[int][]time.Duration{1: {11 * ms}, 2: {10 * ms}}, 20, 10 * ms, true},
		// a = -10ms, c = 10ms: b=1 would be 0; proportional to the smallest known instead.
		{"never zero", map[int][]time.Duration{2: {10 * ms}, 3: {20 * ms}}, 1, 5 * ms, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := NewEWMAEstimator(0.5)
			for b, obs := range tt.observed {
				for _, d := range obs {
					e.Observe("m", b, d)
				}
			}
			got, known := e.Estimate("m", tt.batch)
			if known != tt.known || (got-tt.want).Abs() > time.Microsecond {
				t.Errorf("Estimate(%d) = %v, %v; want %v, %v", tt.batch, got, known, tt.want, tt.known)
			}
			if known && got <= 0 {
				t.Errorf("Estimate(%d) = %v, must be positive", tt.batch, got)
			}
			if _, ok := e.Estimate("other", tt.batch); ok {
				t.Error("another model is known")
			}
		})
	}
}

func TestWarmup(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		runs := map[int]int{}
		exec := ExecutorFunc(func(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
			b := int(req.Inputs[0].Shape[0])
			runs[b]++
			d := time.Duration(b) * time.Millisecond
			if runs[b] == 1 {
				d *= 10 // a slow first run must not count
			}
			time.Sleep(d)
			return &runtime.InferResponse{}, nil
		})
		est := NewEWMAEstimator(0.5)
		sample := func(b int) *runtime.InferRequest {
			return &runtime.InferRequest{Inputs: []runtime.Tensor{fp32([]int64{int64(b)}, make([]float32, b)...)}}
		}
		if err := Warmup(t.Context(), "m", exec, est, []int{1, 4}, 2, sample); err != nil {
			t.Fatal(err)
		}
		if runs[1] != 3 || runs[4] != 3 {
			t.Errorf("runs = %v, want 3 per size", runs)
		}
		for _, b := range []int{1, 4} {
			if got, _ := est.Estimate("m", b); got != time.Duration(b)*time.Millisecond {
				t.Errorf("Estimate(%d) = %v", b, got)
			}
		}
	})
}
