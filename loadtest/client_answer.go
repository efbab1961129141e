package loadtest

// A gRPC answer as the load generator reads it: skimmed, not decoded.
//
// The generator checks an answer's names and shape (checkGRPCAnswer) and
// never looks at its tensors' values. Decoding a ModelInferResponse with
// protobuf copies every output into memory of its own, a megabyte a call
// for the colocation day's recogniser: on two cores shared with the server
// that garbage made the generator's collector hold answers, its calls
// assisting the collector or waiting for its mark to finish, 15-80 ms
// after the server had written them (a Go execution trace of both
// processes, BENCHMARKS.md), and counted that as the server's latency. A
// clientAnswer keeps the fields it checks and the lengths of the outputs,
// read from the message in place (a buffer of gRPC's pool), as the REST
// client skims its answers (clientSkim).

import (
	"errors"
	"fmt"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
)

// clientAnswer is what the generator reads of a ModelInferResponse.
type clientAnswer struct {
	id, modelName, modelVersion string
	outputs                     []clientAnswerOutput
	raw                         []int // raw_output_contents: each entry's length
}

// clientAnswerOutput is one of its outputs.
type clientAnswerOutput struct {
	name        string
	hasContents bool // the contents field was there (values sent in the message)
}

// ModelInferResponse's fields (grpc_service.proto) the generator reads.
const (
	answerModelName    protowire.Number = 1
	answerModelVersion protowire.Number = 2
	answerID           protowire.Number = 3
	answerOutputs      protowire.Number = 5
	answerRawContents  protowire.Number = 6

	answerOutputName     protowire.Number = 1
	answerOutputContents protowire.Number = 5
)

var errAnswerWire = errors.New("not a ModelInferResponse")

// unmarshal reads a serialized ModelInferResponse into a, which is reset.
// Fields it does not check are skipped, but the whole message must be
// well formed.
func (a *clientAnswer) unmarshal(data mem.BufferSlice) error {
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	*a = clientAnswer{}
	return a.read(buf.ReadOnlyData())
}

func (a *clientAnswer) read(b []byte) error {
	for len(b) > 0 {
		num, v, isBytes, n, err := consumeField(b)
		if err != nil {
			return err
		}
		b = b[n:]
		if !isBytes {
			continue
		}
		switch num {
		case answerModelName:
			a.modelName = string(v)
		case answerModelVersion:
			a.modelVersion = string(v)
		case answerID:
			a.id = string(v)
		case answerOutputs:
			o, err := readAnswerOutput(v)
			if err != nil {
				return fmt.Errorf("an output: %w", err)
			}
			a.outputs = append(a.outputs, o)
		case answerRawContents:
			a.raw = append(a.raw, len(v))
		}
	}
	return nil
}

// consumeField reads the field at the start of b: its number, its value
// when it is length-delimited (isBytes), and its length in b.
func consumeField(b []byte) (num protowire.Number, v []byte, isBytes bool, n int, err error) {
	num, typ, tn := protowire.ConsumeTag(b)
	if tn < 0 {
		return 0, nil, false, 0, fmt.Errorf("%w: %v", errAnswerWire, protowire.ParseError(tn))
	}
	var vn int
	if typ == protowire.BytesType {
		v, vn = protowire.ConsumeBytes(b[tn:])
	} else {
		vn = protowire.ConsumeFieldValue(num, typ, b[tn:])
	}
	if vn < 0 {
		return 0, nil, false, 0, fmt.Errorf("%w: field %d: %v", errAnswerWire, num, protowire.ParseError(vn))
	}
	return num, v, typ == protowire.BytesType, tn + vn, nil
}

// readAnswerOutput reads an InferOutputTensor's name and whether it has
// contents.
func readAnswerOutput(b []byte) (clientAnswerOutput, error) {
	var o clientAnswerOutput
	for len(b) > 0 {
		num, v, isBytes, n, err := consumeField(b)
		if err != nil {
			return o, err
		}
		b = b[n:]
		switch {
		case num == answerOutputName && isBytes:
			o.name = string(v)
		case num == answerOutputContents && isBytes:
			o.hasContents = true
		}
	}
	return o, nil
}
