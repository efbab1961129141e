package runtime

import (
	"errors"
	"fmt"
	"os"

	"google.golang.org/protobuf/encoding/protowire"
)

// ReadSignature reads a model file's graph inputs (initializers excluded)
// and outputs without ONNX Runtime: the fields of onnx.proto it needs
// (ModelProto.graph, GraphProto.input/output/initializer, ValueInfoProto,
// TypeProto.Tensor, TensorShapeProto), decoded from the wire format. A
// dimension with a symbolic name or no value is -1. The simulated
// instances use it; runners take the signature from ONNX Runtime.
func ReadSignature(path string) (inputs, outputs []TensorSpec, err error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, nil, err
	}
	if fi.Size() > 2<<30 {
		return nil, nil, fmt.Errorf("%w: %s is %d bytes, over protobuf's 2 GiB", ErrModelLoad, path, fi.Size())
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	inputs, outputs, err = parseSignature(b)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %s: %w", ErrModelLoad, path, err)
	}
	return inputs, outputs, nil
}

var errWire = errors.New("not an ONNX model (bad protobuf)")

// fields calls fn for each field of a message; fn gets the bytes of
// length-delimited fields and the value of varints.
func fields(b []byte, fn func(num protowire.Number, typ protowire.Type, bytes []byte, v uint64) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return errWire
		}
		b = b[n:]
		var (
			val  []byte
			v    uint64
			size int
		)
		switch typ {
		case protowire.BytesType:
			val, size = protowire.ConsumeBytes(b)
		case protowire.VarintType:
			v, size = protowire.ConsumeVarint(b)
		default:
			size = protowire.ConsumeFieldValue(num, typ, b)
		}
		if size < 0 {
			return errWire
		}
		b = b[size:]
		if err := fn(num, typ, val, v); err != nil {
			return err
		}
	}
	return nil
}

// onnxTypes maps TensorProto.DataType to the protocol's names.
var onnxTypes = map[uint64]DataType{
	1: FP32, 2: Uint8, 3: Int8, 4: Uint16, 5: Int16, 6: Int32, 7: Int64, 8: Bytes,
	9: Bool, 10: FP16, 11: FP64, 12: Uint32, 13: Uint64, 16: BF16,
}

func parseSignature(model []byte) (inputs, outputs []TensorSpec, err error) {
	var graph []byte
	err = fields(model, func(num protowire.Number, typ protowire.Type, b []byte, _ uint64) error {
		if num == 7 && typ == protowire.BytesType { // ModelProto.graph
			graph = b
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	if graph == nil {
		return nil, nil, errors.New("no graph")
	}
	initializers := map[string]bool{}
	var ins, outs [][]byte
	err = fields(graph, func(num protowire.Number, typ protowire.Type, b []byte, _ uint64) error {
		if typ != protowire.BytesType {
			return nil
		}
		switch num {
		case 5: // initializer: TensorProto, name is field 8
			return fields(b, func(n protowire.Number, t protowire.Type, v []byte, _ uint64) error {
				if n == 8 && t == protowire.BytesType {
					initializers[string(v)] = true
				}
				return nil
			})
		case 11:
			ins = append(ins, b)
		case 12:
			outs = append(outs, b)
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	for _, b := range ins {
		spec, err := valueInfo(b)
		if err != nil {
			return nil, nil, err
		}
		if !initializers[spec.Name] {
			inputs = append(inputs, spec)
		}
	}
	for _, b := range outs {
		spec, err := valueInfo(b)
		if err != nil {
			return nil, nil, err
		}
		outputs = append(outputs, spec)
	}
	if len(outputs) == 0 {
		return nil, nil, errors.New("the graph has no outputs")
	}
	return inputs, outputs, nil
}

// valueInfo decodes a ValueInfoProto holding a tensor.
func valueInfo(b []byte) (TensorSpec, error) {
	var spec TensorSpec
	var tensor []byte
	err := fields(b, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		switch {
		case num == 1 && typ == protowire.BytesType:
			spec.Name = string(v)
		case num == 2 && typ == protowire.BytesType: // TypeProto
			return fields(v, func(n protowire.Number, t protowire.Type, tv []byte, _ uint64) error {
				if n == 1 && t == protowire.BytesType { // tensor_type
					tensor = tv
				}
				return nil
			})
		}
		return nil
	})
	if err != nil {
		return spec, err
	}
	if tensor == nil {
		return spec, fmt.Errorf("%s is not a tensor", spec.Name)
	}
	err = fields(tensor, func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error {
		switch {
		case num == 1 && typ == protowire.VarintType:
			dt, ok := onnxTypes[x]
			if !ok {
				return fmt.Errorf("%s: element type %d is not supported", spec.Name, x)
			}
			spec.DataType = dt
		case num == 2 && typ == protowire.BytesType: // TensorShapeProto
			spec.Shape = []int64{}
			return fields(v, func(n protowire.Number, t protowire.Type, dim []byte, _ uint64) error {
				if n != 1 || t != protowire.BytesType {
					return nil
				}
				d := int64(-1)
				err := fields(dim, func(dn protowire.Number, dt protowire.Type, _ []byte, dv uint64) error {
					if dn == 1 && dt == protowire.VarintType && int64(dv) > 0 {
						d = int64(dv)
					}
					return nil
				})
				spec.Shape = append(spec.Shape, d)
				return err
			})
		}
		return nil
	})
	if spec.DataType == "" && err == nil {
		err = fmt.Errorf("%s has no element type", spec.Name)
	}
	return spec, err
}
