package configs

import (
	"fmt"
	"maps"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/prototext"

	"github.com/sloserve/sloserve/configs/tritonpb"
)

// Triton's model config (config.pbtxt, protobuf text of Triton's
// ModelConfig message, declared in configs/tritonpb/model_config.proto) is a
// second way to write a model's config. It maps onto Model as follows;
// docs/model-management.md has the table of every field.
//
//   - A field Model has an equivalent for is read into it.
//   - A field whose effect sloserve cannot honour is an error naming it
//     (a config that loads is served as written, or not at all).
//   - A field with no effect on what a client gets back (a label file, an
//     image format hint, pinned memory on a CPU server) is a warning.
//   - A field not declared in model_config.proto (sequence_batching,
//     batch_input, ...) fails the parse, named.
//   - An ensemble (platform "ensemble", ensemble_scheduling) is read by
//     mapTritonEnsemble (triton_ensemble.go).
//
// sloserve's own settings that Triton has no field for (SLO, class, share
// limits, threads) travel as parameters, keyed by their config.yaml path.

// Triton's platform and backend names for ONNX Runtime models.
const (
	TritonPlatformONNX = PlatformONNXRuntime
	TritonBackendONNX  = "onnxruntime"
)

// The parameters a config.pbtxt may carry, keyed by their config.yaml path,
// and the two ONNX Runtime backend parameters of Triton's that mean the same.
const (
	paramLatencyMS         = "slo.latency_ms"
	paramClass             = "slo.class"
	paramPriority          = "slo.priority"
	paramMinShare          = "resources.min_compute_share"
	paramMaxShare          = "resources.max_compute_share"
	paramComputeShare      = "resources.compute_share"
	paramMemoryLimit       = "resources.memory_limit"
	paramMaxQueueSize      = "max_queue_size"
	paramIntraOp           = "execution.intra_op_threads"
	paramInterOp           = "execution.inter_op_threads"
	paramConcurrency       = "execution.concurrency"
	paramAllowSpinning     = "execution.allow_spinning"
	paramGraphOptimization = "execution.graph_optimization"
	paramIsolation         = "execution.isolation"
	paramTritonIntraOp     = "intra_op_thread_count"
	paramTritonInterOp     = "inter_op_thread_count"
)

// ourParamPrefixes mark parameter keys in sloserve's own namespace: an
// unknown one is a typo, an error; other unknown keys are warnings.
var ourParamPrefixes = []string{"slo.", "resources.", "execution.", "profile.", "dynamic_batching."}

// ParseTritonModel decodes a Triton config.pbtxt and maps it onto a
// validated Model; file is used only in messages. Without a name in the
// file the model has no name, so use LoadModel for a folder.
func ParseTritonModel(file string, data []byte) (*Model, error) {
	return parseTritonModel(file, data, "")
}

var unknownPbtxtFieldRE = regexp.MustCompile(`\(line (\d+):\d+\): unknown field: (\S+)`)

// RenameTritonModel returns a Triton config.pbtxt with its model name set
// to name, for a model staged under a name of the server's choosing
// (--model-dir). Fields stay as they were; comments and layout do not.
func RenameTritonModel(file string, data []byte, name string) ([]byte, error) {
	var tc tritonpb.ModelConfig
	if err := prototext.Unmarshal(data, &tc); err != nil {
		return nil, &FieldError{File: file, Msg: "not a valid Triton model config: " + err.Error()}
	}
	tc.Name = name
	return prototext.MarshalOptions{Multiline: true}.Marshal(&tc)
}

func parseTritonModel(file string, data []byte, dir string) (*Model, error) {
	var tc tritonpb.ModelConfig
	if err := prototext.Unmarshal(data, &tc); err != nil {
		fe := &FieldError{File: file, Msg: "not a valid Triton model config: " + err.Error()}
		if m := unknownPbtxtFieldRE.FindStringSubmatch(err.Error()); m != nil {
			fe.Line, _ = strconv.Atoi(m[1])
			fe.Path, fe.Msg = m[2], "not supported by sloserve (or not a Triton model config field)"
		}
		return nil, fe
	}
	return mapTritonModel(&tc, file, dir)
}

// ParseTritonModelJSON decodes a Triton ModelConfig in JSON, as Triton's
// model-control clients send a config override with a load request (the
// "config" parameter), and maps it onto a validated Model of the model in
// dir. A config without a name takes the folder's; one naming another
// model is refused.
func ParseTritonModelJSON(file string, data []byte, dir string) (*Model, error) {
	var tc tritonpb.ModelConfig
	if err := protojson.Unmarshal(data, &tc); err != nil {
		return nil, &FieldError{File: file, Msg: "not a valid Triton model config in JSON: " + err.Error()}
	}
	if dir != "" && tc.GetName() != "" && tc.GetName() != folderName(dir) {
		return nil, &FieldError{File: file, Path: "name", Msg: fmt.Sprintf("names model %q, not %q", tc.GetName(), folderName(dir))}
	}
	return mapTritonModel(&tc, file, dir)
}

// mapTritonModel maps a decoded Triton config onto a validated Model.
func mapTritonModel(tc *tritonpb.ModelConfig, file, dir string) (*Model, error) {
	if isTritonEnsemble(tc) {
		return mapTritonEnsemble(tc, file, dir)
	}
	m := defaultModel()
	m.File, m.Dir = file, dir
	t := tritonReader{file: file}
	t.read(tc, &m)
	if dir != "" && len(t.errs) == 0 {
		t.completeFromModel(tc, &m, dir)
	}
	if m.Execution.Provider != ProviderCUDA {
		m.Execution.CUDA = nil // CUDA options come with a GPU instance group
	}
	if m.Name == "" && dir != "" {
		m.Name = folderName(dir) // Triton names a model after its folder
	}
	if len(t.errs) == 0 {
		for _, e := range m.validate() {
			e.Path = tritonPath(e.Path)
			t.errs = append(t.errs, e)
		}
	}
	if len(t.errs) > 0 {
		for _, e := range t.errs {
			e.File = file
		}
		return nil, t.errs.join()
	}
	if m.Platform == PlatformONNXRuntime {
		m.Platform = PlatformONNX
	}
	m.Warnings = t.warnings
	return &m, nil
}

// tritonReader maps one ModelConfig onto a Model, collecting errors and
// warnings.
type tritonReader struct {
	file     string
	errs     problems
	warnings []string
}

func (t *tritonReader) fail(path, format string, args ...any) { t.errs.add(path, format, args...) }

// readWarmup reads model_warmup: each sample's input shapes are a set of
// profile shapes (profile.shapes), the batch dimension put in front when
// the model batches (profiling replaces it by each batch size). sloserve
// profiles and warms up with zeros, so the samples' data, batch size and
// count do not matter; a data file is a warning. Shapes are validated as
// profile.shapes are.
func (t *tritonReader) readWarmup(ws []*tritonpb.ModelWarmup, m *Model) {
	for i, w := range ws {
		path := fmt.Sprintf("model_warmup[%d]", i)
		if len(w.GetInputs()) == 0 {
			t.fail(path+".inputs", "must name at least one input")
			continue
		}
		set := map[string][]int64{}
		for name, in := range w.GetInputs() {
			shape := slices.Clone(in.GetDims())
			if m.MaxBatchSize > 0 {
				shape = append([]int64{1}, shape...)
			}
			set[name] = shape
			if in.GetInputDataFile() != "" {
				t.warn(path+".inputs."+name+".input_data_file", "ignored: the model is warmed up and profiled with zeros at this shape")
			}
		}
		m.Profile.Shapes = append(m.Profile.Shapes, set)
	}
}

func (t *tritonReader) warn(path, format string, args ...any) {
	t.warnings = append(t.warnings, fmt.Sprintf("%s: %s: ", t.file, path)+fmt.Sprintf(format, args...))
}

func (t *tritonReader) read(tc *tritonpb.ModelConfig, m *Model) {
	m.Name = tc.GetName()
	switch p, b := tc.GetPlatform(), tc.GetBackend(); {
	case p != "" && p != TritonPlatformONNX:
		t.fail("platform", "sloserve serves only %q models, got %q", TritonPlatformONNX, p)
	case b != "" && b != TritonBackendONNX:
		t.fail("backend", "sloserve serves only the %q backend, got %q", TritonBackendONNX, b)
	}
	if r := tc.GetRuntime(); r != "" {
		t.fail("runtime", "a backend library cannot be chosen, got %q", r)
	}
	t.readVersionPolicy(tc.GetVersionPolicy(), m)
	if mb := tc.GetMaxBatchSize(); mb < 0 {
		t.fail("max_batch_size", "must be >= 0, got %d", mb)
	} else {
		m.MaxBatchSize = int(mb)
	}
	for i, in := range tc.GetInput() {
		path := fmt.Sprintf("input[%d]", i)
		m.Inputs = append(m.Inputs, t.tensor(path, in.GetName(), in.GetDataType(), in.GetDims(), m.MaxBatchSize))
		if in.GetFormat() != tritonpb.ModelInput_FORMAT_NONE {
			t.warn(path+".format", "ignored: %s is a hint for clients; the tensor is passed as it comes", in.GetFormat())
		}
		if r := in.GetReshape(); r != nil {
			m.Inputs[i].Reshape = reshapeOf(r, m.MaxBatchSize)
		}
		if in.GetIsShapeTensor() {
			t.fail(path+".is_shape_tensor", "not supported (shape tensors are a TensorRT feature)")
		}
		if in.GetAllowRaggedBatch() {
			t.fail(path+".allow_ragged_batch", "not supported: requests are batched only with equal shapes")
		}
		if in.GetOptional() {
			t.fail(path+".optional", "not supported: every input is required")
		}
	}
	for i, out := range tc.GetOutput() {
		path := fmt.Sprintf("output[%d]", i)
		m.Outputs = append(m.Outputs, t.tensor(path, out.GetName(), out.GetDataType(), out.GetDims(), m.MaxBatchSize))
		if out.GetLabelFilename() != "" {
			t.warn(path+".label_filename", "ignored: sloserve has no classification extension")
		}
		if r := out.GetReshape(); r != nil {
			m.Outputs[i].Reshape = reshapeOf(r, m.MaxBatchSize)
		}
		if out.GetIsShapeTensor() {
			t.fail(path+".is_shape_tensor", "not supported (shape tensors are a TensorRT feature)")
		}
	}
	t.readInstanceGroups(tc.GetInstanceGroup(), m)
	params := t.readParameters(tc.GetParameters(), m)
	t.readDynamicBatching(tc, m, params)
	t.readWarmup(tc.GetModelWarmup(), m)
	t.readOptimization(tc.GetOptimization(), m, params)

	if f := tc.GetDefaultModelFilename(); f != "" && f != ModelFile {
		t.fail("default_model_filename", "must be %q (the file a version folder holds), got %q", ModelFile, f)
	}
	if len(tc.GetCcModelFilenames()) > 0 {
		t.fail("cc_model_filenames", "not supported: every version folder holds %s", ModelFile)
	}
	if len(tc.GetMetricTags()) > 0 {
		t.warn("metric_tags", "ignored: metrics are labelled by model and version only")
	}
	if len(tc.GetModelOperations().GetOpLibraryFilename()) > 0 {
		t.fail("model_operations.op_library_filename", "not supported: custom operator libraries are not loaded")
	}
	if tc.GetModelTransactionPolicy().GetDecoupled() {
		t.fail("model_transaction_policy.decoupled", "not supported: a request gets exactly one response")
	}
	if tc.GetResponseCache().GetEnable() {
		t.warn("response_cache.enable", "ignored: sloserve has no response cache; every request is executed")
	}
}

// reshapeOf is a Triton reshape in sloserve's terms: the batch dimension
// -1 in front when the model batches; never nil.
func reshapeOf(r *tritonpb.ModelTensorReshape, maxBatch int) []int64 {
	if maxBatch > 0 {
		return append([]int64{-1}, r.GetShape()...)
	}
	return append([]int64{}, r.GetShape()...)
}

func (t *tritonReader) readVersionPolicy(vp *tritonpb.ModelVersionPolicy, m *Model) {
	switch c := vp.GetPolicyChoice().(type) {
	case *tritonpb.ModelVersionPolicy_Latest_:
		m.VersionPolicy.Latest = &LatestPolicy{NumVersions: int(min(c.Latest.GetNumVersions(), math.MaxInt32))}
		if m.VersionPolicy.Latest.NumVersions == 0 {
			m.VersionPolicy.Latest.NumVersions = 1 // Triton's default
		}
	case *tritonpb.ModelVersionPolicy_All_:
		m.VersionPolicy.All = &AllPolicy{}
	case *tritonpb.ModelVersionPolicy_Specific_:
		m.VersionPolicy.Specific = &SpecificPolicy{Versions: slices.Clone(c.Specific.GetVersions())}
	default:
		m.VersionPolicy.Latest = &LatestPolicy{NumVersions: 1}
	}
}

// tensor maps an input or output. Triton's dims leave out the batch
// dimension of a batching model; sloserve's shape starts with it.
func (t *tritonReader) tensor(path, name string, dt tritonpb.DataType, dims []int64, maxBatch int) TensorConfig {
	tc := TensorConfig{Name: name}
	switch dt {
	case tritonpb.DataType_TYPE_INVALID:
		t.fail(path+".data_type", "required")
	case tritonpb.DataType_TYPE_STRING:
		tc.DataType = "BYTES"
	default:
		tc.DataType = strings.TrimPrefix(dt.String(), "TYPE_")
	}
	if maxBatch > 0 {
		tc.Shape = append([]int64{-1}, dims...)
	} else {
		tc.Shape = slices.Clone(dims)
	}
	return tc
}

func (t *tritonReader) readInstanceGroups(groups []*tritonpb.ModelInstanceGroup, m *Model) {
	if len(groups) == 0 {
		// Triton's default: one instance where the server has room, a GPU
		// when there is one.
		m.Execution.Auto = true
		return
	}
	total := 0
	explicit := tritonpb.ModelInstanceGroup_KIND_AUTO // the first CPU or GPU group's kind
	gpu := int32(-1)
	for i, g := range groups {
		path := fmt.Sprintf("instance_group[%d]", i)
		n := int(g.GetCount())
		if n == 0 {
			n = 1 // Triton's default
		}
		if n < 0 {
			t.fail(path+".count", "must be >= 1, got %d", n)
			continue
		}
		switch k := g.GetKind(); k {
		case tritonpb.ModelInstanceGroup_KIND_AUTO:
		case tritonpb.ModelInstanceGroup_KIND_CPU, tritonpb.ModelInstanceGroup_KIND_GPU:
			if explicit != tritonpb.ModelInstanceGroup_KIND_AUTO && k != explicit {
				t.fail(path+".kind", "all instance groups must run on the same kind of device, got %s and %s", explicit, k)
			}
			explicit = k
		default:
			t.fail(path+".kind", "must be KIND_CPU, KIND_GPU or KIND_AUTO, got %s", k)
		}
		switch gpus := g.GetGpus(); {
		case g.GetKind() == tritonpb.ModelInstanceGroup_KIND_CPU && len(gpus) > 0:
			t.fail(path+".gpus", "not allowed with KIND_CPU")
		case g.GetKind() == tritonpb.ModelInstanceGroup_KIND_AUTO && len(gpus) > 0:
			t.fail(path+".gpus", "not allowed with KIND_AUTO (the server picks the device); give kind KIND_GPU to name a GPU")
		case len(gpus) > 1:
			t.fail(path+".gpus", "a model runs on one GPU, got %v", gpus)
		case len(gpus) == 1:
			if gpu >= 0 && gpus[0] != gpu {
				t.fail(path+".gpus", "a model runs on one GPU, got %d and %d", gpu, gpus[0])
			}
			gpu = gpus[0]
		}
		if g.GetName() != "" {
			t.warn(path+".name", "ignored: instances are named by model, version and index")
		}
		if len(g.GetProfile()) > 0 {
			t.fail(path+".profile", "not supported (optimization profiles are a TensorRT feature)")
		}
		if g.GetPassive() {
			t.fail(path+".passive", "not supported: every instance serves")
		}
		if g.GetHostPolicy() != "" {
			t.warn(path+".host_policy", "ignored: sloserve places instances through its limiters")
		}
		total += n
	}
	m.Instances = total
	switch explicit {
	case tritonpb.ModelInstanceGroup_KIND_GPU:
		m.Execution.Provider = ProviderCUDA
		m.Execution.CUDA = defaultCUDA()
		m.Execution.DeviceID = int(max(gpu, 0))
		m.Execution.DeviceGiven = gpu >= 0
	case tritonpb.ModelInstanceGroup_KIND_AUTO: // every group KIND_AUTO
		m.Execution.Auto = true
	}
}

// OnDevice resolves a device the config leaves to the server
// (Execution.Auto: Triton's KIND_AUTO, or a config.pbtxt without
// instance_group): a copy on the GPU (provider cuda, placed by the
// server) when the server has one, else m itself, on the CPU.
func (m *Model) OnDevice(serverHasGPU bool) *Model {
	if !m.Execution.Auto || !serverHasGPU || m.Execution.Provider == ProviderCUDA {
		return m
	}
	c := *m
	c.Execution.Provider = ProviderCUDA
	c.Execution.CUDA = defaultCUDA()
	return &c
}

// readParameters reads sloserve's settings from parameters and returns
// the keys it read, for the cross-checks of the other fields.
func (t *tritonReader) readParameters(params map[string]*tritonpb.ModelParameter, m *Model) map[string]bool {
	seen := map[string]bool{}
	for _, key := range slices.Sorted(maps.Keys(params)) {
		v := strings.TrimSpace(params[key].GetStringValue())
		path := fmt.Sprintf("parameters[%q]", key)
		seen[key] = true
		num := func(dst *float64) {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
				t.fail(path, "must be a number, got %q", v)
				return
			}
			*dst = f
		}
		integer := func(dst *int) {
			n, err := strconv.Atoi(v)
			if err != nil {
				t.fail(path, "must be an integer, got %q", v)
				return
			}
			*dst = n
		}
		switch key {
		case paramLatencyMS:
			num(&m.SLO.LatencyMS)
		case paramClass:
			m.SLO.Class = v
		case paramPriority:
			integer(&m.SLO.Priority)
		case paramMinShare:
			num(&m.Resources.MinComputeShare)
		case paramMaxShare:
			num(&m.Resources.MaxComputeShare)
		case paramComputeShare:
			num(&m.Resources.ComputeShare)
		case paramMemoryLimit:
			b, err := ParseByteSize(v)
			if err != nil {
				t.fail(path, "must be a byte size such as 512MiB, got %q", v)
			}
			m.Resources.MemoryLimit = b
		case paramMaxQueueSize:
			integer(&m.MaxQueueSize)
		case paramIntraOp, paramTritonIntraOp:
			integer(&m.Execution.IntraOpThreads)
		case paramInterOp, paramTritonInterOp:
			integer(&m.Execution.InterOpThreads)
		case paramConcurrency:
			integer(&m.Execution.Concurrency)
		case paramAllowSpinning:
			b, err := strconv.ParseBool(v)
			if err != nil {
				t.fail(path, "must be true or false, got %q", v)
			}
			m.Execution.AllowSpinning = b
		case paramGraphOptimization:
			m.Execution.GraphOptimization = v
		case paramIsolation:
			m.Execution.Isolation = v
		default:
			if slices.ContainsFunc(ourParamPrefixes, func(p string) bool { return strings.HasPrefix(key, p) }) {
				t.fail(path, "unknown sloserve parameter")
			} else {
				t.warn(path, "ignored: not a parameter sloserve reads")
			}
		}
	}
	if (seen[paramIntraOp] && seen[paramTritonIntraOp]) || (seen[paramInterOp] && seen[paramTritonInterOp]) {
		t.fail("parameters", "give the thread counts once, as %s/%s or as %s/%s", paramIntraOp, paramInterOp, paramTritonIntraOp, paramTritonInterOp)
	}
	if m.SLO.LatencyMS > 0 && !seen[paramClass] {
		// A latency target makes a model latency-critical unless the
		// parameters say otherwise: the point of giving one.
		m.SLO.Class = ClassLatencyCritical
	}
	return seen
}

func (t *tritonReader) readDynamicBatching(tc *tritonpb.ModelConfig, m *Model, params map[string]bool) {
	db := tc.GetDynamicBatching()
	if db == nil {
		if m.MaxBatchSize > 0 {
			t.warn("dynamic_batching", "not given, but sloserve merges queued requests of a model with max_batch_size > 0 anyway")
		}
		return
	}
	for _, b := range db.GetPreferredBatchSize() {
		m.DynamicBatching.PreferredBatchSizes = append(m.DynamicBatching.PreferredBatchSizes, int(b))
	}
	m.DynamicBatching.MaxQueueDelay = time.Duration(min(db.GetMaxQueueDelayMicroseconds(), uint64(time.Hour/time.Microsecond))) * time.Microsecond
	if db.GetPreserveOrdering() {
		t.warn("dynamic_batching.preserve_ordering", "ignored: every response goes to its own request (on a stream, in the order they finish)")
	}
	levels := db.GetPriorityLevels()
	if levels > math.MaxInt32 {
		t.fail("dynamic_batching.priority_levels", "must be at most %d, got %d", math.MaxInt32, levels)
		return
	}
	m.DynamicBatching.PriorityLevels = int(levels)
	if d := db.GetDefaultPriorityLevel(); d != 0 {
		switch {
		case levels == 0:
			t.fail("dynamic_batching.default_priority_level", "needs priority_levels")
		case d > levels:
			t.fail("dynamic_batching.default_priority_level", "must be between 1 and priority_levels (%d), got %d", levels, d)
		case params[paramPriority] && m.SLO.Priority != int(d):
			t.fail("dynamic_batching.default_priority_level", "is %d but parameter %s is %d; give one", d, paramPriority, m.SLO.Priority)
		default:
			m.SLO.Priority = int(d)
		}
	}
	if len(db.GetPriorityQueuePolicy()) > 0 {
		t.fail("dynamic_batching.priority_queue_policy", "not supported: one queue policy (default_queue_policy) applies to all levels")
	}
	if qp := db.GetDefaultQueuePolicy(); qp != nil {
		if qp.GetTimeoutAction() == tritonpb.ModelQueuePolicy_DELAY {
			t.fail("dynamic_batching.default_queue_policy.timeout_action", "DELAY is not supported: a request whose time is up is dropped (REJECT)")
		}
		if us := qp.GetDefaultTimeoutMicroseconds(); us > 0 {
			if us > uint64(time.Hour/time.Microsecond) {
				t.fail("dynamic_batching.default_queue_policy.default_timeout_microseconds", "must be at most %d (one hour), got %d", uint64(time.Hour/time.Microsecond), us)
			} else {
				m.DynamicBatching.DefaultTimeout = time.Duration(us) * time.Microsecond
			}
			if !qp.GetAllowTimeoutOverride() {
				t.warn("dynamic_batching.default_queue_policy.allow_timeout_override", "is false, but a request may always shorten its own timeout in sloserve")
			}
		}
		if n := qp.GetMaxQueueSize(); n > 0 {
			if params[paramMaxQueueSize] && uint64(m.MaxQueueSize) != uint64(n) {
				t.fail("dynamic_batching.default_queue_policy.max_queue_size", "is %d but parameter %s is %d; give one", n, paramMaxQueueSize, m.MaxQueueSize)
			}
			m.MaxQueueSize = int(min(n, math.MaxInt32))
		}
	}
}

func (t *tritonReader) readOptimization(o *tritonpb.ModelOptimizationPolicy, m *Model, params map[string]bool) {
	if o == nil {
		return
	}
	if g := o.GetGraph(); g != nil {
		if params[paramGraphOptimization] {
			t.fail("optimization.graph.level", "give the graph optimization once, here or as parameter %s", paramGraphOptimization)
		}
		switch l := g.GetLevel(); {
		case l < 0:
			m.Execution.GraphOptimization = GraphOptBasic
		case l == 1:
			m.Execution.GraphOptimization = GraphOptExtended
		default:
			m.Execution.GraphOptimization = GraphOptAll
		}
	}
	if o.GetPriority() != tritonpb.ModelOptimizationPolicy_PRIORITY_DEFAULT {
		t.warn("optimization.priority", "ignored (a TensorRT setting in Triton); sloserve ranks models by slo.priority")
	}
	if ea := o.GetExecutionAccelerators(); len(ea.GetGpuExecutionAccelerator())+len(ea.GetCpuExecutionAccelerator()) > 0 {
		t.fail("optimization.execution_accelerators", "not supported: models run on the ONNX Runtime CPU or CUDA provider")
	}
	if o.GetInputPinnedMemory() != nil || o.GetOutputPinnedMemory() != nil {
		t.warn("optimization.input_pinned_memory", "ignored: tensors are not staged through pinned memory")
	}
}

// tritonPaths translate the config.yaml paths of validation messages into
// the config.pbtxt fields they came from.
var tritonPaths = []struct{ yaml, pbtxt string }{
	{"inputs", "input"},
	{"outputs", "output"},
	{"instances", "instance_group.count"},
	{"dynamic_batching.preferred_batch_sizes", "dynamic_batching.preferred_batch_size"},
	{"dynamic_batching.max_queue_delay", "dynamic_batching.max_queue_delay_microseconds"},
	{"dynamic_batching.default_timeout", "dynamic_batching.default_queue_policy.default_timeout_microseconds"},
	{"max_queue_size", "dynamic_batching.default_queue_policy.max_queue_size"},
	{"version_policy.latest.num_versions", "version_policy.latest.num_versions"},
	{"execution.provider", "instance_group.kind"},
	{"execution.device_id", "instance_group.gpus"},
}

func tritonPath(p string) string {
	// Profile shapes come from model_warmup: profile.shapes.x (one
	// sample) or profile.shapes[i].x.
	if rest, ok := strings.CutPrefix(p, "profile.shapes"); ok {
		i, name := "0", strings.TrimPrefix(rest, ".")
		if strings.HasPrefix(rest, "[") {
			i, name, _ = strings.Cut(rest[1:], "].")
		}
		return "model_warmup[" + i + "].inputs." + name
	}
	for _, tp := range tritonPaths {
		if p == tp.yaml || strings.HasPrefix(p, tp.yaml+".") || strings.HasPrefix(p, tp.yaml+"[") {
			return tp.pbtxt + strings.TrimPrefix(p, tp.yaml)
		}
	}
	for _, prefix := range ourParamPrefixes {
		if strings.HasPrefix(p, prefix) {
			return fmt.Sprintf("parameters[%q]", p)
		}
	}
	return p
}

// TritonConfig is m in Triton's ModelConfig shape, as the ModelConfig
// endpoints answer it: what parseTritonModel maps back to an equal Model.
// m's inputs and outputs should be complete (the loaded model's, when the
// config leaves them out).
func TritonConfig(m *Model) *tritonpb.ModelConfig {
	if m.Ensemble != nil {
		return tritonEnsembleConfig(m)
	}
	tc := &tritonpb.ModelConfig{
		Name:         m.Name,
		Platform:     TritonPlatformONNX,
		Backend:      TritonBackendONNX,
		MaxBatchSize: int32(min(m.MaxBatchSize, math.MaxInt32)),
		Parameters:   map[string]*tritonpb.ModelParameter{},
	}
	tc.VersionPolicy = tritonVersionPolicy(m.VersionPolicy)
	reshape := func(t TensorConfig) *tritonpb.ModelTensorReshape {
		if t.Reshape == nil {
			return nil
		}
		return &tritonpb.ModelTensorReshape{Shape: tritonDims(t.Reshape, m.MaxBatchSize)}
	}
	for _, in := range m.Inputs {
		tc.Input = append(tc.Input, &tritonpb.ModelInput{Name: in.Name, DataType: tritonDataType(in.DataType), Dims: tritonDims(in.Shape, m.MaxBatchSize), Reshape: reshape(in)})
	}
	for _, out := range m.Outputs {
		tc.Output = append(tc.Output, &tritonpb.ModelOutput{Name: out.Name, DataType: tritonDataType(out.DataType), Dims: tritonDims(out.Shape, m.MaxBatchSize), Reshape: reshape(out)})
	}
	g := &tritonpb.ModelInstanceGroup{Name: m.Name, Count: int32(m.Instances), Kind: tritonpb.ModelInstanceGroup_KIND_CPU}
	if m.Execution.Provider == ProviderCUDA {
		g.Kind = tritonpb.ModelInstanceGroup_KIND_GPU
		if m.Execution.DeviceGiven || m.Execution.DeviceID != 0 {
			// A model placed by the server names no GPU.
			g.Gpus = []int32{int32(m.Execution.DeviceID)}
		}
	}
	tc.InstanceGroup = []*tritonpb.ModelInstanceGroup{g}
	if m.MaxBatchSize > 0 || m.DynamicBatching.PriorityLevels > 0 || m.DynamicBatching.DefaultTimeout > 0 || m.MaxQueueSize > 0 {
		db := &tritonpb.ModelDynamicBatching{
			MaxQueueDelayMicroseconds: uint64(m.DynamicBatching.MaxQueueDelay / time.Microsecond),
			PriorityLevels:            uint64(m.DynamicBatching.PriorityLevels),
		}
		for _, b := range m.DynamicBatching.PreferredBatchSizes {
			db.PreferredBatchSize = append(db.PreferredBatchSize, int32(b))
		}
		if m.DynamicBatching.PriorityLevels > 0 {
			db.DefaultPriorityLevel = uint64(m.SLO.Priority)
		}
		if m.MaxQueueSize > 0 || m.DynamicBatching.DefaultTimeout > 0 {
			db.DefaultQueuePolicy = &tritonpb.ModelQueuePolicy{
				MaxQueueSize:               uint32(m.MaxQueueSize),
				DefaultTimeoutMicroseconds: uint64(m.DynamicBatching.DefaultTimeout / time.Microsecond),
				AllowTimeoutOverride:       m.DynamicBatching.DefaultTimeout > 0,
			}
		}
		tc.SchedulingChoice = &tritonpb.ModelConfig_DynamicBatching{DynamicBatching: db}
	}
	switch m.Execution.GraphOptimization {
	case GraphOptBasic:
		tc.Optimization = &tritonpb.ModelOptimizationPolicy{Graph: &tritonpb.ModelOptimizationPolicy_Graph{Level: -1}}
	case GraphOptExtended:
		tc.Optimization = &tritonpb.ModelOptimizationPolicy{Graph: &tritonpb.ModelOptimizationPolicy_Graph{Level: 1}}
	case GraphOptDisable:
		tc.Parameters[paramGraphOptimization] = tritonParam(GraphOptDisable)
	}

	// sloserve's own settings, given when not the default (class and
	// latency always: they say how the model is scheduled).
	tc.Parameters[paramClass] = tritonParam(m.SLO.Class)
	tc.Parameters[paramLatencyMS] = tritonParam(strconv.FormatFloat(m.SLO.LatencyMS, 'g', -1, 64))
	if m.SLO.Priority != 0 && m.DynamicBatching.PriorityLevels == 0 {
		tc.Parameters[paramPriority] = tritonParam(strconv.Itoa(m.SLO.Priority))
	}
	r := m.Resources
	if r.MinComputeShare != 0 {
		tc.Parameters[paramMinShare] = tritonParam(strconv.FormatFloat(r.MinComputeShare, 'g', -1, 64))
	}
	if r.MaxComputeShare != 1 {
		tc.Parameters[paramMaxShare] = tritonParam(strconv.FormatFloat(r.MaxComputeShare, 'g', -1, 64))
	}
	if r.ComputeShare != 0 {
		tc.Parameters[paramComputeShare] = tritonParam(strconv.FormatFloat(r.ComputeShare, 'g', -1, 64))
	}
	if r.MemoryLimit != 0 {
		tc.Parameters[paramMemoryLimit] = tritonParam(strconv.FormatInt(int64(r.MemoryLimit), 10))
	}
	ex := m.Execution
	if ex.IntraOpThreads != 0 {
		tc.Parameters[paramIntraOp] = tritonParam(strconv.Itoa(ex.IntraOpThreads))
	}
	if ex.InterOpThreads != 0 {
		tc.Parameters[paramInterOp] = tritonParam(strconv.Itoa(ex.InterOpThreads))
	}
	if ex.Concurrency != 0 {
		tc.Parameters[paramConcurrency] = tritonParam(strconv.Itoa(ex.Concurrency))
	}
	if ex.AllowSpinning {
		tc.Parameters[paramAllowSpinning] = tritonParam("true")
	}
	if ex.Isolation == IsolationInProcess {
		tc.Parameters[paramIsolation] = tritonParam(ex.Isolation)
	}
	for i, set := range m.Profile.Shapes {
		w := &tritonpb.ModelWarmup{Name: fmt.Sprintf("profile_%d", i), BatchSize: 1, Count: 1, Inputs: map[string]*tritonpb.ModelWarmup_Input{}}
		for name, shape := range set {
			dt := tritonpb.DataType_TYPE_INVALID
			if j := slices.IndexFunc(m.Inputs, func(t TensorConfig) bool { return t.Name == name }); j >= 0 {
				dt = tritonDataType(m.Inputs[j].DataType)
			}
			w.Inputs[name] = &tritonpb.ModelWarmup_Input{DataType: dt, Dims: tritonDims(shape, m.MaxBatchSize),
				InputDataType: &tritonpb.ModelWarmup_Input_ZeroData{ZeroData: true}}
		}
		tc.ModelWarmup = append(tc.ModelWarmup, w)
	}
	return tc
}

// tritonVersionPolicy is a version policy in Triton's shape.
func tritonVersionPolicy(p VersionPolicy) *tritonpb.ModelVersionPolicy {
	vp := &tritonpb.ModelVersionPolicy{}
	switch {
	case p.All != nil:
		vp.PolicyChoice = &tritonpb.ModelVersionPolicy_All_{All: &tritonpb.ModelVersionPolicy_All{}}
	case p.Specific != nil:
		vp.PolicyChoice = &tritonpb.ModelVersionPolicy_Specific_{Specific: &tritonpb.ModelVersionPolicy_Specific{Versions: slices.Clone(p.Specific.Versions)}}
	default:
		n := 1
		if p.Latest != nil {
			n = p.Latest.NumVersions
		}
		vp.PolicyChoice = &tritonpb.ModelVersionPolicy_Latest_{Latest: &tritonpb.ModelVersionPolicy_Latest{NumVersions: uint32(max(n, 0))}}
	}
	return vp
}

func tritonParam(v string) *tritonpb.ModelParameter {
	return &tritonpb.ModelParameter{StringValue: v}
}

// tritonDataType is the Triton data type of an Open Inference Protocol
// datatype name.
func tritonDataType(dt string) tritonpb.DataType {
	if dt == "BYTES" {
		return tritonpb.DataType_TYPE_STRING
	}
	return tritonpb.DataType(tritonpb.DataType_value["TYPE_"+dt])
}

// tritonDims leaves the batch dimension out of a batching model's shape.
func tritonDims(shape []int64, maxBatch int) []int64 {
	if maxBatch > 0 && len(shape) > 0 {
		return slices.Clone(shape[1:])
	}
	return slices.Clone(shape)
}
