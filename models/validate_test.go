package models

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/runtime"
)

// testVersion is a version with one dynamic FP64 input x [-1, -1] and one
// output y, batching up to maxBatch.
func testVersion(maxBatch int) *version {
	return &version{
		model:    "m",
		maxBatch: maxBatch,
		inputs:   []runtime.TensorSpec{{Name: "x", DataType: runtime.FP64, Shape: []int64{-1, -1}}},
		outputs:  []runtime.TensorSpec{{Name: "y", DataType: runtime.FP64, Shape: []int64{-1, -1}}},
	}
}

// TestValidateByteSizeOverflow: 2^61 FP64 elements need 2^64 bytes, which
// wraps to 0 in int64; an empty tensor must not pass for them. Without an
// element limit (0), only the data size check stands in the way.
func TestValidateByteSizeOverflow(t *testing.T) {
	for _, tc := range []struct {
		name  string
		shape []int64
		data  []byte
		want  string
	}{
		{"wraps to zero", []int64{1, 1 << 61}, nil, "needs 2305843009213693952 × 8 bytes of data, got 0"},
		{"wraps to eight", []int64{1, 1<<61 + 1}, make([]byte, 8), "needs 2305843009213693953 × 8 bytes of data, got 8"},
		{"ragged", []int64{1, 2}, make([]byte, 12), "needs 16 bytes of data, got 12"},
		{"zero dimension", []int64{1, 0}, nil, "has shape [1 0]: dimension 1 is 0; it must be at least 1"},
		{"zero batch", []int64{0, 4}, nil, "dimension 0 is 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP64, Shape: tc.shape, Data: tc.data}}}
			_, err := testVersion(0).validate(req, 0)
			if !errors.Is(err, ErrInvalidInput) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want ErrInvalidInput containing %q", err, tc.want)
			}
		})
	}
	// The largest shape whose bytes fit is still judged by its bytes.
	n := int64(math.MaxInt64 / 8)
	req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP64, Shape: []int64{1, n}}}}
	if _, err := testVersion(0).validate(req, 0); err == nil || !strings.Contains(err.Error(), "needs 9223372036854775800 bytes") {
		t.Errorf("err = %v", err)
	}
}

func TestCheckBatchLimit(t *testing.T) {
	cfg := &configs.Model{Name: "m", File: "repo/m/config.yaml", MaxBatchSize: 2048}
	err := checkBatchLimit(cfg, 1024)
	if want := "repo/m/config.yaml: max_batch_size: 2048 is over the server's limits.max_batch_size (1024)"; err == nil || err.Error() != want {
		t.Errorf("err = %v, want %q", err, want)
	}
	for _, limit := range []int{0, 2048, 4096} {
		if err := checkBatchLimit(cfg, limit); err != nil {
			t.Errorf("limit %d: %v", limit, err)
		}
	}
}

// TestRegistryRefusesBatchOverLimit: a model whose max_batch_size is over
// the server's limit fails to load, with the reason in the index, and starts
// no instance.
func TestRegistryRefusesBatchOverLimit(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1) // max_batch_size 4
	f := &fakeFactory{fail: map[string]error{}}
	r, err := New(Options{
		Repositories: []string{repo}, Control: ControlExplicit, MaxTensorElements: 1 << 20, MaxBatchSize: 2,
		DrainTimeout: time.Second, NewInstance: f.start, Registerer: prometheus.NewRegistry(),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	err = r.Load(t.Context(), "sum")
	if want := "max_batch_size: 4 is over the server's limits.max_batch_size (2)"; !errors.Is(err, ErrBadConfig) || !strings.Contains(err.Error(), want) {
		t.Fatalf("Load = %v, want ErrBadConfig containing %q", err, want)
	}
	idx := r.Index(false)
	if len(idx) != 1 || idx[0].State != StateUnavailable || !strings.Contains(idx[0].Reason, "limits.max_batch_size (2)") {
		t.Errorf("index = %+v", idx)
	}
	if n := len(f.of("sum", 1)); n != 0 {
		t.Errorf("%d instances started", n)
	}
}
