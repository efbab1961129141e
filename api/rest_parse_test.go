package api

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

// The fast float parsers agree with strconv on every token they accept,
// and accept the numbers clients write.
func TestParseFloatFast(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	var toks []string
	for range 200000 {
		f := math.Float64frombits(rng.Uint64())
		if rng.IntN(2) == 0 {
			f = rng.NormFloat64() * math.Pow(10, float64(rng.IntN(20)-10))
		}
		prec := rng.IntN(20) - 1
		toks = append(toks,
			strconv.FormatFloat(f, 'g', prec, 64),
			strconv.FormatFloat(f, 'f', rng.IntN(12), 64),
			strconv.FormatFloat(float64(float32(f)), 'g', -1, 32),
			strconv.FormatFloat(f, 'e', prec, 64))
	}
	// Decimals exactly halfway between two float32s, and next to them.
	for range 20000 {
		b := rng.Uint32()>>2 | 1<<29
		lo, hi := math.Float32frombits(b), math.Float32frombits(b+1)
		mid := (float64(lo) + float64(hi)) / 2
		s := strconv.FormatFloat(mid, 'e', -1, 64)
		toks = append(toks, s, strconv.FormatFloat(mid, 'e', 16, 64), strconv.FormatFloat(math.Nextafter(mid, 0), 'e', -1, 64))
	}
	toks = append(toks, "0", "-0", "0.0", "-0.0e5", "1", "-1", "1e22", "1e23", "1e-22", "1e-23", "9007199254740992",
		"9007199254740993", "3.4028235e38", "3.4028236e38", "1e-45", "1.1754944e-38", "1.17549435e-38", "123456789012345678901",
		"0.000000000000000000001", "1e0000", "4.0", "65504", "0.1", "-", "1e", "1.", ".5", "01", "1e+", "+1", "1x")
	accepted := 0
	for _, tok := range toks {
		if f, ok := parseFloat64Fast([]byte(tok)); ok {
			accepted++
			want, err := strconv.ParseFloat(tok, 64)
			if err != nil || math.Float64bits(f) != math.Float64bits(want) {
				t.Fatalf("parseFloat64Fast(%q) = %v, strconv %v (%v)", tok, f, want, err)
			}
		}
		if f, ok := parseFloat32Fast([]byte(tok)); ok {
			want, err := strconv.ParseFloat(tok, 32)
			if err != nil || math.Float32bits(f) != math.Float32bits(float32(want)) {
				t.Fatalf("parseFloat32Fast(%q) = %v, strconv %v (%v)", tok, f, float32(want), err)
			}
		}
	}
	if accepted < len(toks)/3 {
		t.Errorf("accepted %d of %d tokens", accepted, len(toks))
	}
	// What the load generator and numpy write is taken fast, and what
	// Python's json.dumps writes for a float32 (tritonclient): the float64
	// it equals, in up to 17 digits.
	for _, tok := range []string{"0.123456789", "-0.87654321", "1.5e-07", "255", "0.0039215689",
		"0.12345679104328156", "-0.8765432238578796", "1.1920928955078125e-07", "3.3999999521443642e+38", "1.0000000031710769e-30", "1e-05"} {
		if _, ok := parseFloat32Fast([]byte(tok)); !ok {
			t.Errorf("parseFloat32Fast(%q) refused", tok)
		}
	}
}

// parseFloat32Fast gives strconv's float32 for every token it takes, those
// of 18 to 19 digits and exponents past 22 (rounded more than once) near
// float32 midpoints above all, and takes every float32 as Python writes it.
func TestParseFloat32FastRounded(t *testing.T) {
	rng := rand.New(rand.NewPCG(33, 34))
	check := func(tok string) bool {
		f, ok := parseFloat32Fast([]byte(tok))
		if !ok {
			return false
		}
		want, err := strconv.ParseFloat(tok, 32)
		if err != nil || math.Float32bits(f) != math.Float32bits(float32(want)) {
			t.Fatalf("parseFloat32Fast(%q) = %v (%#x), strconv %v (%#x, %v)", tok, f, math.Float32bits(f), float32(want), math.Float32bits(float32(want)), err)
		}
		return true
	}
	refusedPy := 0
	for range 300000 {
		// A float32 of any normal magnitude, as Python writes it.
		b := rng.Uint32()&^(0xff<<23) | uint32(1+rng.IntN(254))<<23
		v := math.Float32frombits(b)
		if !check(strconv.FormatFloat(float64(v), 'g', -1, 64)) && math.Abs(float64(v)) >= 1e-30 && math.Abs(float64(v)) <= 1e30 {
			refusedPy++
		}
		// A float32 midpoint and its float64 neighbours, in 17 to 19
		// digits: the numbers double rounding gets wrong.
		next := math.Float32frombits(b + 1)
		mid := (float64(v) + float64(next)) / 2
		for _, x := range []float64{mid, math.Nextafter(mid, 0), math.Nextafter(mid, math.Inf(1)),
			math.Nextafter(math.Nextafter(mid, 0), 0)} {
			for _, prec := range []int{16, 17, 18} {
				check(strconv.FormatFloat(x, 'e', prec, 64))
			}
		}
		// Decimals just off a midpoint by less than float64 resolves.
		digits := strconv.FormatFloat(mid, 'e', 18, 64)
		e := strings.IndexByte(digits, 'e')
		for _, d := range []string{"1", "9"} {
			check(digits[:e-1] + d + digits[e:])
		}
	}
	if refusedPy > 0 {
		t.Errorf("%d float32s as Python writes them refused", refusedPy)
	}
	for _, tok := range []string{"-0", "-0.0", "0e44", "1e44", "-1e-44", "9999999999999999999e-44", "1e-66", "1e66", "1e67", "3.4028234663852886e+38", "1e39", "1e-46", "3.4028235677973366e+38",
		"1.401298464324817e-45", "1.1754943508222875e-38", "0.10000000149011611938"} {
		check(tok)
	}
}

// parseRESTFast either reads a body exactly as encoding/json does (with no
// duplicate key) or gives up; the seeds and mutations of them cover both.
func TestParseRESTFastMatchesEncodingJSON(t *testing.T) {
	bodies := append([]string{}, restFuzzSeeds...)
	bodies = append(bodies, string(restWakewordBody()),
		`{"id":"x","parameters":{"binary_data_output":true,"timeout":5},"inputs":[],"outputs":[{"name":"y","parameters":{"binary_data":false}}]}`,
		` { "inputs" : [ { "name" : "x" , "shape" : [ 1 , 2 ] , "datatype" : "FP32" , "data" : [ 1.5 , -2e3 ] } ] } `,
		`{"inputs":[{"name":"x","shape":[1],"datatype":"BYTES","data":["a\u00e9\n"]}]}`,
		`{"inputs":[{"name":"x","Shape":[1],"datatype":"FP32","data":[1]}]}`,
		`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}],"parameters":{"a":1,"A":2}}`,
		`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}],"parameters":{"a":{"b":1,"b":2}}}`,
		`{"inputs":[{"name":"x\u0041","shape":[1],"datatype":"FP32","data":[1]}]}`,
		`{"inputs":[{"name":"x","shape":[1.0],"datatype":"FP32","data":[1]}]}`,
		`{"inputs":[{"name":"x","shape":[01],"datatype":"FP32","data":[1]}]}`,
		`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1,]}]}`,
		// Flat arrays of numbers (flatNumbers) and arrays that only start so.
		`{"inputs":[{"name":"x","shape":[3],"datatype":"FP32","data":[ 1 , -0.0 ,2E-3 ]}]}`,
		`{"inputs":[{"name":"x","shape":[0],"datatype":"FP32","data":[ ]}]}`,
		`{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1,[2]]}]}`,
		`{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1,"2"]}]}`,
		`{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1 2]}]}`,
		`{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1,-]}]}`,
		`{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1,.5]}]}`,
		`{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1,NaN]}]}`,
		`{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1,2}]}`,
		`{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1,2`,
		`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1 2]}]}`,
		`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[-]}]}`,
		`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":["\x"]}]}`,
		`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]} x`,
		`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}],}`,
	)
	rng := rand.New(rand.NewPCG(13, 14))
	fast := 0
	for _, b := range bodies {
		variants := []string{b}
		for range 300 {
			m := []byte(b)
			if len(m) == 0 {
				break
			}
			switch i := rng.IntN(len(m)); rng.IntN(3) {
			case 0:
				m = append(m[:i], m[i+1:]...)
			case 1:
				const junk = `{}[]",:0-.eE1 tfn\`
				m[i] = junk[rng.IntN(len(junk))]
			default:
				m = append(m[:i], append([]byte(m[i:i+1]), m[i:]...)...)
			}
			variants = append(variants, string(m))
		}
		for _, v := range variants {
			var got restRequestJSON
			if !parseRESTFast([]byte(v), &got) {
				continue
			}
			fast++
			var want restRequestJSON
			if err := decodeRESTStructure([]byte(v), &want); err != nil {
				t.Fatalf("parseRESTFast read %q, which encoding/json refuses: %v", v, err)
			}
			if !reflect.DeepEqual(jsonOf(t, got), jsonOf(t, want)) || !reflect.DeepEqual(got, want) {
				t.Fatalf("parseRESTFast(%q) = %s\nencoding/json gives %s", v, jsonOf(t, got), jsonOf(t, want))
			}
		}
	}
	if fast < len(bodies) {
		t.Errorf("only %d bodies read fast", fast)
	}
}

func jsonOf(t *testing.T, v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return strings.ReplaceAll(string(b), `\u0026`, "&")
}

func FuzzParseRESTFast(f *testing.F) {
	for _, s := range restFuzzSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var got restRequestJSON
		if !parseRESTFast(body, &got) {
			return
		}
		var want restRequestJSON
		if err := decodeRESTStructure(body, &want); err != nil {
			t.Fatalf("parseRESTFast read %q, which encoding/json refuses: %v", body, err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("parseRESTFast(%q) = %+v, encoding/json %+v", body, got, want)
		}
	})
}
