package e2e

import (
	"fmt"
	"testing"
	"time"

	"github.com/sloserve/sloserve/api/inference"
)

// clsInfer is a classifier request of one 48 x width image, raw contents.
func clsInfer(model string, width int) *inference.ModelInferRequest {
	img := make([]float32, 3*48*width)
	for i := range img {
		img[i] = float32(i%251) / 251
	}
	return &inference.ModelInferRequest{
		ModelName:        model,
		Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1, 3, 48, int64(width)}}},
		RawInputContents: [][]byte{f32bytes(img)},
	}
}

// prediction is what /v2/control reports of a model's recent executions:
// the MAPE, its jitter floor (mape_floor), the means and the count.
type prediction struct {
	MAPE, Floor         float64
	Predicted, Observed float64 // ms
	Samples             int
}

// predictionMAPE is the MAPE of recent executions /v2/control reports for
// a model, with the number of executions it covers.
func (s *testServer) predictionMAPE(t *testing.T, model string) (float64, int) {
	t.Helper()
	p := s.prediction(t, model)
	return p.MAPE, p.Samples
}

// prediction reads a model's prediction figures from /v2/control.
func (s *testServer) prediction(t *testing.T, model string) prediction {
	t.Helper()
	var c struct {
		Devices []struct {
			Models []struct {
				Model      string  `json:"model"`
				MAPE       float64 `json:"mape"`
				Floor      float64 `json:"mape_floor"`
				Predicted  float64 `json:"predicted_latency_ms"`
				Observed   float64 `json:"observed_latency_ms"`
				Correction float64 `json:"correction"`
				Profile    float64 `json:"profile_mape"`
				Samples    int     `json:"prediction_samples"`
			} `json:"models"`
		} `json:"devices"`
	}
	// The control view lists a model from the adjuster's first pass on
	// (control.period, 1 s): a fast test may ask before it.
	deadline := time.Now().Add(30 * time.Second)
	for {
		if code := s.json(t, "GET", "/v2/control", nil, &c); code != 200 {
			t.Fatalf("GET /v2/control: %d", code)
		}
		for _, d := range c.Devices {
			for _, m := range d.Models {
				if m.Model == model {
					t.Logf("%s: predicted %.1fms, observed %.1fms (means), correction %.2f, profile MAPE %.1f%%, MAPE %.1f%% over a jitter floor of %.1f%%",
						model, m.Predicted, m.Observed, m.Correction, 100*m.Profile, 100*m.MAPE, 100*m.Floor)
					return prediction{MAPE: m.MAPE, Floor: m.Floor, Predicted: m.Predicted, Observed: m.Observed, Samples: m.Samples}
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("/v2/control has no model %s", model)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestE2EPredictorMixedShapes is issue 29's reproduction: the classifier
// served at two input shapes in turn, 48x240 and 48x3840, neither of them
// profiled (the profile is at widths 192 and 960, so 240 is interpolated
// and 3840 extrapolated). The MAPE of recent executions that /v2/control
// reports must stay near the one of the same server serving one shape.
// With one correction for all shapes and a curve blind to size (before
// issue 29) both shapes were predicted alike, between the two: the issue
// measured 87% at 48x320 and 48x1600 on a quiet machine. The shapes here
// are further apart (16x the elements) so that that error stands out of
// the noise of a busy machine, which the single-shape MAPE measures.
func TestE2EPredictorMixedShapes(t *testing.T) {
	const model = "cls"
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{model, demoModel(t, "ocr-cls"), `max_batch_size: 8
inputs: [{name: x, datatype: FP32, shape: [-1, 3, 48, -1]}]
execution: {intra_op_threads: 1}
slo: {latency_ms: 10000, class: latency-critical}
resources: {compute_share: 1}
profile:
  shapes: [{x: [1, 3, 48, 192]}, {x: [1, 3, 48, 960]}]
  batch_sizes: [1, 4]
`})
	dir := t.TempDir()
	// A cache of its own, also over make test's shared one: the test
	// needs this profile, not one cached by an earlier server.
	s := startServer(t, repo, fmt.Sprintf("control: {profile: {budget: 120s, cache_dir: %q}}\n", dir),
		withCommand("", nil, "SLOSERVE_CONTROL_PROFILE_CACHE_DIR="+dir))
	requireCgroups(t, s.control(t))
	key := model + "/1"
	if !s.logHas("profiled", key) {
		t.Fatalf("the model was not profiled:\n%s", s.log.String())
	}
	// One request at a time, so that every execution is a batch of one
	// and its time is the model's, not the queue's.
	run := func(widths ...int) {
		for i := range 2 * 100 {
			if _, err := s.grpc.ModelInfer(t.Context(), clsInfer(model, widths[i%len(widths)])); err != nil {
				t.Fatalf("infer at width %d: %v", widths[i%len(widths)], err)
			}
		}
	}
	run(240)
	single, n := s.predictionMAPE(t, key)
	t.Logf("one shape (48x240): MAPE %.1f%% over %d executions", 100*single, n)
	run(240, 3840)
	mixed, n := s.predictionMAPE(t, key)
	t.Logf("two shapes in turn (48x240, 48x3840): MAPE %.1f%% over %d executions", 100*mixed, n)
	if n < 100 {
		t.Fatalf("%d executions in the window, want 100", n)
	}
	// Each shape predicted at its size, with its own correction: the mix
	// is predicted about as well as one shape. The margin is for the
	// noise of a busy machine; a size-blind predictor is off by about
	// 200% here on top of it.
	if bound := 1.5*single + 0.5; mixed > bound {
		t.Errorf("MAPE under two shapes %.1f%%, over %.1f%% (1.5 times one shape's %.1f%%, plus 50 points)", 100*mixed, 100*bound, 100*single)
	}
}
