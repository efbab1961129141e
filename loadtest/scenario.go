package loadtest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/sloserve/sloserve/control"
)

// A Scenario is a load test written down: which models to drive, with what
// arrivals and inputs, for how long, and (for --serve and --compare) how to
// start the server. loadtest/scenarios holds the project's own.
type Scenario struct {
	Name        string        `yaml:"name"`
	Description string        `yaml:"description"`
	Duration    time.Duration `yaml:"duration"` // the measured window
	// Warmup is sent before the measured window and not recorded: it lets
	// the server's forecasts, shares and connections settle.
	Warmup time.Duration  `yaml:"warmup"`
	Seed   uint64         `yaml:"seed"`
	Server ScenarioServer `yaml:"server"`
	Models []ModelLoad    `yaml:"models"`

	dir string // the scenario file's folder: relative paths start there
}

// ScenarioServer says how to start the server for this scenario.
type ScenarioServer struct {
	// Repository is the model repository, relative to the scenario file;
	// empty: the server's configured repositories.
	Repository string `yaml:"repository"`
	// Policies compared by --compare, in order.
	Policies []string `yaml:"policies"`
	// Set holds server config overrides as key=value, as `serve --set`.
	Set []string `yaml:"set"`
}

// ModelLoad is one model's load.
type ModelLoad struct {
	Model    string `yaml:"model"`
	Version  string `yaml:"version"`
	Protocol string `yaml:"protocol"` // rest, rest-binary or grpc (default)
	// Connections is how many gRPC connections the model's requests take
	// in turn; 0: the run's (--connections, DefaultConnections).
	Connections int `yaml:"connections"`
	// SLO and Class override what the server reports for the model when
	// classifying outcomes; zero: the server's.
	SLO   time.Duration `yaml:"slo"`
	Class string        `yaml:"class"`
	// Timeout is the client's deadline per request, also sent to the server
	// as the request's timeout; 0: 4 x the SLO, at least 1 s.
	Timeout time.Duration `yaml:"timeout"`
	// Concurrency > 0 drives the model in a closed loop: that many clients,
	// each sending its next request when the last one ends; Rate and
	// Process are then unused.
	Concurrency int              `yaml:"concurrency"`
	Process     ProcessSpec      `yaml:"process"`
	Rate        RateSpec         `yaml:"rate"`
	Inputs      map[string]Input `yaml:"inputs"`
}

// ProcessSpec is the shape of inter-arrival times: poisson (default) or
// gamma with a coefficient of variation.
type ProcessSpec struct {
	Kind string  `yaml:"kind"`
	CV   float64 `yaml:"cv"`
}

// RateSpec is one of the rate schedules, or a trace to replay.
type RateSpec struct {
	Constant *float64     `yaml:"constant"`
	Steps    []StepSpec   `yaml:"steps"`
	Diurnal  *DiurnalSpec `yaml:"diurnal"`
	Trace    *TraceSpec   `yaml:"trace"`
}

// StepSpec is one step of a steps schedule.
type StepSpec struct {
	At   time.Duration `yaml:"at"`
	Rate float64       `yaml:"rate"`
}

// DiurnalSpec is a compressed day: the rate moves between min and max once
// a period, peaking at peak_at (a fraction of the period). hourly, when
// given, is the day's shape as 24 relative levels.
type DiurnalSpec struct {
	Period time.Duration `yaml:"period"`
	Min    float64       `yaml:"min"`
	Max    float64       `yaml:"max"`
	PeakAt float64       `yaml:"peak_at"`
	Hourly []float64     `yaml:"hourly"`
}

// TraceSpec replays a CSV of arrival timestamps.
type TraceSpec struct {
	File      string        `yaml:"file"`   // relative to the scenario file
	Column    string        `yaml:"column"` // empty: the first column named like a time
	TimeScale float64       `yaml:"time_scale"`
	RateScale float64       `yaml:"rate_scale"`
	Start     time.Duration `yaml:"start"`
	Loop      bool          `yaml:"loop"`
	// Modulate thins the trace's arrivals by a diurnal curve.
	Modulate *DiurnalSpec `yaml:"modulate"`
}

// Input is how one model input is filled.
type Input struct {
	Shape []int64 `yaml:"shape"`
	Data  string  `yaml:"data"` // random (default), zeros or ones
	File  string  `yaml:"file"` // raw little-endian tensor bytes, relative to the scenario file
}

// ErrScenario marks an invalid scenario.
var ErrScenario = errors.New("invalid scenario")

// LoadScenario reads and validates a scenario file.
func LoadScenario(path string) (*Scenario, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	sc, err := ParseScenario(data, filepath.Dir(path))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return sc, nil
}

// ParseScenario decodes a scenario strictly (unknown fields are errors)
// and validates it; dir is where relative paths start.
func ParseScenario(data []byte, dir string) (*Scenario, error) {
	sc := &Scenario{dir: dir}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(sc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%w: empty file", ErrScenario)
		}
		return nil, fmt.Errorf("%w: %v", ErrScenario, err)
	}
	if err := sc.Validate(); err != nil {
		return nil, err
	}
	return sc, nil
}

// Path resolves a path of the scenario file relative to its folder.
func (sc *Scenario) Path(p string) string {
	if p == "" || filepath.IsAbs(p) {
		return p
	}
	return filepath.Join(sc.dir, p)
}

// Validate checks the scenario's fields and their combinations; the error
// names every problem by its field path.
func (sc *Scenario) Validate() error {
	var errs []string
	bad := func(field, format string, args ...any) {
		errs = append(errs, field+": "+fmt.Sprintf(format, args...))
	}
	if sc.Name == "" {
		bad("name", "required")
	}
	if sc.Duration <= 0 {
		bad("duration", "must be greater than 0, got %s", sc.Duration)
	}
	if sc.Warmup < 0 {
		bad("warmup", "must not be negative, got %s", sc.Warmup)
	}
	for i, p := range sc.Server.Policies {
		if !slices.Contains([]string{control.SharePolicyStatic, control.SharePolicyShared, control.SharePolicyAdaptive}, p) {
			bad(fmt.Sprintf("server.policies[%d]", i), "want %s, %s or %s, got %q", control.SharePolicyStatic, control.SharePolicyShared, control.SharePolicyAdaptive, p)
		}
	}
	for i, kv := range sc.Server.Set {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			bad(fmt.Sprintf("server.set[%d]", i), "want key=value, got %q", kv)
		}
	}
	if len(sc.Models) == 0 {
		bad("models", "at least one model is required")
	}
	for i := range sc.Models {
		m := &sc.Models[i]
		f := fmt.Sprintf("models[%d]", i)
		if m.Model == "" {
			bad(f+".model", "required")
		}
		if m.Protocol == "" {
			m.Protocol = ProtoGRPC
		}
		if !slices.Contains([]string{ProtoREST, ProtoRESTBinary, ProtoGRPC}, m.Protocol) {
			bad(f+".protocol", "want rest, rest-binary or grpc, got %q", m.Protocol)
		}
		if m.Connections < 0 || m.Connections > clientMaxConnections {
			bad(f+".connections", "want 0 (the run's) to %d, got %d", clientMaxConnections, m.Connections)
		} else if m.Connections > 0 && m.Protocol != ProtoGRPC {
			bad(f+".connections", "only for protocol grpc (REST opens connections as its requests need them)")
		}
		if m.Class != "" && m.Class != LatencyCritical && m.Class != BestEffort {
			bad(f+".class", "want latency-critical or best-effort, got %q", m.Class)
		}
		if m.SLO < 0 {
			bad(f+".slo", "must not be negative, got %s", m.SLO)
		}
		if m.Timeout < 0 {
			bad(f+".timeout", "must not be negative, got %s", m.Timeout)
		}
		for name, in := range m.Inputs {
			if in.Data != "" && in.Data != "random" && in.Data != "zeros" && in.Data != "ones" {
				bad(f+".inputs."+name+".data", "want random, zeros or ones, got %q", in.Data)
			}
			if in.File != "" && in.Data != "" {
				bad(f+".inputs."+name, "give data or file, not both")
			}
		}
		switch {
		case m.Concurrency < 0:
			bad(f+".concurrency", "must not be negative, got %d", m.Concurrency)
		case m.Concurrency > 0:
			if !m.Rate.empty() {
				bad(f, "give concurrency (closed loop) or rate (open loop), not both")
			}
		default:
			if _, err := m.process(); err != nil {
				bad(f+".process", "%v", err)
			}
			if _, err := m.Rate.kinds(); err != nil {
				bad(f+".rate", "%v", err)
			} else if _, err := sc.schedule(m); err != nil {
				bad(f+".rate", "%v", err)
			}
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w:\n  %s", ErrScenario, strings.Join(errs, "\n  "))
	}
	return nil
}

func (r RateSpec) empty() bool {
	return r.Constant == nil && r.Steps == nil && r.Diurnal == nil && r.Trace == nil
}

// kinds checks that exactly one schedule is given.
func (r RateSpec) kinds() (string, error) {
	var set []string
	if r.Constant != nil {
		set = append(set, "constant")
	}
	if r.Steps != nil {
		set = append(set, "steps")
	}
	if r.Diurnal != nil {
		set = append(set, "diurnal")
	}
	if r.Trace != nil {
		set = append(set, "trace")
	}
	switch len(set) {
	case 0:
		return "", errors.New("give one of constant, steps, diurnal or trace (or concurrency for a closed loop)")
	case 1:
		return set[0], nil
	}
	return "", fmt.Errorf("give one of constant, steps, diurnal or trace, not %s", strings.Join(set, " and "))
}

func (m *ModelLoad) process() (Process, error) {
	p := Process{Kind: m.Process.Kind, CV: m.Process.CV}
	if p.Kind == "" {
		p.Kind = "poisson"
	}
	return p, p.Validate()
}

func (d *DiurnalSpec) schedule() (Diurnal, error) {
	s := Diurnal{Period: d.Period, Min: d.Min, Max: d.Max, PeakAt: d.PeakAt, Hourly: d.Hourly}
	return s, s.Validate()
}

// schedule builds the rate schedule of an open-loop model. A trace has no
// Schedule; for it the result is nil.
func (sc *Scenario) schedule(m *ModelLoad) (Schedule, error) {
	r := m.Rate
	switch {
	case r.Constant != nil:
		s := Constant{RPS: *r.Constant}
		return s, s.Validate()
	case r.Steps != nil:
		s := make(Steps, len(r.Steps))
		for i, st := range r.Steps {
			s[i] = Step{At: st.At, Rate: st.Rate}
		}
		return s, s.Validate()
	case r.Diurnal != nil:
		return r.Diurnal.schedule()
	case r.Trace != nil:
		if _, err := sc.traceOptions(r.Trace); err != nil {
			return nil, err
		}
		if r.Trace.File == "" {
			return nil, errors.New("trace.file: required")
		}
		return nil, nil
	}
	return nil, errors.New("no rate")
}

func (sc *Scenario) traceOptions(t *TraceSpec) (TraceOptions, error) {
	o := TraceOptions{TimeScale: t.TimeScale, RateScale: t.RateScale, Start: t.Start, Loop: t.Loop}
	if t.Modulate != nil {
		d, err := t.Modulate.schedule()
		if err != nil {
			return o, fmt.Errorf("trace.modulate: %w", err)
		}
		o.Modulate = d
	}
	return o, o.Validate()
}

// Arrivals returns model i's send offsets over [-Warmup, Duration), the
// measured window starting at 0, as a run sends them: for replaying a
// scenario's open-loop load elsewhere (the server's simulated-time days).
func (sc *Scenario) Arrivals(i int) ([]time.Duration, error) {
	offs, _, err := sc.arrivals(i, 1)
	return offs, err
}

// arrivals returns model i's send offsets over [-Warmup, Duration) shifted
// so that the measured window starts at 0, with scale multiplying an open-
// loop schedule's rate (the capacity search; 1 otherwise). Traces are
// loaded here.
func (sc *Scenario) arrivals(i int, scale float64) ([]time.Duration, string, error) {
	m := &sc.Models[i]
	total := sc.Warmup + sc.Duration
	seed := sc.Seed*1000003 + uint64(i)
	p, err := m.process()
	if err != nil {
		return nil, "", err
	}
	var offs []time.Duration
	var desc string
	if m.Rate.Trace != nil {
		t := m.Rate.Trace
		tr, err := LoadTrace(sc.Path(t.File), t.Column)
		if err != nil {
			return nil, "", err
		}
		o, err := sc.traceOptions(t)
		if err != nil {
			return nil, "", err
		}
		if o.RateScale == 0 {
			o.RateScale = 1
		}
		o.RateScale *= scale
		offs = tr.Arrivals(o, total, seed)
		desc = fmt.Sprintf("trace %s (%d arrivals over %s), time x%g, rate x%g", filepath.Base(t.File), len(tr.Offsets), tr.Span.Round(time.Second), orOne(t.TimeScale), o.RateScale)
		if o.Modulate != nil {
			desc += ", modulated by " + o.Modulate.String()
		}
	} else {
		s, err := sc.schedule(m)
		if err != nil {
			return nil, "", err
		}
		if scale != 1 {
			s = Scaled{Schedule: s, Factor: scale}
		}
		// The schedule's t=0 is the start of the measured window; the
		// warmup before it runs at the schedule's rate at 0.
		offs = Arrivals(p, warmupSchedule{s, sc.Warmup}, total, seed)
		desc = s.String() + ", " + p.String()
	}
	for j := range offs {
		offs[j] -= sc.Warmup
	}
	return offs, desc, nil
}

func orOne(f float64) float64 {
	if f == 0 {
		return 1
	}
	return f
}

// warmupSchedule runs the first Warmup of a run at the schedule's rate at
// its start, then the schedule itself.
type warmupSchedule struct {
	Schedule
	warmup time.Duration
}

func (w warmupSchedule) Rate(t time.Duration) float64 {
	if t < w.warmup {
		return w.Schedule.Rate(0)
	}
	return w.Schedule.Rate(t - w.warmup)
}
