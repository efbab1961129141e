package api

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/sloserve/sloserve/runtime"
)

// fp32Token writes v in one of the ways clients write numbers.
func fp32Token(rng *rand.Rand, v float32) string {
	switch rng.IntN(8) {
	case 0:
		return strconv.FormatFloat(float64(v), 'g', -1, 64) // Python's json.dumps
	case 1:
		return strconv.FormatFloat(float64(v), 'e', rng.IntN(20), 64)
	case 2:
		return strconv.FormatFloat(float64(v), 'f', rng.IntN(12), 64)
	case 3:
		return strconv.FormatFloat(float64(v), 'E', rng.IntN(9), 32)
	case 4:
		return strconv.Itoa(int(v * 1000)) // integers as floats
	case 5:
		edge := []string{"0", "-0", "0.0", "-0.0", "0e0", "1e38", "3.4028235e38", "3.4028236e38", "-3.4028235e+38",
			"3.5e38", "1e39", "1e-38", "1.17549435e-38", "1e-45", "1e-46", "-1e-50", "1E5", "1e+05", "12345678901234567890",
			"123456789012345678901", "0.10000000149011611938", "4.0", "65504", "16777217", "1e22", "1e23", "1e-22", "1e-23"}
		return edge[rng.IntN(len(edge))]
	}
	return strconv.FormatFloat(float64(v), 'g', -1, 32) // the load generator
}

// decodeJSONData (its flat FP32 loop) gives the bytes and errors of the
// general element-by-element path for every FP32 data value: numbers as
// every client writes them (the shortest float32, Python's float64 repr,
// fixed and exponent forms, integers, -0, the edges of float32's range
// and beyond), and arrays the loop gives up on (nested, miscounted, a
// string).
func TestDecodeJSONDataFlatMatchesGeneral(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	seps := []string{",", ", ", " ,", ",\n  ", "\t,\r\n"}
	flat := 0
	for trial := range 20000 {
		n := rng.IntN(40)
		toks := make([]string, n)
		for i := range toks {
			v := float32(rng.NormFloat64() * math.Pow(10, float64(rng.IntN(16)-8)))
			toks[i] = fp32Token(rng, v)
		}
		sep := seps[rng.IntN(len(seps))]
		raw := "[" + strings.Join(toks, sep) + "]"
		want := int64(n)
		switch trial % 10 {
		case 0:
			want++ // a count that does not match
		case 1:
			if n > 1 {
				raw = "[[" + strings.Join(toks[:n/2], sep) + "]," + strings.Join(toks[n/2:], sep) + "]" // nested
			}
		case 2:
			if n > 0 {
				toks[rng.IntN(n)] = `"1.5"`
				raw = "[" + strings.Join(toks, sep) + "]"
			}
		case 3:
			raw = " " + raw + "\n"
		}
		got, gotErr := decodeJSONData("x", []byte(raw), runtime.FP32, want, 3)
		ref, refErr := decodeJSONDataGeneral("x", []byte(raw), runtime.FP32, want, 3)
		if fmt.Sprint(gotErr) != fmt.Sprint(refErr) || !bytes.Equal(got, ref) {
			t.Fatalf("%s (n %d):\ngot  % x, %v\nwant % x, %v", raw, want, got, gotErr, ref, refErr)
		}
		if _, ok := decodeFlatFP32([]byte(raw), want); ok {
			flat++
		}
	}
	if flat < 20000/5 {
		t.Errorf("only %d of 20000 data values decoded by the flat loop", flat)
	}
	// What clients send is all read by the flat loop.
	vs := make([]string, 2400)
	for i := range vs {
		vs[i] = strconv.FormatFloat(float64(float32(rng.Float64()*2-1)), 'g', -1, 64)
	}
	for _, raw := range []string{"[" + strings.Join(vs, ", ") + "]", "[" + strings.Join(vs, ",") + "]", "[]"} {
		n := int64(strings.Count(raw, ",") + 1)
		if raw == "[]" {
			n = 0
		}
		if _, ok := decodeFlatFP32([]byte(raw), n); !ok {
			t.Errorf("the flat loop gave up on %.60s...", raw)
		}
	}
}

// Numbers JSON does not have are refused with 400 whatever loop reads
// the data; values beyond float32's range too.
func TestRESTJSONRefusesNonNumbers(t *testing.T) {
	h, _ := newRESTTest(restLimits)
	for _, tc := range []struct{ data, want string }{
		{"NaN", "malformed JSON"},
		{"Infinity", "malformed JSON"},
		{"-Infinity", "malformed JSON"},
		{"nan", "malformed JSON"},
		{"1e39", "out of range for FP32"},
		{"-3.5e38", "out of range for FP32"},
		{`"1.5"`, "FP32 data must be numbers"},
		{"null", "null is not allowed"},
	} {
		t.Run(tc.data, func(t *testing.T) {
			rec := restCall{method: "POST", path: "/v2/models/sum/infer",
				body: `{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[1,2,3,` + tc.data + `]}]}`}.do(t, t.Context(), h)
			if rec.Code != 400 {
				t.Fatalf("status %d: %s", rec.Code, rec.Body)
			}
			if msg := restErrorBody(t, rec); !strings.Contains(msg, tc.want) {
				t.Errorf("error %q, want it to say %q", msg, tc.want)
			}
		})
	}
}
