package loadtest

import (
	"context"
	"errors"
	"time"
)

// SearchOptions tune the capacity search.
type SearchOptions struct {
	Target float64       // attainment every latency-critical model must keep; 0: 0.99
	Probe  time.Duration // measured length of each probe; 0: 20 s
	Warmup time.Duration // before each probe; 0: 5 s
	Start  float64       // first scale tried; 0: 1
	Max    float64       // highest scale tried; 0: 1024
	// Precision ends the bisection when hi/lo - 1 is below it; 0: 0.05.
	Precision float64
}

// Probe is one step of the search.
type Probe struct {
	Scale      float64  `json:"scale"`
	Attainment float64  `json:"attainment"` // the lowest among the judged models
	Pass       bool     `json:"pass"`
	Behind     bool     `json:"generator_behind"`
	Summary    *Summary `json:"summary"`
}

// SearchResult is the highest scale that kept the target, and how it was
// found.
type SearchResult struct {
	Scale  float64 `json:"scale"` // 0: not even the lowest probe passed
	Target float64 `json:"target"`
	Probes []Probe `json:"probes"`
}

// Search finds the highest multiple of the scenario's open-loop rates at
// which every latency-critical model (every model, when none is) keeps the
// target SLO attainment: doubling from Start until a probe fails, then
// bisecting. Each probe is a short run of its own.
func Search(ctx context.Context, sc *Scenario, opts Options, so SearchOptions, logf func(format string, args ...any)) (*SearchResult, error) {
	if so.Target == 0 {
		so.Target = 0.99
	}
	if so.Probe == 0 {
		so.Probe = 20 * time.Second
	}
	if so.Warmup == 0 {
		so.Warmup = 5 * time.Second
	}
	if so.Start == 0 {
		so.Start = 1
	}
	if so.Max == 0 {
		so.Max = 1024
	}
	if so.Precision == 0 {
		so.Precision = 0.05
	}
	for _, m := range sc.Models {
		if m.Concurrency > 0 {
			return nil, errors.New("the capacity search scales open-loop rates; closed-loop models (concurrency) have none")
		}
	}
	res := &SearchResult{Target: so.Target}
	probe := func(scale float64) (bool, error) {
		o := opts
		o.Scale, o.Duration, o.Warmup, o.WarmupSet = scale, so.Probe, so.Warmup, true
		run, err := Execute(ctx, sc, o)
		if err != nil {
			return false, err
		}
		sum := Summarize(run)
		p := Probe{Scale: scale, Attainment: 1, Summary: sum, Behind: sum.Generator.Behind}
		judged := LatencyCritical
		if !hasClass(sum, LatencyCritical) {
			judged = ""
		}
		for _, m := range sum.Models {
			if judged == "" || m.Class == judged {
				p.Attainment = min(p.Attainment, m.Attainment)
			}
		}
		p.Pass = p.Attainment >= so.Target
		res.Probes = append(res.Probes, p)
		logf("scale %.3g: attainment %.4f (%s)", scale, p.Attainment, map[bool]string{true: "pass", false: "fail"}[p.Pass])
		if p.Behind {
			logf("scale %.3g: the generator fell behind (p99 lag %.1f ms): this probe measures the client too", scale, sum.Generator.LagP99ms)
		}
		return p.Pass, nil
	}
	scale, err := searchScale(so, probe)
	res.Scale = scale
	return res, err
}

// searchScale finds the highest scale probe passes: doubling from
// so.Start until a probe fails or so.Max is passed, halving (at most ten
// times) when even so.Start fails, then bisecting to so.Precision. It
// returns 0 when no probe passed.
func searchScale(so SearchOptions, probe func(scale float64) (bool, error)) (float64, error) {
	lo, hi := 0.0, 0.0
	for s := so.Start; ; s *= 2 {
		if s > so.Max {
			return lo, nil
		}
		ok, err := probe(s)
		if err != nil {
			return lo, err
		}
		if !ok {
			hi = s
			break
		}
		lo = s
	}
	if lo == 0 {
		for s, i := so.Start/2, 0; i < 10; s, i = s/2, i+1 {
			ok, err := probe(s)
			if err != nil {
				return 0, err
			}
			if ok {
				lo = s
				break
			}
			hi = s
		}
		if lo == 0 {
			return 0, nil
		}
	}
	for hi/lo-1 > so.Precision {
		mid := (lo + hi) / 2
		ok, err := probe(mid)
		if err != nil {
			return lo, err
		}
		if ok {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo, nil
}

func hasClass(s *Summary, class string) bool {
	for _, m := range s.Models {
		if m.Class == class {
			return true
		}
	}
	return false
}
