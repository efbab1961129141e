package models

import (
	"slices"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/runtime"
)

// A reshaped tensor (configs.TensorConfig.Reshape) crosses the version in
// two shapes: the client's (Shape), which the metadata shows and requests
// are validated against, and the model file's (Reshape), which the
// instances take and give. The data is the same bytes in the same order:
// only the shape changes, and the batch dimension is carried over.

// toModelShapes gives a validated request's reshaped inputs the model
// file's shapes.
func (v *version) toModelShapes(req *runtime.InferRequest) {
	for i := range req.Inputs {
		t := &req.Inputs[i]
		if tc := reshaped(v.cfg.Inputs, t.Name); tc != nil {
			t.Shape = v.withBatch(t.Shape, tc.Reshape)
		}
	}
}

// toWireShapes gives a response's reshaped outputs the shapes clients see.
func (v *version) toWireShapes(resp *runtime.InferResponse) {
	if resp == nil {
		return
	}
	for i := range resp.Outputs {
		t := &resp.Outputs[i]
		if tc := reshaped(v.cfg.Outputs, t.Name); tc != nil {
			t.Shape = v.withBatch(t.Shape, tc.Shape)
		}
	}
}

// reshaped is the config of tensor name when it is reshaped, else nil.
func reshaped(ts []configs.TensorConfig, name string) *configs.TensorConfig {
	for i := range ts {
		if ts[i].Name == name && ts[i].Reshape != nil {
			return &ts[i]
		}
	}
	return nil
}

// withBatch is shape "to" with the batch dimension of "from" when the
// model batches ("to" is fixed but for it).
func (v *version) withBatch(from, to []int64) []int64 {
	out := slices.Clone(to)
	if out == nil {
		out = []int64{}
	}
	if v.maxBatch > 0 && len(from) > 0 && len(out) > 0 {
		out[0] = from[0]
	}
	return out
}
