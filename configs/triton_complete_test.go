package configs

import (
	"errors"
	"io/fs"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
)

// onnxSignature is a model file holding only a graph's inputs and outputs
// (ModelProto.graph, GraphProto.input/output, ValueInfoProto, TypeProto):
// what completing a config reads. A dimension of -1 is written symbolic.
type onnxTensor struct {
	name  string
	dtype uint64 // TensorProto.DataType: 1 FP32, 6 INT32
	dims  []int64
}

func onnxSignature(ins, outs []onnxTensor) []byte {
	value := func(t onnxTensor) []byte {
		var shape []byte
		for _, d := range t.dims {
			var dim []byte
			if d < 0 {
				dim = protowire.AppendTag(dim, 2, protowire.BytesType)
				dim = protowire.AppendString(dim, "N")
			} else {
				dim = protowire.AppendTag(dim, 1, protowire.VarintType)
				dim = protowire.AppendVarint(dim, uint64(d))
			}
			shape = protowire.AppendTag(shape, 1, protowire.BytesType)
			shape = protowire.AppendBytes(shape, dim)
		}
		var tensor []byte
		tensor = protowire.AppendTag(tensor, 1, protowire.VarintType)
		tensor = protowire.AppendVarint(tensor, t.dtype)
		tensor = protowire.AppendTag(tensor, 2, protowire.BytesType)
		tensor = protowire.AppendBytes(tensor, shape)
		var typ []byte
		typ = protowire.AppendTag(typ, 1, protowire.BytesType)
		typ = protowire.AppendBytes(typ, tensor)
		var vi []byte
		vi = protowire.AppendTag(vi, 1, protowire.BytesType)
		vi = protowire.AppendString(vi, t.name)
		vi = protowire.AppendTag(vi, 2, protowire.BytesType)
		return protowire.AppendBytes(vi, typ)
	}
	var graph []byte
	for _, t := range ins {
		graph = protowire.AppendTag(graph, 11, protowire.BytesType)
		graph = protowire.AppendBytes(graph, value(t))
	}
	for _, t := range outs {
		graph = protowire.AppendTag(graph, 12, protowire.BytesType)
		graph = protowire.AppendBytes(graph, value(t))
	}
	var model []byte
	model = protowire.AppendTag(model, 7, protowire.BytesType)
	return protowire.AppendBytes(model, graph)
}

var (
	batchingModel = onnxSignature(
		[]onnxTensor{{"x", 1, []int64{-1, 10}}, {"k", 6, []int64{-1}}},
		[]onnxTensor{{"y", 1, []int64{-1, 3, -1}}})
	fixedModel = onnxSignature(
		[]onnxTensor{{"in", 6, []int64{1, 2}}},
		[]onnxTensor{{"out", 6, []int64{1}}})
)

// TestTritonAutoComplete: a Triton model folder without a config, or with
// a config.pbtxt that leaves fields out, is completed from its model file
// as Triton's ONNX Runtime backend does.
func TestTritonAutoComplete(t *testing.T) {
	batchingIO := [2][]TensorConfig{
		{{Name: "x", DataType: "FP32", Shape: []int64{-1, 10}}, {Name: "k", DataType: "INT32", Shape: []int64{-1}}},
		{{Name: "y", DataType: "FP32", Shape: []int64{-1, 3, -1}}},
	}
	cases := []struct {
		name     string
		model    []byte
		pbtxt    *string // nil: no config file
		maxBatch int
		io       [2][]TensorConfig
		err      string
	}{
		{name: "no config, batching model", model: batchingModel, maxBatch: TritonDefaultMaxBatchSize, io: batchingIO},
		{name: "no config, fixed model", model: fixedModel, io: [2][]TensorConfig{
			{{Name: "in", DataType: "INT32", Shape: []int64{1, 2}}},
			{{Name: "out", DataType: "INT32", Shape: []int64{1}}},
		}},
		{name: "only max_batch_size", model: batchingModel, pbtxt: ptr(`max_batch_size: 16`), maxBatch: 16, io: batchingIO},
		{name: "max_batch_size 0 with inputs listed stays 0", model: batchingModel,
			pbtxt: ptr(`input [ { name: "x", data_type: TYPE_FP32, dims: [ -1, 10 ] }, { name: "k", data_type: TYPE_INT32, dims: [ -1 ] } ]`),
			io: [2][]TensorConfig{
				{{Name: "x", DataType: "FP32", Shape: []int64{-1, 10}}, {Name: "k", DataType: "INT32", Shape: []int64{-1}}},
				{{Name: "y", DataType: "FP32", Shape: []int64{-1, 3, -1}}},
			}},
		{name: "instance group only", model: batchingModel, pbtxt: ptr(`instance_group [ { count: 2 } ]`), maxBatch: TritonDefaultMaxBatchSize, io: batchingIO},
		{name: "batching asked of a fixed model", model: fixedModel, pbtxt: ptr(`max_batch_size: 8`),
			err: `max_batch_size: is 8, but "in" in`},
		{name: "not an ONNX file is left to the load", model: []byte("\xff\xff\xff")},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "auto")
			writeFile(t, filepath.Join(dir, "1", ModelFile), string(tc.model))
			if tc.pbtxt != nil {
				writeFile(t, filepath.Join(dir, ModelConfigPbtxt), *tc.pbtxt)
			}
			m, err := LoadModel(dir)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) || !errors.Is(err, ErrInvalid) {
					t.Fatalf("err %v, want one holding %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if m.Name != "auto" || m.Platform != PlatformONNX || m.MaxBatchSize != tc.maxBatch {
				t.Errorf("name %q platform %q max_batch_size %d, want auto, onnx, %d", m.Name, m.Platform, m.MaxBatchSize, tc.maxBatch)
			}
			eq := func(a, b TensorConfig) bool {
				return a.Name == b.Name && a.DataType == b.DataType && slices.Equal(a.Shape, b.Shape)
			}
			if !slices.EqualFunc(m.Inputs, tc.io[0], eq) || !slices.EqualFunc(m.Outputs, tc.io[1], eq) {
				t.Errorf("inputs %+v outputs %+v, want %+v %+v", m.Inputs, m.Outputs, tc.io[0], tc.io[1])
			}
			if tc.pbtxt == nil && len(m.Warnings) != 0 {
				t.Errorf("warnings %q", m.Warnings)
			}
			// In Triton's shape the batch dimension leaves the dims and
			// dynamic batching is on, as Triton's completed config shows.
			trc := TritonConfig(m)
			if tc.maxBatch > 0 && (trc.GetDynamicBatching() == nil || !slices.Equal(trc.GetInput()[0].GetDims(), m.Inputs[0].Shape[1:])) {
				t.Errorf("Triton's shape: %v", trc)
			}
		})
	}
	// A folder with neither config nor version is not a model.
	empty := filepath.Join(t.TempDir(), "empty")
	writeFile(t, filepath.Join(empty, "README"), "")
	if _, err := LoadModel(empty); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("an empty folder: %v, want fs.ErrNotExist", err)
	}
}

func ptr(s string) *string { return &s }

// KIND_AUTO, and no instance_group at all, leave the device to the server:
// the GPU when it has one, else the CPU. A CPU or GPU group beside an
// AUTO one decides for it.
func TestTritonKindAuto(t *testing.T) {
	for _, tc := range []struct {
		name, pbtxt string
		auto        bool
		onGPU       string // provider when the server has a GPU
	}{
		{"no instance_group", ``, true, ProviderCUDA},
		{"KIND_AUTO", `instance_group [ { count: 2, kind: KIND_AUTO } ]`, true, ProviderCUDA},
		{"KIND_CPU", `instance_group [ { kind: KIND_CPU } ]`, false, ProviderCPU},
		{"KIND_AUTO and KIND_CPU", `instance_group [ { kind: KIND_AUTO }, { kind: KIND_CPU } ]`, false, ProviderCPU},
		{"KIND_AUTO and KIND_GPU", `instance_group [ { kind: KIND_AUTO }, { kind: KIND_GPU, gpus: [ 1 ] } ]`, false, ProviderCUDA},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := ParseTritonModel("config.pbtxt", []byte(`name: "m" `+tc.pbtxt))
			if err != nil {
				t.Fatal(err)
			}
			if m.Execution.Auto != tc.auto {
				t.Errorf("auto %v, want %v", m.Execution.Auto, tc.auto)
			}
			if cpu := m.OnDevice(false); cpu.Execution.Provider != ProviderCPU && tc.onGPU == ProviderCPU {
				t.Errorf("without a GPU: provider %s", cpu.Execution.Provider)
			}
			gpu := m.OnDevice(true)
			if gpu.Execution.Provider != tc.onGPU {
				t.Errorf("with a GPU: provider %s, want %s", gpu.Execution.Provider, tc.onGPU)
			}
			if gpu.Execution.Provider == ProviderCUDA && (gpu.Execution.CUDA == nil || gpu.Validate() != nil) {
				t.Errorf("with a GPU: cuda options %+v, %v", gpu.Execution.CUDA, gpu.Validate())
			}
			if tc.auto && (m.Execution.Provider != ProviderCPU || gpu.Execution.DeviceGiven) {
				t.Errorf("auto: %s before resolving, device given %v after", m.Execution.Provider, gpu.Execution.DeviceGiven)
			}
		})
	}
}

// A reshape reads the same from config.yaml and config.pbtxt, writes back
// in Triton's shape, and must keep the elements.
func TestReshapeConfig(t *testing.T) {
	y, err := ParseModel("config.yaml", []byte("name: m\nmax_batch_size: 4\ninputs: [{name: v, datatype: FP32, shape: [-1, 2, 5], reshape: [-1, 10]}]\noutputs: [{name: s, datatype: FP32, shape: [-1, 1], reshape: [-1]}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	p, err := ParseTritonModel("config.pbtxt", []byte(`name: "m" max_batch_size: 4
input [ { name: "v", data_type: TYPE_FP32, dims: [ 2, 5 ], reshape: { shape: [ 10 ] } } ]
output [ { name: "s", data_type: TYPE_FP32, dims: [ 1 ], reshape: { shape: [ ] } } ]`))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []*Model{y, p} {
		if !slices.Equal(m.Inputs[0].Reshape, []int64{-1, 10}) || !slices.Equal(m.Inputs[0].ModelShape(), []int64{-1, 10}) ||
			!slices.Equal(m.Outputs[0].Reshape, []int64{-1}) || !slices.Equal(m.Outputs[0].Shape, []int64{-1, 1}) {
			t.Errorf("%s: inputs %+v outputs %+v", m.File, m.Inputs, m.Outputs)
		}
	}
	tc := TritonConfig(p)
	if r := tc.GetInput()[0].GetReshape(); r == nil || !slices.Equal(r.GetShape(), []int64{10}) || tc.GetOutput()[0].GetReshape() == nil {
		t.Errorf("Triton's shape: %v", tc)
	}
	for _, bad := range []struct{ yaml, want string }{
		{"inputs: [{name: v, datatype: FP32, shape: [-1, 2, 5], reshape: [-1, 9]}]", "inputs[0].reshape: [-1 9] holds 9 elements, shape [-1 2 5] holds 10"},
		{"inputs: [{name: v, datatype: FP32, shape: [-1, 2, 5], reshape: [10]}]", "inputs[0].reshape[0]: must be -1 (the batch dimension)"},
		{"inputs: [{name: v, datatype: FP32, shape: [-1, -1], reshape: [-1, 10]}]", "inputs[0].shape[1]: must be fixed (>= 1) when the tensor is reshaped"},
	} {
		_, err := ParseModel("config.yaml", []byte("name: m\nmax_batch_size: 4\n"+bad.yaml+"\n"))
		if err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%s: %v, want %q", bad.yaml, err, bad.want)
		}
	}
}
