package e2e

import (
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/configs/tritonpb"
)

// tritonFolder adds a model folder to a repository as a Triton repository
// has it: version 1's model.onnx and, unless pbtxt is "", a config.pbtxt.
func tritonFolder(t *testing.T, repo, name, model, pbtxt string) {
	t.Helper()
	dir := filepath.Join(repo, name)
	if err := os.MkdirAll(filepath.Join(dir, "1"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(model, filepath.Join(dir, "1", "model.onnx")); err != nil {
		t.Fatal(err)
	}
	if pbtxt != "" {
		if err := os.WriteFile(filepath.Join(dir, "config.pbtxt"), []byte(pbtxt), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// A Triton model folder without a config is served with the config Triton
// would complete from the model: named after the folder, its tensors read
// from the model file, max_batch_size 4 (Triton's default) because every
// tensor's first dimension is dynamic; one whose config.pbtxt gives only
// max_batch_size is completed the same way.
func TestE2ETritonAutoComplete(t *testing.T) {
	repo := t.TempDir()
	tritonFolder(t, repo, "auto", testModel(t, "example_dynamic_axes.onnx"), "")
	tritonFolder(t, repo, "partial", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 2\n")
	tritonFolder(t, repo, "fixed", testModel(t, "example_unicode.onnx"), "")
	s := startServer(t, repo, "")
	rng := rand.New(rand.NewPCG(3, 1))

	for _, tc := range []struct {
		model    string
		maxBatch int32
	}{{"auto", 4}, {"partial", 2}} {
		t.Run(tc.model, func(t *testing.T) {
			resp, err := s.grpc.ModelConfig(t.Context(), &inference.ModelConfigRequest{Name: tc.model})
			if err != nil {
				t.Fatal(err)
			}
			c := resp.GetConfig()
			in, out := c.GetInput(), c.GetOutput()
			if c.GetName() != tc.model || c.GetPlatform() != "onnxruntime_onnx" || c.GetMaxBatchSize() != tc.maxBatch ||
				len(in) != 1 || in[0].GetName() != "input_vectors" || in[0].GetDataType() != tritonpb.DataType_TYPE_FP32 || !slices.Equal(in[0].GetDims(), []int64{10}) ||
				len(out) != 1 || out[0].GetName() != "output_scalars" || out[0].GetDataType() != tritonpb.DataType_TYPE_FP32 || len(out[0].GetDims()) != 0 ||
				c.GetDynamicBatching() == nil {
				t.Errorf("gRPC config %v", c)
			}
			var rest struct {
				Name         string `json:"name"`
				Platform     string `json:"platform"`
				MaxBatchSize int32  `json:"max_batch_size"`
				Input        []struct {
					Name     string  `json:"name"`
					DataType string  `json:"data_type"`
					Dims     []int64 `json:"dims"`
				} `json:"input"`
			}
			code, body, _ := s.do(t, "GET", "/v2/models/"+tc.model+"/config", nil)
			if err := json.Unmarshal(body, &rest); code != 200 || err != nil || rest.Name != tc.model || rest.Platform != "onnxruntime_onnx" ||
				rest.MaxBatchSize != tc.maxBatch || len(rest.Input) != 1 || rest.Input[0].DataType != "TYPE_FP32" || !slices.Equal(rest.Input[0].Dims, []int64{10}) {
				t.Errorf("REST config %d %s: %v", code, body, err)
			}

			// Inference over both protocols, up to the completed batch size.
			rows := int(tc.maxBatch)
			m, flat := randomRows(rng, rows, 10)
			var jr jsonInferResponse
			if code := s.json(t, "POST", "/v2/models/"+tc.model+"/infer", jsonInferRequest{
				Inputs: []jsonTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{int64(rows), 10}, Data: flat}},
			}, &jr); code != 200 {
				t.Fatalf("REST infer: %d %s", code, jr.Error)
			}
			closeTo(t, "REST row sums", jr.Outputs[0].Data, rowSums(m), 1e-5)
			gr, err := s.grpc.ModelInfer(t.Context(), &inference.ModelInferRequest{ModelName: tc.model, Inputs: []*inference.ModelInferRequest_InferInputTensor{{
				Name: "input_vectors", Datatype: "FP32", Shape: []int64{int64(rows), 10},
			}}, RawInputContents: [][]byte{f32bytes(flat)}})
			if err != nil {
				t.Fatal(err)
			}
			closeTo(t, "gRPC row sums", bytesF32(gr.GetRawOutputContents()[0]), rowSums(m), 1e-5)
			// One row over the completed max_batch_size is refused.
			if _, err := s.grpc.ModelInfer(t.Context(), grpcDyn(tc.model, rows+1)); status.Code(err) != codes.InvalidArgument {
				t.Errorf("%d rows: %v, want InvalidArgument", rows+1, err)
			}
		})
	}

	t.Run("fixed", func(t *testing.T) {
		// A model whose first dimension is fixed does not batch: its dims
		// are the model's whole shape.
		resp, err := s.grpc.ModelConfig(t.Context(), &inference.ModelConfigRequest{Name: "fixed"})
		if err != nil {
			t.Fatal(err)
		}
		c := resp.GetConfig()
		if c.GetMaxBatchSize() != 0 || len(c.GetInput()) != 1 || c.GetInput()[0].GetName() != "in" ||
			c.GetInput()[0].GetDataType() != tritonpb.DataType_TYPE_INT32 || !slices.Equal(c.GetInput()[0].GetDims(), []int64{1, 2}) {
			t.Errorf("config %v", c)
		}
		var jr jsonInferResponse
		if code := s.json(t, "POST", "/v2/models/fixed/infer", jsonInferRequest{
			Inputs: []jsonTensor{{Name: "in", Datatype: "INT32", Shape: []int64{1, 2}, Data: []int32{3, 4}}},
		}, &jr); code != 200 || len(jr.Outputs) != 1 || !slices.Equal(jr.Outputs[0].Shape, []int64{1}) {
			t.Errorf("infer: %d %+v", code, jr)
		}
	})
}

// KIND_AUTO (and a config without instance_group, Triton's default) runs
// a model on the GPU when the server has one, else on the CPU. On the
// simulated GPU the outputs are zeros of the model's shape; on the CPU
// they are the model's (row sums): the numbers say where it ran.
func TestE2ETritonKindAuto(t *testing.T) {
	repo := t.TempDir()
	tritonFolder(t, repo, "auto", testModel(t, "example_dynamic_axes.onnx"), "instance_group [ { count: 1, kind: KIND_AUTO } ]\n")
	tritonFolder(t, repo, "none", testModel(t, "example_dynamic_axes.onnx"), "")
	tritonFolder(t, repo, "cpu", testModel(t, "example_dynamic_axes.onnx"), "instance_group [ { kind: KIND_CPU } ]\n")
	for _, tc := range []struct {
		name, extra string
		kind        tritonpb.ModelInstanceGroup_Kind
	}{
		{"no GPU", "", tritonpb.ModelInstanceGroup_KIND_CPU},
		{"simulated GPU", "gpu:\n  simulator: {devices: 1, sms: 80, memory: 16GiB}\n", tritonpb.ModelInstanceGroup_KIND_GPU},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startServer(t, repo, tc.extra)
			m, flat := randomRows(rand.New(rand.NewPCG(5, 5)), 2, 10)
			for _, model := range []string{"auto", "none", "cpu"} {
				want := tc.kind
				if model == "cpu" {
					want = tritonpb.ModelInstanceGroup_KIND_CPU
				}
				resp, err := s.grpc.ModelConfig(t.Context(), &inference.ModelConfigRequest{Name: model})
				if err != nil {
					t.Fatal(err)
				}
				if g := resp.GetConfig().GetInstanceGroup(); len(g) != 1 || g[0].GetKind() != want || g[0].GetCount() != 1 {
					t.Errorf("%s: instance groups %v, want one of kind %s", model, g, want)
				}
				var jr jsonInferResponse
				if code := s.json(t, "POST", "/v2/models/"+model+"/infer", jsonInferRequest{
					Inputs: []jsonTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{2, 10}, Data: flat}},
				}, &jr); code != 200 {
					t.Fatalf("%s: infer %d %s", model, code, jr.Error)
				}
				sums := rowSums(m)
				if want == tritonpb.ModelInstanceGroup_KIND_GPU {
					sums = []float64{0, 0} // the simulator's outputs
				}
				closeTo(t, model+" outputs", jr.Outputs[0].Data, sums, 1e-5)
			}
		})
	}
}

// reshape: clients send and get a tensor in the config's dims, the model
// gets and gives its own. The numbers are the model's; only the shapes
// differ from those of the same model served without reshape.
func TestE2ETritonReshape(t *testing.T) {
	repo := t.TempDir()
	tritonFolder(t, repo, "batched", testModel(t, "example_dynamic_axes.onnx"), `max_batch_size: 8
input [ { name: "input_vectors", data_type: TYPE_FP32, dims: [ 2, 5 ], reshape: { shape: [ 10 ] } } ]
output [ { name: "output_scalars", data_type: TYPE_FP32, dims: [ 1 ], reshape: { shape: [ ] } } ]
`)
	tritonFolder(t, repo, "single", testModel(t, "example_unicode.onnx"), `input [ { name: "in", data_type: TYPE_INT32, dims: [ 2 ], reshape: { shape: [ 1, 2 ] } } ]
output [ { name: "out", data_type: TYPE_INT32, dims: [ ], reshape: { shape: [ 1 ] } } ]
`)
	tritonFolder(t, repo, "plain", testModel(t, "example_unicode.onnx"), "")
	s := startServer(t, repo, "")

	t.Run("metadata and config", func(t *testing.T) {
		var md struct {
			Inputs  []struct{ Shape []int64 } `json:"inputs"`
			Outputs []struct{ Shape []int64 } `json:"outputs"`
		}
		if code := s.json(t, "GET", "/v2/models/batched", nil, &md); code != 200 || len(md.Inputs) != 1 ||
			!slices.Equal(md.Inputs[0].Shape, []int64{-1, 2, 5}) || !slices.Equal(md.Outputs[0].Shape, []int64{-1, 1}) {
			t.Errorf("metadata %d %+v, want the clients' shapes [-1 2 5] and [-1 1]", code, md)
		}
		resp, err := s.grpc.ModelConfig(t.Context(), &inference.ModelConfigRequest{Name: "batched"})
		if err != nil {
			t.Fatal(err)
		}
		in, out := resp.GetConfig().GetInput()[0], resp.GetConfig().GetOutput()[0]
		if !slices.Equal(in.GetDims(), []int64{2, 5}) || in.GetReshape() == nil || !slices.Equal(in.GetReshape().GetShape(), []int64{10}) ||
			!slices.Equal(out.GetDims(), []int64{1}) || out.GetReshape() == nil || len(out.GetReshape().GetShape()) != 0 {
			t.Errorf("config input %v output %v", in, out)
		}
	})

	t.Run("batched", func(t *testing.T) {
		m, flat := randomRows(rand.New(rand.NewPCG(7, 7)), 3, 10)
		var jr jsonInferResponse
		if code := s.json(t, "POST", "/v2/models/batched/infer", jsonInferRequest{
			Inputs: []jsonTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{3, 2, 5}, Data: flat}},
		}, &jr); code != 200 {
			t.Fatalf("infer: %d %s", code, jr.Error)
		}
		if o := jr.Outputs[0]; o.Name != "output_scalars" || !slices.Equal(o.Shape, []int64{3, 1}) {
			t.Errorf("output %+v, want shape [3 1]", o)
		}
		closeTo(t, "row sums", jr.Outputs[0].Data, rowSums(m), 1e-5)
		// gRPC, binary: the same.
		gr, err := s.grpc.ModelInfer(t.Context(), &inference.ModelInferRequest{ModelName: "batched", Inputs: []*inference.ModelInferRequest_InferInputTensor{{
			Name: "input_vectors", Datatype: "FP32", Shape: []int64{3, 2, 5},
		}}, RawInputContents: [][]byte{f32bytes(flat)}})
		if err != nil {
			t.Fatal(err)
		}
		if o := gr.GetOutputs()[0]; !slices.Equal(o.GetShape(), []int64{3, 1}) {
			t.Errorf("gRPC output shape %v, want [3 1]", o.GetShape())
		}
		closeTo(t, "gRPC row sums", bytesF32(gr.GetRawOutputContents()[0]), rowSums(m), 1e-5)
		// The model's own shape is not the clients'.
		var bad jsonInferResponse
		if code := s.json(t, "POST", "/v2/models/batched/infer", jsonInferRequest{
			Inputs: []jsonTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{3, 10}, Data: flat}},
		}, &bad); code != 400 || bad.Error == "" {
			t.Errorf("a request in the model's shape: %d %q, want 400 naming the shape", code, bad.Error)
		}
	})

	t.Run("not batched", func(t *testing.T) {
		var plain, reshaped jsonInferResponse
		if code := s.json(t, "POST", "/v2/models/plain/infer", jsonInferRequest{
			Inputs: []jsonTensor{{Name: "in", Datatype: "INT32", Shape: []int64{1, 2}, Data: []int32{7, -3}}},
		}, &plain); code != 200 {
			t.Fatalf("plain: %d %s", code, plain.Error)
		}
		if code := s.json(t, "POST", "/v2/models/single/infer", jsonInferRequest{
			Inputs: []jsonTensor{{Name: "in", Datatype: "INT32", Shape: []int64{2}, Data: []int32{7, -3}}},
		}, &reshaped); code != 200 {
			t.Fatalf("reshaped: %d %s", code, reshaped.Error)
		}
		if !slices.Equal(plain.Outputs[0].Shape, []int64{1}) || len(reshaped.Outputs[0].Shape) != 0 ||
			!slices.Equal(reshaped.Outputs[0].Data, plain.Outputs[0].Data) || len(plain.Outputs[0].Data) != 1 {
			t.Errorf("plain %+v, reshaped %+v: want the same value, shapes [1] and []", plain.Outputs, reshaped.Outputs)
		}
	})
}
