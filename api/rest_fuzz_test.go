package api

import (
	"encoding/json"
	"errors"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/sloserve/sloserve/runtime"
)

// fuzzLimits keep the fuzzed decoder's allocations small.
var fuzzLimits = Limits{MaxRequestBytes: 1 << 16, MaxTensorElements: 1 << 10}

// restFuzzSeeds are realistic and broken request bodies.
var restFuzzSeeds = []string{
	`{"inputs":[{"name":"x","shape":[2,4],"datatype":"FP32","data":[[1,2,3,4],[5,6,7,8]]}]}`,
	`{"id":"a","inputs":[{"name":"x","shape":[2,4],"datatype":"FP32","data":[1,2,3,4,5,6,7,8]}],"outputs":[{"name":"y","parameters":{"binary_data":true}}]}`,
	`{"inputs":[{"name":"b","shape":[2],"datatype":"BOOL","data":[true,false]},{"name":"s","shape":[1,2],"datatype":"BYTES","data":[["a\"\u00e9","\ud83d\ude00"]]}]}`,
	`{"inputs":[{"name":"h","shape":[3],"datatype":"FP16","data":[0.1,65504,-6e-8]},{"name":"g","shape":[1],"datatype":"BF16","data":[3.14]}]}`,
	`{"inputs":[{"name":"i","shape":[4],"datatype":"INT64","data":[-9223372036854775808,9223372036854775807,1e3,4.0]},{"name":"u","shape":[1],"datatype":"UINT8","data":[255]}]}`,
	`{"inputs":[{"name":"d","shape":[],"datatype":"FP64","data":[1e300]}],"parameters":{"binary_data_output":true}}`,
	`{"inputs":[{"name":"x","shape":[1],"datatype":"UINT8","data":[300]}]}`,
	`{"inputs":[{"name":"x","shape":[1],"datatype":"INT32","data":[1.5]}]}`,
	`{"inputs":[{"name":"x","shape":[-1],"datatype":"FP32","data":[]}]}`,
	`{"inputs":[{"name":"x","shape":[9223372036854775807,2],"datatype":"FP32","data":[]}]}`,
	`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[[[[1]]]]}]}`,
	`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":["1"]}]}`,
	`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]},{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}`,
	`{"inputs":[{"name":"x","shape":[1],"datatype":"FP99","data":[1]}]}`,
	`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}],"parameters":{"timeout":250000,"priority":2}}`,
	`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}],"parameters":{"timeout":-1e30,"priority":1.5}}`,
	`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}],"parameters":{"timeout":3600000001}}`,
	`{"inputs":[`,
	`[]`,
	``,
	// Hostile: shapes far beyond the data, overflowing products, nesting
	// past encoding/json's depth limit, invalid UTF-8 in BYTES.
	`{"inputs":[{"name":"x","shape":[1,1099511627776],"datatype":"FP32","data":[1]}]}`,
	`{"inputs":[{"name":"x","shape":[100000000,10],"datatype":"FP32","data":[1]}]}`,
	`{"inputs":[{"name":"x","shape":[4294967296,4294967296],"datatype":"INT64","data":[]}]}`,
	`{"inputs":[{"name":"x","shape":[9223372036854775808],"datatype":"INT64","data":[]}]}`,
	`{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":` + strings.Repeat("[", 10001) + strings.Repeat("]", 10001) + `}]}`,
	"{\"inputs\":[{\"name\":\"s\",\"shape\":[2],\"datatype\":\"BYTES\",\"data\":[\"\xff\xfe\",\"\\ud800\"]}]}",
	`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1],"parameters":{"binary_data_size":4}}]}`,
}

// checkDecoded asserts what every decode result must satisfy: errors are
// client errors, and accepted tensors are consistent and encodable.
func checkDecoded(t *testing.T, req *restRequest, err error) {
	if err != nil {
		if !errors.Is(err, errBadRequest) && !errors.Is(err, errTooLarge) {
			t.Fatalf("error %v is neither a bad request nor too large", err)
		}
		if status, _ := statusOf(err); status != 400 && status != 413 {
			t.Fatalf("error %v gives status %d", err, status)
		}
		return
	}
	if req.timeout < 0 || req.timeout > maxRequestTimeout || req.priority < 0 {
		t.Fatalf("accepted timeout %v, priority %d", req.timeout, req.priority)
	}
	for _, in := range req.inputs {
		if !in.DataType.Valid() {
			t.Fatalf("input %q has datatype %q", in.Name, in.DataType)
		}
		n, err := runtime.ElementCount(in.Shape, fuzzLimits.MaxTensorElements)
		if err != nil {
			t.Fatalf("input %q: %v", in.Name, err)
		}
		if in.DataType == runtime.Bytes {
			if _, err := runtime.SplitBytes(in.Data, n); err != nil {
				t.Fatalf("input %q: %v", in.Name, err)
			}
		} else if int64(len(in.Data)) != n*int64(in.DataType.Size()) {
			t.Fatalf("input %q: %d bytes for %d elements of %s", in.Name, len(in.Data), n, in.DataType)
		}
	}
	// Echo the inputs back as outputs: the response must be valid JSON.
	out, _, err := appendRESTResponse(nil, "m", "1", req, req.inputs)
	if err != nil {
		t.Fatalf("encoding accepted inputs: %v", err)
	}
	if !json.Valid(out) {
		t.Fatalf("response is not JSON: %s", out)
	}
}

func FuzzDecodeInferJSON(f *testing.F) {
	for _, s := range restFuzzSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, err := decodeRESTInfer(body, -1, fuzzLimits)
		checkDecoded(t, req, err)
	})
}

func FuzzDecodeInferBinary(f *testing.F) {
	add := func(header string, bin string) {
		f.Add(int64(len(header)), []byte(header+bin))
	}
	add(`{"inputs":[{"name":"x","shape":[2,4],"datatype":"FP32","parameters":{"binary_data_size":32}}]}`,
		string(f32s(1, 2, 3, 4, 5, 6, 7, 8)))
	add(`{"inputs":[{"name":"s","shape":[2],"datatype":"BYTES","parameters":{"binary_data_size":11}},`+
		`{"name":"b","shape":[1],"datatype":"BOOL","parameters":{"binary_data_size":1}}]}`,
		"\x03\x00\x00\x00abc\x00\x00\x00\x00\x01")
	add(`{"inputs":[{"name":"x","shape":[1],"datatype":"FP64","parameters":{"binary_data_size":8}},`+
		`{"name":"j","shape":[1],"datatype":"INT8","data":[-1]}]}`, "\x00\x00\x00\x00\x00\x00\xf0\x3f")
	add(`{"inputs":[{"name":"x","shape":[2],"datatype":"BYTES","parameters":{"binary_data_size":5}}]}`, "\x09\x00\x00\x00a")
	add(`{"inputs":[{"name":"x","shape":[2,4],"datatype":"FP32","parameters":{"binary_data_size":28}}]}`, string(f32s(1, 2, 3, 4, 5, 6, 7)))
	add(`{"inputs":[]}`, "trailing")
	add(`{"inputs":[{"name":"x","shape":[100000000,10],"datatype":"FP32","parameters":{"binary_data_size":4}}]}`, "\x00\x00\x80\x3f")
	add(`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","parameters":{"binary_data_size":4000000000}}]}`, "\x00\x00\x80\x3f")
	add(`{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","parameters":{"binary_data_size":-4}}]}`, "\x00\x00\x80\x3f")
	add(`{"inputs":[{"name":"s","shape":[1],"datatype":"BYTES","parameters":{"binary_data_size":6}}]}`, "\xff\xff\xff\xff\xff\xfe")
	f.Add(int64(1<<62), []byte(`{"inputs":[]}`))
	f.Add(int64(1000), []byte(`{"inputs":[]}`))
	f.Add(int64(-1), []byte(restFuzzSeeds[0]))
	f.Fuzz(func(t *testing.T, headerLen int64, body []byte) {
		if headerLen < -1 {
			headerLen = -1 // the handler refuses other negative values before decoding
		}
		req, err := decodeRESTInfer(body, headerLen, fuzzLimits)
		checkDecoded(t, req, err)
	})
}

func FuzzAppendJSONString(f *testing.F) {
	for _, s := range []string{"", "abc", "\"\\\n\x00", "é😀", "\xff\xfe", "\u2028", "\xed\xa0\x80"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		out := appendJSONString(nil, s)
		var back string
		if err := json.Unmarshal(out, &back); err != nil {
			t.Fatalf("%q -> %s: %v", s, out, err)
		}
		if utf8.ValidString(s) && back != s {
			t.Fatalf("%q -> %s -> %q", s, out, back)
		}
		// Unescaping our own output gives back what the JSON decoder reads.
		if got := string(appendJSONUnescaped(nil, out[1:len(out)-1])); got != back {
			t.Fatalf("unescape %s: %q, want %q", out, got, back)
		}
	})
}

// FuzzRequestOptions parses the scheduling options a request carries: the
// Inference-Timeout-Ms header and the timeout and priority parameters (raw
// JSON values). Accepted values are in range and agree with the plain
// reading; refusals are bad requests.
func FuzzRequestOptions(f *testing.F) {
	for _, s := range []struct{ header, timeout, priority string }{
		{"50", "250000", "2"},
		{"0.01", "1", "0"},
		{"3600000", "3600000000", "9223372036854775807"},
		{"3600000.0000001", "3600000001", "9223372036854775808"},
		{"1e3", "1e3", "1.5"},
		{"-1", "-1", "-1"},
		{"NaN", "-0", "-0"},
		{"Inf", "null", `"2"`},
		{"0.0000001", "18446744073709551616", "1e400"},
		{".", "true", "[]"},
		{"", "", ""},
	} {
		f.Add(s.header, s.timeout, s.priority)
	}
	f.Fuzz(func(t *testing.T, header, timeout, priority string) {
		if d, problem := parseTimeoutMillis(header); problem == "" {
			ms, err := strconv.ParseFloat(header, 64)
			if err != nil || d <= 0 || d > maxRequestTimeout || strings.ContainsAny(header, "eE+-") {
				t.Fatalf("header %q accepted as %v", header, d)
			}
			if diff := math.Abs(float64(d) - ms*1e6); diff > 1 {
				t.Fatalf("header %q read as %v, %v ns off", header, d, diff)
			}
		}
		checkOption := func(err error) {
			if err != nil && !errors.Is(err, errBadRequest) {
				t.Fatalf("refusal %v is not a bad request", err)
			}
		}
		d, err := restTimeoutParam(json.RawMessage(timeout))
		checkOption(err)
		if err == nil {
			var us uint64
			if d <= 0 || d > maxRequestTimeout || d%time.Microsecond != 0 {
				t.Fatalf("timeout %q accepted as %v", timeout, d)
			}
			if json.Unmarshal([]byte(timeout), &us) == nil && time.Duration(us)*time.Microsecond != d {
				t.Fatalf("timeout %q read as %v, JSON says %d µs", timeout, d, us)
			}
		}
		p, err := restPriorityParam(json.RawMessage(priority))
		checkOption(err)
		if err == nil {
			var want uint64
			if p < 0 {
				t.Fatalf("priority %q accepted as %d", priority, p)
			}
			if json.Unmarshal([]byte(priority), &want) == nil && uint64(p) != want {
				t.Fatalf("priority %q read as %d, JSON says %d", priority, p, want)
			}
		}
	})
}
