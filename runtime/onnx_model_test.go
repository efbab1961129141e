package runtime

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
)

// The ONNX test networks cover no BYTES that work without a UTF-8 locale,
// no rank-0 tensors and no dynamically shaped half floats, so these tests
// write tiny Identity networks themselves, as raw onnx.ModelProto bytes.

// ONNX TensorProto.DataType values.
const (
	onnxFloat   = 1
	onnxInt64   = 7
	onnxString  = 8
	onnxBool    = 9
	onnxFloat16 = 10
)

// identityPair is one graph input copied to one graph output. dims holds
// int sizes or string names of dynamic dimensions; nil means rank 0.
// sequence wraps the input in a one-tensor sequence instead
// (SequenceConstruct).
type identityPair struct {
	in, out  string
	elemType int
	dims     []any
	sequence bool
}

// writeIdentityModel writes an ONNX model of Identity (or
// SequenceConstruct) nodes and returns its path.
func writeIdentityModel(t *testing.T, pairs ...identityPair) string {
	t.Helper()
	msg := func(fields ...[]byte) []byte { return bytes.Join(fields, nil) }
	bytesField := func(num protowire.Number, v []byte) []byte {
		b := protowire.AppendTag(nil, num, protowire.BytesType)
		return protowire.AppendBytes(b, v)
	}
	str := func(num protowire.Number, s string) []byte { return bytesField(num, []byte(s)) }
	varint := func(num protowire.Number, v int64) []byte {
		b := protowire.AppendTag(nil, num, protowire.VarintType)
		return protowire.AppendVarint(b, uint64(v))
	}
	valueInfo := func(name string, elemType int, dims []any, sequence bool) []byte {
		var shape []byte
		for _, d := range dims {
			switch d := d.(type) {
			case int:
				shape = append(shape, bytesField(1, varint(1, int64(d)))...) // dim { dim_value }
			case string:
				shape = append(shape, bytesField(1, str(2, d))...) // dim { dim_param }
			}
		}
		tensorType := msg(varint(1, int64(elemType)), bytesField(2, shape)) // elem_type, shape
		typ := bytesField(1, tensorType)                                    // TypeProto { tensor_type }
		if sequence {
			typ = bytesField(4, bytesField(1, typ)) // TypeProto { sequence_type { elem_type } }
		}
		return msg(str(1, name), bytesField(2, typ))
	}
	var graph []byte
	for i, p := range pairs {
		op := "Identity"
		if p.sequence {
			op = "SequenceConstruct"
		}
		node := msg(str(1, p.in), str(2, p.out), str(3, fmt.Sprint("node", i)), str(4, op))
		graph = append(graph, bytesField(1, node)...)
	}
	graph = append(graph, str(2, "identities")...)
	for _, p := range pairs {
		graph = append(graph, bytesField(11, valueInfo(p.in, p.elemType, p.dims, false))...)
	}
	for _, p := range pairs {
		graph = append(graph, bytesField(12, valueInfo(p.out, p.elemType, p.dims, p.sequence))...)
	}
	model := msg(
		varint(1, 8),                     // ir_version
		str(2, "sloserve runtime tests"), // producer_name
		bytesField(7, graph),
		bytesField(8, varint(2, 17)), // opset_import { version: 17 }
	)
	path := filepath.Join(t.TempDir(), "identity.onnx")
	if err := os.WriteFile(path, model, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestRunnerIdentityTypes(t *testing.T) {
	model := writeIdentityModel(t,
		identityPair{in: "s", out: "s_out", elemType: onnxString, dims: []any{"n"}},
		identityPair{in: "f", out: "f_out", elemType: onnxFloat, dims: []any{"m"}},
		identityPair{in: "scalar", out: "scalar_out", elemType: onnxInt64},
		identityPair{in: "flags", out: "flags_out", elemType: onnxBool, dims: []any{2, "k"}},
	)
	r := startTestRunner(t, testRunnerConfig(t, model))
	wantIn := []TensorSpec{
		{Name: "s", DataType: Bytes, Shape: []int64{-1}},
		{Name: "f", DataType: FP32, Shape: []int64{-1}},
		{Name: "scalar", DataType: Int64, Shape: []int64{}},
		{Name: "flags", DataType: Bool, Shape: []int64{2, -1}},
	}
	if !slices.EqualFunc(r.Inputs(), wantIn, specEqual) {
		t.Errorf("Inputs() = %v, want %v", r.Inputs(), wantIn)
	}

	words := []string{"I", "", "héllo wörld", "大 김", strings.Repeat("x", 1000)}
	var s []byte
	for _, w := range words {
		s = AppendBytesElement(s, []byte(w))
	}
	scalar := binary.LittleEndian.AppendUint64(nil, uint64(math.MaxInt64-41))
	flags := []byte{1, 0, 0, 1, 1, 1}
	tests := []struct {
		name   string
		inputs []Tensor
	}{
		{"values", []Tensor{
			{Name: "s", DataType: Bytes, Shape: []int64{int64(len(words))}, Data: s},
			{Name: "f", DataType: FP32, Shape: []int64{3}, Data: f32Bytes([]float32{1.5, -2, float32(math.Inf(1))})},
			{Name: "scalar", DataType: Int64, Shape: []int64{}, Data: scalar},
			{Name: "flags", DataType: Bool, Shape: []int64{2, 3}, Data: flags},
		}},
		{"empty", []Tensor{
			{Name: "s", DataType: Bytes, Shape: []int64{0}, Data: nil},
			{Name: "f", DataType: FP32, Shape: []int64{0}, Data: nil},
			{Name: "scalar", DataType: Int64, Shape: []int64{}, Data: scalar},
			{Name: "flags", DataType: Bool, Shape: []int64{2, 0}, Data: nil},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := r.Infer(t.Context(), &InferRequest{Inputs: tt.inputs})
			if err != nil {
				t.Fatal(err)
			}
			for _, in := range tt.inputs {
				out := outputNamed(t, resp, in.Name+"_out")
				if out.DataType != in.DataType || !slices.Equal(out.Shape, in.Shape) || !bytes.Equal(out.Data, in.Data) {
					t.Errorf("%s: got %s %v %q, want %s %v %q", out.Name, out.DataType, out.Shape, out.Data, in.DataType, in.Shape, in.Data)
				}
			}
		})
	}
}

func TestStartRunnerRejectsUnsupportedModel(t *testing.T) {
	tests := []struct {
		name string
		pair identityPair
		want string
	}{
		// onnxruntime_go cannot return a dynamically shaped FP16 output.
		{"dynamic FP16 output", identityPair{"h", "h_out", onnxFloat16, []any{"n"}, false}, `output "h_out" is FP16 with dynamic shape [?]`},
		{"sequence output", identityPair{"x", "seq", onnxFloat, []any{2}, true}, `output "seq" has ONNX type ONNX_TYPE_SEQUENCE; only tensors are supported`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := StartRunner(t.Context(), testRunnerConfig(t, writeIdentityModel(t, tt.pair)))
			if err == nil || !strings.Contains(err.Error(), "model unsupported: "+tt.want) {
				t.Errorf("err = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}
