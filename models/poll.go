package models

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"
)

// poll watches the repositories: a new model folder is loaded, a changed
// config or version set is reloaded (the old versions serve until the new
// ones are ready), and a removed folder is unloaded after draining. A change
// that fails to load leaves the previous version serving.
func (r *Registry) poll(ctx context.Context) {
	defer close(r.pollDone)
	t := time.NewTicker(r.opts.PollInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r.pollOnce(ctx)
	}
}

func (r *Registry) pollOnce(ctx context.Context) {
	present := r.scan()
	r.mu.RLock()
	type change struct{ name, why string }
	var changes []change
	var gone []string
	for name, m := range r.models {
		if !slices.Contains(present, name) {
			gone = append(gone, name)
			continue
		}
		if fp := fingerprint(m.dir); fp != m.fingerprint {
			why := "changed"
			if m.fingerprint == "" {
				why = "new"
			}
			changes = append(changes, change{name, why})
		}
	}
	r.mu.RUnlock()
	for _, name := range gone {
		r.log.Info("model folder removed; unloading", "model", name)
		if err := r.unload(ctx, name, "removed from the repository"); err != nil {
			r.log.Warn("poll: unload failed", "model", name, "err", err)
		}
		r.mu.Lock()
		if m, ok := r.models[name]; ok && len(m.serving) == 0 {
			delete(r.models, name)
		}
		r.mu.Unlock()
	}
	for _, c := range changes {
		r.log.Info("model folder "+c.why+"; loading", "model", c.name)
		if err := r.load(ctx, c.name); err != nil {
			r.log.Error("poll: load failed", "model", c.name, "err", err)
		}
	}
}

// fingerprint summarises what a load of a model folder reads: the config
// file's bytes and every version folder's model file size and time.
func fingerprint(dir string) string {
	h := sha256.New()
	for _, name := range []string{"config.yaml", "config.yml"} {
		if b, err := os.ReadFile(filepath.Join(dir, name)); err == nil {
			fmt.Fprintf(h, "%s:%d:", name, len(b))
			h.Write(b)
		}
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		if st, err := os.Stat(filepath.Join(dir, e.Name(), "model.onnx")); err == nil {
			fmt.Fprintf(h, "|%s:%d:%d", e.Name(), st.Size(), st.ModTime().UnixNano())
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}
