package runtime

import (
	"maps"
	"strings"
	"testing"
)

func TestCUDAOptions(t *testing.T) {
	tests := []struct {
		name string
		opts ProviderOptions
		want map[string]string
	}{
		{
			name: "defaults",
			opts: ProviderOptions{Kind: ProviderCUDA},
			want: map[string]string{"device_id": "0", "arena_extend_strategy": "kNextPowerOfTwo", "cudnn_conv_algo_search": "EXHAUSTIVE"},
		},
		{
			name: "MPS share",
			opts: ProviderOptions{Kind: ProviderCUDA, DeviceID: 1, GPUMemLimit: 2 << 30, ArenaExtendStrategy: ArenaSameAsRequested, CudnnConvAlgoSearch: ConvAlgoHeuristic},
			want: map[string]string{"device_id": "1", "gpu_mem_limit": "2147483648", "arena_extend_strategy": "kSameAsRequested", "cudnn_conv_algo_search": "HEURISTIC"},
		},
		{
			name: "default search",
			opts: ProviderOptions{Kind: ProviderCUDA, CudnnConvAlgoSearch: ConvAlgoDefault},
			want: map[string]string{"device_id": "0", "arena_extend_strategy": "kNextPowerOfTwo", "cudnn_conv_algo_search": "DEFAULT"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.opts.CUDAOptions()
			if err != nil {
				t.Fatal(err)
			}
			if !maps.Equal(got, tt.want) {
				t.Errorf("CUDAOptions() = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestProviderOptionsValidate(t *testing.T) {
	tests := []struct {
		name string
		opts ProviderOptions
		want string // "" means valid
	}{
		{"zero value", ProviderOptions{}, ""},
		{"all set", ProviderOptions{Kind: ProviderCUDA, DeviceID: 2, IntraOpThreads: 4, InterOpThreads: 1, GraphOptimization: GraphOptBasic, GPUMemLimit: 1 << 30, ArenaExtendStrategy: ArenaSameAsRequested, CudnnConvAlgoSearch: ConvAlgoDefault}, ""},
		{"kind", ProviderOptions{Kind: "rocm"}, `kind: "rocm"`},
		{"graph", ProviderOptions{GraphOptimization: "max"}, `graph optimization: "max"`},
		{"arena", ProviderOptions{ArenaExtendStrategy: "1"}, `arena extend strategy: "1"`},
		{"conv", ProviderOptions{CudnnConvAlgoSearch: "EXHAUSTIVE"}, `cudnn conv algo search: "EXHAUSTIVE"`},
		{"threads", ProviderOptions{IntraOpThreads: -1}, "intra-op threads: -1 is negative"},
		{"memory", ProviderOptions{GPUMemLimit: -5}, "GPU memory limit: -5 is negative"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.opts.Validate()
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("Validate() = %v, want nil", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("Validate() = %v, want it to contain %q", err, tt.want)
			}
			if _, err := tt.opts.CUDAOptions(); (err == nil) != (tt.want == "") {
				t.Errorf("CUDAOptions() error = %v, want error: %v", err, tt.want != "")
			}
		})
	}
}

// The flags the server renders are the flags the runner parses.
func TestProviderArgsRoundTrip(t *testing.T) {
	in := ProviderOptions{Kind: ProviderCUDA, DeviceID: 3, IntraOpThreads: 2, InterOpThreads: 1, GraphOptimization: GraphOptExtended, GPUMemLimit: 123456789, ArenaExtendStrategy: ArenaSameAsRequested, CudnnConvAlgoSearch: ConvAlgoHeuristic}
	args := append([]string{"--socket", "/tmp/s", "--model", "m.onnx", "--library", "lib.so"}, in.args()...)
	f, err := parseRunnerFlags(args)
	if err != nil {
		t.Fatal(err)
	}
	if f.provider != in || f.socket != "/tmp/s" || f.model != "m.onnx" || f.library != "lib.so" {
		t.Errorf("parsed %+v, want provider %+v", f, in)
	}

	if got, err := parseRunnerFlags(ProviderOptions{}.args()); err == nil ||
		!strings.Contains(err.Error(), "--socket is required") || !strings.Contains(err.Error(), "--model is required") {
		t.Errorf("parse without socket and model = %+v, %v", got, err)
	}
	if _, err := parseRunnerFlags(append(args, "extra")); err == nil || !strings.Contains(err.Error(), "unexpected arguments") {
		t.Errorf("parse with a stray argument: %v", err)
	}
	if _, err := parseRunnerFlags(append(args, "--provider", "tpu")); err == nil || !strings.Contains(err.Error(), `"tpu"`) {
		t.Errorf("parse with provider tpu: %v", err)
	}
}
