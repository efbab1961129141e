package runtime

import (
	"bytes"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sloserve/sloserve/internal/syncbuf"
)

// A runner that runs a long call at its own CPU quota's limit is busy, not
// hung: its health checks may go unanswered while the call runs (in the
// predictor benchmark, ocr-rec profiled at a 0.5-CPU quota failed three
// 2 s checks in a row and was killed: "check took 1.947s, the runner ran
// 975ms and waited 4.031s for a CPU"), but they fail with the call in
// flight and the cgroup throttled, and are not counted. The runner here
// is real (the demo recogniser, batch 4 at 48x1280, one intra-op thread)
// in a cpu cgroup of its own with a quota of half a CPU over 10 ms
// periods, as the limiter makes them; its checks are a few times shorter
// than one call, so that some go unanswered while the call runs. It
// keeps its process and answers every call as it did without the quota.
func TestRunnerAtItsQuotaIsNotHung(t *testing.T) {
	if _, ok := cpuWait(os.Getpid()); !ok {
		t.Skip("the kernel gives no /proc/<pid>/task/<tid>/schedstat")
	}
	model := demoModel(t, "ocr-rec")
	dir, setQuota := quotaCgroupDir(t)
	const batch, width = 4, 1280
	in := make([]float32, batch*3*48*width)
	rng := rand.New(rand.NewPCG(7, 7))
	for i := range in {
		in[i] = rng.Float32()
	}
	req := &InferRequest{Inputs: []Tensor{{Name: "x", DataType: FP32, Shape: []int64{batch, 3, 48, width}, Data: f32Bytes(in)}}}
	// The answer without a quota, from a runner of its own with the
	// usual checks: the same model on one thread gives the same bytes.
	ref := startTestRunner(t, testRunnerConfig(t, model))
	want, err := ref.Infer(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	if err := ref.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}

	setQuota(5000, 10000)
	cfg := testRunnerConfig(t, model)
	cfg.HealthInterval = 25 * time.Millisecond
	cfg.JoinCgroups = []string{filepath.Join(dir, "cgroup.procs")}
	var log syncbuf.Buffer
	cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(t.Output(), &log), &slog.HandlerOptions{Level: slog.LevelInfo}))
	r := startTestRunner(t, cfg)
	pid := r.Pid()
	for i := range 4 {
		start := time.Now()
		got, err := r.Infer(t.Context(), req)
		took := time.Since(start)
		if err != nil {
			t.Fatalf("call %d at the quota, after %v: %v", i, took.Round(time.Millisecond), err)
		}
		if len(got.Outputs) != 1 || !bytes.Equal(got.Outputs[0].Data, want.Outputs[0].Data) {
			t.Fatalf("call %d at the quota answered other outputs than without it", i)
		}
		if took < 4*cfg.HealthInterval {
			t.Fatalf("call %d took %v at the quota, under 4 health-check periods: the test does not hold a call across checks", i, took)
		}
		t.Logf("call %d at the quota: %v", i, took.Round(time.Millisecond))
	}
	if got := r.Pid(); got != pid || r.Restarts() != 0 || strings.Contains(log.String(), "runner hung") {
		t.Fatalf("the runner %d at its quota was killed as hung and replaced by %d (%d restarts)", pid, got, r.Restarts())
	}
	t.Logf("health checks not answered in time and not counted (starved by the quota or by the host): %d", strings.Count(log.String(), "starved of CPU; not counted"))
}

// demoModel is the path of a demo model's version 1 in
// $SLOSERVE_DEMO_REPOSITORY, else in ../demo-repository.
func demoModel(t testing.TB, name string) string {
	t.Helper()
	repo := os.Getenv("SLOSERVE_DEMO_REPOSITORY")
	if repo == "" {
		repo = filepath.Join("..", "demo-repository")
	}
	p, err := filepath.Abs(filepath.Join(repo, name, "1", "model.onnx"))
	if err == nil {
		_, err = os.Stat(p)
	}
	if err != nil {
		skipWithoutORT(t, "no demo model %s: %v", name, err)
	}
	return p
}
