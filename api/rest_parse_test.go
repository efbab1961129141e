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
	// What the load generator and numpy write is taken fast.
	for _, tok := range []string{"0.123456789", "-0.87654321", "1.5e-07", "255", "0.0039215689"} {
		if _, ok := parseFloat32Fast([]byte(tok)); !ok {
			t.Errorf("parseFloat32Fast(%q) refused", tok)
		}
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
