package api

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/sloserve/sloserve/runtime"
)

func TestFP16FromFloat64(t *testing.T) {
	tests := []struct {
		name string
		f    float64
		want uint16
	}{
		{"zero", 0, 0x0000},
		{"negative zero", math.Copysign(0, -1), 0x8000},
		{"one", 1, 0x3c00},
		{"minus two", -2, 0xc000},
		{"0.1 rounds down", 0.1, 0x2e66},
		{"1/3 rounds up", 1.0 / 3, 0x3555},
		{"largest finite", 65504, 0x7bff},
		{"just below the overflow tie", 65519.99, 0x7bff},
		{"overflow tie rounds to inf", 65520, 0x7c00},
		{"huge", 1e300, 0x7c00},
		{"negative huge", -1e300, 0xfc00},
		{"inf", math.Inf(1), 0x7c00},
		{"minus inf", math.Inf(-1), 0xfc00},
		{"smallest normal", 0x1p-14, 0x0400},
		{"largest subnormal", 1023 * 0x1p-24, 0x03ff},
		{"largest subnormal rounds up to smallest normal", 1023.5 * 0x1p-24, 0x0400},
		{"smallest subnormal", 0x1p-24, 0x0001},
		{"half the smallest subnormal ties to zero", 0x1p-25, 0x0000},
		{"just above half the smallest subnormal", 0x1p-25 * (1 + 0x1p-40), 0x0001},
		{"1.5 subnormal units ties to 2", 3 * 0x1p-25, 0x0002},
		{"2.5 subnormal units ties to 2", 5 * 0x1p-25, 0x0002},
		{"negative subnormal", -0x1p-24, 0x8001},
		{"tiny", 1e-30, 0x0000},
		{"negative tiny", -1e-30, 0x8000},
		{"float64 subnormal", 5e-324, 0x0000},
		{"tie rounds to even (down)", 1 + 0x1p-11, 0x3c00},
		{"tie rounds to even (up)", 1 + 3*0x1p-11, 0x3c02},
		{"above the tie rounds up", 1 + 0x1p-11 + 0x1p-30, 0x3c01},
		{"rounding carries into the exponent", 2 - 0x1p-12, 0x4000},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := fp16FromFloat64(tc.f); got != tc.want {
				t.Fatalf("fp16FromFloat64(%g) = %#04x, want %#04x", tc.f, got, tc.want)
			}
		})
	}
	if h := fp16FromFloat64(math.NaN()); h&0x7c00 != 0x7c00 || h&0x03ff == 0 {
		t.Fatalf("NaN gives %#04x", h)
	}
}

func TestBF16FromFloat64(t *testing.T) {
	tests := []struct {
		name string
		f    float64
		want uint16
	}{
		{"zero", 0, 0x0000},
		{"negative zero", math.Copysign(0, -1), 0x8000},
		{"one", 1, 0x3f80},
		{"0.1 rounds up", 0.1, 0x3dcd},
		{"pi", math.Pi, 0x4049},
		{"largest finite", 0x1.fep127, 0x7f7f},
		{"float32 max rounds to inf", math.MaxFloat32, 0x7f80},
		{"inf", math.Inf(1), 0x7f80},
		{"minus inf", math.Inf(-1), 0xff80},
		{"smallest normal", 0x1p-126, 0x0080},
		{"smallest subnormal", 0x1p-133, 0x0001},
		{"half the smallest subnormal ties to zero", 0x1p-134, 0x0000},
		{"three halves of the smallest subnormal tie to 2", 3 * 0x1p-134, 0x0002},
		{"tie rounds to even (down)", 1 + 0x1p-8, 0x3f80},
		{"tie rounds to even (up)", 1 + 3*0x1p-8, 0x3f82},
		// Via float32 this would round twice: first to the tie 1+2^-8, then
		// to even 0x3f80.
		{"no double rounding", 1 + 0x1p-8 + 0x1p-30, 0x3f81},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := bf16FromFloat64(tc.f); got != tc.want {
				t.Fatalf("bf16FromFloat64(%g) = %#04x, want %#04x", tc.f, got, tc.want)
			}
		})
	}
	if h := bf16FromFloat64(math.NaN()); h&0x7f80 != 0x7f80 || h&0x007f == 0 {
		t.Fatalf("NaN gives %#04x", h)
	}
}

// halfFormat is one 16-bit float format under test.
type halfFormat struct {
	name   string
	from   func(float64) uint16
	to     func(uint16) float64
	quiet  uint16 // the quiet NaN bit
	expAll uint16 // the exponent field mask
}

var halfFormats = []halfFormat{
	{"FP16", fp16FromFloat64, fp16ToFloat64, 0x0200, 0x7c00},
	{"BF16", bf16FromFloat64, bf16ToFloat64, 0x0040, 0x7f80},
}

// TestHalfRoundTripAllBits converts every bit pattern to float64 and back.
func TestHalfRoundTripAllBits(t *testing.T) {
	for _, hf := range halfFormats {
		t.Run(hf.name, func(t *testing.T) {
			for i := range 1 << 16 {
				h := uint16(i)
				f := hf.to(h)
				back := hf.from(f)
				isNaN := h&hf.expAll == hf.expAll && h&^(hf.expAll|0x8000) != 0
				if isNaN {
					if !math.IsNaN(f) || back != h|hf.quiet {
						t.Fatalf("NaN %#04x -> %g -> %#04x", h, f, back)
					}
					continue
				}
				if back != h {
					t.Fatalf("%#04x -> %g -> %#04x", h, f, back)
				}
			}
		})
	}
}

// TestHalfRoundsToNearest checks random float64 values against their
// neighbours: the result is the nearest value, ties to an even pattern.
func TestHalfRoundsToNearest(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, hf := range halfFormats {
		t.Run(hf.name, func(t *testing.T) {
			maxFinite := hf.to(hf.expAll - 1)
			for range 200000 {
				// Values across the whole range, subnormals included, with
				// exact ties now and then.
				var f float64
				switch rng.IntN(3) {
				case 0:
					f = math.Ldexp(rng.Float64(), rng.IntN(300)-150)
				case 1: // halfway between two neighbours
					h := uint16(rng.IntN(int(hf.expAll - 1)))
					f = (hf.to(h) + hf.to(h+1)) / 2
				default:
					f = hf.to(uint16(rng.IntN(int(hf.expAll))))
				}
				if rng.IntN(2) == 0 {
					f = -f
				}
				h := hf.from(f)
				mag := h & 0x7fff
				if math.Abs(f) > maxFinite {
					if mag != hf.expAll && math.Abs(f) >= maxFinite+(maxFinite-hf.to(hf.expAll-2))/2 {
						t.Fatalf("%g -> %#04x, want inf", f, h)
					}
					continue
				}
				got := math.Abs(hf.to(h))
				a := math.Abs(f)
				for _, nb := range []uint16{mag - 1, mag + 1} {
					if mag == 0 && nb == 0xffff || nb >= hf.expAll {
						continue
					}
					d, dn := math.Abs(a-got), math.Abs(a-hf.to(nb))
					if dn < d || dn == d && mag&1 == 1 {
						t.Fatalf("%g -> %#04x (%g), but %#04x (%g) is nearer or even", f, h, hf.to(h), nb, hf.to(nb))
					}
				}
			}
		})
	}
}

func TestAppendJSONHalf(t *testing.T) {
	tests := []struct {
		dt   runtime.DataType
		f    float64
		want string
	}{
		{runtime.FP16, 0.1, "0.1"},
		{runtime.FP16, 1, "1"},
		{runtime.FP16, -1.5, "-1.5"},
		{runtime.FP16, 65504, "65500"}, // the shortest decimal that rounds to it, as numpy prints
		{runtime.FP16, 2048, "2048"},
		{runtime.FP16, 0x1p-24, "6e-8"},
		{runtime.FP16, math.Copysign(0, -1), "-0"},
		{runtime.FP16, math.Inf(1), "null"},
		{runtime.FP16, math.NaN(), "null"},
		{runtime.BF16, 0.1, "0.1"},
		{runtime.BF16, 1e10, "10000000000"},
		{runtime.BF16, 1e30, "1e+30"},
		{runtime.BF16, math.Pi, "3.14"},
		{runtime.BF16, math.Inf(-1), "null"},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%s/%g", tc.dt, tc.f), func(t *testing.T) {
			h := fp16FromFloat64(tc.f)
			if tc.dt == runtime.BF16 {
				h = bf16FromFloat64(tc.f)
			}
			if got := string(appendJSONHalf(nil, tc.dt, h)); got != tc.want {
				t.Fatalf("got %s, want %s", got, tc.want)
			}
		})
	}
}

// TestAppendJSONHalfShortest checks every finite pattern: the text reads back
// as the same pattern and no shorter significand would.
func TestAppendJSONHalfShortest(t *testing.T) {
	for _, hf := range halfFormats {
		dt := runtime.DataType(hf.name)
		t.Run(hf.name, func(t *testing.T) {
			for i := range 1 << 16 {
				h := uint16(i)
				if h&hf.expAll == hf.expAll {
					continue
				}
				text := appendJSONHalf(nil, dt, h)
				var f float64
				if err := json.Unmarshal(text, &f); err != nil {
					t.Fatalf("%#04x: %s is not JSON: %v", h, text, err)
				}
				if back := hf.from(f); back != h {
					t.Fatalf("%#04x -> %s -> %#04x", h, text, back)
				}
			}
		})
	}
}

// TestAppendJSONFloat compares the float encoding with encoding/json's.
func TestAppendJSONFloat(t *testing.T) {
	vals := []float64{0, 1, -1, 0.1, 1.0 / 3, 1e-6, 9.99e-7, 1e-7, 1e20, 1e21, 123456789, 1e300, 5e-324,
		math.MaxFloat64, math.SmallestNonzeroFloat64, math.MaxFloat32, -2.5e-10, 100000000}
	rng := rand.New(rand.NewPCG(3, 4))
	for range 2000 {
		vals = append(vals, math.Float64frombits(rng.Uint64()))
	}
	for _, v := range vals {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			if got := string(appendJSONFloat(nil, v, 64)); got != "null" {
				t.Fatalf("%v: %s", v, got)
			}
			continue
		}
		want, _ := json.Marshal(v)
		if got := appendJSONFloat(nil, v, 64); string(got) != string(want) {
			t.Fatalf("float64 %v: %s, want %s", v, got, want)
		}
		f32 := float32(v)
		if math.IsInf(float64(f32), 0) {
			continue
		}
		want, _ = json.Marshal(f32)
		if got := appendJSONFloat(nil, float64(f32), 32); string(got) != string(want) {
			t.Fatalf("float32 %v: %s, want %s", f32, got, want)
		}
	}
}

func TestAppendJSONString(t *testing.T) {
	tests := []string{
		"", "plain", `quote " backslash \ slash /`, "\n\r\t\b\f\x00\x1f\x7f", "héllo wörld", "日本語", "😀",
		"\u2028\u2029", "bad \xff byte", "truncated \xe6\x97", "\xed\xa0\x80 surrogate", "<html>&",
	}
	for _, s := range tests {
		t.Run(fmt.Sprintf("%q", s), func(t *testing.T) {
			got := appendJSONString(nil, s)
			if !json.Valid(got) {
				t.Fatalf("%s is not valid JSON", got)
			}
			var back, want string
			if err := json.Unmarshal(got, &back); err != nil {
				t.Fatal(err)
			}
			ref, _ := json.Marshal(s)
			_ = json.Unmarshal(ref, &want)
			if back != want {
				t.Fatalf("%s decodes to %q, want %q", got, back, want)
			}
			if b := appendJSONString(nil, []byte(s)); string(b) != string(got) {
				t.Fatalf("[]byte gives %s, string %s", b, got)
			}
		})
	}
}

func TestAppendJSONUnescaped(t *testing.T) {
	tests := []string{
		`plain`, `\"\\\/\b\f\n\r\t`, `\u00e9\u0041`, `\ud83d\ude00`, `\ud83d`, `\ud83dx`, `\ude00`,
		`\ud83d\u0041`, `a\u0000b`, `héllo`,
	}
	for _, s := range tests {
		t.Run(s, func(t *testing.T) {
			var want string
			if err := json.Unmarshal([]byte(`"`+s+`"`), &want); err != nil {
				t.Fatal(err)
			}
			if got := string(appendJSONUnescaped(nil, []byte(s))); got != want {
				t.Fatalf("got %q, want %q", got, want)
			}
		})
	}
}

func TestParseJSONInteger(t *testing.T) {
	tests := []struct {
		tok     string
		neg     bool
		mag     uint64
		wantErr error
	}{
		{"0", false, 0, nil},
		{"-0", true, 0, nil},
		{"42", false, 42, nil},
		{"-42", true, 42, nil},
		{"18446744073709551615", false, math.MaxUint64, nil},
		{"18446744073709551616", false, 0, errIntRange},
		{"99999999999999999999", false, 0, errIntRange},
		{"4.0", false, 4, nil},
		{"-1e3", true, 1000, nil},
		{"1E2", false, 100, nil},
		{"1.5", false, 0, errNotInteger},
		{"1e-1", false, 0, errNotInteger},
		{"1e20", false, 0, errIntRange},
		{"1e400", false, 0, errIntRange},
		{"-", false, 0, errNotInteger},
	}
	for _, tc := range tests {
		t.Run(tc.tok, func(t *testing.T) {
			neg, mag, err := parseJSONInteger([]byte(tc.tok))
			if err != tc.wantErr {
				t.Fatalf("error %v, want %v", err, tc.wantErr)
			}
			if err == nil && (neg != tc.neg || mag != tc.mag) {
				t.Fatalf("got %v %d %v, want %v %d", neg, mag, err, tc.neg, tc.mag)
			}
		})
	}
}

func TestJSONDataScanner(t *testing.T) {
	tests := []struct {
		raw      string
		maxDepth int
		want     string // the tokens joined by |, or the error
	}{
		{`[]`, 1, ""},
		{`[1,2,3]`, 1, "1|2|3"},
		{` [ [1 , 2] ,[3],[ ] ,[[4]]] `, 3, "1|2|3|4"},
		{`["a,]b","\"[",true,null]`, 1, `"a,]b"|"\"["|true|null`},
		{`[[1]]`, 1, "error: data nests arrays more than 1 deep"},
		{`5`, 1, "error: data must be an array"},
		{`[1,[2`, 2, "error: data ends inside an array"},
		{`["abc`, 1, "error: data ends inside an array"},
		{`[{"a":1}]`, 1, "error: data holds an object"},
	}
	for _, tc := range tests {
		t.Run(tc.raw, func(t *testing.T) {
			s := jsonDataScanner{buf: []byte(tc.raw), maxDepth: tc.maxDepth}
			var toks []string
			err := s.start()
			for err == nil {
				var tok []byte
				var ok bool
				tok, ok, err = s.next()
				if !ok {
					break
				}
				toks = append(toks, string(tok))
			}
			got := strings.Join(toks, "|")
			if err != nil {
				got = "error: " + err.Error()
			}
			if got != tc.want {
				t.Fatalf("got %s, want %s", got, tc.want)
			}
		})
	}
}

// TestDecodeRESTInferAliasesBinary checks that binary inputs share the body
// and cannot grow into each other.
func TestDecodeRESTInferAliasesBinary(t *testing.T) {
	header := `{"inputs":[{"name":"a","datatype":"UINT8","shape":[2],"parameters":{"binary_data_size":2}},` +
		`{"name":"b","datatype":"UINT8","shape":[1],"parameters":{"binary_data_size":1}}]}`
	body := []byte(header + "\x01\x02\x03")
	req, err := decodeRESTInfer(body, int64(len(header)), restLimits)
	if err != nil {
		t.Fatal(err)
	}
	a, b := req.inputs[0].Data, req.inputs[1].Data
	if string(a) != "\x01\x02" || string(b) != "\x03" || &a[0] != &body[len(header)] || cap(a) != 2 {
		t.Fatalf("a % x (cap %d), b % x", a, cap(a), b)
	}
}

// restBenchBody is a sum-model request body holding rows*4 FP32 values.
func restBenchBody(rows int) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, `{"id":"bench","inputs":[{"name":"x","shape":[%d,4],"datatype":"FP32","data":[`, rows)
	for i := range rows * 4 {
		if i > 0 {
			sb.WriteByte(',')
		}
		fmt.Fprintf(&sb, "%g", float32(i)*0.37)
	}
	sb.WriteString(`]}]}`)
	return sb.String()
}

func BenchmarkDecodeRESTInfer(b *testing.B) {
	lim := Limits{MaxRequestBytes: 1 << 30, MaxTensorElements: 1 << 30}
	for _, rows := range []int{1, 1024} {
		body := []byte(restBenchBody(rows))
		b.Run(fmt.Sprintf("json/rows=%d", rows), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				if _, err := decodeRESTInfer(body, -1, lim); err != nil {
					b.Fatal(err)
				}
			}
		})
		header := fmt.Sprintf(`{"id":"bench","inputs":[{"name":"x","shape":[%d,4],"datatype":"FP32","parameters":{"binary_data_size":%d}}]}`,
			rows, rows*16)
		bin := append([]byte(header), make([]byte, rows*16)...)
		b.Run(fmt.Sprintf("binary/rows=%d", rows), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(bin)))
			for b.Loop() {
				if _, err := decodeRESTInfer(bin, int64(len(header)), lim); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkAppendRESTResponse(b *testing.B) {
	for _, dt := range []runtime.DataType{runtime.FP32, runtime.FP16, runtime.Int64} {
		for _, n := range []int{2, 4096} {
			data := make([]byte, n*dt.Size())
			rng := rand.New(rand.NewPCG(5, 6))
			for i := range data {
				data[i] = byte(rng.Uint32())
			}
			if dt == runtime.FP16 { // keep the values finite
				for i := 1; i < len(data); i += 2 {
					data[i] &= 0x7b
				}
			}
			outs := []runtime.Tensor{{Name: "y", DataType: dt, Shape: []int64{int64(n)}, Data: data}}
			req := &restRequest{}
			b.Run(fmt.Sprintf("%s/n=%d", dt, n), func(b *testing.B) {
				b.ReportAllocs()
				var buf []byte
				for b.Loop() {
					var err error
					if buf, _, err = appendRESTResponse(buf[:0], "sum", "1", req, outs); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// appendJSONHalfReference is the obvious search appendJSONHalf must agree
// with: format with 1, 2, ... significant digits until the text parses back
// to the same pattern.
func appendJSONHalfReference(buf []byte, dt runtime.DataType, h uint16) []byte {
	f := halfToFloat64(dt, h)
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return append(buf, "null"...)
	}
	narrow := fp16FromFloat64
	if dt == runtime.BF16 {
		narrow = bf16FromFloat64
	}
	for prec := 1; prec <= 17; prec++ {
		s := strconv.FormatFloat(f, 'e', prec-1, 64)
		g, err := strconv.ParseFloat(s, 64)
		if err == nil && narrow(g) == h {
			return appendJSONFloat(buf, g, 64)
		}
	}
	return appendJSONFloat(buf, f, 64)
}

func TestAppendJSONHalfMatchesReference(t *testing.T) {
	for _, dt := range []runtime.DataType{runtime.FP16, runtime.BF16} {
		t.Run(string(dt), func(t *testing.T) {
			for i := range 1 << 16 {
				h := uint16(i)
				got, want := appendJSONHalf(nil, dt, h), appendJSONHalfReference(nil, dt, h)
				if string(got) != string(want) {
					t.Fatalf("%#04x: %s, reference %s", h, got, want)
				}
			}
		})
	}
}

// restWakewordBody is a request like the demo wake-word model's: 25x96 FP32
// values in [-1, 1), written with the fewest digits, as the load generator
// writes them.
func restWakewordBody() []byte {
	rng := rand.New(rand.NewPCG(7, 8))
	b := []byte(`{"inputs":[{"name":"onnx::Flatten_0","shape":[1,25,96],"datatype":"FP32","data":[`)
	for i := range 25 * 96 {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendFloat(b, float64(float32(rng.Float64()*2-1)), 'g', -1, 32)
	}
	return append(b, `]}]}`...)
}

func BenchmarkDecodeRESTWakeword(b *testing.B) {
	body := restWakewordBody()
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, err := decodeRESTInfer(body, -1, restLimits); err != nil {
			b.Fatal(err)
		}
	}
}

// No element of a fixed-size datatype takes more JSON than the datatype
// table's JSONMaxBytes, which sizes the response's reservation.
func TestJSONMaxBytesBoundsElements(t *testing.T) {
	rng := rand.New(rand.NewPCG(15, 16))
	for _, info := range runtime.DataTypes() {
		if info.Size == 0 {
			continue
		}
		const n = 4096
		data := make([]byte, n*info.Size)
		for i := range data {
			data[i] = byte(rng.Uint32())
		}
		// The extremes: all ones (-1, the largest unsigned, a NaN), the
		// most negative integer, the smallest subnormal.
		for i := range info.Size {
			data[i] = 0xff
			data[info.Size+i] = 0
			data[2*info.Size+i] = 0
		}
		data[2*info.Size-1] = 0x80
		data[2*info.Size] = 1
		tn := runtime.Tensor{Name: "y", DataType: info.Name, Shape: []int64{n}, Data: data}
		out := appendJSONData(nil, &tn, n)
		per := int64(len(out)-2) / n
		for _, el := range strings.Split(string(out[1:len(out)-1]), ",") {
			if len(el)+1 > info.JSONMaxBytes {
				t.Errorf("%s: element %s takes %d bytes with its separator; the table says at most %d", info.Name, el, len(el)+1, info.JSONMaxBytes)
				break
			}
		}
		if per > int64(info.JSONMaxBytes) {
			t.Errorf("%s: %d bytes per element", info.Name, per)
		}
	}
}

// BenchmarkDecodeRESTWakewordPy is BenchmarkDecodeRESTWakeword with the
// values as Python's json.dumps writes float32s (tritonclient).
func BenchmarkDecodeRESTWakewordPy(b *testing.B) {
	body := []byte(restPyBody(600))
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, err := decodeRESTInfer(body, -1, restLimits); err != nil {
			b.Fatal(err)
		}
	}
}
