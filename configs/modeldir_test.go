package configs

import (
	"strings"
	"testing"
)

func TestModelDirValidation(t *testing.T) {
	tests := []struct {
		name    string
		set     map[string]string
		wantErr string // "" = valid
	}{
		{"unset", nil, ""},
		{"dir and name", map[string]string{"model_dir": "/mnt/models", "model_name": "resnet-50_v1.5"}, ""},
		{"name alone", map[string]string{"model_name": "m"}, "model_name: only allowed with model_dir"},
		{"dir alone", map[string]string{"model_dir": "/mnt/models"}, "model_name: required with model_dir"},
		{"bad name", map[string]string{"model_dir": "/mnt/models", "model_name": "../x"}, "is not a model name"},
		{"explicit mode", map[string]string{"model_dir": "/m", "model_name": "m", "model_control": "explicit"}, `model_control: must be "none" with model_dir`},
		{"modelmesh", map[string]string{"listen.modelmesh": "127.0.0.1:8085", "model_control": "explicit", "control.memory_budget": "1GiB"}, ""},
		{"modelmesh not explicit", map[string]string{"listen.modelmesh": "127.0.0.1:8085", "control.memory_budget": "1GiB"}, `model_control: must be "explicit" with listen.modelmesh`},
		{"modelmesh without a budget", map[string]string{"listen.modelmesh": "127.0.0.1:8085", "model_control": "explicit"}, "control.memory_budget: must be > 0 with listen.modelmesh"},
		{"modelmesh on every interface", map[string]string{"listen.modelmesh": ":8085", "model_control": "explicit", "control.memory_budget": "1GiB"}, "listen.modelmesh: must be a loopback address"},
		{"modelmesh on the grpc port", map[string]string{"listen.modelmesh": "127.0.0.1:8001", "model_control": "explicit", "control.memory_budget": "1GiB"}, "listen.modelmesh: \"127.0.0.1:8001\" conflicts with listen.grpc"},
		{"modelmesh_dir relative", map[string]string{"listen.modelmesh": "127.0.0.1:8085", "model_control": "explicit", "control.memory_budget": "1GiB", "modelmesh_dir": "models"}, `modelmesh_dir: must be an absolute folder other than / with listen.modelmesh (where ModelMesh's puller writes models), got "models"`},
		{"modelmesh_dir root", map[string]string{"listen.modelmesh": "127.0.0.1:8085", "model_control": "explicit", "control.memory_budget": "1GiB", "modelmesh_dir": "/"}, `modelmesh_dir: must be an absolute folder other than /`},
		{"modelmesh and model_dir", map[string]string{"listen.modelmesh": "127.0.0.1:8085", "model_control": "explicit", "control.memory_budget": "1GiB", "model_dir": "/m", "model_name": "m"}, "model_dir: cannot be set with listen.modelmesh"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := DefaultServer()
			for k, v := range tt.set {
				if err := s.Set(k, v); err != nil {
					t.Fatal(err)
				}
			}
			err := s.Validate()
			switch {
			case tt.wantErr == "" && err != nil:
				t.Errorf("Validate: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("Validate = %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
	// The environment reaches the keys too: KServe runtimes are often
	// configured that way.
	s := DefaultServer()
	if err := s.ApplyEnv([]string{"SLOSERVE_MODEL_DIR=/mnt/models", "SLOSERVE_MODEL_NAME=m"}); err != nil {
		t.Fatal(err)
	}
	if s.ModelDir != "/mnt/models" || s.ModelName != "m" {
		t.Errorf("ApplyEnv: model_dir %q, model_name %q", s.ModelDir, s.ModelName)
	}
}
