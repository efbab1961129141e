package configs

import (
	"strings"
	"testing"
)

// A cuda model that names its device is pinned there under gpu.placement;
// one that names none is placed by the server (Execution.DeviceGiven).
func TestDeviceGiven(t *testing.T) {
	for _, c := range []struct {
		name, yaml string
		want       bool
	}{
		{"cuda with device_id", "execution: {provider: cuda, device_id: 1}\n", true},
		{"cuda with device_id 0", "execution: {provider: cuda, device_id: 0}\n", true},
		{"cuda without device_id", "execution: {provider: cuda}\n", false},
		{"cpu with device_id 0", "execution: {provider: cpu, device_id: 0}\n", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			m, err := ParseModel("m.yaml", []byte("name: m\n"+c.yaml))
			if err != nil {
				t.Fatal(err)
			}
			if m.Execution.DeviceGiven != c.want {
				t.Errorf("DeviceGiven %v, want %v", m.Execution.DeviceGiven, c.want)
			}
		})
	}
	for _, c := range []struct {
		name, pbtxt string
		want        bool
	}{
		{"gpus given", `name: "m" platform: "onnxruntime_onnx" instance_group [{kind: KIND_GPU gpus: [2]}]`, true},
		{"no gpus", `name: "m" platform: "onnxruntime_onnx" instance_group [{kind: KIND_GPU}]`, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			m, err := ParseTritonModel("config.pbtxt", []byte(c.pbtxt))
			if err != nil {
				t.Fatal(err)
			}
			if m.Execution.DeviceGiven != c.want {
				t.Errorf("DeviceGiven %v, want %v", m.Execution.DeviceGiven, c.want)
			}
			// Written back, a placed model names no GPU, a pinned one its own.
			back := TritonConfig(m).String()
			if strings.Contains(back, "gpus") != c.want {
				t.Errorf("written back: %s", back)
			}
		})
	}
}

func TestPlacementNeedsSimulatedGPUs(t *testing.T) {
	s := DefaultServer()
	s.GPU.Placement.Enabled = true
	if err := s.Validate(); err == nil || !strings.Contains(err.Error(), "gpu.placement.enabled") {
		t.Errorf("placement without simulated GPUs: %v, want a refusal naming gpu.placement.enabled", err)
	}
	s.GPU.Simulator.Devices = 2
	if err := s.Validate(); err != nil {
		t.Errorf("placement on 2 simulated GPUs: %v", err)
	}
	s.GPU.Placement.Period = 0
	if err := s.Validate(); err == nil || !strings.Contains(err.Error(), "gpu.placement") {
		t.Errorf("placement period 0: %v, want a refusal", err)
	}
}
