package api

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// grpcTestLimits are the limits the gRPC tests run with.
var grpcTestLimits = Limits{MaxRequestBytes: 1 << 20, MaxTensorElements: 1 << 16}

// startGRPC serves b on an in-memory listener with NewGRPC and returns a
// connection to it; both are stopped when the test ends.
func startGRPC(tb testing.TB, b Backend, lim Limits) *grpc.ClientConn {
	tb.Helper()
	return serveGRPC(tb, NewGRPC(b, lim, slog.New(slog.DiscardHandler)))
}

// serveGRPC serves srv on an in-memory listener and returns a connection.
func serveGRPC(tb testing.TB, srv *grpc.Server) *grpc.ClientConn {
	tb.Helper()
	lis := bufconn.Listen(1 << 20)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(lis) }()
	conn, err := grpc.NewClient("passthrough:///bufconn",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(1<<30), grpc.MaxCallRecvMsgSize(1<<30)),
	)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		conn.Close()
		srv.Stop()
		if err := <-done; err != nil {
			tb.Errorf("Serve: %v", err)
		}
	})
	return conn
}

func grpcFP32Bytes(vals ...float32) []byte {
	var b []byte
	for _, v := range vals {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
	}
	return b
}

func grpcInt64Bytes(vals ...int64) []byte {
	var b []byte
	for _, v := range vals {
		b = binary.LittleEndian.AppendUint64(b, uint64(v))
	}
	return b
}

// wantGRPCCode fails the test unless err is a status with code and a message
// containing msg.
func wantGRPCCode(t *testing.T, err error, code codes.Code, msg string) {
	t.Helper()
	st, ok := status.FromError(err)
	if !ok {
		t.Fatalf("error %v is not a gRPC status", err)
	}
	if st.Code() != code || !strings.Contains(st.Message(), msg) {
		t.Fatalf("got %s %q, want %s containing %q", st.Code(), st.Message(), code, msg)
	}
}

func TestGRPCServerRPCs(t *testing.T) {
	fb := newFakeBackend()
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, fb, grpcTestLimits))
	ctx := t.Context()

	t.Run("ServerLive", func(t *testing.T) {
		resp, err := c.ServerLive(ctx, &inference.ServerLiveRequest{})
		if err != nil || !resp.GetLive() {
			t.Fatalf("got %v, %v; want live", resp, err)
		}
	})
	t.Run("ServerReady", func(t *testing.T) {
		resp, err := c.ServerReady(ctx, &inference.ServerReadyRequest{})
		if err != nil || !resp.GetReady() {
			t.Fatalf("got %v, %v; want ready", resp, err)
		}
	})
	t.Run("ServerMetadata", func(t *testing.T) {
		resp, err := c.ServerMetadata(ctx, &inference.ServerMetadataRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetName() != "sloserve" || resp.GetVersion() != "test" || !slices.Equal(resp.GetExtensions(), Extensions) {
			t.Fatalf("got %v", resp)
		}
	})
	t.Run("ModelReady", func(t *testing.T) {
		for _, tc := range []struct {
			name, version string
			want          bool
		}{
			{"sum", "", true},
			{"sum", "1", true},
			{"unready", "", false},
			// As Triton: unknown models and versions are not ready, not errors.
			{"nope", "", false},
			{"sum", "9", false},
		} {
			resp, err := c.ModelReady(ctx, &inference.ModelReadyRequest{Name: tc.name, Version: tc.version})
			if err != nil || resp.GetReady() != tc.want {
				t.Errorf("%s/%s: got %v, %v; want ready=%v", tc.name, tc.version, resp, err, tc.want)
			}
		}
	})
	t.Run("ModelMetadata", func(t *testing.T) {
		resp, err := c.ModelMetadata(ctx, &inference.ModelMetadataRequest{Name: "sum"})
		if err != nil {
			t.Fatal(err)
		}
		want := &inference.ModelMetadataResponse{
			Name:     "sum",
			Versions: []string{"1"},
			Platform: "onnxruntime_onnx",
			Inputs:   []*inference.ModelMetadataResponse_TensorMetadata{{Name: "x", Datatype: "FP32", Shape: []int64{-1, 4}}},
			Outputs: []*inference.ModelMetadataResponse_TensorMetadata{
				{Name: "y", Datatype: "FP32", Shape: []int64{-1}},
				{Name: "count", Datatype: "INT64", Shape: []int64{-1}},
			},
		}
		if !proto.Equal(resp, want) {
			t.Fatalf("got %v\nwant %v", resp, want)
		}
		_, err = c.ModelMetadata(ctx, &inference.ModelMetadataRequest{Name: "sum", Version: "9"})
		wantGRPCCode(t, err, codes.NotFound, "version")
	})
	t.Run("ModelStatistics", func(t *testing.T) {
		resp, err := c.ModelStatistics(ctx, &inference.ModelStatisticsRequest{Name: "sum"})
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.GetModelStats()) != 1 {
			t.Fatalf("got %v", resp)
		}
		st := resp.GetModelStats()[0]
		if st.GetName() != "sum" || st.GetVersion() != "1" || st.GetInferenceCount() != 3 ||
			st.GetExecutionCount() != 2 || st.GetLastInference() != 0 || st.GetInferenceStats().GetSuccess() == nil {
			t.Fatalf("got %v", st)
		}
		all, err := c.ModelStatistics(ctx, &inference.ModelStatisticsRequest{})
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, s := range all.GetModelStats() {
			names = append(names, s.GetName())
		}
		if !slices.Equal(names, []string{"echo", "sum"}) {
			t.Fatalf("got models %v", names)
		}
	})
	t.Run("RepositoryIndex", func(t *testing.T) {
		for _, tc := range []struct {
			ready bool
			want  []string
		}{
			{false, []string{"echo:READY", "sum:READY", "unready:UNAVAILABLE"}},
			{true, []string{"echo:READY", "sum:READY"}},
		} {
			resp, err := c.RepositoryIndex(ctx, &inference.RepositoryIndexRequest{Ready: tc.ready})
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, m := range resp.GetModels() {
				if m.GetVersion() != "1" {
					t.Errorf("%s: version %q", m.GetName(), m.GetVersion())
				}
				got = append(got, m.GetName()+":"+m.GetState())
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("ready=%v: got %v, want %v", tc.ready, got, tc.want)
			}
		}
	})
	t.Run("RepositoryModelLoadUnload", func(t *testing.T) {
		if _, err := c.RepositoryModelLoad(ctx, &inference.RepositoryModelLoadRequest{ModelName: "unready"}); err != nil {
			t.Fatal(err)
		}
		if r, err := c.ModelReady(ctx, &inference.ModelReadyRequest{Name: "unready"}); err != nil || !r.GetReady() {
			t.Fatalf("after load: %v, %v", r, err)
		}
		// tritonclient always sends unload_dependents.
		unload := &inference.RepositoryModelUnloadRequest{
			ModelName:  "unready",
			Parameters: map[string]*inference.ModelRepositoryParameter{"unload_dependents": {ParameterChoice: &inference.ModelRepositoryParameter_BoolParam{}}},
		}
		if _, err := c.RepositoryModelUnload(ctx, unload); err != nil {
			t.Fatal(err)
		}
		if r, err := c.ModelReady(ctx, &inference.ModelReadyRequest{Name: "unready"}); err != nil || r.GetReady() {
			t.Fatalf("after unload: %v, %v", r, err)
		}
	})
}

func TestGRPCServerNotReady(t *testing.T) {
	fb := newFakeBackend()
	fb.notLive, fb.notReady = true, true
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, fb, grpcTestLimits))
	live, err := c.ServerLive(t.Context(), &inference.ServerLiveRequest{})
	if err != nil || live.GetLive() {
		t.Errorf("ServerLive: %v, %v; want false", live, err)
	}
	ready, err := c.ServerReady(t.Context(), &inference.ServerReadyRequest{})
	if err != nil || ready.GetReady() {
		t.Errorf("ServerReady: %v, %v; want false", ready, err)
	}
}

// grpcSumRequest is [[1,2,3,4],[5,6,7,8]] for the sum model, in typed contents
// or in raw_input_contents.
func grpcSumRequest(raw bool) *inference.ModelInferRequest {
	x := &inference.ModelInferRequest_InferInputTensor{Name: "x", Datatype: "FP32", Shape: []int64{2, 4}}
	req := &inference.ModelInferRequest{ModelName: "sum", Id: "req-1", Inputs: []*inference.ModelInferRequest_InferInputTensor{x}}
	vals := []float32{1, 2, 3, 4, 5, 6, 7, 8}
	if raw {
		req.RawInputContents = [][]byte{grpcFP32Bytes(vals...)}
	} else {
		x.Contents = &inference.InferTensorContents{Fp32Contents: vals}
	}
	return req
}

func TestGRPCInferSum(t *testing.T) {
	fb := newFakeBackend()
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, fb, grpcTestLimits))
	for _, tc := range []struct {
		name    string
		raw     bool
		outputs []string
		want    []*inference.ModelInferResponse_InferOutputTensor
		wantRaw [][]byte
	}{
		{
			name: "fp32_contents",
			want: []*inference.ModelInferResponse_InferOutputTensor{
				{Name: "y", Datatype: "FP32", Shape: []int64{2}},
				{Name: "count", Datatype: "INT64", Shape: []int64{2}},
			},
			wantRaw: [][]byte{grpcFP32Bytes(10, 26), grpcInt64Bytes(4, 4)},
		},
		{
			name: "raw_input_contents",
			raw:  true,
			want: []*inference.ModelInferResponse_InferOutputTensor{
				{Name: "y", Datatype: "FP32", Shape: []int64{2}},
				{Name: "count", Datatype: "INT64", Shape: []int64{2}},
			},
			wantRaw: [][]byte{grpcFP32Bytes(10, 26), grpcInt64Bytes(4, 4)},
		},
		{
			name:    "requested_output",
			raw:     true,
			outputs: []string{"count"},
			want:    []*inference.ModelInferResponse_InferOutputTensor{{Name: "count", Datatype: "INT64", Shape: []int64{2}}},
			wantRaw: [][]byte{grpcInt64Bytes(4, 4)},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := grpcSumRequest(tc.raw)
			for _, o := range tc.outputs {
				req.Outputs = append(req.Outputs, &inference.ModelInferRequest_InferRequestedOutputTensor{
					Name: o,
					// binary_data is a REST matter; gRPC ignores it.
					Parameters: map[string]*inference.InferParameter{"binary_data": {ParameterChoice: &inference.InferParameter_BoolParam{BoolParam: true}}},
				})
			}
			resp, err := c.ModelInfer(t.Context(), req)
			if err != nil {
				t.Fatal(err)
			}
			want := &inference.ModelInferResponse{
				ModelName:         "sum",
				ModelVersion:      "1",
				Id:                "req-1",
				Outputs:           tc.want,
				RawOutputContents: tc.wantRaw,
			}
			if !proto.Equal(resp, want) {
				t.Fatalf("got %v\nwant %v", resp, want)
			}
			fb.mu.Lock()
			seen := fb.lastReq
			fb.mu.Unlock()
			if !slices.Equal(seen.Outputs, tc.outputs) {
				t.Errorf("backend saw outputs %q, want %q", seen.Outputs, tc.outputs)
			}
			if x := seen.Inputs[0]; x.DataType != runtime.FP32 || !slices.Equal(x.Shape, []int64{2, 4}) || string(x.Data) != string(grpcFP32Bytes(1, 2, 3, 4, 5, 6, 7, 8)) {
				t.Errorf("backend saw input %+v", x)
			}
		})
	}
}

// grpcEchoCase is one datatype round trip through the echo model.
type grpcEchoCase struct {
	dt       string
	shape    []int64
	contents *inference.InferTensorContents // nil: raw
	raw      []byte                         // the expected (and, without contents, sent) data
}

func grpcEchoCases() []grpcEchoCase {
	u16 := func(v ...uint16) []byte {
		var b []byte
		for _, x := range v {
			b = binary.LittleEndian.AppendUint16(b, x)
		}
		return b
	}
	u32 := func(v ...uint32) []byte {
		var b []byte
		for _, x := range v {
			b = binary.LittleEndian.AppendUint32(b, x)
		}
		return b
	}
	u64 := func(v ...uint64) []byte {
		var b []byte
		for _, x := range v {
			b = binary.LittleEndian.AppendUint64(b, x)
		}
		return b
	}
	f64 := func(v ...float64) []byte {
		var b []byte
		for _, x := range v {
			b = binary.LittleEndian.AppendUint64(b, math.Float64bits(x))
		}
		return b
	}
	var bytesRaw []byte
	for _, e := range []string{"héllo", "", "x\x00y"} {
		bytesRaw = runtime.AppendBytesElement(bytesRaw, []byte(e))
	}
	return []grpcEchoCase{
		{"BOOL", []int64{3}, &inference.InferTensorContents{BoolContents: []bool{true, false, true}}, []byte{1, 0, 1}},
		{"INT8", []int64{3}, &inference.InferTensorContents{IntContents: []int32{-128, 0, 127}}, []byte{0x80, 0, 0x7f}},
		{"INT16", []int64{1, 3}, &inference.InferTensorContents{IntContents: []int32{-32768, -1, 32767}}, u16(0x8000, 0xffff, 0x7fff)},
		{"INT32", []int64{2}, &inference.InferTensorContents{IntContents: []int32{math.MinInt32, math.MaxInt32}}, u32(0x80000000, 0x7fffffff)},
		{"INT64", []int64{2}, &inference.InferTensorContents{Int64Contents: []int64{math.MinInt64, -2}}, grpcInt64Bytes(math.MinInt64, -2)},
		{"UINT8", []int64{2}, &inference.InferTensorContents{UintContents: []uint32{0, 255}}, []byte{0, 255}},
		{"UINT16", []int64{2}, &inference.InferTensorContents{UintContents: []uint32{1, 65535}}, u16(1, 65535)},
		{"UINT32", []int64{2}, &inference.InferTensorContents{UintContents: []uint32{7, math.MaxUint32}}, u32(7, math.MaxUint32)},
		{"UINT64", []int64{2}, &inference.InferTensorContents{Uint64Contents: []uint64{9, math.MaxUint64}}, u64(9, math.MaxUint64)},
		{"FP32", []int64{2, 2}, &inference.InferTensorContents{Fp32Contents: []float32{1.5, -2, float32(math.Inf(1)), 0}}, grpcFP32Bytes(1.5, -2, float32(math.Inf(1)), 0)},
		{"FP64", []int64{2}, &inference.InferTensorContents{Fp64Contents: []float64{math.Pi, -0.25}}, f64(math.Pi, -0.25)},
		{"BYTES", []int64{3}, &inference.InferTensorContents{BytesContents: [][]byte{[]byte("héllo"), {}, []byte("x\x00y")}}, bytesRaw},
		{"BYTES", []int64{3, 1}, nil, bytesRaw},
		{"FP16", []int64{2}, nil, u16(0x3c00, 0xc000)}, // 1, -2
		{"BF16", []int64{2}, nil, u16(0x3f80, 0xc000)}, // 1, -2
		{"FP32", []int64{0, 4}, nil, []byte{}},
	}
}

func TestGRPCInferEchoDatatypes(t *testing.T) {
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, newFakeBackend(), grpcTestLimits))
	for _, tc := range grpcEchoCases() {
		kind := "typed"
		if tc.contents == nil {
			kind = "raw"
		}
		t.Run(fmt.Sprintf("%s/%s/%v", tc.dt, kind, tc.shape), func(t *testing.T) {
			in := &inference.ModelInferRequest_InferInputTensor{Name: "in", Datatype: tc.dt, Shape: tc.shape, Contents: tc.contents}
			req := &inference.ModelInferRequest{ModelName: "echo", Inputs: []*inference.ModelInferRequest_InferInputTensor{in}}
			if tc.contents == nil {
				req.RawInputContents = [][]byte{tc.raw}
			}
			resp, err := c.ModelInfer(t.Context(), req)
			if err != nil {
				t.Fatal(err)
			}
			want := &inference.ModelInferResponse{
				ModelName:         "echo",
				ModelVersion:      "1",
				Outputs:           []*inference.ModelInferResponse_InferOutputTensor{{Name: "in_out", Datatype: tc.dt, Shape: tc.shape}},
				RawOutputContents: [][]byte{tc.raw},
			}
			if !proto.Equal(resp, want) {
				t.Fatalf("got %v\nwant %v", resp, want)
			}
		})
	}
}

func TestGRPCInferErrors(t *testing.T) {
	lim := Limits{MaxRequestBytes: 1 << 16, MaxTensorElements: 1 << 10}
	fb := newFakeBackend()
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, fb, lim))

	type input = inference.ModelInferRequest_InferInputTensor
	one := func(in *input, raw ...[]byte) *inference.ModelInferRequest {
		return &inference.ModelInferRequest{ModelName: "echo", Inputs: []*input{in}, RawInputContents: raw}
	}
	fp32 := func(v ...float32) *inference.InferTensorContents {
		return &inference.InferTensorContents{Fp32Contents: v}
	}

	for _, tc := range []struct {
		name  string
		req   *inference.ModelInferRequest
		err   error // the backend fails with it
		code  codes.Code
		inMsg string
	}{
		{
			name:  "unknown model",
			req:   &inference.ModelInferRequest{ModelName: "nope"},
			code:  codes.NotFound,
			inMsg: `model not found: "nope"`,
		},
		{
			name: "unknown version",
			req: func() *inference.ModelInferRequest {
				r := grpcSumRequest(true)
				r.ModelVersion = "7"
				return r
			}(),
			code:  codes.NotFound,
			inMsg: `version "7"`,
		},
		{
			name:  "unready model",
			req:   &inference.ModelInferRequest{ModelName: "unready"},
			code:  codes.Unavailable,
			inMsg: "not ready",
		},
		{
			name:  "backend invalid input",
			req:   &inference.ModelInferRequest{ModelName: "sum", Inputs: []*input{{Name: "x", Datatype: "FP32", Shape: []int64{1, 3}, Contents: fp32(1, 2, 3)}}},
			code:  codes.InvalidArgument,
			inMsg: "sum wants x FP32 [-1,4]",
		},
		{
			name:  "backend error",
			req:   grpcSumRequest(true),
			err:   errors.New("runner exploded"),
			code:  codes.Internal,
			inMsg: "runner exploded",
		},
		{
			name:  "backend deadline",
			req:   grpcSumRequest(true),
			err:   fmt.Errorf("queued too long: %w", context.DeadlineExceeded),
			code:  codes.DeadlineExceeded,
			inMsg: "queued too long",
		},
		{
			name:  "missing input name",
			req:   one(&input{Datatype: "FP32", Shape: []int64{1}, Contents: fp32(1)}),
			code:  codes.InvalidArgument,
			inMsg: "input 0 has no name",
		},
		{
			name:  "missing datatype",
			req:   one(&input{Name: "a", Shape: []int64{1}, Contents: fp32(1)}),
			code:  codes.InvalidArgument,
			inMsg: `input "a" has no datatype`,
		},
		{
			name:  "bad datatype",
			req:   one(&input{Name: "a", Datatype: "FLOAT32", Shape: []int64{1}, Contents: fp32(1)}),
			code:  codes.InvalidArgument,
			inMsg: `unknown datatype "FLOAT32"`,
		},
		{
			name:  "missing shape",
			req:   one(&input{Name: "a", Datatype: "FP32", Contents: fp32(1)}),
			code:  codes.InvalidArgument,
			inMsg: `input "a" has no shape`,
		},
		{
			name:  "shape count mismatch",
			req:   one(&input{Name: "a", Datatype: "FP32", Shape: []int64{2, 2}, Contents: fp32(1, 2, 3)}),
			code:  codes.InvalidArgument,
			inMsg: "contents hold 3 elements, the shape needs 4",
		},
		{
			name:  "no data",
			req:   one(&input{Name: "a", Datatype: "FP32", Shape: []int64{2}}),
			code:  codes.InvalidArgument,
			inMsg: "contents hold 0 elements, the shape needs 2",
		},
		{
			name:  "negative dim",
			req:   one(&input{Name: "a", Datatype: "FP32", Shape: []int64{-1, 4}, Contents: fp32(1, 2, 3, 4)}),
			code:  codes.InvalidArgument,
			inMsg: "dimension 0 is -1",
		},
		{
			name:  "overflowing shape",
			req:   one(&input{Name: "a", Datatype: "FP32", Shape: []int64{math.MaxInt64, math.MaxInt64, 2}}),
			code:  codes.InvalidArgument,
			inMsg: "invalid shape",
		},
		{
			name:  "too many elements",
			req:   one(&input{Name: "a", Datatype: "FP32", Shape: []int64{1 << 20}}),
			code:  codes.ResourceExhausted,
			inMsg: "has 1048576 elements, the limit is 1024",
		},
		{
			name: "raw count not inputs count",
			req: &inference.ModelInferRequest{
				ModelName:        "echo",
				Inputs:           []*input{{Name: "a", Datatype: "UINT8", Shape: []int64{1}}, {Name: "b", Datatype: "UINT8", Shape: []int64{1}}},
				RawInputContents: [][]byte{{1}},
			},
			code:  codes.InvalidArgument,
			inMsg: "raw_input_contents has 1 entries for 2 inputs",
		},
		{
			name:  "raw size mismatch",
			req:   one(&input{Name: "a", Datatype: "FP32", Shape: []int64{2}}, grpcFP32Bytes(1)),
			code:  codes.InvalidArgument,
			inMsg: "raw data has 4 bytes, 2 elements of FP32 need 8",
		},
		{
			name:  "raw BYTES count mismatch",
			req:   one(&input{Name: "a", Datatype: "BYTES", Shape: []int64{2}}, runtime.AppendBytesElement(nil, []byte("x"))),
			code:  codes.InvalidArgument,
			inMsg: "BYTES data holds 1 elements, shape needs 2",
		},
		{
			name:  "raw BYTES truncated",
			req:   one(&input{Name: "a", Datatype: "BYTES", Shape: []int64{1}}, []byte{9, 0, 0, 0, 'x'}),
			code:  codes.InvalidArgument,
			inMsg: "BYTES element declares 9 bytes",
		},
		{
			name:  "raw and contents",
			req:   one(&input{Name: "a", Datatype: "FP32", Shape: []int64{1}, Contents: fp32(1)}, grpcFP32Bytes(1)),
			code:  codes.InvalidArgument,
			inMsg: `input "a" has both raw_input_contents and fp32_contents`,
		},
		{
			name:  "wrong contents field",
			req:   one(&input{Name: "a", Datatype: "FP32", Shape: []int64{1}, Contents: &inference.InferTensorContents{IntContents: []int32{1}}}),
			code:  codes.InvalidArgument,
			inMsg: "datatype FP32 takes fp32_contents, not int_contents",
		},
		{
			name:  "extra contents field",
			req:   one(&input{Name: "a", Datatype: "INT64", Shape: []int64{1}, Contents: &inference.InferTensorContents{Int64Contents: []int64{1}, BoolContents: []bool{true}}}),
			code:  codes.InvalidArgument,
			inMsg: "datatype INT64 takes int64_contents, not bool_contents",
		},
		{
			name:  "FP16 typed",
			req:   one(&input{Name: "a", Datatype: "FP16", Shape: []int64{1}, Contents: fp32(1)}),
			code:  codes.InvalidArgument,
			inMsg: "FP16 has no typed contents field; send it in raw_input_contents",
		},
		{
			name:  "uint8 out of range",
			req:   one(&input{Name: "a", Datatype: "UINT8", Shape: []int64{2}, Contents: &inference.InferTensorContents{UintContents: []uint32{1, 256}}}),
			code:  codes.InvalidArgument,
			inMsg: "element 1: value 256 is out of range for UINT8",
		},
		{
			name:  "int8 out of range",
			req:   one(&input{Name: "a", Datatype: "INT8", Shape: []int64{1}, Contents: &inference.InferTensorContents{IntContents: []int32{-129}}}),
			code:  codes.InvalidArgument,
			inMsg: "value -129 is out of range for INT8",
		},
		{
			name:  "int16 out of range",
			req:   one(&input{Name: "a", Datatype: "INT16", Shape: []int64{1}, Contents: &inference.InferTensorContents{IntContents: []int32{40000}}}),
			code:  codes.InvalidArgument,
			inMsg: "value 40000 is out of range for INT16",
		},
		{
			name: "duplicate input",
			req: &inference.ModelInferRequest{
				ModelName: "echo",
				Inputs:    []*input{{Name: "a", Datatype: "FP32", Shape: []int64{1}, Contents: fp32(1)}, {Name: "a", Datatype: "FP32", Shape: []int64{1}, Contents: fp32(2)}},
			},
			code:  codes.InvalidArgument,
			inMsg: `input "a" appears more than once`,
		},
		{
			name: "duplicate output",
			req: func() *inference.ModelInferRequest {
				r := grpcSumRequest(true)
				r.Outputs = []*inference.ModelInferRequest_InferRequestedOutputTensor{{Name: "y"}, {Name: "count"}, {Name: "y"}}
				return r
			}(),
			code:  codes.InvalidArgument,
			inMsg: `output "y" is requested more than once`,
		},
		{
			name: "sequence_id",
			req: &inference.ModelInferRequest{
				ModelName:  "echo",
				Parameters: map[string]*inference.InferParameter{"sequence_id": {ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: 5}}},
			},
			code:  codes.InvalidArgument,
			inMsg: `parameter "sequence_id" is not supported`,
		},
		{
			name: "classification output",
			req: &inference.ModelInferRequest{
				ModelName: "sum",
				Outputs: []*inference.ModelInferRequest_InferRequestedOutputTensor{{
					Name:       "y",
					Parameters: map[string]*inference.InferParameter{"classification": {ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: 3}}},
				}},
			},
			code:  codes.InvalidArgument,
			inMsg: `output "y": parameter "classification" is not supported`,
		},
		{
			name: "unknown output",
			req: func() *inference.ModelInferRequest {
				r := grpcSumRequest(true)
				r.Outputs = []*inference.ModelInferRequest_InferRequestedOutputTensor{{Name: "z"}}
				return r
			}(),
			code:  codes.InvalidArgument,
			inMsg: `unknown output "z"`,
		},
		{
			name:  "message over MaxRecvMsgSize",
			req:   one(&input{Name: "a", Datatype: "UINT8", Shape: []int64{1 << 17}}, make([]byte, 1<<17)),
			code:  codes.ResourceExhausted,
			inMsg: "larger than max",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fb.mu.Lock()
			fb.inferErr = tc.err
			fb.mu.Unlock()
			resp, err := c.ModelInfer(t.Context(), tc.req)
			if err == nil {
				t.Fatalf("got %v, want an error", resp)
			}
			wantGRPCCode(t, err, tc.code, tc.inMsg)
		})
	}
}

func TestGRPCInferAcceptsParameters(t *testing.T) {
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, newFakeBackend(), grpcTestLimits))
	req := grpcSumRequest(false)
	req.Parameters = map[string]*inference.InferParameter{
		"priority": {ParameterChoice: &inference.InferParameter_Uint64Param{Uint64Param: 1}},
		"timeout":  {ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: 1000}},
		"custom":   {ParameterChoice: &inference.InferParameter_StringParam{StringParam: "x"}},
	}
	if _, err := c.ModelInfer(t.Context(), req); err != nil {
		t.Fatal(err)
	}
}

func TestGRPCRepositoryErrors(t *testing.T) {
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, newFakeBackend(), grpcTestLimits))
	str := func(s string) *inference.ModelRepositoryParameter {
		return &inference.ModelRepositoryParameter{ParameterChoice: &inference.ModelRepositoryParameter_StringParam{StringParam: s}}
	}
	for _, tc := range []struct {
		name   string
		load   *inference.RepositoryModelLoadRequest
		unload *inference.RepositoryModelUnloadRequest
		index  *inference.RepositoryIndexRequest
		code   codes.Code
		inMsg  string
	}{
		{name: "load path traversal", load: &inference.RepositoryModelLoadRequest{ModelName: "../x"}, code: codes.InvalidArgument, inMsg: `invalid model name "../x"`},
		{name: "load slash", load: &inference.RepositoryModelLoadRequest{ModelName: "a/b"}, code: codes.InvalidArgument, inMsg: "invalid model name"},
		{name: "load backslash", load: &inference.RepositoryModelLoadRequest{ModelName: `a\b`}, code: codes.InvalidArgument, inMsg: "invalid model name"},
		{name: "load NUL", load: &inference.RepositoryModelLoadRequest{ModelName: "a\x00"}, code: codes.InvalidArgument, inMsg: "invalid model name"},
		{name: "load dotdot", load: &inference.RepositoryModelLoadRequest{ModelName: ".."}, code: codes.InvalidArgument, inMsg: "invalid model name"},
		{name: "load empty", load: &inference.RepositoryModelLoadRequest{}, code: codes.InvalidArgument, inMsg: "model_name is required"},
		{name: "load unknown", load: &inference.RepositoryModelLoadRequest{ModelName: "nope"}, code: codes.NotFound, inMsg: `"nope"`},
		{
			name:  "load repository name",
			load:  &inference.RepositoryModelLoadRequest{RepositoryName: "models", ModelName: "sum"},
			code:  codes.InvalidArgument,
			inMsg: "repository_name is not supported",
		},
		{
			name: "load file override",
			load: &inference.RepositoryModelLoadRequest{ModelName: "sum", Parameters: map[string]*inference.ModelRepositoryParameter{
				"config": str("{}"), "file:1/model.onnx": {ParameterChoice: &inference.ModelRepositoryParameter_BytesParam{BytesParam: []byte("x")}},
			}},
			code:  codes.InvalidArgument,
			inMsg: `load parameter "file:1/model.onnx": file overrides are not supported`,
		},
		{
			name: "load config not a string",
			load: &inference.RepositoryModelLoadRequest{ModelName: "sum", Parameters: map[string]*inference.ModelRepositoryParameter{
				"config": {ParameterChoice: &inference.ModelRepositoryParameter_BytesParam{BytesParam: []byte("{}")}},
			}},
			code:  codes.InvalidArgument,
			inMsg: `parameter "config" must be a string_param`,
		},
		{
			name:  "load other parameters",
			load:  &inference.RepositoryModelLoadRequest{ModelName: "sum", Parameters: map[string]*inference.ModelRepositoryParameter{"force": str("1")}},
			code:  codes.InvalidArgument,
			inMsg: "parameters not supported: force",
		},
		{name: "unload path traversal", unload: &inference.RepositoryModelUnloadRequest{ModelName: "../x"}, code: codes.InvalidArgument, inMsg: "invalid model name"},
		{
			name:   "unload parameters",
			unload: &inference.RepositoryModelUnloadRequest{ModelName: "sum", Parameters: map[string]*inference.ModelRepositoryParameter{"force": str("yes")}},
			code:   codes.InvalidArgument,
			inMsg:  "parameters not supported: force",
		},
		{name: "unload unknown", unload: &inference.RepositoryModelUnloadRequest{ModelName: "nope"}, code: codes.NotFound, inMsg: `"nope"`},
		{name: "index repository name", index: &inference.RepositoryIndexRequest{RepositoryName: "models"}, code: codes.InvalidArgument, inMsg: "repository_name is not supported"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var err error
			switch {
			case tc.load != nil:
				_, err = c.RepositoryModelLoad(t.Context(), tc.load)
			case tc.unload != nil:
				_, err = c.RepositoryModelUnload(t.Context(), tc.unload)
			default:
				_, err = c.RepositoryIndex(t.Context(), tc.index)
			}
			wantGRPCCode(t, err, tc.code, tc.inMsg)
		})
	}
}

// grpcToggleBackend is a fakeBackend whose readiness may change while requests
// are in flight.
type grpcToggleBackend struct {
	*fakeBackend
	notReady atomic.Bool
}

func (b *grpcToggleBackend) Ready() bool { return !b.notReady.Load() }

func TestGRPCHealth(t *testing.T) {
	b := &grpcToggleBackend{fakeBackend: newFakeBackend()}
	h := grpc_health_v1.NewHealthClient(startGRPC(t, b, grpcTestLimits))
	for _, tc := range []struct {
		name     string
		notReady bool
		service  string
		want     grpc_health_v1.HealthCheckResponse_ServingStatus
	}{
		{"ready", false, "", grpc_health_v1.HealthCheckResponse_SERVING},
		{"ready inference service", false, "inference.GRPCInferenceService", grpc_health_v1.HealthCheckResponse_SERVING},
		{"not ready", true, "", grpc_health_v1.HealthCheckResponse_NOT_SERVING},
		{"not ready inference service", true, "inference.GRPCInferenceService", grpc_health_v1.HealthCheckResponse_NOT_SERVING},
		{"ready again", false, "", grpc_health_v1.HealthCheckResponse_SERVING},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b.notReady.Store(tc.notReady)
			resp, err := h.Check(t.Context(), &grpc_health_v1.HealthCheckRequest{Service: tc.service})
			if err != nil {
				t.Fatal(err)
			}
			if resp.GetStatus() != tc.want {
				t.Fatalf("got %v, want %v", resp.GetStatus(), tc.want)
			}
		})
	}
	t.Run("unknown service", func(t *testing.T) {
		_, err := h.Check(t.Context(), &grpc_health_v1.HealthCheckRequest{Service: "nope"})
		wantGRPCCode(t, err, codes.NotFound, "nope")
	})
	t.Run("list", func(t *testing.T) {
		b.notReady.Store(false)
		resp, err := h.List(t.Context(), &grpc_health_v1.HealthListRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.GetStatuses()) != 2 || resp.GetStatuses()["inference.GRPCInferenceService"].GetStatus() != grpc_health_v1.HealthCheckResponse_SERVING {
			t.Fatalf("got %v", resp)
		}
	})
}

func TestGRPCHealthWatch(t *testing.T) {
	b := &grpcToggleBackend{fakeBackend: newFakeBackend()}
	srv := grpc.NewServer()
	grpc_health_v1.RegisterHealthServer(srv, &grpcHealthServer{b: b, interval: time.Millisecond})
	h := grpc_health_v1.NewHealthClient(serveGRPC(t, srv))

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	stream, err := h.Watch(ctx, &grpc_health_v1.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	recv := func(want grpc_health_v1.HealthCheckResponse_ServingStatus) {
		t.Helper()
		resp, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetStatus() != want {
			t.Fatalf("got %v, want %v", resp.GetStatus(), want)
		}
	}
	recv(grpc_health_v1.HealthCheckResponse_SERVING)
	b.notReady.Store(true)
	recv(grpc_health_v1.HealthCheckResponse_NOT_SERVING)
	b.notReady.Store(false)
	recv(grpc_health_v1.HealthCheckResponse_SERVING)
	cancel()
	if _, err := stream.Recv(); status.Code(err) != codes.Canceled {
		t.Fatalf("after cancel: %v", err)
	}

	unknown, err := h.Watch(t.Context(), &grpc_health_v1.HealthCheckRequest{Service: "nope"})
	if err != nil {
		t.Fatal(err)
	}
	if resp, err := unknown.Recv(); err != nil || resp.GetStatus() != grpc_health_v1.HealthCheckResponse_SERVICE_UNKNOWN {
		t.Fatalf("unknown service: %v, %v", resp, err)
	}
}

func TestGRPCReflection(t *testing.T) {
	conn := startGRPC(t, newFakeBackend(), grpcTestLimits)
	stream, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&reflectionpb.ServerReflectionRequest{
		MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{},
	}); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	for _, want := range []string{"inference.GRPCInferenceService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} {
		if !slices.Contains(names, want) {
			t.Errorf("services %v lack %s", names, want)
		}
	}

	// The service's file descriptor resolves, so grpcurl can describe it.
	if err := stream.Send(&reflectionpb.ServerReflectionRequest{
		MessageRequest: &reflectionpb.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: "inference.GRPCInferenceService"},
	}); err != nil {
		t.Fatal(err)
	}
	resp, err = stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetFileDescriptorResponse().GetFileDescriptorProto()) == 0 {
		t.Fatalf("no file descriptor for the inference service: %v", resp)
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != io.EOF {
		t.Fatalf("after CloseSend: %v", err)
	}
}

// grpcPanicBackend panics in Infer.
type grpcPanicBackend struct{ *fakeBackend }

func (grpcPanicBackend) Infer(context.Context, string, string, *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	panic("boom")
}

// grpcLogCounter counts log records at error level.
type grpcLogCounter struct {
	errors atomic.Int32
}

func (h *grpcLogCounter) Enabled(context.Context, slog.Level) bool { return true }
func (h *grpcLogCounter) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelError {
		h.errors.Add(1)
	}
	return nil
}
func (h *grpcLogCounter) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *grpcLogCounter) WithGroup(string) slog.Handler      { return h }

func TestGRPCRecoversPanic(t *testing.T) {
	logs := &grpcLogCounter{}
	conn := serveGRPC(t, NewGRPC(grpcPanicBackend{newFakeBackend()}, grpcTestLimits, slog.New(logs)))
	c := inference.NewGRPCInferenceServiceClient(conn)
	_, err := c.ModelInfer(t.Context(), grpcSumRequest(true))
	wantGRPCCode(t, err, codes.Internal, "internal error")
	if n := logs.errors.Load(); n != 1 {
		t.Errorf("logged %d errors, want 1", n)
	}
	// The server still serves.
	if _, err := c.ServerLive(t.Context(), &inference.ServerLiveRequest{}); err != nil {
		t.Fatal(err)
	}
}

// grpcCtxBackend reports the context its Infer sees: the deadline on
// entered, then why it ended on ended.
type grpcCtxBackend struct {
	*fakeBackend
	entered chan time.Time // the deadline; zero if none
	ended   chan error
}

func (b *grpcCtxBackend) Infer(ctx context.Context, _, _ string, _ *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	d, _ := ctx.Deadline()
	b.entered <- d
	<-ctx.Done()
	b.ended <- ctx.Err()
	return nil, "", fmt.Errorf("waiting for a runner: %w", ctx.Err())
}

// TestGRPCInferContext checks that the client's deadline and cancellation
// reach the Backend. The deadline is far off so that a loaded machine cannot
// make it expire before the request arrives; the client cancels instead.
func TestGRPCInferContext(t *testing.T) {
	b := &grpcCtxBackend{fakeBackend: newFakeBackend(), entered: make(chan time.Time, 1), ended: make(chan error, 1)}
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, b, grpcTestLimits))
	deadline := time.Now().Add(time.Minute)
	ctx, cancel := context.WithDeadline(t.Context(), deadline)
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		_, err := c.ModelInfer(ctx, grpcSumRequest(true))
		errc <- err
	}()
	got := <-b.entered
	if d := got.Sub(deadline); d < -10*time.Second || d > time.Second {
		t.Errorf("Infer saw deadline %v, client set %v", got, deadline)
	}
	cancel()
	if err := <-b.ended; !errors.Is(err, context.Canceled) {
		t.Errorf("Infer's context ended with %v, want canceled", err)
	}
	if err := <-errc; status.Code(err) != codes.Canceled {
		t.Errorf("client got %v, want Canceled", err)
	}
}

func TestGRPCStopLeavesNoGoroutines(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	srv := NewGRPC(newFakeBackend(), grpcTestLimits, nil)
	lis := bufconn.Listen(1 << 16)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(lis) }()
	conn, err := grpc.NewClient("passthrough:///bufconn",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	c := inference.NewGRPCInferenceServiceClient(conn)
	if _, err := c.ModelInfer(t.Context(), grpcSumRequest(true)); err != nil {
		t.Fatal(err)
	}
	conn.Close()
	srv.GracefulStop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// BenchmarkGRPCInfer measures one sum inference over gRPC on an in-memory
// connection, against the same handler called directly (transport=none) as
// the baseline for the transport's cost.
func BenchmarkGRPCInfer(b *testing.B) {
	fb := newFakeBackend()
	c := inference.NewGRPCInferenceServiceClient(startGRPC(b, fb, grpcTestLimits))
	direct := &grpcService{b: fb, lim: grpcTestLimits, logger: slog.New(slog.DiscardHandler)}
	for _, tc := range []struct {
		transport string
		raw       bool
	}{{"bufconn", true}, {"bufconn", false}, {"none", true}} {
		contents := "typed"
		if tc.raw {
			contents = "raw"
		}
		b.Run(fmt.Sprintf("transport=%s/contents=%s/batch=1", tc.transport, contents), func(b *testing.B) {
			x := &inference.ModelInferRequest_InferInputTensor{Name: "x", Datatype: "FP32", Shape: []int64{1, 4}}
			req := &inference.ModelInferRequest{ModelName: "sum", Inputs: []*inference.ModelInferRequest_InferInputTensor{x}}
			if tc.raw {
				req.RawInputContents = [][]byte{grpcFP32Bytes(1, 2, 3, 4)}
			} else {
				x.Contents = &inference.InferTensorContents{Fp32Contents: []float32{1, 2, 3, 4}}
			}
			infer := c.ModelInfer
			if tc.transport == "none" {
				infer = func(ctx context.Context, req *inference.ModelInferRequest, _ ...grpc.CallOption) (*inference.ModelInferResponse, error) {
					return direct.ModelInfer(ctx, req)
				}
			}
			ctx := b.Context()
			b.ReportAllocs()
			for b.Loop() {
				if _, err := infer(ctx, req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// KServe's Python protocol sends the model name in field 1 (Triton's
// repository_name) for load and unload; sloserve reads it as the model.
func TestGRPCRepositoryKServeLayout(t *testing.T) {
	b := newFakeBackend()
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, b, Limits{}))
	if _, err := c.RepositoryModelUnload(t.Context(), &inference.RepositoryModelUnloadRequest{RepositoryName: "sum"}); err != nil {
		t.Fatal(err)
	}
	if ok, _ := b.ModelReady("sum", ""); ok {
		t.Fatal("sum still loaded after an unload naming it in field 1")
	}
	if _, err := c.RepositoryModelLoad(t.Context(), &inference.RepositoryModelLoadRequest{RepositoryName: "sum"}); err != nil {
		t.Fatal(err)
	}
	if ok, _ := b.ModelReady("sum", ""); !ok {
		t.Fatal("sum not loaded after a load naming it in field 1")
	}
	_, err := c.RepositoryModelLoad(t.Context(), &inference.RepositoryModelLoadRequest{RepositoryName: "other", ModelName: "sum"})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("a named repository with a model name: %v, want InvalidArgument", err)
	}
}

// grpcInt64 and grpcUint64 are request parameters.
func grpcInt64(v int64) *inference.InferParameter {
	return &inference.InferParameter{ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: v}}
}

func grpcUint64(v uint64) *inference.InferParameter {
	return &inference.InferParameter{ParameterChoice: &inference.InferParameter_Uint64Param{Uint64Param: v}}
}

func TestGRPCRequestOptions(t *testing.T) {
	fb := newFakeBackend()
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, fb, grpcTestLimits))
	for _, tc := range []struct {
		name         string
		params       map[string]*inference.InferParameter
		wantTimeout  time.Duration
		wantPriority int
		id           string // the request's id, passed on for the scheduler's debug lines
	}{
		{name: "none"},
		{name: "other parameters only", params: map[string]*inference.InferParameter{
			"custom": {ParameterChoice: &inference.InferParameter_StringParam{StringParam: "x"}}}},
		{name: "id", id: "client-7"},
		{name: "int64 timeout", params: map[string]*inference.InferParameter{"timeout": grpcInt64(250000)},
			wantTimeout: 250 * time.Millisecond},
		{name: "uint64 timeout", params: map[string]*inference.InferParameter{"timeout": grpcUint64(1)},
			wantTimeout: time.Microsecond},
		{name: "longest timeout", params: map[string]*inference.InferParameter{"timeout": grpcUint64(3600000000)},
			wantTimeout: time.Hour},
		{name: "int64 priority", params: map[string]*inference.InferParameter{"priority": grpcInt64(2)}, wantPriority: 2},
		{name: "uint64 priority", params: map[string]*inference.InferParameter{"priority": grpcUint64(1)}, wantPriority: 1},
		{name: "priority zero", params: map[string]*inference.InferParameter{"priority": grpcInt64(0)}},
		{name: "both", params: map[string]*inference.InferParameter{"priority": grpcUint64(3), "timeout": grpcInt64(1000000)},
			wantTimeout: time.Second, wantPriority: 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := grpcSumRequest(true)
			req.Parameters = tc.params
			req.Id = tc.id
			before := time.Now()
			if _, err := c.ModelInfer(t.Context(), req); err != nil {
				t.Fatal(err)
			}
			after := time.Now()
			fb.mu.Lock()
			got := fb.lastReq
			fb.mu.Unlock()
			checkDeadline(t, got.Deadline, before, after, tc.wantTimeout)
			// The arrival is stamped when the call's headers came, and
			// the timeout counts from it.
			if got.Arrival.Before(before) || got.Arrival.After(after) {
				t.Errorf("arrival %v not within the call (%v .. %v)", got.Arrival, before, after)
			}
			if tc.wantTimeout > 0 && !got.Deadline.Equal(got.Arrival.Add(tc.wantTimeout)) {
				t.Errorf("deadline %v, want arrival + %v = %v", got.Deadline, tc.wantTimeout, got.Arrival.Add(tc.wantTimeout))
			}
			if got.Priority != tc.wantPriority {
				t.Errorf("priority %d, want %d", got.Priority, tc.wantPriority)
			}
			if got.ID != tc.id {
				t.Errorf("id %q, want %q", got.ID, tc.id)
			}
		})
	}
}

func TestGRPCRequestOptionsRefused(t *testing.T) {
	fb := newFakeBackend()
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, fb, grpcTestLimits))
	str := &inference.InferParameter{ParameterChoice: &inference.InferParameter_StringParam{StringParam: "1000"}}
	dbl := &inference.InferParameter{ParameterChoice: &inference.InferParameter_DoubleParam{DoubleParam: 1.5}}
	boolean := &inference.InferParameter{ParameterChoice: &inference.InferParameter_BoolParam{BoolParam: true}}
	for _, tc := range []struct {
		name  string
		param string
		value *inference.InferParameter
		inMsg string
	}{
		{"negative timeout", "timeout", grpcInt64(-1),
			`parameter "timeout" must be an integer number of microseconds greater than 0, not -1`},
		{"most negative timeout", "timeout", grpcInt64(math.MinInt64),
			`parameter "timeout" must be an integer number of microseconds greater than 0, not -9223372036854775808`},
		{"zero timeout", "timeout", grpcUint64(0), `parameter "timeout" must be an integer number of microseconds greater than 0, not 0`},
		{"timeout over an hour", "timeout", grpcInt64(3600000001),
			`parameter "timeout" must be at most 3600000000 microseconds (1h0m0s), not 3600000001`},
		{"timeout overflowing Duration", "timeout", grpcUint64(math.MaxUint64),
			`parameter "timeout" must be at most 3600000000 microseconds (1h0m0s), not 18446744073709551615`},
		{"string timeout", "timeout", str, `parameter "timeout" must be an int64_param or a uint64_param, not string_param`},
		{"double timeout", "timeout", dbl, `parameter "timeout" must be an int64_param or a uint64_param, not double_param`},
		{"empty timeout", "timeout", &inference.InferParameter{}, `parameter "timeout" must be an int64_param or a uint64_param, not no value`},
		{"negative priority", "priority", grpcInt64(-2), `parameter "priority" must be an integer >= 0, not -2`},
		{"priority over int", "priority", grpcUint64(math.MaxUint64),
			`parameter "priority" must be at most 9223372036854775807, not 18446744073709551615`},
		{"bool priority", "priority", boolean, `parameter "priority" must be an int64_param or a uint64_param, not bool_param`},
		{"string priority", "priority", str, `parameter "priority" must be an int64_param or a uint64_param, not string_param`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fb.mu.Lock()
			fb.lastReq = nil
			fb.mu.Unlock()
			req := grpcSumRequest(true)
			req.Parameters = map[string]*inference.InferParameter{tc.param: tc.value}
			_, err := c.ModelInfer(t.Context(), req)
			wantGRPCCode(t, err, codes.InvalidArgument, tc.inMsg)
			fb.mu.Lock()
			defer fb.mu.Unlock()
			if fb.lastReq != nil {
				t.Fatal("the refused request reached the backend")
			}
		})
	}
}

// TestGRPCQoSRejected checks that the scheduler's refusal reaches the client
// as RESOURCE_EXHAUSTED with its message intact.
func TestGRPCQoSRejected(t *testing.T) {
	fb := newFakeBackend()
	fb.inferErr = fmt.Errorf("model %q: %w: predicted completion misses the deadline by 12.5ms (queue ahead 40ms, execution 7ms)",
		"sum", qos.ErrRejected)
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, fb, grpcTestLimits))
	req := grpcSumRequest(true)
	req.Parameters = map[string]*inference.InferParameter{"timeout": grpcInt64(30000)}
	_, err := c.ModelInfer(t.Context(), req)
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.ResourceExhausted || st.Message() != fb.inferErr.Error() {
		t.Fatalf("got %v, want RESOURCE_EXHAUSTED %q", err, fb.inferErr)
	}
}
