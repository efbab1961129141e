package loadtest

import (
	"bytes"
	"encoding/binary"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// inputTestHalf decodes an FP16 (bf false) or BF16 (bf true) value.
func inputTestHalf(h uint16, bf bool) float64 {
	if bf {
		return float64(math.Float32frombits(uint32(h) << 16))
	}
	exp, mant := int(h>>10&0x1f), float64(h&0x3ff)
	switch exp {
	case 0:
		return math.Ldexp(mant, -24)
	case 0x1f:
		return math.Inf(1)
	}
	return math.Ldexp(1+mant/1024, exp-15)
}

// inputTestBytes splits BYTES data into its elements.
func inputTestBytes(t *testing.T, raw []byte) []string {
	t.Helper()
	var out []string
	for len(raw) > 0 {
		if len(raw) < 4 {
			t.Fatalf("BYTES data truncated in a length prefix")
		}
		l := binary.LittleEndian.Uint32(raw)
		if int(l) > len(raw)-4 {
			t.Fatalf("BYTES element of %d bytes, %d remain", l, len(raw)-4)
		}
		out = append(out, string(raw[4:4+l]))
		raw = raw[4+l:]
	}
	return out
}

// inputTestValues decodes fixed-size data as float64s.
func inputTestValues(t *testing.T, dt string, raw []byte) []float64 {
	t.Helper()
	le := binary.LittleEndian
	size, _ := inputElementSize(dt)
	var out []float64
	for i := 0; i < len(raw); i += size {
		var v float64
		switch dt {
		case "BOOL", "UINT8":
			v = float64(raw[i])
		case "INT8":
			v = float64(int8(raw[i]))
		case "UINT16":
			v = float64(le.Uint16(raw[i:]))
		case "INT16":
			v = float64(int16(le.Uint16(raw[i:])))
		case "UINT32":
			v = float64(le.Uint32(raw[i:]))
		case "INT32":
			v = float64(int32(le.Uint32(raw[i:])))
		case "UINT64":
			v = float64(le.Uint64(raw[i:]))
		case "INT64":
			v = float64(int64(le.Uint64(raw[i:])))
		case "FP16":
			v = inputTestHalf(le.Uint16(raw[i:]), false)
		case "BF16":
			v = inputTestHalf(le.Uint16(raw[i:]), true)
		case "FP32":
			v = float64(math.Float32frombits(le.Uint32(raw[i:])))
		case "FP64":
			v = math.Float64frombits(le.Uint64(raw[i:]))
		default:
			t.Fatalf("no decoder for %s", dt)
		}
		out = append(out, v)
	}
	return out
}

func inputTestModel(inputs ...TensorMeta) *ModelMeta {
	return &ModelMeta{Name: "m", Inputs: inputs, Outputs: []TensorMeta{{Name: "out", DataType: "FP32", Shape: []int64{-1}}}}
}

func TestBuildInputsShapes(t *testing.T) {
	tests := []struct {
		name  string
		decl  []int64
		spec  []int64
		want  []int64
		error string // a substring of the error; "" when none
	}{
		{name: "fixed", decl: []int64{2, 3}, want: []int64{2, 3}},
		{name: "scalar", decl: []int64{}, want: []int64{}},
		{name: "batch dimension defaults to 1", decl: []int64{-1, 3, 4}, want: []int64{1, 3, 4}},
		{name: "dynamic dimensions from the spec", decl: []int64{-1, -1, 3}, spec: []int64{2, 5, 3}, want: []int64{2, 5, 3}},
		{name: "spec may repeat fixed dimensions", decl: []int64{2, 3}, spec: []int64{2, 3}, want: []int64{2, 3}},
		{name: "zero-sized dimension", decl: []int64{-1, 4}, spec: []int64{0, 4}, want: []int64{0, 4}},
		{name: "dynamic dimension left unset", decl: []int64{1, -1}, error: "dimension 1 of shape [1 -1] is dynamic"},
		{name: "rank differs", decl: []int64{-1, 3}, spec: []int64{1, 3, 1}, error: "rank 3"},
		{name: "fixed dimension differs", decl: []int64{-1, 3}, spec: []int64{4, 2}, error: "dimension 1 must be 3"},
		{name: "negative dimension", decl: []int64{-1, 3}, spec: []int64{-1, 3}, error: "dimension 0 is negative"},
		{name: "element count overflows", decl: []int64{-1, -1, -1}, spec: []int64{1 << 31, 1 << 31, 1 << 2},
			error: "more elements than an int64"},
		{name: "over 1 GiB", decl: []int64{-1, 1024}, spec: []int64{1<<18 + 1, 1024}, error: "more than the 1073741824 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			const dt = "FP32"
			md := inputTestModel(TensorMeta{Name: "x", DataType: dt, Shape: tt.decl})
			specs := map[string]InputSpec{}
			if tt.spec != nil {
				specs["x"] = InputSpec{Shape: tt.spec, Data: "zeros"}
			}
			got, err := BuildInputs(md, specs, 1)
			if tt.error != "" {
				if err == nil || !strings.Contains(err.Error(), tt.error) {
					t.Fatalf("error %v, want one containing %q", err, tt.error)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != 1 || !slices.Equal(got[0].Shape, tt.want) || got[0].Shape == nil {
				t.Fatalf("shape %v, want %v", got[0].Shape, tt.want)
			}
			n := int64(1)
			for _, d := range tt.want {
				n *= d
			}
			size, _ := inputElementSize(dt)
			if int64(len(got[0].Raw)) != n*int64(size) {
				t.Fatalf("%d bytes, want %d", len(got[0].Raw), n*int64(size))
			}
		})
	}
}

func TestBuildInputsErrors(t *testing.T) {
	dir := t.TempDir()
	short := filepath.Join(dir, "short.bin")
	if err := os.WriteFile(short, make([]byte, 23), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name  string
		decl  TensorMeta
		specs map[string]InputSpec
		error string
	}{
		{name: "unknown input", decl: TensorMeta{Name: "x", DataType: "FP32", Shape: []int64{2}},
			specs: map[string]InputSpec{"y": {}}, error: `has no input "y"`},
		{name: "unsupported datatype", decl: TensorMeta{Name: "x", DataType: "FP8", Shape: []int64{2}},
			error: `unsupported datatype "FP8"`},
		{name: "unknown data", decl: TensorMeta{Name: "x", DataType: "FP32", Shape: []int64{2}},
			specs: map[string]InputSpec{"x": {Data: "twos"}}, error: `unknown data "twos"`},
		{name: "file size mismatch", decl: TensorMeta{Name: "x", DataType: "FP32", Shape: []int64{2, 3}},
			specs: map[string]InputSpec{"x": {File: short}}, error: "has 23 bytes; shape [2 3] of FP32 needs 24"},
		{name: "missing file", decl: TensorMeta{Name: "x", DataType: "FP32", Shape: []int64{2, 3}},
			specs: map[string]InputSpec{"x": {File: filepath.Join(dir, "none")}}, error: "no such file"},
		{name: "file and data", decl: TensorMeta{Name: "x", DataType: "FP32", Shape: []int64{2, 3}},
			specs: map[string]InputSpec{"x": {File: short, Data: "ones"}}, error: "both data"},
		{name: "BYTES from a file", decl: TensorMeta{Name: "x", DataType: "BYTES", Shape: []int64{2}},
			specs: map[string]InputSpec{"x": {File: short}}, error: "BYTES inputs cannot be read from a file"},
		{name: "BYTES over 1 GiB at worst", decl: TensorMeta{Name: "x", DataType: "BYTES", Shape: []int64{-1}},
			specs: map[string]InputSpec{"x": {Shape: []int64{1 << 26}}}, error: "more than the 1073741824 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := BuildInputs(inputTestModel(tt.decl), tt.specs, 1)
			if err == nil || !strings.Contains(err.Error(), tt.error) {
				t.Fatalf("error %v, want one containing %q", err, tt.error)
			}
		})
	}
	if _, err := BuildInputs(nil, nil, 1); err == nil {
		t.Error("no error for nil metadata")
	}
}

var inputTestDataTypes = []struct {
	dt   string
	size int
}{
	{"BOOL", 1}, {"UINT8", 1}, {"UINT16", 2}, {"UINT32", 4}, {"UINT64", 8},
	{"INT8", 1}, {"INT16", 2}, {"INT32", 4}, {"INT64", 8},
	{"FP16", 2}, {"BF16", 2}, {"FP32", 4}, {"FP64", 8},
}

func TestBuildInputsData(t *testing.T) {
	for _, tc := range inputTestDataTypes {
		for _, data := range []string{"", "random", "zeros", "ones"} {
			t.Run(tc.dt+"/"+data, func(t *testing.T) {
				md := inputTestModel(TensorMeta{Name: "x", DataType: tc.dt, Shape: []int64{-1, 50, 20}})
				specs := map[string]InputSpec{"x": {Data: data}}
				got, err := BuildInputs(md, specs, 7)
				if err != nil {
					t.Fatal(err)
				}
				x := got[0]
				if x.Name != "x" || x.DataType != tc.dt || len(x.Raw) != 1000*tc.size {
					t.Fatalf("got %s %s with %d bytes, want x %s with %d", x.Name, x.DataType, len(x.Raw), tc.dt, 1000*tc.size)
				}
				vals := inputTestValues(t, tc.dt, x.Raw)
				distinct := map[float64]bool{}
				for i, v := range vals {
					distinct[v] = true
					switch data {
					case "zeros":
						if v != 0 {
							t.Fatalf("element %d is %v, want 0", i, v)
						}
					case "ones":
						if v != 1 {
							t.Fatalf("element %d is %v, want 1", i, v)
						}
					default:
						limit := 1.0
						if !strings.HasPrefix(tc.dt, "FP") && tc.dt != "BF16" {
							limit = inputRandomIntLimit
						}
						if tc.dt == "BOOL" {
							limit = 2
						}
						if v < 0 || v >= limit || math.IsNaN(v) {
							t.Fatalf("element %d is %v, want it in [0, %v)", i, v, limit)
						}
					}
				}
				if (data == "" || data == "random") && len(distinct) < 2 {
					t.Fatalf("random data has %d distinct values", len(distinct))
				}

				again, err := BuildInputs(md, specs, 7)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(again[0].Raw, x.Raw) {
					t.Error("the same seed made different data")
				}
				other, err := BuildInputs(md, specs, 8)
				if err != nil {
					t.Fatal(err)
				}
				if random := data == "" || data == "random"; random == bytes.Equal(other[0].Raw, x.Raw) {
					t.Errorf("another seed made equal data: %v; want %v", !random, random)
				}
			})
		}
	}
}

func TestBuildInputsHalfFractions(t *testing.T) {
	// Every value random data can take converts exactly.
	for k := range uint32(1 << 11) {
		if got, want := inputTestHalf(inputHalfFraction(k, 11, 15, 10), false), float64(k)/2048; got != want {
			t.Fatalf("FP16 %d/2048 = %v", k, got)
		}
	}
	for k := range uint32(1 << 8) {
		if got, want := inputTestHalf(inputHalfFraction(k, 8, 127, 7), true), float64(k)/256; got != want {
			t.Fatalf("BF16 %d/256 = %v", k, got)
		}
	}
}

func TestBuildInputsBytes(t *testing.T) {
	md := inputTestModel(TensorMeta{Name: "s", DataType: "BYTES", Shape: []int64{-1, 3}})
	for _, tc := range []struct{ data, elem string }{{"zeros", "0"}, {"ones", "1"}} {
		got, err := BuildInputs(md, map[string]InputSpec{"s": {Data: tc.data}}, 1)
		if err != nil {
			t.Fatal(err)
		}
		want := bytes.Repeat([]byte{1, 0, 0, 0, tc.elem[0]}, 3)
		if !bytes.Equal(got[0].Raw, want) {
			t.Errorf("%s: raw %v, want %v", tc.data, got[0].Raw, want)
		}
	}

	got, err := BuildInputs(md, map[string]InputSpec{"s": {Shape: []int64{40, 3}}}, 1)
	if err != nil {
		t.Fatal(err)
	}
	elems := inputTestBytes(t, got[0].Raw)
	if len(elems) != 120 {
		t.Fatalf("%d elements, want 120", len(elems))
	}
	lengths := map[int]bool{}
	for _, e := range elems {
		lengths[len(e)] = true
		if len(e) < 1 || len(e) > inputMaxRandomString || strings.Trim(e, inputRandomChars) != "" {
			t.Fatalf("element %q: want 1 to %d letters and digits", e, inputMaxRandomString)
		}
	}
	if len(lengths) < 2 {
		t.Errorf("random elements all have the same length")
	}
}

func TestBuildInputsFile(t *testing.T) {
	want := make([]byte, 2*3*8)
	for i := range want {
		want[i] = byte(i)
	}
	name := filepath.Join(t.TempDir(), "x.bin")
	if err := os.WriteFile(name, want, 0o644); err != nil {
		t.Fatal(err)
	}
	md := inputTestModel(
		TensorMeta{Name: "x", DataType: "FP64", Shape: []int64{-1, 3}},
		TensorMeta{Name: "y", DataType: "INT32", Shape: []int64{4}},
	)
	got, err := BuildInputs(md, map[string]InputSpec{"x": {Shape: []int64{2, 3}, File: name}}, 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Name != "x" || got[1].Name != "y" {
		t.Fatalf("inputs %v, want x then y", got)
	}
	if !bytes.Equal(got[0].Raw, want) {
		t.Errorf("x is %v, want the file's bytes %v", got[0].Raw, want)
	}
	if len(got[1].Raw) != 16 {
		t.Errorf("y has %d bytes, want 16", len(got[1].Raw))
	}
}

func TestBuildInputsSeedPerInput(t *testing.T) {
	// Two inputs of the same type and shape get different random data, and
	// an input's data does not depend on the other inputs' specs.
	md := inputTestModel(
		TensorMeta{Name: "a", DataType: "FP32", Shape: []int64{16}},
		TensorMeta{Name: "b", DataType: "FP32", Shape: []int64{16}},
	)
	first, err := BuildInputs(md, nil, 3)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(first[0].Raw, first[1].Raw) {
		t.Error("two inputs have the same random data")
	}
	second, err := BuildInputs(md, map[string]InputSpec{"a": {Data: "ones"}}, 3)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(first[1].Raw, second[1].Raw) {
		t.Error("b's data changed with a's spec")
	}
}

func TestFetchMetadata(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/v2/models/ocr det", "/v2/models/ocr det/versions/2":
			_, _ = w.Write([]byte(`{"name":"ocr det","versions":["1","2"],"platform":"onnxruntime_onnx",
				"inputs":[{"name":"image","datatype":"FP32","shape":[-1,3,640,640]}],
				"outputs":[{"name":"maps","datatype":"FP32","shape":[-1,1,640,640]}]}`))
		case "/v2/models/broken":
			_, _ = w.Write([]byte(`{"name":`))
		default:
			w.WriteHeader(http.StatusNotFound)
			_, _ = w.Write([]byte(`{"error":"model \"` + strings.TrimPrefix(r.URL.Path, "/v2/models/") + `\" not found"}`))
		}
	}))
	defer srv.Close()

	for _, version := range []string{"", "2"} {
		md, err := FetchMetadata(t.Context(), srv.Client(), srv.URL+"/", "ocr det", version)
		if err != nil {
			t.Fatal(err)
		}
		want := ModelMeta{
			Name:     "ocr det",
			Versions: []string{"1", "2"},
			Inputs:   []TensorMeta{{Name: "image", DataType: "FP32", Shape: []int64{-1, 3, 640, 640}}},
			Outputs:  []TensorMeta{{Name: "maps", DataType: "FP32", Shape: []int64{-1, 1, 640, 640}}},
		}
		if md.Name != want.Name || !slices.Equal(md.Versions, want.Versions) ||
			len(md.Inputs) != 1 || md.Inputs[0].Name != "image" || md.Inputs[0].DataType != "FP32" ||
			!slices.Equal(md.Inputs[0].Shape, want.Inputs[0].Shape) ||
			len(md.Outputs) != 1 || md.Outputs[0].Name != "maps" {
			t.Errorf("version %q: metadata %+v, want %+v", version, *md, want)
		}
	}

	_, err := FetchMetadata(t.Context(), nil, srv.URL, "nope", "")
	if err == nil || !strings.Contains(err.Error(), "404") || !strings.Contains(err.Error(), `model "nope" not found`) {
		t.Errorf("error %v, want the 404 and the server's message", err)
	}
	_, err = FetchMetadata(t.Context(), nil, srv.URL, "broken", "")
	if err == nil || !strings.Contains(err.Error(), "decoding") {
		t.Errorf("error %v, want a decoding error", err)
	}
}
