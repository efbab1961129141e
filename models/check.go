package models

import (
	"errors"
	"fmt"
	"path/filepath"
	"strconv"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/runtime"
)

// CheckOptions are the server settings a load checks a model folder
// against.
type CheckOptions struct {
	MaxBatchSize      int   // limits.max_batch_size; 0: none
	MaxTensorElements int64 // limits.max_tensor_elements; 0: none
	HasGPU            bool  // see Options.HasGPU
}

func (r *Registry) checkOptions() CheckOptions {
	return CheckOptions{MaxBatchSize: r.opts.MaxBatchSize, MaxTensorElements: r.opts.MaxTensorElements, HasGPU: r.opts.HasGPU}
}

// readModelConfig reads a model folder's config (or override, a Triton
// config in JSON, when not empty) and checks it against the server's
// limits, as a load does before it starts anything. Errors wrap
// ErrBadConfig.
func readModelConfig(dir string, override []byte, o CheckOptions) (*configs.Model, error) {
	var cfg *configs.Model
	var err error
	if len(override) > 0 {
		cfg, err = configs.ParseTritonModelJSON("the load request's config", override, dir)
	} else {
		cfg, err = configs.LoadModel(dir)
	}
	if err == nil {
		cfg = cfg.OnDevice(o.HasGPU)
		err = checkBatchLimit(cfg, o.MaxBatchSize)
	}
	if err == nil {
		err = checkShapeLimit(cfg, o.MaxTensorElements)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	return cfg, nil
}

// selectVersions lists a model folder's versions and returns those its
// policy serves. Errors wrap ErrBadConfig.
func selectVersions(cfg *configs.Model, dir string) ([]int64, error) {
	available, err := configs.ListVersions(dir)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	selected := cfg.SelectVersions(available)
	if len(selected) == 0 {
		return nil, fmt.Errorf("%w: %s: no version folder with a model.onnx matches the version policy (found %v)", ErrBadConfig, dir, available)
	}
	if err := checkVersionLimit(cfg, selected); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	return selected, nil
}

// CheckFolder checks a model folder without serving it: its config and
// the versions it selects as a load does, and each selected model file's
// inputs and outputs against the config, read from the file without ONNX
// Runtime (a load asks ONNX Runtime, which may still refuse a file that
// reads here, e.g. for an operator it lacks). It returns the config a load
// would use and the versions it would serve; errors are the load's, and
// wrap ErrBadConfig. A folder that holds no config and no version is
// fs.ErrNotExist, as configs.LoadModel says.
func CheckFolder(dir string, o CheckOptions) (*configs.Model, []int64, error) {
	cfg, err := readModelConfig(dir, nil, o)
	if err != nil {
		return nil, nil, err
	}
	if cfg.Ensemble != nil {
		// Its steps are checked against the step models when it loads.
		available, err := configs.EnsembleVersions(dir)
		if err != nil {
			return cfg, nil, fmt.Errorf("%w: %w", ErrBadConfig, err)
		}
		return cfg, cfg.SelectVersions(available), nil
	}
	selected, err := selectVersions(cfg, dir)
	if err != nil {
		return cfg, nil, err
	}
	var errs []error
	for _, n := range selected {
		file := filepath.Join(dir, strconv.FormatInt(n, 10), configs.ModelFile)
		ins, outs, err := runtime.ReadSignature(file)
		if err == nil {
			_, _, err = checkSignature(cfg, ins, outs)
		} else {
			err = fmt.Errorf("%w: %w", ErrBadConfig, err)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("version %d: %w", n, err))
		}
	}
	return cfg, selected, errors.Join(errs...)
}
