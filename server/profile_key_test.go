package server

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/predictor"
)

// A cached profile is reused only under the limiter kind that measured
// it: the same share runs on a quota under cgroups and on whole CPUs under
// the unprivileged backend, so a profile from one would mislead the other.
func TestProfileCacheKeyedByLimiter(t *testing.T) {
	dir := t.TempDir()
	model := filepath.Join(dir, "model.onnx")
	if err := os.WriteFile(model, []byte("not a real model: only its bytes are hashed"), 0o644); err != nil {
		t.Fatal(err)
	}
	pred, err := predictor.New(predictor.Options{})
	if err != nil {
		t.Fatal(err)
	}
	p := &profiler{
		cfg:   configs.Profile{Runs: 1, Budget: time.Minute},
		cache: predictor.Cache{Dir: filepath.Join(dir, "cache")},
		pred:  pred,
		lib:   "libonnxruntime.so.1.30.0",
		log:   slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	measured := 0
	run := func(kind string) {
		t.Helper()
		err := p.run(t.Context(), models.ProfileRun{
			Key: "m/1", Device: "cpu", Path: model, Config: &configs.Model{MaxBatchSize: 2},
			MaxShare: 1, BatchSizes: []int{1, 2}, Limiter: kind,
			Measure: func(_ context.Context, batch int, share float64, _ int) (time.Duration, error) {
				measured++
				return time.Duration(float64(batch)*float64(time.Millisecond)/share) + time.Millisecond, nil
			},
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	run("cgroup-v1")
	first := measured
	if first == 0 {
		t.Fatal("the first profile measured nothing")
	}
	run("unprivileged")
	if measured == first {
		t.Error("a profile measured under cgroups was reused under the unprivileged limiter")
	}
	again := measured
	run("cgroup-v1")
	if measured != again {
		t.Errorf("the cgroup profile was measured again (%d points), want it from the cache", measured-again)
	}
}
