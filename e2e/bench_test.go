package e2e

// Benchmarks of the whole server path against a direct in-process ONNX
// Runtime call, measured side by side in the same run so that machine noise
// hits both. Run with `make bench BENCH=Server PKGS=./cmd/sloserve`.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	ort "github.com/yalue/onnxruntime_go"

	"github.com/sloserve/sloserve/api/inference"
)

func initORT(b testing.TB) {
	b.Helper()
	if !ort.IsInitialized() {
		ort.SetSharedLibraryPath(need(b, "SLOSERVE_ONNXRUNTIME_LIBRARY"))
		if err := ort.InitializeEnvironment(); err != nil {
			b.Fatal(err)
		}
	}
}

// directSession is a dynamic session in this process: the baseline.
func directSession(b testing.TB, path string, in, out string, threads int) *ort.DynamicAdvancedSession {
	b.Helper()
	initORT(b)
	opts, err := ort.NewSessionOptions()
	if err != nil {
		b.Fatal(err)
	}
	defer opts.Destroy()
	if threads > 0 {
		if err := opts.SetIntraOpNumThreads(threads); err != nil {
			b.Fatal(err)
		}
	}
	s, err := ort.NewDynamicAdvancedSession(path, []string{in}, []string{out}, opts)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Destroy() })
	return s
}

// runDirect runs one call the way an embedding program would: wrap the
// input, run, read the output.
func runDirect(b testing.TB, s *ort.DynamicAdvancedSession, shape []int64, data []float32) []float32 {
	in, err := ort.NewTensor(ort.NewShape(shape...), data)
	if err != nil {
		b.Fatal(err)
	}
	defer in.Destroy()
	outs := []ort.Value{nil}
	if err := s.Run([]ort.Value{in}, outs); err != nil {
		b.Fatal(err)
	}
	defer outs[0].Destroy()
	return outs[0].(*ort.Tensor[float32]).GetData()
}

// benchShared runs a benchmark's server under the shared policy (no
// shares, no limiter): the serving-path and scheduler benchmarks measure
// those parts alone, as before the control loop existed.
const benchShared = "control: {policy: shared}\n"

// benchProfiling lets the server benchmarks be profiled: with
// SLOSERVE_BENCH_PPROF_ADDR set, the server serves /debug/pprof/ there
// (`go tool pprof http://ADDR/debug/pprof/profile?seconds=10` while the
// benchmark runs); with SLOSERVE_RUNNER_PROFILE_DIR set, the runners
// write their profiles into that folder when they stop.
func benchProfiling() []serverOption {
	if addr := os.Getenv("SLOSERVE_BENCH_PPROF_ADDR"); addr != "" {
		return []serverOption{withFlags("--pprof-addr", addr)}
	}
	return nil
}

func percentile(ds []time.Duration, p float64) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[int(float64(len(s)-1)*p)]
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// BenchmarkServerOverhead interleaves a direct call, a gRPC call and a REST
// JSON call on the tiny row-sum network and reports each path's p50/p99 and
// the latency the server path adds over the direct call, for the model in
// a runner process and in the server, and how the runner calls waited in
// their mailbox (mailboxMetrics). With SLOSERVE_BENCH_BASELINE_BIN set to
// a sloserve binary built from another commit, each case runs on that
// binary too ("/bin=baseline"), right after this build's: before and
// after, alternated in one run.
func BenchmarkServerOverhead(b *testing.B) {
	bins := []struct{ name, path string }{{"", ""}}
	if path := os.Getenv("SLOSERVE_BENCH_BASELINE_BIN"); path != "" {
		bins = append(bins, struct{ name, path string }{"/bin=baseline", path})
	}
	for _, c := range []struct {
		name, isolation string
		spinning        bool
		opts            []serverOption
	}{
		{"isolation=process", "process", false, nil},
		{"isolation=in-process", "in-process", false, nil},
		// The runner hop as it was before the call mailbox: every call on
		// the runner's socket.
		{"isolation=process/mailbox=off", "process", false, []serverOption{withSet("runtime.call_mailbox=false")}},
		// A model that owns its cores: its runner's worker polls through
		// the gap between calls instead of sleeping (allow_spinning).
		{"isolation=process/spinning", "process", true, nil},
	} {
		for _, bin := range bins {
			opts := slices.Clone(c.opts)
			if bin.path != "" {
				opts = append(opts, withCommand(bin.path, nil))
			}
			b.Run(c.name+bin.name, func(b *testing.B) { benchServerOverhead(b, c.isolation, c.spinning, opts...) })
		}
	}
}

// isolations are the execution.isolation settings the server benchmarks
// compare: a runner process per instance (tensors through its arena), and
// the model inside the server.
var isolations = []string{"process", "in-process"}

func benchServerOverhead(b *testing.B, isolation string, spinning bool, opts ...serverOption) {
	repo := b.TempDir()
	tiny := testModel(b, "example_dynamic_axes.onnx")
	writeRepo(b, repo, repoModel{"tiny", tiny, fmt.Sprintf("max_batch_size: 8\nexecution: {intra_op_threads: 1, allow_spinning: %v, isolation: %s}\n", spinning, isolation)})
	s := startServer(b, repo, benchShared, append(opts, benchProfiling()...)...)
	direct := directSession(b, tiny, "input_vectors", "output_scalars", 1)

	data := make([]float32, 10)
	for i := range data {
		data[i] = float32(i)
	}
	grpcReq := &inference.ModelInferRequest{
		ModelName: "tiny",
		Inputs: []*inference.ModelInferRequest_InferInputTensor{{
			Name: "input_vectors", Datatype: "FP32", Shape: []int64{1, 10},
		}},
		RawInputContents: [][]byte{f32bytes(data)},
	}
	restBody, _ := json.Marshal(jsonInferRequest{Inputs: []jsonTensor{{
		Name: "input_vectors", Datatype: "FP32", Shape: []int64{1, 10}, Data: data,
	}}})
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
	rest := func() {
		resp, err := client.Post(s.http+"/v2/models/tiny/infer", "application/json", bytes.NewReader(restBody))
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			b.Fatalf("REST status %d", resp.StatusCode)
		}
	}
	// Warm every path.
	for range 200 {
		runDirect(b, direct, []int64{1, 10}, data)
		if _, err := s.grpc.ModelInfer(b.Context(), grpcReq); err != nil {
			b.Fatal(err)
		}
		rest()
	}
	// The transport floor: a gRPC call the server answers without touching
	// a model (ServerLive), on the same connection.
	live := func() {
		if _, err := s.grpc.ServerLive(b.Context(), &inference.ServerLiveRequest{}); err != nil {
			b.Fatal(err)
		}
	}
	var dDirect, dGRPC, dREST, dLive []time.Duration
	box0 := mailboxMetrics(b, s)
	b.ReportAllocs()
	for b.Loop() {
		t0 := time.Now()
		runDirect(b, direct, []int64{1, 10}, data)
		t1 := time.Now()
		if _, err := s.grpc.ModelInfer(b.Context(), grpcReq); err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		rest()
		t3 := time.Now()
		live()
		t4 := time.Now()
		dDirect = append(dDirect, t1.Sub(t0))
		dGRPC = append(dGRPC, t2.Sub(t1))
		dREST = append(dREST, t3.Sub(t2))
		dLive = append(dLive, t4.Sub(t3))
	}
	b.StopTimer()
	for _, m := range []struct {
		name string
		ds   []time.Duration
	}{{"direct", dDirect}, {"grpc", dGRPC}, {"rest", dREST}, {"grpc-live", dLive}} {
		b.ReportMetric(us(percentile(m.ds, 0.5)), m.name+"-p50-µs")
		b.ReportMetric(us(percentile(m.ds, 0.99)), m.name+"-p99-µs")
	}
	reportMailbox(b, box0, mailboxMetrics(b, s))
	b.ReportMetric(us(percentile(dGRPC, 0.5)-percentile(dDirect, 0.5)), "grpc-added-p50-µs")
	// What issue 33 measures: the gRPC call over the transport's floor.
	b.ReportMetric(us(percentile(dGRPC, 0.5)-percentile(dLive, 0.5)), "grpc-over-live-p50-µs")
	b.ReportMetric(us(percentile(dREST, 0.5)-percentile(dDirect, 0.5)), "rest-added-p50-µs")
	b.ReportMetric(us(percentile(dGRPC, 0.99)-percentile(dDirect, 0.99)), "grpc-added-p99-µs")
	b.ReportMetric(us(percentile(dREST, 0.99)-percentile(dDirect, 0.99)), "rest-added-p99-µs")
	// Allocations in the server per call of each path, from its Go
	// runtime's count: independent of the machine's load. And the CPU
	// time per call of the server and of its runners (their threads'
	// schedstat, in nanoseconds), each path's calls one after another.
	const calls = 500
	for _, p := range []struct {
		name string
		call func()
	}{{"grpc", func() {
		if _, err := s.grpc.ModelInfer(b.Context(), grpcReq); err != nil {
			b.Fatal(err)
		}
	}}, {"rest", rest}, {"grpc-live", live}} {
		before := serverMallocs(b, s)
		server, runners := s.cpu(b)
		for range calls {
			p.call()
		}
		b.ReportMetric((serverMallocs(b, s)-before)/calls, p.name+"-server-allocs/call")
		server2, runners2 := s.cpu(b)
		b.ReportMetric(us(server2-server)/calls, p.name+"-server-cpu-µs/call")
		if isolation == "process" {
			b.ReportMetric(us(runners2-runners)/calls, p.name+"-runner-cpu-µs/call")
		}
	}
}

// mailboxMetrics is the server's sloserve_runner_mailbox_* series
// (runtime.NewMailboxMetrics); empty from a server without them.
func mailboxMetrics(b *testing.B, s *testServer) map[string]float64 {
	series := map[string]float64{}
	for k, v := range s.scrape(b) {
		if strings.HasPrefix(k, "sloserve_runner_mailbox_") {
			series[k] = v
		}
	}
	return series
}

// reportMailbox reports how the runner calls between the two scrapes
// waited in their mailbox, per call answered in its slot (the gRPC and
// the REST calls both): on the server's side (its callers waiting for
// answers), whether they polled, caught the answer polling, slept, and
// how often they woke a worker; on the runner's (its workers waiting for
// calls), the same and how often they woke a caller; and the mean time
// from the post to a worker taking the call, the run, and from the
// answer to the caller having read it.
func reportMailbox(b *testing.B, before, after map[string]float64) {
	d := func(series string) float64 { return after[series] - before[series] }
	calls := d("sloserve_runner_mailbox_calls_total")
	if calls <= 0 {
		return
	}
	for _, side := range []string{"server", "runner"} {
		for _, m := range []struct{ series, unit string }{
			{"polls", "polls"}, {"polls_caught", "caught"}, {"sleeps", "sleeps"}, {"wakes", "wakes"},
		} {
			b.ReportMetric(d(fmt.Sprintf("sloserve_runner_mailbox_%s_total{side=%q}", m.series, side))/calls, "mbox-"+side+"-"+m.unit+"/call")
		}
	}
	for _, part := range []string{"to_take", "run", "to_seen"} {
		b.ReportMetric(d(fmt.Sprintf("sloserve_runner_mailbox_call_seconds_total{part=%q}", part))/calls*1e6, "mbox-"+strings.ReplaceAll(part, "_", "-")+"-µs")
	}
}

// cpu is the CPU time the server's threads and its runners' have run so
// far, from /proc/PID/task/*/schedstat: nanoseconds, where /proc/PID/stat
// counts in ticks of 10 ms.
func (s *testServer) cpu(b *testing.B) (server, runners time.Duration) {
	server = threadsCPU(s.cmd.Process.Pid)
	for _, pid := range s.children() {
		runners += threadsCPU(pid)
	}
	return server, runners
}

// threadsCPU is the CPU time the threads of process pid have run so far;
// 0 when it cannot be read.
func threadsCPU(pid int) time.Duration {
	paths, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
	var n int64
	for _, path := range paths {
		b, err := os.ReadFile(path)
		if err != nil {
			continue // a thread that ended meanwhile
		}
		if f := strings.Fields(string(b)); len(f) > 0 {
			k, _ := strconv.ParseInt(f[0], 10, 64)
			n += k
		}
	}
	return time.Duration(n)
}

// serverMallocs is the server's count of heap allocations so far.
func serverMallocs(b *testing.B, s *testServer) float64 {
	v, ok := s.metricValue(b, "go_memstats_mallocs_total")
	if !ok {
		b.Fatal("no go_memstats_mallocs_total")
	}
	return v
}

// BenchmarkServerThroughput16 drives the tiny network through gRPC from 16
// concurrent clients and reports inferences per second, beside 16
// goroutines calling one in-process session for the same time.
// The spinning case is the model with allow_spinning: its runners' polls
// must not cost it throughput when calls come back to back.
func BenchmarkServerThroughput16(b *testing.B) {
	for _, iso := range isolations {
		b.Run("isolation="+iso, func(b *testing.B) { benchServerThroughput16(b, iso, false) })
	}
	b.Run("isolation=process/spinning", func(b *testing.B) { benchServerThroughput16(b, "process", true) })
}

func benchServerThroughput16(b *testing.B, isolation string, spinning bool) {
	repo := b.TempDir()
	tiny := testModel(b, "example_dynamic_axes.onnx")
	writeRepo(b, repo, repoModel{"tiny", tiny, fmt.Sprintf("max_batch_size: 8\ninstances: 2\nexecution: {intra_op_threads: 1, concurrency: 4, allow_spinning: %v, isolation: %s}\n", spinning, isolation)})
	s := startServer(b, repo, benchShared, benchProfiling()...)
	direct := directSession(b, tiny, "input_vectors", "output_scalars", 1)
	data := make([]float32, 10)
	req := &inference.ModelInferRequest{
		ModelName:        "tiny",
		Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{1, 10}}},
		RawInputContents: [][]byte{f32bytes(data)},
	}
	// The connection learns its calls' message size first: on a fresh
	// gRPC connection each call being read reserves the largest message
	// (64 MiB) until one has been read (api/grpc_conn_budget.go). This
	// benchmark measures the steady state.
	for range 20 {
		if _, err := s.grpc.ModelInfer(b.Context(), req); err != nil {
			b.Fatal(err)
		}
	}
	const clients = 16
	window := 2 * time.Second
	measure := func(call func()) float64 {
		var n atomic.Int64
		var wg sync.WaitGroup
		deadline := time.Now().Add(window)
		for range clients {
			wg.Go(func() {
				for time.Now().Before(deadline) {
					call()
					n.Add(1)
				}
			})
		}
		wg.Wait()
		return float64(n.Load()) / window.Seconds()
	}
	var server, local []float64
	var use throughputUse
	for b.Loop() {
		before := readThroughputUse(b, s)
		rate := measure(func() {
			if _, err := s.grpc.ModelInfer(b.Context(), req); err != nil {
				b.Error(err)
			}
		})
		use = use.add(readThroughputUse(b, s).sub(before))
		server = append(server, rate)
		local = append(local, measure(func() { runDirect(b, direct, []int64{1, 10}, data) }))
	}
	slices.Sort(server)
	slices.Sort(local)
	b.ReportMetric(server[len(server)/2], "grpc-infer/s")
	b.ReportMetric(local[len(local)/2], "direct-infer/s")
	b.ReportMetric(server[len(server)/2]/local[len(local)/2], "grpc/direct")
	// Where the cores go: CPU time per inference of each process over the
	// gRPC windows (robust on a busy machine, unlike the rate), the mean
	// executed batch, and the rate the machine's cores would allow if
	// server, runners and client had them to themselves.
	if use.infers > 0 {
		per := func(sec float64) float64 { return sec / use.infers * 1e6 }
		b.ReportMetric(per(use.server), "server-cpu-µs/infer")
		b.ReportMetric(per(use.runners), "runner-cpu-µs/infer")
		b.ReportMetric(per(use.client), "client-cpu-µs/infer")
		b.ReportMetric(use.mallocs/use.infers, "server-allocs/infer")
		if total := use.server + use.runners + use.client; total > 0 {
			b.ReportMetric(float64(goruntime.NumCPU())*use.infers/total, "cpu-bound-infer/s")
		}
	}
	if use.batches > 0 {
		b.ReportMetric(use.rows/use.batches, "mean-batch")
	}
}

// throughputUse is what a throughput window used: CPU seconds of the
// server, its runners and this process (the clients), the inferences the
// scheduler counted, its executed batches and their rows, and the server's
// heap allocations.
type throughputUse struct{ server, runners, client, infers, batches, rows, mallocs float64 }

func readThroughputUse(b *testing.B, s *testServer) throughputUse {
	u := throughputUse{server: cpuSeconds(s.cmd.Process.Pid), client: cpuSeconds(os.Getpid())}
	u.mallocs = serverMallocs(b, s)
	for _, pid := range s.children() {
		u.runners += cpuSeconds(pid)
	}
	for k, v := range s.scrape(b) {
		switch {
		case strings.HasPrefix(k, "sloserve_qos_batch_size_count{"):
			u.batches += v
		case strings.HasPrefix(k, "sloserve_qos_batch_size_sum{"):
			u.rows += v
		case strings.HasPrefix(k, "sloserve_qos_requests_total{") && (strings.Contains(k, `outcome="good"`) || strings.Contains(k, `outcome="late"`)):
			u.infers += v
		}
	}
	return u
}

func (u throughputUse) sub(o throughputUse) throughputUse {
	return throughputUse{u.server - o.server, u.runners - o.runners, u.client - o.client, u.infers - o.infers, u.batches - o.batches, u.rows - o.rows, u.mallocs - o.mallocs}
}

func (u throughputUse) add(o throughputUse) throughputUse {
	return throughputUse{u.server + o.server, u.runners + o.runners, u.client + o.client, u.infers + o.infers, u.batches + o.batches, u.rows + o.rows, u.mallocs + o.mallocs}
}

// BenchmarkServerDetector640 compares the PP-OCRv4 detector on a 640x640
// image through gRPC against the same model in process, interleaved, with
// the server running it in a runner process and in itself; and per
// isolation with the tensors in the messages (grpc), and with the client's
// system shared memory holding the input and receiving the output
// (grpc-shm), the image already in the region as the direct call has it
// already in memory.
func BenchmarkServerDetector640(b *testing.B) {
	for _, iso := range isolations {
		b.Run("isolation="+iso, func(b *testing.B) { benchServerDetector640(b, iso) })
	}
}

func benchServerDetector640(b *testing.B, isolation string) {
	repo := b.TempDir()
	det := demoModel(b, "ocr-det")
	// Spinning allowed, as in the direct session's default options.
	writeRepo(b, repo, repoModel{"det", det, "max_batch_size: 1\nexecution: {intra_op_threads: 2, allow_spinning: true, isolation: " + isolation + "}\n"})
	s := startServer(b, repo, benchShared, benchProfiling()...)
	direct := directSession(b, det, "x", "sigmoid_0.tmp_0", 2)
	rng := rand.New(rand.NewPCG(3, 4))
	img := make([]float32, 3*640*640)
	for i := range img {
		img[i] = rng.Float32()
	}
	shape := []int64{1, 3, 640, 640}
	inline := &inference.ModelInferRequest{
		ModelName:        "det",
		Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: shape}},
		RawInputContents: [][]byte{f32bytes(img)},
	}
	b.Run("grpc", func(b *testing.B) { benchDetector(b, s, direct, shape, img, inline) })
	b.Run("grpc-shm", func(b *testing.B) {
		const inBytes, outBytes = 3 * 640 * 640 * 4, 640 * 640 * 4
		key, f := benchShmObject(b, inBytes+outBytes)
		if _, err := f.WriteAt(f32bytes(img), 0); err != nil {
			b.Fatal(err)
		}
		for _, r := range []*inference.SystemSharedMemoryRegisterRequest{
			{Name: "det-in", Key: key, Offset: 0, ByteSize: inBytes},
			{Name: "det-out", Key: key, Offset: inBytes, ByteSize: outBytes},
		} {
			if _, err := s.grpc.SystemSharedMemoryRegister(b.Context(), r); err != nil {
				b.Fatal(err)
			}
		}
		b.Cleanup(func() {
			_, _ = s.grpc.SystemSharedMemoryUnregister(context.Background(), &inference.SystemSharedMemoryUnregisterRequest{})
		})
		req := &inference.ModelInferRequest{
			ModelName: "det",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: shape,
				Parameters: shmInt64("det-in", 0, inBytes)}},
			Outputs: []*inference.ModelInferRequest_InferRequestedOutputTensor{{Name: "sigmoid_0.tmp_0",
				Parameters: shmInt64("det-out", 0, outBytes)}},
		}
		benchDetector(b, s, direct, shape, img, req)
	})
}

// benchShmObject creates a POSIX shared-memory object of size bytes.
func benchShmObject(b *testing.B, size int) (string, *os.File) {
	b.Helper()
	name := fmt.Sprintf("sloserve-bench-%d-%d", os.Getpid(), shmSeq.Add(1))
	f, err := os.OpenFile("/dev/shm/"+name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		b.Skipf("no POSIX shared memory here: %v", err)
	}
	b.Cleanup(func() { f.Close(); os.Remove("/dev/shm/" + name) })
	if err := f.Truncate(int64(size)); err != nil {
		b.Fatal(err)
	}
	return "/" + name, f
}

// benchDetector interleaves direct calls and server calls of req and
// reports both p50s, their ratio and where the server's time went.
func benchDetector(b *testing.B, s *testServer, direct *ort.DynamicAdvancedSession, shape []int64, img []float32, req *inference.ModelInferRequest) {
	for range 3 {
		runDirect(b, direct, shape, img)
		if _, err := s.grpc.ModelInfer(b.Context(), req); err != nil {
			b.Fatal(err)
		}
	}
	// The server's own statistics are cumulative: this run's share is the
	// difference.
	stats := func() *inference.InferStatistics {
		st, err := s.grpc.ModelStatistics(b.Context(), &inference.ModelStatisticsRequest{Name: "det"})
		if err != nil {
			b.Fatal(err)
		}
		return st.ModelStats[0].InferenceStats
	}
	before := stats()
	// A pause between calls lets the other path's ONNX Runtime threads go
	// idle, so neither call runs while the other's threads still spin.
	const settle = 50 * time.Millisecond
	var dDirect, dServer []time.Duration
	for b.Loop() {
		t0 := time.Now()
		runDirect(b, direct, shape, img)
		dDirect = append(dDirect, time.Since(t0))
		time.Sleep(settle)
		t1 := time.Now()
		if _, err := s.grpc.ModelInfer(b.Context(), req); err != nil {
			b.Fatal(err)
		}
		dServer = append(dServer, time.Since(t1))
		time.Sleep(settle)
	}
	b.StopTimer()
	// Where the server's time went: total inside the server, and the
	// runner's input copy, session run and output copy.
	after := stats()
	perCall := func(a, b0 *inference.StatisticDuration) float64 {
		if a.Count == b0.Count {
			return 0
		}
		return float64(a.Ns-b0.Ns) / float64(a.Count-b0.Count) / 1e6
	}
	b.ReportMetric(perCall(after.Success, before.Success), "server-mean-ms")
	b.ReportMetric(perCall(after.ComputeInput, before.ComputeInput), "runner-input-mean-ms")
	b.ReportMetric(perCall(after.ComputeInfer, before.ComputeInfer), "runner-infer-mean-ms")
	b.ReportMetric(perCall(after.ComputeOutput, before.ComputeOutput), "runner-output-mean-ms")
	pd, ps := percentile(dDirect, 0.5), percentile(dServer, 0.5)
	b.ReportMetric(float64(pd)/1e6, "direct-p50-ms")
	b.ReportMetric(float64(ps)/1e6, "grpc-p50-ms")
	b.ReportMetric(float64(ps)/float64(pd), "grpc/direct-p50")
}
