package e2e

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/sloserve/sloserve/api/inference"
)

// binaryOpModel writes an ONNX model of one elementwise operator (Add,
// Mul) on two FP32 vectors of a dynamic length: z = op(x, y), as raw
// onnx.ModelProto bytes (the test networks hold no such model).
func binaryOpModel(t *testing.T, op string) string {
	t.Helper()
	field := func(num protowire.Number, parts ...[]byte) []byte {
		return protowire.AppendBytes(protowire.AppendTag(nil, num, protowire.BytesType), bytes.Join(parts, nil))
	}
	str := func(num protowire.Number, s string) []byte { return field(num, []byte(s)) }
	varint := func(num protowire.Number, v uint64) []byte {
		return protowire.AppendVarint(protowire.AppendTag(nil, num, protowire.VarintType), v)
	}
	// ValueInfoProto{name, type{tensor_type{elem_type FLOAT, shape{dim{dim_param "batch"}}}}}
	vector := func(num protowire.Number, name string) []byte {
		return field(num, str(1, name), field(2, field(1, varint(1, 1), field(2, field(1, str(2, "batch"))))))
	}
	node := field(1, str(1, "x"), str(1, "y"), str(2, "z"), str(3, strings.ToLower(op)), str(4, op))
	graph := field(7, node, str(2, op), vector(11, "x"), vector(11, "y"), vector(12, "z"))
	model := bytes.Join([][]byte{varint(1, 8), str(2, "sloserve e2e"), graph, field(8, varint(2, 17))}, nil)
	path := filepath.Join(t.TempDir(), strings.ToLower(op)+".onnx")
	if err := os.WriteFile(path, model, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// pipeConfig is a Triton ensemble of four steps over three models:
// dyn sums each row of RAW into SUM; add and mul, side by side, make
// DBL = SUM+SUM and SQ = SUM*SUM; add again makes OUT = DBL+SQ.
const pipeConfig = `name: "pipe"
platform: "ensemble"
max_batch_size: 8
input [ { name: "RAW", data_type: TYPE_FP32, dims: [ 10 ] } ]
output [
  { name: "OUT", data_type: TYPE_FP32, dims: [ ] },
  { name: "SUM", data_type: TYPE_FP32, dims: [ ] }
]
ensemble_scheduling {
  step [
    {
      model_name: "dyn"
      model_version: -1
      input_map { key: "input_vectors" value: "RAW" }
      output_map { key: "output_scalars" value: "SUM" }
    },
    {
      model_name: "add"
      model_version: -1
      input_map { key: "x" value: "SUM" }
      input_map { key: "y" value: "SUM" }
      output_map { key: "z" value: "DBL" }
    },
    {
      model_name: "mul"
      model_version: -1
      input_map { key: "x" value: "SUM" }
      input_map { key: "y" value: "SUM" }
      output_map { key: "z" value: "SQ" }
    },
    {
      model_name: "add"
      model_version: -1
      input_map { key: "x" value: "DBL" }
      input_map { key: "y" value: "SQ" }
      output_map { key: "z" value: "OUT" }
    }
  ]
}
`

// restInfer runs a JSON request on model and returns each output's
// values as float32, by name.
func restInfer(t *testing.T, s *testServer, model string, inputs ...jsonTensor) map[string][]float32 {
	t.Helper()
	var resp jsonInferResponse
	if code := s.json(t, "POST", "/v2/models/"+model+"/infer", jsonInferRequest{Inputs: inputs}, &resp); code != 200 {
		t.Fatalf("%s: %d %+v", model, code, resp)
	}
	out := map[string][]float32{}
	for _, o := range resp.Outputs {
		for _, v := range o.Data {
			out[o.Name] = append(out[o.Name], float32(v))
		}
	}
	return out
}

func vec(name string, vs []float32) jsonTensor {
	return jsonTensor{Name: name, Datatype: "FP32", Shape: []int64{int64(len(vs))}, Data: vs}
}

func TestE2EEnsemble(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo,
		repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\nslo: {latency_ms: 10000, class: latency-critical}\n"},
		repoModel{"add", binaryOpModel(t, "Add"), "max_batch_size: 8\nslo: {latency_ms: 10000, class: best-effort}\n"},
		repoModel{"mul", binaryOpModel(t, "Mul"), "max_batch_size: 8\nslo: {latency_ms: 10000, class: latency-critical}\n"},
	)
	if err := os.MkdirAll(filepath.Join(repo, "pipe", "1"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(repo, "pipe", "config.pbtxt"), []byte(pipeConfig), 0o644); err != nil {
		t.Fatal(err)
	}
	s := startServer(t, repo, "model_control: explicit\nstartup_models: [\"*\"]\n")

	rng := rand.New(rand.NewPCG(31, 7))
	rows, flat := randomRows(rng, 3, 10)

	// The steps by hand, each model on its own.
	sum := restInfer(t, s, "dyn", jsonTensor{Name: "input_vectors", Datatype: "FP32", Shape: []int64{3, 10}, Data: flat})["output_scalars"]
	closeTo(t, "dyn's row sums", f64s(sum), rowSums(rows), 1e-5)
	dbl := restInfer(t, s, "add", vec("x", sum), vec("y", sum))["z"]
	sq := restInfer(t, s, "mul", vec("x", sum), vec("y", sum))["z"]
	want := restInfer(t, s, "add", vec("x", dbl), vec("y", sq))["z"]
	for i, x := range sum {
		if w := float32(float32(x+x) + float32(x*x)); want[i] != w {
			t.Fatalf("by hand: OUT[%d] = %v, want %v (2s+s² of %v)", i, want[i], w, x)
		}
	}
	before := inferenceCounts(t, s, "dyn", "add", "mul")

	t.Run("rest json", func(t *testing.T) {
		var resp jsonInferResponse
		req := jsonInferRequest{Inputs: []jsonTensor{{Name: "RAW", Datatype: "FP32", Shape: []int64{3, 10}, Data: flat}}}
		if code := s.json(t, "POST", "/v2/models/pipe/infer", req, &resp); code != 200 {
			t.Fatalf("%d %+v", code, resp)
		}
		if resp.ModelName != "pipe" || resp.ModelVersion != "1" || len(resp.Outputs) != 2 {
			t.Fatalf("response %+v", resp)
		}
		got := map[string][]float32{}
		for _, o := range resp.Outputs {
			if o.Datatype != "FP32" || !slices.Equal(o.Shape, []int64{3}) {
				t.Errorf("%s is %s %v, want FP32 [3]", o.Name, o.Datatype, o.Shape)
			}
			got[o.Name] = f32s(o.Data)
		}
		if !slices.Equal(got["OUT"], want) || !slices.Equal(got["SUM"], sum) {
			t.Errorf("OUT %v SUM %v, want %v and %v (the steps by hand)", got["OUT"], got["SUM"], want, sum)
		}
	})

	t.Run("tritonclient binary", func(t *testing.T) {
		// tritonclient.http's infer(): the JSON header, then the input's
		// bytes; binary_data_size on the input, binary_data on each
		// requested output (http/_infer_input.py, _requested_output.py),
		// no Content-Type (http/_client.py).
		header := []byte(`{"inputs":[{"name":"RAW","shape":[3,10],"datatype":"FP32","parameters":{"binary_data_size":120}}],` +
			`"outputs":[{"name":"OUT","parameters":{"binary_data":true}}]}`)
		req, err := http.NewRequestWithContext(t.Context(), "POST", s.http+"/v2/models/pipe/infer", bytes.NewReader(append(slices.Clone(header), f32bytes(flat)...)))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Inference-Header-Content-Length", strconv.Itoa(len(header)))
		req.Header.Set("User-Agent", "python/gevent-http-client-2.0")
		resp, err := s.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		n, err := strconv.Atoi(resp.Header.Get("Inference-Header-Content-Length"))
		if resp.StatusCode != 200 || err != nil || n > len(body) {
			t.Fatalf("%d %q: %s", resp.StatusCode, resp.Header.Get("Inference-Header-Content-Length"), body)
		}
		var head jsonInferResponse
		if err := json.Unmarshal(body[:n], &head); err != nil || len(head.Outputs) != 1 || head.Outputs[0].Name != "OUT" {
			t.Fatalf("header %s: %v", body[:n], err)
		}
		if got := body[n:]; !bytes.Equal(got, f32bytes(want)) {
			t.Errorf("OUT bytes %v, want %v", floatsOf(got), want)
		}
	})

	t.Run("grpc", func(t *testing.T) {
		// tritonclient.grpc's infer(): raw_input_contents, the outputs
		// asked for by name.
		resp, err := s.grpc.ModelInfer(t.Context(), &inference.ModelInferRequest{
			ModelName: "pipe",
			Inputs:    []*inference.ModelInferRequest_InferInputTensor{{Name: "RAW", Datatype: "FP32", Shape: []int64{3, 10}}},
			Outputs: []*inference.ModelInferRequest_InferRequestedOutputTensor{
				{Name: "SUM"}, {Name: "OUT"},
			},
			RawInputContents: [][]byte{f32bytes(flat)},
		})
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetModelVersion() != "1" || len(resp.GetOutputs()) != 2 || resp.GetOutputs()[0].GetName() != "SUM" || resp.GetOutputs()[1].GetName() != "OUT" {
			t.Fatalf("response %v", resp)
		}
		raw := resp.GetRawOutputContents()
		if len(raw) != 2 || !bytes.Equal(raw[0], f32bytes(sum)) || !bytes.Equal(raw[1], f32bytes(want)) {
			t.Errorf("raw outputs %v, want SUM %v OUT %v", raw, sum, want)
		}
	})

	// Every step went through its own model: three ensemble requests of
	// three rows each; add runs twice in each.
	after := inferenceCounts(t, s, "dyn", "add", "mul")
	for m, per := range map[string]uint64{"dyn": 1, "add": 2, "mul": 1} {
		if d := after[m] - before[m]; d != 3*3*per {
			t.Errorf("%s counted %d inferences for the ensemble requests, want %d", m, d, 3*3*per)
		}
	}
	if c := inferenceCounts(t, s, "pipe")["pipe"]; c != 9 {
		t.Errorf("the ensemble counted %d inferences, want 9", c)
	}

	t.Run("metadata config index", func(t *testing.T) {
		var md struct {
			Name     string       `json:"name"`
			Platform string       `json:"platform"`
			Versions []string     `json:"versions"`
			Inputs   []jsonTensor `json:"inputs"`
			Outputs  []jsonTensor `json:"outputs"`
		}
		if code := s.json(t, "GET", "/v2/models/pipe", nil, &md); code != 200 || md.Platform != "ensemble" ||
			!slices.Equal(md.Versions, []string{"1"}) || len(md.Inputs) != 1 || !slices.Equal(md.Inputs[0].Shape, []int64{-1, 10}) || len(md.Outputs) != 2 {
			t.Errorf("metadata %d %+v", code, md)
		}
		if code, b, _ := s.do(t, "GET", "/v2/models/pipe/ready", nil); code != 200 {
			t.Errorf("ready: %d %s", code, b)
		}
		var cfg struct {
			Platform           string `json:"platform"`
			MaxBatchSize       int    `json:"max_batch_size"`
			EnsembleScheduling struct {
				Step []struct {
					ModelName string            `json:"model_name"`
					InputMap  map[string]string `json:"input_map"`
				} `json:"step"`
			} `json:"ensemble_scheduling"`
		}
		if code := s.json(t, "GET", "/v2/models/pipe/config", nil, &cfg); code != 200 || cfg.Platform != "ensemble" || cfg.MaxBatchSize != 8 ||
			len(cfg.EnsembleScheduling.Step) != 4 || cfg.EnsembleScheduling.Step[2].ModelName != "mul" || cfg.EnsembleScheduling.Step[3].InputMap["y"] != "SQ" {
			t.Errorf("config %d %+v", code, cfg)
		}
		if st := indexState(t, s, "pipe"); st.State != "READY" {
			t.Errorf("index %+v", st)
		}
	})

	t.Run("step errors", func(t *testing.T) {
		// A step model unloaded: the ensemble is not ready, the index says
		// which step, a request fails naming it, over both protocols.
		if code, b, _ := s.do(t, "POST", "/v2/repository/models/mul/unload", nil); code != 200 {
			t.Fatalf("unload mul: %d %s", code, b)
		}
		if code, _, _ := s.do(t, "GET", "/v2/models/pipe/ready", nil); code == 200 {
			t.Errorf("pipe ready with mul unloaded")
		}
		if st := indexState(t, s, "pipe"); st.State != "UNAVAILABLE" || !strings.Contains(st.Reason, "step 2 (model mul)") {
			t.Errorf("index %+v", st)
		}
		req := jsonInferRequest{Inputs: []jsonTensor{{Name: "RAW", Datatype: "FP32", Shape: []int64{1, 10}, Data: flat[:10]}}}
		var resp jsonInferResponse
		if code := s.json(t, "POST", "/v2/models/pipe/infer", req, &resp); code != http.StatusServiceUnavailable ||
			!strings.Contains(resp.Error, "ensemble pipe step 2 (model mul)") {
			t.Errorf("infer with mul unloaded: %d %q", code, resp.Error)
		}
		_, err := s.grpc.ModelInfer(t.Context(), &inference.ModelInferRequest{ModelName: "pipe",
			Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "RAW", Datatype: "FP32", Shape: []int64{1, 10}}},
			RawInputContents: [][]byte{f32bytes(flat[:10])}})
		if st := status.Convert(err); st.Code() != codes.Unavailable || !strings.Contains(st.Message(), "ensemble pipe step 2 (model mul)") {
			t.Errorf("gRPC infer with mul unloaded: %v", err)
		}

		// Loading the ensemble while a step model is missing fails, naming it.
		code, b, _ := s.do(t, "POST", "/v2/repository/models/pipe/load", nil)
		if code != http.StatusBadRequest || !strings.Contains(string(b), "failed to load 'pipe'") || !strings.Contains(string(b), "step[2] (model mul): the step model must be loaded first") {
			t.Errorf("load with mul unloaded: %d %s", code, b)
		}
		// The ensemble served on before the failed reload; with mul back,
		// it answers as before.
		if code, b, _ := s.do(t, "POST", "/v2/repository/models/mul/load", nil); code != 200 {
			t.Fatalf("load mul: %d %s", code, b)
		}
		if code, b, _ := s.do(t, "POST", "/v2/repository/models/pipe/load", nil); code != 200 {
			t.Fatalf("load pipe: %d %s", code, b)
		}
		resp = jsonInferResponse{}
		if code := s.json(t, "POST", "/v2/models/pipe/infer", req, &resp); code != 200 || len(resp.Outputs) != 2 || float32(resp.Outputs[0].Data[0]) != want[0] {
			t.Errorf("after mul came back: %d %+v, want OUT[0] %v", code, resp, want[0])
		}

		// A request the ensemble refuses itself, in its own terms.
		bad := jsonInferRequest{Inputs: []jsonTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{1, 10}, Data: flat[:10]}}}
		resp = jsonInferResponse{}
		if code := s.json(t, "POST", "/v2/models/pipe/infer", bad, &resp); code != http.StatusBadRequest || !strings.Contains(resp.Error, `unknown input "input_vectors" for model pipe`) {
			t.Errorf("a step's input name: %d %q", code, resp.Error)
		}
	})
}

// indexState is the repository index's entry of model.
func indexState(t *testing.T, s *testServer, model string) (e struct{ Name, Version, State, Reason string }) {
	t.Helper()
	var idx []struct {
		Name    string `json:"name"`
		Version string `json:"version"`
		State   string `json:"state"`
		Reason  string `json:"reason"`
	}
	if code := s.json(t, "POST", "/v2/repository/index", map[string]any{}, &idx); code != 200 {
		t.Fatalf("index: %d", code)
	}
	for _, x := range idx {
		if x.Name == model {
			e.Name, e.Version, e.State, e.Reason = x.Name, x.Version, x.State, x.Reason
		}
	}
	return e
}

// inferenceCounts reads each model's inference_count from the statistics
// extension.
func inferenceCounts(t *testing.T, s *testServer, ms ...string) map[string]uint64 {
	t.Helper()
	out := map[string]uint64{}
	for _, m := range ms {
		var st struct {
			ModelStats []struct {
				InferenceCount uint64 `json:"inference_count"`
			} `json:"model_stats"`
		}
		if code := s.json(t, "GET", "/v2/models/"+m+"/stats", nil, &st); code != 200 || len(st.ModelStats) != 1 {
			t.Fatalf("%s stats: %d %+v", m, code, st)
		}
		out[m] = st.ModelStats[0].InferenceCount
	}
	return out
}

func f64s(vs []float32) []float64 {
	out := make([]float64, len(vs))
	for i, v := range vs {
		out[i] = float64(v)
	}
	return out
}

func f32s(vs []float64) []float32 {
	out := make([]float32, len(vs))
	for i, v := range vs {
		out[i] = float32(v)
	}
	return out
}

func floatsOf(b []byte) []float32 {
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}
