package api

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// restLimits are the limits the REST tests run with.
var restLimits = Limits{MaxRequestBytes: 1 << 16, MaxTensorElements: 1 << 12}

// restCall is one request to the REST handler.
type restCall struct {
	method  string
	path    string
	body    string
	headers map[string]string
}

// do serves one request on h and returns the recorded response.
func (rc restCall) do(t testing.TB, ctx context.Context, h http.Handler) *httptest.ResponseRecorder {
	t.Helper()
	method := rc.method
	if method == "" {
		method = http.MethodPost
	}
	req := httptest.NewRequestWithContext(ctx, method, rc.path, strings.NewReader(rc.body))
	for k, v := range rc.headers {
		req.Header.Set(k, v)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// newRESTTest returns a REST handler over a fresh fake backend.
func newRESTTest(lim Limits) (http.Handler, *fakeBackend) {
	fb := newFakeBackend()
	return NewREST(fb, lim, slog.New(slog.DiscardHandler)), fb
}

// restErrorBody decodes an {"error"} body, failing if it is not one.
func restErrorBody(t *testing.T, rec *httptest.ResponseRecorder) string {
	t.Helper()
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Fatalf("error Content-Type %q, want application/json", ct)
	}
	var body struct {
		Error *string `json:"error"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil || body.Error == nil {
		t.Fatalf("error body %q is not {\"error\": ...} (%v)", rec.Body, err)
	}
	return *body.Error
}

// jsonEqual reports whether two JSON texts hold the same value.
func jsonEqual(t *testing.T, got, want []byte) bool {
	t.Helper()
	var g, w any
	if err := json.Unmarshal(got, &g); err != nil {
		t.Fatalf("response %q is not JSON: %v", got, err)
	}
	if err := json.Unmarshal(want, &w); err != nil {
		t.Fatalf("expected %q is not JSON: %v", want, err)
	}
	gb, _ := json.Marshal(g)
	wb, _ := json.Marshal(w)
	return bytes.Equal(gb, wb)
}

func TestRESTRoutes(t *testing.T) {
	statsSum := `{"name":"sum","version":"1","last_inference":0,"inference_count":3,"execution_count":2,
		"inference_stats":{"success":{"count":0,"ns":0},"fail":{"count":0,"ns":0},"queue":{"count":0,"ns":0},
		"compute_input":{"count":0,"ns":0},"compute_infer":{"count":0,"ns":0},"compute_output":{"count":0,"ns":0}},
		"batch_stats":[]}`
	statsEcho := strings.NewReplacer(`"sum"`, `"echo"`, `"inference_count":3`, `"inference_count":0`,
		`"execution_count":2`, `"execution_count":0`).Replace(statsSum)
	sumMetadata := `{"name":"sum","versions":["1"],"platform":"onnxruntime_onnx",
		"inputs":[{"name":"x","datatype":"FP32","shape":[-1,4]}],
		"outputs":[{"name":"y","datatype":"FP32","shape":[-1]},{"name":"count","datatype":"INT64","shape":[-1]}]}`
	tests := []struct {
		name       string
		call       restCall
		wantStatus int
		wantBody   string // JSON compared by value; "" wants an empty body
		wantError  string // a substring of the {"error"} message
	}{
		{"live", restCall{method: "GET", path: "/v2/health/live"}, 200, "", ""},
		{"ready", restCall{method: "GET", path: "/v2/health/ready"}, 200, "", ""},
		{"server metadata", restCall{method: "GET", path: "/v2"}, 200,
			`{"name":"sloserve","version":"test","extensions":["binary_tensor_data","model_configuration","model_repository","statistics","sloserve_control"],"sloserve_limiters":{"cpu":"cgroup-v1"}}`, ""},
		{"model metadata", restCall{method: "GET", path: "/v2/models/sum"}, 200, sumMetadata, ""},
		{"model version metadata", restCall{method: "GET", path: "/v2/models/sum/versions/1"}, 200, sumMetadata, ""},
		{"metadata without tensors", restCall{method: "GET", path: "/v2/models/echo"}, 200,
			`{"name":"echo","versions":["1"],"platform":"onnxruntime_onnx","inputs":[],"outputs":[]}`, ""},
		{"metadata unknown model", restCall{method: "GET", path: "/v2/models/nope"}, 404, "", "model not found"},
		{"metadata unknown version", restCall{method: "GET", path: "/v2/models/sum/versions/2"}, 404, "", "version not found"},
		{"model ready", restCall{method: "GET", path: "/v2/models/sum/ready"}, 200, "", ""},
		{"model version ready", restCall{method: "GET", path: "/v2/models/sum/versions/1/ready"}, 200, "", ""},
		{"model not ready", restCall{method: "GET", path: "/v2/models/unready/ready"}, 400, "", `model "unready" is not ready`},
		// As Triton: an unknown model or version is not ready (400), not 404.
		{"ready unknown model", restCall{method: "GET", path: "/v2/models/nope/ready"}, 400, "", `model "nope" is not ready`},
		{"ready unknown version", restCall{method: "GET", path: "/v2/models/sum/versions/9/ready"}, 400, "", `model "sum" version "9" is not ready`},
		{"all stats", restCall{method: "GET", path: "/v2/models/stats"}, 200,
			`{"model_stats":[` + statsEcho + `,` + statsSum + `]}`, ""},
		{"model stats", restCall{method: "GET", path: "/v2/models/sum/stats"}, 200, `{"model_stats":[` + statsSum + `]}`, ""},
		{"model version stats", restCall{method: "GET", path: "/v2/models/sum/versions/1/stats"}, 200,
			`{"model_stats":[` + statsSum + `]}`, ""},
		{"model named stats", restCall{method: "GET", path: "/v2/models/stats/ready"}, 400, "", `model "stats" is not ready`},
		{"stats unknown model", restCall{method: "GET", path: "/v2/models/nope/stats"}, 404, "", "model not found"},
		{"index", restCall{path: "/v2/repository/index"}, 200,
			`[{"name":"echo","version":"1","state":"READY"},{"name":"sum","version":"1","state":"READY"},
			  {"name":"unready","version":"1","state":"UNAVAILABLE"}]`, ""},
		{"index ready", restCall{path: "/v2/repository/index", body: `{"ready":true}`}, 200,
			`[{"name":"echo","version":"1","state":"READY"},{"name":"sum","version":"1","state":"READY"}]`, ""},
		{"index not ready", restCall{path: "/v2/repository/index", body: `{"ready":false,"other":1}`}, 200,
			`[{"name":"echo","version":"1","state":"READY"},{"name":"sum","version":"1","state":"READY"},
			  {"name":"unready","version":"1","state":"UNAVAILABLE"}]`, ""},
		{"index bad body", restCall{path: "/v2/repository/index", body: `{"ready":`}, 400, "", "malformed JSON"},
		{"index wrong type", restCall{path: "/v2/repository/index", body: `{"ready":"yes"}`}, 400, "", "ready must be true or false, not string"},
		{"index duplicate key", restCall{path: "/v2/repository/index", body: `{"ready":true,"ready":false}`}, 400, "", `key "ready" appears twice`},
		{"load", restCall{path: "/v2/repository/models/unready/load"}, 200, `{}`, ""},
		{"load empty parameters", restCall{path: "/v2/repository/models/sum/load", body: `{"parameters":{}}`}, 200, `{}`, ""},
		{"load with a config", restCall{path: "/v2/repository/models/sum/load", body: `{"parameters":{"config":"{}"}}`}, 200, `{}`, ""},
		{"load with a config not a string", restCall{path: "/v2/repository/models/sum/load", body: `{"parameters":{"config":{"max_batch_size":4}}}`},
			400, "", "parameters.config must be a string"},
		{"load with a file override", restCall{path: "/v2/repository/models/sum/load", body: `{"parameters":{"config":"{}","file:1/model.onnx":"AAAA"}}`},
			400, "", `load parameter "file:1/model.onnx": file overrides are not supported`},
		{"load with other parameters", restCall{path: "/v2/repository/models/sum/load", body: `{"parameters":{"force":true}}`},
			400, "", `parameters not supported: force (a load takes only "config")`},
		{"load unknown", restCall{path: "/v2/repository/models/nope/load"}, 404, "", "model not found"},
		{"unload", restCall{path: "/v2/repository/models/sum/unload", body: `{"parameters":{"unload_dependents":true}}`},
			200, `{}`, ""},
		{"unload unknown", restCall{path: "/v2/repository/models/nope/unload"}, 404, "", "model not found"},
		{"unknown route", restCall{method: "GET", path: "/v2/nothing/here"}, 404, "", "no route"},
		{"unknown under model", restCall{method: "GET", path: "/v2/models/sum/versions/1/nothing"}, 404, "", "no route"},
		{"trailing slash", restCall{method: "GET", path: "/v2/models/sum/"}, 404, "", "no route"},
		{"wrong method infer", restCall{method: "GET", path: "/v2/models/sum/infer"}, 405, "", "method GET not allowed"},
		{"wrong method health", restCall{method: "POST", path: "/v2/health/live"}, 405, "", "not allowed"},
		{"wrong method load", restCall{method: "DELETE", path: "/v2/repository/models/sum/load"}, 405, "", "not allowed"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, _ := newRESTTest(restLimits)
			rec := tc.call.do(t, t.Context(), h)
			if rec.Code != tc.wantStatus {
				t.Fatalf("status %d, want %d; body %s", rec.Code, tc.wantStatus, rec.Body)
			}
			switch {
			case tc.wantError != "":
				if msg := restErrorBody(t, rec); !strings.Contains(msg, tc.wantError) {
					t.Fatalf("error %q, want it to contain %q", msg, tc.wantError)
				}
			case tc.wantBody == "":
				if rec.Body.Len() != 0 {
					t.Fatalf("body %q, want none", rec.Body)
				}
			default:
				if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
					t.Errorf("Content-Type %q", ct)
				}
				if !jsonEqual(t, rec.Body.Bytes(), []byte(tc.wantBody)) {
					t.Fatalf("body\n%s\nwant\n%s", rec.Body, tc.wantBody)
				}
			}
		})
	}
}

func TestRESTHealthNotReady(t *testing.T) {
	h, fb := newRESTTest(restLimits)
	fb.notLive, fb.notReady = true, true
	for _, path := range []string{"/v2/health/live", "/v2/health/ready"} {
		t.Run(path, func(t *testing.T) {
			rec := restCall{method: "GET", path: path}.do(t, t.Context(), h)
			if rec.Code != http.StatusServiceUnavailable {
				t.Fatalf("status %d, want 503", rec.Code)
			}
		})
	}
}

func TestRESTLoadUnloadChangesReadiness(t *testing.T) {
	h, _ := newRESTTest(restLimits)
	ctx := t.Context()
	steps := []struct {
		call restCall
		want int
	}{
		{restCall{method: "GET", path: "/v2/models/unready/ready"}, 400},
		{restCall{path: "/v2/repository/models/unready/load"}, 200},
		{restCall{method: "GET", path: "/v2/models/unready/ready"}, 200},
		{restCall{path: "/v2/repository/models/unready/unload"}, 200},
		{restCall{method: "GET", path: "/v2/models/unready/ready"}, 400},
	}
	for i, s := range steps {
		if rec := s.call.do(t, ctx, h); rec.Code != s.want {
			t.Fatalf("step %d %s: status %d, want %d; %s", i, s.call.path, rec.Code, s.want, rec.Body)
		}
	}
}

// restInferResponse is an inference response body as a client decodes it.
type restInferResponse struct {
	ModelName    string `json:"model_name"`
	ModelVersion string `json:"model_version"`
	ID           string `json:"id"`
	Outputs      []struct {
		Name       string          `json:"name"`
		Datatype   string          `json:"datatype"`
		Shape      []int64         `json:"shape"`
		Parameters map[string]any  `json:"parameters"`
		Data       json.RawMessage `json:"data"`
	} `json:"outputs"`
}

// decodeInferResponse splits a response by Inference-Header-Content-Length
// and decodes its JSON part; the binary part follows.
func decodeInferResponse(t *testing.T, rec *httptest.ResponseRecorder) (restInferResponse, []byte) {
	t.Helper()
	if rec.Code != http.StatusOK {
		t.Fatalf("status %d: %s", rec.Code, rec.Body)
	}
	body := rec.Body.Bytes()
	if cl := rec.Header().Get("Content-Length"); cl != strconv.Itoa(len(body)) {
		t.Fatalf("Content-Length %q, body has %d bytes", cl, len(body))
	}
	jsonPart, bin := body, []byte(nil)
	if h := rec.Header().Get(headerInferenceLength); h != "" {
		n, err := strconv.Atoi(h)
		if err != nil || n > len(body) {
			t.Fatalf("bad %s %q for %d bytes", headerInferenceLength, h, len(body))
		}
		if ct := rec.Header().Get("Content-Type"); ct != "application/octet-stream" {
			t.Errorf("binary response Content-Type %q", ct)
		}
		jsonPart, bin = body[:n], body[n:]
	} else if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Errorf("JSON response Content-Type %q", ct)
	}
	var resp restInferResponse
	if err := json.Unmarshal(jsonPart, &resp); err != nil {
		t.Fatalf("response JSON %q: %v", jsonPart, err)
	}
	return resp, bin
}

func TestRESTInferSum(t *testing.T) {
	tests := []struct {
		name    string
		path    string
		body    string
		wantID  string
		outputs map[string]string // output name -> data
	}{
		{"nested", "/v2/models/sum/infer",
			`{"inputs":[{"name":"x","shape":[2,4],"datatype":"FP32","data":[[1,2,3,4],[5,6,7,8]]}]}`,
			"", map[string]string{"y": "[10,26]", "count": "[4,4]"}},
		{"flat", "/v2/models/sum/infer",
			`{"inputs":[{"name":"x","shape":[2,4],"datatype":"FP32","data":[1,2,3,4,5,6,7,8]}]}`,
			"", map[string]string{"y": "[10,26]", "count": "[4,4]"}},
		{"data before shape, with id and extension fields", "/v2/models/sum/versions/1/infer",
			`{"id":"req-1","extra":{"a":[1,{}]},"inputs":[{"data":[[0.5,0.25,1e1,-1],[1,1,1,1]],"datatype":"FP32",
			  "shape":[2,4],"name":"x","parameters":{"custom":1}}],"parameters":{"priority":1}}`,
			"req-1", map[string]string{"y": "[9.75,4]", "count": "[4,4]"}},
		{"one output", "/v2/models/sum/infer",
			`{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}],"outputs":[{"name":"y"}]}`,
			"", map[string]string{"y": "[10]"}},
		{"empty batch", "/v2/models/sum/infer",
			`{"inputs":[{"name":"x","shape":[0,4],"datatype":"FP32","data":[]}]}`,
			"", map[string]string{"y": "[]", "count": "[]"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, _ := newRESTTest(restLimits)
			resp, bin := decodeInferResponse(t, restCall{path: tc.path, body: tc.body}.do(t, t.Context(), h))
			if resp.ModelName != "sum" || resp.ModelVersion != "1" || resp.ID != tc.wantID || len(bin) != 0 {
				t.Fatalf("response %+v, binary %d bytes", resp, len(bin))
			}
			if len(resp.Outputs) != len(tc.outputs) {
				t.Fatalf("%d outputs, want %d", len(resp.Outputs), len(tc.outputs))
			}
			for _, o := range resp.Outputs {
				if want := tc.outputs[o.Name]; string(o.Data) != want {
					t.Errorf("output %s data %s, want %s", o.Name, o.Data, want)
				}
			}
		})
	}
}

// binaryRequest builds a body of the binary tensor data extension and its
// headers.
func binaryRequest(header string, parts ...[]byte) (string, map[string]string) {
	body := header + string(bytes.Join(parts, nil))
	return body, map[string]string{headerInferenceLength: strconv.Itoa(len(header))}
}

func f32s(vals ...float32) []byte {
	var b []byte
	for _, v := range vals {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
	}
	return b
}

func i64s(vals ...int64) []byte {
	var b []byte
	for _, v := range vals {
		b = binary.LittleEndian.AppendUint64(b, uint64(v))
	}
	return b
}

func TestRESTInferBinary(t *testing.T) {
	x := f32s(1, 2, 3, 4, 5, 6, 7, 8)
	binX := `{"inputs":[{"name":"x","shape":[2,4],"datatype":"FP32","parameters":{"binary_data_size":32}}]`
	tests := []struct {
		name       string
		header     string
		parts      [][]byte
		wantJSON   map[string]string // outputs sent as JSON data
		wantBinary []string          // outputs sent in binary, in order
		wantSizes  []int             // their binary_data_size
		wantBin    []byte
	}{
		{"binary in, JSON out", binX + `}`, [][]byte{x},
			map[string]string{"y": "[10,26]", "count": "[4,4]"}, nil, nil, nil},
		{"binary in, all binary out", binX + `,"parameters":{"binary_data_output":true}}`, [][]byte{x},
			nil, []string{"y", "count"}, []int{8, 16}, append(f32s(10, 26), i64s(4, 4)...)},
		{"per-output binary", binX + `,"outputs":[{"name":"count","parameters":{"binary_data":true}},{"name":"y"}]}`,
			[][]byte{x}, map[string]string{"y": "[10,26]"}, []string{"count"}, []int{16}, i64s(4, 4)},
		{"per-output override of binary_data_output", binX +
			`,"parameters":{"binary_data_output":true},"outputs":[{"name":"y","parameters":{"binary_data":false}},{"name":"count"}]}`,
			[][]byte{x}, map[string]string{"y": "[10,26]"}, []string{"count"}, []int{16}, i64s(4, 4)},
		{"JSON in with the header, binary out",
			`{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[1,2,3,4.5]}],"outputs":[{"name":"y","parameters":{"binary_data":true}}]}`,
			nil, nil, []string{"y"}, []int{4}, f32s(10.5)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, fb := newRESTTest(restLimits)
			body, hdr := binaryRequest(tc.header, tc.parts...)
			resp, bin := decodeInferResponse(t, restCall{path: "/v2/models/sum/infer", body: body, headers: hdr}.do(t, t.Context(), h))
			if got := fb.lastReq.Inputs[0].Data; tc.parts != nil && !bytes.Equal(got, x) {
				t.Fatalf("backend got input %v", got)
			}
			var gotBinary []string
			for _, o := range resp.Outputs {
				if o.Data != nil {
					if want, ok := tc.wantJSON[o.Name]; !ok || string(o.Data) != want {
						t.Errorf("output %s data %s, want %s", o.Name, o.Data, want)
					}
					if o.Parameters != nil {
						t.Errorf("JSON output %s has parameters %v", o.Name, o.Parameters)
					}
					continue
				}
				size, _ := o.Parameters["binary_data_size"].(float64)
				if k := len(gotBinary); k >= len(tc.wantSizes) || int(size) != tc.wantSizes[k] {
					t.Errorf("output %s binary_data_size %v", o.Name, o.Parameters["binary_data_size"])
				}
				gotBinary = append(gotBinary, o.Name)
			}
			if fmt.Sprint(gotBinary) != fmt.Sprint(tc.wantBinary) {
				t.Fatalf("binary outputs %v, want %v", gotBinary, tc.wantBinary)
			}
			if !bytes.Equal(bin, tc.wantBin) {
				t.Fatalf("binary part % x, want % x", bin, tc.wantBin)
			}
		})
	}
}

func TestRESTEchoDatatypes(t *testing.T) {
	tests := []struct {
		datatype string
		shape    string
		data     string
		want     string // the output data; "" means the same as data
		wantBin  []byte // the tensor bytes, when checked
	}{
		{"BOOL", "[3]", "[true,false,true]", "", []byte{1, 0, 1}},
		{"UINT8", "[3]", "[0,255,7]", "", []byte{0, 255, 7}},
		{"UINT16", "[2]", "[0,65535]", "", []byte{0, 0, 255, 255}},
		{"UINT32", "[2]", "[0,4294967295]", "", nil},
		{"UINT64", "[2]", "[0,18446744073709551615]", "", nil},
		{"INT8", "[2]", "[-128,127]", "", []byte{0x80, 0x7f}},
		{"INT16", "[2]", "[-32768,32767]", "", []byte{0, 0x80, 0xff, 0x7f}},
		{"INT32", "[2]", "[-2147483648,2147483647]", "", nil},
		{"INT64", "[2]", "[-9223372036854775808,9223372036854775807]", "", i64s(math.MinInt64, math.MaxInt64)},
		{"INT32", "[4]", "[4.0,1e3,-0,-7]", "[4,1000,0,-7]", nil},
		{"FP16", "[7]", "[0.1,65504,-2,6e-8,0,-0,1.0009765625]", "[0.1,65500,-2,6e-8,0,-0,1.001]",
			[]byte{0x66, 0x2e, 0xff, 0x7b, 0x00, 0xc0, 0x01, 0x00, 0, 0, 0, 0x80, 0x01, 0x3c}},
		{"BF16", "[4]", "[0.1,1,-3.140625,3.3895314e38]", "[0.1,1,-3.14,3.39e+38]",
			[]byte{0xcd, 0x3d, 0x80, 0x3f, 0x49, 0xc0, 0x7f, 0x7f}},
		{"FP32", "[6]", "[0.1,-1.5,3.4028235e38,1e-7,100000000,0]", "[0.1,-1.5,3.4028235e+38,1e-7,100000000,0]", nil},
		{"FP64", "[4]", "[0.1,1e300,-2.5,5e-324]", "[0.1,1e+300,-2.5,5e-324]", nil},
		{"BYTES", "[6]", `["hello","","\u00e9é","a\"b\\c\n\t\/","\ud83d\ude00","\u2028\u0001"]`,
			`["hello","","éé","a\"b\\c\n\t/","😀","\u2028\u0001"]`,
			[]byte("\x05\x00\x00\x00hello\x00\x00\x00\x00\x04\x00\x00\x00\xc3\xa9\xc3\xa9")},
		{"FP32", "[2,2]", "[[1,2],[3,4]]", "[1,2,3,4]", nil},
		{"INT64", "[]", "[5]", "", nil},
		{"FP32", "[2,0]", "[[],[]]", "[]", nil},
	}
	for _, tc := range tests {
		t.Run(tc.datatype+tc.shape, func(t *testing.T) {
			h, fb := newRESTTest(restLimits)
			body := fmt.Sprintf(`{"inputs":[{"name":"v","datatype":%q,"shape":%s,"data":%s}]}`, tc.datatype, tc.shape, tc.data)
			resp, _ := decodeInferResponse(t, restCall{path: "/v2/models/echo/infer", body: body}.do(t, t.Context(), h))
			want := tc.want
			if want == "" {
				want = tc.data
			}
			if len(resp.Outputs) != 1 {
				t.Fatalf("%d outputs", len(resp.Outputs))
			}
			o := resp.Outputs[0]
			if o.Name != "v_out" || o.Datatype != tc.datatype || fmt.Sprint(o.Shape) != strings.ReplaceAll(tc.shape, ",", " ") {
				t.Errorf("output %s %s %v", o.Name, o.Datatype, o.Shape)
			}
			if string(o.Data) != want {
				t.Errorf("data %s, want %s", o.Data, want)
			}
			in := fb.lastReq.Inputs[0]
			if tc.wantBin != nil && !bytes.HasPrefix(in.Data, tc.wantBin) {
				t.Errorf("tensor bytes % x, want % x", in.Data, tc.wantBin)
			}

			// The same tensor back in binary gives the bytes the backend saw.
			body = strings.TrimSuffix(body, "}") + `,"parameters":{"binary_data_output":true}}`
			_, bin := decodeInferResponse(t, restCall{path: "/v2/models/echo/infer", body: body}.do(t, t.Context(), h))
			if !bytes.Equal(bin, in.Data) {
				t.Errorf("binary output % x, want % x", bin, in.Data)
			}
		})
	}
}

// TestRESTBytesInvalidUTF8 sends raw invalid UTF-8 inside a JSON string: it
// is refused (JSON text must be UTF-8). The same bytes in binary are kept as
// sent, and in a JSON response become U+FFFD.
func TestRESTBytesInvalidUTF8(t *testing.T) {
	h, fb := newRESTTest(restLimits)
	body := "{\"inputs\":[{\"name\":\"s\",\"datatype\":\"BYTES\",\"shape\":[1],\"data\":[\"ok\",\"a\xff\xfeb\"]}]}"
	body = strings.Replace(body, "[1]", "[2]", 1)
	rec := restCall{path: "/v2/models/echo/infer", body: body}.do(t, t.Context(), h)
	if msg, want := restErrorBody(t, rec), `input "s": element 1: the string is not valid UTF-8`; rec.Code != 400 || !strings.Contains(msg, want) {
		t.Errorf("invalid UTF-8 in JSON: %d %s, want 400 with %s", rec.Code, msg, want)
	}
	// An escaped unpaired surrogate is valid JSON text; it decodes to U+FFFD.
	body = `{"inputs":[{"name":"s","datatype":"BYTES","shape":[1],"data":["a\ud800b"]}]}`
	decodeInferResponse(t, restCall{path: "/v2/models/echo/infer", body: body}.do(t, t.Context(), h))
	if got := fb.lastReq.Inputs[0].Data; !bytes.Equal(got, []byte("\x05\x00\x00\x00a\xef\xbf\xbdb")) {
		t.Errorf("tensor % x", got)
	}

	elem := []byte("\x04\x00\x00\x00a\xff\xfeb")
	body, hdr := binaryRequest(`{"inputs":[{"name":"s","datatype":"BYTES","shape":[1],"parameters":{"binary_data_size":8}}]}`, elem)
	resp, _ := decodeInferResponse(t, restCall{path: "/v2/models/echo/infer", body: body, headers: hdr}.do(t, t.Context(), h))
	if got := fb.lastReq.Inputs[0].Data; !bytes.Equal(got, elem) {
		t.Errorf("tensor % x", got)
	}
	if got := string(resp.Outputs[0].Data); got != `["a\ufffd\ufffdb"]` {
		t.Errorf("data %s", got)
	}
}

func TestRESTErrors(t *testing.T) {
	big := strings.Repeat("1,", 40000)
	x8 := `"name":"x","datatype":"FP32","shape":[2,4]`
	sumInput := func(s string) string { return `{"inputs":[{` + s + `}]}` }
	bin := func(header string, parts ...[]byte) restCall {
		body, hdr := binaryRequest(header, parts...)
		return restCall{path: "/v2/models/sum/infer", body: body, headers: hdr}
	}
	sum := func(body string) restCall { return restCall{path: "/v2/models/sum/infer", body: body} }
	echo := func(datatype, shape, data string) restCall {
		return restCall{path: "/v2/models/echo/infer",
			body: fmt.Sprintf(`{"inputs":[{"name":"v","datatype":%q,"shape":%s,"data":%s}]}`, datatype, shape, data)}
	}
	tests := []struct {
		name       string
		call       restCall
		wantStatus int
		wantError  string
	}{
		{"malformed JSON", sum(`{"inputs":[`), 400, "malformed JSON"},
		{"syntax error", sum(`{"inputs":[}`), 400, "malformed JSON"},
		{"trailing comma", sum(`{"inputs":[],}`), 400, "malformed JSON"},
		{"empty body", sum(``), 400, "malformed JSON"},
		{"not an object", sum(`[1]`), 400, "must be a JSON object"},
		{"data after the object", sum(sumInput(x8+`,"data":[1,2,3,4,5,6,7,8]`) + `{}`), 400, "data after"},
		{"no inputs", sum(`{"id":"a"}`), 400, "no inputs"},
		{"duplicate key", sum(`{"id":"a","id":"b",` + sumInput(x8 + `,"data":[1,2,3,4,5,6,7,8]`)[1:]), 400, `key "id" appears twice`},
		{"duplicate key in an input", sum(sumInput(x8 + `,"data":[1,2,3,4,5,6,7,8],"shape":[8,1]`)), 400, `key "shape" appears twice`},
		{"duplicate key by case", sum(`{"inputs":[],"Inputs":[]}`), 400, `key "Inputs" appears twice`},
		{"duplicate key escaped", sum(`{"id":"a","\u0069d":"b","inputs":[]}`), 400, `key "id" appears twice`},
		{"duplicate parameter", sum(`{"parameters":{"timeout":1,"timeout":2},` + sumInput(x8 + `,"data":[1,2,3,4,5,6,7,8]`)[1:]), 400, `key "timeout" appears twice`},
		{"id not a string", sum(`{"id":7,"inputs":[]}`), 400, "id must be a string"},
		{"unknown model", restCall{path: "/v2/models/nope/infer", body: sumInput(x8 + `,"data":[1,2,3,4,5,6,7,8]`)}, 404, "model not found"},
		{"unknown version", restCall{path: "/v2/models/sum/versions/3/infer", body: sumInput(x8 + `,"data":[1,2,3,4,5,6,7,8]`)}, 404, "version not found"},
		{"unready model", restCall{path: "/v2/models/unready/infer", body: sumInput(x8 + `,"data":[1,2,3,4,5,6,7,8]`)}, 503, "not ready"},
		{"backend rejects input", sum(sumInput(`"name":"x","datatype":"FP32","shape":[2,2],"data":[1,2,3,4]`)), 400, "sum wants x FP32"},
		{"unknown output", sum(`{"inputs":[{` + x8 + `,"data":[1,2,3,4,5,6,7,8]}],"outputs":[{"name":"z"}]}`), 400, `unknown output "z"`},
		{"wrong datatype", sum(sumInput(`"name":"x","datatype":"FLOAT32","shape":[1],"data":[1]`)), 400, `unknown datatype "FLOAT32"`},
		{"lower-case datatype", sum(sumInput(`"name":"x","datatype":"fp32","shape":[1],"data":[1]`)), 400, "unknown datatype"},
		{"missing name", sum(sumInput(`"datatype":"FP32","shape":[1],"data":[1]`)), 400, "inputs[0] has no name"},
		{"missing datatype", sum(sumInput(`"name":"x","shape":[1],"data":[1]`)), 400, `input "x" has no datatype`},
		{"missing shape", sum(sumInput(`"name":"x","datatype":"FP32","data":[1]`)), 400, `input "x" has no shape`},
		{"no data", sum(sumInput(x8)), 400, "neither data nor binary_data_size"},
		{"null data", sum(sumInput(x8 + `,"data":null`)), 400, "neither data nor binary_data_size"},
		{"duplicate input", sum(`{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1]},{"name":"x","datatype":"FP32","shape":[1],"data":[1]}]}`),
			400, `input "x" appears twice`},
		{"duplicate output", sum(`{"inputs":[],"outputs":[{"name":"y"},{"name":"y"}]}`), 400, `output "y" appears twice`},
		{"output without name", sum(`{"inputs":[],"outputs":[{}]}`), 400, "outputs[0] has no name"},
		{"too few elements", sum(sumInput(x8 + `,"data":[1,2,3,4,5,6,7]`)), 400, "shape needs 8 elements but data has 7"},
		{"too many elements in data", sum(sumInput(x8 + `,"data":[[1,2,3,4],[5,6,7,8],[9]]`)), 400, "shape needs 8 elements but data has 9"},
		{"far too few elements", sum(sumInput(`"name":"x","datatype":"FP64","shape":[4000],"data":[1]`)), 400, "shape needs 4000 elements but data has 1"},
		{"negative dimension", sum(sumInput(`"name":"x","datatype":"FP32","shape":[2,-4],"data":[]`)), 400, "dimension 1 of shape [2 -4] is negative"},
		{"fractional dimension", sum(sumInput(`"name":"x","datatype":"FP32","shape":[1.5],"data":[]`)), 400, "must be an integer"},
		{"dimension overflowing int64", sum(sumInput(`"name":"x","datatype":"FP32","shape":[9223372036854775808],"data":[]`)), 400, "fits in 64 bits"},
		{"shape product overflowing int64", sum(sumInput(`"name":"x","datatype":"FP32","shape":[4294967296,4294967296],"data":[]`)), 413, "more than the 4096 elements"},
		{"too many elements", sum(sumInput(`"name":"x","datatype":"FP32","shape":[1,4097],"data":[]`)), 413, "more than the 4096 elements"},
		{"shape not an array", sum(sumInput(`"name":"x","datatype":"FP32","shape":4,"data":[]`)), 400, "shape must be an array"},
		{"data not an array", sum(sumInput(`"name":"x","datatype":"FP32","shape":[],"data":5`)), 400, "data must be an array"},
		{"deeply nested data", sum(sumInput(`"name":"x","datatype":"FP32","shape":[1],"data":[[[1]]]`)), 400, "nests arrays more than 2 deep"},
		{"hostile nesting", sum(sumInput(`"name":"x","datatype":"FP32","shape":[1],"data":` + strings.Repeat("[", 20000) + strings.Repeat("]", 20000))), 400, "malformed JSON"},
		{"object in data", echo("FP32", "[1]", `[{"a":1}]`), 400, "data holds an object"},
		{"out-of-range UINT8", echo("UINT8", "[2]", "[1,300]"), 400, "element 1: 300 is out of range for UINT8"},
		{"negative UINT32", echo("UINT32", "[1]", "[-1]"), 400, "out of range for UINT32"},
		{"out-of-range INT8", echo("INT8", "[1]", "[-129]"), 400, "out of range for INT8"},
		{"out-of-range INT64", echo("INT64", "[1]", "[9223372036854775808]"), 400, "out of range for INT64"},
		{"out-of-range UINT64", echo("UINT64", "[1]", "[18446744073709551616]"), 400, "out of range for UINT64"},
		{"huge integral float for INT64", echo("INT64", "[1]", "[1e19]"), 400, "out of range for INT64"},
		{"fractional INT32", echo("INT32", "[1]", "[1.5]"), 400, "1.5 is not an integer; INT32 data must be integers"},
		{"string for FP32", echo("FP32", "[1]", `["1.5"]`), 400, `"1.5" is a string; FP32 data must be numbers`},
		{"bool for INT32", echo("INT32", "[1]", `[true]`), 400, "is a boolean"},
		{"number for BOOL", echo("BOOL", "[1]", `[1]`), 400, "BOOL data must be true or false"},
		{"number for BYTES", echo("BYTES", "[1]", `[1]`), 400, "BYTES data must be strings"},
		{"null element", echo("FP32", "[1]", `[null]`), 400, "null is not allowed; FP32 data must be numbers"},
		{"FP32 overflow", echo("FP32", "[1]", "[1e39]"), 400, "out of range for FP32"},
		{"FP16 overflow", echo("FP16", "[1]", "[65520]"), 400, "out of range for FP16"},
		{"BF16 overflow", echo("BF16", "[1]", "[3.5e38]"), 400, "out of range for BF16"},
		{"FP64 overflow", echo("FP64", "[1]", "[1e309]"), 400, "out of range for FP64"},
		{"classification", sum(`{"inputs":[],"outputs":[{"name":"y","parameters":{"classification":3}}]}`), 400, "classification extension is not supported"},
		{"shared memory input", sum(sumInput(x8 + `,"parameters":{"shared_memory_region":"r"}`)), 400, "shared memory extension"},
		{"binary_data_output not a bool", sum(`{"inputs":[],"parameters":{"binary_data_output":1}}`), 400, "binary_data_output must be true or false"},
		{"binary_data not a bool", sum(`{"inputs":[],"outputs":[{"name":"y","parameters":{"binary_data":"yes"}}]}`), 400, "binary_data must be true or false"},
		{"negative binary_data_size", bin(sumInput(x8 + `,"parameters":{"binary_data_size":-1}`)), 400, "binary_data_size must be a non-negative integer, not -1"},
		{"binary header beyond body", restCall{path: "/v2/models/sum/infer", body: `{"inputs":[]}`,
			headers: map[string]string{headerInferenceLength: "100"}}, 400, "is 100 but the body has only 13 bytes"},
		{"binary header not a number", restCall{path: "/v2/models/sum/infer", body: `{"inputs":[]}`,
			headers: map[string]string{headerInferenceLength: "12a"}}, 400, "must be a non-negative integer"},
		{"binary header negative", restCall{path: "/v2/models/sum/infer", body: `{"inputs":[]}`,
			headers: map[string]string{headerInferenceLength: "-1"}}, 400, "must be a non-negative integer"},
		{"binary header cuts the JSON", restCall{path: "/v2/models/sum/infer", body: `{"inputs":[]}`,
			headers: map[string]string{headerInferenceLength: "5"}}, 400, "malformed JSON"},
		{"binary part longer than sizes", bin(sumInput(x8+`,"parameters":{"binary_data_size":32}`), f32s(1, 2, 3, 4, 5, 6, 7, 8, 9)),
			400, "4 bytes that no input's binary_data_size accounts for"},
		{"binary part shorter than sizes", bin(sumInput(x8+`,"parameters":{"binary_data_size":32}`), f32s(1, 2, 3, 4, 5, 6, 7)),
			400, "binary_data_size is 32 but only 28 bytes"},
		{"binary size wrong for shape", bin(sumInput(x8+`,"parameters":{"binary_data_size":28}`), f32s(1, 2, 3, 4, 5, 6, 7)),
			400, "shape [2 4] of FP32 needs 32 bytes"},
		{"binary size without header", sum(sumInput(x8 + `,"parameters":{"binary_data_size":32}`)), 400, "has no Inference-Header-Content-Length header"},
		{"binary size and data", bin(sumInput(x8+`,"data":[1,2,3,4,5,6,7,8],"parameters":{"binary_data_size":32}`), f32s(1, 2, 3, 4, 5, 6, 7, 8)),
			400, "both data and binary_data_size"},
		{"binary bytes malformed", func() restCall {
			body, hdr := binaryRequest(`{"inputs":[{"name":"s","datatype":"BYTES","shape":[2],"parameters":{"binary_data_size":6}}]}`,
				[]byte("\x01\x00\x00\x00ab"))
			return restCall{path: "/v2/models/echo/infer", body: body, headers: hdr}
		}(), 400, "BYTES"},
		{"body over the limit", sum(sumInput(`"name":"x","datatype":"FP32","shape":[40000],"data":[` + big + `1]`)), 413, "the limit is 65536"},
		{"gzip cut short", restCall{path: "/v2/models/sum/infer", body: "\x1f\x8b", headers: map[string]string{"Content-Encoding": "gzip"}},
			400, "does not decompress as Content-Encoding gzip says"},
		{"brotli", restCall{path: "/v2/models/sum/infer", body: "x", headers: map[string]string{"Content-Encoding": "br"}}, 415, `Content-Encoding "br"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, _ := newRESTTest(restLimits)
			rec := tc.call.do(t, t.Context(), h)
			if rec.Code != tc.wantStatus {
				t.Fatalf("status %d, want %d; body %s", rec.Code, tc.wantStatus, rec.Body)
			}
			msg := restErrorBody(t, rec)
			if !strings.Contains(msg, tc.wantError) {
				t.Fatalf("error %q, want it to contain %q", msg, tc.wantError)
			}
		})
	}
}

func TestRESTBackendErrors(t *testing.T) {
	tests := []struct {
		err        error
		wantStatus int
	}{
		{fmt.Errorf("%w: x has the wrong shape", models.ErrInvalidInput), 400},
		{fmt.Errorf("runner: %w", runtime.ErrUnavailable), 503},
		{models.ErrTooLarge, 413},
		{context.DeadlineExceeded, 504},
		{fmt.Errorf("%w: deadline passed 3ms ago", qos.ErrDropped), 504},
		{fmt.Errorf("%w: sum holds 64 requests", qos.ErrQueueFull), 429},
		{errors.New("boom"), 500},
	}
	for _, tc := range tests {
		t.Run(tc.err.Error(), func(t *testing.T) {
			h, fb := newRESTTest(restLimits)
			fb.inferErr = tc.err
			rec := restCall{path: "/v2/models/sum/infer",
				body: `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}`}.do(t, t.Context(), h)
			if rec.Code != tc.wantStatus {
				t.Fatalf("status %d, want %d", rec.Code, tc.wantStatus)
			}
			if msg := restErrorBody(t, rec); msg != tc.err.Error() {
				t.Fatalf("error %q, want %q", msg, tc.err)
			}
		})
	}
}

// TestRESTChunkedBodyLimit sends bodies without a Content-Length to a real
// server, so only http.MaxBytesReader can stop them.
func TestRESTChunkedBodyLimit(t *testing.T) {
	h, _ := newRESTTest(Limits{MaxRequestBytes: 256, MaxTensorElements: 1 << 12})
	srv := httptest.NewServer(h)
	defer srv.Close()
	tests := []struct {
		name       string
		body       string
		wantStatus int
	}{
		{"within the limit", `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}`, 200},
		{"over the limit", `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}],"pad":"` +
			strings.Repeat("p", 300) + `"}`, 413},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// An io.Reader the client cannot measure is sent chunked.
			body := io.MultiReader(strings.NewReader(tc.body))
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/v2/models/sum/infer", body)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := srv.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			got, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.wantStatus {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.wantStatus, got)
			}
			if tc.wantStatus == 200 && !strings.Contains(string(got), `"data":[10]`) {
				t.Fatalf("body %s", got)
			}
		})
	}
}

// TestRESTBinaryOverHTTP round-trips binary data through a real server and
// client.
func TestRESTBinaryOverHTTP(t *testing.T) {
	h, _ := newRESTTest(restLimits)
	srv := httptest.NewServer(h)
	defer srv.Close()
	header := `{"inputs":[{"name":"x","shape":[3,4],"datatype":"FP32","parameters":{"binary_data_size":48}}],"parameters":{"binary_data_output":true}}`
	body := header + string(f32s(1, 2, 3, 4, 5, 6, 7, 8, 0.5, 0.5, 0.5, -0.5))
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/v2/models/sum/infer", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(headerInferenceLength, strconv.Itoa(len(header)))
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("status %d %v: %s", resp.StatusCode, err, got)
	}
	n, err := strconv.Atoi(resp.Header.Get(headerInferenceLength))
	if err != nil || n > len(got) {
		t.Fatalf("header %q", resp.Header.Get(headerInferenceLength))
	}
	if want := append(f32s(10, 26, 1), i64s(4, 4, 4)...); !bytes.Equal(got[n:], want) {
		t.Fatalf("binary part % x, want % x", got[n:], want)
	}
	if !json.Valid(got[:n]) {
		t.Fatalf("JSON part %q", got[:n])
	}
}

// TestRESTConcurrent serves JSON and binary requests from many goroutines at
// once; each checks its own numbers, so a response buffer shared by mistake
// shows up (and -race reports it).
func TestRESTConcurrent(t *testing.T) {
	h, _ := newRESTTest(restLimits)
	ctx := t.Context()
	errs := make(chan error, 8)
	for g := range 8 {
		go func() {
			errs <- func() error {
				for i := range 50 {
					v := float32(g*1000 + i)
					header := fmt.Sprintf(`{"id":"%d-%d","inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[%g,1,1,1]}]`, g, i, v)
					call := restCall{path: "/v2/models/sum/infer", body: header + "}",
						headers: map[string]string{"Content-Encoding": "identity"}}
					binary := i%2 == 1
					if binary {
						call.body, call.headers = binaryRequest(header + `,"parameters":{"binary_data_output":true}}`)
					}
					rec := call.do(t, ctx, h)
					if rec.Code != 200 {
						return fmt.Errorf("status %d: %s", rec.Code, rec.Body)
					}
					body := rec.Body.String()
					if !strings.Contains(body, fmt.Sprintf(`"id":"%d-%d"`, g, i)) {
						return fmt.Errorf("request %d-%d got %s", g, i, body)
					}
					if binary {
						n, _ := strconv.Atoi(rec.Header().Get(headerInferenceLength))
						if got := body[n:]; got != string(append(f32s(v+3), i64s(4)...)) {
							return fmt.Errorf("request %d-%d got binary % x", g, i, got)
						}
					} else if want := fmt.Sprintf(`"data":[%g]`, v+3); !strings.Contains(body, want) {
						return fmt.Errorf("request %d-%d got %s, want %s", g, i, body, want)
					}
				}
				return nil
			}()
		}()
	}
	for range 8 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

// panickingBackend panics in Infer.
type panickingBackend struct{ *fakeBackend }

func (panickingBackend) Infer(context.Context, string, string, *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	panic("backend bug")
}

// badOutputBackend returns an output whose data does not match its shape.
type badOutputBackend struct{ *fakeBackend }

func (badOutputBackend) Infer(context.Context, string, string, *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	return &runtime.InferResponse{Outputs: []runtime.Tensor{{Name: "y", DataType: runtime.FP32, Shape: []int64{2}, Data: []byte{1}}}}, "1", nil
}

func TestRESTInternalErrors(t *testing.T) {
	tests := []struct {
		name      string
		backend   Backend
		wantError string
	}{
		{"panic", panickingBackend{newFakeBackend()}, "internal server error"},
		{"output data mismatch", badOutputBackend{newFakeBackend()}, `output "y" has 1 bytes of data; shape [2] of FP32 needs 8`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var logs bytes.Buffer
			h := NewREST(tc.backend, restLimits, slog.New(slog.NewTextHandler(&logs, nil)))
			rec := restCall{path: "/v2/models/sum/infer",
				body: `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}`}.do(t, t.Context(), h)
			if rec.Code != 500 {
				t.Fatalf("status %d, want 500", rec.Code)
			}
			if msg := restErrorBody(t, rec); !strings.Contains(msg, tc.wantError) {
				t.Fatalf("error %q, want %q", msg, tc.wantError)
			}
			if !strings.Contains(logs.String(), "level=ERROR") {
				t.Fatalf("nothing logged: %s", logs.String())
			}
		})
	}
}

func BenchmarkRESTInferJSON(b *testing.B) {
	for _, batch := range []int{1, 64} {
		body := restBenchBody(batch)
		fb := newFakeBackend()
		h := NewREST(fb, Limits{MaxRequestBytes: 1 << 20, MaxTensorElements: 1 << 20}, slog.New(slog.DiscardHandler))

		// The baseline: the backend alone, on an already decoded request.
		b.Run(fmt.Sprintf("batch=%d/path=backend", batch), func(b *testing.B) {
			dec, err := decodeRESTInfer([]byte(body), -1, restLimits)
			if err != nil {
				b.Fatal(err)
			}
			rr := dec.runtimeRequest()
			b.ReportAllocs()
			for b.Loop() {
				if _, _, err := fb.Infer(b.Context(), "sum", "", rr); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("batch=%d/path=handler", batch), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				req := httptest.NewRequestWithContext(b.Context(), http.MethodPost, "/v2/models/sum/infer", strings.NewReader(body))
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, req)
				if rec.Code != 200 {
					b.Fatalf("status %d: %s", rec.Code, rec.Body)
				}
			}
		})
		b.Run(fmt.Sprintf("batch=%d/path=loopback", batch), func(b *testing.B) {
			srv := httptest.NewServer(h)
			defer srv.Close()
			client := srv.Client()
			url := srv.URL + "/v2/models/sum/infer"
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				req, _ := http.NewRequestWithContext(b.Context(), http.MethodPost, url, strings.NewReader(body))
				resp, err := client.Do(req)
				if err != nil {
					b.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Fatalf("status %d", resp.StatusCode)
				}
			}
		})
	}
}

// restSumBody is a valid inference body for "sum" with the given request
// parameters (a JSON object's members, "" for none).
func restSumBody(params string) string {
	return `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}],"parameters":{` + params + `}}`
}

// checkDeadline checks that a request's deadline is its arrival, between
// before and after, plus timeout; no timeout wants a zero deadline.
func checkDeadline(t *testing.T, got time.Time, before, after time.Time, timeout time.Duration) {
	t.Helper()
	if timeout == 0 {
		if !got.IsZero() {
			t.Fatalf("deadline %v, want none", got)
		}
		return
	}
	if got.IsZero() {
		t.Fatalf("no deadline, want arrival + %v", timeout)
	}
	if d := got.Sub(before); d < timeout {
		t.Errorf("deadline is %v after the request was sent, want at least %v", d, timeout)
	}
	if d := got.Sub(after); d > timeout {
		t.Errorf("deadline is %v after the response came, want at most %v", d, timeout)
	}
}

func TestRESTRequestOptions(t *testing.T) {
	tests := []struct {
		name         string
		params       string
		header       string // Inference-Timeout-Ms
		wantTimeout  time.Duration
		wantPriority int
		id           string // the request's id, passed on for the scheduler's debug lines
	}{
		{name: "none"},
		{name: "other parameters only", params: `"binary_data_output":false,"custom":"x"`},
		{name: "id", id: "client-7"},
		{name: "timeout", params: `"timeout":250000`, wantTimeout: 250 * time.Millisecond},
		{name: "timeout with exponent", params: `"timeout":2e6`, wantTimeout: 2 * time.Second},
		{name: "timeout of one microsecond", params: `"timeout":1`, wantTimeout: time.Microsecond},
		{name: "longest timeout", params: `"timeout":3600000000`, wantTimeout: time.Hour},
		{name: "header", header: "250", wantTimeout: 250 * time.Millisecond},
		{name: "header with fraction", header: "2.5", wantTimeout: 2500 * time.Microsecond},
		{name: "header fraction only", header: ".25", wantTimeout: 250 * time.Microsecond},
		{name: "header to the nanosecond", header: "0.000001", wantTimeout: time.Nanosecond},
		{name: "longest header", header: "3600000", wantTimeout: time.Hour},
		{name: "header shorter", params: `"timeout":500000`, header: "100", wantTimeout: 100 * time.Millisecond},
		{name: "parameter shorter", params: `"timeout":50000`, header: "100", wantTimeout: 50 * time.Millisecond},
		{name: "priority", params: `"priority":2`, wantPriority: 2},
		{name: "priority zero", params: `"priority":0`},
		{name: "priority and timeout", params: `"priority":1,"timeout":1000000`, wantPriority: 1, wantTimeout: time.Second},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, fb := newRESTTest(restLimits)
			call := restCall{path: "/v2/models/sum/infer", body: restSumBody(tc.params)}
			if tc.id != "" {
				call.body = `{"id":"` + tc.id + `",` + strings.TrimPrefix(call.body, "{")
			}
			if tc.header != "" {
				call.headers = map[string]string{"Inference-Timeout-Ms": tc.header}
			}
			before := time.Now()
			rec := call.do(t, t.Context(), h)
			after := time.Now()
			if rec.Code != 200 {
				t.Fatalf("status %d: %s", rec.Code, rec.Body)
			}
			got := fb.lastReq
			checkDeadline(t, got.Deadline, before, after, tc.wantTimeout)
			if got.Priority != tc.wantPriority {
				t.Errorf("priority %d, want %d", got.Priority, tc.wantPriority)
			}
			if got.ID != tc.id {
				t.Errorf("id %q, want %q", got.ID, tc.id)
			}
		})
	}
}

func TestRESTRequestOptionsRefused(t *testing.T) {
	tests := []struct {
		name      string
		params    string
		header    string
		wantError string
	}{
		{"negative timeout", `"timeout":-1`, "", "parameters.timeout must be an integer number of microseconds greater than 0, not -1"},
		{"zero timeout", `"timeout":0`, "", "parameters.timeout must be an integer number of microseconds greater than 0, not 0"},
		{"negative zero timeout", `"timeout":-0`, "", "parameters.timeout must be an integer"},
		{"fractional timeout", `"timeout":1.5`, "", "parameters.timeout must be an integer number of microseconds greater than 0, not 1.5"},
		{"timeout string", `"timeout":"1000"`, "", `parameters.timeout must be an integer number of microseconds greater than 0, not "1000"`},
		{"timeout bool", `"timeout":true`, "", "parameters.timeout must be an integer"},
		{"timeout null", `"timeout":null`, "", "parameters.timeout must be an integer"},
		{"timeout object", `"timeout":{"us":5}`, "", "parameters.timeout must be an integer"},
		{"timeout over an hour", `"timeout":3600000001`, "", "parameters.timeout must be at most 3600000000 microseconds (1h0m0s), not 3600000001"},
		{"timeout overflowing Duration", `"timeout":9223372036854775807`, "", "parameters.timeout must be at most 3600000000 microseconds"},
		{"timeout over uint64", `"timeout":1e30`, "", "parameters.timeout must be at most 3600000000 microseconds (1h0m0s), not 1e30"},
		{"huge negative timeout", `"timeout":-1e30`, "", "parameters.timeout must be an integer number of microseconds greater than 0, not -1e30"},
		{"negative priority", `"priority":-1`, "", "parameters.priority must be an integer >= 0, not -1"},
		{"fractional priority", `"priority":0.5`, "", "parameters.priority must be an integer >= 0, not 0.5"},
		{"priority string", `"priority":"1"`, "", `parameters.priority must be an integer >= 0, not "1"`},
		{"priority over int", `"priority":18446744073709551615`, "", "parameters.priority must be at most 9223372036854775807, not 18446744073709551615"},
		{"priority over uint64", `"priority":1e30`, "", "parameters.priority must be at most"},
		{"negative header", "", "-5", `Inference-Timeout-Ms must be a decimal number of milliseconds greater than 0, not "-5"`},
		{"zero header", "", "0", "Inference-Timeout-Ms must be a decimal number of milliseconds greater than 0"},
		{"zero header with fraction", "", "0.000", "Inference-Timeout-Ms must be a decimal number of milliseconds greater than 0"},
		{"header below a nanosecond", "", "0.0000001", "Inference-Timeout-Ms must be a decimal number of milliseconds greater than 0"},
		{"non-numeric header", "", "soon", `Inference-Timeout-Ms must be a decimal number of milliseconds greater than 0, not "soon"`},
		{"header with unit", "", "250ms", "Inference-Timeout-Ms must be a decimal number"},
		{"header with exponent", "", "1e3", "Inference-Timeout-Ms must be a decimal number"},
		{"header with two points", "", "1.2.3", "Inference-Timeout-Ms must be a decimal number"},
		{"header point only", "", ".", "Inference-Timeout-Ms must be a decimal number"},
		{"header NaN", "", "NaN", "Inference-Timeout-Ms must be a decimal number"},
		{"header Inf", "", "Inf", "Inference-Timeout-Ms must be a decimal number"},
		{"header over an hour", "", "3600000.001", `Inference-Timeout-Ms must be at most 3600000 milliseconds (1h0m0s), not "3600000.001"`},
		{"header overflowing float64", "", "9" + strings.Repeat("9", 400), "Inference-Timeout-Ms must be at most 3600000 milliseconds"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, fb := newRESTTest(restLimits)
			call := restCall{path: "/v2/models/sum/infer", body: restSumBody(tc.params)}
			if tc.header != "" {
				call.headers = map[string]string{"Inference-Timeout-Ms": tc.header}
			}
			rec := call.do(t, t.Context(), h)
			if rec.Code != http.StatusBadRequest {
				t.Fatalf("status %d, want 400; body %s", rec.Code, rec.Body)
			}
			if msg := restErrorBody(t, rec); !strings.Contains(msg, tc.wantError) {
				t.Fatalf("error %q, want it to contain %q", msg, tc.wantError)
			}
			if fb.lastReq != nil {
				t.Fatal("the refused request reached the backend")
			}
		})
	}
}

// TestRESTQoSRejected checks that the scheduler's refusal reaches the client
// as 429 with its message, which says by how much the deadline would be
// missed, intact.
func TestRESTQoSRejected(t *testing.T) {
	h, fb := newRESTTest(restLimits)
	fb.inferErr = fmt.Errorf("model %q: %w: predicted completion misses the deadline by 12.5ms (queue ahead 40ms, execution 7ms)",
		"sum", qos.ErrRejected)
	rec := restCall{path: "/v2/models/sum/infer", body: restSumBody(`"timeout":30000`)}.do(t, t.Context(), h)
	if rec.Code != http.StatusTooManyRequests {
		t.Fatalf("status %d, want 429; body %s", rec.Code, rec.Body)
	}
	if msg := restErrorBody(t, rec); msg != fb.inferErr.Error() {
		t.Fatalf("error %q, want %q", msg, fb.inferErr)
	}
}

// TestLoadConfigOverride: a load with Triton's config override hands the
// config to the backend as tritonclient sends it, over REST (a JSON string
// in parameters.config: http/_client.py load_model) and gRPC (a
// string_param: grpc/_client.py load_model); a load without one hands
// none.
func TestLoadConfigOverride(t *testing.T) {
	const config = `{"name": "sum", "max_batch_size": 4}`
	h, fb := newRESTTest(restLimits)
	body, _ := json.Marshal(map[string]any{"parameters": map[string]any{"config": config}})
	for _, b := range []string{string(body), `{}`} {
		rec := restCall{path: "/v2/repository/models/sum/load", body: b}.do(t, t.Context(), h)
		if rec.Code != 200 {
			t.Fatalf("load %s: %d %s", b, rec.Code, rec.Body)
		}
	}
	gb := newFakeBackend()
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, gb, grpcTestLimits))
	_, err := c.RepositoryModelLoad(t.Context(), &inference.RepositoryModelLoadRequest{ModelName: "sum",
		Parameters: map[string]*inference.ModelRepositoryParameter{"config": {ParameterChoice: &inference.ModelRepositoryParameter_StringParam{StringParam: config}}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, got := range [][]string{fb.loadConfigs, gb.loadConfigs} {
		if len(got) < 1 || got[0] != config {
			t.Fatalf("the backend got configs %q, want %q first", got, config)
		}
	}
	if fb.loadConfigs[1] != "" {
		t.Fatalf("a load without a config handed %q", fb.loadConfigs[1])
	}
}
