package configs

import (
	"fmt"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/sloserve/sloserve/configs/tritonpb"
	"github.com/sloserve/sloserve/runtime"
)

// TritonDefaultMaxBatchSize is the max_batch_size a completed config gets
// for a model that can batch, Triton's default-max-batch-size.
const TritonDefaultMaxBatchSize = 4

// completeFromModel fills what a Triton config leaves out from the model
// file, as Triton's ONNX Runtime backend completes a config (its default
// auto-complete): the inputs and outputs with their datatypes and dims
// when the config lists none, and max_batch_size when the config gives
// neither it nor any tensor. A model batches when the first dimension of
// every input and output is dynamic; it then gets
// TritonDefaultMaxBatchSize and dynamic batching. A config that lists its
// tensors says through their dims whether the batch dimension is there,
// so its max_batch_size is taken as written.
//
// The model file read is the latest version the policy selects; without
// one, or when it does not parse, nothing is completed (the load then
// fails on the missing version or the file).
func (t *tritonReader) completeFromModel(tc *tritonpb.ModelConfig, m *Model, dir string) {
	needIn, needOut := len(tc.GetInput()) == 0, len(tc.GetOutput()) == 0
	if !needIn && !needOut {
		return
	}
	available, err := ListVersions(dir)
	if err != nil {
		return // the load reports the folder
	}
	selected := m.SelectVersions(available)
	if len(selected) == 0 {
		return
	}
	file := filepath.Join(dir, strconv.FormatInt(selected[len(selected)-1], 10), ModelFile)
	ins, outs, err := runtime.ReadSignature(file)
	if err != nil {
		// Left as written: the load reports the model file as ONNX
		// Runtime sees it.
		return
	}
	// The model batches when no tensor's first dimension is fixed.
	fixed := slices.IndexFunc(slices.Concat(ins, outs), func(s runtime.TensorSpec) bool { return len(s.Shape) == 0 || s.Shape[0] >= 0 })
	if needIn && needOut && tc.GetMaxBatchSize() == 0 && fixed < 0 {
		m.MaxBatchSize = TritonDefaultMaxBatchSize
	}
	if m.MaxBatchSize > 0 && fixed >= 0 {
		s := slices.Concat(ins, outs)[fixed]
		t.fail("max_batch_size", "is %d, but %q in %s has no dynamic first dimension (shape %v), so the model cannot batch", m.MaxBatchSize, s.Name, file, s.Shape)
		return
	}
	conv := func(specs []runtime.TensorSpec) []TensorConfig {
		out := make([]TensorConfig, len(specs))
		for i, s := range specs {
			out[i] = TensorConfig{Name: s.Name, DataType: string(s.DataType), Shape: slices.Clone(s.Shape)}
			if m.MaxBatchSize > 0 {
				out[i].Shape[0] = -1
			}
		}
		return out
	}
	if needIn {
		m.Inputs = conv(ins)
	}
	if needOut {
		m.Outputs = conv(outs)
	}
}

// noConfigFile is how messages name the config of a model folder that
// has no config file.
func noConfigFile(dir string) string {
	return fmt.Sprintf("%s (no config file; completed from the model)", dir)
}
