package api

import (
	"context"
	"fmt"
	"sync"

	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/sloserve/sloserve/api/inference"
)

// Decoding a protobuf message can take many times its wire size: every
// element of a repeated bytes field (bytes_contents) becomes a slice header
// of 24 bytes, a one-byte varint of a shape becomes an int64 of 8, a map
// entry of a few bytes (parameters) becomes a map slot, a message and a
// wrapper. The server's codec counts that cost from the wire before it
// decodes, and reserves it in the memory budget first.

// Estimated costs of decoded structures, in bytes.
const (
	decodedMessageBytes  = 128 // a message struct and the pointer to it
	decodedMapEntryBytes = 160 // a map slot (and its share of the map's growth), the value's message
	decodedSliceHeader   = 24
	decodedGrowth        = 2 // repeated fields grow by appending: up to twice their length
)

// decodedCost is the memory decoding b into a message of descriptor md
// takes, estimated from the wire, or an error for a malformed message
// (which proto.Unmarshal will report itself).
func decodedCost(b []byte, md protoreflect.MessageDescriptor) (int64, error) {
	var n int64
	fields := md.Fields()
	for len(b) > 0 {
		num, typ, tl := protowire.ConsumeTag(b)
		if tl < 0 {
			return 0, protowire.ParseError(tl)
		}
		b = b[tl:]
		vl := protowire.ConsumeFieldValue(num, typ, b)
		if vl < 0 {
			return 0, protowire.ParseError(vl)
		}
		value := b[:vl]
		b = b[vl:]
		fd := fields.ByNumber(num)
		if fd == nil {
			n += int64(vl) + 8 // kept as unknown bytes
			continue
		}
		switch {
		case fd.Message() != nil: // a message, or a map's entry
			v, ln := protowire.ConsumeBytes(value)
			if ln < 0 {
				return 0, protowire.ParseError(ln)
			}
			c, err := decodedCost(v, fd.Message())
			if err != nil {
				return 0, err
			}
			switch {
			case fd.IsMap():
				n += decodedMapEntryBytes + c
			case fd.IsList():
				n += decodedMessageBytes + c + decodedGrowth*8 // and the pointer in the list
			default:
				n += decodedMessageBytes + c
			}
		case fd.Kind() == protoreflect.BytesKind || fd.Kind() == protoreflect.StringKind:
			v, _ := protowire.ConsumeBytes(value)
			n += int64(len(v)) + 8 // rounded up to the allocator's classes
			if fd.IsList() {
				n += decodedGrowth * decodedSliceHeader
			}
		case fd.IsList():
			size := int64(scalarSize(fd.Kind()))
			if typ == protowire.BytesType { // packed
				v, _ := protowire.ConsumeBytes(value)
				n += decodedGrowth * size * packedCount(v, fd.Kind())
			} else {
				n += decodedGrowth * size
			}
		}
	}
	return n, nil
}

// scalarSize is the size of a decoded scalar of kind k.
func scalarSize(k protoreflect.Kind) int {
	switch k {
	case protoreflect.BoolKind:
		return 1
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Uint32Kind, protoreflect.EnumKind,
		protoreflect.Fixed32Kind, protoreflect.Sfixed32Kind, protoreflect.FloatKind:
		return 4
	}
	return 8
}

// packedCount is the number of elements of a packed repeated field.
func packedCount(b []byte, k protoreflect.Kind) int64 {
	switch k {
	case protoreflect.Fixed32Kind, protoreflect.Sfixed32Kind, protoreflect.FloatKind:
		return int64(len(b) / 4)
	case protoreflect.Fixed64Kind, protoreflect.Sfixed64Kind, protoreflect.DoubleKind:
		return int64(len(b) / 8)
	}
	var c int64
	for _, x := range b {
		if x < 0x80 { // the last byte of a varint
			c++
		}
	}
	return c
}

// grpcDecodeCodec is the gRPC server's codec: protobuf, with the memory a
// received message takes decoded reserved before it is decoded. A
// ModelInferRequest's reservation is kept for its handler (takeDecoded),
// which holds it until the call ends; one that does not fit is left empty
// and its handler refuses the call with RESOURCE_EXHAUSTED (a codec error
// would reach the client as INTERNAL). Other messages, small by nature,
// are refused by an error when their cost does not fit and give their
// reservation back once decoded.
//
// A ModelInferRequest is asked about first (preadmit, when set) with the
// model name and version read from its first bytes: a request its model
// would refuse anyway (queue full, one row predicted to miss its SLO, the
// server at its limit on requests in flight) is neither copied out of the
// receive buffers nor decoded, and its handler refuses it with that error.
// Under overload most calls are such refusals, and decoding them (a copy
// and an allocation of the whole tensor each, and the garbage collection
// after) took the CPU the admitted ones need.
type grpcDecodeCodec struct {
	encoding.CodecV2
	budget *MemoryBudget
	// preadmit says, from a ModelInferRequest's model name and version,
	// whether its model would refuse it now (Backend.Preadmit); nil: no
	// request is refused before it is decoded.
	preadmit func(name, version string) error
	// decoded holds, per received ModelInferRequest, its *Reservation or
	// the error that refused it, until its handler takes it.
	decoded sync.Map
}

func newGRPCDecodeCodec(budget *MemoryBudget, preadmit func(name, version string) error) *grpcDecodeCodec {
	return &grpcDecodeCodec{CodecV2: encoding.GetCodecV2(grpcproto.Name), budget: budget, preadmit: preadmit}
}

func (c *grpcDecodeCodec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return c.CodecV2.Unmarshal(data, v)
	}
	if req, isInfer := v.(*inference.ModelInferRequest); isInfer && c.preadmit != nil && len(data) > 0 {
		if name, version, ok := peekInferModel(data[0].ReadOnlyData()); ok {
			if err := c.preadmit(name, version); err != nil {
				// Kept, not decoded, until the handler has seen the
				// call's metadata: a ModelMesh header may name another
				// model (takeDecoded).
				data.Ref()
				c.decoded.Store(req, &grpcPeekRefusal{err: err, model: name, data: data})
				return nil
			}
		}
	}
	return c.unmarshal(data, m)
}

// unmarshal decodes data into m within the budget: see Unmarshal.
func (c *grpcDecodeCodec) unmarshal(data mem.BufferSlice, m proto.Message) error {
	req, isInfer := m.(*inference.ModelInferRequest)
	refuse := func(err error) error {
		if isInfer {
			c.decoded.Store(req, err)
			return nil
		}
		return err
	}
	// The call's own reservation covers the buffers its message was
	// received in. A compressed message is decompressed into buffers of
	// its own, and a message in more than one buffer is gathered into one
	// first: both are reserved here from the message's actual length
	// (once, and once more when gathered; an uncompressed message counts
	// twice), rather than for every call from the largest message a call
	// may send.
	n := int64(data.Len())
	if len(data) > 1 {
		n *= 2
	}
	// The copies end with this function: taken and given back without a
	// Reservation. The reasons are formatted only for a refusal (each
	// cost two allocations on every call).
	if err := c.budget.take(n, func() string { return fmt.Sprintf("receiving a message of %d bytes", data.Len()) }, false); err != nil {
		return refuse(err)
	}
	defer c.budget.give(n)
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	b := buf.ReadOnlyData()
	cost, err := decodedCost(b, m.ProtoReflect().Descriptor())
	if err != nil {
		return err
	}
	res, err := c.budget.reserveFunc(cost, func() string { return fmt.Sprintf("decoding a message of %d bytes", len(b)) })
	if err != nil {
		return refuse(err)
	}
	if err := proto.Unmarshal(b, m); err != nil {
		res.Release()
		return err
	}
	if isInfer {
		c.decoded.Store(req, res)
	} else {
		res.Release()
	}
	return nil
}

// grpcPeekRefusal is a ModelInferRequest refused from the model name at
// the start of its message, which is kept undecoded until its handler
// takes it.
type grpcPeekRefusal struct {
	err   error
	model string // the name the message starts with
	data  mem.BufferSlice
}

// takeDecoded returns the reservation of a ModelInferRequest this codec
// decoded, or the error that refused to decode it. A request refused from
// its first bytes is refused for the model its message names; when the
// call's ModelMesh header names another model (meshModelName), the
// refusal was about the wrong model, and the message is decoded now.
func (c *grpcDecodeCodec) takeDecoded(ctx context.Context, req *inference.ModelInferRequest) (*Reservation, error) {
	if c == nil {
		return nil, nil
	}
	v, ok := c.decoded.LoadAndDelete(req)
	if !ok {
		return nil, nil
	}
	switch v := v.(type) {
	case *grpcPeekRefusal:
		defer v.data.Free()
		if meshModelName(ctx, v.model) == v.model {
			return nil, v.err
		}
		if err := c.unmarshal(v.data, req); err != nil {
			return nil, fmt.Errorf("%w: %v", errBadRequest, err)
		}
		return c.takeDecoded(ctx, req)
	case error:
		return nil, v
	}
	return v.(*Reservation), nil
}

// discard gives back what the codec holds for req, if its handler did not
// take it.
func (c *grpcDecodeCodec) discard(req *inference.ModelInferRequest) {
	if c == nil {
		return
	}
	v, ok := c.decoded.LoadAndDelete(req)
	if !ok {
		return
	}
	switch v := v.(type) {
	case *grpcPeekRefusal:
		v.data.Free()
	case *Reservation:
		v.Release()
	}
}

var _ encoding.CodecV2 = (*grpcDecodeCodec)(nil)

// Field numbers of ModelInferRequest's model_name and model_version.
const (
	inferModelNameField    = 1
	inferModelVersionField = 2
)

// peekInferModel reads the model name and version of a ModelInferRequest
// from the start of its wire form b, without decoding the rest. Encoders
// write fields in the order of their numbers (Go's, C++'s and Python's
// do), so model_name comes first and model_version, when set, second. ok
// is false when b does not start with a model name (a field order of its
// own), or a name or version is cut off by the end of b: the caller then asks nothing
// and decodes as usual. The version is "" when it is not there.
func peekInferModel(b []byte) (name, version string, ok bool) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 || num != inferModelNameField || typ != protowire.BytesType {
		return "", "", false
	}
	b = b[n:]
	v, n := protowire.ConsumeBytes(b)
	if n < 0 {
		return "", "", false
	}
	name, b = string(v), b[n:]
	num, typ, n = protowire.ConsumeTag(b)
	if n < 0 || num != inferModelVersionField || typ != protowire.BytesType {
		return name, "", true
	}
	v, n = protowire.ConsumeBytes(b[n:])
	if n < 0 {
		return "", "", false // the version is cut off
	}
	return name, string(v), true
}
