package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

// KServe runs a serving runtime with the model mounted at /mnt/models and
// the InferenceService's name templated into the runtime's args
// ({{.Name}}); no repository, no config file. These tests start the binary
// the same way, from a folder with no demo-repository, as
// deploy/kserve/servingruntime.yaml's args do.

// kserveArgs returns the args of deploy/kserve/clusterservingruntime.yaml's
// container as KServe would run them for an InferenceService named name
// with its model at mnt, less "serve" and the listen addresses, which the
// harness gives (free ports).
func kserveArgs(t *testing.T, mnt, name string) []string {
	t.Helper()
	b, err := os.ReadFile("../deploy/kserve/clusterservingruntime.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var rt struct {
		Spec struct {
			Containers []struct {
				Args []string `yaml:"args"`
			} `yaml:"containers"`
		} `yaml:"spec"`
	}
	if err := yaml.Unmarshal(b, &rt); err != nil {
		t.Fatal(err)
	}
	if len(rt.Spec.Containers) != 1 || len(rt.Spec.Containers[0].Args) == 0 || rt.Spec.Containers[0].Args[0] != "serve" {
		t.Fatalf("the serving runtime's container does not run serve: %+v", rt.Spec.Containers)
	}
	var args []string
	for _, a := range rt.Spec.Containers[0].Args[1:] {
		if strings.HasPrefix(a, "--http-addr=") || strings.HasPrefix(a, "--grpc-addr=") || strings.HasPrefix(a, "--metrics-addr=") {
			continue
		}
		a = strings.ReplaceAll(a, "/mnt/models", mnt)
		args = append(args, strings.ReplaceAll(a, "{{.Name}}", name))
	}
	return args
}

// TestE2EKServeModelDir serves a model folder in the layouts KServe's
// storage initializer leaves: a model.onnx (or one *.onnx of another name)
// at the top, or version folders.
func TestE2EKServeModelDir(t *testing.T) {
	layouts := []struct {
		name  string
		files map[string]string // path in the model folder -> test model it links to
	}{
		{"model.onnx", map[string]string{"model.onnx": "example_dynamic_axes.onnx"}},
		{"other file name", map[string]string{"dynamic-axes.onnx": "example_dynamic_axes.onnx"}},
		{"version folder", map[string]string{"3/model.onnx": "example_dynamic_axes.onnx"}},
	}
	for _, l := range layouts {
		t.Run(l.name, func(t *testing.T) {
			mnt := t.TempDir()
			for path, model := range l.files {
				p := filepath.Join(mnt, path)
				if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink(testModel(t, model), p); err != nil {
					t.Fatal(err)
				}
			}
			s := startServer(t, "", "", withCommandLine(t.TempDir(), kserveArgs(t, mnt, "isvc-dyn")...))

			code, body, _ := s.do(t, "POST", "/v2/models/isvc-dyn/infer", dynBody)
			if code != 200 || !strings.Contains(string(body), `"model_name":"isvc-dyn"`) {
				t.Fatalf("infer: %d %s", code, body)
			}
			// grpc-v2: the same model over the gRPC port.
			req := grpcDynRequest()
			req.ModelName = "isvc-dyn"
			resp, err := s.grpc.ModelInfer(t.Context(), req)
			if err != nil || resp.ModelName != "isvc-dyn" || len(resp.RawOutputContents) != 1 {
				t.Fatalf("gRPC infer: %v, %v", resp, err)
			}
			var index []struct{ Name, State string }
			if code := s.json(t, "POST", "/v2/repository/index", map[string]any{}, &index); code != 200 {
				t.Fatalf("index: %d", code)
			}
			if len(index) != 1 || index[0].Name != "isvc-dyn" || index[0].State != "READY" {
				t.Errorf("index = %+v, want only isvc-dyn, READY", index)
			}
			if code, body, _ := s.do(t, "GET", "/v2/models/isvc-dyn/ready", nil); code != 200 {
				t.Errorf("model ready: %d %s", code, body)
			}
		})
	}
}

// TestE2EKServeModelDirErrors: a model folder the server cannot serve stops
// the start with a message naming the folder and what was wanted.
func TestE2EKServeModelDirErrors(t *testing.T) {
	empty := t.TempDir()
	if err := os.WriteFile(filepath.Join(empty, "README"), []byte("no model here"), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"no model in the folder", []string{"--model-dir", empty, "--model-name", "m"}, "no model found"},
		{"missing folder", []string{"--model-dir", filepath.Join(empty, "missing"), "--model-name", "m"}, "no such file or directory"},
		{"no name", []string{"--model-dir", empty}, "model_name: required with model_dir"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := append([]string{"serve", "--http-addr", freePort(t), "--grpc-addr", freePort(t), "--metrics-addr", freePort(t)}, tt.args...)
			_, stderr, err := runSloserve(args...)
			if err == nil || !strings.Contains(stderr, tt.want) {
				t.Fatalf("serve %v: %v, stderr:\n%s\nwant a failure saying %q", tt.args, err, stderr, tt.want)
			}
		})
	}
}

// TestE2EKServeModelDirTritonConfig: a model migrated from Triton keeps
// its config.pbtxt beside the model file (named after its old folder);
// served with the runtime's arguments under the InferenceService's name,
// it keeps its batching, instances and SLO.
func TestE2EKServeModelDirTritonConfig(t *testing.T) {
	for _, layout := range []string{"model.onnx", "1/model.onnx"} {
		t.Run(layout, func(t *testing.T) {
			mnt := t.TempDir()
			p := filepath.Join(mnt, layout)
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(testModel(t, "example_dynamic_axes.onnx"), p); err != nil {
				t.Fatal(err)
			}
			pbtxt := strings.Replace(tritonDynPbtxt, "instance_group [ { count: 1, kind: KIND_CPU } ]", "instance_group [ { count: 2, kind: KIND_CPU } ]", 1)
			if err := os.WriteFile(filepath.Join(mnt, "config.pbtxt"), []byte(pbtxt), 0o644); err != nil {
				t.Fatal(err)
			}
			s := startServer(t, "", "", withCommandLine(t.TempDir(), kserveArgs(t, mnt, "isvc-dyn")...))
			var cfg struct {
				Name          string `json:"name"`
				MaxBatchSize  int    `json:"max_batch_size"`
				InstanceGroup []struct {
					Count int `json:"count"`
				} `json:"instance_group"`
				DynamicBatching struct {
					PreferredBatchSize []int `json:"preferred_batch_size"`
				} `json:"dynamic_batching"`
			}
			if code := s.json(t, "GET", "/v2/models/isvc-dyn/config", nil, &cfg); code != 200 {
				t.Fatalf("config: %d", code)
			}
			if cfg.Name != "isvc-dyn" || cfg.MaxBatchSize != 8 || len(cfg.InstanceGroup) != 1 || cfg.InstanceGroup[0].Count != 2 || len(cfg.DynamicBatching.PreferredBatchSize) != 2 {
				t.Errorf("config %+v: want the config.pbtxt's max_batch_size 8, 2 instances and preferred batch sizes [4 8] under the name isvc-dyn", cfg)
			}
			if code, body, _ := s.do(t, "POST", "/v2/models/isvc-dyn/infer", dynBody); code != 200 {
				t.Fatalf("infer: %d %s", code, body)
			}
		})
	}
}
