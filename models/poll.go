package models

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/sloserve/sloserve/configs"
)

// watch follows the repositories: a new model folder is loaded, a changed
// config or version set is reloaded (the old versions serve until the new
// ones are ready), and a removed folder is unloaded after draining. A change
// that fails to load leaves the previous version serving. In poll mode it
// looks every poll interval and whenever Rescan asks; in none mode only
// when Rescan asks.
func (r *Registry) watch(ctx context.Context) {
	defer close(r.watchDone)
	var (
		timer *time.Timer
		tick  <-chan time.Time
	)
	if r.opts.Control == ControlPoll {
		timer = time.NewTimer(time.Duration(r.pollInterval.Load()))
		defer timer.Stop()
		tick = timer.C
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick:
		case <-r.rescan:
		}
		r.pollOnce(ctx)
		if timer != nil {
			// Read again: a config reload may have changed it.
			timer.Reset(time.Duration(r.pollInterval.Load()))
		}
	}
}

// Rescan asks for a pass over the repositories now, as a poll does, in
// poll and none modes; it returns at once. Requests made while a pass runs
// collapse into one more pass. In explicit mode it only refreshes the list
// of models the index shows: loading stays with the API.
func (r *Registry) Rescan() {
	if r.opts.Control == ControlExplicit {
		r.scan()
		return
	}
	select {
	case r.rescan <- struct{}{}:
	default:
	}
}

// SetPollInterval changes the poll interval from the next poll on.
func (r *Registry) SetPollInterval(d time.Duration) {
	if d > 0 {
		r.pollInterval.Store(int64(d))
	}
}

// SetDrainTimeout changes how long an unload or reload waits for in-flight
// requests.
func (r *Registry) SetDrainTimeout(d time.Duration) {
	if d >= 0 {
		r.drainTimeout.Store(int64(d))
	}
}

// SetRepositories replaces the list of model repositories after checking
// that each is a readable directory (an error changes nothing). The models
// of an added repository are found, and those of a removed one lost, at the
// next pass over the repositories (see Rescan); in explicit mode a loaded
// model stays loaded until it is unloaded.
func (r *Registry) SetRepositories(repos []string) error {
	if len(repos) == 0 {
		return fmt.Errorf("%w: no model repository", ErrBadConfig)
	}
	if err := checkRepositories(repos); err != nil {
		return err
	}
	r.mu.Lock()
	r.repos = slices.Clone(repos)
	r.mu.Unlock()
	return nil
}

// repositories returns the current list of model repositories.
func (r *Registry) repositories() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.repos
}

func checkRepositories(repos []string) error {
	for _, repo := range repos {
		if st, err := os.Stat(repo); err != nil || !st.IsDir() {
			return fmt.Errorf("model repository %q: not a readable directory", repo)
		}
	}
	return nil
}

// pollOnce is one pass over the repositories.
func (r *Registry) pollOnce(ctx context.Context) {
	present := map[string]bool{}
	for _, name := range r.scan() {
		present[name] = true
	}
	type known struct{ name, dir, fingerprint string }
	var all []known
	r.mu.RLock()
	for name, m := range r.models {
		all = append(all, known{name, m.dir, m.fingerprint})
	}
	r.mu.RUnlock()
	type change struct{ name, why string }
	var changes []change
	var gone []string
	for _, k := range all { // reading the folders without the lock
		if !present[k.name] {
			gone = append(gone, k.name)
			continue
		}
		// A model's print is one of the two (an ensemble's counts its
		// version folders, which hold no model file).
		if fp, ens := fingerprint(k.dir); fp != k.fingerprint && ens != k.fingerprint {
			why := "changed"
			if k.fingerprint == "" {
				why = "new"
			}
			changes = append(changes, change{k.name, why})
		}
	}
	if len(gone) > 0 {
		// From now on requests find no such model, also while the
		// unload below drains the ones in flight.
		r.mu.Lock()
		for _, name := range gone {
			if m, ok := r.models[name]; ok {
				m.removed = true
			}
		}
		r.mu.Unlock()
	}
	slices.Sort(gone)
	slices.SortFunc(changes, func(a, b change) int { return strings.Compare(a.name, b.name) })
	// Ensembles load after the models they run.
	ensembles := map[string]bool{}
	for _, c := range changes {
		ensembles[c.name] = r.isEnsemble(c.name)
	}
	slices.SortStableFunc(changes, func(a, b change) int {
		return compareBool(ensembles[a.name], ensembles[b.name])
	})
	for _, name := range gone {
		r.log.Info("model folder removed; unloading", "model", name)
		if err := r.unload(ctx, name, "removed from the repository", true); err != nil {
			r.log.Warn("unload of a removed model failed", "model", name, "err", err)
		}
		r.mu.Lock()
		if m, ok := r.models[name]; ok && len(m.serving) == 0 {
			delete(r.models, name)
			r.metrics.forgetModel(name)
		}
		r.mu.Unlock()
	}
	for _, c := range changes {
		r.log.Info("model folder "+c.why+"; loading", "model", c.name)
		// A failure is logged, counted and shown in the index by load.
		_ = r.load(ctx, c.name)
	}
	if len(changes) > 0 {
		r.retryEnsembles(ctx, ensembles)
	}
}

// fingerprint summarises what a load of a model folder reads: the config
// file's bytes and, for every version folder a load would see (symlinked
// ones too), the model file's real path, size and time. Other folders, such
// as a hidden one a new version is staged in, do not count. ensemble is
// the print of the folder as an ensemble's: the same, and the numbered
// folders an ensemble's versions are, which hold no model file.
func fingerprint(dir string) (model, ensemble string) {
	h := sha256.New()
	for _, name := range configs.ModelConfigFiles {
		// configs.ReadFile refuses a FIFO or a device (it would hang or
		// exhaust memory here, on every poll); the error is the print, and
		// the load it triggers reports it.
		b, err := configs.ReadFile(filepath.Join(dir, name))
		switch {
		case err == nil:
			fmt.Fprintf(h, "%s:%d:", name, len(b))
			h.Write(b)
		case !errors.Is(err, fs.ErrNotExist):
			fmt.Fprintf(h, "%s:%v:", name, err)
		}
	}
	versions, err := configs.ListVersions(dir)
	if err != nil {
		fmt.Fprintf(h, "|%v", err)
	}
	for _, v := range versions {
		path := filepath.Join(dir, strconv.FormatInt(v, 10), configs.ModelFile)
		st, err := os.Stat(path)
		if err != nil {
			continue
		}
		real, _ := filepath.EvalSymlinks(path)
		fmt.Fprintf(h, "|%d:%s:%d:%d", v, real, st.Size(), st.ModTime().UnixNano())
	}
	model = hex.EncodeToString(h.Sum(nil))
	folders, err := configs.EnsembleVersions(dir)
	fmt.Fprintf(h, "|ensemble versions %v %v", folders, err)
	return model, hex.EncodeToString(h.Sum(nil))
}
