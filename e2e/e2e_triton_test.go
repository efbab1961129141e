package e2e

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/configs/tritonpb"
)

// tritonDynYAML and tritonDynPbtxt are one model's config in both formats.
const (
	tritonDynYAML = `max_batch_size: 8
instances: 1
slo: {latency_ms: 2000, class: latency-critical, priority: 1}
dynamic_batching: {max_queue_delay: 1ms, preferred_batch_sizes: [4, 8], priority_levels: 2}
max_queue_size: 64
resources: {max_compute_share: 0.5}
`
	tritonDynPbtxt = `# as a Triton model repository has it
name: "dyn"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "input_vectors", data_type: TYPE_FP32, dims: [ 10 ] } ]
output [ { name: "output_scalars", data_type: TYPE_FP32, dims: [ ], label_filename: "labels.txt" } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 1000
  priority_levels: 2
  default_priority_level: 1
  default_queue_policy { max_queue_size: 64 }
}
parameters { key: "slo.latency_ms" value: { string_value: "2000" } }
parameters { key: "resources.max_compute_share" value: { string_value: "0.5" } }
`
)

// tritonRepo is a repository with model dyn configured by config.yaml
// (pbtxt false) or by a Triton config.pbtxt.
func tritonRepo(t *testing.T, pbtxt bool) string {
	t.Helper()
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), tritonDynYAML})
	if pbtxt {
		dir := filepath.Join(repo, "dyn")
		if err := os.Remove(filepath.Join(dir, "config.yaml")); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "config.pbtxt"), []byte(tritonDynPbtxt), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return repo
}

// What a server says about dyn: metadata (REST), config (REST JSON and
// gRPC).
type tritonView struct {
	metadata, configJSON []byte
	config               *tritonpb.ModelConfig
}

func viewOf(t *testing.T, s *testServer) tritonView {
	t.Helper()
	var v tritonView
	var code int
	if code, v.metadata, _ = s.do(t, "GET", "/v2/models/dyn", nil); code != 200 {
		t.Fatalf("metadata: %d %s", code, v.metadata)
	}
	if code, v.configJSON, _ = s.do(t, "GET", "/v2/models/dyn/config", nil); code != 200 {
		t.Fatalf("config: %d %s", code, v.configJSON)
	}
	resp, err := s.grpc.ModelConfig(t.Context(), &inference.ModelConfigRequest{Name: "dyn"})
	if err != nil {
		t.Fatal(err)
	}
	v.config = resp.GetConfig()
	return v
}

// The same repository served through config.yaml and through a Triton
// config.pbtxt describes itself the same, over REST and gRPC, in Triton's
// model config shape; Triton's readiness answers hold.
func TestE2ETritonModelConfig(t *testing.T) {
	yamlServer := startServer(t, tritonRepo(t, false), "")
	fromYAML := viewOf(t, yamlServer)
	if err := yamlServer.stop(); err != nil {
		t.Fatal(err)
	}
	s := startServer(t, tritonRepo(t, true), "")
	fromPbtxt := viewOf(t, s)

	if !bytes.Equal(fromYAML.metadata, fromPbtxt.metadata) {
		t.Errorf("metadata differs:\nconfig.yaml  %s\nconfig.pbtxt %s", fromYAML.metadata, fromPbtxt.metadata)
	}
	if !bytes.Equal(fromYAML.configJSON, fromPbtxt.configJSON) {
		t.Errorf("REST config differs:\nconfig.yaml  %s\nconfig.pbtxt %s", fromYAML.configJSON, fromPbtxt.configJSON)
	}
	if !proto.Equal(fromYAML.config, fromPbtxt.config) {
		t.Errorf("gRPC config differs:\nconfig.yaml  %v\nconfig.pbtxt %v", fromYAML.config, fromPbtxt.config)
	}
	if !s.logHas("level=WARN", "output[0].label_filename", "ignored") {
		t.Error("no warning naming the config.pbtxt field sloserve ignores")
	}

	c := fromPbtxt.config
	db := c.GetDynamicBatching()
	if c.GetName() != "dyn" || c.GetPlatform() != "onnxruntime_onnx" || c.GetMaxBatchSize() != 8 ||
		len(c.GetInput()) != 1 || c.GetInput()[0].GetName() != "input_vectors" || c.GetInput()[0].GetDataType() != tritonpb.DataType_TYPE_FP32 ||
		!slices.Equal(c.GetInput()[0].GetDims(), []int64{10}) || len(c.GetOutput()[0].GetDims()) != 0 ||
		!slices.Equal(db.GetPreferredBatchSize(), []int32{4, 8}) || db.GetMaxQueueDelayMicroseconds() != 1000 ||
		db.GetPriorityLevels() != 2 || db.GetDefaultPriorityLevel() != 1 || db.GetDefaultQueuePolicy().GetMaxQueueSize() != 64 ||
		c.GetParameters()["slo.latency_ms"].GetStringValue() != "2000" || c.GetParameters()["slo.class"].GetStringValue() != "latency-critical" ||
		c.GetParameters()["resources.max_compute_share"].GetStringValue() != "0.5" {
		t.Errorf("config %v", c)
	}
	var rest struct {
		MaxBatchSize int `json:"max_batch_size"`
		Input        []struct {
			DataType string  `json:"data_type"`
			Dims     []int64 `json:"dims"`
		} `json:"input"`
	}
	if err := json.Unmarshal(fromPbtxt.configJSON, &rest); err != nil || rest.MaxBatchSize != 8 || rest.Input[0].DataType != "TYPE_FP32" || rest.Input[0].Dims[0] != 10 {
		t.Errorf("REST config %s: %v", fromPbtxt.configJSON, err)
	}

	t.Run("wire numbers", func(t *testing.T) {
		// A Triton client decodes by field number; check the ones its
		// tools read against Triton's model_config.proto, independently
		// of the generated code.
		resp, err := s.grpc.ModelConfig(t.Context(), &inference.ModelConfigRequest{Name: "dyn"})
		if err != nil {
			t.Fatal(err)
		}
		wire, err := proto.Marshal(resp)
		if err != nil {
			t.Fatal(err)
		}
		// ModelConfigResponse.config = 1; ModelConfig.name = 1, platform = 2,
		// max_batch_size = 4, input = 5, dynamic_batching = 11;
		// ModelInput.name = 1, data_type = 2 (TYPE_FP32 = 11);
		// ModelDynamicBatching.max_queue_delay_microseconds = 2,
		// priority_levels = 4.
		cfg := wireFields(t, wireFields(t, wire)[1][0])
		input := wireFields(t, cfg[5][0])
		batching := wireFields(t, cfg[11][0])
		if string(cfg[1][0]) != "dyn" || string(cfg[2][0]) != "onnxruntime_onnx" || wireVarint(cfg[4][0]) != 8 ||
			string(input[1][0]) != "input_vectors" || wireVarint(input[2][0]) != 11 ||
			wireVarint(batching[2][0]) != 1000 || wireVarint(batching[4][0]) != 2 {
			t.Errorf("config on the wire: %v", cfg)
		}
	})

	t.Run("readiness", func(t *testing.T) {
		for _, name := range []string{"nosuch", "dyn\x00"} {
			r, err := s.grpc.ModelReady(t.Context(), &inference.ModelReadyRequest{Name: name})
			if err != nil || r.GetReady() {
				t.Errorf("gRPC ModelReady(%q) = %v, %v; want OK, not ready", name, r, err)
			}
		}
		if r, err := s.grpc.ModelReady(t.Context(), &inference.ModelReadyRequest{Name: "dyn", Version: "7"}); err != nil || r.GetReady() {
			t.Errorf("gRPC ModelReady(dyn, 7) = %v, %v; want OK, not ready", r, err)
		}
		if code, b, _ := s.do(t, "GET", "/v2/models/nosuch/ready", nil); code != 400 || !bytes.Contains(b, []byte("not ready")) {
			t.Errorf("REST ready of an unknown model: %d %s, want 400 as Triton answers", code, b)
		}
		if code, _, _ := s.do(t, "GET", "/v2/models/dyn/ready", nil); code != 200 {
			t.Errorf("REST ready of dyn: %d", code)
		}
		if code, b, _ := s.do(t, "GET", "/v2/models/nosuch/config", nil); code != 404 {
			t.Errorf("config of an unknown model: %d %s, want 404", code, b)
		}
	})

	t.Run("batch stats", func(t *testing.T) {
		for _, rows := range []int{1, 3, 3} {
			if _, err := s.grpc.ModelInfer(t.Context(), grpcDyn("dyn", rows)); err != nil {
				t.Fatal(err)
			}
		}
		st, err := s.grpc.ModelStatistics(t.Context(), &inference.ModelStatisticsRequest{Name: "dyn"})
		if err != nil {
			t.Fatal(err)
		}
		count := map[uint64]uint64{}
		for _, b := range st.GetModelStats()[0].GetBatchStats() {
			count[b.GetBatchSize()] = b.GetComputeInfer().GetCount()
			if b.GetComputeInfer().GetNs() == 0 || b.GetComputeInput().GetCount() != b.GetComputeInfer().GetCount() {
				t.Errorf("batch %d: %v", b.GetBatchSize(), b)
			}
		}
		// Sequential requests run alone: one execution each, none from
		// the warm-up.
		if count[1] != 1 || count[3] != 2 || len(count) != 2 || st.GetModelStats()[0].GetExecutionCount() != 3 {
			t.Errorf("batch_stats %v, execution_count %d; want 1 of size 1 and 2 of size 3", count, st.GetModelStats()[0].GetExecutionCount())
		}
	})
}

// wireFields splits a message's encoding into its length-delimited and
// varint fields by number.
func wireFields(t *testing.T, b []byte) map[protowire.Number][][]byte {
	t.Helper()
	out := map[protowire.Number][][]byte{}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			t.Fatalf("bad tag: %v", protowire.ParseError(n))
		}
		b = b[n:]
		var v []byte
		switch typ {
		case protowire.BytesType:
			v, n = protowire.ConsumeBytes(b)
		case protowire.VarintType:
			_, n = protowire.ConsumeVarint(b)
			v = b[:max(n, 0)]
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			t.Fatalf("field %d: %v", num, protowire.ParseError(n))
		}
		out[num] = append(out[num], v)
		b = b[n:]
	}
	return out
}

// closeFloats reports whether two raw FP32 tensors are equal up to float
// rounding.
func closeFloats(a, b []byte) bool {
	if len(a) != len(b) || len(a)%4 != 0 {
		return false
	}
	for i := 0; i < len(a); i += 4 {
		x := math.Float32frombits(binary.LittleEndian.Uint32(a[i:]))
		y := math.Float32frombits(binary.LittleEndian.Uint32(b[i:]))
		if math.Abs(float64(x-y)) > 1e-4*max(1, math.Abs(float64(y))) {
			return false
		}
	}
	return true
}

func wireVarint(b []byte) uint64 {
	v, _ := protowire.ConsumeVarint(b)
	return v
}

// ModelStreamInfer over a real socket: every request answered once with
// its id and the output ModelInfer gives; a bad request ends only itself;
// a client that never reads cannot make the server run (and hold) more
// than the stream's in-flight bound.
func TestE2ETritonStreamInfer(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo,
		repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"},
		repoModel{"wide", testModel(t, "example_dynamic_axes.onnx"), ""})
	s := startServer(t, repo, "")

	t.Run("ids and errors", func(t *testing.T) {
		stream, err := s.grpc.ModelStreamInfer(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]string{} // id -> error substring, "" for success
		expect := map[string][]byte{}
		for i := range 20 {
			req := grpcDyn("dyn", 1+i%4)
			vals := make([]float32, 10*(1+i%4))
			for j := range vals {
				vals[j] = float32(i) + float32(j)/8
			}
			req.RawInputContents[0] = f32bytes(vals)
			req.Id = fmt.Sprintf("r%d", i)
			unary, err := s.grpc.ModelInfer(t.Context(), req)
			if err != nil {
				t.Fatal(err)
			}
			want[req.Id], expect[req.Id] = "", unary.GetRawOutputContents()[0]
			if err := stream.Send(req); err != nil {
				t.Fatal(err)
			}
			if i == 7 {
				unknown := grpcDyn("nosuch", 1)
				unknown.Id = "unknown"
				bad := grpcDyn("dyn", 2)
				bad.Id, bad.Inputs[0].Shape = "bad-shape", []int64{2, 11}
				want[unknown.Id], want[bad.Id] = `model not found: "nosuch"`, "raw data has 80 bytes"
				for _, r := range []*inference.ModelInferRequest{unknown, bad} {
					if err := stream.Send(r); err != nil {
						t.Fatal(err)
					}
				}
			}
		}
		if err := stream.CloseSend(); err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for {
			a, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("the stream ended with %v after %d answers", err, len(seen))
			}
			id := a.GetInferResponse().GetId()
			wantErr, ok := want[id]
			switch {
			case !ok || seen[id]:
				t.Errorf("unexpected answer for %q", id)
			case wantErr == "" && (a.GetErrorMessage() != "" || !closeFloats(a.GetInferResponse().GetRawOutputContents()[0], expect[id])):
				// Streamed requests may run merged into batches: equal to
				// ModelInfer's answer up to float rounding.
				t.Errorf("%s: error %q, output %v, ModelInfer's %v", id, a.GetErrorMessage(), a.GetInferResponse().GetRawOutputContents(), expect[id])
			case wantErr != "" && !strings.Contains(a.GetErrorMessage(), wantErr):
				t.Errorf("%s: error %q, want it to contain %q", id, a.GetErrorMessage(), wantErr)
			}
			seen[id] = true
		}
		if len(seen) != len(want) {
			t.Errorf("%d answers, want %d", len(seen), len(want))
		}
	})

	t.Run("slow reader", func(t *testing.T) {
		const (
			requests = 200
			rows     = 6000 // 240 KB in, 24 KB out
		)
		// A client with fixed 64 KiB receive windows, as a slow reader's
		// would stay: the server can push only a few answers into it.
		conn, err := grpc.NewClient(s.grpcAddr, grpc.WithTransportCredentials(s.creds),
			grpc.WithInitialWindowSize(64<<10), grpc.WithInitialConnWindowSize(64<<10))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		stream, err := inference.NewGRPCInferenceServiceClient(conn).ModelStreamInfer(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		ran := func() uint64 {
			st, err := s.grpc.ModelStatistics(t.Context(), &inference.ModelStatisticsRequest{Name: "wide"})
			if err != nil {
				t.Fatal(err)
			}
			if len(st.GetModelStats()) == 0 {
				return 0
			}
			is := st.GetModelStats()[0].GetInferenceStats()
			return is.GetSuccess().GetCount() + is.GetFail().GetCount()
		}
		before := ran()
		var sent atomic.Int64
		sendDone := make(chan error, 1)
		go func() {
			for i := range requests {
				req := grpcDyn("wide", rows)
				req.Id = fmt.Sprint(i)
				if err := stream.Send(req); err != nil {
					sendDone <- err
					return
				}
				sent.Add(1)
			}
			sendDone <- stream.CloseSend()
		}()
		// Wait until the server stops running more.
		var settled uint64
		for stable, last := 0, uint64(1<<63); stable < 10; {
			time.Sleep(50 * time.Millisecond)
			if n := ran() - before; n == last {
				stable++
			} else {
				stable, last = 0, n
			}
			settled = last
		}
		t.Logf("a stalled stream: %d requests run, %d sent", settled, sent.Load())
		// The in-flight slots, plus the few answers the client's window
		// and gRPC's write quota take; the server's 16 MiB receive window
		// alone would hold some 70 requests.
		if bound := uint64(api.DefaultStreamInflight + 24); settled > bound {
			t.Errorf("with a client that does not read, the server ran %d requests; want at most %d", settled, bound)
		}
		if n := sent.Load(); n >= requests {
			t.Errorf("all %d sends went through a stalled stream", n)
		}
		got := map[string]bool{}
		for len(got) < requests {
			a, err := stream.Recv()
			if err != nil {
				t.Fatalf("after %d answers: %v", len(got), err)
			}
			if a.GetErrorMessage() != "" || len(a.GetInferResponse().GetRawOutputContents()[0]) != 4*rows {
				t.Fatalf("answer %q: %q", a.GetInferResponse().GetId(), a.GetErrorMessage())
			}
			got[a.GetInferResponse().GetId()] = true
		}
		if err := <-sendDone; err != nil {
			t.Fatal(err)
		}
		if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
			t.Errorf("stream end: %v, want EOF", err)
		}
	})
}
