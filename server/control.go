package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/device"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/predictor"
	"github.com/sloserve/sloserve/simgpu"
)

// profileCacheDir is where profiles are kept: the configured folder, else
// the user cache directory, else the temporary directory.
func profileCacheDir(configured string) string {
	if configured != "" {
		return configured
	}
	if dir, err := os.UserCacheDir(); err == nil {
		return filepath.Join(dir, "sloserve", "profiles")
	}
	return filepath.Join(os.TempDir(), "sloserve-profiles")
}

// profiler runs the predictor's sweep for a freshly loaded version, or
// takes the curve from the cache when this model file was profiled on this
// machine with the same settings before.
type profiler struct {
	cfg   configs.Profile
	cache predictor.Cache
	pred  *predictor.Predictor
	lib   string // the ONNX Runtime library, part of the cache key
	log   *slog.Logger
	// report, when set, receives every profile installed (the profile
	// command prints it).
	report func(run models.ProfileRun, p predictor.Profile, cached bool)
	fresh  bool // ignore cached profiles
	// sim, when set, runs cuda models: their profiles are the
	// simulator's, keyed by its spec and the model's curve.
	sim *simgpu.Sim
	// sweeping holds a chan struct{} (capacity 1) per device: one sweep
	// runs on a device at a time, since a sweep timed while another
	// model's sweep runs beside it measures both. On a GPU models loading
	// together at start profiled each other's kernels and hid where a
	// model stops getting faster with more SMs. On the CPU a share is a
	// quota of all the cores, not cores of its own: three OCR models of
	// two threads each, profiled together on two cores, measured the
	// detector's batch of one at 43 ms (23 ms alone), its curve took
	// 33 ms as fixed cost, and batches of three and four, predicted with
	// the batch of one's correction, ended late at the server for 4-75%
	// of their requests against 0-0.3% for batches of one (BENCHMARKS.md,
	// issue 29).
	sweeping sync.Map
}

// lockDevice serialises the sweeps of one device: it waits for the
// device's turn (a channel, so that a wait under testing/synctest is
// durable) and returns the release, or ctx's error.
func (p *profiler) lockDevice(ctx context.Context, device string) (func(), error) {
	v, _ := p.sweeping.LoadOrStore(device, make(chan struct{}, 1))
	turn := v.(chan struct{})
	select {
	case turn <- struct{}{}:
		return func() { <-turn }, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// profileShares are the compute shares profiled: on a CPU a quarter, half
// and all of what the model can use; on a GPU eighths up to half, then
// three quarters and all. Under MPS every share is a cap and a model runs
// no faster past its knee, so the adjuster sizes caps at the knees the
// profile shows (predictor.Knee); with quarters only, a knee at 0.3 was
// seen at 0.5 and a knee at 0.6 not at all, and each cap kept a fifth of
// a device idle from the batch jobs (GPU day in simulated time, 5 seeds:
// best-effort throughput 0.38x static's with quarters, 0.54x with eighths;
// latency-critical attainment 95.2% and 95.4%). Each share is an MPS
// client at profiling.
func profileShares(device string, maxShare float64) []float64 {
	if strings.HasPrefix(device, "cuda:") {
		return []float64{maxShare / 8, maxShare / 4, 3 * maxShare / 8, maxShare / 2, 3 * maxShare / 4, maxShare}
	}
	return []float64{maxShare / 4, maxShare / 2, maxShare}
}

// simulated is the part of a profile's cache key that says it was measured
// on the simulator: its spec and the model's curve; "" on real devices.
func (p *profiler) simulated(run models.ProfileRun) string {
	if device.Simulated(p.sim, run.Device) == nil {
		return ""
	}
	m, _ := run.Config.Execution.Simulated.Model()
	return fmt.Sprintf("simgpu=%+v model=%+v", p.sim.Spec(), m)
}

// run is the registry's Options.Profile.
func (p *profiler) run(ctx context.Context, run models.ProfileRun) error {
	parts := []string{"device=" + run.Device, "threads=" + strconv.Itoa(run.Threads),
		fmt.Sprintf("shares=%v", profileShares(run.Device, run.MaxShare)),
		fmt.Sprintf("batches=%v", run.BatchSizes),
		fmt.Sprintf("shapes=%v", run.Config.Profile.Shapes),
		fmt.Sprintf("elements=%v", run.Elements),
		"onnxruntime=" + filepath.Base(p.lib), "limiter=" + run.Limiter}
	if !strings.HasPrefix(run.Device, "cuda:") {
		// CPU profiles cached before their sweeps ran one at a time
		// were measured beside each other's: measure them again.
		parts = append(parts, "sweeps=one-per-device")
	}
	if sim := p.simulated(run); sim != "" {
		parts = append(parts, sim)
	}
	key, err := predictor.Key(run.Path, predictor.MachineID(), parts...)
	if err != nil {
		return err
	}
	var (
		prof predictor.Profile
		ok   bool
	)
	if !p.fresh {
		if prof, ok, err = p.cache.Load(key); err != nil {
			p.log.Warn("ignoring an unreadable cached profile", "model", run.Key, "err", err)
			ok = false
		}
	}
	if ok {
		p.pred.SetProfile(run.Key, prof)
		p.storeWorkingSets(run, prof)
		p.log.Info("profile from cache", "model", run.Key, "mape", prof.MAPE, "curve", prof.Curve)
		if p.report != nil {
			p.report(run, prof, true)
		}
		return nil
	}
	unlock, err := p.lockDevice(ctx, run.Device)
	if err != nil {
		return err
	}
	points, err := predictor.Sweep(ctx, predictor.SweepOptions{
		Batches:  run.BatchSizes,
		MaxBatch: max(1, run.Config.MaxBatchSize),
		Shares:   profileShares(run.Device, run.MaxShare),
		Runs:     p.cfg.Runs,
		Budget:   p.cfg.Budget,
		Memory:   run.Memory,
		Elements: run.Elements,
	}, run.MeasureAt)
	unlock()
	if err != nil && !errors.Is(err, predictor.ErrBudget) {
		return err
	}
	if err != nil {
		return fmt.Errorf("%w (raise control.profile.budget, or profile fewer batch sizes)", err)
	}
	prof, err = predictor.NewProfile(key, points, time.Now())
	if err != nil {
		return err
	}
	p.pred.SetProfile(run.Key, prof)
	if err := p.cache.Store(prof); err != nil {
		p.log.Warn("profile not cached", "model", run.Key, "err", err)
	}
	p.storeWorkingSets(run, prof)
	p.log.Info("profiled", "model", run.Key, "points", len(points), "mape", prof.MAPE, "curve", prof.Curve)
	if p.report != nil {
		p.report(run, prof, false)
	}
	return nil
}

// The registry applies the control loop's shares to the models' instances.
var _ control.AsyncActuator = (*models.Registry)(nil)
