package models

import (
	"fmt"
	"testing"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/runtime"
)

// A model profiled at several shapes gets a request builder per shape and
// each shape's row size; without profile.shapes, dynamic dimensions take
// DefaultProfileDims; a model without dynamic dimensions has one shape.
func TestProfileRequestsPerShape(t *testing.T) {
	det := []runtime.TensorSpec{{Name: "x", DataType: runtime.FP32, Shape: []int64{-1, 3, -1, -1}}}
	listed := &version{maxBatch: 4, inputs: det, cfg: &configs.Model{Profile: configs.ModelProfile{
		Shapes: configs.ProfileShapes{{"x": {1, 3, 32, 32}}, {"x": {1, 3, 64, 128}}}}}}
	samples, elements, sizes := profileRequests(listed)
	if len(samples) != 2 || fmt.Sprint(elements) != "[3072 24576]" || fmt.Sprint(sizes) != "[1 2 4]" {
		t.Fatalf("listed shapes: %d builders, elements %v, sizes %v", len(samples), elements, sizes)
	}
	if got := fmt.Sprint(samples[1](4).Inputs[0].Shape); got != "[4 3 64 128]" {
		t.Errorf("second shape at batch 4: %s", got)
	}
	unlisted := &version{maxBatch: 4, inputs: det, cfg: &configs.Model{}}
	samples, elements, _ = profileRequests(unlisted)
	if len(samples) != 2 || fmt.Sprint(elements) != fmt.Sprint([]int64{3 * 64 * 64, 3 * 256 * 256}) {
		t.Fatalf("default shapes: %d builders, elements %v", len(samples), elements)
	}
	if got := fmt.Sprint(samples[0](2).Inputs[0].Shape); got != "[2 3 64 64]" {
		t.Errorf("first default shape at batch 2: %s", got)
	}
	static := &version{maxBatch: 0, cfg: &configs.Model{},
		inputs: []runtime.TensorSpec{{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 3, 8, 8}}}}
	samples, elements, sizes = profileRequests(static)
	if len(samples) != 1 || fmt.Sprint(elements) != "[192]" || fmt.Sprint(sizes) != "[1]" {
		t.Errorf("static shapes: %d builders, elements %v, sizes %v", len(samples), elements, sizes)
	}
	// A shape over the element limit at batch 1 is left out, the others
	// profiled.
	limited := &version{maxBatch: 4, inputs: det, maxElements: 3 * 64 * 64 * 4, cfg: &configs.Model{}}
	if samples, elements, sizes = profileRequests(limited); len(samples) != 1 || fmt.Sprint(sizes) != "[1 2 4]" || elements[0] != 3*64*64 {
		t.Errorf("limited: %d builders, elements %v, sizes %v", len(samples), elements, sizes)
	}
}
