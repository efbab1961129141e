package loadtest

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sloserve/sloserve/configs"
)

// The project's own scenarios must stay valid.
func TestShippedScenarios(t *testing.T) {
	files, err := filepath.Glob("scenarios/*.yaml")
	if err != nil || len(files) < 3 {
		t.Fatalf("scenarios: %v %v", files, err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			sc, err := LoadScenario(f)
			if err != nil {
				t.Fatal(err)
			}
			if sc.Server.Repository != "" {
				repo := sc.Path(sc.Server.Repository)
				if _, err := os.Stat(repo); err != nil {
					t.Errorf("server.repository: %v", err)
				}
				// Every model config in it is one the server accepts:
				// a scenario that only runs elsewhere (gpu-day-cuda on a
				// real GPU) is checked here too.
				dirs, _ := os.ReadDir(repo)
				for _, d := range dirs {
					if !d.IsDir() {
						continue
					}
					if _, err := configs.LoadModel(filepath.Join(repo, d.Name())); err != nil {
						t.Errorf("server.repository %s: %v", d.Name(), err)
					}
				}
			}
			// A trace the scenario replays ships with the project.
			for i, m := range sc.Models {
				if m.Rate.Trace == nil {
					continue
				}
				if _, err := LoadTrace(sc.Path(m.Rate.Trace.File), m.Rate.Trace.Column); err != nil {
					t.Errorf("models[%d].rate.trace.file: %v", i, err)
				}
			}
		})
	}
}

func TestScenarioErrors(t *testing.T) {
	const head = "name: x\nduration: 10s\n"
	cases := []struct {
		name, yaml, want string
	}{
		{"empty", "", "empty file"},
		{"unknown field", head + "modelz: []\n", "modelz"},
		{"no name", "duration: 1s\nmodels: [{model: m, rate: {constant: 1}}]\n", "name: required"},
		{"no duration", "name: x\nmodels: [{model: m, rate: {constant: 1}}]\n", "duration: must be greater than 0"},
		{"negative warmup", head + "warmup: -1s\nmodels: [{model: m, rate: {constant: 1}}]\n", "warmup: must not be negative"},
		{"no models", head, "models: at least one"},
		{"no model name", head + "models: [{rate: {constant: 1}}]\n", "models[0].model: required"},
		{"bad protocol", head + "models: [{model: m, protocol: http, rate: {constant: 1}}]\n", `models[0].protocol: want rest, rest-binary or grpc, got "http"`},
		{"negative connections", head + "models: [{model: m, connections: -1, rate: {constant: 1}}]\n", "models[0].connections: want 0 (the run's) to 256, got -1"},
		{"too many connections", head + "models: [{model: m, connections: 1000, rate: {constant: 1}}]\n", "models[0].connections: want 0 (the run's) to 256, got 1000"},
		{"connections over REST", head + "models: [{model: m, protocol: rest, connections: 2, rate: {constant: 1}}]\n", "models[0].connections: only for protocol grpc"},
		{"bad class", head + "models: [{model: m, class: gold, rate: {constant: 1}}]\n", "models[0].class"},
		{"no rate", head + "models: [{model: m}]\n", "models[0].rate: give one of"},
		{"two rates", head + "models: [{model: m, rate: {constant: 1, diurnal: {period: 1m, max: 2}}}]\n", "not constant and diurnal"},
		{"rate and concurrency", head + "models: [{model: m, concurrency: 2, rate: {constant: 1}}]\n", "not both"},
		{"negative concurrency", head + "models: [{model: m, concurrency: -1}]\n", "concurrency: must not be negative"},
		{"negative rate", head + "models: [{model: m, rate: {constant: -1}}]\n", "models[0].rate"},
		{"bad process", head + "models: [{model: m, process: {kind: weibull}, rate: {constant: 1}}]\n", "models[0].process"},
		{"gamma without cv", head + "models: [{model: m, process: {kind: gamma}, rate: {constant: 1}}]\n", "models[0].process"},
		{"diurnal min over max", head + "models: [{model: m, rate: {diurnal: {period: 1m, min: 5, max: 2}}}]\n", "models[0].rate"},
		{"trace without file", head + "models: [{model: m, rate: {trace: {time_scale: 2}}}]\n", "trace.file: required"},
		{"bad input data", head + "models: [{model: m, rate: {constant: 1}, inputs: {x: {data: pi}}}]\n", "inputs.x.data"},
		{"bad policy", head + "server: {policies: [fair]}\nmodels: [{model: m, rate: {constant: 1}}]\n", "server.policies[0]"},
		{"bad set", head + "server: {set: [novalue]}\nmodels: [{model: m, rate: {constant: 1}}]\n", "server.set[0]"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := ParseScenario([]byte(c.yaml), ".")
			if err == nil {
				t.Fatal("no error")
			}
			if !errors.Is(err, ErrScenario) {
				t.Errorf("error %v is not ErrScenario", err)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %q does not contain %q", err, c.want)
			}
		})
	}
}

// arrivals of a scenario: the warmup comes before offset 0, at the
// schedule's starting rate; the window follows the schedule; the rate
// scale multiplies it; the seed fixes it.
func TestScenarioArrivals(t *testing.T) {
	sc, err := ParseScenario([]byte(`name: x
duration: 100s
warmup: 20s
seed: 3
models:
  - model: m
    rate: {steps: [{at: 0s, rate: 10}, {at: 50s, rate: 30}]}
`), ".")
	if err != nil {
		t.Fatal(err)
	}
	count := func(offs []time.Duration, from, to time.Duration) float64 {
		n := 0
		for _, o := range offs {
			if o >= from && o < to {
				n++
			}
		}
		return float64(n)
	}
	within := func(name string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 4*math.Sqrt(want) {
			t.Errorf("%s: %v arrivals, want %v ± %.0f", name, got, want, 4*math.Sqrt(want))
		}
	}
	for _, scale := range []float64{1, 2} {
		offs, desc, err := sc.arrivals(0, scale)
		if err != nil {
			t.Fatal(err)
		}
		if desc == "" {
			t.Error("no description")
		}
		within("warmup", count(offs, -20*time.Second, 0), 10*20*scale)
		within("first step", count(offs, 0, 50*time.Second), 10*50*scale)
		within("second step", count(offs, 50*time.Second, 100*time.Second), 30*50*scale)
		if n := count(offs, 100*time.Second, time.Hour) + count(offs, -time.Hour, -20*time.Second); n != 0 {
			t.Errorf("%v arrivals outside [-warmup, duration)", n)
		}
		again, _, _ := sc.arrivals(0, scale)
		if len(again) != len(offs) || again[len(again)/2] != offs[len(offs)/2] {
			t.Error("same seed, different arrivals")
		}
	}
}
