package e2e

import (
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// demoConfig is a demo model's config.yaml without its name line (writeRepo
// writes one).
func demoConfig(t *testing.T, model string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(need(t, "SLOSERVE_DEMO_REPOSITORY"), model, "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	return regexp.MustCompile(`(?m)^name:.*\n`).ReplaceAllString(string(data), "")
}

// TestE2EPredictorDemoMixedShapes is issue 29's reproduction as a new user
// would try it: the demo repository's classifier and detector, with their
// demo configs (adaptive shares, each profiled at one shape: 48x192 and
// 320x320), served with requests alternating between two shapes per
// model: ocr-cls at 48x320 and 48x1600, ocr-det at 256x256 and 640x640.
// The issue measured the MAPE of recent executions /v2/control reports at
// 87% (cls) and 168% (det). Here each model is first served at each of
// its two shapes alone, then at both in turn, one request at a time (every
// execution a batch of one); the mixed MAPE's excess over its jitter floor
// (the least MAPE one time per bucket could have had, which /v2/control
// reports beside it: what is left is the predictor's error) must stay
// within twice the one-shape phases' mean excess plus 15 points, and the
// mixed MAPE under 30% where the machine is quiet enough that one shape
// alone is predicted within 15% and the mixed phase's floor is under 15%.
// (The bound was twice the one-shape MAPEs plus 5 points: make test
// beside two CPU burners measured ocr-cls at 12.4% and 12.2% alone, over
// floors of 12.0% and 9.4%, and 36.0% in turn over a floor of 28.1%: the
// machine got busier between the phases; 7.9 points of the 36 were the
// predictor's.) On a machine shared with four builds (load
// average 20 on 2 cores) one shape alone measured 31 to 75% (cls, 3 to
// 12 ms executions) and 25 to 30% (det), the mix 36 to 71% and 29 to
// 30%: each execution's jitter, not the prediction of its mean, which was
// within 7% of the observed mean in every phase; the mix came out at up
// to 1.6 times the mean of the one-shape MAPEs. A predictor blind to size
// (one correction for both shapes, as before issue 29) measured 87% (cls,
// one shape alone 28%) and 160% (det, 27%) under the mix.
func TestE2EPredictorDemoMixedShapes(t *testing.T) {
	type shape struct{ h, w int }
	cases := []struct {
		model string
		a, b  shape
	}{
		{"ocr-cls", shape{48, 320}, shape{48, 1600}},
		{"ocr-det", shape{256, 256}, shape{640, 640}},
	}
	repo := t.TempDir()
	for _, c := range cases {
		writeRepo(t, repo, repoModel{c.model, demoModel(t, c.model), demoConfig(t, c.model)})
	}
	s := startServer(t, repo, "")
	const window = 100 // predictor.Window: the executions /v2/control's MAPE covers
	for _, c := range cases {
		t.Run(c.model, func(t *testing.T) {
			// run executes n requests, the shapes in turn. A busy
			// machine may hold a request long enough before the server
			// reads it that it is refused or dropped (the demo SLOs are
			// 100 and 500 ms): it is sent again. A refused request never
			// runs, so it changes nothing the test measures; the bound
			// only ends a run the server refuses more often than it
			// serves. (Beside two CPU burners and a -race test suite, 21
			// of 200 ocr-det requests were refused; the last had spent
			// about 510 ms of its 500 before admission saw it, for an
			// execution predicted at 110 ms with nothing queued ahead.)
			run := func(n int, shapes ...shape) {
				refused := 0
				for i := 0; i < n; {
					sh := shapes[i%len(shapes)]
					_, err := s.grpc.ModelInfer(t.Context(), imageInfer(c.model, 1, 3, int64(sh.h), int64(sh.w)))
					switch status.Code(err) {
					case codes.OK:
						i++
					case codes.ResourceExhausted, codes.DeadlineExceeded:
						if refused++; refused > n {
							t.Fatalf("%d requests refused or dropped, more than the %d served; the latest: %v", refused, n, err)
						}
					default:
						t.Fatalf("infer %s at %dx%d: %v", c.model, sh.h, sh.w, err)
					}
				}
			}
			key := c.model + "/1"
			// A first pass at both shapes teaches the online correction
			// each size. Each phase then runs twice the window, and its
			// second window is measured: what the predictor does at the
			// phase's shapes, not how fast it left the last phase's.
			run(window, c.a, c.b)
			run(2*window, c.a)
			pA := s.prediction(t, key)
			run(2*window, c.b)
			pB := s.prediction(t, key)
			run(2*window, c.a, c.b)
			pM := s.prediction(t, key)
			mixed, n := pM.MAPE, pM.Samples
			t.Logf("%s: MAPE at %dx%d alone %.1f%% (floor %.1f%%), at %dx%d alone %.1f%% (floor %.1f%%), the two in turn %.1f%% (floor %.1f%%, over %d executions)",
				c.model, c.a.h, c.a.w, 100*pA.MAPE, 100*pA.Floor, c.b.h, c.b.w, 100*pB.MAPE, 100*pB.Floor, 100*mixed, 100*pM.Floor, n)
			if n < window {
				t.Fatalf("%d executions in the window, want %d", n, window)
			}
			one := (pA.MAPE + pB.MAPE) / 2
			oneExcess := max(0, (pA.MAPE-pA.Floor+pB.MAPE-pB.Floor)/2)
			if excess := mixed - pM.Floor; excess > 2*oneExcess+0.15 {
				t.Errorf("MAPE under two shapes %.1f%%, %.1f points over its jitter floor: over twice the one-shape phases' mean excess (%.1f points) plus 15",
					100*mixed, 100*excess, 100*oneExcess)
			}
			if one < 0.15 && pM.Floor < 0.15 && mixed > 0.30 {
				t.Errorf("MAPE under two shapes %.1f%% (floor %.1f%%), over 30%% (one shape: %.1f%%)", 100*mixed, 100*pM.Floor, 100*one)
			}
		})
	}
}
