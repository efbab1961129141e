package api

import (
	"encoding/json"
	"net/http"
	"reflect"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/configs/tritonpb"
)

func TestGRPCModelConfig(t *testing.T) {
	c := inference.NewGRPCInferenceServiceClient(startGRPC(t, newFakeBackend(), grpcTestLimits))
	for _, version := range []string{"", "1"} {
		resp, err := c.ModelConfig(t.Context(), &inference.ModelConfigRequest{Name: "sum", Version: version})
		if err != nil {
			t.Fatal(err)
		}
		cfg := resp.GetConfig()
		in, out := cfg.GetInput(), cfg.GetOutput()
		if cfg.GetName() != "sum" || cfg.GetPlatform() != "onnxruntime_onnx" || cfg.GetBackend() != "onnxruntime" || cfg.GetMaxBatchSize() != 8 ||
			len(in) != 1 || in[0].GetName() != "x" || in[0].GetDataType() != tritonpb.DataType_TYPE_FP32 || !reflect.DeepEqual(in[0].GetDims(), []int64{4}) ||
			len(out) != 2 || out[1].GetName() != "count" || out[1].GetDataType() != tritonpb.DataType_TYPE_INT64 || len(out[1].GetDims()) != 0 {
			t.Errorf("version %q: config %v", version, cfg)
		}
		if db := cfg.GetDynamicBatching(); !reflect.DeepEqual(db.GetPreferredBatchSize(), []int32{4}) {
			t.Errorf("dynamic_batching %v", db)
		}
		if g := cfg.GetInstanceGroup(); len(g) != 1 || g[0].GetCount() != 1 || g[0].GetKind() != tritonpb.ModelInstanceGroup_KIND_CPU {
			t.Errorf("instance_group %v", g)
		}
		p := cfg.GetParameters()
		if p["slo.latency_ms"].GetStringValue() != "50" || p["slo.class"].GetStringValue() != "latency-critical" {
			t.Errorf("parameters %v", p)
		}
	}
	_, err := c.ModelConfig(t.Context(), &inference.ModelConfigRequest{Name: "nope"})
	wantGRPCCode(t, err, codes.NotFound, `"nope"`)
	_, err = c.ModelConfig(t.Context(), &inference.ModelConfigRequest{Name: "sum", Version: "9"})
	wantGRPCCode(t, err, codes.NotFound, "version not found")
}

// The REST config is the same message in Triton's JSON: proto field names,
// enums by name, integers as numbers (not protojson's strings), every
// scalar present.
func TestRESTModelConfig(t *testing.T) {
	h, _ := newRESTTest(restLimits)
	for _, path := range []string{"/v2/models/sum/config", "/v2/models/sum/versions/1/config"} {
		rec := restCall{method: "GET", path: path}.do(t, t.Context(), h)
		if rec.Code != http.StatusOK {
			t.Fatalf("%s: %d %s", path, rec.Code, rec.Body)
		}
		var cfg struct {
			Name           string `json:"name"`
			Platform       string `json:"platform"`
			MaxBatchSize   *int   `json:"max_batch_size"`
			DefaultModelFN string `json:"default_model_filename"`
			Input          []struct {
				Name     string  `json:"name"`
				DataType string  `json:"data_type"`
				Dims     []int64 `json:"dims"` // fails to decode if strings
				Format   string  `json:"format"`
			} `json:"input"`
			DynamicBatching struct {
				PreferredBatchSize []int32 `json:"preferred_batch_size"`
				MaxQueueDelayUS    *uint64 `json:"max_queue_delay_microseconds"`
			} `json:"dynamic_batching"`
			VersionPolicy struct {
				Latest struct {
					NumVersions int `json:"num_versions"`
				} `json:"latest"`
			} `json:"version_policy"`
			Parameters map[string]struct {
				StringValue string `json:"string_value"`
			} `json:"parameters"`
			SequenceBatching any `json:"sequence_batching"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &cfg); err != nil {
			t.Fatalf("%s: %v\n%s", path, err, rec.Body)
		}
		if cfg.Name != "sum" || cfg.Platform != "onnxruntime_onnx" || cfg.MaxBatchSize == nil || *cfg.MaxBatchSize != 8 ||
			len(cfg.Input) != 1 || cfg.Input[0].DataType != "TYPE_FP32" || !reflect.DeepEqual(cfg.Input[0].Dims, []int64{4}) ||
			cfg.Input[0].Format != "FORMAT_NONE" || cfg.VersionPolicy.Latest.NumVersions != 1 ||
			!reflect.DeepEqual(cfg.DynamicBatching.PreferredBatchSize, []int32{4}) || cfg.DynamicBatching.MaxQueueDelayUS == nil ||
			cfg.Parameters["slo.latency_ms"].StringValue != "50" {
			t.Errorf("%s: %+v\n%s", path, cfg, rec.Body)
		}
	}
	for path, want := range map[string]int{"/v2/models/nope/config": 404, "/v2/models/sum/versions/9/config": 404} {
		rec := restCall{method: "GET", path: path}.do(t, t.Context(), h)
		if rec.Code != want {
			t.Errorf("%s: %d, want %d", path, rec.Code, want)
		}
		restErrorBody(t, rec)
	}
}
