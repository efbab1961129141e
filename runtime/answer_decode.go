package runtime

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// This file reads a runner's answer (a runnerpb.InferResponse) from its
// mailbox slot with fewer allocations than proto.Unmarshal: the usual
// answer, one output of a short shape, is one allocation (the message, its
// output, the output's descriptor and shape together), its output's name
// and datatype are strings the server already holds, and only inline data
// and an error's message are copied out on their own. It reads what
// proto.Unmarshal reads (unknown fields skipped, repeated int64 packed or
// not, the last of a scalar field seen twice winning, a field of another
// wire type than its own skipped as unknown) and refuses what it refuses,
// strings that are not UTF-8 among them.

// errAnswerFrame is an answer that is not a well-formed InferResponse.
var errAnswerFrame = errors.New("malformed answer")

// Field numbers of runnerpb.InferResponse, Tensor and ArenaSlice.
const (
	respOutputs  = 1
	respInputNs  = 2
	respInferNs  = 3
	respOutputNs = 4
	respID       = 5
	respCode     = 6
	respMessage  = 7

	tensorName     = 1
	tensorDatatype = 2
	tensorShape    = 3
	tensorData     = 4
	tensorArena    = 5

	sliceOffset = 1
	sliceLength = 2
)

// oneOutputAnswer is an answer of one output, allocated at once.
type oneOutputAnswer struct {
	resp   runnerpb.InferResponse
	ptr    [1]*runnerpb.Tensor
	tensor runnerpb.Tensor
	arena  runnerpb.ArenaSlice
	shape  [4]int64
}

// decodeAnswer decodes an InferResponse from b, which it does not keep.
// names interns the outputs' names (nil: each is copied).
func decodeAnswer(b []byte, names *nameCache) (*runnerpb.InferResponse, error) {
	outputs := 0
	if err := forEachField(b, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		if num == respOutputs && typ == protowire.BytesType {
			outputs++
		}
		return nil
	}); err != nil {
		return nil, err
	}
	var (
		resp    *runnerpb.InferResponse
		tensors []runnerpb.Tensor
		spare   *oneOutputAnswer // room for the one output's descriptor and shape
	)
	if outputs == 1 {
		one := new(oneOutputAnswer)
		resp, spare = &one.resp, one
		one.ptr[0] = &one.tensor
		resp.Outputs = one.ptr[:]
	} else {
		resp = &runnerpb.InferResponse{}
		if outputs > 0 {
			resp.Outputs = make([]*runnerpb.Tensor, outputs)
			tensors = make([]runnerpb.Tensor, outputs)
			for k := range tensors {
				resp.Outputs[k] = &tensors[k]
			}
		}
	}
	k := 0
	err := forEachField(b, func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error {
		// A field of a known number but another wire type is an unknown
		// field to proto.Unmarshal: skipped here too.
		switch {
		case typ == protowire.BytesType && num == respOutputs:
			t := resp.Outputs[k]
			k++
			return decodeTensor(v, t, spare, names)
		case typ == protowire.BytesType && num == respMessage:
			if !utf8.Valid(v) {
				return fmt.Errorf("%w: message not UTF-8", errAnswerFrame)
			}
			resp.Message = string(v)
		case typ != protowire.VarintType:
		case num == respInputNs:
			resp.InputNs = int64(x)
		case num == respInferNs:
			resp.InferNs = int64(x)
		case num == respOutputNs:
			resp.OutputNs = int64(x)
		case num == respID:
			resp.Id = x
		case num == respCode:
			resp.Code = int32(x)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return resp, nil
}

// decodeTensor decodes a Tensor from b into t; spare, when not nil, has
// room for its arena descriptor and a shape of up to 4 dimensions.
func decodeTensor(b []byte, t *runnerpb.Tensor, spare *oneOutputAnswer, names *nameCache) error {
	dims := 0
	if err := forEachField(b, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		if num != tensorShape {
			return nil
		}
		switch typ {
		case protowire.VarintType:
			dims++
		case protowire.BytesType:
			for len(v) > 0 {
				_, n := protowire.ConsumeVarint(v)
				if n < 0 {
					return fmt.Errorf("%w: shape: %v", errAnswerFrame, protowire.ParseError(n))
				}
				v = v[n:]
				dims++
			}
		}
		return nil
	}); err != nil {
		return err
	}
	if dims > 0 {
		if spare != nil && dims <= len(spare.shape) {
			t.Shape = spare.shape[:0:dims]
		} else {
			t.Shape = make([]int64, 0, dims)
		}
	}
	return forEachField(b, func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error {
		switch {
		case typ == protowire.VarintType && num == tensorShape:
			t.Shape = append(t.Shape, int64(x))
		case typ != protowire.BytesType:
			// Another wire type: an unknown field, skipped.
		case num == tensorName || num == tensorDatatype:
			if !utf8.Valid(v) {
				return fmt.Errorf("%w: tensor field %d not UTF-8", errAnswerFrame, num)
			}
			if num == tensorName {
				t.Name = names.intern(v)
			} else {
				t.Datatype = datatypeName(v)
			}
		case num == tensorShape:
			for len(v) > 0 {
				d, n := protowire.ConsumeVarint(v) // checked by the count above
				t.Shape = append(t.Shape, int64(d))
				v = v[n:]
			}
		case num == tensorData:
			t.Data = append([]byte{}, v...)
		case num == tensorArena:
			// A message field seen twice merges, as proto.Unmarshal does.
			if t.Arena == nil {
				if spare != nil {
					t.Arena = &spare.arena
				} else {
					t.Arena = &runnerpb.ArenaSlice{}
				}
			}
			return forEachField(v, func(num protowire.Number, typ protowire.Type, _ []byte, x uint64) error {
				switch {
				case typ != protowire.VarintType:
				case num == sliceOffset:
					t.Arena.Offset = x
				case num == sliceLength:
					t.Arena.Length = x
				}
				return nil
			})
		}
		return nil
	})
}

// forEachField calls f with each field of the message in b: its number,
// wire type, and its bytes (length-delimited fields) or value (varints;
// fixed-size fields give their value too). Groups are skipped whole.
func forEachField(b []byte, f func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return fmt.Errorf("%w: %v", errAnswerFrame, protowire.ParseError(n))
		}
		b = b[n:]
		var (
			v []byte
			x uint64
		)
		switch typ {
		case protowire.VarintType:
			x, n = protowire.ConsumeVarint(b)
		case protowire.BytesType:
			v, n = protowire.ConsumeBytes(b)
		case protowire.Fixed32Type:
			var x32 uint32
			x32, n = protowire.ConsumeFixed32(b)
			x = uint64(x32)
		case protowire.Fixed64Type:
			x, n = protowire.ConsumeFixed64(b)
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return fmt.Errorf("%w: field %d: %v", errAnswerFrame, num, protowire.ParseError(n))
		}
		b = b[n:]
		if err := f(num, typ, v, x); err != nil {
			return err
		}
	}
	return nil
}

// datatypeName is the datatype's name as a string the package holds,
// without an allocation for the known ones.
func datatypeName(b []byte) string {
	for _, t := range dataTypes {
		if string(t.Name) == string(b) {
			return string(t.Name)
		}
	}
	return string(b)
}

// nameCache interns the few output names a runner answers with, so that
// decoding an answer does not copy them. It holds at most maxCachedNames;
// others are copied each time.
type nameCache struct {
	mu    sync.Mutex
	names atomic.Pointer[[]string]
}

const maxCachedNames = 64

// intern returns b as a string, the cached one when b is cached.
func (c *nameCache) intern(b []byte) string {
	if c == nil {
		return string(b)
	}
	if p := c.names.Load(); p != nil {
		for _, s := range *p {
			if s == string(b) {
				return s
			}
		}
	}
	s := string(b)
	c.mu.Lock()
	defer c.mu.Unlock()
	var old []string
	if p := c.names.Load(); p != nil {
		old = *p
	}
	if len(old) < maxCachedNames {
		grown := append(old[:len(old):len(old)], s)
		c.names.Store(&grown)
	}
	return s
}
