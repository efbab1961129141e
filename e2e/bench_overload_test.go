package e2e

// BenchmarkOverload and BenchmarkSoak: what the server does far past its
// capacity, and whether it holds steady for a long time below it. Run with
//
//	make bench BENCH='Overload|Soak' PKGS=./e2e BENCHTIME=1x
//
// Both use two real models sharing the machine under the default (adaptive)
// control policy: the PP-OCRv4 detector on 320x320 images, latency-critical,
// and the PP-OCRv4 recogniser on 48x320 text lines, best-effort. A
// calibration server first measures each model's capacity alone (closed-loop
// clients, a loose SLO) and the detector's batch latencies, from which the
// detector's SLO is set. Then:
//
//   - Overload: a fresh server gets open-loop Poisson arrivals at
//     SLOSERVE_OVERLOAD_FACTOR (10) times each model's capacity for
//     SLOSERVE_OVERLOAD_DURATION (1m), while a prober asks for readiness
//     every 100 ms and a sampler reads the server's and runners' memory
//     every second. It reports the latency-critical goodput against its
//     capacity, how every request ended, the probe latencies and the memory.
//   - Soak: a fresh server gets SLOSERVE_SOAK_LOAD (0.7) of each model's
//     capacity for SLOSERVE_SOAK_DURATION (10m); every 10 s the sampler
//     reads goroutines, open files and resident memory, of the server and of
//     the runners. It reports the first and last minute and the fitted
//     growth per hour.

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/loadtest"
)

// Names of the two models in the overload repository.
const (
	ovLCName = "det" // latency-critical: ocr-det at 320x320
	ovBEName = "rec" // best-effort: ocr-rec at 48x320
)

// Parameters of the overload and soak benchmarks.
const (
	ovClients     = 4                // closed-loop clients that measure a capacity
	ovWarm        = 2 * time.Second  // closed-loop load before a capacity window
	ovWindow      = 10 * time.Second // capacity window
	ovProbeEvery  = 100 * time.Millisecond
	ovSampleEvery = time.Second
	ovSeed        = 7
)

// envFloat and envDuration read a benchmark parameter from the environment.
func envFloat(b *testing.B, name string, def float64) float64 {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f <= 0 {
		b.Fatalf("%s=%q: want a positive number", name, v)
	}
	return f
}

func envDuration(b *testing.B, name string, def time.Duration) time.Duration {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		b.Fatalf("%s=%q: want a positive duration", name, v)
	}
	return d
}

// imageInfer is a request for model with one FP32 input x of shape, raw
// contents filled with a fixed pattern.
func imageInfer(model string, shape ...int64) *inference.ModelInferRequest {
	n := int64(1)
	for _, d := range shape {
		n *= d
	}
	img := make([]float32, n)
	for i := range img {
		img[i] = float32(i%253) / 253
	}
	return &inference.ModelInferRequest{
		ModelName:        model,
		Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: shape}},
		RawInputContents: [][]byte{f32bytes(img)},
	}
}

func ovLCInfer(batch int64) *inference.ModelInferRequest {
	return imageInfer(ovLCName, batch, 3, 320, 320)
}
func ovBEInfer() *inference.ModelInferRequest { return imageInfer(ovBEName, 1, 3, 48, 320) }

// overloadRepo writes the repository with the detector's SLO.
func overloadRepo(b *testing.B, sloMS float64) string { return overloadRepoSLOs(b, sloMS, 60000) }

// overloadRepoSLOs writes the repository with the detector's and the
// recogniser's SLOs.
func overloadRepoSLOs(b *testing.B, sloMS, beSLOMS float64) string {
	repo := b.TempDir()
	writeRepo(b, repo,
		repoModel{ovLCName, demoModel(b, "ocr-det"), fmt.Sprintf(`max_batch_size: 4
inputs: [{name: x, datatype: FP32, shape: [-1, 3, 320, 320]}]
execution: {intra_op_threads: 1}
slo: {latency_ms: %g, class: latency-critical, priority: 1}
resources: {memory_limit: 512MiB}
profile: {shapes: {x: [1, 3, 320, 320]}}
`, sloMS)},
		repoModel{ovBEName, demoModel(b, "ocr-rec"), fmt.Sprintf(`max_batch_size: 4
inputs: [{name: x, datatype: FP32, shape: [-1, 3, 48, 320]}]
execution: {intra_op_threads: 1}
slo: {latency_ms: %g, class: best-effort}
resources: {memory_limit: 1GiB}
profile: {shapes: {x: [1, 3, 48, 320]}}
`, beSLOMS)},
	)
	return repo
}

// ovCalibration is what a server with a loose SLO measures of each model
// alone.
type ovCalibration struct {
	solo, batch4 time.Duration // detector p50, sequential calls
	lcCapacity   float64       // detector req/s, ovClients closed-loop clients
	beCapacity   float64       // recogniser req/s, the same
	sloMS        float64       // the detector's SLO for the runs
}

func calibrateOverload(b *testing.B) ovCalibration {
	s := startServer(b, overloadRepo(b, 5000), "")
	timeCalls := func(req *inference.ModelInferRequest, n int) time.Duration {
		ds := make([]time.Duration, n)
		for i := range ds {
			t0 := time.Now()
			if _, err := s.grpc.ModelInfer(b.Context(), req); err != nil {
				b.Fatal(err)
			}
			ds[i] = time.Since(t0)
		}
		return percentile(ds, 0.5)
	}
	timeCalls(ovLCInfer(1), 10) // warm
	var c ovCalibration
	c.solo, c.batch4 = timeCalls(ovLCInfer(1), 40), timeCalls(ovLCInfer(4), 15)
	c.lcCapacity = measureRateOver(b, s, ovLCInfer(1), ovClients, ovWarm, ovWindow)
	c.beCapacity = measureRateOver(b, s, ovBEInfer(), ovClients, ovWarm, ovWindow)
	// Room for a full batch ahead of a request's own, and some.
	c.sloMS = math.Round(2.5 * ms(c.batch4))
	if err := s.stop(); err != nil {
		b.Fatal(err)
	}
	return c
}

// ownClient is a gRPC client on a connection of its own, as a separate
// client application would have: one connection carries at most
// limits.grpc_max_streams calls at once, and the two models' load must not
// queue behind each other in the generator.
func ownClient(b *testing.B, s *testServer) inference.GRPCInferenceServiceClient {
	conn, err := grpc.NewClient(s.grpcAddr, grpc.WithTransportCredentials(s.creds))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { conn.Close() })
	return inference.NewGRPCInferenceServiceClient(conn)
}

// procSample is one reading of the server process and its runners.
type procSample struct {
	at                   time.Duration
	serverRSS, runnerRSS int64 // bytes
	serverFDs, runnerFDs int
	goroutines           float64 // the server's, from its metrics
	heapInuse            float64
	runners              int
}

// readProc reads a process's resident memory (bytes) and open files.
func readProc(pid int) (rss int64, fds int, ok bool) {
	st, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		return 0, 0, false
	}
	for line := range strings.SplitSeq(string(st), "\n") {
		if v, found := strings.CutPrefix(line, "VmRSS:"); found {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			rss = kb << 10
		}
	}
	ents, err := os.ReadDir(filepath.Join("/proc", strconv.Itoa(pid), "fd"))
	if err != nil {
		return rss, 0, false
	}
	return rss, len(ents), true
}

// sampleProcs reads the server and every child of it; metrics adds the
// server's goroutines and heap from its own endpoint.
func sampleProcs(b *testing.B, s *testServer, at time.Duration, metrics bool) procSample {
	p := procSample{at: at}
	p.serverRSS, p.serverFDs, _ = readProc(s.cmd.Process.Pid)
	for _, pid := range s.runnerPids(b, "runner") {
		rss, fds, ok := readProc(pid)
		if ok {
			p.runnerRSS += rss
			p.runnerFDs += fds
			p.runners++
		}
	}
	if metrics {
		// The sampler's goroutine must not call Fatal: a failed scrape
		// leaves the sample's metrics NaN.
		p.goroutines, p.heapInuse = math.NaN(), math.NaN()
		if m, err := s.scrapeMetrics(); err == nil {
			p.goroutines, p.heapInuse = m["go_goroutines"], m["go_memstats_heap_inuse_bytes"]
		}
	}
	return p
}

// prober asks for readiness over REST every ovProbeEvery.
type prober struct {
	cancel context.CancelFunc
	done   chan struct{}

	mu        sync.Mutex
	latencies []time.Duration
	failures  int
	lastErr   string
}

func startProber(s *testServer) *prober {
	ctx, cancel := context.WithCancel(context.Background())
	p := &prober{cancel: cancel, done: make(chan struct{})}
	client := &http.Client{Timeout: 5 * time.Second}
	go func() {
		defer close(p.done)
		defer client.CloseIdleConnections()
		t := time.NewTicker(ovProbeEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			t0 := time.Now()
			resp, err := client.Get(s.http + "/v2/health/ready")
			took := time.Since(t0)
			p.mu.Lock()
			switch {
			case err != nil:
				p.failures++
				p.lastErr = err.Error()
			case resp.StatusCode != http.StatusOK:
				p.failures++
				p.lastErr = resp.Status
			default:
				p.latencies = append(p.latencies, took)
			}
			p.mu.Unlock()
			if resp != nil {
				resp.Body.Close()
			}
		}
	}()
	return p
}

func (p *prober) stop() {
	p.cancel()
	<-p.done
}

// sampler reads procSamples every period until stopped.
type sampler struct {
	cancel  context.CancelFunc
	done    chan struct{}
	samples []procSample
}

func startSampler(b *testing.B, s *testServer, period time.Duration, metrics bool) *sampler {
	ctx, cancel := context.WithCancel(context.Background())
	sm := &sampler{cancel: cancel, done: make(chan struct{})}
	start := time.Now()
	go func() {
		defer close(sm.done)
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			sm.samples = append(sm.samples, sampleProcs(b, s, time.Since(start), metrics))
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return sm
}

func (sm *sampler) stop() []procSample {
	sm.cancel()
	<-sm.done
	return sm.samples
}

// tally counts open-loop records that ran for d by outcome.
func tally(recs []*lcRecord, d time.Duration) *phaseResult {
	p := &phaseResult{dur: d}
	p.add(recs)
	return p
}

// writeExamples writes an error of each kind the records of p had.
func writeExamples(sb *strings.Builder, name string, p *phaseResult) {
	for o, err := range p.examples {
		if err != nil {
			fmt.Fprintf(sb, "%s %s: e.g. %v\n", name, lcOutcomeNames[o], err)
		}
	}
}

func mib(n int64) float64 { return float64(n) / (1 << 20) }

// ovKind is who decided a request's outcome and what they said: the
// outcome, then the status (HTTP or gRPC) and the start of its message, or
// "generator" for an arrival never sent, or "client timeout".
func ovKind(r *lcRecord) string {
	if r.err == nil {
		return lcOutcomeNames[r.outcome]
	}
	msg := r.err.Error()
	if st, ok := status.FromError(r.err); ok {
		msg = st.Message()
		if !strings.HasPrefix(msg, "client timeout") && !strings.Contains(msg, ": ") {
			msg = st.Code().String() + ": " + msg
		}
	}
	if errors.Is(r.err, errGenerator) {
		msg = "generator (never sent, the server never saw it): " + strings.TrimPrefix(msg, errGenerator.Error()+": ")
	}
	if len(msg) > 100 {
		msg = msg[:100]
	}
	return lcOutcomeNames[r.outcome] + " " + msg
}

// writeCountsCompared writes how the client's counts of the detector's
// requests and its scheduler's relate: the scheduler counts the requests
// that reached admission (refusals from the headers included); the client
// also counts what the server refused before admission (the memory
// budget's 429 / RESOURCE_EXHAUSTED, gRPC calls refused unread: no model's
// count has them, and both are server-wide), arrivals the generator never
// sent, its own timeouts (the server counts those as whatever became of
// them) and transport failures; a request good in the scheduler is late at
// the client when its answer took too long on the way back.
func writeCountsCompared(sb *strings.Builder, recs []*lcRecord, p *phaseResult, server overloadOutcomes, memRefused, unread float64) {
	kinds := map[string]int{}
	for _, r := range recs {
		kinds[ovKind(r)]++
	}
	names := slices.Collect(maps.Keys(kinds))
	slices.SortFunc(names, func(a, b string) int { return cmp.Or(kinds[b]-kinds[a], strings.Compare(a, b)) })
	fmt.Fprintf(sb, "detector, counted by the client: %d arrivals; %d good, %d late, %d rejected, %d dropped, %d failed. By the scheduler: %.0f good, %.0f late, %.0f rejected, %.0f dropped; server-wide, refused before any model's count: %.0f by the memory budget, %.0f gRPC calls unread\n",
		p.sent, p.counts[lcGood], p.counts[lcLate], p.counts[lcRejected], p.counts[lcDropped], p.counts[lcFailed],
		server.good, server.late, server.rejected, server.dropped, memRefused, unread)
	fmt.Fprintf(sb, "detector at the client by kind (who decided, what they said):\n")
	for i, k := range names {
		if i == 10 {
			fmt.Fprintf(sb, "  ... %d more kinds\n", len(names)-i)
			break
		}
		fmt.Fprintf(sb, "  %7d  %s\n", kinds[k], k)
	}
}

// BenchmarkOverload offers each model SLOSERVE_OVERLOAD_FACTOR times its
// capacity for SLOSERVE_OVERLOAD_DURATION and reports the detector's goodput
// against its capacity, the readiness probe's latency and the memory used,
// once per protocol of SLOSERVE_OVERLOAD_PROTOCOLS (grpc,rest), each on a
// fresh server after one calibration. Over grpc the generator sends as
// loadtest's client does, each message marshalled once, over
// SLOSERVE_OVERLOAD_CONNECTIONS (loadtest.DefaultConnections) connections
// per model; grpc-generated is the client the benchmark had before, for
// comparison: the generated client on one connection per model,
// marshalling every call. Over rest it sends as loadtest's client does
// (rest-binary: headers and body written once, sent with one writev over
// its own kept-alive connections); rest-nethttp is the net/http sender the
// benchmark had before. Arrivals go through loadtest.Pacer with at most
// SLOSERVE_OVERLOAD_MAX_INFLIGHT (1024) requests per model in flight and
// none sent over ovMaxLag late: the others are dropped by the generator,
// counted and never sent, so a starved generator neither grows nor runs
// on. The report compares the client's counts of the detector with its
// scheduler's and lists the client's by kind. The generator (this process, with
// its prober and sampler) runs confined to SLOSERVE_OVERLOAD_GENERATOR_CPUS
// (0.5; 0: unconfined) in a cgroup of its own, as clients on other
// machines would be, and the run fails when the generator's cgroup used
// more than 10% over that quota over the load; the server's own counts
// split the late requests into those that finished late in the scheduler
// and those that became late on the way back. The server logs at
// SLOSERVE_OVERLOAD_LOG_LEVEL (info).
func BenchmarkOverload(b *testing.B) {
	factor := envFloat(b, "SLOSERVE_OVERLOAD_FACTOR", 10)
	dur := envDuration(b, "SLOSERVE_OVERLOAD_DURATION", time.Minute)
	genCPUs := 0.5
	if v := os.Getenv("SLOSERVE_OVERLOAD_GENERATOR_CPUS"); v != "" {
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || f < 0 {
			b.Fatalf("SLOSERVE_OVERLOAD_GENERATOR_CPUS=%q: want a number >= 0", v)
		}
		genCPUs = f
	}
	protocols := strings.Split(cmp.Or(os.Getenv("SLOSERVE_OVERLOAD_PROTOCOLS"), "grpc,rest"), ",")
	cal := calibrateOverload(b)
	fmt.Printf("calibration: detector p50 %.1f ms (batch 1), %.1f ms (batch 4); capacity %.1f req/s; recogniser capacity %.1f req/s; detector SLO %.0f ms\n",
		ms(cal.solo), ms(cal.batch4), cal.lcCapacity, cal.beCapacity, cal.sloMS)
	for _, proto := range protocols {
		if proto != "grpc" && proto != "rest" && proto != "grpc-generated" && proto != "rest-nethttp" {
			b.Fatalf("SLOSERVE_OVERLOAD_PROTOCOLS: unknown protocol %q (grpc, rest, grpc-generated, rest-nethttp)", proto)
		}
		b.Run(proto, func(b *testing.B) { overloadRun(b, proto, cal, factor, dur, genCPUs) })
	}
}

// cpuSeconds is the CPU time a process has used (user and system), from
// /proc/<pid>/stat at the usual 100 ticks a second; 0 if it is gone.
func cpuSeconds(pid int) float64 {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0
	}
	// The command may hold spaces: the fields follow its closing paren.
	rest := string(b[bytes.LastIndexByte(b, ')')+1:])
	f := strings.Fields(rest)
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / 100
}

// cpuUse is the CPU time of the overload run's processes.
type cpuUse struct{ server, lc, be, generator float64 }

func readCPU(b *testing.B, s *testServer) cpuUse {
	u := cpuUse{server: cpuSeconds(s.cmd.Process.Pid), generator: cpuSeconds(os.Getpid())}
	for _, pid := range s.runnerPids(b, "/"+ovLCName+"/") {
		u.lc += cpuSeconds(pid)
	}
	for _, pid := range s.runnerPids(b, "/"+ovBEName+"/") {
		u.be += cpuSeconds(pid)
	}
	return u
}

// overloadOutcomes are the scheduler's counts of the detector's requests.
type overloadOutcomes struct{ good, late, rejected, dropped float64 }

func detectorOutcomes(b *testing.B, s *testServer) overloadOutcomes {
	m := s.scrape(b)
	series := `sloserve_qos_requests_total{class="latency-critical",device="cpu",model="` + ovLCName + `/1",outcome="`
	return overloadOutcomes{m[series+`good"}`], m[series+`late"}`], m[series+`rejected"}`], m[series+`dropped"}`]}
}

// restSender sends one request of model with one FP32 input x of shape in
// the binary tensor extension, asking for binary outputs, and returns its
// outcome as a gRPC status, as classify reads it.
func restSender(s *testServer, client *http.Client, model string, shape ...int64) func(context.Context) error {
	msg := imageInfer(model, shape...)
	raw := msg.RawInputContents[0]
	header := fmt.Sprintf(`{"inputs":[{"name":"x","datatype":"FP32","shape":%s,"parameters":{"binary_data_size":%d}}],"parameters":{"binary_data_output":true}}`,
		strings.ReplaceAll(fmt.Sprint(shape), " ", ","), len(raw))
	body := append([]byte(header), raw...)
	url := s.http + "/v2/models/" + model + "/infer"
	return func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Inference-Header-Content-Length", strconv.Itoa(len(header)))
		req.Header.Set("Content-Type", "application/octet-stream")
		resp, err := client.Do(req)
		if err != nil {
			return status.Error(codes.Unavailable, err.Error())
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusOK:
			return nil
		case http.StatusTooManyRequests:
			return status.Error(codes.ResourceExhausted, string(b))
		case http.StatusGatewayTimeout:
			return status.Error(codes.DeadlineExceeded, string(b))
		}
		return status.Errorf(codes.Unknown, "%d %s", resp.StatusCode, b)
	}
}

// grpcSender sends msg's request as the load generator does
// (loadtest.Client): marshalled once and sent as those bytes, over
// connections of its own taken in turn; with generated, through the
// generated client, marshalled per call, over one connection, as the
// benchmark sent before. It returns the outcome as a gRPC status, as
// classify reads it.
func grpcSender(b *testing.B, s *testServer, msg *inference.ModelInferRequest, connections int, generated bool) func(context.Context) error {
	if generated {
		client := ownClient(b, s)
		return func(ctx context.Context) error { _, err := client.ModelInfer(ctx, msg); return err }
	}
	in := msg.Inputs[0]
	c, err := loadtest.NewClient(loadtest.ClientOptions{
		Protocol: loadtest.ProtoGRPC, GRPCAddr: s.grpcAddr, Model: msg.ModelName,
		Inputs:        []loadtest.Tensor{{Name: in.Name, DataType: in.Datatype, Shape: in.Shape, Raw: msg.RawInputContents[0]}},
		ServerTimeout: -1, Connections: connections,
		GRPCDialOptions: []grpc.DialOption{grpc.WithTransportCredentials(s.creds)},
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	return loadtestSend(c)
}

// restClientSender sends msg's request as the load generator does over
// REST (loadtest.Client, rest-binary): the body encoded once and written
// with its prepared headers in one call over the client's own kept-alive
// connections. It returns the outcome as a gRPC status, as classify reads
// it, with the client's detail as the message.
func restClientSender(b *testing.B, s *testServer, msg *inference.ModelInferRequest) func(context.Context) error {
	in := msg.Inputs[0]
	c, err := loadtest.NewClient(loadtest.ClientOptions{
		Protocol: loadtest.ProtoRESTBinary, HTTPBase: s.http, Model: msg.ModelName,
		Inputs:        []loadtest.Tensor{{Name: in.Name, DataType: in.Datatype, Shape: in.Shape, Raw: msg.RawInputContents[0]}},
		ServerTimeout: -1,
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	return loadtestSend(c)
}

// loadtestSend turns a loadtest.Client's outcomes into the gRPC statuses
// classify reads.
func loadtestSend(c *loadtest.Client) func(context.Context) error {
	return func(ctx context.Context) error {
		switch o, detail := c.Infer(ctx); o {
		case loadtest.Good:
			return nil
		case loadtest.Rejected:
			return status.Error(codes.ResourceExhausted, detail)
		case loadtest.Dropped:
			return status.Error(codes.DeadlineExceeded, detail)
		default:
			return status.Error(codes.Unknown, detail)
		}
	}
}

// ovConnections reads SLOSERVE_OVERLOAD_CONNECTIONS: the gRPC connections
// per model (loadtest.DefaultConnections).
func ovConnections(b *testing.B) int {
	v := os.Getenv("SLOSERVE_OVERLOAD_CONNECTIONS")
	if v == "" {
		return loadtest.DefaultConnections
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		b.Fatalf("SLOSERVE_OVERLOAD_CONNECTIONS=%q: want a count >= 1", v)
	}
	return n
}

// ovMaxLag is how late the overload generator may send a request: one it
// comes to later than that is dropped by the generator, never sent.
const ovMaxLag = time.Second

// errGenerator is the error of an arrival the generator did not send.
var errGenerator = errors.New("not sent by the generator")

// ovOpenLoop is openLoopWith with its memory bounded: Poisson arrivals of
// rate per second for d, each sent from a goroutine of its own at its time
// (loadtest.Pacer), at most maxInFlight at once; an arrival that finds
// maxInFlight in flight or comes over ovMaxLag late is recorded as dropped
// with errGenerator and not sent. When the generator falls behind (too
// little CPU, a server slow to read) it drops rather than piles up
// goroutines, calls and their buffers, which grew a starved generator to
// 13 GB and a run past 18 minutes.
func ovOpenLoop(send func(context.Context) error, rate float64, d, slo time.Duration, maxInFlight int, rng *rand.Rand) []*lcRecord {
	var arrivals []time.Duration
	for at := time.Duration(0); ; {
		at += time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
		if at >= d {
			break
		}
		arrivals = append(arrivals, at)
	}
	recs := make([]*lcRecord, len(arrivals))
	start := time.Now()
	p := loadtest.Pacer{Start: start, MaxInFlight: maxInFlight, MaxLag: ovMaxLag,
		Send: func(i int, at time.Duration) {
			sent := time.Now()
			rec := &lcRecord{lag: sent.Sub(start.Add(at))}
			// A safety net only: far longer than any queue here lasts.
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			err := send(ctx)
			rec.latency = time.Since(sent)
			rec.outcome, rec.err = classify(err, rec.latency, slo), err
			recs[i] = rec
		},
		Drop: func(i int, at time.Duration, detail string) {
			recs[i] = &lcRecord{lag: time.Since(start.Add(at)), outcome: lcDropped,
				err: fmt.Errorf("%w: %s", errGenerator, detail)}
		},
	}
	p.Run(context.Background(), arrivals)
	return recs
}

// genMemSample is the most the generator process held at once.
type genMemSample struct {
	heapInuse  uint64 // Go heap in use, bytes
	goroutines int
	logBytes   int // the server's output the harness keeps
}

// genMemSampler reads the generator's own memory every second until
// stopped: what grows when it falls behind shows here.
type genMemSampler struct {
	stopc chan struct{}
	done  chan struct{}
	max   genMemSample
}

func startGenMemSampler(s *testServer) *genMemSampler {
	g := &genMemSampler{stopc: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(g.done)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			var ms goruntime.MemStats
			goruntime.ReadMemStats(&ms)
			s.log.mu.Lock()
			logBytes := s.log.b.Len()
			s.log.mu.Unlock()
			g.max.heapInuse = max(g.max.heapInuse, ms.HeapInuse)
			g.max.goroutines = max(g.max.goroutines, goruntime.NumGoroutine())
			g.max.logBytes = max(g.max.logBytes, logBytes)
			select {
			case <-g.stopc:
				return
			case <-t.C:
			}
		}
	}()
	return g
}

func (g *genMemSampler) stop() genMemSample {
	close(g.stopc)
	<-g.done
	return g.max
}

// ovMaxInFlight reads SLOSERVE_OVERLOAD_MAX_INFLIGHT: the requests per model
// the generator keeps in flight at most (1024: two models' REST
// connections, one a request, stay within the server's 4096).
func ovMaxInFlight(b *testing.B) int {
	v := os.Getenv("SLOSERVE_OVERLOAD_MAX_INFLIGHT")
	if v == "" {
		return 1024
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		b.Fatalf("SLOSERVE_OVERLOAD_MAX_INFLIGHT=%q: want a count >= 1", v)
	}
	return n
}

func overloadRun(b *testing.B, proto string, cal ovCalibration, factor float64, dur time.Duration, genCPUs float64) {
	slo := time.Duration(cal.sloMS * float64(time.Millisecond))
	maxInFlight := ovMaxInFlight(b)
	var (
		lcRecs, beRecs []*lcRecord
		probe          *prober
		mem            []procSample
		before, after  procSample
		recovery       time.Duration
		server         overloadOutcomes
		confined       string
		clientNote     string
		cpu            cpuUse
		gen            generatorLoad
		elapsed        time.Duration
		memRefused     float64 // limits.max_memory refusals over the load
		unread         float64 // gRPC calls refused unread at limits.max_inflight_requests
		genMem         genMemSample
		memPeak        float64 // bytes reserved at most
	)
	for b.Loop() {
		// At info level (SLOSERVE_OVERLOAD_LOG_LEVEL): the harness pipes
		// the server's log into this process, and at debug the server
		// writes a line for every refusal, thousands a second at 10x,
		// which the confined generator would have to read.
		level := cmp.Or(os.Getenv("SLOSERVE_OVERLOAD_LOG_LEVEL"), "info")
		s := startServer(b, overloadRepo(b, cal.sloMS), "", append(benchProfiling(), withFlags("--log-level", level))...)
		// Half the capacity for a while: the control loop learns the
		// models and the baseline is a working server's.
		warm := startClosedLoop(s, ovLCInfer(1), 1)
		time.Sleep(5 * time.Second)
		warm.stop()
		before = sampleProcs(b, s, 0, true)
		first := detectorOutcomes(b, s)
		m0 := s.scrape(b)
		memRefused0, unread0 := m0["sloserve_memory_refused_total"], m0["sloserve_requests_refused_unread_total"]

		var sendLC, sendBE func(context.Context) error
		switch proto {
		case "grpc":
			n := ovConnections(b)
			clientNote = fmt.Sprintf("gRPC messages marshalled once, %d connections per model", n)
			sendLC, sendBE = grpcSender(b, s, ovLCInfer(1), n, false), grpcSender(b, s, ovBEInfer(), n, false)
		case "grpc-generated":
			clientNote = "gRPC through the generated client, marshalled per call, one connection per model"
			sendLC, sendBE = grpcSender(b, s, ovLCInfer(1), 1, true), grpcSender(b, s, ovBEInfer(), 1, true)
		case "rest":
			clientNote = "REST with the binary tensor extension through loadtest's client: bodies encoded once, headers written once, its own kept-alive connections"
			sendLC, sendBE = restClientSender(b, s, ovLCInfer(1)), restClientSender(b, s, ovBEInfer())
		default: // rest-nethttp
			clientNote = "REST with the binary tensor extension through net/http, bodies encoded once"
			// Two clients, as two applications; refusals close their
			// connections (the body is never read), so the pools refill.
			newClient := func() *http.Client {
				c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024, DisableCompression: true}}
				b.Cleanup(c.CloseIdleConnections)
				return c
			}
			sendLC = restSender(s, newClient(), ovLCName, 1, 3, 320, 320)
			sendBE = restSender(s, newClient(), ovBEName, 1, 3, 48, 320)
		}

		jail := &confinement{
			note:  "generator unconfined (SLOSERVE_OVERLOAD_GENERATOR_CPUS=0)",
			usage: func() (time.Duration, bool) { return 0, false },
			stats: func() (int64, int64) { return 0, 0 },
			leave: func() {},
		}
		if genCPUs > 0 {
			jail = generatorCgroup(b, genCPUs)
		}
		confined = jail.note
		cpu0 := readCPU(b, s)
		gen0, genKnown := jail.usage()
		thr0, per0 := jail.stats()
		start := time.Now()
		probe = startProber(s)
		genSampler := startGenMemSampler(s)
		sm := startSampler(b, s, ovSampleEvery, false)
		var wg sync.WaitGroup
		wg.Go(func() {
			lcRecs = ovOpenLoop(sendLC, factor*cal.lcCapacity, dur, slo, maxInFlight, rand.New(rand.NewPCG(ovSeed, 1)))
		})
		wg.Go(func() {
			beRecs = ovOpenLoop(sendBE, factor*cal.beCapacity, dur, time.Minute, maxInFlight, rand.New(rand.NewPCG(ovSeed, 2)))
		})
		wg.Wait()
		// The load lasts until its last request has ended, which is
		// later than dur when requests queue: CPU is measured over that.
		elapsed = time.Since(start)
		cpu1 := readCPU(b, s)
		gen1, genKnown1 := jail.usage()
		thr1, per1 := jail.stats()
		gen = generatorLoad{elapsed: elapsed, cgroup: gen1 - gen0, cgroupKnown: genKnown && genKnown1,
			process:   time.Duration((cpu1.generator - cpu0.generator) * float64(time.Second)),
			throttled: thr1 - thr0, period: per1 - per0}
		mem = sm.stop()
		genMem = genSampler.stop()
		probe.stop()
		jail.leave()
		cpu = cpuUse{cpu1.server - cpu0.server, cpu1.lc - cpu0.lc, cpu1.be - cpu0.be, cpu1.generator - cpu0.generator}
		last := detectorOutcomes(b, s)
		m := s.scrape(b)
		memRefused, memPeak = m["sloserve_memory_refused_total"]-memRefused0, m["sloserve_memory_reserved_peak_bytes"]
		unread = m["sloserve_requests_refused_unread_total"] - unread0
		server = overloadOutcomes{last.good - first.good, last.late - first.late, last.rejected - first.rejected, last.dropped - first.dropped}

		// Recovery: how long until a detector request is good again.
		t0 := time.Now()
		for time.Since(t0) < time.Minute {
			c0 := time.Now()
			_, err := s.grpc.ModelInfer(b.Context(), ovLCInfer(1))
			if err == nil && time.Since(c0) <= slo {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		recovery = time.Since(t0)
		after = sampleProcs(b, s, 0, true)
		if err := s.stop(); err != nil {
			b.Fatal(err)
		}
	}

	lc, be := tally(lcRecs, dur), tally(beRecs, dur)
	goodput := lc.goodput()
	var maxServer, maxRunners int64
	for _, m := range mem {
		maxServer, maxRunners = max(maxServer, m.serverRSS), max(maxRunners, m.runnerRSS)
	}
	probe.mu.Lock()
	probes, probeFails, probeErr := probe.latencies, probe.failures, probe.lastErr
	probe.mu.Unlock()

	b.ReportMetric(cal.lcCapacity, "lc-capacity-req/s")
	b.ReportMetric(goodput, "lc-good/s")
	b.ReportMetric(goodput/cal.lcCapacity, "lc-good/capacity")
	b.ReportMetric(server.good/dur.Seconds()/cal.lcCapacity, "lc-server-good/capacity")
	b.ReportMetric(pctMS(probes, 0.99), "ready-p99-ms")
	b.ReportMetric(mib(maxServer), "server-max-rss-MiB")
	b.ReportMetric(cpu.server/elapsed.Seconds(), "server-cores")
	b.ReportMetric(gen.cores(), "generator-cores")

	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%s: %gx capacity for %v over %s, detector SLO %.0f ms; %s; %s\n", b.Name(), factor, dur, proto, cal.sloMS, clientNote, confined)
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "model\toffered/s\tcapacity/s\tsent\tgood\tlate\trejected\tdropped\tfailed\tgoodput/s\tgood/capacity\tp50 ms\tp99 ms\tlag p99 ms\t")
	row := func(name string, capacity float64, p *phaseResult) {
		c := p.counts
		fmt.Fprintf(tw, "%s\t%.0f\t%.1f\t%d\t%d\t%d\t%d\t%d\t%d\t%.1f\t%.3f\t%.1f\t%.1f\t%.1f\t\n",
			name, factor*capacity, capacity, p.sent, c[lcGood], c[lcLate], c[lcRejected], c[lcDropped], c[lcFailed],
			p.goodput(), p.goodput()/capacity, pctMS(p.latencies, 0.5), pctMS(p.latencies, 0.99), pctMS(p.lags, 0.99))
	}
	row("detector (latency-critical)", cal.lcCapacity, lc)
	row("recogniser (best-effort)", cal.beCapacity, be)
	tw.Flush()
	fmt.Fprintf(&sb, "detector in the server's scheduler: %.0f good, %.0f late, %.0f rejected, %.0f dropped; good/capacity %.3f (the client saw %d good: %.0f on time in the scheduler became late on the way back)\n",
		server.good, server.late, server.rejected, server.dropped, server.good/dur.Seconds()/cal.lcCapacity, lc.counts[lcGood], max(0, server.good-float64(lc.counts[lcGood])))
	writeCountsCompared(&sb, lcRecs, lc, server, memRefused, unread)
	secs := elapsed.Seconds()
	fmt.Fprintf(&sb, "CPU in cores over the load (%v, until its last request ended): server %.2f, detector runner %.2f, recogniser runner %.2f, %s (of %d)\n",
		elapsed.Round(100*time.Millisecond), cpu.server/secs, cpu.lc/secs, cpu.be/secs, gen, goruntime.NumCPU())
	if sent := lc.sent + be.sent; gen.cgroupKnown && sent > 0 {
		fmt.Fprintf(&sb, "generator: %.0f µs of CPU per request sent (%d sent); at the %.0f requests a second scheduled that needs %.2f cores\n",
			float64(gen.cgroup.Microseconds())/float64(sent), sent, factor*(cal.lcCapacity+cal.beCapacity),
			gen.cgroup.Seconds()/float64(sent)*factor*(cal.lcCapacity+cal.beCapacity))
	}
	fmt.Fprintf(&sb, "readiness probes: %d answered, %d failed (%s); latency p50 %.2f ms, p99 %.2f ms, max %.2f ms\n",
		len(probes), probeFails, probeErr, pctMS(probes, 0.5), pctMS(probes, 0.99), pctMS(probes, 1))
	fmt.Fprintf(&sb, "generator memory (this process, sampled each second over the load): Go heap in use at most %.0f MiB, goroutines at most %d, the server's log kept for failure messages %.1f MiB (%d generator arrivals in flight at most: %d a model)\n",
		mib(int64(genMem.heapInuse)), genMem.goroutines, mib(int64(genMem.logBytes)), 2*maxInFlight, maxInFlight)
	fmt.Fprintf(&sb, "memory: server RSS %.0f MiB before, max %.0f MiB during, %.0f MiB after; runners %.0f / %.0f / %.0f MiB; server goroutines %.0f before, %.0f after\n",
		mib(before.serverRSS), mib(maxServer), mib(after.serverRSS),
		mib(before.runnerRSS), mib(maxRunners), mib(after.runnerRSS), before.goroutines, after.goroutines)
	fmt.Fprintf(&sb, "memory budget (limits.max_memory): %.0f requests refused over the load, at most %.0f MiB reserved\n", memRefused, memPeak/(1<<20))
	fmt.Fprintf(&sb, "recovery: a detector request within its SLO %.0f ms after the load stopped\n", ms(recovery))
	writeExamples(&sb, "detector", lc)
	writeExamples(&sb, "recogniser", be)
	fmt.Print(sb.String())
	if err := gen.check(genCPUs); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkSoak offers each model SLOSERVE_SOAK_LOAD of its capacity for
// SLOSERVE_SOAK_DURATION and reports the server's and runners' goroutines,
// open files and memory over the run.
func BenchmarkSoak(b *testing.B) {
	load := envFloat(b, "SLOSERVE_SOAK_LOAD", 0.7)
	dur := envDuration(b, "SLOSERVE_SOAK_DURATION", 10*time.Minute)
	cal := calibrateOverload(b)
	slo := time.Duration(cal.sloMS * float64(time.Millisecond))
	fmt.Printf("calibration: detector capacity %.1f req/s, recogniser %.1f req/s, detector SLO %.0f ms\n",
		cal.lcCapacity, cal.beCapacity, cal.sloMS)

	var (
		lcRecs, beRecs []*lcRecord
		samples        []procSample
	)
	for b.Loop() {
		s := startServer(b, overloadRepo(b, cal.sloMS), "")
		sm := startSampler(b, s, 10*time.Second, true)
		var wg sync.WaitGroup
		wg.Go(func() {
			lcRecs = openLoop(ownClient(b, s), ovLCInfer(1), load*cal.lcCapacity, dur, slo, rand.New(rand.NewPCG(ovSeed, 3)))
		})
		wg.Go(func() {
			beRecs = openLoop(ownClient(b, s), ovBEInfer(), load*cal.beCapacity, dur, time.Minute, rand.New(rand.NewPCG(ovSeed, 4)))
		})
		wg.Wait()
		samples = sm.stop()
		if err := s.stop(); err != nil {
			b.Fatal(err)
		}
	}

	lc, be := tally(lcRecs, dur), tally(beRecs, dur)
	// The first minute is the warm-up: the control loop and the allocators
	// settle. Growth is judged from its end to the run's end.
	var steady []procSample
	for _, s := range samples {
		if s.at >= time.Minute {
			steady = append(steady, s)
		}
	}
	if len(steady) < 3 {
		steady = samples
	}
	type series struct {
		name string
		unit string
		get  func(procSample) float64
	}
	all := []series{
		{"server goroutines", "", func(p procSample) float64 { return p.goroutines }},
		{"server open files", "", func(p procSample) float64 { return float64(p.serverFDs) }},
		{"server RSS", "MiB", func(p procSample) float64 { return mib(p.serverRSS) }},
		{"server Go heap in use", "MiB", func(p procSample) float64 { return p.heapInuse / (1 << 20) }},
		{"runners' open files", "", func(p procSample) float64 { return float64(p.runnerFDs) }},
		{"runners' RSS", "MiB", func(p procSample) float64 { return mib(p.runnerRSS) }},
		{"runner processes", "", func(p procSample) float64 { return float64(p.runners) }},
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%s: %.0f%% of capacity for %v; %d samples, growth judged after the first minute\n", b.Name(), 100*load, dur, len(samples))
	fmt.Fprintf(&sb, "detector: %d sent, %d good, %d late, %d rejected, %d dropped, %d failed; recogniser: %d sent, %d good, %d failed\n",
		lc.sent, lc.counts[lcGood], lc.counts[lcLate], lc.counts[lcRejected], lc.counts[lcDropped], lc.counts[lcFailed],
		be.sent, be.counts[lcGood], be.counts[lcFailed])
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "series\tat 1 min\tat end\tmin\tmax\tfitted growth per hour\t")
	for _, s := range all {
		vals := make([]float64, len(steady))
		xs := make([]float64, len(steady))
		for i, p := range steady {
			vals[i], xs[i] = s.get(p), p.at.Hours()
		}
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%.1f\t%.1f\t%+.1f %s\t\n", s.name, vals[0], vals[len(vals)-1],
			slices.Min(vals), slices.Max(vals), slope(xs, vals), s.unit)
		b.ReportMetric(vals[len(vals)-1]-vals[0], strings.ReplaceAll(s.name, " ", "-")+"-growth")
	}
	tw.Flush()
	writeExamples(&sb, "detector", lc)
	writeExamples(&sb, "recogniser", be)
	var raw bytes.Buffer
	for _, p := range samples {
		fmt.Fprintf(&raw, "%.0f %.0f %d %.1f %d %.1f\n", p.at.Seconds(), p.goroutines, p.serverFDs, mib(p.serverRSS), p.runnerFDs, mib(p.runnerRSS))
	}
	fmt.Fprintf(&sb, "samples (s, goroutines, server fds, server RSS MiB, runner fds, runner RSS MiB):\n%s", raw.String())
	fmt.Print(sb.String())
}

// slope is the least-squares slope of ys over xs.
func slope(xs, ys []float64) float64 {
	n := float64(len(xs))
	if n < 2 {
		return 0
	}
	var sx, sy, sxx, sxy float64
	for i := range xs {
		sx += xs[i]
		sy += ys[i]
		sxx += xs[i] * xs[i]
		sxy += xs[i] * ys[i]
	}
	d := n*sxx - sx*sx
	if d == 0 {
		return 0
	}
	return (n*sxy - sx*sy) / d
}

// BenchmarkOverloadGenerator measures what one request costs the overload
// benchmark's load generator (this process, unconfined) in CPU time, per
// protocol, client and model, for requests the server refuses after
// receiving them (both models' SLOs 1 ms: at 10x about nine in ten) and
// for requests it serves (the overload SLOs): SLOSERVE_OVERLOAD_SENDERS
// (16) closed-loop senders for SLOSERVE_OVERLOAD_GENERATOR_WINDOW (5s)
// each. The CPU a rate of r requests a second needs is r times the cost;
// the overload generator has SLOSERVE_OVERLOAD_GENERATOR_CPUS.
// SLOSERVE_OVERLOAD_GENERATOR_CLIENTS (a comma-separated list of the client
// column's names) runs only those clients. The rates
// say what the machine carried at once, server included, on a connection
// or several: read them as ratios within one run.
func BenchmarkOverloadGenerator(b *testing.B) {
	window := envDuration(b, "SLOSERVE_OVERLOAD_GENERATOR_WINDOW", 5*time.Second)
	senders := int(envFloat(b, "SLOSERVE_OVERLOAD_SENDERS", 16))
	type sender struct {
		name string
		make func(s *testServer, msg *inference.ModelInferRequest) func(context.Context) error
	}
	rest := func(s *testServer, msg *inference.ModelInferRequest) func(context.Context) error {
		c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024, DisableCompression: true}}
		b.Cleanup(c.CloseIdleConnections)
		return restSender(s, c, msg.ModelName, msg.Inputs[0].Shape...)
	}
	senderKinds := []sender{
		{"grpc generated 1 conn", func(s *testServer, m *inference.ModelInferRequest) func(context.Context) error {
			return grpcSender(b, s, m, 1, true)
		}},
		{"grpc pre-encoded 1 conn", func(s *testServer, m *inference.ModelInferRequest) func(context.Context) error {
			return grpcSender(b, s, m, 1, false)
		}},
		{fmt.Sprintf("grpc pre-encoded %d conns", loadtest.DefaultConnections), func(s *testServer, m *inference.ModelInferRequest) func(context.Context) error {
			return grpcSender(b, s, m, loadtest.DefaultConnections, false)
		}},
		{"rest binary net/http", rest},
		{"rest binary loadtest net/http", func(s *testServer, m *inference.ModelInferRequest) func(context.Context) error {
			// loadtest's client as it sent before its own connections:
			// through a net/http client tuned as it was.
			tr := &http.Transport{MaxIdleConnsPerHost: 1024, DisableCompression: true}
			hc := &http.Client{Transport: tr}
			b.Cleanup(hc.CloseIdleConnections)
			in := m.Inputs[0]
			c, err := loadtest.NewClient(loadtest.ClientOptions{
				Protocol: loadtest.ProtoRESTBinary, HTTPBase: s.http, Model: m.ModelName, HTTPClient: hc,
				Inputs:        []loadtest.Tensor{{Name: in.Name, DataType: in.Datatype, Shape: in.Shape, Raw: m.RawInputContents[0]}},
				ServerTimeout: -1,
			})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { c.Close() })
			return loadtestSend(c)
		}},
		{"rest binary loadtest", func(s *testServer, m *inference.ModelInferRequest) func(context.Context) error {
			return restClientSender(b, s, m)
		}},
	}
	if v := os.Getenv("SLOSERVE_OVERLOAD_GENERATOR_CLIENTS"); v != "" {
		keep := strings.Split(v, ",")
		senderKinds = slices.DeleteFunc(senderKinds, func(k sender) bool { return !slices.Contains(keep, k.name) })
		if len(senderKinds) == 0 {
			b.Fatalf("SLOSERVE_OVERLOAD_GENERATOR_CLIENTS=%q names none of the clients", v)
		}
	}
	cpuNow := func() time.Duration {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			b.Fatal(err)
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	var sb strings.Builder
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "server\tmodel\tclient\trequests\tgood\trefused\tother\treq/s\tMB/s sent\tgenerator µs CPU/request\tserver µs CPU/request\t")
	for b.Loop() {
		for _, admit := range []string{"refused", "served"} {
			lcSLO, beSLO := 1.0, 1.0
			if admit == "served" {
				lcSLO, beSLO = 5000, 60000
			}
			s := startServer(b, overloadRepoSLOs(b, lcSLO, beSLO), "", withFlags("--log-level", "info"))
			for _, msg := range []*inference.ModelInferRequest{ovLCInfer(1), ovBEInfer()} {
				size := float64(len(msg.RawInputContents[0]))
				for _, k := range senderKinds {
					send := k.make(s, msg)
					var counts [numLCOutcomes]int
					var n int
					var mu sync.Mutex
					run := func(d time.Duration, count bool) {
						end := time.Now().Add(d)
						var wg sync.WaitGroup
						for range senders {
							wg.Go(func() {
								for time.Now().Before(end) {
									err := send(b.Context())
									if count {
										mu.Lock()
										counts[classify(err, 0, time.Hour)]++
										n++
										mu.Unlock()
									}
								}
							})
						}
						wg.Wait()
					}
					run(time.Second, false) // connections up, pools warm
					srv0, gen0, t0 := cpuSeconds(s.cmd.Process.Pid), cpuNow(), time.Now()
					run(window, true)
					el := time.Since(t0).Seconds()
					gen, srv := cpuNow()-gen0, cpuSeconds(s.cmd.Process.Pid)-srv0
					fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%.1f\t%.0f\t%.0f\t%.0f\t\n", admit, msg.ModelName, k.name, n,
						counts[lcGood], counts[lcRejected], n-counts[lcGood]-counts[lcRejected], float64(n)/el,
						float64(n)*size/el/1e6, float64(gen.Microseconds())/float64(max(n, 1)), srv*1e6/float64(max(n, 1)))
				}
			}
			if err := s.stop(); err != nil {
				b.Fatal(err)
			}
		}
	}
	tw.Flush()
	fmt.Printf("\n%s: %d closed-loop senders, %v a case, generator unconfined (process CPU, getrusage)\n%s", b.Name(), senders, window, sb.String())
}
