package server

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/models"
)

// ModelMesh's runtime SPI on sloserve: ModelMesh hands a model id and the
// folder its puller filled; the mesh stages the folder into the server's
// staged repository under the id (as model_dir does for one model) and
// loads it through the registry's explicit mode. Sizes are what the model
// may take of control.memory_budget, which is the capacity ModelMesh fills.

// Sizes when a model's config sets no resources.memory_limit: its files'
// bytes twice (ONNX Runtime holds the weights and its arena) and what a
// runner process takes by itself.
const (
	meshRunnerOverhead   = 64 << 20
	meshDefaultModelSize = 256 << 20
)

var _ api.ModelMesh = (*mesh)(nil)

// mesh implements api.ModelMesh over the registry.
type mesh struct {
	reg  *models.Registry
	repo string // the staged repository, the registry's only one
	cfg  *configs.Server

	mu     sync.Mutex
	loaded map[string]uint64 // model id -> size, for models loaded through the mesh
}

func newMesh(reg *models.Registry, repo string, cfg *configs.Server) *mesh {
	return &mesh{reg: reg, repo: repo, cfg: cfg, loaded: map[string]uint64{}}
}

func (m *mesh) MeshStatus(ctx context.Context, purge bool) (api.MeshStatus, error) {
	if purge {
		m.mu.Lock()
		ids := make([]string, 0, len(m.loaded))
		for id := range m.loaded {
			ids = append(ids, id)
		}
		m.mu.Unlock()
		for _, id := range ids {
			if err := m.MeshUnload(ctx, id); err != nil {
				return api.MeshStatus{}, err
			}
		}
	}
	return api.MeshStatus{
		Ready:    m.reg.Started(),
		Capacity: uint64(m.cfg.Control.MemoryBudget),
		// A load starts a runner, profiles the model and warms it up.
		LoadTimeout:      m.cfg.Runtime.ReadyTimeout + m.cfg.Control.Profile.Budget + m.cfg.Runtime.CallTimeout,
		DefaultModelSize: meshDefaultModelSize,
		Version:          Version,
	}, nil
}

// meshID checks a model id is usable as a folder name; the model config's
// own name rules apply when it loads.
func meshID(id string) error {
	if id == "" || id == "." || id == ".." || strings.ContainsAny(id, "/\\\x00") || strings.HasPrefix(id, ".") {
		return fmt.Errorf("%w: model id %q cannot name a model", models.ErrInvalidInput, id)
	}
	return nil
}

func (m *mesh) MeshLoad(ctx context.Context, id, path string) (uint64, error) {
	if err := meshID(id); err != nil {
		return 0, err
	}
	m.mu.Lock()
	size, ok := m.loaded[id]
	m.mu.Unlock()
	if ok {
		return size, nil
	}
	dir := filepath.Join(m.repo, id)
	if err := stageModel(path, id, m.repo); err != nil {
		os.RemoveAll(dir)
		return 0, fmt.Errorf("%w: modelPath %s: %w", models.ErrInvalidInput, path, err)
	}
	size, err := m.size(dir)
	if err == nil {
		err = m.reg.Load(ctx, id)
	}
	if err != nil {
		// Nothing stays held: the registry forgets a model whose folder is gone.
		_ = m.reg.Unload(context.WithoutCancel(ctx), id)
		os.RemoveAll(dir)
		return 0, err
	}
	m.mu.Lock()
	m.loaded[id] = size
	m.mu.Unlock()
	return size, nil
}

func (m *mesh) MeshUnload(ctx context.Context, id string) error {
	if err := meshID(id); err != nil {
		return err
	}
	err := m.reg.Unload(ctx, id)
	if err != nil && !errors.Is(err, models.ErrModelNotFound) {
		return err
	}
	m.mu.Lock()
	delete(m.loaded, id)
	m.mu.Unlock()
	return os.RemoveAll(filepath.Join(m.repo, id))
}

func (m *mesh) MeshModelSize(id string) (uint64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	size, ok := m.loaded[id]
	if !ok {
		return 0, fmt.Errorf("%w: %q is not loaded", models.ErrModelNotFound, id)
	}
	return size, nil
}

func (m *mesh) MeshPredictSize(path string) (uint64, error) {
	b, err := treeBytes(path)
	if err != nil {
		return 0, fmt.Errorf("%w: modelPath %s: %w", models.ErrInvalidInput, path, err)
	}
	return 2*b + meshRunnerOverhead, nil
}

// size is a staged model's size: its memory limit when its config sets
// one (the runner is held to it), else the estimate from its files.
func (m *mesh) size(dir string) (uint64, error) {
	cfg, err := configs.LoadModel(dir)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", models.ErrBadConfig, err)
	}
	if cfg.Resources.MemoryLimit > 0 {
		return uint64(cfg.Resources.MemoryLimit) * uint64(cfg.Instances), nil
	}
	b, err := treeBytes(dir)
	if err != nil {
		return 0, err
	}
	return (2*b + meshRunnerOverhead) * uint64(cfg.Instances), nil
}

// treeBytes sums the sizes of the regular files under dir, following the
// links staging made.
func treeBytes(dir string) (uint64, error) {
	var total uint64
	var walk func(string, int) error
	walk = func(d string, depth int) error {
		if depth > 4 {
			return nil
		}
		entries, err := os.ReadDir(d)
		if err != nil {
			return err
		}
		for _, e := range entries {
			p := filepath.Join(d, e.Name())
			fi, err := os.Stat(p)
			if errors.Is(err, fs.ErrNotExist) {
				continue
			}
			if err != nil {
				return err
			}
			switch {
			case fi.IsDir():
				if err := walk(p, depth+1); err != nil {
					return err
				}
			case fi.Mode().IsRegular():
				total += uint64(fi.Size())
			}
		}
		return nil
	}
	return total, walk(dir, 0)
}
