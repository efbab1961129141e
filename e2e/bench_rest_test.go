package e2e

// BenchmarkRESTTiny: REST JSON inference on the demo wake-word model
// (wakeword-hello: 25x96 FP32 in, one score out) beside its floors, in one
// run on one server. Run with
//
//	go test -run '^$' -bench RESTTiny -benchtime 1x ./e2e
//
// The model is latency-critical with a 40 ms SLO, as a user serving a
// wake-word detector would set it. Paths, each sent as its own client
// library writes it and read to its end:
//
//   - rest-ready: GET /v2/health/ready, the REST floor (no model);
//   - rest-json: the request as the load generator writes it (FP32 values
//     with the fewest digits, float32's shortest form);
//   - rest-json-py: the same values as Triton's Python client writes them
//     (tritonclient's set_data_from_numpy turns each float32 into a Python
//     float, which json.dumps writes with up to 17 digits);
//   - rest-binary: the binary tensor data extension, binary output;
//   - grpc: ModelInfer, the load generator's gRPC client;
//   - grpc-live: ServerLive, the gRPC floor.
//
// REST requests go over kept-alive HTTP/1.1 connections of the benchmark's
// own, each request's bytes as net/http writes them (Request.Write), written
// in one call, and the response parsed by net/http's ReadResponse: the
// client costs the same for every REST path. Per round: one closed-loop
// client interleaving the paths (p50, p99), then 16 closed-loop clients on
// each path in turn for SLOSERVE_REST_BENCH_WINDOW (3s) (requests a second,
// 429s and 504s, and the server's and runner's CPU per request; any other
// failure ends the benchmark).
// SLOSERVE_REST_BENCH_ROUNDS (3) rounds of SLOSERVE_REST_BENCH_CALLS (2000)
// calls per path at one client; the medians are reported, and a
// table of them is logged. On a shared machine read the ratios to the
// floors, and the CPU per request, not the figures.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/loadtest"
)

// The wake-word model's name, input and shape.
const (
	wakeModel = "wakeword-hello"
	wakeInput = "onnx::Flatten_0"
)

var wakeShape = []int64{1, 25, 96}

// wakeRepo is a repository holding the demo wake-word model, latency-
// critical with a 40 ms SLO, otherwise as the demo repository serves it.
func wakeRepo(tb testing.TB) string {
	repo := tb.TempDir()
	writeRepo(tb, repo, repoModel{wakeModel, demoModel(tb, wakeModel), `max_batch_size: 0
instances: 1
execution: {provider: cpu, intra_op_threads: 1}
slo: {latency_ms: 40, class: latency-critical}
resources: {memory_limit: 128MiB, min_compute_share: 0.05, max_compute_share: 1.0}
`})
	return repo
}

// wakeValues are the 2,400 input values: features in [-1, 1).
func wakeValues() []float32 {
	rng := rand.New(rand.NewPCG(33, 1))
	vs := make([]float32, 25*96)
	for i := range vs {
		vs[i] = float32(rng.Float64()*2 - 1)
	}
	return vs
}

// wakeJSON is the JSON body of a wake-word request. py writes each value as
// Python's json.dumps writes the float64 a float32 becomes (repr: the
// shortest digits that read back as that float64); otherwise with the
// fewest digits that read back as the float32, as the load generator does.
func wakeJSON(vs []float32, py bool) []byte {
	b := []byte(`{"inputs": [{"name": "` + wakeInput + `", "shape": [1, 25, 96], "datatype": "FP32", "data": [`)
	for i, v := range vs {
		if i > 0 {
			b = append(b, ", "...)
		}
		if py {
			b = strconv.AppendFloat(b, float64(v), 'g', -1, 64)
		} else {
			b = strconv.AppendFloat(b, float64(v), 'g', -1, 32)
		}
	}
	return append(b, "]}]}"...)
}

// wakeBinary is a wake-word request in the binary tensor data extension,
// asking for its output in binary too: the body and the JSON header's
// length.
func wakeBinary(vs []float32) ([]byte, int) {
	header := fmt.Sprintf(`{"inputs":[{"name":%q,"shape":[1,25,96],"datatype":"FP32","parameters":{"binary_data_size":%d}}],"parameters":{"binary_data_output":true}}`,
		wakeInput, 4*len(vs))
	return append([]byte(header), f32bytes(vs)...), len(header)
}

// rawRequest is the bytes net/http writes for a request to base+path with
// body (nil: a GET) and the header pairs.
func rawRequest(tb testing.TB, base, path string, body []byte, header ...string) []byte {
	method := http.MethodGet
	var rd io.Reader
	if body != nil {
		method, rd = http.MethodPost, bytes.NewReader(body)
	}
	req, err := http.NewRequest(method, base+path, rd)
	if err != nil {
		tb.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	var buf bytes.Buffer
	if err := req.Write(&buf); err != nil {
		tb.Fatal(err)
	}
	return buf.Bytes()
}

// rawHTTP sends one prepared request over a kept-alive connection of its
// own, dialling again when the server closed it.
type rawHTTP struct {
	addr string
	req  []byte
	conn net.Conn
	br   *bufio.Reader
}

func newRawHTTP(s *testServer, req []byte) *rawHTTP {
	return &rawHTTP{addr: strings.TrimPrefix(s.http, "http://"), req: req}
}

// do sends the request and reads the response to its end: its status and
// body.
func (c *rawHTTP) do() (int, []byte, error) {
	if c.conn == nil {
		conn, err := net.Dial("tcp", c.addr)
		if err != nil {
			return 0, nil, err
		}
		c.conn, c.br = conn, bufio.NewReaderSize(conn, 64<<10)
	}
	if _, err := c.conn.Write(c.req); err != nil {
		c.close()
		return 0, nil, err
	}
	resp, err := http.ReadResponse(c.br, nil)
	if err != nil {
		c.close()
		return 0, nil, err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.Close {
		c.close()
	}
	return resp.StatusCode, body, err
}

func (c *rawHTTP) close() {
	if c.conn != nil {
		c.conn.Close()
		c.conn = nil
	}
}

// tinyPath is one way of asking the server something, for one client: a
// new caller per client (connections are not shared).
type tinyPath struct {
	name   string
	caller func() (call func() (status int, err error), done func())
}

// tinyPaths are the benchmark's paths on server s.
func tinyPaths(tb testing.TB, s *testServer) []tinyPath {
	vs := wakeValues()
	bin, headerLen := wakeBinary(vs)
	infer := "/v2/models/" + wakeModel + "/infer"
	// rest calls req; an inference's answer must have a body (a health
	// probe's has none).
	rest := func(req []byte) func() (func() (int, error), func()) {
		return func() (func() (int, error), func()) {
			c := newRawHTTP(s, req)
			infer := bytes.HasPrefix(req, []byte("POST "))
			return func() (int, error) {
				code, body, err := c.do()
				if err == nil && code == http.StatusOK && infer && len(body) == 0 {
					err = fmt.Errorf("an empty answer")
				}
				return code, err
			}, c.close
		}
	}
	grpcClient, err := loadtest.NewClient(loadtest.ClientOptions{
		Protocol: loadtest.ProtoGRPC, GRPCAddr: s.grpcAddr, Model: wakeModel,
		Inputs:        []loadtest.Tensor{{Name: wakeInput, DataType: "FP32", Shape: wakeShape, Raw: f32bytes(vs)}},
		ServerTimeout: -1, GRPCDialOptions: []grpc.DialOption{grpc.WithTransportCredentials(s.creds)},
	})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { grpcClient.Close() })
	return []tinyPath{
		{"rest-ready", rest(rawRequest(tb, s.http, "/v2/health/ready", nil))},
		{"rest-json", rest(rawRequest(tb, s.http, infer, wakeJSON(vs, false), "Content-Type", "application/json"))},
		{"rest-json-py", rest(rawRequest(tb, s.http, infer, wakeJSON(vs, true), "Content-Type", "application/json"))},
		{"rest-binary", rest(rawRequest(tb, s.http, infer, bin, "Content-Type", "application/octet-stream",
			"Inference-Header-Content-Length", strconv.Itoa(headerLen)))},
		{"grpc", func() (func() (int, error), func()) {
			return func() (int, error) {
				switch o, detail := grpcClient.Infer(context.Background()); o {
				case loadtest.Good:
					return http.StatusOK, nil
				case loadtest.Rejected:
					return http.StatusTooManyRequests, nil
				case loadtest.Dropped:
					return http.StatusGatewayTimeout, nil
				default:
					return 0, fmt.Errorf("grpc: %v %s", o, detail)
				}
			}, func() {}
		}},
		{"grpc-live", func() (func() (int, error), func()) {
			return func() (int, error) {
				_, err := s.grpc.ServerLive(context.Background(), &inference.ServerLiveRequest{})
				return http.StatusOK, err
			}, func() {}
		}},
	}
}

// tinyLoop runs clients closed-loop callers of p for window: requests
// answered 200, refused (429), dropped at their deadline (504), and the
// first other failure.
func tinyLoop(p tinyPath, clients int, window time.Duration) (ok, refused, dropped int64, err error) {
	var nOK, nRefused, nDropped atomic.Int64
	var errOnce sync.Once
	var wg sync.WaitGroup
	deadline := time.Now().Add(window)
	for range clients {
		call, done := p.caller()
		wg.Go(func() {
			defer done()
			for time.Now().Before(deadline) {
				code, e := call()
				switch {
				case e == nil && code == http.StatusOK:
					nOK.Add(1)
				case e == nil && code == http.StatusTooManyRequests:
					nRefused.Add(1)
				case e == nil && code == http.StatusGatewayTimeout:
					nDropped.Add(1)
				default:
					if e == nil {
						e = fmt.Errorf("%s: status %d", p.name, code)
					}
					errOnce.Do(func() { err = e })
				}
			}
		})
	}
	wg.Wait()
	return nOK.Load(), nRefused.Load(), nDropped.Load(), err
}

// serverCPU is the CPU seconds the server and its runners have used.
func serverCPU(s *testServer) (server, runners float64) {
	server = cpuSeconds(s.cmd.Process.Pid)
	for _, pid := range s.children() {
		runners += cpuSeconds(pid)
	}
	return server, runners
}

// envInt reads a positive integer benchmark parameter.
func envInt(tb testing.TB, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		tb.Fatalf("%s=%q: want an integer >= 1", name, v)
	}
	return n
}

func BenchmarkRESTTiny(b *testing.B) {
	s := startServer(b, wakeRepo(b), "", benchProfiling()...)
	paths := tinyPaths(b, s)
	rounds := envInt(b, "SLOSERVE_REST_BENCH_ROUNDS", 3)
	window := envDuration(b, "SLOSERVE_REST_BENCH_WINDOW", 3*time.Second)
	single := envInt(b, "SLOSERVE_REST_BENCH_CALLS", 2000) // calls per path per round at one client
	const clients = 16

	type result struct {
		p50, p99, rate, refused, dropped, serverUS, runnerUS []float64
		single429                                            float64 // 429s and 504s at one client, all rounds
	}
	res := make([]result, len(paths))
	for b.Loop() {
		// Warm every path.
		for _, p := range paths {
			if _, _, _, err := tinyLoop(p, clients, window/4); err != nil {
				b.Fatal(err)
			}
		}
		for range rounds {
			calls := make([]func() (int, error), len(paths))
			for i, p := range paths {
				call, done := p.caller()
				defer done()
				calls[i] = call
			}
			ds := make([][]time.Duration, len(paths))
			for range single {
				for i, call := range calls {
					t0 := time.Now()
					code, err := call()
					d := time.Since(t0)
					switch {
					case err == nil && code == http.StatusOK:
						ds[i] = append(ds[i], d)
					case err == nil && (code == http.StatusTooManyRequests || code == http.StatusGatewayTimeout):
						res[i].single429 += 1 // counted, not timed
					default:
						b.Fatalf("%s: status %d, %v", paths[i].name, code, err)
					}
				}
			}
			for i, p := range paths {
				r := &res[i]
				r.p50 = append(r.p50, us(percentile(ds[i], 0.5)))
				r.p99 = append(r.p99, us(percentile(ds[i], 0.99)))
				srv0, run0 := serverCPU(s)
				ok, refused, dropped, err := tinyLoop(p, clients, window)
				srv1, run1 := serverCPU(s)
				if err != nil {
					b.Fatalf("%s at %d clients: %v", p.name, clients, err)
				}
				r.rate = append(r.rate, float64(ok)/window.Seconds())
				r.refused = append(r.refused, float64(refused))
				r.dropped = append(r.dropped, float64(dropped))
				if n := float64(ok + refused + dropped); n > 0 {
					r.serverUS = append(r.serverUS, (srv1-srv0)/n*1e6)
					r.runnerUS = append(r.runnerUS, (run1-run0)/n*1e6)
				}
			}
		}
	}
	b.StopTimer()
	median := func(xs []float64) float64 {
		if len(xs) == 0 {
			return math.NaN()
		}
		s := slices.Clone(xs)
		slices.Sort(s)
		return s[len(s)/2]
	}
	var sb strings.Builder
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "path\tp50 µs\tp99 µs\t1-client 429+504\t16-client /s\t429s\t504s\tserver CPU µs/req\trunner CPU µs/req\t\n")
	for i, p := range paths {
		r := res[i]
		b.ReportMetric(median(r.p50), p.name+"-p50-µs")
		b.ReportMetric(median(r.p99), p.name+"-p99-µs")
		b.ReportMetric(median(r.rate), p.name+"-16c-req/s")
		b.ReportMetric(median(r.refused), p.name+"-16c-429s")
		b.ReportMetric(median(r.dropped), p.name+"-16c-504s")
		b.ReportMetric(median(r.serverUS), p.name+"-server-cpu-µs/req")
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t\n", p.name, median(r.p50), median(r.p99), r.single429,
			median(r.rate), median(r.refused), median(r.dropped), median(r.serverUS), median(r.runnerUS))
	}
	tw.Flush()
	// The ratios the aims are stated in, against the floors
	// measured beside them.
	at := func(name string) result {
		return res[slices.IndexFunc(paths, func(p tinyPath) bool { return p.name == name })]
	}
	json, ready, grpcInfer := at("rest-json"), at("rest-ready"), at("grpc")
	b.ReportMetric(median(json.p50)-median(ready.p50), "rest-json-added-p50-µs")
	b.ReportMetric(median(json.p50)/median(grpcInfer.p50), "rest-json/grpc-p50")
	b.ReportMetric(median(json.rate)/median(grpcInfer.rate), "rest-json/grpc-16c-rate")
	b.Logf("medians of %d rounds, %d clients for %v each:\n%s", rounds, clients, window, sb.String())
}
