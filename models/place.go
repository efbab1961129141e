package models

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/limiter"
)

// This file is the registry's side of placement across GPUs: the device a
// cuda model that names none loads on (Options.Place), the versions as
// placement sees them (Placements), and a move of a serving version to
// another device by a warm shadow (Move).

// ErrMoving answers a share change of a version that is moving to another
// device: the target device's adjuster sizes it there.
var ErrMoving = errors.New("model version is moving to another device")

// ErrNotMovable means a version cannot move: it is not on a GPU, or its
// config names its device.
var ErrNotMovable = errors.New("model cannot move")

// placed returns the config a model loads with: as it is, unless the
// model is on cuda without a device_id and Options.Place is set, which
// then names the device. Options.Place hears of the cuda models that name
// their device too (it must return that device), so that it counts them
// while they load.
func (r *Registry) placed(name, dir string, cfg *configs.Model) (*configs.Model, error) {
	if r.opts.Place == nil || cfg.Execution.Provider != configs.ProviderCUDA {
		return cfg, nil
	}
	// The memory its instances will pin at load: the newest selected
	// version's first memory share (0: its memory_limit).
	var memory int64
	if selected, err := selectVersions(cfg, dir); err == nil {
		memory = r.firstMemory(modelFile(dir, slices.Max(selected)), cfg)
	}
	id, err := r.opts.Place(name, cfg, memory)
	if err != nil {
		return nil, fmt.Errorf("placing the model on a GPU: %w", err)
	}
	if cfg.Execution.DeviceGiven {
		return cfg, nil
	}
	return onDevice(cfg, id), nil
}

// onDevice is a copy of cfg on cuda device id.
func onDevice(cfg *configs.Model, id int) *configs.Model {
	c := *cfg
	c.Execution.DeviceID = id
	return &c
}

// PlacedVersion is a serving version as placement sees it.
type PlacedVersion struct {
	Key    string // "model/N"
	Model  string
	Device string // "cpu" or "cuda:N"
	Config *configs.Model
	// Pinned: the config names the device (execution.device_id).
	Pinned bool
	// MemoryLimit is the memory its instances may use together (0: none).
	MemoryLimit int64
	// MemoryUsed is what its limiter units report they use now.
	MemoryUsed int64
	Share      limiter.Share
}

// Placements returns the serving versions of cuda models.
func (r *Registry) Placements() []PlacedVersion {
	r.mu.RLock()
	var vs []*version
	for _, m := range r.models {
		for _, v := range m.serving {
			if v.cfg.Execution.Provider == configs.ProviderCUDA {
				vs = append(vs, v)
			}
		}
	}
	r.mu.RUnlock()
	out := make([]PlacedVersion, 0, len(vs))
	for _, v := range vs {
		v.instMu.RLock()
		share, n := v.share, v.cfg.Instances
		v.instMu.RUnlock()
		out = append(out, PlacedVersion{
			Key: v.key, Model: v.model, Device: v.device, Config: v.cfg,
			Pinned:      v.cfg.Execution.DeviceGiven,
			MemoryLimit: int64(v.cfg.Resources.MemoryLimit) * int64(n),
			MemoryUsed:  r.UnitStats(v.key).MemoryBytes,
			Share:       share,
		})
	}
	return out
}

// Move moves a serving version ("model/N") to another cuda device by a
// warm shadow: the version's instances start on the target at its current
// share and are warmed; the version then joins the target device's
// scheduler and takes every new request, while the requests already
// admitted (queued or running) finish on the old device, whose scheduler
// lets its queue run before the version leaves it; then the old instances
// stop. No request fails for the move. A version whose config names its
// device does not move (ErrNotMovable).
func (r *Registry) Move(ctx context.Context, key, device string) error {
	name, label, ok := strings.Cut(key, "/")
	if !ok {
		return fmt.Errorf("%w: %q is not model/version", ErrModelNotFound, key)
	}
	idx, ok := strings.CutPrefix(device, "cuda:")
	id, err := strconv.Atoi(idx)
	if !ok || err != nil || id < 0 {
		return fmt.Errorf("%w: %s: %q is not a GPU (cuda:N)", ErrNotMovable, key, device)
	}
	m, err := r.lookup(name)
	if err != nil {
		return err
	}
	m.op.Lock()
	defer m.op.Unlock()
	v, err := r.serving(name, label)
	if err != nil {
		return err
	}
	switch {
	case v.device == device:
		return nil
	case v.cfg.Execution.Provider != configs.ProviderCUDA:
		return fmt.Errorf("%w: %s runs on %s", ErrNotMovable, key, v.device)
	case v.cfg.Execution.DeviceGiven:
		return fmt.Errorf("%w: %s: its config names device %d", ErrNotMovable, key, v.cfg.Execution.DeviceID)
	}
	// No swap starts on the old device from now on; one in progress ends
	// first, so that the old instances stop at the share they run at.
	v.moving.Store(true)
	waitShare(v)
	v.instMu.RLock()
	share := v.share
	v.instMu.RUnlock()
	fresh, err := r.startVersionAt(ctx, onDevice(v.cfg, id), m.dir, v.number, share)
	if err != nil {
		v.moving.Store(false)
		return fmt.Errorf("%s: starting on %s: %w", key, device, err)
	}
	// Each new instance is warmed as a replacement is (warmInstances);
	// then the pool's warm-up seeds the target's latency estimates.
	if err := warmInstances(ctx, fresh); err != nil {
		v.moving.Store(false)
		r.stopVersion(context.WithoutCancel(ctx), fresh)
		return fmt.Errorf("%s: warming on %s: %w", key, device, err)
	}
	r.warmUp(ctx, fresh)
	if err := r.schedule(ctx, fresh); err != nil {
		v.moving.Store(false)
		r.unschedule(context.WithoutCancel(ctx), fresh, nil)
		r.stopVersion(context.WithoutCancel(ctx), fresh)
		return fmt.Errorf("%s: scheduling on %s: %w", key, device, err)
	}
	r.mu.Lock()
	if m.serving[v.number] != v { // cannot happen under m.op; kept safe
		r.mu.Unlock()
		v.moving.Store(false)
		r.unschedule(context.WithoutCancel(ctx), fresh, nil)
		r.stopVersion(context.WithoutCancel(ctx), fresh)
		return fmt.Errorf("%w: %s changed during the move", ErrNotReady, key)
	}
	m.serving[v.number] = fresh
	r.mu.Unlock()
	r.log.Info("version moved", "model", v.model, "version", v.label, "from", v.device, "to", device, "share", formatShare(share))
	r.drainAndStop(context.WithoutCancel(ctx), v, map[int64]*version{v.number: fresh})
	return nil
}

// waitShare returns once no share change of the version is in progress.
// It polls rather than waits on the lock, so that a swap sleeping on
// simulated time (testing/synctest) is not stalled by a goroutine blocked
// on a mutex.
func waitShare(v *version) {
	lockShare(v)
	v.shareMu.Unlock()
}

// lockShare takes the version's share lock, polling as waitShare does.
func lockShare(v *version) {
	for !v.shareMu.TryLock() {
		time.Sleep(5 * time.Millisecond)
	}
}
