package models

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/runtime"
)

// This file answers what the registry knows about its models: readiness,
// metadata, configs, the repository index and the instances.

// ModelReady reports whether a version ("" = any) of the model can serve.
func (r *Registry) ModelReady(name, ver string) (bool, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if e, ok, err := r.ensembleLocked(name, ver); ok {
		if err != nil {
			return false, err
		}
		ready, _ := r.stepsReadyLocked(e)
		return ready, nil
	}
	_, v, err := r.findLocked(name, ver)
	if errors.Is(err, ErrNotReady) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return v.ready(), nil
}

// notes joins what the version's instances say about themselves (why one
// cannot serve) or, when all serve, the last fault they recovered from.
func (v *version) notes() string {
	members := v.pool.Members()
	var out []string
	for i, inst := range members {
		if _, why := inst.Status(); why != "" {
			if len(members) > 1 {
				why = fmt.Sprintf("instance %d: %s", i, why)
			}
			out = append(out, why)
		}
	}
	if len(out) == 0 {
		if f := v.fault.Load(); f != nil {
			return *f
		}
	}
	return strings.Join(out, "; ")
}

// setFault records an unexpected end of instance i's process.
func (v *version) setFault(i int, cause string) {
	f := fmt.Sprintf("recovered: instance %d's runner ended at %s: %s", i, time.Now().UTC().Format(time.RFC3339), cause)
	v.fault.Store(&f)
}

// ready reports whether any instance of the version can serve now.
func (v *version) ready() bool { return v.pool.Ready() }

// Metadata describes a model; ver "" describes its highest ready version.
func (r *Registry) Metadata(name, ver string) (Metadata, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if e, ok, err := r.ensembleLocked(name, ver); ok {
		if err != nil {
			return Metadata{}, err
		}
		return Metadata{Name: name, Versions: []string{e.label}, Platform: configs.PlatformEnsemble, Inputs: e.inputs, Outputs: e.outputs}, nil
	}
	m, v, err := r.findLocked(name, ver)
	if err != nil {
		return Metadata{}, err
	}
	ins, outs := v.wire()
	md := Metadata{Name: name, Platform: "onnxruntime_onnx", Inputs: ins, Outputs: outs}
	for _, sv := range m.serving {
		md.Versions = append(md.Versions, sv.label)
	}
	slices.SortFunc(md.Versions, func(a, b string) int { return cmp.Compare(len(a), len(b))*2 + cmp.Compare(a, b) })
	if ver != "" {
		md.Versions = []string{v.label}
	}
	return md, nil
}

// ModelConfig is the config a version ("" = the highest ready one) serves
// with, its inputs and outputs those of the loaded model. The copy shares
// its lists and policies with the version's: read it, do not change it.
func (r *Registry) ModelConfig(name, ver string) (*configs.Model, error) {
	if e, ok, err := r.ensemble(name, ver); ok {
		if err != nil {
			return nil, err
		}
		cfg := *e.cfg
		cfg.Warnings = nil
		return &cfg, nil
	}
	v, err := r.serving(name, ver)
	if err != nil {
		return nil, err
	}
	cfg := *v.cfg
	ins, outs := v.wire()
	cfg.Inputs, cfg.Outputs = tensorConfigs(ins, v.cfg.Inputs), tensorConfigs(outs, v.cfg.Outputs)
	cfg.Warnings = nil
	return &cfg, nil
}

// tensorConfigs are the tensors clients see, with the reshapes the
// config declares.
func tensorConfigs(specs []runtime.TensorSpec, declared []configs.TensorConfig) []configs.TensorConfig {
	out := make([]configs.TensorConfig, len(specs))
	for i, s := range specs {
		out[i] = configs.TensorConfig{Name: s.Name, DataType: string(s.DataType), Shape: slices.Clone(s.Shape)}
		if j := slices.IndexFunc(declared, func(t configs.TensorConfig) bool { return t.Name == s.Name }); j >= 0 {
			out[i].Reshape = slices.Clone(declared[j].Reshape)
		}
	}
	return out
}

// Index lists every model in the repositories with the state of each of its
// versions; readyOnly keeps the ready ones.
func (r *Registry) Index(readyOnly bool) []IndexEntry {
	if r.opts.Control == ControlExplicit {
		r.scan()
	}
	return r.IndexKnown(readyOnly)
}

// IndexKnown is Index without rescanning the repositories: the models the
// registry knows, for readers that come often (metrics, the dashboard).
func (r *Registry) IndexKnown(readyOnly bool) []IndexEntry {
	r.mu.RLock()
	defer r.mu.RUnlock()
	var out []IndexEntry
	for _, m := range r.models {
		if len(m.states) == 0 {
			if !readyOnly {
				out = append(out, IndexEntry{Name: m.name, State: StateUnavailable, Reason: m.reason})
			}
			continue
		}
		for n, e := range m.states {
			if m.ens != nil && m.ens.number == n && e.State == StateReady {
				if ready, why := r.stepsReadyLocked(m.ens); !ready {
					e = IndexEntry{Name: e.Name, Version: e.Version, State: StateUnavailable, Reason: why}
				}
			}
			if v, ok := m.serving[n]; ok && e.State == StateReady {
				if !v.ready() {
					e = IndexEntry{Name: e.Name, Version: e.Version, State: StateUnavailable, Reason: v.notes()}
				} else if e.Reason == "" {
					e.Reason = v.notes()
				}
			}
			if readyOnly && e.State != StateReady {
				continue
			}
			out = append(out, e)
		}
	}
	slices.SortFunc(out, func(a, b IndexEntry) int {
		return cmp.Or(cmp.Compare(a.Name, b.Name), cmp.Compare(len(a.Version), len(b.Version)), cmp.Compare(a.Version, b.Version))
	})
	return out
}

// loadFailures tells, for every model in the repositories, whether its last
// load or reload failed.
func (r *Registry) loadFailures() map[string]bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make(map[string]bool, len(r.models))
	for name, m := range r.models {
		out[name] = m.loadFailed
	}
	return out
}

// Instances calls fn for every instance of every serving version, for
// per-process metrics.
func (r *Registry) Instances(fn func(model, version string, index int, inst Instance)) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	for _, m := range r.models {
		for _, v := range m.serving {
			for i, inst := range v.pool.Members() {
				if inst, ok := inst.(Instance); ok {
					fn(m.name, v.label, i, inst)
				}
			}
		}
	}
}
