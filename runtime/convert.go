package runtime

import (
	"bytes"
	"fmt"
	"slices"
	"time"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// This file holds the pure-Go halves of the data path: conversions between
// runtime and runnerpb types, and the runner's checks of a request against
// the model's inputs and outputs before anything reaches ONNX Runtime.

func specsToProto(specs []TensorSpec) []*runnerpb.TensorSpec {
	out := make([]*runnerpb.TensorSpec, len(specs))
	for i, s := range specs {
		out[i] = &runnerpb.TensorSpec{Name: s.Name, Datatype: string(s.DataType), Shape: s.Shape}
	}
	return out
}

func specsFromProto(specs []*runnerpb.TensorSpec) ([]TensorSpec, error) {
	out := make([]TensorSpec, len(specs))
	for i, s := range specs {
		dt, ok := ParseDataType(s.GetDatatype())
		if !ok {
			return nil, fmt.Errorf("tensor %q has unknown datatype %q", s.GetName(), s.GetDatatype())
		}
		out[i] = TensorSpec{Name: s.GetName(), DataType: dt, Shape: s.GetShape()}
	}
	return out, nil
}

func requestToProto(req *InferRequest) *runnerpb.InferRequest {
	in := make([]*runnerpb.Tensor, len(req.Inputs))
	for i, t := range req.Inputs {
		in[i] = &runnerpb.Tensor{Name: t.Name, Datatype: string(t.DataType), Shape: t.Shape, Data: t.Data}
	}
	return &runnerpb.InferRequest{Inputs: in, Outputs: req.Outputs}
}

// readResponse converts a runner's answer, copying the outputs it wrote to
// the arena mem out of the call's output region. The runner is not
// trusted: a descriptor outside the region, or one whose length does not
// match its tensor's type and shape, is an ErrArena error, and nothing
// outside the region is read.
func readResponse(resp *runnerpb.InferResponse, mem []byte, region *runnerpb.ArenaSlice) (*InferResponse, error) {
	for _, t := range resp.GetOutputs() {
		if t.GetArena() == nil {
			continue
		}
		if region == nil || mem == nil {
			return nil, fmt.Errorf("%w: output %q names the arena, but the call gave it no room there", ErrArena, t.GetName())
		}
		b, err := arenaBytes(mem, region.GetOffset(), region.GetLength(), t.GetArena())
		if err != nil {
			return nil, fmt.Errorf("output %q: %w", t.GetName(), err)
		}
		if _, err := checkArenaTensor(t, uint64(len(b))); err != nil {
			return nil, err
		}
		t.Data = bytes.Clone(b)
		t.Arena = nil
	}
	return responseFromProto(resp)
}

func responseFromProto(resp *runnerpb.InferResponse) (*InferResponse, error) {
	var r *InferResponse
	if len(resp.GetOutputs()) == 1 {
		// The common case in one allocation.
		one := new(oneOutputResponse)
		r = &one.resp
		r.Outputs = one.out[:]
	} else {
		r = &InferResponse{Outputs: make([]Tensor, len(resp.GetOutputs()))}
	}
	out := r.Outputs
	for i, t := range resp.GetOutputs() {
		dt, ok := ParseDataType(t.GetDatatype())
		if !ok {
			return nil, fmt.Errorf("runner returned output %q with unknown datatype %q", t.GetName(), t.GetDatatype())
		}
		out[i] = Tensor{Name: t.GetName(), DataType: dt, Shape: t.GetShape(), Data: t.GetData()}
	}
	r.Timing = Timing{
		Input:  time.Duration(resp.GetInputNs()),
		Infer:  time.Duration(resp.GetInferNs()),
		Output: time.Duration(resp.GetOutputNs()),
	}
	return r, nil
}

// oneOutputResponse is a response of one output, allocated at once.
type oneOutputResponse struct {
	resp InferResponse
	out  [1]Tensor
}

// modelIO is a model's inputs and outputs, indexed by name.
type modelIO struct {
	inputs, outputs []TensorSpec
	inIndex         map[string]int
	outIndex        map[string]int
}

func newModelIO(inputs, outputs []TensorSpec) *modelIO {
	m := &modelIO{
		inputs:   inputs,
		outputs:  outputs,
		inIndex:  make(map[string]int, len(inputs)),
		outIndex: make(map[string]int, len(outputs)),
	}
	for i, s := range inputs {
		m.inIndex[s.Name] = i
	}
	for i, s := range outputs {
		m.outIndex[s.Name] = i
	}
	return m
}

// checkedInput is a request tensor that matches its model input.
type checkedInput struct {
	tensor   *runnerpb.Tensor
	dataType DataType
	// elements is the element count of the shape.
	elements int64
	// strings holds the elements of a BYTES tensor.
	strings []string
}

// orderInputs checks the request's tensors against the model's inputs and
// returns them in the model's input order. Every error wraps
// ErrInvalidTensor.
func (m *modelIO) orderInputs(tensors []*runnerpb.Tensor) ([]checkedInput, error) {
	ordered := make([]checkedInput, len(m.inputs))
	for _, t := range tensors {
		i, ok := m.inIndex[t.GetName()]
		if !ok {
			return nil, fmt.Errorf("%w: the model has no input %q (inputs: %s)", ErrInvalidTensor, t.GetName(), specNames(m.inputs))
		}
		if ordered[i].tensor != nil {
			return nil, fmt.Errorf("%w: input %q given twice", ErrInvalidTensor, t.GetName())
		}
		c, err := checkInput(m.inputs[i], t)
		if err != nil {
			return nil, fmt.Errorf("%w: input %q: %w", ErrInvalidTensor, t.GetName(), err)
		}
		ordered[i] = c
	}
	for i, c := range ordered {
		if c.tensor == nil {
			return nil, fmt.Errorf("%w: input %q is missing", ErrInvalidTensor, m.inputs[i].Name)
		}
	}
	return ordered, nil
}

// checkInput checks one tensor's type, shape and data against its spec.
func checkInput(spec TensorSpec, t *runnerpb.Tensor) (checkedInput, error) {
	dt, ok := ParseDataType(t.GetDatatype())
	if !ok {
		return checkedInput{}, fmt.Errorf("unknown datatype %q", t.GetDatatype())
	}
	if dt != spec.DataType {
		return checkedInput{}, fmt.Errorf("datatype is %s, the model expects %s", dt, spec.DataType)
	}
	shape := t.GetShape()
	if err := checkShape(spec.Shape, shape); err != nil {
		return checkedInput{}, err
	}
	n, err := ElementCount(shape, 0)
	if err != nil {
		return checkedInput{}, err
	}
	c := checkedInput{tensor: t, dataType: dt, elements: n}
	data := t.GetData()
	if dt == Bytes {
		elems, err := SplitBytes(data, n)
		if err != nil {
			return checkedInput{}, err
		}
		c.strings = make([]string, len(elems))
		for i, e := range elems {
			// ONNX Runtime string tensors are filled from C strings.
			if bytes.IndexByte(e, 0) >= 0 {
				return checkedInput{}, fmt.Errorf("BYTES element %d contains a NUL byte, which ONNX Runtime strings cannot hold", i)
			}
			c.strings[i] = string(e)
		}
		return c, nil
	}
	if want := dt.ByteSize(n); int64(len(data)) != want {
		return checkedInput{}, fmt.Errorf("data has %d bytes, shape %v of %s needs %d", len(data), shape, dt, want)
	}
	if dt == Bool {
		for i, b := range data {
			if b > 1 {
				return checkedInput{}, fmt.Errorf("BOOL element %d is %d, not 0 or 1", i, b)
			}
		}
	}
	return c, nil
}

// checkShape checks a concrete shape against a model shape in which -1
// marks a dynamic dimension. A model shape of rank 0 is not checked:
// ONNX Runtime reports unknown-rank tensors that way too.
func checkShape(model, shape []int64) error {
	for i, d := range shape {
		if d < 0 {
			return fmt.Errorf("%w: dimension %d of %v is negative", ErrShape, i, shape)
		}
	}
	if len(model) == 0 {
		return nil
	}
	if len(shape) != len(model) {
		return fmt.Errorf("shape %v has rank %d, the model expects %s (rank %d)", shape, len(shape), formatShape(model), len(model))
	}
	for i, d := range model {
		if d >= 0 && shape[i] != d {
			return fmt.Errorf("shape %v does not fit the model's %s at dimension %d", shape, formatShape(model), i)
		}
	}
	return nil
}

// selectOutputs returns the indexes of the requested outputs in request
// order, or of all outputs when none is requested.
func (m *modelIO) selectOutputs(names []string) ([]int, error) {
	if len(names) == 0 {
		all := make([]int, len(m.outputs))
		for i := range all {
			all[i] = i
		}
		return all, nil
	}
	idx := make([]int, 0, len(names))
	for _, name := range names {
		i, ok := m.outIndex[name]
		if !ok {
			return nil, fmt.Errorf("%w: the model has no output %q (outputs: %s)", ErrInvalidTensor, name, specNames(m.outputs))
		}
		if slices.Contains(idx, i) {
			return nil, fmt.Errorf("%w: output %q requested twice", ErrInvalidTensor, name)
		}
		idx = append(idx, i)
	}
	return idx, nil
}

// isStatic reports whether a model shape has no dynamic dimension.
func isStatic(shape []int64) bool {
	return !slices.ContainsFunc(shape, func(d int64) bool { return d < 0 })
}

func specNames(specs []TensorSpec) string {
	names := make([]string, len(specs))
	for i, s := range specs {
		names[i] = fmt.Sprintf("%q", s.Name)
	}
	return fmt.Sprint(names)
}

// formatShape prints a model shape with "?" for dynamic dimensions.
func formatShape(shape []int64) string {
	b := []byte{'['}
	for i, d := range shape {
		if i > 0 {
			b = append(b, ',')
		}
		if d < 0 {
			b = append(b, '?')
		} else {
			b = fmt.Appendf(b, "%d", d)
		}
	}
	return string(append(b, ']'))
}
