package runtime

import (
	"math/rand/v2"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// answerSamples are answers as a runner writes them, and wire forms only
// another encoder would write.
func answerSamples(t *testing.T) map[string][]byte {
	t.Helper()
	enc := func(m *runnerpb.InferResponse) []byte {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	out := map[string][]byte{
		"empty": nil,
		"one output in the arena": enc(&runnerpb.InferResponse{Id: 7, InputNs: 1, InferNs: 22, OutputNs: 333, Outputs: []*runnerpb.Tensor{
			{Name: "output_scalars", Datatype: "FP32", Shape: []int64{1}, Arena: &runnerpb.ArenaSlice{Offset: 4096, Length: 4}}}}),
		"one output inline, five dimensions": enc(&runnerpb.InferResponse{Id: 1 << 40, Outputs: []*runnerpb.Tensor{
			{Name: "y", Datatype: "INT64", Shape: []int64{1, 2, 3, 4, 5}, Data: make([]byte, 960)}}}),
		"three outputs": enc(&runnerpb.InferResponse{Id: 3, Outputs: []*runnerpb.Tensor{
			{Name: "a", Datatype: "BYTES", Shape: []int64{2}, Data: []byte{1, 0, 0, 0, 'x', 0, 0, 0, 0}},
			{Name: "b", Datatype: "BOOL", Shape: []int64{}},
			{Name: "c", Datatype: "NOT A TYPE", Shape: []int64{-1, 0}, Arena: &runnerpb.ArenaSlice{}}}}),
		"a failure":               enc(&runnerpb.InferResponse{Id: 9, Code: 3, Message: "input x: shape [1 2] does not match [1 10]"}),
		"negative code and times": enc(&runnerpb.InferResponse{Code: -1, InputNs: -5}),
	}
	// By hand: a shape unpacked, unknown fields of every wire type, fields
	// of a known number and another wire type, a scalar given twice, an
	// arena descriptor given twice (they merge).
	var tensor []byte
	tensor = protowire.AppendTag(tensor, tensorName, protowire.BytesType)
	tensor = protowire.AppendString(tensor, "z")
	tensor = protowire.AppendTag(tensor, tensorShape, protowire.VarintType)
	tensor = protowire.AppendVarint(tensor, 2)
	tensor = protowire.AppendTag(tensor, tensorShape, protowire.VarintType)
	tensor = protowire.AppendVarint(tensor, 3)
	tensor = protowire.AppendTag(tensor, tensorDatatype, protowire.Fixed32Type) // not its type: unknown
	tensor = protowire.AppendFixed32(tensor, 1)
	tensor = protowire.AppendTag(tensor, tensorDatatype, protowire.BytesType)
	tensor = protowire.AppendString(tensor, "UINT8")
	var arena1, arena2 []byte
	arena1 = protowire.AppendTag(arena1, sliceOffset, protowire.VarintType)
	arena1 = protowire.AppendVarint(arena1, 64)
	arena2 = protowire.AppendTag(arena2, sliceLength, protowire.VarintType)
	arena2 = protowire.AppendVarint(arena2, 6)
	arena2 = protowire.AppendTag(arena2, 9, protowire.Fixed64Type)
	arena2 = protowire.AppendFixed64(arena2, 1)
	tensor = protowire.AppendTag(tensor, tensorArena, protowire.BytesType)
	tensor = protowire.AppendBytes(tensor, arena1)
	tensor = protowire.AppendTag(tensor, tensorArena, protowire.BytesType)
	tensor = protowire.AppendBytes(tensor, arena2)
	tensor = protowire.AppendTag(tensor, 15, protowire.StartGroupType)
	tensor = protowire.AppendTag(tensor, 1, protowire.VarintType)
	tensor = protowire.AppendVarint(tensor, 1)
	tensor = protowire.AppendTag(tensor, 15, protowire.EndGroupType)
	var resp []byte
	resp = protowire.AppendTag(resp, respID, protowire.VarintType)
	resp = protowire.AppendVarint(resp, 1)
	resp = protowire.AppendTag(resp, respOutputs, protowire.BytesType)
	resp = protowire.AppendBytes(resp, tensor)
	resp = protowire.AppendTag(resp, respID, protowire.VarintType)
	resp = protowire.AppendVarint(resp, 2)
	resp = protowire.AppendTag(resp, respCode, protowire.BytesType) // not its type: unknown
	resp = protowire.AppendString(resp, "x")
	resp = protowire.AppendTag(resp, 100, protowire.BytesType)
	resp = protowire.AppendString(resp, "unknown")
	out["by hand"] = resp
	return out
}

// dropUnknown clears the unknown fields proto.Unmarshal keeps and
// decodeAnswer skips.
func dropUnknown(m *runnerpb.InferResponse) {
	m.ProtoReflect().SetUnknown(nil)
	for _, t := range m.GetOutputs() {
		t.ProtoReflect().SetUnknown(nil)
		if t.Arena != nil {
			t.Arena.ProtoReflect().SetUnknown(nil)
		}
	}
}

// decodeBoth decodes b with proto.Unmarshal and decodeAnswer and reports
// where they disagree.
func decodeBoth(t *testing.T, name string, b []byte, names *nameCache) {
	t.Helper()
	want := &runnerpb.InferResponse{}
	wantErr := proto.Unmarshal(b, want)
	got, err := decodeAnswer(b, names)
	switch {
	case (err != nil) != (wantErr != nil):
		t.Errorf("%s (% x): decodeAnswer error %v, proto.Unmarshal %v", name, b, err, wantErr)
	case err == nil:
		dropUnknown(want)
		if !proto.Equal(got, want) {
			t.Errorf("%s: decodeAnswer\n%v\nproto.Unmarshal\n%v", name, got, want)
		}
	}
}

// decodeAnswer reads every answer as proto.Unmarshal does, and fails
// where it fails: every cut of the samples, samples with a byte changed,
// a name that is not UTF-8.
func TestDecodeAnswerMatchesProto(t *testing.T) {
	var names nameCache
	samples := answerSamples(t)
	for name, b := range samples {
		decodeBoth(t, name, b, &names)
		decodeBoth(t, name+" again (names cached)", b, &names)
		for n := range len(b) {
			decodeBoth(t, name+" cut", b[:n], &names)
		}
	}
	bad, _ := proto.Marshal(&runnerpb.InferResponse{Outputs: []*runnerpb.Tensor{{Name: "ok"}}})
	bad[len(bad)-1] = 0xff // the name's last byte
	if _, err := decodeAnswer(bad, &names); err == nil {
		t.Error("a name that is not UTF-8 decoded")
	}
	rng := rand.New(rand.NewPCG(3, 3))
	for name, b := range samples {
		for range 300 {
			if len(b) == 0 {
				break
			}
			m := append([]byte(nil), b...)
			m[rng.IntN(len(m))] = byte(rng.IntN(256))
			decodeBoth(t, name+" changed", m, &names)
		}
	}
}

// Sinks keep what the allocation tests build on the heap, where a
// caller's would be.
var (
	sinkAnswer   *runnerpb.InferResponse
	sinkResponse *InferResponse
)

// The usual answer (one output, in the arena) is read out of its slot in
// one allocation, and turned into the server's response in one more;
// proto.Unmarshal took seven, the response two.
func TestAnswerDecodeAllocations(t *testing.T) {
	ar, err := newArena("test", 4096, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer ar.close()
	m := ar.box
	b := answerSamples(t)["one output in the arena"]
	copy(m.respArea(1), b)
	*m.respLen(1) = uint32(len(b))
	resp, err := m.answer(1, 7)
	if err != nil || resp.GetOutputs()[0].GetArena().GetLength() != 4 || resp.GetInferNs() != 22 {
		t.Fatalf("answer = %v, %v", resp, err)
	}
	if n := testing.AllocsPerRun(100, func() {
		if sinkAnswer, err = m.answer(1, 7); err != nil {
			t.Fatal(err)
		}
	}); n > 1 {
		t.Errorf("reading the answer from its slot allocates %v times, want 1", n)
	}
	if n := testing.AllocsPerRun(100, func() {
		if sinkResponse, err = responseFromProto(resp); err != nil {
			t.Fatal(err)
		}
	}); n > 1 {
		t.Errorf("responseFromProto of one output allocates %v times, want 1", n)
	}
	out, err := responseFromProto(resp)
	if err != nil || len(out.Outputs) != 1 || out.Outputs[0].Name != "output_scalars" || out.Outputs[0].DataType != FP32 || out.Timing.Output != 333 {
		t.Errorf("response %+v, %v", out, err)
	}
}
