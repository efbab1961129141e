package server

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/sloserve/sloserve/configs"
)

func TestStageModel(t *testing.T) {
	write := func(t *testing.T, dir string, files map[string]string) {
		t.Helper()
		for name, body := range files {
			p := filepath.Join(dir, name)
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	tests := []struct {
		name     string
		files    map[string]string
		versions []int64
		model    string // what <version>/model.onnx of the first version must hold
		slo      float64
		wantErr  string
	}{
		{name: "model.onnx", files: map[string]string{"model.onnx": "m", "model.onnx.data": "d", "other.onnx": "o"}, versions: []int64{1}, model: "m"},
		{name: "one other onnx", files: map[string]string{"resnet.onnx": "r", "README": "x"}, versions: []int64{1}, model: "r"},
		{name: "versions", files: map[string]string{"2/model.onnx": "two", "7/model.onnx": "seven"}, versions: []int64{2, 7}, model: "two"},
		{name: "triton config", files: map[string]string{"1/model.onnx": "m", "config.pbtxt": "name: \"old\"\nplatform: \"onnxruntime_onnx\"\nparameters { key: \"slo.latency_ms\" value: { string_value: \"40\" } }\n"}, versions: []int64{1}, model: "m", slo: 40},
		{name: "own config over a triton one", files: map[string]string{"1/model.onnx": "m", "config.yaml": "slo: {latency_ms: 30, class: latency-critical}\n", "config.pbtxt": "name: \"old\"\n"}, versions: []int64{1}, model: "m", slo: 30},
		{name: "bad triton config", files: map[string]string{"model.onnx": "m", "config.pbtxt": "ignored"}, wantErr: "not a valid Triton model config"},
		{name: "triton layout", files: map[string]string{"served/3/model.onnx": "three"}, versions: []int64{3}, model: "three"},
		{name: "own config", files: map[string]string{"model.onnx": "m", "config.yaml": "# keep\nname: other\nslo: {latency_ms: 40, class: latency-critical}\n"}, versions: []int64{1}, model: "m", slo: 40},
		{name: "own config without a name", files: map[string]string{"1/model.onnx": "m", "config.yml": "max_batch_size: 4\n"}, versions: []int64{1}, model: "m"},
		{name: "empty", files: map[string]string{"README": "x"}, wantErr: "no model found"},
		{name: "ambiguous", files: map[string]string{"a.onnx": "a", "b.onnx": "b"}, wantErr: "several .onnx files"},
		{name: "bad config", files: map[string]string{"model.onnx": "m", "config.yaml": "- a list\n"}, wantErr: "not a mapping"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir, repo := t.TempDir(), t.TempDir()
			write(t, dir, tt.files)
			err := stageModel(dir, "served", repo)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("stageModel = %v, want an error containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			out := filepath.Join(repo, "served")
			cfg, err := configs.LoadModel(out)
			if err != nil {
				t.Fatalf("the staged config does not load: %v", err)
			}
			if cfg.Name != "served" || cfg.SLO.LatencyMS != tt.slo {
				t.Errorf("staged config: name %q, slo %v; want served, %v", cfg.Name, cfg.SLO.LatencyMS, tt.slo)
			}
			vs, err := configs.ListVersions(out)
			if err != nil || !slices.Equal(vs, tt.versions) {
				t.Fatalf("versions %v (%v), want %v", vs, err, tt.versions)
			}
			b, err := os.ReadFile(filepath.Join(out, strconv.FormatInt(tt.versions[0], 10), "model.onnx"))
			if err != nil || string(b) != tt.model {
				t.Errorf("model.onnx holds %q (%v), want %q", b, err, tt.model)
			}
			if _, ok := tt.files["model.onnx.data"]; ok {
				if _, err := os.Stat(filepath.Join(out, "1", "model.onnx.data")); err != nil {
					t.Errorf("external data beside the model is not staged: %v", err)
				}
			}
		})
	}
}
