package runtime

import (
	"testing"

	ort "github.com/yalue/onnxruntime_go"
)

// Every datatype of the Open Inference Protocol has one row in the table,
// and each row says what the protocol, ONNX Runtime and gRPC say of it.
func TestDataTypeTable(t *testing.T) {
	for _, tc := range []struct {
		name  string
		size  int
		kind  DataKind
		ort   ort.TensorElementDataType
		proto string
	}{
		{"BOOL", 1, KindBool, ort.TensorElementDataTypeBool, "bool_contents"},
		{"UINT8", 1, KindUnsigned, ort.TensorElementDataTypeUint8, "uint_contents"},
		{"UINT16", 2, KindUnsigned, ort.TensorElementDataTypeUint16, "uint_contents"},
		{"UINT32", 4, KindUnsigned, ort.TensorElementDataTypeUint32, "uint_contents"},
		{"UINT64", 8, KindUnsigned, ort.TensorElementDataTypeUint64, "uint64_contents"},
		{"INT8", 1, KindSigned, ort.TensorElementDataTypeInt8, "int_contents"},
		{"INT16", 2, KindSigned, ort.TensorElementDataTypeInt16, "int_contents"},
		{"INT32", 4, KindSigned, ort.TensorElementDataTypeInt32, "int_contents"},
		{"INT64", 8, KindSigned, ort.TensorElementDataTypeInt64, "int64_contents"},
		{"FP16", 2, KindFloat, ort.TensorElementDataTypeFloat16, ""},
		{"FP32", 4, KindFloat, ort.TensorElementDataTypeFloat, "fp32_contents"},
		{"FP64", 8, KindFloat, ort.TensorElementDataTypeDouble, "fp64_contents"},
		{"BF16", 2, KindFloat, ort.TensorElementDataTypeBFloat16, ""},
		{"BYTES", 0, KindString, ort.TensorElementDataTypeString, "bytes_contents"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dt, ok := ParseDataType(tc.name)
			if !ok || !dt.Valid() {
				t.Fatalf("ParseDataType(%q) = %q, %v", tc.name, dt, ok)
			}
			info, ok := dt.Info()
			if !ok || info.Name != dt || dt.Size() != tc.size || info.Size != tc.size || info.Kind != tc.kind || info.GRPCContents != tc.proto {
				t.Errorf("Info() = %+v, %v; Size() %d; want size %d kind %d contents %q", info, ok, dt.Size(), tc.size, tc.kind, tc.proto)
			}
			if o := dataTypeToORT[dt]; o != tc.ort || ortElementTypes[tc.ort] != dt {
				t.Errorf("ONNX Runtime element type %d, back %q; want %d", o, ortElementTypes[tc.ort], tc.ort)
			}
			if tc.size > 0 && info.JSONMaxBytes < 2 || tc.size == 0 && info.JSONMaxBytes != 0 {
				t.Errorf("JSONMaxBytes %d", info.JSONMaxBytes)
			}
		})
	}
	if n := len(DataTypes()); n != 14 || len(dataTypeToORT) != 14 || len(ortElementTypes) != 14 {
		t.Errorf("%d datatypes, %d and %d ONNX Runtime types; want 14", n, len(dataTypeToORT), len(ortElementTypes))
	}
	for _, s := range []string{"", "fp32", "FLOAT32", "STRING", "FP8"} {
		if _, ok := ParseDataType(s); ok {
			t.Errorf("ParseDataType(%q) is ok", s)
		}
		if _, ok := DataType(s).Info(); ok || DataType(s).Size() != 0 {
			t.Errorf("DataType(%q).Info() is ok", s)
		}
	}
}
