package e2e

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	ort "github.com/yalue/onnxruntime_go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
)

// inferenceRepo is the repository most end-to-end tests serve: the small
// test networks of onnxruntime_go and the PP-OCR text detector.
func inferenceRepo(t *testing.T) string {
	repo := t.TempDir()
	writeRepo(t, repo,
		repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"},
		repoModel{"multi", testModel(t, "example_multitype.onnx"), "max_batch_size: 0\n"},
		repoModel{"fp16", testModel(t, "example_float16.onnx"), "max_batch_size: 0\n"},
		repoModel{"det", demoModel(t, "ocr-det"), `max_batch_size: 2
inputs: [{name: x, datatype: FP32, shape: [-1, 3, -1, -1]}]
execution: {intra_op_threads: 2}
`},
	)
	return repo
}

type jsonTensor struct {
	Name       string         `json:"name"`
	Datatype   string         `json:"datatype"`
	Shape      []int64        `json:"shape"`
	Data       any            `json:"data,omitempty"`
	Parameters map[string]any `json:"parameters,omitempty"`
}

type jsonInferRequest struct {
	ID         string         `json:"id,omitempty"`
	Inputs     []jsonTensor   `json:"inputs"`
	Outputs    []jsonTensor   `json:"outputs,omitempty"`
	Parameters map[string]any `json:"parameters,omitempty"`
}

type jsonOutput struct {
	Name       string         `json:"name"`
	Datatype   string         `json:"datatype"`
	Shape      []int64        `json:"shape"`
	Data       []float64      `json:"data"`
	Parameters map[string]any `json:"parameters"`
}

type jsonInferResponse struct {
	ModelName    string       `json:"model_name"`
	ModelVersion string       `json:"model_version"`
	ID           string       `json:"id"`
	Outputs      []jsonOutput `json:"outputs"`
	Error        string       `json:"error"`
}

func randomRows(rng *rand.Rand, rows, cols int) ([][]float32, []float32) {
	var flat []float32
	m := make([][]float32, rows)
	for r := range m {
		m[r] = make([]float32, cols)
		for c := range m[r] {
			m[r][c] = rng.Float32()*20 - 10
		}
		flat = append(flat, m[r]...)
	}
	return m, flat
}

func rowSums(m [][]float32) []float64 {
	out := make([]float64, len(m))
	for i, row := range m {
		for _, v := range row {
			out[i] += float64(v)
		}
	}
	return out
}

func closeTo(t *testing.T, what string, got, want []float64, tol float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: got %d values, want %d", what, len(got), len(want))
	}
	for i := range got {
		if math.Abs(got[i]-want[i]) > tol*math.Max(1, math.Abs(want[i])) {
			t.Fatalf("%s[%d] = %v, want %v (±%v)", what, i, got[i], want[i], tol)
		}
	}
}

func f32bytes(vs []float32) []byte {
	b := make([]byte, 0, 4*len(vs))
	for _, v := range vs {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
	}
	return b
}

func bytesF32(b []byte) []float64 {
	out := make([]float64, len(b)/4)
	for i := range out {
		out[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:])))
	}
	return out
}

func TestE2EInference(t *testing.T) {
	s := startServer(t, inferenceRepo(t), "")
	rng := rand.New(rand.NewPCG(1, 2))

	t.Run("rest json nested", func(t *testing.T) {
		m, _ := randomRows(rng, 3, 10)
		var resp jsonInferResponse
		code := s.json(t, "POST", "/v2/models/dyn/infer", jsonInferRequest{
			ID:     "req-1",
			Inputs: []jsonTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{3, 10}, Data: m}},
		}, &resp)
		if code != 200 {
			t.Fatalf("status %d: %s", code, resp.Error)
		}
		if resp.ModelName != "dyn" || resp.ModelVersion != "1" || resp.ID != "req-1" {
			t.Errorf("response header = %+v", resp)
		}
		o := resp.Outputs[0]
		if o.Name != "output_scalars" || o.Datatype != "FP32" || fmt.Sprint(o.Shape) != "[3]" {
			t.Errorf("output = %+v", o)
		}
		closeTo(t, "row sums", o.Data, rowSums(m), 1e-5)
	})

	t.Run("rest json flat", func(t *testing.T) {
		m, flat := randomRows(rng, 2, 10)
		var resp jsonInferResponse
		code := s.json(t, "POST", "/v2/models/dyn/versions/1/infer", jsonInferRequest{
			Inputs: []jsonTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{2, 10}, Data: flat}},
		}, &resp)
		if code != 200 {
			t.Fatalf("status %d: %s", code, resp.Error)
		}
		closeTo(t, "row sums", resp.Outputs[0].Data, rowSums(m), 1e-5)
	})

	t.Run("rest binary", func(t *testing.T) {
		m, flat := randomRows(rng, 5, 10)
		header, _ := json.Marshal(jsonInferRequest{
			Inputs: []jsonTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{5, 10},
				Parameters: map[string]any{"binary_data_size": 200}}},
			Parameters: map[string]any{"binary_data_output": true},
		})
		body := append(header, f32bytes(flat)...)
		code, b, h := s.do(t, "POST", "/v2/models/dyn/infer", body,
			"Inference-Header-Content-Length", strconv.Itoa(len(header)), "Content-Type", "application/octet-stream")
		if code != 200 {
			t.Fatalf("status %d: %s", code, b)
		}
		n, err := strconv.Atoi(h.Get("Inference-Header-Content-Length"))
		if err != nil || n > len(b) {
			t.Fatalf("response header length %q: %v", h.Get("Inference-Header-Content-Length"), err)
		}
		var resp jsonInferResponse
		if err := json.Unmarshal(b[:n], &resp); err != nil {
			t.Fatal(err)
		}
		if size := resp.Outputs[0].Parameters["binary_data_size"]; size != float64(20) {
			t.Fatalf("binary_data_size = %v, want 20", size)
		}
		closeTo(t, "row sums", bytesF32(b[n:]), rowSums(m), 1e-5)
	})

	t.Run("grpc typed and raw", func(t *testing.T) {
		m, flat := randomRows(rng, 4, 10)
		typed := &inference.ModelInferRequest{
			ModelName: "dyn", Id: "g1",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{
				Name: "input_vectors", Datatype: "FP32", Shape: []int64{4, 10},
				Contents: &inference.InferTensorContents{Fp32Contents: flat},
			}},
		}
		raw := &inference.ModelInferRequest{
			ModelName: "dyn", ModelVersion: "1",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{
				Name: "input_vectors", Datatype: "FP32", Shape: []int64{4, 10},
			}},
			RawInputContents: [][]byte{f32bytes(flat)},
		}
		for _, req := range []*inference.ModelInferRequest{typed, raw} {
			resp, err := s.grpc.ModelInfer(t.Context(), req)
			if err != nil {
				t.Fatal(err)
			}
			if resp.ModelName != "dyn" || resp.ModelVersion != "1" || resp.Id != req.Id {
				t.Errorf("response = %v", resp)
			}
			if len(resp.RawOutputContents) != 1 || fmt.Sprint(resp.Outputs[0].Shape) != "[4]" {
				t.Fatalf("outputs = %v", resp.Outputs)
			}
			closeTo(t, "row sums", bytesF32(resp.RawOutputContents[0]), rowSums(m), 1e-5)
		}
	})

	t.Run("multitype", func(t *testing.T) {
		// The network computes OutputA = int16(InputB * InputA - 512) and
		// OutputB = int64(InputA) * 1234 (onnxruntime_go's generator script).
		var resp jsonInferResponse
		code := s.json(t, "POST", "/v2/models/multi/infer", jsonInferRequest{
			Inputs: []jsonTensor{
				{Name: "InputA", Datatype: "UINT8", Shape: []int64{1, 1, 1}, Data: []int{7}},
				{Name: "InputB", Datatype: "FP64", Shape: []int64{1, 2, 2}, Data: []float64{1.5, -2.25, 100, 80}},
			},
		}, &resp)
		if code != 200 {
			t.Fatalf("status %d: %s", code, resp.Error)
		}
		got := map[string]jsonOutput{}
		for _, o := range resp.Outputs {
			got[o.Name] = o
		}
		if a := got["OutputA"]; a.Datatype != "INT16" || fmt.Sprint(a.Data) != "[-501 -527 188 48]" {
			t.Errorf("OutputA = %+v, want INT16 [-501 -527 188 48]", a)
		}
		if b := got["OutputB"]; b.Datatype != "INT64" || fmt.Sprint(b.Data) != "[8638]" {
			t.Errorf("OutputB = %+v, want INT64 [8638]", b)
		}
	})

	t.Run("requested output subset", func(t *testing.T) {
		var resp jsonInferResponse
		code := s.json(t, "POST", "/v2/models/multi/infer", jsonInferRequest{
			Inputs: []jsonTensor{
				{Name: "InputA", Datatype: "UINT8", Shape: []int64{1, 1, 1}, Data: []int{2}},
				{Name: "InputB", Datatype: "FP64", Shape: []int64{1, 2, 2}, Data: []float64{0, 0, 0, 0}},
			},
			Outputs: []jsonTensor{{Name: "OutputB"}},
		}, &resp)
		if code != 200 || len(resp.Outputs) != 1 || resp.Outputs[0].Name != "OutputB" || resp.Outputs[0].Data[0] != 2468 {
			t.Errorf("status %d, outputs %+v, want only OutputB = 2468", code, resp.Outputs)
		}
	})

	t.Run("float16 to bfloat16", func(t *testing.T) {
		// OutputA = bfloat16(InputA * 3); these values are exact in both types.
		in := []float32{0.5, 1, 1.5, 2, -0.25, 0, 4, -8}
		raw := make([]byte, 0, 16)
		for _, v := range in {
			raw = binary.LittleEndian.AppendUint16(raw, f32ToF16(v))
		}
		resp, err := s.grpc.ModelInfer(t.Context(), &inference.ModelInferRequest{
			ModelName: "fp16",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{
				Name: "InputA", Datatype: "FP16", Shape: []int64{1, 2, 2, 2},
			}},
			RawInputContents: [][]byte{raw},
		})
		if err != nil {
			t.Fatal(err)
		}
		if resp.Outputs[0].Datatype != "BF16" {
			t.Fatalf("datatype %s, want BF16", resp.Outputs[0].Datatype)
		}
		out := resp.RawOutputContents[0]
		for i, v := range in {
			bits := binary.LittleEndian.Uint16(out[2*i:])
			if got := math.Float32frombits(uint32(bits) << 16); got != v*3 {
				t.Errorf("OutputA[%d] = %v, want %v", i, got, v*3)
			}
		}
	})

	t.Run("ocr detector matches direct onnxruntime", func(t *testing.T) {
		const h, w = 64, 96
		img := make([]float32, 3*h*w)
		for i := range img {
			img[i] = rng.Float32()*2 - 1
		}
		want := directDetector(t, img, h, w)
		resp, err := s.grpc.ModelInfer(t.Context(), &inference.ModelInferRequest{
			ModelName: "det",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{
				Name: "x", Datatype: "FP32", Shape: []int64{1, 3, h, w},
			}},
			RawInputContents: [][]byte{f32bytes(img)},
		})
		if err != nil {
			t.Fatal(err)
		}
		if got := fmt.Sprint(resp.Outputs[0].Shape); got != fmt.Sprintf("[1 1 %d %d]", h, w) {
			t.Fatalf("shape %s", got)
		}
		closeTo(t, "detector map", bytesF32(resp.RawOutputContents[0]), want, 1e-5)
	})

	t.Run("metadata", func(t *testing.T) {
		var md struct {
			Name     string       `json:"name"`
			Versions []string     `json:"versions"`
			Platform string       `json:"platform"`
			Inputs   []jsonTensor `json:"inputs"`
			Outputs  []jsonTensor `json:"outputs"`
		}
		if code := s.json(t, "GET", "/v2/models/dyn", nil, &md); code != 200 {
			t.Fatalf("status %d", code)
		}
		if md.Name != "dyn" || fmt.Sprint(md.Versions) != "[1]" || md.Platform != "onnxruntime_onnx" ||
			md.Inputs[0].Name != "input_vectors" || md.Inputs[0].Datatype != "FP32" || fmt.Sprint(md.Inputs[0].Shape) != "[-1 10]" ||
			md.Outputs[0].Name != "output_scalars" || fmt.Sprint(md.Outputs[0].Shape) != "[-1]" {
			t.Errorf("REST metadata = %+v", md)
		}
		g, err := s.grpc.ModelMetadata(t.Context(), &inference.ModelMetadataRequest{Name: "multi", Version: "1"})
		if err != nil {
			t.Fatal(err)
		}
		if len(g.Inputs) != 2 || g.Inputs[0].Datatype != "UINT8" || g.Outputs[1].Datatype != "INT64" {
			t.Errorf("gRPC metadata = %v", g)
		}
		var server struct {
			Name       string   `json:"name"`
			Extensions []string `json:"extensions"`
		}
		s.json(t, "GET", "/v2", nil, &server)
		if server.Name != "sloserve" || !strings.Contains(strings.Join(server.Extensions, ","), "binary_tensor_data") {
			t.Errorf("server metadata = %+v", server)
		}
		for _, path := range []string{"/v2/health/live", "/v2/health/ready", "/v2/models/dyn/ready", "/v2/models/dyn/versions/1/ready"} {
			if code, b, _ := s.do(t, "GET", path, nil); code != 200 {
				t.Errorf("GET %s = %d %s", path, code, b)
			}
		}
		if r, err := s.grpc.ModelReady(t.Context(), &inference.ModelReadyRequest{Name: "det"}); err != nil || !r.Ready {
			t.Errorf("gRPC ModelReady(det) = %v, %v", r, err)
		}
	})

	t.Run("bad requests rest", func(t *testing.T) {
		for _, tc := range []struct {
			name, path, body string
			status           int
			want             string
		}{
			{"malformed json", "/v2/models/dyn/infer", `{"inputs": [`, 400, ""},
			{"unknown model", "/v2/models/nope/infer", `{"inputs":[]}`, 404, "nope"},
			{"unknown version", "/v2/models/dyn/versions/7/infer", `{"inputs":[]}`, 404, "7"},
			{"wrong datatype", "/v2/models/dyn/infer", `{"inputs":[{"name":"input_vectors","datatype":"INT32","shape":[1,10],"data":[1,2,3,4,5,6,7,8,9,0]}]}`, 400, "INT32"},
			{"wrong shape", "/v2/models/dyn/infer", `{"inputs":[{"name":"input_vectors","datatype":"FP32","shape":[1,9],"data":[1,2,3,4,5,6,7,8,9]}]}`, 400, "[-1 10]"},
			{"data length", "/v2/models/dyn/infer", `{"inputs":[{"name":"input_vectors","datatype":"FP32","shape":[1,10],"data":[1,2,3]}]}`, 400, "input_vectors"},
			{"missing input", "/v2/models/multi/infer", `{"inputs":[{"name":"InputA","datatype":"UINT8","shape":[1,1,1],"data":[1]}]}`, 400, "InputB"},
			{"unknown output", "/v2/models/dyn/infer", `{"inputs":[{"name":"input_vectors","datatype":"FP32","shape":[1,10],"data":[1,2,3,4,5,6,7,8,9,0]}],"outputs":[{"name":"zzz"}]}`, 400, "zzz"},
			{"batch too large", "/v2/models/det/infer", `{"inputs":[{"name":"x","datatype":"FP32","shape":[3,3,1,1],"data":[1,2,3,4,5,6,7,8,9]}]}`, 400, "batch size 3"},
			{"too many elements", "/v2/models/dyn/infer", `{"inputs":[{"name":"input_vectors","datatype":"FP32","shape":[1000000000,10],"data":[]}]}`, 413, ""},
			{"zero dimension", "/v2/models/det/infer", `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,3,0,16],"data":[]}]}`, 400, "dimension 2 is 0"},
			{"version with a leading zero", "/v2/models/dyn/versions/01/infer", string(dynBody), 404, `version "01"`},
			{"version with a plus sign", "/v2/models/dyn/versions/+1/infer", string(dynBody), 404, `version "+1"`},
			{"duplicate key", "/v2/models/dyn/infer", `{"inputs":[],` + string(dynBody)[1:], 400, `key "inputs" appears twice`},
		} {
			t.Run(tc.name, func(t *testing.T) {
				code, b, h := s.do(t, "POST", tc.path, []byte(tc.body))
				var e struct {
					Error string `json:"error"`
				}
				if err := json.Unmarshal(b, &e); err != nil || e.Error == "" {
					t.Fatalf("body %q is not {\"error\": ...} (%v)", b, err)
				}
				if code != tc.status || !strings.Contains(e.Error, tc.want) {
					t.Errorf("status %d error %q, want %d containing %q", code, e.Error, tc.status, tc.want)
				}
				if ct := h.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
					t.Errorf("Content-Type %q", ct)
				}
			})
		}
		// The binary header claims more than the body holds.
		code, b, _ := s.do(t, "POST", "/v2/models/dyn/infer", []byte(`{"inputs":[]}`),
			"Inference-Header-Content-Length", "500", "Content-Type", "application/octet-stream")
		if code != 400 || !bytes.Contains(b, []byte(`"error"`)) {
			t.Errorf("header length beyond body: %d %s", code, b)
		}
	})

	t.Run("bad requests grpc", func(t *testing.T) {
		in := func(name, dt string, shape []int64, c *inference.InferTensorContents) *inference.ModelInferRequest_InferInputTensor {
			return &inference.ModelInferRequest_InferInputTensor{Name: name, Datatype: dt, Shape: shape, Contents: c}
		}
		ten := &inference.InferTensorContents{Fp32Contents: make([]float32, 10)}
		for _, tc := range []struct {
			name string
			req  *inference.ModelInferRequest
			code codes.Code
			want string
		}{
			{"unknown model", &inference.ModelInferRequest{ModelName: "nope"}, codes.NotFound, "nope"},
			{"unknown version", &inference.ModelInferRequest{ModelName: "dyn", ModelVersion: "3"}, codes.NotFound, "3"},
			{"wrong datatype", &inference.ModelInferRequest{ModelName: "dyn", Inputs: []*inference.ModelInferRequest_InferInputTensor{
				in("input_vectors", "INT32", []int64{1, 10}, &inference.InferTensorContents{IntContents: make([]int32, 10)})}}, codes.InvalidArgument, "INT32"},
			{"wrong shape", &inference.ModelInferRequest{ModelName: "dyn", Inputs: []*inference.ModelInferRequest_InferInputTensor{
				in("input_vectors", "FP32", []int64{2, 5}, ten)}}, codes.InvalidArgument, "[-1 10]"},
			{"count mismatch", &inference.ModelInferRequest{ModelName: "dyn", Inputs: []*inference.ModelInferRequest_InferInputTensor{
				in("input_vectors", "FP32", []int64{2, 10}, ten)}}, codes.InvalidArgument, "input_vectors"},
			{"missing input", &inference.ModelInferRequest{ModelName: "multi", Inputs: []*inference.ModelInferRequest_InferInputTensor{
				in("InputA", "UINT8", []int64{1, 1, 1}, &inference.InferTensorContents{UintContents: []uint32{1}})}}, codes.InvalidArgument, "InputB"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				_, err := s.grpc.ModelInfer(t.Context(), tc.req)
				st := status.Convert(err)
				if st.Code() != tc.code || !strings.Contains(st.Message(), tc.want) {
					t.Errorf("got %v %q, want %v containing %q", st.Code(), st.Message(), tc.code, tc.want)
				}
			})
		}
	})

	t.Run("statistics and metrics", func(t *testing.T) {
		var before struct {
			ModelStats []struct {
				Name           string `json:"name"`
				Version        string `json:"version"`
				InferenceCount uint64 `json:"inference_count"`
				ExecutionCount uint64 `json:"execution_count"`
			} `json:"model_stats"`
		}
		if code := s.json(t, "GET", "/v2/models/multi/stats", nil, &before); code != 200 || len(before.ModelStats) != 1 {
			t.Fatalf("stats: %d %+v", code, before)
		}
		const metric = "sloserve_qos_requests_total"
		answered := func() float64 {
			good, _ := s.modelMetric(t, metric, "multi/1", `outcome="good"`)
			late, _ := s.modelMetric(t, metric, "multi/1", `outcome="late"`)
			return good + late
		}
		m0 := answered()
		const n = 5
		for range n {
			var resp jsonInferResponse
			code := s.json(t, "POST", "/v2/models/multi/infer", jsonInferRequest{Inputs: []jsonTensor{
				{Name: "InputA", Datatype: "UINT8", Shape: []int64{1, 1, 1}, Data: []int{1}},
				{Name: "InputB", Datatype: "FP64", Shape: []int64{1, 2, 2}, Data: []float64{1, 2, 3, 4}},
			}}, &resp)
			if code != 200 {
				t.Fatal(resp.Error)
			}
		}
		g, err := s.grpc.ModelStatistics(t.Context(), &inference.ModelStatisticsRequest{Name: "multi"})
		if err != nil {
			t.Fatal(err)
		}
		st := g.ModelStats[0]
		if st.InferenceCount != before.ModelStats[0].InferenceCount+n || st.ExecutionCount != before.ModelStats[0].ExecutionCount+n ||
			st.InferenceStats.Success.Count < n || st.InferenceStats.ComputeInfer.Ns == 0 || st.LastInference == 0 {
			t.Errorf("gRPC statistics after %d more requests = %v (before %+v)", n, st, before.ModelStats[0])
		}
		if m1 := answered(); m1-m0 != n {
			t.Errorf("%s of multi/1 answered went from %v to %v, want +%d", metric, m0, m1, n)
		}
		for _, series := range []string{
			"sloserve_qos_request_duration_seconds_count",
			"sloserve_qos_compute_duration_seconds_count",
			"sloserve_qos_queue_delay_seconds_count",
		} {
			if v, ok := s.modelMetric(t, series, "multi/1"); !ok || v < n {
				t.Errorf("%s of multi/1 = %v (present %v), want >= %d", series, v, ok, n)
			}
		}
		if v, ok := s.metricValue(t, `sloserve_runner_resident_memory_bytes{instance="0",model="det",version="1"}`); !ok || v < 1<<20 {
			t.Errorf("runner RSS for det = %v (present %v), want > 1 MiB", v, ok)
		}
		if _, ok := s.metricValue(t, `sloserve_model_load_duration_seconds_count{model="det",version="1"}`); !ok {
			t.Error("no model load duration for det")
		}
	})

	t.Run("repository index", func(t *testing.T) {
		var idx []struct {
			Name, Version, State string
		}
		if code := s.json(t, "POST", "/v2/repository/index", map[string]any{}, &idx); code != 200 {
			t.Fatalf("status %d", code)
		}
		var got []string
		for _, e := range idx {
			got = append(got, e.Name+"/"+e.Version+"/"+e.State)
		}
		if strings.Join(got, " ") != "det/1/READY dyn/1/READY fp16/1/READY multi/1/READY" {
			t.Errorf("index = %v", got)
		}
		// Loading is refused in the default control mode (none).
		code, b, _ := s.do(t, "POST", "/v2/repository/models/dyn/load", []byte(`{}`))
		if code != 400 || !bytes.Contains(b, []byte("explicit")) {
			t.Errorf("load in none mode: %d %s", code, b)
		}
	})
}

// directDetector runs the detector in this test process through
// onnxruntime_go, the independent reference for the server's answer.
func directDetector(t *testing.T, img []float32, h, w int64) []float64 {
	t.Helper()
	if !ort.IsInitialized() {
		ort.SetSharedLibraryPath(need(t, "SLOSERVE_ONNXRUNTIME_LIBRARY"))
		if err := ort.InitializeEnvironment(); err != nil {
			t.Fatal(err)
		}
	}
	in, err := ort.NewTensor(ort.NewShape(1, 3, h, w), img)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Destroy()
	out, err := ort.NewEmptyTensor[float32](ort.NewShape(1, 1, h, w))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Destroy()
	opts, err := ort.NewSessionOptions()
	if err != nil {
		t.Fatal(err)
	}
	defer opts.Destroy()
	sess, err := ort.NewAdvancedSession(demoModel(t, "ocr-det"), []string{"x"}, []string{"sigmoid_0.tmp_0"},
		[]ort.Value{in}, []ort.Value{out}, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Destroy()
	if err := sess.Run(); err != nil {
		t.Fatal(err)
	}
	res := make([]float64, 0, h*w)
	for _, v := range out.GetData() {
		res = append(res, float64(v))
	}
	return res
}

// f32ToF16 converts exactly representable values (test inputs only).
func f32ToF16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int((b>>23)&0xff) - 127 + 15
	mant := b & 0x7fffff
	if f == 0 {
		return sign
	}
	return sign | uint16(exp)<<10 | uint16(mant>>13)
}
