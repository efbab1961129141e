package models

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/qos"
)

// writePbtxtModel creates a model folder with a Triton config.pbtxt and
// empty version files.
func writePbtxtModel(t *testing.T, repo, name, pbtxt string, versions ...int) {
	t.Helper()
	writeModel(t, repo, name, "", versions...)
	dir := filepath.Join(repo, name)
	if err := os.Remove(filepath.Join(dir, configs.ModelConfigFile)); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, configs.ModelConfigPbtxt), []byte(pbtxt), 0o644); err != nil {
		t.Fatal(err)
	}
}

// A folder with only a config.pbtxt loads as one with a config.yaml does,
// reloads when it changes (poll mode), and answers its config with the
// loaded model's inputs and outputs.
func TestRegistryServesConfigPbtxt(t *testing.T) {
	repo := t.TempDir()
	writePbtxtModel(t, repo, "sum", `max_batch_size: 4
instance_group { count: 1 kind: KIND_CPU }
parameters { key: "slo.latency_ms" value: { string_value: "200" } }
`, 1)
	r, f, _ := newTestRegistry(t, ControlPoll, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 2, 3, 4})); err != nil {
		t.Fatal(err)
	}
	cfg, err := r.ModelConfig("sum", "")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.MaxBatchSize != 4 || cfg.SLO.LatencyMS != 200 || cfg.SLO.Class != configs.ClassLatencyCritical ||
		len(cfg.Inputs) != 1 || cfg.Inputs[0].Name != "x" || fmt.Sprint(cfg.Inputs[0].Shape) != "[-1 4]" ||
		len(cfg.Outputs) != 1 || cfg.Outputs[0].Name != "y" {
		t.Errorf("config %+v", cfg)
	}

	writePbtxtModel(t, repo, "sum", "max_batch_size: 4\ninstance_group { count: 2 }\n")
	r.pollOnce(t.Context())
	live := 0
	for _, fi := range f.of("sum", 1) {
		if !fi.stopped.Load() {
			live++
		}
	}
	if live != 2 {
		t.Errorf("after the config.pbtxt changed: %d live instances, want 2", live)
	}
	if _, err := r.ModelConfig("nope", ""); !errors.Is(err, ErrModelNotFound) {
		t.Errorf("unknown model: %v", err)
	}
}

// Statistics count executions by batch size where they run; warm-up runs
// are not clients' executions and are not counted.
func TestRegistryBatchStatistics(t *testing.T) {
	t.Run("unscheduled", func(t *testing.T) {
		repo := t.TempDir()
		writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
		r, _, _ := newTestRegistry(t, ControlPoll, repo)
		if err := r.Start(t.Context()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Stop(context.Background()) })
		for _, rows := range [][][4]float32{{{1}}, {{1}, {2}}, {{1}, {2}}} {
			if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest(rows...)); err != nil {
				t.Fatal(err)
			}
		}
		st, _ := r.Statistics("sum", "1")
		b := st[0].Batches
		if st[0].ExecutionCount != 3 || len(b) != 2 || b[0].BatchSize != 1 || b[0].ComputeInfer.Count != 1 ||
			b[1].BatchSize != 2 || b[1].ComputeInfer.Count != 2 || b[1].ComputeInfer.Total != 2*time.Millisecond {
			t.Errorf("executions %d, batches %+v; want 1 of size 1 and 2 of size 2", st[0].ExecutionCount, b)
		}
	})
	t.Run("scheduled", func(t *testing.T) {
		repo := t.TempDir()
		writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+"slo: {latency_ms: 1000, class: latency-critical}\n", 1)
		sched, err := qos.NewScheduler(qos.Options{DeviceSlots: 2})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		ran := make(chan error, 1)
		go func() { ran <- sched.Run(ctx) }()
		t.Cleanup(func() { cancel(); <-ran })
		f := &fakeFactory{fail: map[string]error{}}
		r, err := New(Options{
			Repositories: []string{repo}, Control: ControlPoll, NewInstance: f.start,
			Scheduler: func(string) (*qos.Scheduler, error) { return sched, nil },
			Estimator: qos.NewEWMAEstimator(0),
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Start(t.Context()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Stop(context.Background()) })
		if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1}, [4]float32{2}, [4]float32{3})); err != nil {
			t.Fatal(err)
		}
		if n := f.of("sum", 1)[0].calls.Load(); n < 3 {
			t.Fatalf("the instance ran %d calls; want the warm-up's and the request", n)
		}
		st, _ := r.Statistics("sum", "1")
		b := st[0].Batches
		if st[0].ExecutionCount != 1 || len(b) != 1 || b[0].BatchSize != 3 || b[0].ComputeInfer.Count != 1 {
			t.Errorf("executions %d, batches %+v; want the one request's execution of 3", st[0].ExecutionCount, b)
		}
	})
}

// A request that gives no timeout gets the model's default timeout
// (dynamic_batching.default_timeout, Triton's default queue policy).
func TestRegistryDefaultTimeout(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+"dynamic_batching: {default_timeout: 50ms}\n", 1)
	r, f, _ := newTestRegistry(t, ControlPoll, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	f.mu.Lock()
	f.g = make(chan struct{}) // the instance never answers
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		close(f.g)
		f.mu.Unlock()
	}()
	start := time.Now()
	_, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1}))
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want the default timeout's deadline", err)
	}
	// A watchdog, not a timing: without the default timeout the call
	// would wait for an instance that never answers.
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("took %v", took)
	}
}

// A request asking for a priority beyond the model's levels gets the
// model's own, as Triton treats one.
func TestRegistryPriorityLevels(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+"slo: {latency_ms: 1000, priority: 2}\ndynamic_batching: {priority_levels: 3}\n", 1)
	r, _, _ := newTestRegistry(t, ControlPoll, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	for _, tc := range []struct{ asked, got int }{{1, 1}, {3, 3}, {4, 0}, {0, 0}} {
		req := sumRequest([4]float32{1})
		req.Priority = tc.asked
		if _, _, err := r.Infer(t.Context(), "sum", "", req); err != nil {
			t.Fatal(err)
		}
		if req.Priority != tc.got {
			t.Errorf("priority %d became %d, want %d", tc.asked, req.Priority, tc.got)
		}
	}
}
