package models

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/runtime"
)

// validate checks a request against a version's metadata before it reaches a
// runner: every input known and present once, datatypes equal, shapes
// compatible, data sized for the shape, requested outputs known. It returns
// the request's batch size (1 for models without batching).
func (v *version) validate(req *runtime.InferRequest, maxElements int64) (int, error) {
	md, wireOutputs := v.wire()
	if len(req.Inputs) != len(md) {
		var missing []string
		for _, spec := range md {
			if !slices.ContainsFunc(req.Inputs, func(t runtime.Tensor) bool { return t.Name == spec.Name }) {
				missing = append(missing, spec.Name)
			}
		}
		if len(missing) > 0 {
			return 0, fmt.Errorf("%w: missing input %q; %s expects %d inputs", ErrInvalidInput, missing[0], v.model, len(md))
		}
	}
	batch := -1
	seen := make(map[string]bool, len(req.Inputs))
	for i := range req.Inputs {
		t := &req.Inputs[i]
		if seen[t.Name] {
			return 0, fmt.Errorf("%w: input %q given twice", ErrInvalidInput, t.Name)
		}
		seen[t.Name] = true
		idx := slices.IndexFunc(md, func(s runtime.TensorSpec) bool { return s.Name == t.Name })
		if idx < 0 {
			return 0, fmt.Errorf("%w: unknown input %q for model %s", ErrInvalidInput, t.Name, v.model)
		}
		spec := md[idx]
		if t.DataType != spec.DataType {
			return 0, fmt.Errorf("%w: input %q has datatype %s, model expects %s", ErrInvalidInput, t.Name, t.DataType, spec.DataType)
		}
		if len(t.Shape) != len(spec.Shape) {
			return 0, fmt.Errorf("%w: input %q has shape %v, model expects %v", ErrInvalidInput, t.Name, t.Shape, spec.Shape)
		}
		for d, want := range spec.Shape {
			got := t.Shape[d]
			if got < 0 || (want >= 0 && got != want) {
				return 0, fmt.Errorf("%w: input %q has shape %v, model expects %v", ErrInvalidInput, t.Name, t.Shape, spec.Shape)
			}
			// An empty tensor where the model leaves the size open is
			// refused here: ONNX Runtime fails most models on one, which
			// would read as a server error.
			if got == 0 && want < 0 {
				return 0, fmt.Errorf("%w: input %q has shape %v: dimension %d is 0; it must be at least 1", ErrInvalidInput, t.Name, t.Shape, d)
			}
		}
		n, err := runtime.ElementCount(t.Shape, maxElements)
		if err != nil {
			return 0, fmt.Errorf("%w: input %q: %w", ErrTooLarge, t.Name, err)
		}
		if err := checkDataSize(t, n); err != nil {
			return 0, err
		}
		if v.maxBatch > 0 {
			b := int(t.Shape[0])
			if b < 1 || b > v.maxBatch {
				return 0, fmt.Errorf("%w: input %q has batch size %d, model %s allows 1 to %d", ErrInvalidInput, t.Name, b, v.model, v.maxBatch)
			}
			if batch >= 0 && b != batch {
				return 0, fmt.Errorf("%w: inputs disagree on batch size (%d and %d)", ErrInvalidInput, batch, b)
			}
			batch = b
		}
	}
	for _, name := range req.Outputs {
		if !slices.ContainsFunc(wireOutputs, func(s runtime.TensorSpec) bool { return s.Name == name }) {
			return 0, fmt.Errorf("%w: unknown output %q for model %s", ErrInvalidInput, name, v.model)
		}
	}
	if batch < 0 {
		batch = 1
	}
	return batch, nil
}

// checkDataSize checks that a tensor of n elements has the bytes its
// datatype needs, without computing n × element size, which overflows int64
// for the element counts a hostile shape can declare when no element limit
// is set. BYTES tensors are checked by the runner, which splits them.
func checkDataSize(t *runtime.Tensor, n int64) error {
	size := int64(t.DataType.Size())
	if t.DataType == runtime.Bytes || size <= 0 {
		return nil
	}
	if have := int64(len(t.Data)); have%size != 0 || have/size != n {
		need := fmt.Sprintf("%d × %d bytes", n, size)
		if n <= math.MaxInt64/size {
			need = fmt.Sprintf("%d bytes", n*size)
		}
		return fmt.Errorf("%w: input %q with shape %v needs %s of data, got %d", ErrInvalidInput, t.Name, t.Shape, need, have)
	}
	return nil
}

// checkBatchLimit refuses a model config whose max_batch_size is over the
// server's limit (0: none). The limit caps the batch dimension of every
// request, and with it what the batcher merges, what a load warms up and what
// the adjuster and profiler sweep over, which all grow with max_batch_size.
func checkBatchLimit(cfg *configs.Model, limit int) error {
	if limit > 0 && cfg.MaxBatchSize > limit {
		return fmt.Errorf("%s: max_batch_size: %d is over the server's limits.max_batch_size (%d)", cfg.File, cfg.MaxBatchSize, limit)
	}
	return nil
}

// checkVersionLimit refuses a version policy that selects more than
// configs.MaxVersions versions (version_policy all over many folders), or
// more runners than configs.MaxRunnersPerModel with the instances of each.
func checkVersionLimit(cfg *configs.Model, selected []int64) error {
	n := len(selected)
	if n > configs.MaxVersions {
		return fmt.Errorf("%s: version_policy: selects %d versions, at most %d may be served at once; use latest or specific", cfg.File, n, configs.MaxVersions)
	}
	if n*cfg.Instances > configs.MaxRunnersPerModel {
		return fmt.Errorf("%s: instances: %d instances of each of %d versions are %d runners, at most %d per model", cfg.File, cfg.Instances, n, n*cfg.Instances, configs.MaxRunnersPerModel)
	}
	return nil
}

// checkShapeLimit refuses a model config whose declared input shapes or
// profile shapes are over the server's limits.max_tensor_elements (0: none)
// at batch size 1, dynamic dimensions counted as 1: no request could be
// that large, and the warm-up and profiling requests built from them would
// take the server's memory (or overflow) before any runner saw them.
func checkShapeLimit(cfg *configs.Model, limit int64) error {
	if limit <= 0 {
		return nil
	}
	var errs []error
	check := func(field string, shape []int64, batched bool) {
		at1 := slices.Clone(shape)
		for d, n := range at1 {
			if n < 0 || (d == 0 && batched) {
				at1[d] = 1
			}
		}
		if _, err := runtime.ElementCount(at1, limit); err != nil {
			errs = append(errs, fmt.Errorf("%s: %s: %v has more than limits.max_tensor_elements (%d) elements at batch size 1", cfg.File, field, shape, limit))
		}
	}
	for i, in := range cfg.Inputs {
		check(fmt.Sprintf("inputs[%d].shape", i), in.Shape, cfg.MaxBatchSize > 0)
	}
	for i, set := range cfg.Profile.Shapes {
		prefix := "profile.shapes."
		if len(cfg.Profile.Shapes) > 1 {
			prefix = fmt.Sprintf("profile.shapes[%d].", i)
		}
		for _, name := range slices.Sorted(maps.Keys(set)) {
			check(prefix+name, set[name], cfg.MaxBatchSize > 0)
		}
	}
	return errors.Join(errs...)
}

// checkDeclared compares the inputs or outputs a config declares with what
// the model file has. Declared dimensions must equal the file's, except that
// a config may fix a dimension the file leaves dynamic.
func checkDeclared(kind string, declared, actual []runtime.TensorSpec) ([]runtime.TensorSpec, error) {
	if len(declared) == 0 {
		return actual, nil
	}
	if len(declared) != len(actual) {
		return nil, fmt.Errorf("config declares %d %ss, the model file has %d", len(declared), kind, len(actual))
	}
	out := make([]runtime.TensorSpec, len(declared))
	for i, d := range declared {
		idx := slices.IndexFunc(actual, func(a runtime.TensorSpec) bool { return a.Name == d.Name })
		if idx < 0 {
			return nil, fmt.Errorf("config declares %s %q, the model file has no such %s", kind, d.Name, kind)
		}
		a := actual[idx]
		if d.DataType != a.DataType {
			return nil, fmt.Errorf("%s %q: config says datatype %s, the model file has %s", kind, d.Name, d.DataType, a.DataType)
		}
		if len(d.Shape) != len(a.Shape) {
			return nil, fmt.Errorf("%s %q: config says shape %v, the model file has %v", kind, d.Name, d.Shape, a.Shape)
		}
		for k := range d.Shape {
			if a.Shape[k] >= 0 && d.Shape[k] != a.Shape[k] {
				return nil, fmt.Errorf("%s %q: config says shape %v, the model file has %v", kind, d.Name, d.Shape, a.Shape)
			}
		}
		out[i] = d
	}
	return out, nil
}
