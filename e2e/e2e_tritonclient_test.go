package e2e

import (
	"bytes"
	"compress/gzip"
	"compress/zlib"
	"encoding/binary"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	grpccodes "google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
)

// Requests as Triton's Python client library builds them
// (triton-inference-server/client, src/python/library/tritonclient):
// tritonclient.http posts through geventhttpclient with no Content-Type
// (http/_client.py _post), tritonclient.http.aio through aiohttp, which
// types the bytes it posts itself (http/aio/__init__.py _post); neither
// sends Origin or Sec-Fetch-* headers.

// tritonClients are the two HTTP clients' header sets: name, then the
// header pairs each adds to a POST.
var tritonClients = []struct {
	name   string
	header []string
}{
	{"tritonclient.http", []string{"User-Agent", "python/gevent-http-client-2.0"}},
	{"tritonclient.http.aio", []string{"User-Agent", "Python/3.12 aiohttp/3.9.5", "Content-Type", "application/octet-stream"}},
}

// tritonPost posts body with exactly the headers given (no Content-Type
// unless one is given) and returns the status and body.
func tritonPost(t *testing.T, s *testServer, path string, body []byte, header ...string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), "POST", s.http+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := s.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b
}

// TestE2ETritonClientAdmin replays the admin calls of tritonclient's
// example scripts as the library sends them: the clean-up every
// shared-memory example starts with (unregister all system and all CUDA
// regions, REST and gRPC), a system region's registration, and model
// unload and load, over both HTTP clients' headers.
func TestE2ETritonClientAdmin(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
	s := startServer(t, repo, "model_control: explicit\nstartup_models: [\"*\"]\n")
	ctx := t.Context()
	key, obj := e2eShmObject(t, 4096)
	in := make([]byte, 40)
	for i := range 10 {
		binary.LittleEndian.PutUint32(in[4*i:], math.Float32bits(float32(i+1)))
	}
	if _, err := obj.WriteAt(in, 0); err != nil {
		t.Fatal(err)
	}

	for _, c := range tritonClients {
		t.Run(c.name, func(t *testing.T) {
			// simple_http_shm_client.py and simple_http_cudashm_client.py
			// begin with these; unregister posts an empty body.
			for _, p := range []string{"/v2/systemsharedmemory/unregister", "/v2/cudasharedmemory/unregister", "/v2/cudasharedmemory/region/any/unregister"} {
				if code, b := tritonPost(t, s, p, []byte{}, c.header...); code != 200 {
					t.Fatalf("%s: %d %s", p, code, b)
				}
			}
			req, _ := http.NewRequestWithContext(ctx, "GET", s.http+"/v2/cudasharedmemory/status", nil)
			resp, err := s.client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || string(b) != "[]" {
				t.Fatalf("CUDA status: %d %s, want 200 []", resp.StatusCode, b)
			}
			// register_system_shared_memory: json.dumps of key, offset, byte_size.
			reg := []byte(`{"key": "` + key + `", "offset": 0, "byte_size": 64}`)
			if code, b := tritonPost(t, s, "/v2/systemsharedmemory/region/input_data/register", reg, c.header...); code != 200 {
				t.Fatalf("register: %d %s", code, b)
			}
			reg = []byte(`{"key": "` + key + `", "offset": 64, "byte_size": 64}`)
			if code, b := tritonPost(t, s, "/v2/systemsharedmemory/region/output_data/register", reg, c.header...); code != 200 {
				t.Fatalf("register: %d %s", code, b)
			}
			// simple_http_shm_client.py's request: the output in shared
			// memory with binary_data false (http/_requested_output.py).
			if _, err := obj.WriteAt(make([]byte, 4), 64); err != nil {
				t.Fatal(err)
			}
			infer := []byte(`{"inputs": [{"name": "input_vectors", "shape": [1, 10], "datatype": "FP32", "parameters": ` +
				`{"shared_memory_region": "input_data", "shared_memory_byte_size": 40}}], "outputs": [{"name": "output_scalars", ` +
				`"parameters": {"binary_data": false, "shared_memory_region": "output_data", "shared_memory_byte_size": 64}}]}`)
			if code, b := tritonPost(t, s, "/v2/models/dyn/infer", infer, c.header...); code != 200 ||
				!strings.Contains(string(b), `"shared_memory_region":"output_data"`) {
				t.Fatalf("infer in shared memory: %d %s", code, b)
			}
			out := make([]byte, 4)
			if _, err := obj.ReadAt(out, 64); err != nil {
				t.Fatal(err)
			}
			if got := math.Float32frombits(binary.LittleEndian.Uint32(out)); got != 55 {
				t.Fatalf("the output region holds %v, want 55", got)
			}
			for _, r := range []string{"input_data", "output_data"} {
				if code, b := tritonPost(t, s, "/v2/systemsharedmemory/region/"+r+"/unregister", []byte{}, c.header...); code != 200 {
					t.Fatalf("unregister: %d %s", code, b)
				}
			}
			// unload_model, then load_model (json.dumps of {} without a config).
			if code, b := tritonPost(t, s, "/v2/repository/models/dyn/unload", []byte(`{"parameters": {"unload_dependents": false}}`), c.header...); code != 200 {
				t.Fatalf("unload: %d %s", code, b)
			}
			if code, b := tritonPost(t, s, "/v2/repository/models/dyn/load", []byte(`{}`), c.header...); code != 200 {
				t.Fatalf("load: %d %s", code, b)
			}
			if code, b, _ := s.do(t, "GET", "/v2/models/dyn/ready", nil); code != 200 {
				t.Fatalf("dyn not ready after the load: %d %s", code, b)
			}
		})
	}

	t.Run("tritonclient.grpc", func(t *testing.T) {
		if _, err := s.grpc.SystemSharedMemoryUnregister(ctx, &inference.SystemSharedMemoryUnregisterRequest{}); err != nil {
			t.Fatal(err)
		}
		for _, name := range []string{"", "any"} {
			if _, err := s.grpc.CudaSharedMemoryUnregister(ctx, &inference.CudaSharedMemoryUnregisterRequest{Name: name}); err != nil {
				t.Fatalf("CUDA unregister %q: %v", name, err)
			}
		}
		st, err := s.grpc.CudaSharedMemoryStatus(ctx, &inference.CudaSharedMemoryStatusRequest{})
		if err != nil || len(st.GetRegions()) != 0 {
			t.Fatalf("CUDA status: %v %v", st, err)
		}
		_, err = s.grpc.CudaSharedMemoryRegister(ctx, &inference.CudaSharedMemoryRegisterRequest{Name: "g", RawHandle: []byte{0}, ByteSize: 8})
		if err == nil || !strings.Contains(err.Error(), "CUDA shared memory is not supported") {
			t.Fatalf("CUDA register: %v", err)
		}
	})
}

// TestE2ETritonClientLoadConfig loads a model with a config override as
// tritonclient's load_model(config=...) sends it (REST: a JSON string in
// parameters.config; gRPC: a string_param), checks that it serves with it,
// that a bad one fails and leaves the serving config, and that a load
// without one goes back to the folder's config.
func TestE2ETritonClientLoadConfig(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
	s := startServer(t, repo, "model_control: explicit\nstartup_models: [\"*\"]\n")
	maxBatch := func() float64 {
		var cfg struct {
			MaxBatchSize float64 `json:"max_batch_size"`
		}
		if code := s.json(t, "GET", "/v2/models/dyn/config", nil, &cfg); code != 200 {
			t.Fatalf("config: %d", code)
		}
		return cfg.MaxBatchSize
	}
	override := `{"name": "dyn", "backend": "onnxruntime", "max_batch_size": 2}`
	body, _ := json.Marshal(map[string]any{"parameters": map[string]any{"config": override}})
	if code, b := tritonPost(t, s, "/v2/repository/models/dyn/load", body, tritonClients[0].header...); code != 200 {
		t.Fatalf("load with a config: %d %s", code, b)
	}
	if got := maxBatch(); got != 2 {
		t.Fatalf("max_batch_size %v after the override, want 2", got)
	}
	var resp jsonInferResponse
	if code := s.json(t, "POST", "/v2/models/dyn/infer", json.RawMessage(dynBody), &resp); code != 200 || len(resp.Outputs) != 1 {
		t.Fatalf("infer: %d %+v", code, resp)
	}
	closeTo(t, "row sum", resp.Outputs[0].Data, []float64{55}, 1e-6)

	bad, _ := json.Marshal(map[string]any{"parameters": map[string]any{"config": `{"max_batch_size": -3}`}})
	// Triton's words first ("failed to load 'dyn'"), then sloserve's.
	if code, b := tritonPost(t, s, "/v2/repository/models/dyn/load", bad, tritonClients[0].header...); code != 400 ||
		!strings.HasPrefix(string(b), `{"error":"failed to load 'dyn': `) || !strings.Contains(string(b), "max_batch_size") {
		t.Fatalf("load with a bad config: %d %s", code, b)
	}
	if got := maxBatch(); got != 2 {
		t.Fatalf("max_batch_size %v after a failed override, want 2 still", got)
	}

	_, err := s.grpc.RepositoryModelLoad(t.Context(), &inference.RepositoryModelLoadRequest{ModelName: "dyn",
		Parameters: map[string]*inference.ModelRepositoryParameter{"config": {ParameterChoice: &inference.ModelRepositoryParameter_StringParam{
			StringParam: `{"name": "dyn", "max_batch_size": 4}`}}}})
	if err != nil {
		t.Fatal(err)
	}
	if got := maxBatch(); got != 4 {
		t.Fatalf("max_batch_size %v after the gRPC override, want 4", got)
	}
	if code, b := tritonPost(t, s, "/v2/repository/models/dyn/load", []byte(`{}`), tritonClients[0].header...); code != 200 {
		t.Fatalf("load: %d %s", code, b)
	}
	if got := maxBatch(); got != 8 {
		t.Fatalf("max_batch_size %v after a load without a config, want the folder's 8", got)
	}
}

// TestE2ETritonClientCompression sends requests compressed as tritonclient
// does (REST: gzip.compress or zlib.compress of the whole body with
// Content-Encoding and the uncompressed JSON's
// Inference-Header-Content-Length, http/_client.py infer; gRPC: the
// channel's gzip or deflate message compression), checks the numbers, and
// sends zip bombs that the server refuses at max_request_bytes and
// survives.
func TestE2ETritonClientCompression(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
	// The gRPC zip bomb is compressed by grpc-go's client after it has
	// sent the call's headers: 256 MiB through gzip in a -race test binary
	// beside two CPU burners took over a minute, and the server rightly
	// closed the connection at limits.body_timeout (1m) before the message
	// came. The bomb's refusal is what this test checks, not the timeout.
	s := startServer(t, repo, "", withSet("limits.max_request_bytes=1MiB", "limits.body_timeout=10m"))
	header := `{"inputs":[{"name":"input_vectors","shape":[1,10],"datatype":"FP32","parameters":{"binary_data_size":40}}],` +
		`"outputs":[{"name":"output_scalars","parameters":{"binary_data":false}}]}`
	body := []byte(header)
	for i := range 10 {
		body = binary.LittleEndian.AppendUint32(body, math.Float32bits(float32(i+1)))
	}
	compress := map[string]func([]byte) []byte{
		"gzip": func(b []byte) []byte {
			var buf bytes.Buffer
			w := gzip.NewWriter(&buf)
			w.Write(b)
			w.Close()
			return buf.Bytes()
		},
		"deflate": func(b []byte) []byte {
			var buf bytes.Buffer
			w := zlib.NewWriter(&buf)
			w.Write(b)
			w.Close()
			return buf.Bytes()
		},
	}
	for enc, z := range compress {
		code, b := tritonPost(t, s, "/v2/models/dyn/infer", z(body), "User-Agent", "python/gevent-http-client-2.0",
			"Content-Encoding", enc, "Inference-Header-Content-Length", strconv.Itoa(len(header)))
		var resp jsonInferResponse
		if code != 200 || json.Unmarshal(b, &resp) != nil || len(resp.Outputs) != 1 {
			t.Fatalf("%s: %d %s", enc, code, b)
		}
		closeTo(t, enc+" row sum", resp.Outputs[0].Data, []float64{55}, 1e-6)

		r, err := s.grpc.ModelInfer(t.Context(), grpcDynRequest(), grpc.UseCompressor(enc))
		if err != nil || len(r.GetRawOutputContents()) != 1 {
			t.Fatalf("gRPC %s: %v %v", enc, r, err)
		}
		if got := math.Float32frombits(binary.LittleEndian.Uint32(r.GetRawOutputContents()[0])); got != 55 {
			t.Fatalf("gRPC %s: row sum %v, want 55", enc, got)
		}
	}

	// 256 MiB of zeros in 256 KiB: refused at 1 MiB, several at once.
	bomb := compress["gzip"](make([]byte, 256<<20))
	var wg sync.WaitGroup
	codes := make([]int, 8)
	for i := range codes {
		wg.Go(func() {
			codes[i], _ = tritonPost(t, s, "/v2/models/dyn/infer", bomb, "Content-Encoding", "gzip", "Inference-Header-Content-Length", "100")
		})
	}
	wg.Wait()
	for i, code := range codes {
		if code != 413 {
			t.Fatalf("zip bomb %d: %d, want 413", i, code)
		}
	}
	_, err := s.grpc.ModelInfer(t.Context(), &inference.ModelInferRequest{ModelName: "dyn", RawInputContents: [][]byte{make([]byte, 256<<20)}},
		grpc.UseCompressor("gzip"))
	if status.Code(err) != grpccodes.ResourceExhausted {
		t.Fatalf("gRPC zip bomb: %v, want RESOURCE_EXHAUSTED", err)
	}
	var resp jsonInferResponse
	if code := s.json(t, "POST", "/v2/models/dyn/infer", json.RawMessage(dynBody), &resp); code != 200 {
		t.Fatalf("inference after the bombs: %d", code)
	}
}

// TestE2ETritonClientErrorTexts: the errors that Triton's clients and
// scripts match begin with Triton's words, over REST and gRPC.
func TestE2ETritonClientErrorTexts(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
	s := startServer(t, repo, "")
	const unknown = "Request for unknown model: 'foo' is not found"
	for _, c := range []struct{ method, path string }{{"GET", "/v2/models/foo"}, {"POST", "/v2/models/foo/infer"}} {
		var body []byte
		if c.method == "POST" {
			body = dynBody
		}
		code, b, _ := s.do(t, c.method, c.path, body)
		var e struct{ Error string }
		if code != 404 || json.Unmarshal(b, &e) != nil || !strings.HasPrefix(e.Error, unknown) {
			t.Errorf("%s %s: %d %s, want 404 starting %q", c.method, c.path, code, b, unknown)
		}
	}
	if code, b, _ := s.do(t, "GET", "/v2/models/dyn/versions/7", nil); code != 404 || !strings.Contains(string(b), "Request for unknown model: 'dyn' version 7 is not found") {
		t.Errorf("unknown version: %d %s", code, b)
	}
	_, err := s.grpc.ModelMetadata(t.Context(), &inference.ModelMetadataRequest{Name: "foo"})
	if st, _ := status.FromError(err); st.Code() != grpccodes.NotFound || !strings.HasPrefix(st.Message(), unknown) {
		t.Errorf("gRPC metadata: %v", err)
	}
	req := grpcDynRequest()
	req.ModelName = "foo"
	_, err = s.grpc.ModelInfer(t.Context(), req)
	if st, _ := status.FromError(err); st.Code() != grpccodes.NotFound || !strings.HasPrefix(st.Message(), unknown) {
		t.Errorf("gRPC infer: %v", err)
	}
}

// TestE2ETritonClientLogging changes the real server's log level as
// tritonclient's update_log_settings does (POST /v2/logging with
// json.dumps(settings), no Content-Type) and reads it back: what is logged
// follows at once.
func TestE2ETritonClientLogging(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
	s := startServer(t, repo, "")
	settings := func() map[string]any {
		var st map[string]any
		if code := s.json(t, "GET", "/v2/logging", nil, &st); code != 200 {
			t.Fatalf("GET /v2/logging: %d", code)
		}
		return st
	}
	if st := settings(); st["log_verbose_level"] != 1.0 || st["log_info"] != true { // the harness starts it at debug
		t.Fatalf("settings %v", st)
	}
	post := func(body string) map[string]any {
		code, b := tritonPost(t, s, "/v2/logging", []byte(body), tritonClients[0].header...)
		var st map[string]any
		if code != 200 || json.Unmarshal(b, &st) != nil {
			t.Fatalf("POST %s: %d %s", body, code, b)
		}
		return st
	}
	if st := post(`{"log_verbose_level": 0, "log_info": false}`); st["log_info"] != false || st["log_warning"] != true {
		t.Fatalf("after turning info off: %v", st)
	}
	// At warn, neither the change nor the next admin call is logged.
	post(`{"log_warning": true}`)
	if st := post(`{"log_info": true}`); st["log_info"] != true || st["log_verbose_level"] != 0.0 {
		t.Fatalf("after turning info on: %v", st)
	}
	waitFor(t, "the change to info in the log", 30*time.Second, func() bool { return s.logHas(`msg="log settings changed"`, "log_level=INFO") })
	if s.logHas(`msg="log settings changed"`, "log_level=WARN") {
		t.Errorf("a change logged at info while the level was warn")
	}
	calls := strings.Count(s.log.String(), `msg="admin call" component=auth protocol=rest method="POST /v2/logging"`)
	if calls != 1 {
		t.Errorf("%d POST /v2/logging admin calls logged, want 1 (the first, at debug; the others came at warn)", calls)
	}
}
