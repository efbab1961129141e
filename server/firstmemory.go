package server

import (
	"fmt"
	"math"
	"path/filepath"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/predictor"
)

// A GPU model's first memory share. At load every instance pins its
// memory share, and placement keeps room on a device for the models, the
// new one and a shadow of the largest; before a profile the only size
// known is memory_limit. Under the adaptive policy the loop sizes the
// share from the profile's working sets within its first pass anyway, so
// where the model file was profiled before (the profile cache) its
// instances start at the working set of the largest batch the scheduler
// forms (max_batch_size) with the loop's headroom: every batch fits it,
// the profile at load included, and from there the share follows the load
// as the loop sizes it. The GPU day scaled to 36 models pinned 150 GiB of
// memory_limits at load (four 40 GiB devices hold 128) and about 33 GiB
// once sized.
//
// The working sets are kept under a key of their own that names no
// device (a profile's key names the device it ran on, and placement has
// not chosen one yet when it counts a loading model's memory): the model
// file, the machine, the ONNX Runtime library, the model's inputs and
// profile shapes and, on the simulator, its spec without the device count
// and the model's curve.

// memoryKey is the cache key of a model file's working sets.
func (p *profiler) memoryKey(path string, cfg *configs.Model) (string, error) {
	parts := []string{"working-sets", "onnxruntime=" + filepath.Base(p.lib),
		fmt.Sprintf("inputs=%v", cfg.Inputs), fmt.Sprintf("shapes=%v", cfg.Profile.Shapes)}
	if p.sim != nil && cfg.Execution.Provider == configs.ProviderCUDA {
		spec := p.sim.Spec()
		spec.Devices = 0 // a device's working set does not depend on how many there are
		m, _ := cfg.Execution.Simulated.Model()
		parts = append(parts, fmt.Sprintf("simgpu=%+v model=%+v", spec, m))
	}
	return predictor.Key(path, predictor.MachineID(), parts...)
}

// storeWorkingSets keeps a GPU profile's working sets under the model
// file's memory key, unless they are there already.
func (p *profiler) storeWorkingSets(run models.ProfileRun, prof predictor.Profile) {
	if run.Config == nil || run.Config.Execution.Provider != configs.ProviderCUDA {
		return
	}
	measured := false
	for _, pt := range prof.Points {
		measured = measured || pt.Memory > 0
	}
	if !measured {
		return
	}
	key, err := p.memoryKey(run.Path, run.Config)
	if err != nil {
		return
	}
	if _, ok, err := p.cache.Load(key); ok && err == nil {
		return
	}
	prof.Key = key
	if err := p.cache.Store(prof); err != nil {
		p.log.Warn("working sets not cached", "model", run.Key, "err", err)
	}
}

// firstMemory is the registry's Options.FirstMemory where the policy sizes
// memory shares from working sets: for a GPU model whose file's working
// sets are cached, the working set of its largest batch plus
// control.DefaultMemoryHeadroom (the loop's), at least floor (the
// limiter's least share), rounded up to a MiB; 0 otherwise.
func (p *profiler) firstMemory(floor int64) func(path string, cfg *configs.Model) int64 {
	return func(path string, cfg *configs.Model) int64 {
		if cfg.Execution.Provider != configs.ProviderCUDA || cfg.Resources.MemoryLimit <= 0 || p.fresh {
			return 0
		}
		key, err := p.memoryKey(path, cfg)
		if err != nil {
			return 0
		}
		prof, ok, err := p.cache.Load(key)
		if err != nil || !ok {
			return 0
		}
		sets, err := predictor.New(predictor.Options{})
		if err != nil {
			return 0
		}
		sets.SetProfile(cfg.Name, prof)
		ws, ok := sets.WorkingSet(cfg.Name, max(1, cfg.MaxBatchSize))
		if !ok || ws <= 0 {
			return 0
		}
		const mib = 1 << 20
		m := int64(math.Ceil(float64(ws) * (1 + control.DefaultMemoryHeadroom)))
		m = (max(m, floor) + mib - 1) / mib * mib
		if m >= int64(cfg.Resources.MemoryLimit) {
			return 0
		}
		return m
	}
}
