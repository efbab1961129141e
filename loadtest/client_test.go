package loadtest

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// clientTestInputs are inputs of several datatypes, with values whose JSON
// text is not trivial.
func clientTestInputs(t testing.TB) []Tensor {
	t.Helper()
	md := &ModelMeta{Name: "m", Inputs: []TensorMeta{
		{Name: "image", DataType: "FP32", Shape: []int64{-1, 3, 4, 4}},
		{Name: "ids", DataType: "INT64", Shape: []int64{-1, 5}},
		{Name: "mask", DataType: "BOOL", Shape: []int64{-1, 5}},
		{Name: "text", DataType: "BYTES", Shape: []int64{-1}},
	}}
	ins, err := BuildInputs(md, map[string]InputSpec{"text": {Shape: []int64{3}}}, 42)
	if err != nil {
		t.Fatal(err)
	}
	// Extreme values the JSON encoding must keep exactly.
	le := binary.LittleEndian
	le.PutUint32(ins[0].Raw[0:], math.Float32bits(-1.5e-38))
	le.PutUint32(ins[0].Raw[4:], math.Float32bits(math.MaxFloat32))
	le.PutUint32(ins[0].Raw[8:], math.Float32bits(0.1))
	le.PutUint64(ins[1].Raw[0:], 1<<63) // math.MinInt64
	return ins
}

// clientTestRequestJSON is a REST inference request as the fake server reads it.
type clientTestRequestJSON struct {
	ID         *string                    `json:"id"`
	Parameters map[string]json.RawMessage `json:"parameters"`
	Inputs     []struct {
		Name       string            `json:"name"`
		DataType   string            `json:"datatype"`
		Shape      []int64           `json:"shape"`
		Data       []json.RawMessage `json:"data"`
		Parameters struct {
			BinaryDataSize *int64 `json:"binary_data_size"`
		} `json:"parameters"`
	} `json:"inputs"`
}

// clientTestRawJSON converts one JSON data element back to its raw bytes.
func clientTestRawJSON(dt string, v json.RawMessage) ([]byte, error) {
	le := binary.LittleEndian
	switch dt {
	case "FP32":
		f, err := strconv.ParseFloat(string(v), 32)
		return le.AppendUint32(nil, math.Float32bits(float32(f))), err
	case "INT64":
		i, err := strconv.ParseInt(string(v), 10, 64)
		return le.AppendUint64(nil, uint64(i)), err
	case "BOOL":
		switch string(v) {
		case "true":
			return []byte{1}, nil
		case "false":
			return []byte{0}, nil
		}
	case "BYTES":
		var s string
		if err := json.Unmarshal(v, &s); err != nil {
			return nil, err
		}
		return append(le.AppendUint32(nil, uint32(len(s))), s...), nil
	}
	return nil, fmt.Errorf("cannot read %s element %s", dt, v)
}

// clientTestREST is a fake REST server. It checks each request against the
// inputs the client was given and answers as mode says.
type clientTestREST struct {
	model     string
	inputs    []Tensor
	timeoutUS atomic.Int64 // the timeout parameter expected; 0: none
	mode      atomic.Value // string
	requests  atomic.Int64
	lastID    atomic.Value // *string: the last request's id, nil when it had none
}

func (s *clientTestREST) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.requests.Add(1)
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return
	}
	binaryReq, id, problem := s.check(r, body)
	if problem != "" {
		clientTestWriteError(w, http.StatusBadRequest, "fake server: "+problem)
		return
	}
	s.lastID.Store(id)
	mode, _ := s.mode.Load().(string)
	switch mode {
	case "good", "big", "wrong-model", "no-outputs", "no-data", "binary-size", "wrong-id", "no-id":
		s.writeGood(w, mode, binaryReq, id)
	case "429":
		clientTestWriteError(w, http.StatusTooManyRequests, "request rejected: deadline cannot be met")
	case "504":
		clientTestWriteError(w, http.StatusGatewayTimeout, "request dropped: deadline passed while queued")
	case "503":
		clientTestWriteError(w, http.StatusServiceUnavailable, `model "`+s.model+`" is not ready`+strings.Repeat(" and a long explanation", 10))
	case "500-text":
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = w.Write([]byte("plain failure\n"))
	case "slow":
		select {
		case <-r.Context().Done():
		case <-time.After(10 * time.Second):
		}
	default:
		clientTestWriteError(w, http.StatusInternalServerError, "no mode "+mode)
	}
}

func clientTestWriteError(w http.ResponseWriter, status int, msg string) {
	body, _ := json.Marshal(map[string]string{"error": msg})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// check checks a request; it returns whether it asked for binary outputs,
// its id (nil: none) and what is wrong with it, or "".
func (s *clientTestREST) check(r *http.Request, body []byte) (binaryReq bool, id *string, problem string) {
	binaryReq, id, problem = s.checkBody(r, body)
	if r.ContentLength != int64(len(body)) {
		problem = cmp.Or(problem, fmt.Sprintf("Content-Length %d for a body of %d bytes", r.ContentLength, len(body)))
	}
	return binaryReq, id, problem
}

func (s *clientTestREST) checkBody(r *http.Request, body []byte) (binaryReq bool, id *string, problem string) {
	if want := "/v2/models/" + s.model + "/infer"; r.Method != http.MethodPost || r.URL.Path != want {
		return false, nil, fmt.Sprintf("%s %s, want POST %s", r.Method, r.URL.Path, want)
	}
	jsonPart, binPart := body, []byte(nil)
	h := r.Header.Get(clientHeaderInferenceLength)
	if h != "" {
		n, err := strconv.Atoi(h)
		if err != nil || n < 0 || n > len(body) {
			return false, nil, "bad header length " + h
		}
		if ct := r.Header.Get("Content-Type"); ct != "application/octet-stream" {
			return false, nil, "binary request with Content-Type " + ct
		}
		jsonPart, binPart = body[:n], body[n:]
	} else if ct := r.Header.Get("Content-Type"); ct != "application/json" {
		return false, nil, "JSON request with Content-Type " + ct
	}
	var req clientTestRequestJSON
	if err := json.Unmarshal(jsonPart, &req); err != nil {
		return false, nil, "JSON: " + err.Error()
	}
	id = req.ID
	if want := s.timeoutUS.Load(); want > 0 {
		if got := string(req.Parameters["timeout"]); got != strconv.FormatInt(want, 10) {
			return false, nil, fmt.Sprintf("timeout parameter %q, want %d", got, want)
		}
	} else if got, ok := req.Parameters["timeout"]; ok {
		return false, nil, fmt.Sprintf("timeout parameter %s, want none", got)
	}
	binaryReq = string(req.Parameters["binary_data_output"]) == "true"
	if binaryReq != (h != "") {
		return false, nil, fmt.Sprintf("binary_data_output %v with header %q", binaryReq, h)
	}
	if len(req.Inputs) != len(s.inputs) {
		return false, nil, fmt.Sprintf("%d inputs, want %d", len(req.Inputs), len(s.inputs))
	}
	for i, in := range req.Inputs {
		want := s.inputs[i]
		if in.Name != want.Name || in.DataType != want.DataType || fmt.Sprint(in.Shape) != fmt.Sprint(want.Shape) {
			return false, nil, fmt.Sprintf("input %d is %s %s %v, want %s %s %v", i, in.Name, in.DataType, in.Shape, want.Name, want.DataType, want.Shape)
		}
		var raw []byte
		if size := in.Parameters.BinaryDataSize; size != nil {
			if in.Data != nil || *size > int64(len(binPart)) {
				return false, nil, fmt.Sprintf("input %s: binary_data_size %d with %d bytes left", in.Name, *size, len(binPart))
			}
			raw, binPart = binPart[:*size], binPart[*size:]
		} else {
			n := int64(1)
			for _, d := range in.Shape {
				n *= d
			}
			if int64(len(in.Data)) != n {
				return false, nil, fmt.Sprintf("input %s: %d data elements, want %d", in.Name, len(in.Data), n)
			}
			for _, v := range in.Data {
				b, err := clientTestRawJSON(in.DataType, v)
				if err != nil {
					return false, nil, err.Error()
				}
				raw = append(raw, b...)
			}
		}
		if !bytes.Equal(raw, want.Raw) {
			return false, nil, fmt.Sprintf("input %s: data differs", in.Name)
		}
	}
	if len(binPart) != 0 {
		return false, nil, fmt.Sprintf("%d bytes of binary data left", len(binPart))
	}
	return binaryReq, req.ID, ""
}

// writeGood answers 200 with a response, broken as mode says.
func (s *clientTestREST) writeGood(w http.ResponseWriter, mode string, binaryResp bool, id *string) {
	model := s.model
	if mode == "wrong-model" {
		model = "other"
	}
	out := `{"name":"scores","datatype":"FP32","shape":[2],"data":[0.5,0.25]}`
	switch {
	case mode == "big" && !binaryResp:
		// Data over several read chunks, and strings with brackets.
		var b strings.Builder
		b.WriteString(`{"name":"maps","datatype":"FP32","shape":[200,1000],"data":[`)
		for i := range 200 {
			b.WriteString("[")
			for k := range 1000 {
				if k > 0 {
					b.WriteString(",")
				}
				b.WriteString(strconv.FormatFloat(float64(i*k)/7, 'g', -1, 32))
			}
			b.WriteString("]")
			if i < 199 {
				b.WriteString(",")
			}
		}
		b.WriteString(`]},{"name":"labels","datatype":"BYTES","shape":[3],"data":["]","[\"data\":[",""]}`)
		out = b.String()
	case mode == "no-outputs":
		out = ""
	case mode == "no-data":
		out = `{"name":"scores","datatype":"FP32","shape":[2]}`
	case binaryResp:
		out = `{"name":"scores","datatype":"FP32","shape":[2],"parameters":{"binary_data_size":8}}`
	}
	header := `{"model_name":"` + model + `","model_version":"1","outputs":[` + out + `]}`
	switch {
	case mode == "wrong-id":
		header = `{"id":"other",` + header[1:]
	case id != nil && mode != "no-id":
		b, _ := json.Marshal(*id)
		header = `{"id":` + string(b) + `,` + header[1:]
	}
	if !binaryResp {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(header))
		return
	}
	data := []byte{0, 0, 0, 63, 0, 0, 128, 62}
	if mode == "binary-size" {
		data = data[:7]
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set(clientHeaderInferenceLength, strconv.Itoa(len(header)))
	_, _ = w.Write(append([]byte(header), data...))
}

func clientTestNewREST(t testing.TB, inputs []Tensor) (*clientTestREST, *httptest.Server) {
	fake := &clientTestREST{model: "ocr-det", inputs: inputs}
	fake.mode.Store("good")
	srv := httptest.NewServer(fake)
	t.Cleanup(srv.Close)
	return fake, srv
}

type clientTestCase struct {
	mode    string
	outcome Outcome
	detail  string // a prefix of the detail
}

func TestClientREST(t *testing.T) {
	inputs := clientTestInputs(t)
	cases := []clientTestCase{
		{mode: "good", outcome: Good},
		{mode: "big", outcome: Good},
		{mode: "wrong-model", outcome: Failed, detail: `200: invalid response: model_name "other", want "ocr-det"`},
		{mode: "no-outputs", outcome: Failed, detail: "200: invalid response: no outputs"},
		{mode: "429", outcome: Rejected, detail: "429: request rejected: deadline cannot be met"},
		{mode: "504", outcome: Dropped, detail: "504: request dropped"},
		{mode: "503", outcome: Failed, detail: `503: model "ocr-det" is not ready and a long`},
		{mode: "500-text", outcome: Failed, detail: "500: plain failure"},
	}
	for _, proto := range []string{ProtoREST, ProtoRESTBinary} {
		t.Run("proto="+proto, func(t *testing.T) {
			fake, srv := clientTestNewREST(t, inputs)
			fake.timeoutUS.Store(2_000_000)
			c, err := NewClient(ClientOptions{Protocol: proto, HTTPBase: srv.URL + "/", Model: "ocr-det",
				Inputs: inputs, Timeout: 2 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			extra := []clientTestCase{{mode: "no-data", outcome: Failed, detail: `200: invalid response: output "scores" has no data`}}
			if proto == ProtoRESTBinary {
				extra = []clientTestCase{{mode: "binary-size", outcome: Failed,
					detail: "200: invalid response: outputs declare 8 bytes of binary data; the response has 7"}}
			}
			for _, tc := range append(cases, extra...) {
				fake.mode.Store(tc.mode)
				clientTestInfer(t, c, tc)
			}
			if n := fake.requests.Load(); n != int64(len(cases)+len(extra)) {
				t.Errorf("the server saw %d requests, want %d", n, len(cases)+len(extra))
			}
		})
	}
}

// clientTestInfer sends one request and checks its outcome and detail.
func clientTestInfer(t *testing.T, c *Client, tc clientTestCase) {
	t.Helper()
	o, detail := c.Infer(t.Context())
	if o != tc.outcome || !strings.HasPrefix(detail, tc.detail) || (tc.detail == "") != (detail == "") {
		t.Errorf("mode %s: %v %q, want %v %q", tc.mode, o, detail, tc.outcome, tc.detail)
	}
	if len(detail) > len("200: invalid response: ")+clientDetailLen+10 {
		t.Errorf("mode %s: detail %q is not clipped", tc.mode, detail)
	}
}

func TestClientRESTTimeoutParameter(t *testing.T) {
	inputs := clientTestInputs(t)
	tests := []struct {
		name            string
		timeout, server time.Duration
		want            int64
	}{
		{name: "none", want: 0},
		{name: "client timeout", timeout: 1500 * time.Millisecond, want: 1_500_000},
		{name: "rounded up", server: 1500*time.Microsecond + 1, want: 1501},
		{name: "server timeout", timeout: time.Second, server: 250 * time.Millisecond, want: 250_000},
		{name: "server timeout without client timeout", server: 3 * time.Second, want: 3_000_000},
		{name: "not sent", timeout: time.Second, server: -1, want: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, proto := range []string{ProtoREST, ProtoRESTBinary} {
				fake, srv := clientTestNewREST(t, inputs)
				fake.timeoutUS.Store(tt.want)
				c, err := NewClient(ClientOptions{Protocol: proto, HTTPBase: srv.URL, Model: "ocr-det",
					Inputs: inputs, Timeout: tt.timeout, ServerTimeout: tt.server})
				if err != nil {
					t.Fatal(err)
				}
				clientTestInfer(t, c, clientTestCase{mode: proto, outcome: Good})
				c.Close()
			}
		})
	}
}

func TestClientRESTClientTimeout(t *testing.T) {
	inputs := clientTestInputs(t)
	fake, srv := clientTestNewREST(t, inputs)
	fake.mode.Store("slow")
	fake.timeoutUS.Store(50_000)
	for _, proto := range []string{ProtoREST, ProtoRESTBinary} {
		c, err := NewClient(ClientOptions{Protocol: proto, HTTPBase: srv.URL, Model: "ocr-det",
			Inputs: inputs, Timeout: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		clientTestInfer(t, c, clientTestCase{mode: "slow", outcome: Dropped, detail: "client timeout"})
		// A watchdog, not a timing: without the client's timeout the slow
		// fake answers after 10s.
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("the request took %v with a 50ms timeout", d)
		}
		c.Close()
	}
}

func TestClientRESTCanceled(t *testing.T) {
	inputs := clientTestInputs(t)
	fake, srv := clientTestNewREST(t, inputs)
	fake.mode.Store("slow")
	c, err := NewClient(ClientOptions{Protocol: ProtoREST, HTTPBase: srv.URL, Model: "ocr-det", Inputs: inputs})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	// The caller's own deadline is a client timeout too.
	if o, detail := c.Infer(ctx); o != Dropped || detail != "client timeout" {
		t.Errorf("deadline: %v %q, want dropped \"client timeout\"", o, detail)
	}
	ctx, cancel = context.WithCancel(t.Context())
	cancel()
	if o, detail := c.Infer(ctx); o != Failed || detail != "canceled" {
		t.Errorf("canceled: %v %q, want failed \"canceled\"", o, detail)
	}
}

func TestClientRESTClosedServer(t *testing.T) {
	inputs := clientTestInputs(t)
	_, srv := clientTestNewREST(t, inputs)
	srv.Close()
	for _, proto := range []string{ProtoREST, ProtoRESTBinary} {
		c, err := NewClient(ClientOptions{Protocol: proto, HTTPBase: srv.URL, Model: "ocr-det", Inputs: inputs, Timeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		o, detail := c.Infer(t.Context())
		if o != Failed || !strings.HasPrefix(detail, "transport: dial: ") || strings.Contains(detail, "http://") {
			t.Errorf("%s: %v %q, want failed \"transport: dial: ...\"", proto, o, detail)
		}
		c.Close()
	}
}

func TestClientRESTConcurrent(t *testing.T) {
	inputs := clientTestInputs(t)
	fake, srv := clientTestNewREST(t, inputs)
	for _, proto := range []string{ProtoREST, ProtoRESTBinary} {
		c, err := NewClient(ClientOptions{Protocol: proto, HTTPBase: srv.URL, Model: "ocr-det", Inputs: inputs,
			HTTPClient: srv.Client()})
		if err != nil {
			t.Fatal(err)
		}
		const workers, each = 8, 25
		errs := make(chan string, workers*each)
		for range workers {
			go func() {
				for range each {
					o, detail := c.Infer(t.Context())
					errs <- fmt.Sprintf("%v %s", o, detail)
				}
			}()
		}
		for range workers * each {
			if got := <-errs; got != "good " {
				t.Fatalf("%s: %s, want good", proto, got)
			}
		}
		c.Close()
	}
	if n := fake.requests.Load(); n != 2*8*25 {
		t.Errorf("the server saw %d requests, want %d", n, 2*8*25)
	}
}

func TestNewClientErrors(t *testing.T) {
	good := clientTestInputs(t)
	fp16 := []Tensor{{Name: "h", DataType: "FP16", Shape: []int64{2}, Raw: make([]byte, 4)}}
	nan := []Tensor{{Name: "f", DataType: "FP32", Shape: []int64{1}, Raw: binary.LittleEndian.AppendUint32(nil, math.Float32bits(float32(math.NaN())))}}
	short := []Tensor{{Name: "f", DataType: "FP32", Shape: []int64{2, 2}, Raw: make([]byte, 15)}}
	badBytes := []Tensor{{Name: "s", DataType: "BYTES", Shape: []int64{2}, Raw: []byte{1, 0, 0, 0, 'a', 5, 0, 0, 0, 'b'}}}
	notUTF8 := []Tensor{{Name: "s", DataType: "BYTES", Shape: []int64{1}, Raw: []byte{1, 0, 0, 0, 0xff}}}
	tests := []struct {
		name  string
		opts  ClientOptions
		error string
	}{
		{name: "no model", opts: ClientOptions{Protocol: ProtoREST, HTTPBase: "http://x"}, error: "no model"},
		{name: "unknown protocol", opts: ClientOptions{Protocol: "soap", Model: "m"}, error: `unknown protocol "soap"`},
		{name: "bad base", opts: ClientOptions{Protocol: ProtoREST, HTTPBase: "127.0.0.1:8000", Model: "m"}, error: "not an http://"},
		{name: "no gRPC address", opts: ClientOptions{Protocol: ProtoGRPC, Model: "m"}, error: "no gRPC address"},
		{name: "negative timeout", opts: ClientOptions{Protocol: ProtoREST, HTTPBase: "http://x", Model: "m", Timeout: -1}, error: "negative"},
		{name: "timeout over an hour", opts: ClientOptions{Protocol: ProtoGRPC, GRPCAddr: "x:1", Model: "m", Timeout: 2 * time.Hour},
			error: "over the 1h0m0s"},
		{name: "FP16 as JSON", opts: ClientOptions{Protocol: ProtoREST, HTTPBase: "http://x", Model: "m", Inputs: fp16},
			error: "FP16 data cannot be sent as JSON"},
		{name: "NaN as JSON", opts: ClientOptions{Protocol: ProtoREST, HTTPBase: "http://x", Model: "m", Inputs: nan},
			error: "JSON cannot carry"},
		{name: "not UTF-8 as JSON", opts: ClientOptions{Protocol: ProtoREST, HTTPBase: "http://x", Model: "m", Inputs: notUTF8},
			error: "not UTF-8"},
		{name: "data size", opts: ClientOptions{Protocol: ProtoGRPC, GRPCAddr: "x:1", Model: "m", Inputs: short},
			error: "has 15 bytes"},
		{name: "BYTES elements", opts: ClientOptions{Protocol: ProtoRESTBinary, HTTPBase: "http://x", Model: "m", Inputs: badBytes},
			error: "BYTES element 1 is truncated"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := NewClient(tt.opts)
			if err == nil {
				c.Close()
			}
			if err == nil || !strings.Contains(err.Error(), tt.error) {
				t.Fatalf("error %v, want one containing %q", err, tt.error)
			}
		})
	}
	// What JSON cannot carry, binary and gRPC can.
	for _, proto := range []string{ProtoRESTBinary, ProtoGRPC} {
		for _, in := range [][]Tensor{good, fp16, nan, notUTF8} {
			c, err := NewClient(ClientOptions{Protocol: proto, HTTPBase: "http://x", GRPCAddr: "x:1", Model: "m", Inputs: in})
			if err != nil {
				t.Errorf("%s %s: %v", proto, in[0].DataType, err)
				continue
			}
			c.Close()
		}
	}
}

// clientTestGRPC is a fake gRPC inference service.
type clientTestGRPC struct {
	inference.UnimplementedGRPCInferenceServiceServer

	model     string
	inputs    []Tensor
	timeoutUS atomic.Int64
	mode      atomic.Value // string
	requests  atomic.Int64
	lastID    atomic.Value // string
}

func (s *clientTestGRPC) ModelInfer(ctx context.Context, req *inference.ModelInferRequest) (*inference.ModelInferResponse, error) {
	s.requests.Add(1)
	if problem := s.check(req); problem != "" {
		return nil, status.Error(codes.InvalidArgument, "fake server: "+problem)
	}
	s.lastID.Store(req.GetId())
	mode, _ := s.mode.Load().(string)
	resp := &inference.ModelInferResponse{
		Id:                req.GetId(),
		ModelName:         req.GetModelName(),
		ModelVersion:      "1",
		Outputs:           []*inference.ModelInferResponse_InferOutputTensor{{Name: "scores", Datatype: "FP32", Shape: []int64{2}}},
		RawOutputContents: [][]byte{{0, 0, 0, 63, 0, 0, 128, 62}},
	}
	switch mode {
	case "ok":
		return resp, nil
	case "wrong-model":
		resp.ModelName = "other"
		return resp, nil
	case "wrong-id":
		resp.Id = "other"
		return resp, nil
	case "no-id":
		resp.Id = ""
		return resp, nil
	case "no-data":
		resp.RawOutputContents = nil
		return resp, nil
	case "resource-exhausted":
		return nil, status.Error(codes.ResourceExhausted, "request rejected: deadline cannot be met")
	case "too-large":
		return nil, status.Error(codes.ResourceExhausted, "request too large: input \"image\": shape [1 3 4 4] has too many elements")
	case "deadline-exceeded":
		return nil, status.Error(codes.DeadlineExceeded, "request dropped: deadline passed while queued")
	case "unavailable":
		return nil, status.Error(codes.Unavailable, `model "ocr-det" is not ready`)
	case "slow":
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Second):
		}
		return nil, status.Error(codes.DeadlineExceeded, "too slow")
	}
	return nil, status.Error(codes.Internal, "no mode "+mode)
}

func (s *clientTestGRPC) check(req *inference.ModelInferRequest) string {
	if req.GetModelName() != s.model || req.GetModelVersion() != "" {
		return fmt.Sprintf("model %q version %q", req.GetModelName(), req.GetModelVersion())
	}
	p, ok := req.GetParameters()["timeout"]
	if want := s.timeoutUS.Load(); want > 0 {
		if got, isInt := p.GetParameterChoice().(*inference.InferParameter_Int64Param); !isInt || got.Int64Param != want {
			return fmt.Sprintf("timeout parameter %v, want int64_param %d", p, want)
		}
	} else if ok {
		return fmt.Sprintf("timeout parameter %v, want none", p)
	}
	raw := req.GetRawInputContents()
	if len(req.GetInputs()) != len(s.inputs) || len(raw) != len(s.inputs) {
		return fmt.Sprintf("%d inputs with %d raw contents, want %d", len(req.GetInputs()), len(raw), len(s.inputs))
	}
	for i, in := range req.GetInputs() {
		want := s.inputs[i]
		if in.GetName() != want.Name || in.GetDatatype() != want.DataType || fmt.Sprint(in.GetShape()) != fmt.Sprint(want.Shape) {
			return fmt.Sprintf("input %d is %s %s %v", i, in.GetName(), in.GetDatatype(), in.GetShape())
		}
		if len(raw[i]) != len(want.Raw) || !bytes.Equal(raw[i], want.Raw) {
			return fmt.Sprintf("input %s: %d raw bytes, want %d", want.Name, len(raw[i]), len(want.Raw))
		}
	}
	return ""
}

func clientTestNewGRPC(t testing.TB, inputs []Tensor) (*clientTestGRPC, string) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fake := &clientTestGRPC{model: "ocr-det", inputs: inputs}
	fake.mode.Store("ok")
	srv := grpc.NewServer()
	inference.RegisterGRPCInferenceServiceServer(srv, fake)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return fake, lis.Addr().String()
}

func TestClientGRPC(t *testing.T) {
	inputs := clientTestInputs(t)
	fake, addr := clientTestNewGRPC(t, inputs)
	fake.timeoutUS.Store(2_000_000)
	c, err := NewClient(ClientOptions{Protocol: ProtoGRPC, GRPCAddr: addr, Model: "ocr-det", Inputs: inputs, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	cases := []clientTestCase{
		{mode: "ok", outcome: Good},
		{mode: "wrong-model", outcome: Failed, detail: `OK: invalid response: model_name "other", want "ocr-det"`},
		{mode: "no-data", outcome: Failed, detail: `OK: invalid response: output "scores" has no data`},
		{mode: "resource-exhausted", outcome: Rejected, detail: "ResourceExhausted: request rejected"},
		{mode: "too-large", outcome: Failed, detail: "ResourceExhausted: request too large"},
		{mode: "deadline-exceeded", outcome: Dropped, detail: "DeadlineExceeded: request dropped"},
		{mode: "unavailable", outcome: Failed, detail: `Unavailable: model "ocr-det" is not ready`},
		{mode: "ok", outcome: Good},
	}
	for _, tc := range cases {
		fake.mode.Store(tc.mode)
		clientTestInfer(t, c, tc)
	}
	if n := fake.requests.Load(); n != int64(len(cases)) {
		t.Errorf("the server saw %d requests, want %d", n, len(cases))
	}
	if err := c.Close(); err != nil {
		t.Errorf("close: %v", err)
	}
	if o, detail := c.Infer(t.Context()); o != Failed || !strings.HasPrefix(detail, "Canceled: ") {
		t.Errorf("after close: %v %q, want failed \"Canceled: ...\"", o, detail)
	}
}

func TestClientGRPCTimeouts(t *testing.T) {
	inputs := clientTestInputs(t)
	fake, addr := clientTestNewGRPC(t, inputs)
	// A shared connection, which the client must not close.
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()

	fake.mode.Store("slow")
	fake.timeoutUS.Store(40_000)
	c, err := NewClient(ClientOptions{Protocol: ProtoGRPC, GRPCConn: conn, Model: "ocr-det", Inputs: inputs, Timeout: 40 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	clientTestInfer(t, c, clientTestCase{mode: "slow", outcome: Dropped, detail: "client timeout"})
	c.Close()

	fake.mode.Store("ok")
	fake.timeoutUS.Store(0)
	c, err = NewClient(ClientOptions{Protocol: ProtoGRPC, GRPCConn: conn, Model: "ocr-det", Inputs: inputs,
		Timeout: time.Second, ServerTimeout: -1})
	if err != nil {
		t.Fatal(err)
	}
	clientTestInfer(t, c, clientTestCase{mode: "ok", outcome: Good})
	c.Close()

	// The shared connection still works.
	fake.timeoutUS.Store(123)
	c, err = NewClient(ClientOptions{Protocol: ProtoGRPC, GRPCConn: conn, Model: "ocr-det", Inputs: inputs, ServerTimeout: 123 * time.Microsecond})
	if err != nil {
		t.Fatal(err)
	}
	clientTestInfer(t, c, clientTestCase{mode: "ok", outcome: Good})
	c.Close()
}

func TestClientGRPCClosedServer(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	c, err := NewClient(ClientOptions{Protocol: ProtoGRPC, GRPCAddr: addr, Model: "ocr-det", Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if o, detail := c.Infer(t.Context()); o != Failed || !strings.HasPrefix(detail, "Unavailable: ") {
		t.Errorf("%v %q, want failed \"Unavailable: ...\"", o, detail)
	}
}

func TestClientSkim(t *testing.T) {
	tests := []struct{ in, want string }{
		{`{"model_name":"m","outputs":[{"name":"a","shape":[3],"data":[1,2.5e-3,-3]}]}`,
			`{"model_name":"m","outputs":[{"name":"a","shape":[3],"data":[]}]}`},
		{`{"data" : [[1,[2]],["]","\"[",3], "\\"] ,"x":1}`, `{"data" : [] ,"x":1}`},
		{`{"outputs":[{"name":"data","data":["data"]},{"data":[true,false]}]}`, `{"outputs":[{"name":"data","data":[]},{"data":[]}]}`},
		{`{"name":"a\\","data":[1]}`, `{"name":"a\\","data":[]}`},
		{`{"name":"data","x":[1]}`, `{"name":"data","x":[1]}`},
		{`{"data":null,"y":"data"}`, `{"data":null,"y":"data"}`},
		{`{"data":{"data":[1]}}`, `{"data":{"data":[]}}`},
		{`["data",["data"]]`, `["data",["data"]]`},
		{"{\"data\"\n:\t[1]}", "{\"data\"\n:\t[]}"},
		{`{"data":[1,2`, `{"data":[`},
		{`{"da`, `{"da`},
		{``, ``},
	}
	for _, tt := range tests {
		for chunk := 1; chunk <= max(len(tt.in), 1); chunk++ {
			var s clientSkim
			s.reset()
			for in := []byte(tt.in); len(in) > 0; {
				n := min(chunk, len(in))
				if s.write(in[:n]) {
					t.Fatalf("%s: too large", tt.in)
				}
				in = in[n:]
			}
			if string(s.out) != tt.want {
				t.Fatalf("%s in chunks of %d: %s, want %s", tt.in, chunk, s.out, tt.want)
			}
		}
	}

	var s clientSkim
	s.reset()
	if !s.write(bytes.Repeat([]byte(`{"x":1}`), clientMaxSkimmed/7+1)) {
		t.Error("no error over the size limit")
	}
	s.reset()
	if len(s.out) != 0 {
		t.Error("reset kept the output")
	}
}

// FuzzClientSkim checks that skimming keeps what the client reads from a
// response, whatever the document.
func FuzzClientSkim(f *testing.F) {
	f.Add(`{"model_name":"m","model_version":"1","outputs":[{"name":"a","data":[1,[2,"]"]],"parameters":{"binary_data_size":4}}]}`, 3)
	f.Add(`{"outputs":[{"name":"data","data":"data"}],"data":[{"model_name":"x"}]}`, 1)
	f.Fuzz(func(t *testing.T, doc string, chunk int) {
		chunk = max(1, chunk%64+1)
		var s clientSkim
		s.reset()
		for in := []byte(doc); len(in) > 0; {
			n := min(chunk, len(in))
			s.write(in[:n])
			in = in[n:]
		}
		var full, skimmed clientRESTResponse
		if err := json.Unmarshal([]byte(doc), &full); err != nil {
			return
		}
		if err := json.Unmarshal(s.out, &skimmed); err != nil {
			t.Fatalf("%s skims to %s: %v", doc, s.out, err)
		}
		if a, b := clientTestResponseString(&full), clientTestResponseString(&skimmed); a != b {
			t.Fatalf("%s: read %s, skimmed %s", doc, a, b)
		}
	})
}

func clientTestResponseString(r *clientRESTResponse) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%q %q", r.ModelName, r.ModelVersion)
	for _, o := range r.Outputs {
		fmt.Fprintf(&b, " {%q %v", o.Name, o.Data)
		if o.Parameters.BinaryDataSize != nil {
			fmt.Fprintf(&b, " %d", *o.Parameters.BinaryDataSize)
		}
		b.WriteString("}")
	}
	return b.String()
}

func BenchmarkClientSkim(b *testing.B) {
	doc := []byte(`{"model_name":"ocr-det","model_version":"1","outputs":[{"name":"maps","datatype":"FP32","shape":[1,1,640,640],"data":[`)
	for i := range 640 * 640 {
		if i > 0 {
			doc = append(doc, ',')
		}
		doc = strconv.AppendFloat(doc, float64(i%977)/977, 'g', -1, 32)
	}
	doc = append(doc, "]}]}"...)
	b.Run("skim", func(b *testing.B) {
		b.SetBytes(int64(len(doc)))
		b.ReportAllocs()
		var s clientSkim
		for b.Loop() {
			s.reset()
			for in := doc; len(in) > 0; {
				n := min(32<<10, len(in))
				s.write(in[:n])
				in = in[n:]
			}
			var r clientRESTResponse
			if err := json.Unmarshal(s.out, &r); err != nil || r.ModelName != "ocr-det" {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding-json-baseline", func(b *testing.B) {
		b.SetBytes(int64(len(doc)))
		b.ReportAllocs()
		for b.Loop() {
			var r clientRESTResponse
			if err := json.Unmarshal(doc, &r); err != nil || r.ModelName != "ocr-det" {
				b.Fatal(err)
			}
		}
	})
}

func TestClientDetail(t *testing.T) {
	long := strings.Repeat("é", 100) // two bytes each
	got := clientDetail("503", long)
	if !strings.HasPrefix(got, "503: é") || len(got) > len("503: ")+clientDetailLen || !strings.HasSuffix(got, "é") {
		t.Errorf("detail %q: want the message clipped to %d bytes on a rune boundary", got, clientDetailLen)
	}
	if got := clientDetail("504", "  "); got != "504" {
		t.Errorf("empty message: detail %q, want \"504\"", got)
	}
}

// BenchmarkClientInfer measures the client against in-process servers that
// do as little as possible, so the time is mostly the client's and the
// transport's. The baselines send the same bytes with a bare net/http POST
// (body discarded, nothing checked) or a bare generated gRPC call: the
// client's own overhead is the difference.
func BenchmarkClientInfer(b *testing.B) {
	sizes := []struct {
		name string
		meta TensorMeta
	}{
		{"small", TensorMeta{Name: "x", DataType: "FP32", Shape: []int64{1, 64}}},
		{"image", TensorMeta{Name: "x", DataType: "FP32", Shape: []int64{1, 3, 224, 224}}},
	}
	for _, size := range sizes {
		inputs, err := BuildInputs(&ModelMeta{Name: "m", Inputs: []TensorMeta{size.meta}}, nil, 1)
		if err != nil {
			b.Fatal(err)
		}
		jsonResp := []byte(`{"model_name":"m","model_version":"1","outputs":[{"name":"scores","datatype":"FP32","shape":[4],"data":[0.5,0.25,0.125,1]}]}`)
		binHeader := `{"model_name":"m","model_version":"1","outputs":[{"name":"scores","datatype":"FP32","shape":[4],"parameters":{"binary_data_size":16}}]}`
		binResp := append([]byte(binHeader), make([]byte, 16)...)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			if r.Header.Get(clientHeaderInferenceLength) != "" {
				w.Header().Set("Content-Type", "application/octet-stream")
				w.Header().Set(clientHeaderInferenceLength, strconv.Itoa(len(binHeader)))
				_, _ = w.Write(binResp)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(jsonResp)
		}))
		fake, addr := clientTestNewGRPC(b, nil)
		fake.model = "m"
		fake.inputs = inputs
		fake.timeoutUS.Store(10_000_000)

		for _, proto := range []string{ProtoREST, ProtoRESTBinary, ProtoGRPC} {
			b.Run("proto="+proto+"/input="+size.name, func(b *testing.B) {
				c, err := NewClient(ClientOptions{Protocol: proto, HTTPBase: srv.URL, GRPCAddr: addr, Model: "m",
					Inputs: inputs, Timeout: 10 * time.Second})
				if err != nil {
					b.Fatal(err)
				}
				defer c.Close()
				b.SetBytes(int64(len(c.body)))
				b.ReportAllocs()
				b.ResetTimer()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						if o, detail := c.Infer(context.Background()); o != Good {
							b.Errorf("%v %s", o, detail)
							return
						}
					}
				})
			})
		}

		b.Run("proto=http-baseline/input="+size.name, func(b *testing.B) {
			body, headerLen, err := clientEncodeREST(inputs, 10_000_000, true)
			if err != nil {
				b.Fatal(err)
			}
			hc := clientNewHTTP()
			defer hc.CloseIdleConnections()
			url := srv.URL + "/v2/models/m/infer"
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
					req.Header.Set(clientHeaderInferenceLength, strconv.Itoa(headerLen))
					resp, err := hc.Do(req)
					if err != nil {
						b.Error(err)
						return
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			})
		})

		b.Run("proto=grpc-baseline/input="+size.name, func(b *testing.B) {
			c, err := NewClient(ClientOptions{Protocol: ProtoGRPC, GRPCAddr: addr, Model: "m", Inputs: inputs, Timeout: 10 * time.Second})
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := c.grpcClient.ModelInfer(context.Background(), c.grpcReq); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
		srv.Close()
	}
}

// clientTestBackend serves the real REST and gRPC APIs in
// TestClientAgainstServer: it checks that the inputs arrive as BuildInputs
// made them, with the timeout as their deadline, and fails as told.
type clientTestBackend struct {
	api.Backend // the methods the test does not call panic

	models map[string]models.Metadata
	// mu guards inputs, which the test fills once the server runs: a
	// request's bytes on a socket order nothing for the race detector.
	mu      sync.RWMutex
	inputs  map[string][]Tensor
	timeout time.Duration
	err     atomic.Pointer[error]
}

func (b *clientTestBackend) Preadmit(context.Context, string, string, time.Time) error { return nil }

// Ready: the server is serving (REST closes its connections while not).
func (b *clientTestBackend) Ready() bool { return true }

func (b *clientTestBackend) Metadata(name, _ string) (models.Metadata, error) {
	md, ok := b.models[name]
	if !ok {
		return models.Metadata{}, fmt.Errorf("%w: %q", models.ErrModelNotFound, name)
	}
	return md, nil
}

func (b *clientTestBackend) Infer(_ context.Context, name, _ string, req *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	b.mu.RLock()
	defer b.mu.RUnlock()
	want := b.inputs[name]
	if len(req.Inputs) != len(want) {
		return nil, "", fmt.Errorf("%w: %d inputs, want %d", models.ErrInvalidInput, len(req.Inputs), len(want))
	}
	for i, in := range req.Inputs {
		w := want[i]
		if in.Name != w.Name || string(in.DataType) != w.DataType || fmt.Sprint(in.Shape) != fmt.Sprint(w.Shape) || !bytes.Equal(in.Data, w.Raw) {
			return nil, "", fmt.Errorf("%w: input %d differs", models.ErrInvalidInput, i)
		}
	}
	if left := time.Until(req.Deadline); left <= 0 || left > b.timeout {
		return nil, "", fmt.Errorf("%w: deadline in %v, want within %v", models.ErrInvalidInput, left, b.timeout)
	}
	if err := b.err.Load(); err != nil && *err != nil {
		return nil, "", *err
	}
	return &runtime.InferResponse{Outputs: []runtime.Tensor{
		{Name: "scores", DataType: runtime.FP32, Shape: []int64{1, 2}, Data: []byte{0, 0, 0, 63, 0, 0, 128, 62}},
		{Name: "labels", DataType: runtime.Bytes, Shape: []int64{1}, Data: []byte{3, 0, 0, 0, ']', '"', '['}},
	}}, "1", nil
}

// TestClientAgainstServer drives sloserve's own REST and gRPC servers: the
// encodings must be ones they accept, and their errors must classify as
// the load generator's outcomes say.
func TestClientAgainstServer(t *testing.T) {
	meta := map[string]models.Metadata{
		"ocr-det": {Name: "ocr-det", Versions: []string{"1"}, Inputs: []runtime.TensorSpec{
			{Name: "image", DataType: runtime.FP32, Shape: []int64{-1, 3, 8, 8}},
			{Name: "ids", DataType: runtime.Int64, Shape: []int64{-1, 4}},
			{Name: "mask", DataType: runtime.Bool, Shape: []int64{-1, 4}},
			{Name: "small", DataType: runtime.Uint8, Shape: []int64{2}},
			{Name: "text", DataType: runtime.Bytes, Shape: []int64{-1, -1}},
		}, Outputs: []runtime.TensorSpec{{Name: "scores", DataType: runtime.FP32, Shape: []int64{-1, 2}}}},
		"half": {Name: "half", Versions: []string{"1"}, Inputs: []runtime.TensorSpec{
			{Name: "x", DataType: runtime.FP16, Shape: []int64{-1, 16}},
			{Name: "y", DataType: runtime.BF16, Shape: []int64{-1, 16}},
		}},
	}
	backend := &clientTestBackend{models: meta, inputs: map[string][]Tensor{}, timeout: 2 * time.Second}
	rest := httptest.NewServer(api.NewREST(backend, api.Limits{}, nil))
	defer rest.Close()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := api.NewGRPC(backend, api.Limits{}, nil)
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()

	specs := map[string]map[string]InputSpec{"ocr-det": {"text": {Shape: []int64{2, 3}}}}
	backend.mu.Lock()
	for name := range meta {
		md, err := FetchMetadata(t.Context(), nil, rest.URL, name, "")
		if err != nil {
			t.Fatal(err)
		}
		if backend.inputs[name], err = BuildInputs(md, specs[name], 5); err != nil {
			t.Fatal(err)
		}
	}
	// Values the JSON encoding must keep exactly.
	image := backend.inputs["ocr-det"][0].Raw
	binary.LittleEndian.PutUint32(image, math.Float32bits(math.SmallestNonzeroFloat32))
	binary.LittleEndian.PutUint32(image[4:], math.Float32bits(-math.MaxFloat32))
	backend.mu.Unlock()

	type serverCase struct {
		err     error
		outcome Outcome
		rest    string // the detail's prefix over REST
		grpc    string // over gRPC
	}
	cases := []serverCase{
		{nil, Good, "", ""},
		{qos.ErrRejected, Rejected, "429: request rejected", "ResourceExhausted: request rejected"},
		{qos.ErrQueueFull, Rejected, "429: model queue is full", "ResourceExhausted: model queue is full"},
		{qos.ErrDropped, Dropped, "504: request dropped", "DeadlineExceeded: request dropped"},
		{models.ErrNotReady, Failed, "503: model not ready", "Unavailable: model not ready"},
		{fmt.Errorf("%w: over the limit", models.ErrTooLarge), Failed, "413: request too large", "ResourceExhausted: request too large"},
		{errors.New("boom"), Failed, "500: boom", "Internal: boom"},
	}
	for _, proto := range []string{ProtoREST, ProtoRESTBinary, ProtoGRPC} {
		for _, model := range []string{"ocr-det", "half"} {
			t.Run("proto="+proto+"/model="+model, func(t *testing.T) {
				c, err := NewClient(ClientOptions{Protocol: proto, HTTPBase: rest.URL, GRPCAddr: lis.Addr().String(),
					Model: model, Inputs: backend.inputs[model], Timeout: backend.timeout})
				if proto == ProtoREST && model == "half" {
					if err == nil || !strings.Contains(err.Error(), "FP16 data cannot be sent as JSON") {
						t.Fatalf("error %v, want FP16 refused over JSON", err)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				for _, tc := range cases {
					backend.err.Store(&tc.err)
					detail := tc.rest
					if proto == ProtoGRPC {
						detail = tc.grpc
					}
					clientTestInfer(t, c, clientTestCase{mode: fmt.Sprint(tc.err), outcome: tc.outcome, detail: detail})
				}
			})
		}
	}
}

// Details of one kind of failure are equal whatever the durations in the
// server's message, so a report counts them together.
func TestClientDetailElidesDurations(t *testing.T) {
	cases := []struct{ what, msg, want string }{
		{"504", "model m version 1: request dropped: deadline passed while queued: 54.3ms late", "504: model m version 1: request dropped: deadline passed while queued: … late"},
		{"429", "misses the deadline by 1.7ms (queue ahead 0.0ms, execution 12µs)", "429: misses the deadline by … (queue ahead …, execution …)"},
		{"503", "model ocr-det version 12 is not ready", "503: model ocr-det version 12 is not ready"},
		{"Unavailable", "", "Unavailable"},
	}
	for _, c := range cases {
		if got := clientDetail(c.what, c.msg); got != c.want {
			t.Errorf("clientDetail(%q, %q) = %q, want %q", c.what, c.msg, got, c.want)
		}
	}
}

// clientTestCapture is a server codec that keeps every request message's
// bytes as they arrived, then decodes them as protobuf.
type clientTestCapture struct {
	mu   sync.Mutex
	msgs [][]byte
}

func (c *clientTestCapture) Marshal(v any) (mem.BufferSlice, error) { return clientProto.Marshal(v) }
func (c *clientTestCapture) Name() string                           { return "proto" }
func (c *clientTestCapture) Unmarshal(data mem.BufferSlice, v any) error {
	if _, ok := v.(*inference.ModelInferRequest); ok {
		c.mu.Lock()
		c.msgs = append(c.msgs, data.Materialize())
		c.mu.Unlock()
	}
	return clientProto.Unmarshal(data, v)
}

// The message marshalled once is sent as it is, and its bytes on the wire
// are those of the ordinary generated client marshalling the same request:
// the server decodes it the same way.
func TestClientGRPCPreEncoded(t *testing.T) {
	inputs := clientTestInputs(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	capture := &clientTestCapture{}
	fake := &clientTestGRPC{model: "ocr-det", inputs: inputs}
	fake.mode.Store("ok")
	fake.timeoutUS.Store(250_000)
	srv := grpc.NewServer(grpc.ForceServerCodecV2(capture))
	inference.RegisterGRPCInferenceServiceServer(srv, fake)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)

	c, err := NewClient(ClientOptions{Protocol: ProtoGRPC, GRPCAddr: lis.Addr().String(), Model: "ocr-det",
		Inputs: inputs, Timeout: 250 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for range 2 {
		clientTestInfer(t, c, clientTestCase{mode: "ok", outcome: Good})
	}
	// The ordinary path: the generated client and grpc's protobuf codec.
	if _, err := c.grpcClient.ModelInfer(t.Context(), c.grpcReq); err != nil {
		t.Fatal(err)
	}
	capture.mu.Lock()
	msgs := capture.msgs
	capture.mu.Unlock()
	if len(msgs) != 3 {
		t.Fatalf("the server decoded %d messages, want 3", len(msgs))
	}
	ordinary := msgs[2]
	if len(ordinary) < len(inputs[0].Raw) {
		t.Fatalf("the ordinary message has %d bytes, less than its input's %d", len(ordinary), len(inputs[0].Raw))
	}
	for i, m := range msgs[:2] {
		if !bytes.Equal(m, ordinary) {
			t.Errorf("pre-encoded message %d: %d bytes differ from the ordinary encoder's %d", i, len(m), len(ordinary))
		}
	}

	// The codec hands grpc the client's own bytes, not a copy, and
	// marshals anything else as protobuf.
	data, err := clientCodec{}.Marshal(c.grpcMsg)
	if err != nil {
		t.Fatal(err)
	}
	if len(data) != 1 || &data[0].ReadOnlyData()[0] != &c.grpcMsg.b[0] || data.Len() != len(c.grpcMsg.b) {
		t.Errorf("pre-encoded message marshalled into %d buffers of %d bytes, want the client's %d bytes themselves",
			len(data), data.Len(), len(c.grpcMsg.b))
	}
	data, err = clientCodec{}.Marshal(c.grpcReq)
	if err != nil {
		t.Fatal(err)
	}
	if got := data.Materialize(); !bytes.Equal(got, ordinary) {
		t.Errorf("a message marshalled by the codec: %d bytes, want the ordinary %d", len(got), len(ordinary))
	}
	data.Free()
}

// A client's requests take its connections in turn, each request on one,
// and Close closes them all.
func TestClientGRPCConnections(t *testing.T) {
	inputs := clientTestInputs(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	peers := map[string]int{}
	fake := &clientTestGRPC{model: "ocr-det", inputs: inputs}
	fake.mode.Store("ok")
	srv := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if p, ok := peer.FromContext(ctx); ok {
			mu.Lock()
			peers[p.Addr.String()]++
			mu.Unlock()
		}
		return h(ctx, req)
	}))
	inference.RegisterGRPCInferenceServiceServer(srv, fake)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)

	for _, tc := range []struct {
		connections, want int
	}{{0, DefaultConnections}, {1, 1}, {3, 3}} {
		t.Run(fmt.Sprint(tc.connections), func(t *testing.T) {
			clear(peers)
			c, err := NewClient(ClientOptions{Protocol: ProtoGRPC, GRPCAddr: lis.Addr().String(), Model: "ocr-det",
				Inputs: inputs, Connections: tc.connections, ServerTimeout: -1})
			if err != nil {
				t.Fatal(err)
			}
			// Sequential calls, then concurrent ones: turns, not chance.
			const rounds = 4
			for range rounds * tc.want {
				clientTestInfer(t, c, clientTestCase{mode: "ok", outcome: Good})
			}
			var wg sync.WaitGroup
			for range rounds * tc.want {
				wg.Go(func() {
					if o, detail := c.Infer(t.Context()); o != Good {
						t.Errorf("%v %s", o, detail)
					}
				})
			}
			wg.Wait()
			mu.Lock()
			got := maps.Clone(peers)
			mu.Unlock()
			if len(got) != tc.want {
				t.Errorf("requests came over %d connections %v, want %d", len(got), got, tc.want)
			}
			for addr, n := range got {
				if n != 2*rounds {
					t.Errorf("connection %s carried %d requests, want %d (%v)", addr, n, 2*rounds, got)
				}
			}
			if err := c.Close(); err != nil {
				t.Fatal(err)
			}
			for i, conn := range c.grpcConns {
				if s := conn.GetState(); s != connectivity.Shutdown {
					t.Errorf("connection %d after Close: %v", i, s)
				}
			}
		})
	}

	for _, n := range []int{-1, clientMaxConnections + 1} {
		_, err := NewClient(ClientOptions{Protocol: ProtoGRPC, GRPCAddr: lis.Addr().String(), Model: "ocr-det", Connections: n})
		if want := fmt.Sprintf("connections %d: want 1 to %d", n, clientMaxConnections); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("connections %d: %v, want %q", n, err, want)
		}
	}
}

// A request's id goes out on every path without copying the prepared
// message on the client's own paths: the server sees it in the protocol's
// `id` (and every length of a REST body still right: the fake reads the
// body by Content-Length and the binary part by the JSON part's length),
// a request sent without one has none, and an answer for another id fails
// while one that does not echo the id is taken.
func TestClientRequestID(t *testing.T) {
	inputs := clientTestInputs(t)
	type sent struct {
		lastID func() (string, bool)
		mode   func(string)
		c      *Client
		okCode string // the detail's status for an answer that came
	}
	var paths []struct {
		name string
		sent
	}
	add := func(name string, s sent) {
		paths = append(paths, struct {
			name string
			sent
		}{name, s})
	}
	for _, proto := range []string{ProtoREST, ProtoRESTBinary} {
		for _, viaNetHTTP := range []bool{false, true} {
			fake, srv := clientTestNewREST(t, inputs)
			fake.timeoutUS.Store(2_000_000)
			opts := ClientOptions{Protocol: proto, HTTPBase: srv.URL, Model: "ocr-det", Inputs: inputs, Timeout: 2 * time.Second}
			name := proto + "/own connections"
			if viaNetHTTP {
				opts.HTTPClient, name = srv.Client(), proto+"/net/http"
			}
			c, err := NewClient(opts)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			add(name, sent{
				lastID: func() (string, bool) {
					id, _ := fake.lastID.Load().(*string)
					if id == nil {
						return "", false
					}
					return *id, true
				},
				mode: func(m string) { fake.mode.Store(m) }, c: c, okCode: "200",
			})
		}
	}
	fake, addr := clientTestNewGRPC(t, inputs)
	fake.timeoutUS.Store(2_000_000)
	c, err := NewClient(ClientOptions{Protocol: ProtoGRPC, GRPCAddr: addr, Model: "ocr-det", Inputs: inputs, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	add(ProtoGRPC, sent{
		lastID: func() (string, bool) { id, _ := fake.lastID.Load().(string); return id, id != "" },
		mode:   func(m string) { fake.mode.Store(m) }, c: c, okCode: "OK",
	})

	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) {
			good := "good"
			if p.name == ProtoGRPC {
				good = "ok"
			}
			for _, id := range []string{"17", `a "quoted" \ id é`, "12345678901234567890"} {
				p.mode(good)
				if o, detail := p.c.InferID(t.Context(), id); o != Good {
					t.Fatalf("id %q: %v %q, want good", id, o, detail)
				}
				if got, ok := p.lastID(); !ok || got != id {
					t.Errorf("the server saw id %q (given: %v), want %q", got, ok, id)
				}
				// The prepared message is not changed by a send with an id.
				if o, detail := p.c.Infer(t.Context()); o != Good {
					t.Fatalf("no id after id %q: %v %q, want good", id, o, detail)
				}
				if got, ok := p.lastID(); ok {
					t.Errorf("a request sent without an id came with %q", got)
				}
			}
			p.mode("wrong-id")
			want := p.okCode + `: invalid response: id "other", want "17"`
			if o, detail := p.c.InferID(t.Context(), "17"); o != Failed || detail != want {
				t.Errorf("answer for another id: %v %q, want failed %q", o, detail, want)
			}
			p.mode("no-id")
			if o, detail := p.c.InferID(t.Context(), "17"); o != Good {
				t.Errorf("answer without the id: %v %q, want good", o, detail)
			}
		})
	}
}
