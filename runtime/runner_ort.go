package runtime

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"
	"unsafe"

	ort "github.com/yalue/onnxruntime_go"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// This file and inprocess.go are the only ones that talk to ONNX Runtime.
// The session code runs in the runner process, or in the server for an
// InProcess instance.

// ortSessionConfig is what a runner needs to open its session.
type ortSessionConfig struct {
	ModelPath string
	Library   string
	Provider  ProviderOptions
}

// ortSession is one ONNX Runtime session over all of a model's inputs and
// outputs. Run is safe for concurrent use, as ORT sessions are.
type ortSession struct {
	session *ort.DynamicAdvancedSession
	io      *modelIO
	// preallocate marks the outputs the runner must allocate itself; the
	// rest ONNX Runtime allocates. See outputPlan.
	preallocate []bool
}

// ortElementTypes maps ONNX Runtime element types to runtime.DataType,
// from the datatype table (ONNX Runtime numbers its element types as ONNX
// does).
var ortElementTypes = func() map[ort.TensorElementDataType]DataType {
	m := make(map[ort.TensorElementDataType]DataType, len(dataTypes))
	for _, t := range dataTypes {
		m[ort.TensorElementDataType(t.ONNX)] = t.Name
	}
	return m
}()

// dataTypeToORT is the inverse of ortElementTypes.
var dataTypeToORT = func() map[DataType]ort.TensorElementDataType {
	m := make(map[DataType]ort.TensorElementDataType, len(ortElementTypes))
	for o, d := range ortElementTypes {
		m[d] = o
	}
	return m
}()

// TelemetryEnv is the variable with which ONNX Runtime's builds that
// carry telemetry (the npm package's among them) skip it: "1" or "yes"
// turn it off, "0" leaves it on. Left on, every process that loads the
// library writes a SQLite database under $XDG_CACHE_HOME (or
// $HOME/.cache), mat-debug and .ses files into TMPDIR, and tries to send
// what it gathered (the model's name, producer and hashes among it) to
// Microsoft's collector. ONNX Runtime turns it off by itself where a CI
// system's variable is set (CI, GITHUB_ACTIONS and others), nowhere else.
const TelemetryEnv = "ORT_DISABLE_TELEMETRY"

// initORT loads the shared library and creates the ORT environment, with
// ONNX Runtime's telemetry off unless the environment names TelemetryEnv
// itself (an operator may turn it on). Call destroyORT when done.
func initORT(library string) error {
	if binary.NativeEndian.Uint16([]byte{1, 0}) != 1 {
		return errors.New("runner needs a little-endian machine: tensors are passed as raw bytes")
	}
	if _, set := os.LookupEnv(TelemetryEnv); !set {
		// Before the library loads: a cgo program's os.Setenv is the C
		// library's too, where ONNX Runtime reads it.
		if err := os.Setenv(TelemetryEnv, "1"); err != nil {
			return fmt.Errorf("turn ONNX Runtime's telemetry off: %w", err)
		}
	}
	ort.SetSharedLibraryPath(library)
	if err := ort.InitializeEnvironment(ort.WithLogLevelWarning()); err != nil {
		return fmt.Errorf("initialise ONNX Runtime from %s: %w", library, err)
	}
	return nil
}

func destroyORT() error { return ort.DestroyEnvironment() }

// newORTSession reads the model's inputs and outputs and opens the session.
func newORTSession(cfg ortSessionConfig) (*ortSession, error) {
	io, err := readModelIO(cfg.ModelPath)
	if err != nil {
		return nil, err
	}
	plan, err := outputPlan(io.outputs)
	if err != nil {
		return nil, err
	}
	opts, err := newSessionOptions(cfg.Provider)
	if err != nil {
		return nil, err
	}
	defer opts.Destroy()
	inNames := make([]string, len(io.inputs))
	for i, s := range io.inputs {
		inNames[i] = s.Name
	}
	outNames := make([]string, len(io.outputs))
	for i, s := range io.outputs {
		outNames[i] = s.Name
	}
	sess, err := ort.NewDynamicAdvancedSession(cfg.ModelPath, inNames, outNames, opts)
	if err != nil {
		return nil, fmt.Errorf("create ONNX Runtime session for %s: %w", cfg.ModelPath, err)
	}
	return &ortSession{session: sess, io: io, preallocate: plan}, nil
}

// readModelIO lists the model's inputs and outputs. It loads the model in a
// throwaway CPU session without graph optimisation, the cheapest way the
// Go binding offers.
func readModelIO(path string) (*modelIO, error) {
	opts, err := ort.NewSessionOptions()
	if err != nil {
		return nil, fmt.Errorf("create session options: %w", err)
	}
	defer opts.Destroy()
	if err := opts.SetGraphOptimizationLevel(ort.GraphOptimizationLevelDisableAll); err != nil {
		return nil, fmt.Errorf("set graph optimization: %w", err)
	}
	ins, outs, err := ort.GetInputOutputInfoWithOptions(path, opts)
	if err != nil {
		return nil, fmt.Errorf("load model %s: %w", path, err)
	}
	inputs, err := specsFromORT("input", ins)
	if err != nil {
		return nil, err
	}
	outputs, err := specsFromORT("output", outs)
	if err != nil {
		return nil, err
	}
	return newModelIO(inputs, outputs), nil
}

// specsFromORT converts ORT's descriptions, refusing what the data path
// cannot carry: sequences, maps and element types without a DataType.
func specsFromORT(kind string, infos []ort.InputOutputInfo) ([]TensorSpec, error) {
	specs := make([]TensorSpec, len(infos))
	for i, info := range infos {
		if info.OrtValueType != ort.ONNXTypeTensor {
			return nil, fmt.Errorf("model unsupported: %s %q has ONNX type %s; only tensors are supported", kind, info.Name, info.OrtValueType)
		}
		dt, ok := ortElementTypes[info.DataType]
		if !ok {
			return nil, fmt.Errorf("model unsupported: %s %q has element type %s", kind, info.Name, info.DataType)
		}
		shape := make([]int64, len(info.Dimensions))
		for j, d := range info.Dimensions {
			shape[j] = max(d, -1) // symbolic and unknown dimensions are -1
		}
		specs[i] = TensorSpec{Name: info.Name, DataType: dt, Shape: shape}
	}
	return specs, nil
}

// outputPlan decides which outputs the runner allocates before Run. ORT
// allocates the others, and the binding copies them into Go memory.
//
// onnxruntime_go v1.27.0 cannot hand back an ORT-allocated FP16 or BF16
// tensor (it copies one byte per element and then fails), nor a rank-0
// tensor. So those outputs are allocated here, which needs their shape in
// advance: a dynamically shaped FP16 or BF16 output makes the model
// unsupported.
func outputPlan(outputs []TensorSpec) ([]bool, error) {
	plan := make([]bool, len(outputs))
	for i, s := range outputs {
		half := s.DataType == FP16 || s.DataType == BF16
		switch {
		case half && len(s.Shape) == 0:
			return nil, fmt.Errorf("model unsupported: output %q is a rank-0 %s tensor, which the ONNX Runtime Go binding cannot return", s.Name, s.DataType)
		case half && !isStatic(s.Shape):
			return nil, fmt.Errorf("model unsupported: output %q is %s with dynamic shape %s; the ONNX Runtime Go binding can only return %s outputs of fixed shape", s.Name, s.DataType, formatShape(s.Shape), s.DataType)
		case half:
			n, err := ElementCount(s.Shape, 0)
			if err != nil || n == 0 {
				return nil, fmt.Errorf("model unsupported: output %q is an empty %s tensor", s.Name, s.DataType)
			}
			plan[i] = true
		case len(s.Shape) == 0:
			if s.DataType == Bytes {
				return nil, fmt.Errorf("model unsupported: output %q is a rank-0 BYTES tensor, which the ONNX Runtime Go binding cannot return", s.Name)
			}
			plan[i] = true
		}
	}
	return plan, nil
}

// newSessionOptions turns the provider options into ORT session options.
func newSessionOptions(p ProviderOptions) (*ort.SessionOptions, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	p = p.withDefaults()
	opts, err := ort.NewSessionOptions()
	if err != nil {
		return nil, fmt.Errorf("create session options: %w", err)
	}
	level := map[string]ort.GraphOptimizationLevel{
		GraphOptDisable:  ort.GraphOptimizationLevelDisableAll,
		GraphOptBasic:    ort.GraphOptimizationLevelEnableBasic,
		GraphOptExtended: ort.GraphOptimizationLevelEnableExtended,
		GraphOptAll:      ort.GraphOptimizationLevelEnableAll,
	}[p.GraphOptimization]
	steps := []struct {
		what string
		do   func() error
	}{
		{"intra-op threads", func() error { return opts.SetIntraOpNumThreads(p.IntraOpThreads) }},
		{"inter-op threads", func() error { return opts.SetInterOpNumThreads(p.InterOpThreads) }},
		{"graph optimization", func() error { return opts.SetGraphOptimizationLevel(level) }},
		// Unless allowed, idle intra-op threads do not spin after each run:
		// on a shared machine the spinning takes cores from the other models
		// and from this runner's own transfer of the results.
		{"intra-op spinning", func() error {
			return opts.AddSessionConfigEntry("session.intra_op.allow_spinning", map[bool]string{true: "1", false: "0"}[p.AllowSpinning])
		}},
	}
	for _, s := range steps {
		if err := s.do(); err != nil {
			opts.Destroy()
			return nil, fmt.Errorf("set %s: %w", s.what, err)
		}
	}
	if p.Kind == ProviderCUDA {
		if err := appendCUDA(opts, p); err != nil {
			opts.Destroy()
			return nil, err
		}
	}
	return opts, nil
}

// appendCUDA adds the CUDA execution provider. A library built without it
// fails here; that error wraps ErrNoCUDA.
func appendCUDA(opts *ort.SessionOptions, p ProviderOptions) error {
	m, err := p.CUDAOptions()
	if err != nil {
		return err
	}
	cuda, err := ort.NewCUDAProviderOptions()
	if err != nil {
		return cudaError("create CUDA provider options", err)
	}
	defer cuda.Destroy()
	if err := cuda.Update(m); err != nil {
		return cudaError("set CUDA provider options", err)
	}
	if err := opts.AppendExecutionProviderCUDA(cuda); err != nil {
		return cudaError("append CUDA execution provider", err)
	}
	return nil
}

// cudaError wraps ErrNoCUDA when ORT's message says the provider library
// could not be loaded, which is how a CPU-only build answers.
func cudaError(what string, err error) error {
	msg := err.Error()
	for _, s := range []string{"Failed to load", "cannot open shared object", "providers_cuda", "providers_shared", "not enabled", "CUDA is not available"} {
		if strings.Contains(msg, s) {
			return fmt.Errorf("%s: %w: %v", what, ErrNoCUDA, err)
		}
	}
	return fmt.Errorf("%s: %w", what, err)
}

func (s *ortSession) destroy() error { return s.session.Destroy() }

// run executes one request. Inputs that name a part of the arena mem are
// read there in place; outputs go to the request's output region of mem
// where they fit (static numeric outputs are written there by ONNX Runtime
// itself), inline otherwise. Errors wrap ErrInvalidTensor when the request
// is at fault.
func (s *ortSession) run(req *runnerpb.InferRequest, mem []byte) (*runnerpb.InferResponse, error) {
	start := time.Now()
	selected, err := s.io.selectOutputs(req.GetOutputs())
	if err != nil {
		return nil, err
	}
	for _, t := range req.GetInputs() {
		if t.GetArena() == nil {
			continue
		}
		// The server is trusted, but a bad descriptor must not crash the
		// runner either.
		b, err := arenaBytes(mem, 0, uint64(len(mem)), t.GetArena())
		if err != nil {
			return nil, fmt.Errorf("input %q: %w", t.GetName(), err)
		}
		t.Data = b
	}
	out := newOutputRegion(mem, req.GetOutput())
	checked, err := s.io.orderInputs(req.GetInputs())
	if err != nil {
		return nil, err
	}
	inputs := make([]ort.Value, len(checked))
	outputs := make([]ort.Value, len(s.io.outputs))
	defer func() {
		for _, v := range inputs {
			if v != nil {
				v.Destroy()
			}
		}
		for _, v := range outputs {
			if v != nil {
				v.Destroy()
			}
		}
	}()
	for i, c := range checked {
		if inputs[i], err = newInputValue(c); err != nil {
			return nil, fmt.Errorf("%w: input %q: %w", ErrInvalidTensor, c.tensor.GetName(), err)
		}
	}
	// Selected outputs of fixed shape are written by ONNX Runtime straight
	// into the arena, as far as the region goes.
	inArena := make([]*runnerpb.ArenaSlice, len(s.io.outputs))
	for _, i := range selected {
		spec := s.io.outputs[i]
		if len(spec.Shape) == 0 || !isStatic(spec.Shape) || spec.DataType == Bytes {
			continue
		}
		n, err := ElementCount(spec.Shape, 0)
		if err != nil || n == 0 {
			continue
		}
		slice, b := out.take(uint64(spec.DataType.ByteSize(n)))
		if b == nil {
			continue
		}
		if outputs[i], err = ort.NewCustomDataTensor(ort.Shape(spec.Shape), b, dataTypeToORT[spec.DataType]); err != nil {
			return nil, fmt.Errorf("allocate output %q in the arena: %w", spec.Name, err)
		}
		inArena[i] = slice
	}
	for i, pre := range s.preallocate {
		if pre && outputs[i] == nil {
			if outputs[i], err = newOutputValue(s.io.outputs[i]); err != nil {
				return nil, fmt.Errorf("allocate output %q: %w", s.io.outputs[i].Name, err)
			}
		}
	}
	ran := time.Now()
	if err := s.session.Run(inputs, outputs); err != nil {
		return nil, err
	}
	done := time.Now()
	resp := &runnerpb.InferResponse{Outputs: make([]*runnerpb.Tensor, 0, len(selected))}
	for _, i := range selected {
		spec := s.io.outputs[i]
		data, err := valueBytes(spec.DataType, outputs[i])
		if err != nil {
			return nil, fmt.Errorf("read output %q: %w", spec.Name, err)
		}
		t := &runnerpb.Tensor{
			Name:     spec.Name,
			Datatype: string(spec.DataType),
			Shape:    outputs[i].GetShape(),
		}
		if inArena[i] != nil {
			t.Arena = inArena[i] // ONNX Runtime wrote it there
		} else if slice, b := out.take(uint64(len(data))); b != nil {
			copy(b, data)
			t.Arena = slice
		} else {
			t.Data = data
		}
		resp.Outputs = append(resp.Outputs, t)
	}
	resp.InputNs = int64(ran.Sub(start))
	resp.InferNs = int64(done.Sub(ran))
	resp.OutputNs = int64(time.Since(done))
	return resp, nil
}

// newInputValue wraps a checked tensor as an ORT value. Fixed-size types
// use the request's bytes in place.
func newInputValue(c checkedInput) (ort.Value, error) {
	shape := ort.Shape(c.tensor.GetShape())
	if c.dataType == Bytes {
		t, err := ort.NewStringTensor(shape)
		if err != nil {
			return nil, err
		}
		if err := t.SetContents(c.strings); err != nil {
			t.Destroy()
			return nil, err
		}
		return t, nil
	}
	if len(shape) == 0 {
		return codecs[c.dataType].newScalar(c.tensor.GetData())
	}
	data := c.tensor.GetData()
	if c.elements == 0 {
		// ORT takes empty tensors, the binding wants at least one byte.
		data = []byte{0}
	}
	return ort.NewCustomDataTensor(shape, data, dataTypeToORT[c.dataType])
}

// newOutputValue allocates an output the runner fills itself (outputPlan).
func newOutputValue(spec TensorSpec) (ort.Value, error) {
	if len(spec.Shape) == 0 {
		return codecs[spec.DataType].newScalar(make([]byte, spec.DataType.Size()))
	}
	n, err := ElementCount(spec.Shape, 0)
	if err != nil {
		return nil, err
	}
	return ort.NewCustomDataTensor(ort.Shape(spec.Shape), make([]byte, spec.DataType.ByteSize(n)), dataTypeToORT[spec.DataType])
}

// valueBytes returns an output's elements in the wire layout. Numeric data
// is reinterpreted in place, not copied: the binding already copied it into
// Go memory, which outlives the ORT value.
func valueBytes(dt DataType, v ort.Value) ([]byte, error) {
	switch t := v.(type) {
	case *ort.CustomDataTensor:
		return t.GetData(), nil
	case *ort.StringTensor:
		elems, err := t.GetContents()
		if err != nil {
			return nil, err
		}
		var buf []byte
		for _, e := range elems {
			buf = AppendBytesElement(buf, []byte(e))
		}
		return buf, nil
	}
	c, ok := codecs[dt]
	if !ok {
		return nil, fmt.Errorf("no conversion for %s", dt)
	}
	if b, ok := c.bytes(v); ok {
		return b, nil
	}
	return nil, fmt.Errorf("ONNX Runtime returned %T for a %s tensor", v, dt)
}

// codec converts between raw bytes and the binding's typed values for one
// Go element type.
type codec interface {
	newScalar(data []byte) (ort.Value, error)
	bytes(v ort.Value) ([]byte, bool)
}

var codecs = map[DataType]codec{
	FP32: typed[float32]{}, FP64: typed[float64]{},
	Int8: typed[int8]{}, Int16: typed[int16]{}, Int32: typed[int32]{}, Int64: typed[int64]{},
	Uint8: typed[uint8]{}, Uint16: typed[uint16]{}, Uint32: typed[uint32]{}, Uint64: typed[uint64]{},
	Bool: typed[bool]{},
}

type typed[T ort.TensorData] struct{}

func (typed[T]) newScalar(data []byte) (ort.Value, error) {
	var v T
	if len(data) != int(unsafe.Sizeof(v)) {
		return nil, fmt.Errorf("scalar needs %d bytes, got %d", unsafe.Sizeof(v), len(data))
	}
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&v)), len(data)), data)
	return ort.NewScalar(v)
}

func (typed[T]) bytes(v ort.Value) ([]byte, bool) {
	switch t := v.(type) {
	case *ort.Tensor[T]:
		return asBytes(t.GetData()), true
	case *ort.Scalar[T]:
		return asBytes([]T{t.GetData()}), true
	}
	return nil, false
}

// asBytes views a numeric slice as its little-endian bytes (initORT checks
// the machine is little-endian).
func asBytes[T ort.TensorData](s []T) []byte {
	if len(s) == 0 {
		return []byte{}
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), len(s)*int(unsafe.Sizeof(s[0])))
}

// outputRegion hands out aligned parts of a call's output region of the
// arena, front to back.
type outputRegion struct {
	mem       []byte
	next, end uint64
}

// newOutputRegion is the region a request names; empty when it names none
// or one outside mem.
func newOutputRegion(mem []byte, s *runnerpb.ArenaSlice) *outputRegion {
	if s == nil {
		return &outputRegion{}
	}
	if _, err := arenaBytes(mem, 0, uint64(len(mem)), s); err != nil {
		return &outputRegion{}
	}
	return &outputRegion{mem: mem, next: s.GetOffset(), end: s.GetOffset() + s.GetLength()}
}

// take reserves n bytes; nil when they do not fit.
func (o *outputRegion) take(n uint64) (*runnerpb.ArenaSlice, []byte) {
	if o.mem == nil || n > o.end-o.next {
		return nil, nil
	}
	off := o.next
	next, ok := alignUp(off + n)
	if !ok {
		return nil, nil
	}
	o.next = min(next, o.end)
	return &runnerpb.ArenaSlice{Offset: off, Length: n}, o.mem[off : off+n : off+n]
}
