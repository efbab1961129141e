package e2e

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
)

// shmSeq tells apart the shared-memory objects of repeated runs (-count).
var shmSeq atomic.Int64

// e2eShmObject creates a POSIX shared-memory object of size bytes, as a
// client would with shm_open and ftruncate, and returns its key.
func e2eShmObject(t *testing.T, size int) (key string, f *os.File) {
	t.Helper()
	name := fmt.Sprintf("sloserve-e2e-%d-%d", os.Getpid(), shmSeq.Add(1))
	f, err := os.OpenFile("/dev/shm/"+name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Skipf("no POSIX shared memory here: %v", err)
	}
	t.Cleanup(func() { f.Close(); os.Remove("/dev/shm/" + name) })
	if err := f.Truncate(int64(size)); err != nil {
		t.Fatal(err)
	}
	return "/" + name, f
}

func shmInt64(region string, offset, size int64) map[string]*inference.InferParameter {
	return map[string]*inference.InferParameter{
		"shared_memory_region":    {ParameterChoice: &inference.InferParameter_StringParam{StringParam: region}},
		"shared_memory_offset":    {ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: offset}},
		"shared_memory_byte_size": {ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: size}},
	}
}

// TestE2ESharedMemory registers a client's shared memory over REST and gRPC,
// runs the PP-OCR direction classifier with its input read from the region
// and its output written into it, and checks the numbers against the same
// request with the tensors in the messages.
func TestE2ESharedMemory(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"cls", demoModel(t, "ocr-cls"), `max_batch_size: 8
inputs: [{name: x, datatype: FP32, shape: [-1, 3, 48, 192]}]
`})
	s := startServer(t, repo, "")
	ctx := t.Context()

	const inBytes = 3 * 48 * 192 * 4
	const outOffset = 128 << 10 // the output region starts past the input's
	key, f := e2eShmObject(t, outOffset+4096)
	rng := rand.New(rand.NewPCG(uint64(shmSeq.Load()), 17))
	_, x := randomRows(rng, 1, 3*48*192)
	if _, err := f.WriteAt(f32bytes(x), 0); err != nil {
		t.Fatal(err)
	}

	// The reference: the tensors in the message.
	ref, err := s.grpc.ModelInfer(ctx, &inference.ModelInferRequest{
		ModelName:        "cls",
		Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1, 3, 48, 192}}},
		RawInputContents: [][]byte{f32bytes(x)},
	})
	if err != nil {
		t.Fatal(err)
	}
	want := bytesF32(ref.GetRawOutputContents()[0])
	if len(want) != 2 {
		t.Fatalf("reference output has %d values", len(want))
	}
	readOut := func(off int64) []float64 {
		b := make([]byte, 8)
		if _, err := f.ReadAt(b, outOffset+off); err != nil {
			t.Fatal(err)
		}
		return bytesF32(b)
	}
	clearOut := func() {
		if _, err := f.WriteAt(make([]byte, 4096), outOffset); err != nil {
			t.Fatal(err)
		}
	}

	// Server metadata advertises the extension (and not the CUDA one).
	var md struct {
		Extensions []string `json:"extensions"`
	}
	if code := s.json(t, "GET", "/v2", nil, &md); code != 200 || !strings.Contains(strings.Join(md.Extensions, ","), "system_shared_memory") ||
		strings.Contains(strings.Join(md.Extensions, ","), "cuda") {
		t.Fatalf("server metadata: %d %v", code, md.Extensions)
	}

	t.Run("REST", func(t *testing.T) {
		for _, r := range []struct {
			name         string
			offset, size int
		}{{"in", 0, inBytes}, {"out", outOffset, 4096}} {
			code, body, _ := s.do(t, "POST", "/v2/systemsharedmemory/region/"+r.name+"/register",
				fmt.Appendf(nil, `{"key":%q,"offset":%d,"byte_size":%d}`, key, r.offset, r.size))
			if code != 200 {
				t.Fatalf("register %s: %d %s", r.name, code, body)
			}
		}
		var regions []map[string]any
		if code := s.json(t, "GET", "/v2/systemsharedmemory/status", nil, &regions); code != 200 || len(regions) != 2 {
			t.Fatalf("status: %d %v", code, regions)
		}
		clearOut()
		req := jsonInferRequest{
			Inputs: []jsonTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1, 3, 48, 192},
				Parameters: map[string]any{"shared_memory_region": "in", "shared_memory_byte_size": inBytes}}},
			Outputs: []jsonTensor{{Name: "softmax_0.tmp_0",
				Parameters: map[string]any{"shared_memory_region": "out", "shared_memory_offset": 16, "shared_memory_byte_size": 64}}},
		}
		var resp jsonInferResponse
		if code := s.json(t, "POST", "/v2/models/cls/infer", req, &resp); code != 200 {
			t.Fatalf("infer: %d %s", code, resp.Error)
		}
		if len(resp.Outputs) != 1 || resp.Outputs[0].Data != nil || resp.Outputs[0].Parameters["shared_memory_byte_size"] != float64(8) {
			t.Fatalf("the response should name the region and carry no data: %+v", resp.Outputs)
		}
		closeTo(t, "softmax from shared memory", readOut(16), want, 1e-6)

		// An unknown region and a size beyond the region are refused.
		req.Inputs[0].Parameters["shared_memory_region"] = "nope"
		code, body, _ := s.do(t, "POST", "/v2/models/cls/infer", shmJSON(t, req))
		if code != 400 || !strings.Contains(string(body), `no region named \"nope\"`) {
			t.Fatalf("unknown region: %d %s", code, body)
		}
		req.Inputs[0].Parameters["shared_memory_region"] = "in"
		req.Inputs[0].Parameters["shared_memory_offset"] = 4
		code, body, _ = s.do(t, "POST", "/v2/models/cls/infer", shmJSON(t, req))
		if code != 400 || !strings.Contains(string(body), "beyond region") {
			t.Fatalf("beyond the region: %d %s", code, body)
		}
		code, body, _ = s.do(t, "POST", "/v2/cudasharedmemory/region/g/register", []byte(`{"raw_handle":{"b64":"AA=="},"device_id":0,"byte_size":8}`))
		if code != 400 || !strings.Contains(string(body), "CUDA shared memory is not supported") {
			t.Fatalf("CUDA register: %d %s", code, body)
		}
		if code, body, _ := s.do(t, "POST", "/v2/systemsharedmemory/unregister", nil); code != 200 {
			t.Fatalf("unregister: %d %s", code, body)
		}
	})

	t.Run("gRPC", func(t *testing.T) {
		for _, r := range []*inference.SystemSharedMemoryRegisterRequest{
			{Name: "gin", Key: key, Offset: 0, ByteSize: inBytes},
			{Name: "gout", Key: key, Offset: outOffset, ByteSize: 4096},
		} {
			if _, err := s.grpc.SystemSharedMemoryRegister(ctx, r); err != nil {
				t.Fatalf("register %s: %v", r.Name, err)
			}
		}
		st, err := s.grpc.SystemSharedMemoryStatus(ctx, &inference.SystemSharedMemoryStatusRequest{})
		if err != nil || len(st.GetRegions()) != 2 || st.GetRegions()["gout"].GetOffset() != outOffset {
			t.Fatalf("status: %v %v", st, err)
		}
		clearOut()
		resp, err := s.grpc.ModelInfer(ctx, &inference.ModelInferRequest{
			ModelName: "cls",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1, 3, 48, 192},
				Parameters: shmInt64("gin", 0, inBytes)}},
			Outputs: []*inference.ModelInferRequest_InferRequestedOutputTensor{{Name: "softmax_0.tmp_0", Parameters: shmInt64("gout", 32, 8)}},
		})
		if err != nil {
			t.Fatal(err)
		}
		if raw := resp.GetRawOutputContents(); len(raw) != 1 || len(raw[0]) != 0 {
			t.Fatalf("the response should carry no data: %d entries", len(raw))
		}
		closeTo(t, "softmax from shared memory", readOut(32), want, 1e-6)

		_, err = s.grpc.ModelInfer(ctx, &inference.ModelInferRequest{
			ModelName: "cls",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1, 3, 48, 192},
				Parameters: shmInt64("gin", 0, inBytes)}},
			Outputs: []*inference.ModelInferRequest_InferRequestedOutputTensor{{Name: "softmax_0.tmp_0", Parameters: shmInt64("gout", 0, 4)}},
		})
		if st, _ := status.FromError(err); st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), `region "gout" gives 4`) {
			t.Fatalf("output region too small: %v", err)
		}
		_, err = s.grpc.CudaSharedMemoryRegister(ctx, &inference.CudaSharedMemoryRegisterRequest{Name: "g", RawHandle: []byte{0}, ByteSize: 8})
		if st, _ := status.FromError(err); st.Code() != codes.InvalidArgument {
			t.Fatalf("CUDA register: %v", err)
		}
		if _, err := s.grpc.SystemSharedMemoryUnregister(ctx, &inference.SystemSharedMemoryUnregisterRequest{}); err != nil {
			t.Fatal(err)
		}
		st, err = s.grpc.SystemSharedMemoryStatus(ctx, &inference.SystemSharedMemoryStatusRequest{})
		if err != nil || len(st.GetRegions()) != 0 {
			t.Fatalf("status after unregistering: %v %v", st, err)
		}
	})
}

func shmJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestE2ESharedMemoryTruncatedWhileQueued: a client truncates its
// shared-memory object while a request that reads its input from it waits
// in the queue, after the request's checks. When the request runs, the
// server's copy of the input (into the runner's arena; for an in-process
// model, into the server's own memory before ONNX Runtime sees it) faults:
// that request fails with INVALID_ARGUMENT, and the server keeps serving,
// the same model included, with the right numbers. Before the guard the
// server died of SIGBUS.
func TestE2ESharedMemoryTruncatedWhileQueued(t *testing.T) {
	repo := t.TempDir()
	const cfg = "max_batch_size: 1\nslo: {latency_ms: 60000, class: latency-critical}\nexecution: {intra_op_threads: 2%s}\n"
	writeRepo(t, repo,
		repoModel{"det", demoModel(t, "ocr-det"), fmt.Sprintf(cfg, "")},
		repoModel{"detin", demoModel(t, "ocr-det"), fmt.Sprintf(cfg, ", isolation: in-process")},
	)
	s := startServer(t, repo, "")
	ctx := t.Context()

	const side = 32
	img := make([]float32, 3*side*side)
	for i := range img {
		img[i] = float32(i%97) / 97
	}
	in := f32bytes(img)
	shape := []int64{1, 3, side, side}
	plain := func(model string) []float64 {
		resp, err := s.grpc.ModelInfer(ctx, &inference.ModelInferRequest{
			ModelName:        model,
			Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: shape}},
			RawInputContents: [][]byte{in},
		})
		if err != nil {
			t.Fatalf("%s: plain request: %v", model, err)
		}
		return bytesF32(resp.GetRawOutputContents()[0])
	}
	viaShm := func(model, region string) ([]float64, error) {
		resp, err := s.grpc.ModelInfer(ctx, &inference.ModelInferRequest{
			ModelName: model,
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: shape,
				Parameters: shmInt64(region, 0, int64(len(in)))}},
		})
		if err != nil {
			return nil, err
		}
		return bytesF32(resp.GetRawOutputContents()[0]), nil
	}

	for _, model := range []string{"det", "detin"} {
		t.Run(model, func(t *testing.T) {
			want := plain(model)
			key, f := e2eShmObject(t, len(in))
			if _, err := f.WriteAt(in, 0); err != nil {
				t.Fatal(err)
			}
			region := "in-" + model
			if _, err := s.grpc.SystemSharedMemoryRegister(ctx, &inference.SystemSharedMemoryRegisterRequest{Name: region, Key: key, ByteSize: uint64(len(in))}); err != nil {
				t.Fatal(err)
			}
			got, err := viaShm(model, region)
			if err != nil {
				t.Fatalf("intact region: %v", err)
			}
			closeTo(t, "the map from shared memory", got, want, 1e-5)

			// A large request holds the one instance; the shared-memory
			// request queues behind it, and the object is truncated
			// while it waits. The attempt counts only when the request is
			// still queued after the truncation; a faster machine gets a
			// larger blocker.
			for attempt, size := range []int{1600, 2400, 3200} {
				big, bigLen := detRequest(t, size, nil)
				var wg sync.WaitGroup
				var bigCode int
				wg.Go(func() {
					bigCode, _, _ = s.do(t, "POST", "/v2/models/"+model+"/infer", big, "Inference-Header-Content-Length", bigLen)
				})
				waitFor(t, "the big request to run", 30*time.Second, func() bool {
					v, _ := s.modelMetric(t, "sloserve_qos_inflight_requests", model+"/1")
					return v >= 1
				})
				var shmErr error
				wg.Go(func() { _, shmErr = viaShm(model, region) })
				waitFor(t, "the shared-memory request to queue", 30*time.Second, func() bool {
					v, _ := s.modelMetric(t, "sloserve_qos_queue_depth", model+"/1")
					return v >= 1
				})
				if err := f.Truncate(0); err != nil {
					t.Fatal(err)
				}
				queued, _ := s.modelMetric(t, "sloserve_qos_queue_depth", model+"/1")
				wg.Wait()
				if bigCode != 200 {
					t.Fatalf("the big request failed: %d", bigCode)
				}
				// Whatever the timing, the object is back for what follows.
				if err := f.Truncate(int64(len(in))); err != nil {
					t.Fatal(err)
				}
				if _, err := f.WriteAt(in, 0); err != nil {
					t.Fatal(err)
				}
				if queued < 1 {
					t.Logf("attempt %d: the request ran before the truncation (%v); trying a larger blocker", attempt, shmErr)
					continue
				}
				st, _ := status.FromError(shmErr)
				if st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "truncated under its mapping") {
					t.Fatalf("request whose object was truncated while queued: %v; want INVALID_ARGUMENT saying it was truncated", shmErr)
				}
				t.Logf("attempt %d (blocker %dx%d): %v", attempt, size, size, shmErr)
				// The server and the model serve on, from the same region.
				got, err := viaShm(model, region)
				if err != nil {
					t.Fatalf("after the fault: %v", err)
				}
				closeTo(t, "the map from shared memory after the fault", got, want, 1e-5)
				closeTo(t, "a plain request after the fault", plain(model), want, 1e-5)
				return
			}
			t.Fatal("the shared-memory request never waited in the queue behind a blocker of 3200x3200")
		})
	}
}

// asNobody runs curl as uid/gid 65534 (nobody) with args and returns the
// HTTP status and body it got.
func asNobody(t *testing.T, args ...string) (int, string) {
	t.Helper()
	curl, err := exec.LookPath("curl")
	if err != nil {
		t.Skip("no curl to act as another user")
	}
	cmd := exec.Command(curl, append([]string{"-s", "-w", "\n%{http_code}"}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("curl as nobody: %v %s", err, out)
	}
	body, code := "", string(out)
	if i := strings.LastIndexByte(string(out), '\n'); i >= 0 {
		body, code = string(out[:i]), string(out[i+1:])
	}
	n, err := strconv.Atoi(strings.TrimSpace(code))
	if err != nil {
		t.Fatalf("curl as nobody: status %q", code)
	}
	return n, body
}

// TestE2ESharedMemoryOwnership: the server runs as root, a client runs as
// nobody. The client may not make the server map root's private object
// (mode 0600), nor write outputs into root's world-readable one; it may use
// objects whose permissions let it in. The server learns the client's uid
// from the kernel's table of its loopback connection. Before, the server
// mapped and overwrote whatever its own (root) permissions allowed.
func TestE2ESharedMemoryOwnership(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the server runs as root and the client as nobody")
	}
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
	s := startServer(t, repo, "")
	ctx := t.Context()
	rng := rand.New(rand.NewPCG(uint64(shmSeq.Load()), 29))
	rows, x := randomRows(rng, 2, 10)
	in := f32bytes(x)
	object := func(mode os.FileMode) (string, *os.File) {
		key, f := e2eShmObject(t, 4096)
		if _, err := f.WriteAt(in, 0); err != nil {
			t.Fatal(err)
		}
		if err := f.Chmod(mode); err != nil {
			t.Fatal(err)
		}
		return key, f
	}
	register := func(name, key string, offset, size int) []string {
		return []string{"-H", "Content-Type: application/json",
			"-d", fmt.Sprintf(`{"key":%q,"offset":%d,"byte_size":%d}`, key, offset, size),
			s.http + "/v2/systemsharedmemory/region/" + name + "/register"}
	}
	infer := func(inRegion, outRegion string) (*inference.ModelInferResponse, error) {
		return s.grpc.ModelInfer(ctx, &inference.ModelInferRequest{
			ModelName: "dyn",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{2, 10},
				Parameters: shmInt64(inRegion, 0, int64(len(in)))}},
			Outputs: []*inference.ModelInferRequest_InferRequestedOutputTensor{{Name: "output_scalars", Parameters: shmInt64(outRegion, 2048, 8)}},
		})
	}
	sums := func(f *os.File) []float64 {
		b := make([]byte, 8)
		if _, err := f.ReadAt(b, 2048); err != nil {
			t.Fatal(err)
		}
		return bytesF32(b)
	}
	var want []float64
	for _, r := range rows {
		var sum float64
		for _, v := range r {
			sum += float64(v)
		}
		want = append(want, sum)
	}

	// Root's private object: refused to nobody, 403 naming the uid.
	private, pf := object(0o600)
	code, body := asNobody(t, register("private", private, 0, 4096)...)
	if code != 403 || !strings.Contains(body, "uid 65534") || !strings.Contains(body, "may not read it") {
		t.Fatalf("nobody registering root's 0600 object: %d %s; want 403", code, body)
	}

	// Root's world-readable object: nobody may read it, so it takes
	// inputs; an output into it is refused and the object is unchanged.
	readable, rf := object(0o644)
	if code, body := asNobody(t, register("readable", readable, 0, 4096)...); code != 200 {
		t.Fatalf("nobody registering root's 0644 object: %d %s", code, body)
	}
	_, err := infer("readable", "readable")
	if st, _ := status.FromError(err); st.Code() != codes.PermissionDenied || !strings.Contains(st.Message(), "read-only") {
		t.Fatalf("output into root's 0644 object registered by nobody: %v; want PERMISSION_DENIED", err)
	}
	if got := sums(rf); got[0] != 0 || got[1] != 0 {
		t.Fatalf("root's 0644 object was written: %v", got)
	}

	// A world-writable object: nobody's region takes inputs and outputs,
	// with the right numbers.
	shared, sf := object(0o666)
	if code, body := asNobody(t, register("shared", shared, 0, 4096)...); code != 200 {
		t.Fatalf("nobody registering a 0666 object: %d %s", code, body)
	}
	if _, err := infer("readable", "shared"); err != nil {
		t.Fatal(err)
	}
	closeTo(t, "row sums written into nobody's region", sums(sf), want, 1e-5)

	// Root, the object's owner, may register its private object.
	if _, err := s.grpc.SystemSharedMemoryRegister(ctx, &inference.SystemSharedMemoryRegisterRequest{Name: "private", Key: private, ByteSize: 4096}); err != nil {
		t.Fatalf("root registering its own 0600 object: %v", err)
	}
	if _, err := infer("private", "private"); err != nil {
		t.Fatal(err)
	}
	closeTo(t, "row sums written into root's own region", sums(pf), want, 1e-5)
}
