package runtime

import (
	"errors"
	"fmt"
	"strconv"
)

// Execution providers a runner can use.
const (
	ProviderCPU  = "cpu"
	ProviderCUDA = "cuda"
)

// Graph optimisation levels, as ONNX Runtime names them.
const (
	GraphOptDisable  = "disable"
	GraphOptBasic    = "basic"
	GraphOptExtended = "extended"
	GraphOptAll      = "all"
)

// CUDA arena extension strategies.
const (
	ArenaNextPowerOfTwo  = "next_power_of_two"
	ArenaSameAsRequested = "same_as_requested"
)

// cuDNN convolution algorithm searches.
const (
	ConvAlgoExhaustive = "exhaustive"
	ConvAlgoHeuristic  = "heuristic"
	ConvAlgoDefault    = "default"
)

// ProviderOptions configures a runner's ONNX Runtime session. Empty strings
// and zero numbers mean ONNX Runtime's defaults.
type ProviderOptions struct {
	Kind              string // ProviderCPU (default) or ProviderCUDA
	DeviceID          int    // CUDA device
	IntraOpThreads    int    // 0: ONNX Runtime's default
	InterOpThreads    int    // 0: ONNX Runtime's default
	GraphOptimization string // GraphOpt*; default GraphOptAll
	AllowSpinning     bool   // let idle intra-op threads spin between runs

	// CUDA only.
	GPUMemLimit         int64  // bytes for the CUDA arena; 0: unlimited
	ArenaExtendStrategy string // Arena*; default ArenaNextPowerOfTwo
	CudnnConvAlgoSearch string // ConvAlgo*; default ConvAlgoExhaustive
}

// withDefaults fills the empty fields with the defaults.
func (o ProviderOptions) withDefaults() ProviderOptions {
	if o.Kind == "" {
		o.Kind = ProviderCPU
	}
	if o.GraphOptimization == "" {
		o.GraphOptimization = GraphOptAll
	}
	if o.ArenaExtendStrategy == "" {
		o.ArenaExtendStrategy = ArenaNextPowerOfTwo
	}
	if o.CudnnConvAlgoSearch == "" {
		o.CudnnConvAlgoSearch = ConvAlgoExhaustive
	}
	return o
}

// Validate reports the first option that holds an unknown value.
func (o ProviderOptions) Validate() error {
	o = o.withDefaults()
	var errs []error
	oneOf := func(field, v string, allowed ...string) {
		for _, a := range allowed {
			if v == a {
				return
			}
		}
		errs = append(errs, fmt.Errorf("provider option %s: %q is not one of %q", field, v, allowed))
	}
	nonNegative := func(field string, v int64) {
		if v < 0 {
			errs = append(errs, fmt.Errorf("provider option %s: %d is negative", field, v))
		}
	}
	oneOf("kind", o.Kind, ProviderCPU, ProviderCUDA)
	oneOf("graph optimization", o.GraphOptimization, GraphOptDisable, GraphOptBasic, GraphOptExtended, GraphOptAll)
	oneOf("arena extend strategy", o.ArenaExtendStrategy, ArenaNextPowerOfTwo, ArenaSameAsRequested)
	oneOf("cudnn conv algo search", o.CudnnConvAlgoSearch, ConvAlgoExhaustive, ConvAlgoHeuristic, ConvAlgoDefault)
	nonNegative("device id", int64(o.DeviceID))
	nonNegative("intra-op threads", int64(o.IntraOpThreads))
	nonNegative("inter-op threads", int64(o.InterOpThreads))
	nonNegative("GPU memory limit", o.GPUMemLimit)
	return errors.Join(errs...)
}

// args renders the options as runner command-line flags (see RunnerMain).
func (o ProviderOptions) args() []string {
	o = o.withDefaults()
	return []string{
		"--provider", o.Kind,
		"--device-id", strconv.Itoa(o.DeviceID),
		"--intra-op-threads", strconv.Itoa(o.IntraOpThreads),
		"--inter-op-threads", strconv.Itoa(o.InterOpThreads),
		"--graph-optimization", o.GraphOptimization,
		"--allow-spinning=" + strconv.FormatBool(o.AllowSpinning),
		"--gpu-mem-limit", strconv.FormatInt(o.GPUMemLimit, 10),
		"--arena-extend-strategy", o.ArenaExtendStrategy,
		"--cudnn-conv-algo-search", o.CudnnConvAlgoSearch,
	}
}

// CUDAOptions returns the key/value options for ONNX Runtime's CUDA
// execution provider (UpdateCUDAProviderOptions), in the spelling its
// parser accepts: enums by name, not number.
func (o ProviderOptions) CUDAOptions() (map[string]string, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	o = o.withDefaults()
	m := map[string]string{
		"device_id":              strconv.Itoa(o.DeviceID),
		"arena_extend_strategy":  map[string]string{ArenaNextPowerOfTwo: "kNextPowerOfTwo", ArenaSameAsRequested: "kSameAsRequested"}[o.ArenaExtendStrategy],
		"cudnn_conv_algo_search": map[string]string{ConvAlgoExhaustive: "EXHAUSTIVE", ConvAlgoHeuristic: "HEURISTIC", ConvAlgoDefault: "DEFAULT"}[o.CudnnConvAlgoSearch],
	}
	if o.GPUMemLimit > 0 {
		m["gpu_mem_limit"] = strconv.FormatInt(o.GPUMemLimit, 10)
	}
	return m, nil
}
