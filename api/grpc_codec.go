package api

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/runtime"
)

// Request-level parameters of ModelInfer. Triton hands parameters it does not
// know to the model as custom parameters; sloserve has no such use for them
// and ignores them, except for these:
//   - "timeout" (microseconds > 0) and "priority" (>= 0), each an int64_param
//     or a uint64_param, are the request's scheduling options (see
//     request_options.go); the client's gRPC deadline applies as well;
//   - "sequence_id", "sequence_start" and "sequence_end" are refused whatever
//     their value: sloserve has no sequence batcher.
var grpcRefusedRequestParams = []string{"sequence_id", "sequence_start", "sequence_end"}

// Tensor-level parameters refused on inputs and requested outputs; all others
// (such as "binary_data", which only means something over REST) are ignored.
// The shared-memory parameters are refused only where the extension is off.
var (
	grpcRefusedInputParams  = []string{"shared_memory_region"}
	grpcRefusedOutputParams = []string{"classification", "shared_memory_region"}
)

// Names of the InferTensorContents fields, as the protocol spells them.
const (
	grpcBoolContents   = "bool_contents"
	grpcIntContents    = "int_contents"
	grpcInt64Contents  = "int64_contents"
	grpcUintContents   = "uint_contents"
	grpcUint64Contents = "uint64_contents"
	grpcFP32Contents   = "fp32_contents"
	grpcFP64Contents   = "fp64_contents"
	grpcBytesContents  = "bytes_contents"
)

// grpcContentsField names the typed contents field that carries each
// datatype (runtime's datatype table). FP16 and BF16 have none: they travel
// in raw_input_contents only.
var grpcContentsField = func() map[runtime.DataType]string {
	m := make(map[runtime.DataType]string)
	for _, t := range runtime.DataTypes() {
		if t.GRPCContents != "" {
			m[t.Name] = t.GRPCContents
		}
	}
	return m
}()

// decodeGRPCInfer validates a ModelInferRequest and converts its inputs to
// runtime tensors, as Triton does: every input names its datatype and shape;
// the data is either in raw_input_contents (one entry per input, in order) or
// in the typed contents field of the input's datatype, never both. Element
// counts are checked against lim before anything is allocated. Raw data is
// not copied: the tensors alias the message's byte slices, which the message
// owns (gRPC's proto codec unmarshals without aliasing its receive buffer).
//
// The request's deadline is arrival plus its timeout parameter, if any.
//
// Errors wrap errBadRequest, errTooLarge or runtime.ErrShape.
func decodeGRPCInfer(msg *inference.ModelInferRequest, lim Limits, arrival time.Time) (*runtime.InferRequest, error) {
	req, _, err := decodeGRPCInferShm(msg, lim, arrival, nil)
	return req, err
}

// decodeGRPCInferShm is decodeGRPCInfer with the shared memory regions of
// shm (nil: the extension is off): inputs that name a region alias it and
// take no entry of raw_input_contents (as Triton's clients send them), and
// the requested outputs that name one are returned as targets.
func decodeGRPCInferShm(msg *inference.ModelInferRequest, lim Limits, arrival time.Time, shm *shmUse) (*runtime.InferRequest, []shmTarget, error) {
	params := msg.GetParameters()
	for _, k := range grpcRefusedRequestParams {
		if _, ok := params[k]; ok {
			return nil, nil, fmt.Errorf("%w: parameter %q is not supported: sequence batching is not available", errBadRequest, k)
		}
	}
	var (
		timeout  time.Duration
		priority int
	)
	if p, ok := params[paramTimeout]; ok {
		neg, us, err := grpcIntParam(paramTimeout, p)
		if err != nil {
			return nil, nil, err
		}
		var problem string
		if timeout, problem = timeoutFromMicros(neg, us); problem != "" {
			return nil, nil, fmt.Errorf("%w: parameter %q %s, not %s", errBadRequest, paramTimeout, problem, grpcIntString(neg, us))
		}
	}
	if p, ok := params[paramPriority]; ok {
		neg, v, err := grpcIntParam(paramPriority, p)
		if err != nil {
			return nil, nil, err
		}
		var problem string
		if priority, problem = priorityFromUint(neg, v); problem != "" {
			return nil, nil, fmt.Errorf("%w: parameter %q %s, not %s", errBadRequest, paramPriority, problem, grpcIntString(neg, v))
		}
	}
	inputs := msg.GetInputs()
	raw := msg.GetRawInputContents()
	inline := len(inputs) // inputs whose data is in the message
	if shm != nil {
		for _, in := range inputs {
			if grpcSharedMemory(in.GetParameters()) {
				inline--
			}
		}
	}
	if len(raw) > 0 && len(raw) != inline {
		if inline != len(inputs) {
			return nil, nil, fmt.Errorf("%w: raw_input_contents has %d entries for the %d inputs not in shared memory", errBadRequest, len(raw), inline)
		}
		return nil, nil, fmt.Errorf("%w: raw_input_contents has %d entries for %d inputs", errBadRequest, len(raw), inline)
	}
	rawNext := 0
	req := &runtime.InferRequest{
		Inputs:   make([]runtime.Tensor, len(inputs)),
		Deadline: requestDeadline(arrival, timeout, 0),
		Priority: priority,
		ID:       msg.GetId(),
	}
	// Names are checked for repeats through a map, so that a hostile request
	// with many tensors does not cost quadratic time.
	seen := grpcNameSet(len(inputs))
	for i, in := range inputs {
		if in.GetName() == "" {
			return nil, nil, fmt.Errorf("%w: input %d has no name", errBadRequest, i)
		}
		if _, dup := seen[in.GetName()]; dup {
			return nil, nil, fmt.Errorf("%w: input %q appears more than once", errBadRequest, in.GetName())
		}
		if seen != nil {
			seen[in.GetName()] = struct{}{}
		}
		if shm != nil && grpcSharedMemory(in.GetParameters()) {
			t, err := grpcShmInput(shm, in, lim)
			if err != nil {
				return nil, nil, err
			}
			req.Inputs[i] = t
			continue
		}
		var data []byte
		if len(raw) > 0 {
			data = raw[rawNext]
			rawNext++
		}
		t, err := decodeGRPCInput(in, data, len(raw) > 0, lim)
		if err != nil {
			return nil, nil, err
		}
		req.Inputs[i] = t
	}
	outputs := msg.GetOutputs()
	if len(outputs) > 0 {
		req.Outputs = make([]string, len(outputs))
	}
	seen = grpcNameSet(len(outputs))
	var targets []shmTarget
	for i, out := range outputs {
		name := out.GetName()
		if name == "" {
			return nil, nil, fmt.Errorf("%w: requested output %d has no name", errBadRequest, i)
		}
		if _, dup := seen[name]; dup {
			return nil, nil, fmt.Errorf("%w: output %q is requested more than once", errBadRequest, name)
		}
		if seen != nil {
			seen[name] = struct{}{}
		}
		if shm != nil && grpcSharedMemory(out.GetParameters()) {
			t, err := grpcShmOutput(shm, name, out.GetParameters())
			if err != nil {
				return nil, nil, err
			}
			targets = append(targets, t)
		}
		for _, k := range grpcRefusedOutputParams {
			if _, ok := out.GetParameters()[k]; ok && (shm == nil || k != paramShmRegion) {
				return nil, nil, fmt.Errorf("%w: output %q: parameter %q is not supported", errBadRequest, name, k)
			}
		}
		req.Outputs[i] = name
	}
	return req, targets, nil
}

// grpcIntParam reads a request parameter that must be an integer, sent as an
// int64_param or a uint64_param, as its sign (neg: negative) and magnitude.
func grpcIntParam(name string, p *inference.InferParameter) (neg bool, mag uint64, err error) {
	switch v := p.GetParameterChoice().(type) {
	case *inference.InferParameter_Int64Param:
		i := v.Int64Param
		if i < 0 {
			return true, uint64(-(i + 1)) + 1, nil // -MinInt64 overflows int64
		}
		return false, uint64(i), nil
	case *inference.InferParameter_Uint64Param:
		return false, v.Uint64Param, nil
	}
	return false, 0, fmt.Errorf("%w: parameter %q must be an int64_param or a uint64_param, not %s",
		errBadRequest, name, grpcParamKind(p))
}

// grpcParamKind names the field of the InferParameter oneof that p sets.
func grpcParamKind(p *inference.InferParameter) string {
	switch p.GetParameterChoice().(type) {
	case *inference.InferParameter_BoolParam:
		return "bool_param"
	case *inference.InferParameter_Int64Param:
		return "int64_param"
	case *inference.InferParameter_StringParam:
		return "string_param"
	case *inference.InferParameter_DoubleParam:
		return "double_param"
	case *inference.InferParameter_Uint64Param:
		return "uint64_param"
	}
	return "no value"
}

// grpcIntString formats an integer given as sign and magnitude.
func grpcIntString(neg bool, mag uint64) string {
	s := strconv.FormatUint(mag, 10)
	if neg {
		return "-" + s
	}
	return s
}

// grpcNameSet returns a set for n tensor names, or nil when n < 2 and no name
// can repeat. Looking a name up in the nil set finds nothing.
func grpcNameSet(n int) map[string]struct{} {
	if n < 2 {
		return nil
	}
	return make(map[string]struct{}, n)
}

// decodeGRPCInput converts one input. With useRaw, raw is its data and typed
// contents are refused; otherwise the data comes from its typed contents.
func decodeGRPCInput(in *inference.ModelInferRequest_InferInputTensor, raw []byte, useRaw bool, lim Limits) (runtime.Tensor, error) {
	name := in.GetName()
	for _, k := range grpcRefusedInputParams {
		if _, ok := in.GetParameters()[k]; ok {
			return runtime.Tensor{}, fmt.Errorf("%w: input %q: parameter %q is not supported", errBadRequest, name, k)
		}
	}
	dt, shape, n, err := grpcCheckInput(in, lim)
	if err != nil {
		return runtime.Tensor{}, err
	}
	t := runtime.Tensor{Name: name, DataType: dt, Shape: shape}

	set := grpcSetContents(in.GetContents())
	if useRaw {
		if len(set) > 0 {
			return runtime.Tensor{}, fmt.Errorf("%w: input %q has both raw_input_contents and %s", errBadRequest, name, set[0])
		}
		if err := grpcCheckRaw(dt, raw, n); err != nil {
			return runtime.Tensor{}, fmt.Errorf("%w: input %q: %v", errBadRequest, name, err)
		}
		t.Data = raw
		return t, nil
	}

	want, ok := grpcContentsField[dt]
	if !ok {
		return runtime.Tensor{}, fmt.Errorf("%w: input %q: %s has no typed contents field; send it in raw_input_contents", errBadRequest, name, dt)
	}
	for _, f := range set {
		if f != want {
			return runtime.Tensor{}, fmt.Errorf("%w: input %q: datatype %s takes %s, not %s", errBadRequest, name, dt, want, f)
		}
	}
	t.Data, err = grpcTypedData(dt, in.GetContents(), n)
	if err != nil {
		return runtime.Tensor{}, fmt.Errorf("%w: input %q: %v", errBadRequest, name, err)
	}
	return t, nil
}

// grpcCheckInput checks an input's datatype and shape, wherever its data
// comes from, and returns them with its element count.
func grpcCheckInput(in *inference.ModelInferRequest_InferInputTensor, lim Limits) (runtime.DataType, []int64, int64, error) {
	name := in.GetName()
	if in.GetDatatype() == "" {
		return "", nil, 0, fmt.Errorf("%w: input %q has no datatype", errBadRequest, name)
	}
	dt, ok := runtime.ParseDataType(in.GetDatatype())
	if !ok {
		return "", nil, 0, fmt.Errorf("%w: input %q: unknown datatype %q", errBadRequest, name, in.GetDatatype())
	}
	shape := in.GetShape()
	if len(shape) == 0 {
		return "", nil, 0, fmt.Errorf("%w: input %q has no shape", errBadRequest, name)
	}
	n, err := grpcElementCount(shape, lim.MaxTensorElements, dt)
	if err != nil {
		return "", nil, 0, fmt.Errorf("input %q: %w", name, err)
	}
	return dt, shape, n, nil
}

// grpcElementCount is the number of elements of shape. A negative dimension, or
// a product that does not fit in an int64, is a malformed shape
// (runtime.ErrShape); a shape whose elements or bytes exceed the limits is too
// large (errTooLarge).
func grpcElementCount(shape []int64, limit int64, dt runtime.DataType) (int64, error) {
	// runtime.ElementCount gives up on a running product too large for int64
	// even when a later dimension is 0, so a shape with a 0 is settled here.
	if slices.Contains(shape, 0) && !slices.ContainsFunc(shape, func(d int64) bool { return d < 0 }) {
		return 0, nil
	}
	n, err := runtime.ElementCount(shape, 0)
	if err != nil {
		return 0, err
	}
	if limit > 0 && n > limit {
		return 0, fmt.Errorf("%w: shape %v has %d elements, the limit is %d", errTooLarge, shape, n, limit)
	}
	if size := int64(dt.Size()); size > 0 && n > math.MaxInt/size {
		return 0, fmt.Errorf("%w: shape %v has %d elements of %d bytes", errTooLarge, shape, n, size)
	}
	return n, nil
}

// grpcCheckRaw checks that raw holds exactly n elements of dt.
func grpcCheckRaw(dt runtime.DataType, raw []byte, n int64) error {
	if dt == runtime.Bytes {
		err := runtime.CheckBytes(raw, n)
		return err
	}
	if want := dt.ByteSize(n); int64(len(raw)) != want {
		return fmt.Errorf("raw data has %d bytes, %d elements of %s need %d", len(raw), n, dt, want)
	}
	return nil
}

// grpcSetContents names the fields of c that hold data.
func grpcSetContents(c *inference.InferTensorContents) []string {
	if c == nil {
		return nil
	}
	var set []string
	for _, f := range []struct {
		name string
		n    int
	}{
		{grpcBoolContents, len(c.BoolContents)},
		{grpcIntContents, len(c.IntContents)},
		{grpcInt64Contents, len(c.Int64Contents)},
		{grpcUintContents, len(c.UintContents)},
		{grpcUint64Contents, len(c.Uint64Contents)},
		{grpcFP32Contents, len(c.Fp32Contents)},
		{grpcFP64Contents, len(c.Fp64Contents)},
		{grpcBytesContents, len(c.BytesContents)},
	} {
		if f.n > 0 {
			set = append(set, f.name)
		}
	}
	return set
}

// grpcTypedData converts the typed contents of datatype dt, which must hold
// exactly n elements, to the raw little-endian layout.
func grpcTypedData(dt runtime.DataType, c *inference.InferTensorContents, n int64) ([]byte, error) {
	switch dt {
	case runtime.Bool:
		return grpcConvert(c.GetBoolContents(), n, 1, func(b []byte, v bool) error {
			if v {
				b[0] = 1
			}
			return nil
		})
	case runtime.Int8:
		return grpcConvert(c.GetIntContents(), n, 1, func(b []byte, v int32) error {
			if v < math.MinInt8 || v > math.MaxInt8 {
				return fmt.Errorf("value %d is out of range for INT8", v)
			}
			b[0] = byte(int8(v))
			return nil
		})
	case runtime.Int16:
		return grpcConvert(c.GetIntContents(), n, 2, func(b []byte, v int32) error {
			if v < math.MinInt16 || v > math.MaxInt16 {
				return fmt.Errorf("value %d is out of range for INT16", v)
			}
			binary.LittleEndian.PutUint16(b, uint16(int16(v)))
			return nil
		})
	case runtime.Int32:
		return grpcConvert(c.GetIntContents(), n, 4, func(b []byte, v int32) error {
			binary.LittleEndian.PutUint32(b, uint32(v))
			return nil
		})
	case runtime.Int64:
		return grpcConvert(c.GetInt64Contents(), n, 8, func(b []byte, v int64) error {
			binary.LittleEndian.PutUint64(b, uint64(v))
			return nil
		})
	case runtime.Uint8:
		return grpcConvert(c.GetUintContents(), n, 1, func(b []byte, v uint32) error {
			if v > math.MaxUint8 {
				return fmt.Errorf("value %d is out of range for UINT8", v)
			}
			b[0] = byte(v)
			return nil
		})
	case runtime.Uint16:
		return grpcConvert(c.GetUintContents(), n, 2, func(b []byte, v uint32) error {
			if v > math.MaxUint16 {
				return fmt.Errorf("value %d is out of range for UINT16", v)
			}
			binary.LittleEndian.PutUint16(b, uint16(v))
			return nil
		})
	case runtime.Uint32:
		return grpcConvert(c.GetUintContents(), n, 4, func(b []byte, v uint32) error {
			binary.LittleEndian.PutUint32(b, v)
			return nil
		})
	case runtime.Uint64:
		return grpcConvert(c.GetUint64Contents(), n, 8, func(b []byte, v uint64) error {
			binary.LittleEndian.PutUint64(b, v)
			return nil
		})
	case runtime.FP32:
		return grpcConvert(c.GetFp32Contents(), n, 4, func(b []byte, v float32) error {
			binary.LittleEndian.PutUint32(b, math.Float32bits(v))
			return nil
		})
	case runtime.FP64:
		return grpcConvert(c.GetFp64Contents(), n, 8, func(b []byte, v float64) error {
			binary.LittleEndian.PutUint64(b, math.Float64bits(v))
			return nil
		})
	case runtime.Bytes:
		return grpcBytesData(c.GetBytesContents(), n)
	}
	return nil, fmt.Errorf("%s has no typed contents field", dt)
}

// grpcConvert encodes n values of size bytes each with put, after checking that
// there are n of them.
func grpcConvert[T any](vals []T, n int64, size int, put func([]byte, T) error) ([]byte, error) {
	if int64(len(vals)) != n {
		return nil, fmt.Errorf("contents hold %d elements, the shape needs %d", len(vals), n)
	}
	out := make([]byte, len(vals)*size)
	for i, v := range vals {
		if err := put(out[i*size:], v); err != nil {
			return nil, fmt.Errorf("element %d: %w", i, err)
		}
	}
	return out, nil
}

// grpcBytesData lays out n BYTES elements, each with its 4-byte length prefix.
func grpcBytesData(elems [][]byte, n int64) ([]byte, error) {
	if int64(len(elems)) != n {
		return nil, fmt.Errorf("contents hold %d elements, the shape needs %d", len(elems), n)
	}
	total := 0
	for i, e := range elems {
		if uint64(len(e)) > math.MaxUint32 {
			return nil, fmt.Errorf("element %d has %d bytes, more than a BYTES element can hold", i, len(e))
		}
		total += 4 + len(e)
	}
	out := make([]byte, 0, total)
	for _, e := range elems {
		out = runtime.AppendBytesElement(out, e)
	}
	return out, nil
}

// encodeGRPCInferResponse builds the response message. Output data always goes
// in raw_output_contents, one entry per output in order, as Triton sends it;
// the entries alias the runtime tensors' data rather than copying it, so the
// Backend must not reuse that memory once Infer has returned.
func encodeGRPCInferResponse(model, version, id string, resp *runtime.InferResponse) *inference.ModelInferResponse {
	outs := resp.Outputs
	var (
		msg     *inference.ModelInferResponse
		tensors []inference.ModelInferResponse_InferOutputTensor
	)
	if len(outs) == 1 {
		// The common case in one allocation.
		one := new(grpcOneOutputResponse)
		msg, tensors = &one.msg, one.tensor[:]
		msg.Outputs, msg.RawOutputContents = one.ptr[:], one.raw[:]
	} else {
		msg = &inference.ModelInferResponse{
			Outputs:           make([]*inference.ModelInferResponse_InferOutputTensor, len(outs)),
			RawOutputContents: make([][]byte, len(outs)),
		}
		// One allocation for all output tensor messages.
		tensors = make([]inference.ModelInferResponse_InferOutputTensor, len(outs))
	}
	msg.ModelName, msg.ModelVersion, msg.Id = model, version, id
	for i, t := range outs {
		ot := &tensors[i]
		ot.Name = t.Name
		ot.Datatype = string(t.DataType)
		ot.Shape = t.Shape
		msg.Outputs[i] = ot
		msg.RawOutputContents[i] = t.Data
	}
	return msg
}

// grpcOneOutputResponse is a response of one output, allocated at once.
type grpcOneOutputResponse struct {
	msg    inference.ModelInferResponse
	ptr    [1]*inference.ModelInferResponse_InferOutputTensor
	raw    [1][]byte
	tensor [1]inference.ModelInferResponse_InferOutputTensor
}
