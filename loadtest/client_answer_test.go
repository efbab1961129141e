package loadtest

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api/inference"
)

// A skimmed answer holds what protobuf's decoding of the same message
// would give the checks: names, version, id, each output's name and
// whether it has contents, the raw contents' lengths; fields it does not
// read are skipped; a malformed message is an error, not a partial answer.
func TestClientAnswerSkimsWhatProtobufDecodes(t *testing.T) {
	raw := make([]byte, 1<<20)
	msgs := map[string]*inference.ModelInferResponse{
		"raw outputs": {
			ModelName: "ocr-rec", ModelVersion: "1", Id: "17",
			Parameters: map[string]*inference.InferParameter{"sequence_id": {ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: 9}}},
			Outputs: []*inference.ModelInferResponse_InferOutputTensor{
				{Name: "logits", Datatype: "FP32", Shape: []int64{1, 40, 6625}},
				{Name: "lengths", Datatype: "INT64", Shape: []int64{1}},
			},
			RawOutputContents: [][]byte{raw, {1, 0, 0, 0, 0, 0, 0, 0}},
		},
		"contents": {
			ModelName: "m",
			Outputs: []*inference.ModelInferResponse_InferOutputTensor{
				{Name: "a", Datatype: "FP32", Shape: []int64{2}, Contents: &inference.InferTensorContents{Fp32Contents: []float32{1, 2}}},
				{Name: "b", Datatype: "FP32", Shape: []int64{0}},
			},
		},
		"empty": {},
	}
	for name, m := range msgs {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		var a clientAnswer
		a.raw = []int{99} // a reused answer is reset
		if err := (clientCodec{}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, &a); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var want clientAnswer
		want.id, want.modelName, want.modelVersion = m.GetId(), m.GetModelName(), m.GetModelVersion()
		for _, o := range m.GetOutputs() {
			want.outputs = append(want.outputs, clientAnswerOutput{name: o.GetName(), hasContents: o.GetContents() != nil})
		}
		for _, r := range m.GetRawOutputContents() {
			want.raw = append(want.raw, len(r))
		}
		if a.id != want.id || a.modelName != want.modelName || a.modelVersion != want.modelVersion ||
			!slices.Equal(a.outputs, want.outputs) || !slices.Equal(a.raw, want.raw) {
			t.Errorf("%s: skimmed %+v, want %+v", name, a, want)
		}
		// Cut anywhere inside a field, the message is refused.
		for _, cut := range []int{1, len(b) / 2, len(b) - 1} {
			if cut <= 0 || cut >= len(b) {
				continue
			}
			if err := (&clientAnswer{}).read(b[:cut]); !errors.Is(err, errAnswerWire) {
				t.Errorf("%s cut at %d of %d bytes: %v, want errAnswerWire", name, cut, len(b), err)
			}
		}
	}
}

// Reading a megabyte answer allocates a few small strings, not the
// megabyte: the generator's collector is not fed by the answers it checks.
func TestClientAnswerDoesNotCopyTheOutputs(t *testing.T) {
	m := &inference.ModelInferResponse{
		ModelName: "ocr-rec", ModelVersion: "1", Id: "17",
		Outputs:           []*inference.ModelInferResponse_InferOutputTensor{{Name: "logits", Datatype: "FP32", Shape: []int64{1, 40, 6625}}},
		RawOutputContents: [][]byte{make([]byte, 1<<20)},
	}
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	// As gRPC hands it over: in pieces of its reads.
	var data mem.BufferSlice
	for off := 0; off < len(b); off += 16 << 10 {
		data = append(data, mem.SliceBuffer(b[off:min(off+16<<10, len(b))]))
	}
	var a clientAnswer
	read := func() {
		if err := (clientCodec{}).Unmarshal(data, &a); err != nil {
			t.Fatal(err)
		}
	}
	read() // the pool's first buffer of this size
	// Under the race detector, sync.Pool drops a quarter of what is put
	// back (and the detector allocates beside the code): there a read may
	// take a fresh buffer, a quarter of the time on average, and the bound
	// is half the answer (a copy of every answer is over it), over enough
	// reads that the pool's drops cannot pass it by chance.
	n, bound := uint64(20), uint64(64<<10)
	if raceEnabled {
		n, bound = 200, uint64(len(b)/2)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range n {
		read()
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / n; per > bound {
		t.Errorf("reading a %d-byte answer allocated %d bytes a time, want at most %d", len(b), per, bound)
	}
	if fmt.Sprint(a.raw) != fmt.Sprint([]int{1 << 20}) {
		t.Errorf("raw lengths %v", a.raw)
	}
}
