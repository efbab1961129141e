package qos

import (
	"encoding/binary"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

// requestBatch is the batch size of a request to a model that batches: the
// first dimension, which every input must share.
func requestBatch(req *runtime.InferRequest) (int, error) {
	if len(req.Inputs) == 0 {
		return 0, fmt.Errorf("%w: no inputs", ErrInvalidRequest)
	}
	batch := int64(-1)
	for _, in := range req.Inputs {
		if len(in.Shape) == 0 {
			return 0, fmt.Errorf("%w: input %q has no batch dimension", ErrInvalidRequest, in.Name)
		}
		switch {
		case in.Shape[0] < 1:
			return 0, fmt.Errorf("%w: input %q has batch dimension %d", ErrInvalidRequest, in.Name, in.Shape[0])
		case batch < 0:
			batch = in.Shape[0]
		case in.Shape[0] != batch:
			return 0, fmt.Errorf("%w: input %q has batch dimension %d, input %q has %d",
				ErrInvalidRequest, in.Name, in.Shape[0], req.Inputs[0].Name, batch)
		}
	}
	return int(batch), nil
}

// mergeKey describes what must match for two requests to share an execution:
// input names, data types and non-batch dimensions, and the set of requested
// outputs. Requests with equal keys can be merged.
func mergeKey(req *runtime.InferRequest) string {
	ins := req.Inputs
	if !slices.IsSortedFunc(ins, byTensorName) {
		ins = slices.Clone(ins)
		slices.SortFunc(ins, byTensorName)
	}
	outs := req.Outputs
	if !sortedUnique(outs) {
		outs = slices.Clone(outs)
		slices.Sort(outs)
		outs = slices.Compact(outs)
	}
	// Built on the stack; the key itself is the one allocation.
	var buf [256]byte
	b := buf[:0]
	for _, in := range ins {
		b = strconv.AppendQuote(b, in.Name)
		b = append(b, ':')
		b = append(b, in.DataType...)
		for i, d := range in.Shape {
			if i == 0 {
				continue // the batch dimension may differ
			}
			b = append(b, ',')
			b = strconv.AppendInt(b, d, 10)
		}
		b = append(b, ';')
	}
	b = append(b, "->"...)
	for _, o := range outs {
		b = strconv.AppendQuote(b, o)
		b = append(b, ',')
	}
	return string(b)
}

func byTensorName(a, b runtime.Tensor) int { return strings.Compare(a.Name, b.Name) }

// sortedUnique reports whether names are in strictly increasing order.
func sortedUnique(names []string) bool {
	for i := 1; i < len(names); i++ {
		if names[i-1] >= names[i] {
			return false
		}
	}
	return true
}

// latestDeadline is the deadline a merged batch carries: the latest of its
// requests', or none when one of them has none.
func latestDeadline(reqs []*runtime.InferRequest) time.Time {
	var latest time.Time
	for _, r := range reqs {
		if r.Deadline.IsZero() {
			return time.Time{}
		}
		if r.Deadline.After(latest) {
			latest = r.Deadline
		}
	}
	return latest
}

// mergeRequests concatenates requests along the batch dimension into one
// request. sizes are the requests' batch sizes, as splitResponse needs them.
// The requests must have equal merge keys; it fails otherwise.
//
// An input in a client's shared-memory mapping (runtime.Tensor.Mapped) is
// copied under runtime.CopyMapped: when it faults (the client truncated its
// object), faults[j] holds request j's error and its rows are left zero, so
// that the batch still runs for the others. faults is nil when none did.
func mergeRequests(reqs []*runtime.InferRequest) (merged *runtime.InferRequest, sizes []int, faults []error, err error) {
	sizes = make([]int, len(reqs))
	for i, r := range reqs {
		b, err := requestBatch(r)
		if err != nil {
			return nil, nil, nil, err
		}
		sizes[i] = b
	}
	if len(reqs) == 1 {
		return reqs[0], sizes, nil, nil
	}
	key := mergeKey(reqs[0])
	for i, r := range reqs[1:] {
		if k := mergeKey(r); k != key || len(r.Inputs) != len(reqs[0].Inputs) {
			return nil, nil, nil, fmt.Errorf("request %d cannot be merged with request 0: inputs or outputs differ", i+1)
		}
	}
	total := int64(0)
	for _, b := range sizes {
		total += int64(b)
	}
	first := reqs[0]
	merged = &runtime.InferRequest{
		Inputs:   make([]runtime.Tensor, len(first.Inputs)),
		Outputs:  slices.Clone(first.Outputs),
		Deadline: latestDeadline(reqs),
	}
	for i, in := range first.Inputs {
		n := 0
		parts := make([]*runtime.Tensor, len(reqs))
		for j, r := range reqs {
			t := inputNamed(r, in.Name)
			if t == nil {
				return nil, nil, nil, fmt.Errorf("request %d has no input %q", j, in.Name)
			}
			parts[j] = t
			n += len(t.Data)
		}
		data := make([]byte, n)
		at := 0
		for j, p := range parts {
			dst := data[at : at+len(p.Data)]
			at += len(p.Data)
			if !p.Mapped {
				copy(dst, p.Data)
				continue
			}
			if _, err := runtime.CopyMapped(dst, p.Data); err != nil {
				clear(dst)
				if faults == nil {
					faults = make([]error, len(reqs))
				}
				faults[j] = fmt.Errorf("input %q: %w", in.Name, err)
			}
		}
		shape := slices.Clone(in.Shape)
		shape[0] = total
		merged.Inputs[i] = runtime.Tensor{Name: in.Name, DataType: in.DataType, Shape: shape, Data: data}
	}
	return merged, sizes, faults, nil
}

func inputNamed(req *runtime.InferRequest, name string) *runtime.Tensor {
	for i := range req.Inputs {
		if req.Inputs[i].Name == name {
			return &req.Inputs[i]
		}
	}
	return nil
}

// splitResponse cuts the response of a merged request into one response per
// request, along the batch dimension; sizes are the requests' batch sizes.
// Every output's first dimension must equal their sum. The parts share the
// response's buffers.
func splitResponse(resp *runtime.InferResponse, sizes []int) ([]*runtime.InferResponse, error) {
	parts := make([]*runtime.InferResponse, len(sizes))
	if len(sizes) == 1 {
		parts[0] = resp
		return parts, nil
	}
	total := int64(0)
	for _, b := range sizes {
		total += int64(b)
	}
	for i := range parts {
		parts[i] = &runtime.InferResponse{Outputs: make([]runtime.Tensor, len(resp.Outputs)), Timing: resp.Timing}
	}
	for o, out := range resp.Outputs {
		if len(out.Shape) == 0 || out.Shape[0] != total {
			return nil, fmt.Errorf("output %q has shape %v; a merged batch of %d needs that first dimension", out.Name, out.Shape, total)
		}
		bounds, err := rowBounds(out, sizes)
		if err != nil {
			return nil, fmt.Errorf("output %q: %w", out.Name, err)
		}
		for i, b := range sizes {
			shape := slices.Clone(out.Shape)
			shape[0] = int64(b)
			lo, hi := bounds[i], bounds[i+1]
			parts[i].Outputs[o] = runtime.Tensor{Name: out.Name, DataType: out.DataType, Shape: shape, Data: out.Data[lo:hi:hi]}
		}
	}
	return parts, nil
}

// rowBounds returns the byte offsets at which each part of t begins, plus
// the end: part i is Data[bounds[i]:bounds[i+1]].
func rowBounds(t runtime.Tensor, sizes []int) ([]int, error) {
	perRow, err := runtime.ElementCount(t.Shape[1:], 0)
	if err != nil {
		return nil, err
	}
	bounds := make([]int, len(sizes)+1)
	if t.DataType != runtime.Bytes {
		size := t.DataType.Size()
		if size == 0 {
			return nil, fmt.Errorf("unknown data type %q", t.DataType)
		}
		rowBytes := perRow * int64(size)
		if int64(len(t.Data)) != rowBytes*t.Shape[0] {
			return nil, fmt.Errorf("%d data bytes, shape %v of %s needs %d", len(t.Data), t.Shape, t.DataType, rowBytes*t.Shape[0])
		}
		for i, b := range sizes {
			bounds[i+1] = bounds[i] + int(rowBytes)*b
		}
		return bounds, nil
	}
	// BYTES: walk the length prefixes, perRow elements per row.
	off := 0
	for i, b := range sizes {
		for range int64(b) * perRow {
			if len(t.Data)-off < 4 {
				return nil, fmt.Errorf("BYTES element truncated in its length prefix at byte %d", off)
			}
			l := int(binary.LittleEndian.Uint32(t.Data[off:]))
			off += 4
			if l > len(t.Data)-off {
				return nil, fmt.Errorf("BYTES element at byte %d declares %d bytes, %d remain", off-4, l, len(t.Data)-off)
			}
			off += l
		}
		bounds[i+1] = off
	}
	if off != len(t.Data) {
		return nil, fmt.Errorf("%d bytes left after the %d BYTES elements the shape %v holds", len(t.Data)-off, perRow*t.Shape[0], t.Shape)
	}
	return bounds, nil
}
