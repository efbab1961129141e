package configs

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"math"
	"os"
	"path/filepath"
	"regexp"
	goruntime "runtime"
	"slices"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/sloserve/sloserve/runtime"
	"github.com/sloserve/sloserve/simgpu"
)

// Values of the enumerated model config fields.
const (
	PlatformONNX        = "onnx"
	PlatformONNXRuntime = "onnxruntime_onnx" // Triton's name; read as PlatformONNX

	ProviderCPU  = "cpu"
	ProviderCUDA = "cuda"

	// IsolationProcess runs each instance in a runner process of its own
	// (the default); IsolationInProcess runs it inside the server.
	IsolationProcess   = "process"
	IsolationInProcess = "in-process"

	GraphOptDisable  = "disable"
	GraphOptBasic    = "basic"
	GraphOptExtended = "extended"
	GraphOptAll      = "all"

	ArenaNextPowerOfTwo  = "next_power_of_two"
	ArenaSameAsRequested = "same_as_requested"

	ConvAlgoExhaustive = "exhaustive"
	ConvAlgoHeuristic  = "heuristic"
	ConvAlgoDefault    = "default"

	ClassLatencyCritical = "latency-critical"
	ClassBestEffort      = "best-effort"
)

// Limits on model config values.
const (
	MaxInstances = 64
	// MaxConcurrency bounds execution.concurrency.
	MaxConcurrency = 64
	// MaxLatencyMS bounds slo.latency_ms (one hour) so LatencyTarget cannot overflow.
	MaxLatencyMS = 3_600_000
	// MaxVersions bounds the versions a model serves at once (its
	// version policy's selection): each starts its own instances.
	MaxVersions = 16
	// MaxRunnersPerModel bounds instances × served versions: the runner
	// processes one model config may start.
	MaxRunnersPerModel = MaxInstances
)

// MaxThreads bounds execution.intra_op_threads and inter_op_threads: four
// times this machine's CPUs, and at least 16. ONNX Runtime starts an OS
// thread per configured thread, so more threads than CPUs only add context
// switches; a count in the thousands exhausts the process and pids limits
// that every runner shares and aborts more than its own model. Four times
// leaves room to try oversubscription; the floor lets a config written for
// a larger machine load on a small one.
func MaxThreads() int { return max(16, 4*goruntime.NumCPU()) }

// The file names LoadModel looks for in a model folder. A folder with a
// config.yaml (or config.yml) is read from it; one with only a Triton
// config.pbtxt is read from that.
const (
	ModelConfigFile    = "config.yaml"
	ModelConfigFileAlt = "config.yml"
	ModelConfigPbtxt   = "config.pbtxt"
)

// ModelConfigFiles are all the config file names of a model folder, in the
// order LoadModel prefers them.
var ModelConfigFiles = []string{ModelConfigFile, ModelConfigFileAlt, ModelConfigPbtxt}

// Model is one model's config.yaml. See examples/model.yaml.
type Model struct {
	Name          string         `yaml:"name"`
	Platform      string         `yaml:"platform"`
	VersionPolicy VersionPolicy  `yaml:"version_policy"`
	MaxBatchSize  int            `yaml:"max_batch_size"`
	Inputs        []TensorConfig `yaml:"inputs,omitempty"`
	Outputs       []TensorConfig `yaml:"outputs,omitempty"`
	Instances     int            `yaml:"instances"`
	Execution     Execution      `yaml:"execution"`
	SLO           SLO            `yaml:"slo,omitempty"`
	// DynamicBatching tunes how queued requests are merged into batches
	// (models with max_batch_size > 0).
	DynamicBatching DynamicBatching `yaml:"dynamic_batching"`
	// MaxQueueSize bounds the requests waiting for this model; 0 means
	// the scheduler's default (256).
	MaxQueueSize int       `yaml:"max_queue_size"`
	Resources    Resources `yaml:"resources"`
	// Profile tells the predictor's profiling sweep how to build requests.
	Profile ModelProfile `yaml:"profile,omitempty"`
	// Ensemble is the pipeline of an ensemble (PlatformEnsemble, read
	// from a Triton config.pbtxt only); nil for a model of its own.
	Ensemble *Ensemble `yaml:"-"`

	Dir  string `yaml:"-"` // the model folder, when loaded by LoadModel
	File string `yaml:"-"` // the config file, as named in error messages
	// Warnings are what the loader accepted but could not honour in full
	// (config.pbtxt fields sloserve ignores, a config.pbtxt shadowed by a
	// config.yaml), one sentence each naming the file and field; the
	// caller logs them.
	Warnings []string `yaml:"-"`
}

// DynamicBatching tunes request merging.
type DynamicBatching struct {
	// MaxQueueDelay is how long the oldest request may wait for a batch to
	// fill (never past what its deadline allows); 0 sends at once.
	MaxQueueDelay time.Duration `yaml:"max_queue_delay"`
	// PreferredBatchSizes are sizes a batch is cut to and sent at once.
	PreferredBatchSizes []int `yaml:"preferred_batch_sizes,omitempty"`
	// PriorityLevels caps the priority a request may ask for (1 highest):
	// a request asking for a level above it gets the model's priority
	// (slo.priority), as Triton treats one. 0: no cap.
	PriorityLevels int `yaml:"priority_levels"`
	// DefaultTimeout bounds every request's time from arrival to answer,
	// as Triton's default queue policy timeout does: the request is
	// dropped when it cannot be answered in time. A request's own shorter
	// timeout still applies. 0: none.
	DefaultTimeout time.Duration `yaml:"default_timeout"`
}

// VersionPolicy chooses which of the versions on disk are served. Exactly
// one field is set; all nil means the default, the latest version.
type VersionPolicy struct {
	Latest   *LatestPolicy   `yaml:"latest,omitempty"`
	All      *AllPolicy      `yaml:"all,omitempty"`
	Specific *SpecificPolicy `yaml:"specific,omitempty"`
}

// LatestPolicy serves the NumVersions highest versions.
type LatestPolicy struct {
	NumVersions int `yaml:"num_versions"`
}

// AllPolicy serves every version.
type AllPolicy struct{}

// SpecificPolicy serves the listed versions that exist.
type SpecificPolicy struct {
	Versions []int64 `yaml:"versions"`
}

// TensorConfig declares a model input or output. DataType is an Open
// Inference Protocol name such as FP32; a dimension of -1 is dynamic.
type TensorConfig struct {
	Name     string  `yaml:"name"`
	DataType string  `yaml:"datatype"`
	Shape    []int64 `yaml:"shape"`
	// Reshape is the tensor's shape in the model file when clients send
	// or get it in another one (Shape): the same elements in the same
	// order, the batch dimension first as in Shape. Every other dimension
	// of both must be fixed. nil: the model's shape is Shape; [] (no
	// batching) is a scalar.
	Reshape Reshape `yaml:"reshape,omitempty"`
}

// Reshape is a tensor's shape in the model file. It is left out of YAML
// only when nil: [] (a scalar) is written, so that it reads back as one.
type Reshape []int64

// IsZero implements yaml.IsZeroer for omitempty.
func (r Reshape) IsZero() bool { return r == nil }

// ModelShape is the tensor's shape in the model file: Reshape when set,
// else Shape.
func (t TensorConfig) ModelShape() []int64 {
	if t.Reshape != nil {
		return t.Reshape
	}
	return t.Shape
}

// Execution configures the ONNX Runtime session.
type Execution struct {
	Provider string `yaml:"provider"`
	DeviceID int    `yaml:"device_id"`
	// DeviceGiven says the config names the device (device_id in
	// config.yaml, instance_group.gpus in config.pbtxt): with
	// gpu.placement on, such a model is pinned there; one without is
	// placed by the server.
	DeviceGiven bool `yaml:"-"`
	// Auto says the config leaves the device to the server: the GPU when
	// the server has one, else the CPU (Triton's KIND_AUTO; see
	// Model.OnDevice). Provider is cpu until resolved.
	Auto              bool   `yaml:"-"`
	IntraOpThreads    int    `yaml:"intra_op_threads"` // 0: ONNX Runtime's default
	InterOpThreads    int    `yaml:"inter_op_threads"` // 0: ONNX Runtime's default
	GraphOptimization string `yaml:"graph_optimization"`
	// AllowSpinning lets idle intra-op threads spin between runs: a little
	// lower latency for this model, at the cost of CPU that co-located
	// models could use. Off by default on a shared server.
	AllowSpinning bool `yaml:"allow_spinning"`
	// Concurrency is how many requests one instance runs at once; more than
	// 1 overlaps the transfer of one request with the run of another.
	// 0 means 1.
	Concurrency int `yaml:"concurrency"`
	// CUDA holds the CUDA provider options. After LoadModel or ParseModel
	// it is non-nil exactly when Provider is cuda.
	CUDA *CUDA `yaml:"cuda,omitempty"`
	// Isolation is where instances run: "process" (a runner process each,
	// the default) or "in-process" (inside the server: lower latency, no
	// fault isolation, no cgroup limits). See docs/reliability.md. ""
	// (a config built in code) means process.
	Isolation string `yaml:"isolation"`
	// Simulated is how the model behaves on a simulated GPU (the server's
	// gpu.simulator): a preset curve with optional overrides. Only with
	// provider cuda; ignored on real GPUs.
	Simulated *SimulatedModel `yaml:"simulated,omitempty"`
}

// SimulatedModel picks and adjusts the simulator's curve for a model; a
// zero field keeps the preset's value (see simgpu.Model).
type SimulatedModel struct {
	Preset            string        `yaml:"preset"` // "" = resnet50
	Launch            time.Duration `yaml:"launch"`
	Fixed             time.Duration `yaml:"fixed"`
	PerItem           time.Duration `yaml:"per_item"`
	Warmup            time.Duration `yaml:"warmup"`
	Saturation        float64       `yaml:"saturation"`
	SaturationGrowth  float64       `yaml:"saturation_growth"`
	Bandwidth         float64       `yaml:"bandwidth"`
	Weights           ByteSize      `yaml:"weights"`
	ActivationPerItem ByteSize      `yaml:"activation_per_item"`
	Block             time.Duration `yaml:"block"`
}

// DefaultSimulatedPreset is the curve of a cuda model without
// execution.simulated.
const DefaultSimulatedPreset = "resnet50"

// Model is the simulator's curve for the model: the preset with the
// overrides. A nil SimulatedModel is the default preset.
func (s *SimulatedModel) Model() (simgpu.Model, error) {
	if s == nil {
		s = &SimulatedModel{}
	}
	name := s.Preset
	if name == "" {
		name = DefaultSimulatedPreset
	}
	m, ok := simgpu.Presets[name]
	if !ok {
		return simgpu.Model{}, fmt.Errorf("preset: must be one of %s, got %q", strings.Join(slices.Sorted(maps.Keys(simgpu.Presets)), ", "), s.Preset)
	}
	set := func(dst *time.Duration, v time.Duration) {
		if v != 0 {
			*dst = v
		}
	}
	setF := func(dst *float64, v float64) {
		if v != 0 {
			*dst = v
		}
	}
	set(&m.Launch, s.Launch)
	set(&m.Fixed, s.Fixed)
	set(&m.PerItem, s.PerItem)
	set(&m.Warmup, s.Warmup)
	set(&m.Block, s.Block)
	setF(&m.Saturation, s.Saturation)
	setF(&m.SaturationGrowth, s.SaturationGrowth)
	setF(&m.Bandwidth, s.Bandwidth)
	if s.Weights != 0 {
		m.Weights = int64(s.Weights)
	}
	if s.ActivationPerItem != 0 {
		m.ActivationPerItem = int64(s.ActivationPerItem)
	}
	if err := m.Check(); err != nil {
		return simgpu.Model{}, errors.New(strings.TrimPrefix(err.Error(), "simgpu: "))
	}
	return m, nil
}

// CUDA holds ONNX Runtime CUDA execution provider options.
type CUDA struct {
	GPUMemLimit         ByteSize `yaml:"gpu_mem_limit"` // 0: unlimited
	ArenaExtendStrategy string   `yaml:"arena_extend_strategy"`
	CuDNNConvAlgoSearch string   `yaml:"cudnn_conv_algo_search"`
}

// SLO is the model's latency objective. LatencyMS 0 means no target.
type SLO struct {
	LatencyMS float64 `yaml:"latency_ms"`
	Class     string  `yaml:"class"`
	Priority  int     `yaml:"priority"` // 0 default, 1 highest
}

// IsZero reports whether s is the default SLO (best-effort, no latency
// target, priority 0), which a config file expresses by leaving slo out;
// YAML output leaves it out too.
func (s SLO) IsZero() bool {
	return s.LatencyMS == 0 && (s.Class == "" || s.Class == ClassBestEffort) && s.Priority == 0
}

// Resources bounds the shares the adjuster may give the model.
type Resources struct {
	MemoryLimit     ByteSize `yaml:"memory_limit"` // 0: unlimited
	MinComputeShare float64  `yaml:"min_compute_share"`
	MaxComputeShare float64  `yaml:"max_compute_share"`
	// ComputeShare pins the model's compute share: the adjuster leaves it
	// there whatever the policy. 0 lets the policy decide.
	ComputeShare float64 `yaml:"compute_share"`
}

// ModelProfile configures the profiling sweep of a model.
type ModelProfile struct {
	// Shapes gives concrete shapes, batch dimension included (it is
	// replaced by each profiled batch size), for inputs with dynamic
	// dimensions: one set of input shapes, or a list of them to profile
	// each (the predictor's curve is then in input size). Without them a
	// model with dynamic dimensions is profiled at shapes chosen from its
	// declared dimensions (models.DefaultProfileDims).
	Shapes ProfileShapes `yaml:"shapes,omitempty"`
	// BatchSizes to profile; default 1, max_batch_size/2, max_batch_size.
	BatchSizes []int `yaml:"batch_sizes,omitempty"`
}

// IsZero reports whether nothing is set, so YAML output leaves it out.
func (p ModelProfile) IsZero() bool { return len(p.Shapes) == 0 && len(p.BatchSizes) == 0 }

// ProfileShapes are the input shapes a model is profiled at: each entry
// maps input names to a shape. In YAML it is one mapping (one set of
// shapes, `shapes: {x: [1, 3, 320, 320]}`) or a list of them
// (`shapes: [{x: [1, 3, 320, 320]}, {x: [1, 3, 640, 640]}]`).
type ProfileShapes []map[string][]int64

// UnmarshalYAML implements yaml.Unmarshaler: a mapping or a list of them.
// Dimensions must be integers (YAML would truncate 2.5 into an int64).
func (ps *ProfileShapes) UnmarshalYAML(n *yaml.Node) error {
	if bad := nonInteger(n); bad != nil {
		return fmt.Errorf("line %d: profile.shapes: dimensions must be integers, got %q", bad.Line, bad.Value)
	}
	switch n.Kind {
	case yaml.MappingNode:
		var one map[string][]int64
		if err := n.Decode(&one); err != nil {
			return err
		}
		*ps = ProfileShapes{one}
	case yaml.SequenceNode:
		var many []map[string][]int64
		if err := n.Decode(&many); err != nil {
			return err
		}
		*ps = many
	default:
		return fmt.Errorf("line %d: profile.shapes must be a mapping of input names to shapes, or a list of them", n.Line)
	}
	return nil
}

// nonInteger returns the first scalar in the shapes' sequences that is not
// an integer, or nil.
func nonInteger(n *yaml.Node) *yaml.Node {
	if n.Kind == yaml.SequenceNode {
		for _, c := range n.Content {
			if c.Kind == yaml.ScalarNode && c.Tag != "!!int" {
				return c
			}
		}
	}
	for i, c := range n.Content {
		if n.Kind == yaml.MappingNode && i%2 == 0 {
			continue // a key
		}
		if bad := nonInteger(c); bad != nil {
			return bad
		}
	}
	return nil
}

// MarshalYAML implements yaml.Marshaler: one set of shapes is written as
// a mapping, as it is usually read.
func (ps ProfileShapes) MarshalYAML() (any, error) {
	if len(ps) == 1 {
		return ps[0], nil
	}
	return []map[string][]int64(ps), nil
}

// LatencyTarget is the SLO latency, 0 when the model has none.
func (m *Model) LatencyTarget() time.Duration {
	return time.Duration(m.SLO.LatencyMS * float64(time.Millisecond))
}

func defaultModel() Model {
	return Model{
		Platform:  PlatformONNX,
		Instances: 1,
		Execution: Execution{
			Provider:          ProviderCPU,
			GraphOptimization: GraphOptAll,
			CUDA:              defaultCUDA(),
			Isolation:         IsolationProcess,
		},
		SLO:       SLO{Class: ClassBestEffort},
		Resources: Resources{MaxComputeShare: 1},
	}
}

func defaultCUDA() *CUDA {
	return &CUDA{ArenaExtendStrategy: ArenaNextPowerOfTwo, CuDNNConvAlgoSearch: ConvAlgoExhaustive}
}

// LoadModel reads dir/config.yaml (or config.yml), applies the defaults,
// decodes strictly and validates, including that the name is the folder's.
// A folder without either is read from a Triton config.pbtxt (see
// ParseTritonModel); when both kinds are there, config.yaml wins and the
// returned model carries a warning saying so. A folder with neither but
// with a version folder is read as an empty config.pbtxt, completed from
// the model file as Triton completes one.
func LoadModel(dir string) (*Model, error) {
	var file string
	var data []byte
	for _, name := range []string{ModelConfigFile, ModelConfigFileAlt} {
		f := filepath.Join(dir, name)
		b, err := ReadFile(f)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if file != "" {
			return nil, fmt.Errorf("%s: both %s and %s exist; keep one: %w", dir, ModelConfigFile, ModelConfigFileAlt, ErrInvalid)
		}
		file, data = f, b
	}
	pbtxt := filepath.Join(dir, ModelConfigPbtxt)
	if file == "" {
		b, err := ReadFile(pbtxt)
		if errors.Is(err, fs.ErrNotExist) {
			// No config at all: a Triton model folder whose config is
			// completed from its model file, as Triton does.
			if vs, verr := ListVersions(dir); verr == nil && len(vs) > 0 {
				return parseTritonModel(noConfigFile(dir), nil, dir)
			}
			return nil, fmt.Errorf("%s: no %s or %s: %w", dir, ModelConfigFile, ModelConfigPbtxt, fs.ErrNotExist)
		}
		if err != nil {
			return nil, err
		}
		return parseTritonModel(pbtxt, b, dir)
	}
	m, err := parseModel(file, data, dir)
	if err != nil {
		return nil, err
	}
	if _, err := os.Lstat(pbtxt); err == nil {
		m.Warnings = append(m.Warnings, fmt.Sprintf("%s: ignored: %s is read instead", pbtxt, filepath.Base(file)))
	}
	return m, nil
}

// ParseModel decodes and validates a model config; file is used only in
// error messages.
func ParseModel(file string, data []byte) (*Model, error) {
	return parseModel(file, data, "")
}

func parseModel(file string, data []byte, dir string) (*Model, error) {
	m := defaultModel()
	m.File, m.Dir = file, dir
	idx, decoded, ok := decodeStrict(data, &m)
	if !ok {
		return nil, finish(file, idx, decoded, nil).join()
	}

	// Defaults that depend on what the file gave.
	vp := &m.VersionPolicy
	if idx.value("version_policy.latest") != nil && vp.Latest == nil {
		vp.Latest = &LatestPolicy{}
	}
	if idx.value("version_policy.all") != nil && vp.All == nil {
		vp.All = &AllPolicy{}
	}
	if idx.value("version_policy.specific") != nil && vp.Specific == nil {
		vp.Specific = &SpecificPolicy{}
	}
	if vp.Latest == nil && vp.All == nil && vp.Specific == nil {
		vp.Latest = &LatestPolicy{NumVersions: 1}
	}
	ex := &m.Execution
	ex.DeviceGiven = ex.Provider == ProviderCUDA && idx.given("execution.device_id")
	switch {
	case ex.Provider == ProviderCUDA && ex.CUDA == nil:
		ex.CUDA = defaultCUDA()
	case ex.Provider != ProviderCUDA && !idx.given("execution.cuda"):
		ex.CUDA = nil
	}

	validated := m.validate()
	if idx.given("slo") && m.SLO.LatencyMS == 0 && !validated.has("slo.latency_ms") {
		if idx.value("slo.latency_ms") == nil {
			validated.add("slo.latency_ms", "required when slo is given")
		} else {
			validated.add("slo.latency_ms", "must be > 0, got 0")
		}
	}
	if errs := finish(file, idx, decoded, validated); len(errs) > 0 {
		return nil, errs.join()
	}
	if m.Platform == PlatformONNXRuntime {
		m.Platform = PlatformONNX
	}
	return &m, nil
}

// Validate checks values and cross-field rules. When Dir is set, the name
// must equal the folder's name.
func (m *Model) Validate() error {
	p := m.validate()
	for _, e := range p {
		e.File = m.File
	}
	return p.join()
}

var modelNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)

func (m *Model) validate() problems {
	var p problems
	switch {
	case m.Name == "":
		p.add("name", "required")
	case !modelNameRE.MatchString(m.Name):
		p.add("name", "must start with a letter or digit and hold only letters, digits, '.', '_' and '-'; got %q", m.Name)
	case m.Dir != "":
		if folder := folderName(m.Dir); m.Name != folder {
			p.add("name", "must equal the folder name %q, got %q", folder, m.Name)
		}
	}
	p.oneOf("platform", m.Platform, PlatformONNX, PlatformONNXRuntime)
	if d := m.DynamicBatching.MaxQueueDelay; d < 0 || d > time.Minute {
		p.add("dynamic_batching.max_queue_delay", "must be between 0 and 1m, got %v", d)
	}
	for i, b := range m.DynamicBatching.PreferredBatchSizes {
		if b < 1 || (m.MaxBatchSize > 0 && b > m.MaxBatchSize) {
			p.add(fmt.Sprintf("dynamic_batching.preferred_batch_sizes[%d]", i), "must be between 1 and max_batch_size (%d), got %d", m.MaxBatchSize, b)
		}
	}
	if len(m.DynamicBatching.PreferredBatchSizes) > 0 && m.MaxBatchSize == 0 {
		p.add("dynamic_batching.preferred_batch_sizes", "needs max_batch_size > 0")
	}
	switch lv := m.DynamicBatching.PriorityLevels; {
	case lv < 0:
		p.add("dynamic_batching.priority_levels", "must be >= 0, got %d", lv)
	case lv > 0 && m.SLO.Priority > lv:
		p.add("slo.priority", "must be at most dynamic_batching.priority_levels (%d), got %d", lv, m.SLO.Priority)
	}
	if d := m.DynamicBatching.DefaultTimeout; d < 0 || d > time.Hour {
		p.add("dynamic_batching.default_timeout", "must be between 0 and 1h, got %v", d)
	}
	if m.MaxQueueSize < 0 {
		p.add("max_queue_size", "must be >= 0, got %d", m.MaxQueueSize)
	}
	m.VersionPolicy.validate(&p)
	if m.MaxBatchSize < 0 {
		p.add("max_batch_size", "must be >= 0, got %d", m.MaxBatchSize)
	}
	validateTensors(&p, "inputs", m.Inputs, m.MaxBatchSize)
	validateTensors(&p, "outputs", m.Outputs, m.MaxBatchSize)
	if m.Instances < 1 || m.Instances > MaxInstances {
		p.add("instances", "must be between 1 and %d, got %d", MaxInstances, m.Instances)
	}
	m.Execution.validate(&p)
	m.SLO.validate(&p)
	m.Resources.validate(&p)
	if m.Execution.Isolation == IsolationInProcess && m.Resources.MemoryLimit > 0 {
		// Only a process of its own can be held to a memory limit.
		p.add("resources.memory_limit", "cannot be enforced with execution.isolation %s (the model shares the server's memory); remove it or use isolation %s", IsolationInProcess, IsolationProcess)
	}
	m.Profile.validate(&p, m)
	return p
}

func folderName(dir string) string {
	if abs, err := filepath.Abs(dir); err == nil {
		dir = abs
	}
	return filepath.Base(dir)
}

func (vp *VersionPolicy) validate(p *problems) {
	var set []string
	if vp.Latest != nil {
		set = append(set, "latest")
		if n := vp.Latest.NumVersions; n < 1 || n > MaxVersions {
			p.add("version_policy.latest.num_versions", "must be between 1 and %d, got %d", MaxVersions, n)
		}
	}
	if vp.All != nil {
		set = append(set, "all")
	}
	if vp.Specific != nil {
		set = append(set, "specific")
		vs := vp.Specific.Versions
		if len(vs) == 0 {
			p.add("version_policy.specific.versions", "must list at least one version")
		}
		if len(vs) > MaxVersions {
			p.add("version_policy.specific.versions", "may list at most %d versions, got %d", MaxVersions, len(vs))
		}
		seen := map[int64]bool{}
		for i, v := range vs {
			path := fmt.Sprintf("version_policy.specific.versions[%d]", i)
			switch {
			case v < 1:
				p.add(path, "must be >= 1, got %d", v)
			case seen[v]:
				p.add(path, "duplicate version %d", v)
			}
			seen[v] = true
		}
	}
	if len(set) > 1 {
		p.add("version_policy", "exactly one of latest, all, specific may be set; got %s", strings.Join(set, ", "))
	}
}

// dataTypeNames lists the OIP datatype names for messages.
var dataTypeNames = "BOOL, UINT8, UINT16, UINT32, UINT64, INT8, INT16, INT32, INT64, FP16, FP32, FP64, BF16, BYTES"

func validateTensors(p *problems, field string, ts []TensorConfig, maxBatch int) {
	names := map[string]int{}
	for i, t := range ts {
		path := fmt.Sprintf("%s[%d]", field, i)
		switch first, dup := names[t.Name]; {
		case t.Name == "":
			p.add(path+".name", "required")
		case dup:
			p.add(path+".name", "duplicate name %q (also %s[%d])", t.Name, field, first)
		default:
			names[t.Name] = i
		}
		if t.DataType == "" {
			p.add(path+".datatype", "required")
		} else if _, ok := runtime.ParseDataType(t.DataType); !ok {
			p.add(path+".datatype", "must be one of %s; got %q", dataTypeNames, t.DataType)
		}
		batched := maxBatch > 0
		if batched && len(t.Shape) == 0 {
			p.add(path+".shape", "must start with the batch dimension -1 when max_batch_size > 0")
		}
		for d, dim := range t.Shape {
			dp := fmt.Sprintf("%s.shape[%d]", path, d)
			switch {
			case batched && d == 0 && dim != -1:
				p.add(dp, "must be -1 (the batch dimension) when max_batch_size > 0, got %d", dim)
			case dim != -1 && dim < 1:
				p.add(dp, "must be -1 (dynamic) or >= 1, got %d", dim)
			}
		}
		if t.Reshape != nil {
			validateReshape(p, path, t, batched)
		}
	}
}

// validateReshape checks that a reshape keeps the elements: both shapes
// fixed but for the batch dimension, with the same element count.
func validateReshape(p *problems, path string, t TensorConfig, batched bool) {
	count := func(field string, shape []int64) (int64, bool) {
		n := int64(1)
		for d, dim := range shape {
			if batched && d == 0 {
				if dim != -1 {
					p.add(fmt.Sprintf("%s.%s[0]", path, field), "must be -1 (the batch dimension) when max_batch_size > 0, got %d", dim)
					return 0, false
				}
				continue
			}
			if dim < 1 || dim > 1<<31 {
				p.add(fmt.Sprintf("%s.%s[%d]", path, field, d), "must be fixed (>= 1) when the tensor is reshaped, got %d", dim)
				return 0, false
			}
			if n > math.MaxInt64/dim {
				p.add(path+"."+field, "has too many elements: %v", shape)
				return 0, false
			}
			n *= dim
		}
		if batched && len(shape) == 0 {
			p.add(path+"."+field, "must start with the batch dimension -1 when max_batch_size > 0")
			return 0, false
		}
		return n, true
	}
	from, ok1 := count("shape", t.Shape)
	to, ok2 := count("reshape", t.Reshape)
	if ok1 && ok2 && from != to {
		p.add(path+".reshape", "%v holds %d elements, shape %v holds %d; a reshape keeps them all", t.Reshape, to, t.Shape, from)
	}
}

func (e *Execution) validate(p *problems) {
	p.oneOf("execution.provider", e.Provider, ProviderCPU, ProviderCUDA)
	switch {
	case e.DeviceID < 0:
		p.add("execution.device_id", "must be >= 0, got %d", e.DeviceID)
	case e.DeviceID != 0 && e.Provider == ProviderCPU:
		p.add("execution.device_id", "only allowed with provider cuda, got %d with provider cpu", e.DeviceID)
	}
	if n := e.IntraOpThreads; n < 0 || n > MaxThreads() {
		p.add("execution.intra_op_threads", "must be between 0 and %d (4 × the CPUs, at least 16), got %d", MaxThreads(), n)
	}
	if n := e.InterOpThreads; n < 0 || n > MaxThreads() {
		p.add("execution.inter_op_threads", "must be between 0 and %d (4 × the CPUs, at least 16), got %d", MaxThreads(), n)
	}
	if e.Concurrency < 0 || e.Concurrency > MaxConcurrency {
		p.add("execution.concurrency", "must be between 0 and %d, got %d", MaxConcurrency, e.Concurrency)
	}
	p.oneOf("execution.graph_optimization", e.GraphOptimization, GraphOptDisable, GraphOptBasic, GraphOptExtended, GraphOptAll)
	if e.Isolation != "" { // "": built in code, the default
		p.oneOf("execution.isolation", e.Isolation, IsolationProcess, IsolationInProcess)
	}
	if c := e.CUDA; c != nil {
		if e.Provider == ProviderCPU {
			p.add("execution.cuda", "only allowed when execution.provider is cuda")
			return
		}
		if c.GPUMemLimit < 0 {
			p.add("execution.cuda.gpu_mem_limit", "must be >= 0, got %d", c.GPUMemLimit)
		}
		p.oneOf("execution.cuda.arena_extend_strategy", c.ArenaExtendStrategy, ArenaNextPowerOfTwo, ArenaSameAsRequested)
		p.oneOf("execution.cuda.cudnn_conv_algo_search", c.CuDNNConvAlgoSearch, ConvAlgoExhaustive, ConvAlgoHeuristic, ConvAlgoDefault)
	}
	if e.Simulated != nil {
		if e.Provider != ProviderCUDA {
			p.add("execution.simulated", "only allowed when execution.provider is cuda")
			return
		}
		if _, err := e.Simulated.Model(); err != nil {
			p.add("execution.simulated", "%s", err)
		}
	}
}

func (s *SLO) validate(p *problems) {
	switch l := s.LatencyMS; {
	case math.IsNaN(l) || math.IsInf(l, 0) || l < 0:
		p.add("slo.latency_ms", "must be > 0, got %v", l)
	case l > MaxLatencyMS:
		p.add("slo.latency_ms", "must be <= %d (one hour), got %v", MaxLatencyMS, l)
	case l == 0 && s.Class == ClassLatencyCritical:
		p.add("slo.latency_ms", "required for class %s (must be > 0)", ClassLatencyCritical)
	}
	p.oneOf("slo.class", s.Class, ClassLatencyCritical, ClassBestEffort)
	if s.Priority < 0 {
		p.add("slo.priority", "must be >= 0, got %d", s.Priority)
	}
}

func (r *Resources) validate(p *problems) {
	if r.MemoryLimit < 0 {
		p.add("resources.memory_limit", "must be >= 0, got %d", r.MemoryLimit)
	}
	minOK := r.MinComputeShare >= 0 && r.MinComputeShare <= 1 // false for NaN
	if !minOK {
		p.add("resources.min_compute_share", "must be between 0 and 1, got %v", r.MinComputeShare)
	}
	maxOK := r.MaxComputeShare > 0 && r.MaxComputeShare <= 1
	if !maxOK {
		p.add("resources.max_compute_share", "must be > 0 and <= 1, got %v", r.MaxComputeShare)
	}
	if minOK && maxOK && r.MinComputeShare > r.MaxComputeShare {
		p.add("resources.min_compute_share", "must be <= max_compute_share (%v), got %v", r.MaxComputeShare, r.MinComputeShare)
	}
	if !(r.ComputeShare >= 0 && r.ComputeShare <= 1) {
		p.add("resources.compute_share", "must be between 0 and 1, got %v", r.ComputeShare)
	}
}

func (mp *ModelProfile) validate(p *problems, m *Model) {
	for i, b := range mp.BatchSizes {
		if b < 1 || b > max(m.MaxBatchSize, 1) {
			p.add(fmt.Sprintf("profile.batch_sizes[%d]", i), "must be between 1 and max_batch_size (%d), got %d", max(m.MaxBatchSize, 1), b)
		}
	}
	for i, set := range mp.Shapes {
		prefix := "profile.shapes."
		if len(mp.Shapes) > 1 {
			prefix = fmt.Sprintf("profile.shapes[%d].", i)
		}
		if len(set) == 0 {
			p.add(strings.TrimSuffix(prefix, "."), "must name at least one input")
		}
		mp.validateSet(p, m, prefix, set)
	}
}

func (mp *ModelProfile) validateSet(p *problems, m *Model, prefix string, set map[string][]int64) {
	for _, name := range slices.Sorted(maps.Keys(set)) {
		path := prefix + name
		shape := set[name]
		if len(m.Inputs) > 0 && !slices.ContainsFunc(m.Inputs, func(t TensorConfig) bool { return t.Name == name }) {
			p.add(path, "no input named %q", name)
			continue
		}
		if len(shape) == 0 {
			p.add(path, "must not be empty")
		}
		for _, d := range shape {
			if d < 1 || d > 1<<20 {
				p.add(path, "dimensions must be between 1 and 1048576, got %v", shape)
				break
			}
		}
	}
}
