package server

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
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
//
// What ModelMesh may make the server read: a modelPath must be an absolute
// path with no ".." inside modelmesh_dir (the folder its puller writes to),
// once links are resolved; the folder's own contents are the puller's and
// links in it are followed (it links a PVC's files, say). Loads and unloads
// of one id take turns: the second waits for the first.

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
	root string // modelmesh_dir: the only folder modelPaths may name
	cfg  *configs.Server

	mu     sync.Mutex
	loaded map[string]uint64        // model id -> size, for models loaded through the mesh
	busy   map[string]chan struct{} // model id -> closed when its load or unload ends
}

func newMesh(reg *models.Registry, repo string, cfg *configs.Server) *mesh {
	return &mesh{reg: reg, repo: repo, root: cfg.ModelMeshDir, cfg: cfg, loaded: map[string]uint64{}, busy: map[string]chan struct{}{}}
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

// lockID waits until no other load or unload of id runs (or ctx ends) and
// takes the turn; the returned function gives it back. Without turns, a
// failing load's clean-up removed the folder a concurrent load of the same
// id had staged and was loading from.
func (m *mesh) lockID(ctx context.Context, id string) (func(), error) {
	for {
		m.mu.Lock()
		done, held := m.busy[id]
		if !held {
			done = make(chan struct{})
			m.busy[id] = done
			m.mu.Unlock()
			return func() {
				m.mu.Lock()
				delete(m.busy, id)
				m.mu.Unlock()
				close(done)
			}, nil
		}
		m.mu.Unlock()
		select {
		case <-done:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// modelPath checks a modelPath ModelMesh sends against modelmesh_dir and
// returns it with its links resolved.
func (m *mesh) modelPath(path string) (string, error) {
	refuse := func(why string) error {
		return fmt.Errorf("%w: modelPath %s: %s (modelmesh_dir is %s)", models.ErrInvalidInput, path, why, m.root)
	}
	if !filepath.IsAbs(path) {
		return "", refuse("not an absolute path")
	}
	if slices.Contains(strings.Split(path, string(filepath.Separator)), "..") {
		return "", refuse(`has a ".." element`)
	}
	root, err := filepath.EvalSymlinks(m.root)
	if err != nil {
		return "", fmt.Errorf("modelmesh_dir: %w", err)
	}
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return "", fmt.Errorf("%w: modelPath %s: %w", models.ErrInvalidInput, path, err)
	}
	rel, err := filepath.Rel(root, real)
	if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
		return "", refuse("not inside modelmesh_dir")
	}
	return real, nil
}

func (m *mesh) MeshLoad(ctx context.Context, id, path string) (uint64, error) {
	if err := meshID(id); err != nil {
		return 0, err
	}
	src, err := m.modelPath(path)
	if err != nil {
		return 0, err
	}
	unlock, err := m.lockID(ctx, id)
	if err != nil {
		return 0, err
	}
	defer unlock()
	m.mu.Lock()
	size, ok := m.loaded[id]
	m.mu.Unlock()
	if ok {
		return size, nil
	}
	dir := filepath.Join(m.repo, id)
	if err := stageModel(src, id, m.repo); err != nil {
		os.RemoveAll(dir)
		return 0, fmt.Errorf("%w: modelPath %s: %w", models.ErrInvalidInput, path, err)
	}
	size, err = m.size(dir)
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
	unlock, err := m.lockID(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	err = m.reg.Unload(ctx, id)
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
	src, err := m.modelPath(path)
	if err != nil {
		return 0, err
	}
	b, err := treeBytes(src)
	if err != nil {
		return 0, fmt.Errorf("%w: modelPath %s: %w", models.ErrInvalidInput, path, err)
	}
	return 2*b + meshRunnerOverhead, nil
}

// size is a staged model's size, summed over the versions its policy
// serves (each runs its own instances): a version's memory limit when the
// config sets one (each runner is held to it), else the estimate from that
// version's files, times the instances.
func (m *mesh) size(dir string) (uint64, error) {
	cfg, err := configs.LoadModel(dir)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", models.ErrBadConfig, err)
	}
	available, err := configs.ListVersions(dir)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", models.ErrBadConfig, err)
	}
	var total uint64
	for _, v := range cfg.SelectVersions(available) {
		per := uint64(cfg.Resources.MemoryLimit)
		if per == 0 {
			b, err := treeBytes(filepath.Join(dir, strconv.FormatInt(v, 10)))
			if err != nil {
				return 0, err
			}
			per = 2*b + meshRunnerOverhead
		}
		total += per * uint64(cfg.Instances)
	}
	return total, nil
}

// maxTreeEntries bounds the entries treeBytes looks at.
const maxTreeEntries = 10000

// treeBytes sums the sizes of the regular files under dir, following
// links, four folders deep at most; a tree of more than maxTreeEntries
// entries is refused.
func treeBytes(dir string) (uint64, error) {
	var total uint64
	seen := 0
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
			if seen++; seen > maxTreeEntries {
				return fmt.Errorf("more than %d files: not a model folder", maxTreeEntries)
			}
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
