package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
)

// detRequest is a REST binary request for the detector on a size x size
// image, with optional request parameters.
func detRequest(t testing.TB, size int, params map[string]any) ([]byte, string) {
	t.Helper()
	img := make([]float32, 3*size*size)
	for i := range img {
		img[i] = float32(i%255) / 255
	}
	header, err := json.Marshal(jsonInferRequest{
		Inputs: []jsonTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1, 3, int64(size), int64(size)},
			Parameters: map[string]any{"binary_data_size": 4 * len(img)}}},
		Outputs:    []jsonTensor{{Name: "sigmoid_0.tmp_0", Parameters: map[string]any{"binary_data": true}}},
		Parameters: params,
	})
	if err != nil {
		t.Fatal(err)
	}
	return append(header, f32bytes(img)...), strconv.Itoa(len(header))
}

func (s *testServer) executions(t *testing.T, model string) uint64 {
	t.Helper()
	st, err := s.grpc.ModelStatistics(t.Context(), &inference.ModelStatisticsRequest{Name: model})
	if err != nil {
		t.Fatal(err)
	}
	return st.ModelStats[0].ExecutionCount
}

// modelMetric sums the series of a metric that carry model="key" ("name/1":
// the schedulers label a version by its key) and every label of want
// (`outcome="good"`), whatever their class and device; false when none.
func (s *testServer) modelMetric(t *testing.T, metric, key string, want ...string) (float64, bool) {
	t.Helper()
	var (
		sum   float64
		found bool
	)
	for series, v := range s.scrape(t) {
		name, labels, ok := strings.Cut(series, "{")
		if !ok || name != metric || !strings.Contains(labels, `model="`+key+`"`) {
			continue
		}
		if !slices.ContainsFunc(want, func(l string) bool { return !strings.Contains(labels, l) }) {
			sum, found = sum+v, true
		}
	}
	return sum, found
}

// A request whose deadline cannot be met is refused at once with 429 and
// the amount it would miss by; one that expires while queued is dropped
// with 504 and never executed.
func TestE2EDeadlines(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo,
		repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"),
			// A long SLO: the baseline requests below must be admitted
			// however busy the machine.
			"max_batch_size: 8\nslo: {latency_ms: 10000, class: latency-critical}\n"},
		repoModel{"det", demoModel(t, "ocr-det"),
			// A minute: the estimate per batch size learns from the big
			// 1600x1600 requests below, which take seconds on a busy
			// machine, and a 10s SLO then refused the small request that
			// must wait in the queue behind one.
			"max_batch_size: 1\nslo: {latency_ms: 60000, class: latency-critical}\nexecution: {intra_op_threads: 2}\n"},
	)
	// The statistics subtest counts every request the others sent: the
	// attainment window must outlast the test (the default 10 s did not
	// on a busy machine, and the first refusals slid out of it).
	// Profiling is off: a detector without profile shapes is profiled at
	// 64x64 and 256x256 (issue 29) and gets an estimate, and the subtests
	// below need it to start with none, as a model whose profile failed.
	s := startServer(t, repo, "control: {profile: {enabled: false}}\n", withSet("qos.window=10m"))

	t.Run("impossible deadline rejected at once", func(t *testing.T) {
		// The baseline of "at once": the same request without the
		// timeout, executed and answered, the slowest of three, on this
		// machine just before. A refusal does less (no execution).
		const plain = `{"inputs":[{"name":"input_vectors","datatype":"FP32","shape":[1,10],"data":[1,2,3,4,5,6,7,8,9,10]}]}`
		var answered time.Duration
		for range 3 {
			start := time.Now()
			if code, b, _ := s.do(t, "POST", "/v2/models/dyn/infer", []byte(plain)); code != 200 {
				t.Fatalf("dyn: %d %s", code, b)
			}
			answered = max(answered, time.Since(start))
		}
		// The warm-up at load gave dyn latency estimates; 1 µs is less than any.
		before := s.executions(t, "dyn")
		// The fastest of three refusals: one alone, beside two CPU
		// burners and a -race test suite, once lost its CPU for 10 ms.
		body := `{"parameters":{"timeout":1},` + plain[1:]
		took := time.Duration(math.MaxInt64)
		for range 3 {
			start := time.Now()
			code, b, _ := s.do(t, "POST", "/v2/models/dyn/infer", []byte(body))
			took = min(took, time.Since(start))
			if code != 429 || !bytes.Contains(b, []byte("misses the deadline by")) {
				t.Fatalf("got %d %s, want 429 saying by how much the deadline is missed", code, b)
			}
		}
		t.Logf("rejection took %v (the fastest of 3), an answer %v (the slowest of 3)", took, answered)
		if took > 3*answered {
			t.Errorf("rejection took %v, over 3 times an answered request (%v); want it at once", took, answered)
		}
		_, err := s.grpc.ModelInfer(t.Context(), &inference.ModelInferRequest{
			ModelName:        "dyn",
			Parameters:       map[string]*inference.InferParameter{"timeout": {ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: 1}}},
			Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{1, 10}}},
			RawInputContents: [][]byte{make([]byte, 40)},
		})
		if st := status.Convert(err); st.Code() != codes.ResourceExhausted || !strings.Contains(st.Message(), "misses the deadline by") {
			t.Errorf("gRPC: %v, want RESOURCE_EXHAUSTED saying by how much", err)
		}
		if after := s.executions(t, "dyn"); after != before {
			t.Errorf("rejected requests were executed: %d executions became %d", before, after)
		}
		if v, _ := s.metricValue(t, `sloserve_qos_requests_total{class="latency-critical",device="cpu",model="dyn/1",outcome="rejected"}`); v != 4 {
			t.Errorf("rejected counter = %v, want 4 (3 over REST, 1 over gRPC)", v)
		}
	})

	t.Run("expired while queued is dropped, never executed", func(t *testing.T) {
		// The detector's inputs have dynamic image sizes, so it gets no
		// warm-up, and with profiling off it starts with no estimate: both requests are admitted,
		// and the second waits behind the first until its deadline passes.
		// The first is large enough (1600x1600) to be still running when
		// the second comes on a busy machine: at 800x800 it once finished
		// first (219 ms), and the second was refused at admission on the
		// estimate it left, instead of queued.
		big, bigLen := detRequest(t, 1600, nil)
		small, smallLen := detRequest(t, 32, map[string]any{"timeout": 20000}) // 20 ms
		before := s.executions(t, "det")
		var wg sync.WaitGroup
		var bigCode int
		wg.Go(func() {
			bigCode, _, _ = s.do(t, "POST", "/v2/models/det/infer", big, "Inference-Header-Content-Length", bigLen)
		})
		waitFor(t, "the big request to reach the model", 10*time.Second, func() bool {
			v, _ := s.modelMetric(t, "sloserve_qos_inflight_requests", "det/1")
			return v >= 1
		})
		code, b, _ := s.do(t, "POST", "/v2/models/det/infer", small, "Inference-Header-Content-Length", smallLen)
		wg.Wait()
		if bigCode != 200 {
			t.Fatalf("the big request failed: %d", bigCode)
		}
		if code != 504 || !bytes.Contains(b, []byte("deadline passed while queued")) {
			t.Fatalf("the queued request got %d %s; want 504, dropped", code, b)
		}
		if after := s.executions(t, "det"); after != before+1 {
			t.Errorf("executions went from %d to %d; only the big request may run", before, after)
		}
		t.Logf("queued request: %d %s", code, b)
	})

	t.Run("client that disconnects leaves the queue", func(t *testing.T) {
		// Bigger than above: the client gives up only once its request is
		// seen queued, which takes a scrape or more; the big request must
		// still run by then.
		big, bigLen := detRequest(t, 1600, nil)
		small, smallLen := detRequest(t, 32, nil)
		before := s.executions(t, "det")
		var wg sync.WaitGroup
		var bigCode int
		wg.Go(func() {
			bigCode, _, _ = s.do(t, "POST", "/v2/models/det/infer", big, "Inference-Header-Content-Length", bigLen)
		})
		waitFor(t, "the big request to reach the model", 10*time.Second, func() bool {
			v, _ := s.modelMetric(t, "sloserve_qos_inflight_requests", "det/1")
			return v >= 1
		})
		// A client that gives up while its request waits in the queue. It
		// gives up once the server has queued the request, not after a
		// fixed time: on a busy machine the server may take longer than
		// that to read the request, and a request it never read is no
		// arrival to count.
		ctx, giveUp := context.WithCancel(t.Context())
		defer giveUp()
		req, err := http.NewRequestWithContext(ctx, "POST", s.http+"/v2/models/det/infer", bytes.NewReader(small))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Inference-Header-Content-Length", smallLen)
		answered := make(chan int, 1)
		go func() {
			resp, err := s.client.Do(req)
			if err != nil {
				answered <- 0
				return
			}
			resp.Body.Close()
			answered <- resp.StatusCode
		}()
		waitFor(t, "the small request to be queued", 10*time.Second, func() bool {
			v, _ := s.modelMetric(t, "sloserve_qos_queue_depth", "det/1")
			return v >= 1
		})
		giveUp()
		if code := <-answered; code != 0 {
			t.Fatalf("the small request answered %d before the client gave up", code)
		}
		wg.Wait()
		if bigCode != 200 {
			t.Fatalf("the big request failed: %d", bigCode)
		}
		waitFor(t, "the canceled request to be counted", 5*time.Second, func() bool {
			v, _ := s.metricValue(t, `sloserve_qos_requests_total{class="latency-critical",device="cpu",model="det/1",outcome="canceled"}`)
			return v == 1
		})
		if after := s.executions(t, "det"); after != before+1 {
			t.Errorf("executions went from %d to %d; the abandoned request must not run", before, after)
		}
	})

	t.Run("header timeout", func(t *testing.T) {
		code, b, _ := s.do(t, "POST", "/v2/models/dyn/infer", dynBody, "Inference-Timeout-Ms", "0.001")
		if code != 429 {
			t.Errorf("Inference-Timeout-Ms 0.001: %d %s, want 429", code, b)
		}
		if code, b, _ := s.do(t, "POST", "/v2/models/dyn/infer", dynBody, "Inference-Timeout-Ms", "5000"); code != 200 {
			t.Errorf("Inference-Timeout-Ms 5000: %d %s, want 200", code, b)
		}
	})

	t.Run("slo statistics", func(t *testing.T) {
		// dyn saw 5 refused requests and 4 good ones above (the 3 of the
		// baseline and 1 with a timeout); det 1 dropped, 1 canceled and 2
		// good.
		var st struct {
			ModelStats []struct {
				SLO struct {
					Class                                  string
					LatencyTargetMS                        float64 `json:"latency_target_ms"`
					Arrived, Good, Late, Rejected, Dropped uint64
					Attainment                             float64
				} `json:"slo"`
			} `json:"model_stats"`
		}
		if code := s.json(t, "GET", "/v2/models/dyn/stats", nil, &st); code != 200 {
			t.Fatalf("stats: %d", code)
		}
		got := st.ModelStats[0].SLO
		if got.Class != "latency-critical" || got.LatencyTargetMS != 10000 || got.Arrived != 9 || got.Good != 4 ||
			got.Rejected != 5 || got.Late != 0 || math.Abs(got.Attainment-4.0/9) > 1e-9 {
			t.Errorf("REST slo statistics = %+v, want 9 arrived, 4 good, 5 rejected, attainment 4/9", got)
		}
		g, err := s.grpc.ModelStatistics(t.Context(), &inference.ModelStatisticsRequest{Name: "det"})
		if err != nil {
			t.Fatal(err)
		}
		if q := g.ModelStats[0].Slo; q == nil || q.Dropped != 1 || q.Canceled != 1 || q.Good != 2 || q.LatencyTargetMs != 60000 {
			t.Errorf("gRPC slo statistics for det = %v, want 1 dropped, 1 canceled and 2 good", q)
		}
	})
}

// Best-effort load does not hurt a latency-critical model: the model
// gets a light, steady stream first alone, then while the detector
// (best-effort) is kept busy by two clients. Every request must be 200
// and on time at the server (its SLO is about 30 times its latency), and
// the client's median under best-effort load must stay within 5 times its
// median alone, measured in the same test: best-effort work that took the
// model's CPU shows as whole detector executions (tens of ms) in front of
// its 2 ms requests. (Beside a -race test suite and two CPU burners the
// ratio was 0.4 to 2.7 in 10 runs, from the host alone: there the
// best-effort detector ran 2 or 3 requests in all.) The client's own worst case is not checked against the
// SLO: on a busy host (two CPU burners and a -race test suite) the test
// process itself once waited long enough to see 157 ms for a request the
// server had answered on time.
func TestE2EBestEffortDoesNotHurtLatencyCritical(t *testing.T) {
	repo := t.TempDir()
	const sloMS = 150
	writeRepo(t, repo,
		repoModel{"lc", testModel(t, "example_dynamic_axes.onnx"),
			fmt.Sprintf("max_batch_size: 8\nslo: {latency_ms: %d, class: latency-critical}\nexecution: {intra_op_threads: 1}\n", sloMS)},
		repoModel{"be", demoModel(t, "ocr-det"),
			"max_batch_size: 1\nslo: {latency_ms: 60000, class: best-effort}\nexecution: {intra_op_threads: 1}\n"},
	)
	s := startServer(t, repo, "")
	rng := rand.New(rand.NewPCG(5, 6))
	var bad []string
	// steady sends 80 requests at about 30 a second and returns their
	// latencies at the client, sorted.
	steady := func() []time.Duration {
		var lat []time.Duration
		for range 80 {
			start := time.Now()
			code, b, _ := s.do(t, "POST", "/v2/models/lc/infer", dynBody)
			lat = append(lat, time.Since(start))
			if code != 200 {
				bad = append(bad, fmt.Sprintf("%d %s", code, b))
			}
			time.Sleep(time.Duration(20+rng.IntN(30)) * time.Millisecond)
		}
		slices.Sort(lat)
		return lat
	}
	alone := steady()

	stop := make(chan struct{})
	var beDone sync.WaitGroup
	var beOK, beFail int
	var mu sync.Mutex
	body, hlen := detRequest(t, 320, nil)
	for range 2 {
		beDone.Go(func() {
			client := &http.Client{}
			for {
				select {
				case <-stop:
					return
				default:
				}
				req, _ := http.NewRequest("POST", s.http+"/v2/models/be/infer", bytes.NewReader(body))
				req.Header.Set("Inference-Header-Content-Length", hlen)
				resp, err := client.Do(req)
				if err != nil {
					return
				}
				resp.Body.Close()
				mu.Lock()
				if resp.StatusCode == 200 {
					beOK++
				} else {
					beFail++
				}
				mu.Unlock()
			}
		})
	}
	time.Sleep(500 * time.Millisecond) // the best-effort load is on
	loaded := steady()
	close(stop)
	beDone.Wait()
	q := func(lat []time.Duration, f float64) time.Duration { return lat[int(f*float64(len(lat)-1))] }
	t.Logf("latency-critical alone p50 %v p99 %v max %v; beside best-effort p50 %v p99 %v max %v; best-effort %d ok, %d refused",
		q(alone, 0.5), q(alone, 0.99), alone[len(alone)-1], q(loaded, 0.5), q(loaded, 0.99), loaded[len(loaded)-1], beOK, beFail)
	if len(bad) > 0 {
		t.Errorf("latency-critical requests failed: %v", bad)
	}
	if q(loaded, 0.5) > 5*q(alone, 0.5) {
		t.Errorf("latency-critical p50 beside best-effort work %v, over 5 times its p50 alone (%v)", q(loaded, 0.5), q(alone, 0.5))
	}
	if beOK == 0 {
		t.Error("best-effort made no progress")
	}
	if v, _ := s.metricValue(t, `sloserve_qos_requests_total{class="latency-critical",device="cpu",model="lc/1",outcome="good"}`); v != 160 {
		t.Errorf("good latency-critical requests = %v, want 160: each on time at the server", v)
	}
}
