package runtime

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"
)

// DataType is a tensor element type, named as in the Open Inference Protocol.
type DataType string

// The element types that both the Open Inference Protocol and ONNX Runtime know.
const (
	Bool   DataType = "BOOL"
	Uint8  DataType = "UINT8"
	Uint16 DataType = "UINT16"
	Uint32 DataType = "UINT32"
	Uint64 DataType = "UINT64"
	Int8   DataType = "INT8"
	Int16  DataType = "INT16"
	Int32  DataType = "INT32"
	Int64  DataType = "INT64"
	FP16   DataType = "FP16"
	FP32   DataType = "FP32"
	FP64   DataType = "FP64"
	BF16   DataType = "BF16"
	Bytes  DataType = "BYTES"
)

// DataKind is how the bits of a datatype's element are read.
type DataKind uint8

const (
	KindBool     DataKind = iota + 1 // one byte, 0 or 1
	KindUnsigned                     // an unsigned integer
	KindSigned                       // a two's complement integer
	KindFloat                        // an IEEE 754 binary float, or bfloat16
	KindString                       // BYTES: a 4-byte length, then the bytes
)

// DataTypeInfo describes one datatype: the one table of them that the wire
// codecs (api), the runners (runtime) and the load generator read.
type DataTypeInfo struct {
	Name DataType
	// Size is the bytes of one element; 0 for BYTES, whose elements vary.
	Size int
	Kind DataKind
	// ONNX is the element type's number in ONNX (TensorProto.DataType),
	// which ONNX Runtime's element types share.
	ONNX int
	// GRPCContents is the InferTensorContents field that carries the
	// datatype over gRPC; "" when none does (FP16 and BF16 travel in
	// raw_input_contents only).
	GRPCContents string
	// JSONMaxBytes is the most bytes one element takes as a JSON number or
	// literal with its separator, as the REST codec writes it; 0 for BYTES.
	JSONMaxBytes int
}

// dataTypes is the table, in the protocol's order.
var dataTypes = [...]DataTypeInfo{
	{Bool, 1, KindBool, 9, "bool_contents", 6},
	{Uint8, 1, KindUnsigned, 2, "uint_contents", 4},
	{Uint16, 2, KindUnsigned, 4, "uint_contents", 6},
	{Uint32, 4, KindUnsigned, 12, "uint_contents", 11},
	{Uint64, 8, KindUnsigned, 13, "uint64_contents", 21},
	{Int8, 1, KindSigned, 3, "int_contents", 5},
	{Int16, 2, KindSigned, 5, "int_contents", 7},
	{Int32, 4, KindSigned, 6, "int_contents", 12},
	{Int64, 8, KindSigned, 7, "int64_contents", 21},
	{FP16, 2, KindFloat, 10, "", 16},
	{FP32, 4, KindFloat, 1, "fp32_contents", 24},
	{FP64, 8, KindFloat, 11, "fp64_contents", 28},
	{BF16, 2, KindFloat, 16, "", 23}, // up to 21 digits in plain notation below 1e21
	{Bytes, 0, KindString, 8, "bytes_contents", 0},
}

// DataTypes lists every datatype's description.
func DataTypes() []DataTypeInfo { return dataTypes[:] }

// dataTypeIndex finds a datatype's row in dataTypes.
var dataTypeIndex = func() map[DataType]int {
	m := make(map[DataType]int, len(dataTypes))
	for i, t := range dataTypes {
		m[t.Name] = i
	}
	return m
}()

// Info describes d; ok is false when d is not a known datatype.
func (d DataType) Info() (info DataTypeInfo, ok bool) {
	i, ok := dataTypeIndex[d]
	if !ok {
		return DataTypeInfo{}, false
	}
	return dataTypes[i], true
}

// ParseDataType returns the DataType named s, or false when s names none.
func ParseDataType(s string) (DataType, bool) {
	d := DataType(s)
	return d, d.Valid()
}

// Size is the size of one element in bytes; 0 for BYTES, whose elements
// vary, and for unknown datatypes.
func (d DataType) Size() int {
	info, _ := d.Info()
	return info.Size
}

// Valid reports whether d is a known element type.
func (d DataType) Valid() bool {
	_, ok := d.Info()
	return ok
}

// Tensor is one named tensor on the data path. Data holds the elements in
// row-major order, little-endian. For BYTES each element is a 4-byte
// little-endian length followed by that many bytes (the layout of the
// protocol's binary tensor extension), so every tensor is one flat buffer.
type Tensor struct {
	Name     string
	DataType DataType
	Shape    []int64
	Data     []byte
	// Mapped says Data lies in a client's shared-memory mapping, which the
	// client may truncate under it: it is read only through CopyMapped
	// (mapped.go), never handed to ONNX Runtime or an encoder as it is.
	Mapped bool
}

// TensorSpec describes a model input or output. A dimension of -1 is dynamic.
type TensorSpec struct {
	Name     string
	DataType DataType
	Shape    []int64
}

// InferRequest is one inference call on a model instance.
type InferRequest struct {
	Inputs []Tensor
	// Outputs names the outputs to return; empty means all of them.
	Outputs []string
	// Deadline is the time by which the client wants the answer, from the
	// request's own timeout; zero means none. The scheduler also applies
	// the model's SLO and the caller's context deadline; runners ignore it.
	Deadline time.Time
	// Priority is the request's priority (Triton semantics: 0 = the
	// model's default, 1 highest); runners ignore it.
	Priority int
	// Arrival is when the request reached the server (its headers, before
	// its body); the model's SLO counts from it. Zero means when the
	// scheduler got it. Runners ignore it.
	Arrival time.Time
	// ID is the client's id for the request (the Open Inference
	// Protocol's optional `id`), echoed in the response by the API; the
	// scheduler names the request by it in its debug lines. Runners
	// ignore it.
	ID string
}

// InferResponse carries the outputs and how long each step took in the runner.
type InferResponse struct {
	Outputs []Tensor
	Timing  Timing
}

// ErrShape reports a shape that no tensor can have.
var ErrShape = errors.New("invalid shape")

// ElementCount multiplies the dimensions of a concrete shape. It fails on a
// negative dimension or when the product exceeds limit (limit <= 0: no limit
// other than overflow), without overflowing on hostile input.
func ElementCount(shape []int64, limit int64) (int64, error) {
	if limit <= 0 {
		limit = math.MaxInt64
	}
	zero := false
	for i, d := range shape {
		if d < 0 {
			return 0, fmt.Errorf("%w: dimension %d is %d", ErrShape, i, d)
		}
		zero = zero || d == 0
	}
	if zero {
		return 0, nil
	}
	n := int64(1)
	for _, d := range shape {
		if n > limit/d {
			return 0, fmt.Errorf("%w: %v has more than %d elements", ErrShape, shape, limit)
		}
		n *= d
	}
	return n, nil
}

// ByteSize is the number of data bytes a tensor of this type and element
// count must have; for BYTES it is unknown in advance and -1 is returned.
func (d DataType) ByteSize(elements int64) int64 {
	if d == Bytes {
		return -1
	}
	return elements * int64(d.Size())
}

// CheckBytes checks that a BYTES buffer holds exactly n length-prefixed
// elements, without allocating: a check costs nothing per element, whatever
// the shape or the data claim.
func CheckBytes(data []byte, n int64) error {
	var count int64
	for len(data) > 0 {
		if len(data) < 4 {
			return errors.New("BYTES element truncated in its length prefix")
		}
		l := binary.LittleEndian.Uint32(data)
		data = data[4:]
		if uint64(l) > uint64(len(data)) {
			return fmt.Errorf("BYTES element declares %d bytes, %d remain", l, len(data))
		}
		data = data[l:]
		count++
	}
	if count != n {
		return fmt.Errorf("BYTES data holds %d elements, shape needs %d", count, n)
	}
	return nil
}

// SplitBytes decodes a BYTES buffer into its elements, checking that it holds
// exactly n length-prefixed elements. The buffer is checked first
// (CheckBytes): the slice of n elements is allocated only for data that
// holds them.
func SplitBytes(data []byte, n int64) ([][]byte, error) {
	if err := CheckBytes(data, n); err != nil {
		return nil, err
	}
	out := make([][]byte, 0, n)
	for len(data) > 0 {
		l := binary.LittleEndian.Uint32(data)
		out = append(out, data[4:4+l])
		data = data[4+l:]
	}
	return out, nil
}

// AppendBytesElement appends one BYTES element in the length-prefixed layout.
func AppendBytesElement(buf, elem []byte) []byte {
	buf = binary.LittleEndian.AppendUint32(buf, uint32(len(elem)))
	return append(buf, elem...)
}
