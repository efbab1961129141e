package e2e

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// profilePoint is one row of `sloserve profile` output.
type profilePoint struct {
	batch           int
	share, measured float64 // share of the device; milliseconds
}

// curveLine matches the fitted curve `sloserve profile` prints.
var curveLine = regexp.MustCompile(`t\(b, s\) = \((\S+)\*b\^2 \+ (\S+)\*b \+ (\S+)\) / \(s \+ (\S+)\) \+ (\S+) seconds`)

// runProfile runs `sloserve profile --fresh` on a demo model with its own
// cache folder and returns the measured points and the curve (k1..k5).
func runProfile(b *testing.B, model string) ([]profilePoint, [5]float64) {
	b.Helper()
	lib := need(b, "SLOSERVE_ONNXRUNTIME_LIBRARY")
	out, errOut, err := runSloserve("profile", "--fresh", "--repository", need(b, "SLOSERVE_DEMO_REPOSITORY"),
		"--set", "runtime.onnxruntime_library="+lib, "--set", "control.profile.cache_dir="+b.TempDir(),
		"--set", "control.profile.budget=60s", model)
	if err != nil {
		b.Fatalf("sloserve profile %s: %v\n%s%s", model, err, out, errOut)
	}
	var pts []profilePoint
	var k [5]float64
	for line := range strings.SplitSeq(out, "\n") {
		if m := curveLine.FindStringSubmatch(line); m != nil {
			for i := range k {
				k[i], _ = strconv.ParseFloat(m[i+1], 64)
			}
			continue
		}
		f := strings.Fields(line)
		if len(f) != 5 || !strings.HasSuffix(f[4], "%") {
			continue
		}
		batch, err1 := strconv.Atoi(f[0])
		share, err2 := strconv.ParseFloat(f[1], 64)
		measured, err3 := strconv.ParseFloat(f[2], 64)
		if err1 == nil && err2 == nil && err3 == nil {
			pts = append(pts, profilePoint{batch, share, measured})
		}
	}
	if len(pts) < 9 || k == [5]float64{} {
		b.Fatalf("profile output has %d points, curve %v:\n%s", len(pts), k, out)
	}
	return pts, k
}

// curveMS evaluates a printed curve in milliseconds.
func curveMS(k [5]float64, batch int, share float64) float64 {
	x := float64(batch)
	return 1000 * ((k[0]*x*x+k[1]*x+k[2])/(share+k[3]) + k[4])
}

// BenchmarkPredictorAccuracy profiles each demo model twice, as the server
// does at load (3 batch sizes x 3 shares, real cgroup quotas), and reports
// the error of the first run's fitted curve on the second run's fresh
// measurements: the prediction error on latencies the fit never saw.
func BenchmarkPredictorAccuracy(b *testing.B) {
	for _, model := range []string{"ocr-det", "ocr-rec", "ocr-cls"} {
		b.Run(model, func(b *testing.B) {
			var mapes []float64
			for b.Loop() {
				_, fitted := runProfile(b, model)
				fresh, _ := runProfile(b, model)
				var sum float64
				for _, p := range fresh {
					sum += math.Abs(curveMS(fitted, p.batch, p.share)-p.measured) / p.measured
				}
				mapes = append(mapes, sum/float64(len(fresh)))
				if len(mapes) == 1 {
					var sb strings.Builder
					fmt.Fprintf(&sb, "%s: batch share measured(ms) predicted(ms)\n", model)
					for _, p := range fresh {
						fmt.Fprintf(&sb, "  %d %.3f %.1f %.1f\n", p.batch, p.share, p.measured, curveMS(fitted, p.batch, p.share))
					}
					b.Log(sb.String())
				}
			}
			b.ReportMetric(100*median(mapes), "mape%")
		})
	}
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// Parameters of BenchmarkResizeUnderLoad.
const (
	rbRate    = 30.0             // classifier requests per second, Poisson
	rbPhase   = 10 * time.Second // before, and during the changes
	rbChanges = 20
	rbSLO     = 1000 * time.Millisecond
)

// BenchmarkResizeUnderLoad changes the classifier's share 20 times while an
// open-loop stream of requests runs, and compares failed requests and p99
// latency with the same stream before the changes. "live" alternates
// between shares the one-thread runner is not slowed by (cgroup quota
// rewritten in place); "swap" lets intra-op threads follow the share, so
// every change starts a replacement runner, warms it, switches and drains
// the old one.
func BenchmarkResizeUnderLoad(b *testing.B) {
	for _, tc := range []struct {
		name    string
		threads int
		shares  [2]float64
	}{
		{"live", 1, [2]float64{0.5, 1}},
		{"swap", 0, [2]float64{0.4, 0.9}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			repo := b.TempDir()
			writeRepo(b, repo, repoModel{lcName, demoModel(b, "ocr-cls"), fmt.Sprintf(`max_batch_size: 8
inputs: [{name: x, datatype: FP32, shape: [-1, 3, 48, 192]}]
execution: {intra_op_threads: %d}
slo: {latency_ms: %d, class: latency-critical}
`, tc.threads, rbSLO.Milliseconds())})
			s := startServer(b, repo, "control: {profile: {enabled: false}}\n")
			pin := func(share float64) {
				req, _ := http.NewRequest("PUT", s.http+"/v2/models/"+lcName+"/share",
					strings.NewReader(fmt.Sprintf(`{"compute": %g}`, share)))
				req.Header.Set("Content-Type", "application/json")
				resp, err := http.DefaultClient.Do(req)
				if err != nil || resp.StatusCode != 200 {
					b.Fatalf("pin %v: %v %v", share, err, resp)
				}
				resp.Body.Close()
			}
			pin(tc.shares[0])
			req := lcInfer(1)
			rng := rand.New(rand.NewPCG(qbSeed, 0))
			var before, during []*lcRecord
			for b.Loop() {
				openLoop(s.grpc, req, rbRate, 2*time.Second, rbSLO, rng) // warm
				before = append(before, openLoop(s.grpc, req, rbRate, rbPhase, rbSLO, rng)...)
				var wg sync.WaitGroup
				wg.Go(func() {
					for i := range rbChanges {
						time.Sleep(rbPhase / (rbChanges + 1))
						pin(tc.shares[(i+1)%2])
					}
				})
				during = append(during, openLoop(s.grpc, req, rbRate, rbPhase, rbSLO, rng)...)
				wg.Wait()
				pin(tc.shares[0])
			}
			summary := func(recs []*lcRecord) (failed int, p99 float64, n int) {
				var lat []time.Duration
				for _, r := range recs {
					if r.err != nil {
						failed++
						continue
					}
					lat = append(lat, r.latency)
				}
				return failed, pctMS(lat, 0.99), len(recs)
			}
			fb, p99b, nb := summary(before)
			fd, p99d, nd := summary(during)
			var ev eventsJSON
			resp, err := http.Get(s.http + "/v2/control/events?limit=10000")
			if err == nil {
				_ = json.NewDecoder(resp.Body).Decode(&ev)
				resp.Body.Close()
			}
			pins := 0
			for _, e := range ev.Events {
				if e.Kind == "pin" {
					pins++
				}
			}
			b.Logf("%s: before %d requests, %d failed, p99 %.1f ms; during %d share changes (%d pin events) %d requests, %d failed, p99 %.1f ms; ratio %.2f",
				tc.name, nb, fb, p99b, rbChanges, pins, nd, fd, p99d, p99d/p99b)
			b.ReportMetric(float64(fd), "failed")
			b.ReportMetric(p99b, "p99-before-ms")
			b.ReportMetric(p99d, "p99-during-ms")
			b.ReportMetric(p99d/p99b, "p99-ratio")
		})
	}
}
