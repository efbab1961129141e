package models

import (
	"cmp"
	"slices"
)

// This file serves each version's statistics in the shape of Triton's
// statistics extension. Nothing is counted here: the version's scheduler
// counts every request once (qos.Stats), and this reads it.

// Statistics returns per-version statistics of loaded versions: all models
// when name is "", all versions of the model when ver is "".
func (r *Registry) Statistics(name, ver string) ([]Statistics, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	var ms []*model
	if name == "" {
		for _, m := range r.models {
			ms = append(ms, m)
		}
	} else if e, ok, err := r.ensembleLocked(name, ver); ok {
		if err != nil {
			return nil, err
		}
		return []Statistics{e.statistics()}, nil
	} else if ver != "" {
		_, v, err := r.findLocked(name, ver)
		if err != nil {
			return nil, err
		}
		return []Statistics{v.statistics()}, nil
	} else {
		m, err := r.modelLocked(name)
		if err != nil {
			return nil, err
		}
		ms = []*model{m}
	}
	var out []Statistics
	for _, m := range ms {
		for _, v := range m.serving {
			out = append(out, v.statistics())
		}
		if m.ens != nil {
			out = append(out, m.ens.statistics())
		}
	}
	slices.SortFunc(out, func(a, b Statistics) int {
		return cmp.Or(cmp.Compare(a.Name, b.Name), cmp.Compare(len(a.Version), len(b.Version)), cmp.Compare(a.Version, b.Version))
	})
	return out, nil
}

// statistics is the version's statistics, read from the scheduler that
// counts its requests: Triton's figures and the SLO accounting.
func (v *version) statistics() Statistics {
	s := Statistics{Name: v.model, Version: v.label}
	if v.sched == nil {
		return s
	}
	q, ok := v.sched.Stats(v.key)
	if !ok {
		return s
	}
	s.LastInference, s.InferenceCount, s.ExecutionCount = q.LastInference, q.Inferences, q.Executions
	s.Success, s.Fail, s.Queue = q.Success, q.Fail, q.Queue
	s.ComputeInput, s.ComputeInfer, s.ComputeOutput = q.ComputeInput, q.ComputeInfer, q.ComputeOutput
	s.Batches = make([]BatchStatistics, len(q.Batches))
	for i, b := range q.Batches {
		s.Batches[i] = BatchStatistics{
			BatchSize:     b.Size,
			ComputeInput:  Duration{Count: b.Count, Total: b.Input},
			ComputeInfer:  Duration{Count: b.Count, Total: b.Infer},
			ComputeOutput: Duration{Count: b.Count, Total: b.Output},
		}
	}
	s.SLO = &SLOStatistics{
		Class: string(q.Class), LatencyTarget: v.cfg.LatencyTarget(),
		Arrived: q.Arrived, Good: q.Good, Late: q.Late, Rejected: q.Rejected,
		Dropped: q.Dropped, Failed: q.Failed, Canceled: q.Canceled, Invalid: q.Invalid,
		QueueDepth: q.QueueDepth, Goodput: q.Goodput, Attainment: q.Attainment,
		MeanQueueDelay: q.MeanQueueDelay,
	}
	return s
}
