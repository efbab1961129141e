package api

// The REST codec: inference requests from JSON (with the binary tensor data
// extension) into runtime tensors, and inference responses back to JSON.
//
// The request's small structure is read into plain structs by a one-pass
// parser for the common shape (rest_parse.go), else by encoding/json, which
// checks the syntax (field names match as encoding/json matches them, and
// unknown fields are ignored as the protocol allows). The "data" arrays, which
// hold nearly all of the bytes, stay raw: a small scanner flattens each
// already checked value and parses it straight into the tensor's
// little-endian buffer (FP32 data in a flat array, nearly all of it, in one
// loop of its own: decodeFlatFP32). The response is written by hand into a pooled buffer
// with strconv.Append*. Neither direction uses reflection per element.
// (Reading the structure with json.Decoder.Token was tried first and cost
// more than the rest of the handler together: Token decodes every key and
// scalar through Decode and allocates a scanner error for each.)
//
// Choices where the protocol leaves room:
//   - "data" may be flat or nested in any way; only the total element count
//     is checked against the shape, and arrays may nest at most rank+1 deep.
//   - Integer types accept integral numbers written with a fraction or an
//     exponent (4.0, 1e3) and refuse fractional or out-of-range ones.
//   - Floating-point values that overflow their type (1e39 for FP32, 65520
//     for FP16) are refused. JSON has no NaN or infinity: send those in
//     binary. In responses NaN and ±Inf are written as null.
//   - BYTES strings are kept byte for byte once their escapes are decoded
//     (an unpaired surrogate escape becomes U+FFFD, as in encoding/json). A
//     string that is not valid UTF-8 is refused: JSON text must be UTF-8
//     (RFC 8259), and the JSON response could not give the same bytes back.
//     BYTES elements are arbitrary bytes in the protocol; send them with the
//     binary tensor data extension (or over gRPC), where they are kept
//     exactly. In responses BYTES elements are JSON strings with invalid
//     UTF-8 replaced by U+FFFD; clients that need the exact bytes ask for
//     binary_data.
//   - FP16 and BF16 values are converted to and from JSON numbers with
//     round-to-nearest-even, and written back with the fewest digits that
//     convert to the same value (an FP16 0.1 is written as 0.1).

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/sloserve/sloserve/runtime"
)

// headerInferenceLength is the binary tensor data extension's header: the
// length of the JSON part at the start of a request or response body.
const headerInferenceLength = "Inference-Header-Content-Length"

// restRequest is a REST inference request decoded into runtime tensors.
type restRequest struct {
	id      string
	hasID   bool
	inputs  []runtime.Tensor
	outputs []restOutput
	// binaryAll is the request parameter binary_data_output: every output
	// without its own binary_data parameter is returned in binary.
	binaryAll bool
	// timeout is the request parameter timeout; 0 when not given.
	timeout time.Duration
	// priority is the request parameter priority; 0 (the model's) when not
	// given.
	priority int
	// shm are the requested outputs to be written into shared memory.
	shm []shmTarget
}

// restOutput is one entry of the request's "outputs".
type restOutput struct {
	name      string
	binary    bool
	binarySet bool // the output has its own binary_data parameter
}

// runtimeRequest is the request as the Backend takes it, without its
// deadline, which depends on the arrival time and headers.
func (r *restRequest) runtimeRequest() *runtime.InferRequest {
	rr := &runtime.InferRequest{Inputs: r.inputs, Priority: r.priority, ID: r.id}
	if len(r.outputs) > 0 {
		rr.Outputs = make([]string, len(r.outputs))
		for i, o := range r.outputs {
			rr.Outputs[i] = o.name
		}
	}
	return rr
}

// binaryOutput reports whether the output called name is returned in binary.
func (r *restRequest) binaryOutput(name string) bool {
	for _, o := range r.outputs {
		if o.name == name && o.binarySet {
			return o.binary
		}
	}
	return r.binaryAll
}

// restBadRequest is a decode error reported with 400.
func restBadRequest(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errBadRequest, fmt.Sprintf(format, args...))
}

// restRequestJSON is the JSON of an inference request. Input data and
// parameters stay raw: data is converted by decodeJSONData, and only the
// parameters sloserve knows are read.
type restRequestJSON struct {
	ID         *string                    `json:"id"`
	Parameters map[string]json.RawMessage `json:"parameters"`
	Inputs     []restInputJSON            `json:"inputs"`
	Outputs    []restOutputJSON           `json:"outputs"`
}

// restInputJSON is one entry of the request's "inputs".
type restInputJSON struct {
	Name       *string                    `json:"name"`
	Shape      []int64                    `json:"shape"`
	DataType   *string                    `json:"datatype"`
	Parameters map[string]json.RawMessage `json:"parameters"`
	Data       json.RawMessage            `json:"data"`
}

// restOutputJSON is one entry of the request's "outputs".
type restOutputJSON struct {
	Name       *string                    `json:"name"`
	Parameters map[string]json.RawMessage `json:"parameters"`
}

// decodeRESTInfer decodes a REST inference request body. headerLen is the
// value of the Inference-Header-Content-Length header, or -1 when the request
// has none; with it the body is headerLen bytes of JSON followed by the binary
// data of the inputs that declare binary_data_size, in input order. Binary
// input tensors share memory with body. Tensors that name a shared memory
// region are refused.
func decodeRESTInfer(body []byte, headerLen int64, lim Limits) (*restRequest, error) {
	return decodeRESTInferShm(body, headerLen, lim, nil)
}

// decodeRESTInferShm is decodeRESTInfer with the shared memory regions of
// shm: inputs that name a region alias it, and outputs that name one are
// recorded in the request's shm targets.
func decodeRESTInferShm(body []byte, headerLen int64, lim Limits, shm *shmUse) (*restRequest, error) {
	return decodeRESTInferMem(body, headerLen, lim, shm, nil)
}

// restJSONCopies is how many copies of a request's JSON encoding/json holds
// while it decodes: its read buffer, and the raw data arrays. The one-pass
// parser (parseRESTFast) holds none.
const restJSONCopies = 2

// decodeRESTInferMem is decodeRESTInferShm that reserves in mem the memory
// decoding takes beyond the body (nil: none reserved), before it is
// allocated: the decoder's copies of the JSON and each input's tensor data
// decoded from JSON. Over the budget it returns errMemory.
func decodeRESTInferMem(body []byte, headerLen int64, lim Limits, shm *shmUse, mem *Reservation) (*restRequest, error) {
	jsonPart := body
	var binPart []byte
	if headerLen >= 0 {
		if headerLen > int64(len(body)) {
			return nil, restBadRequest("%s is %d but the body has only %d bytes", headerInferenceLength, headerLen, len(body))
		}
		jsonPart, binPart = body[:headerLen], body[headerLen:]
	}

	// The request's structure; the bulk of it, the data arrays, stays raw
	// for decodeJSONData. parseRESTFast leaves them where they are in the
	// body; encoding/json, for what it gives up on, holds its copies of
	// the JSON (restJSONCopies), reserved first.
	var rj restRequestJSON
	if !parseRESTFast(jsonPart, &rj) {
		if err := mem.Grow(restJSONCopies*int64(len(jsonPart)), "decoding the request's JSON"); err != nil {
			return nil, err
		}
		rj = restRequestJSON{}
		if err := decodeRESTStructure(jsonPart, &rj); err != nil {
			return nil, err
		}
	}
	if rj.Inputs == nil {
		return nil, restBadRequest("the request has no inputs")
	}

	req := &restRequest{inputs: make([]runtime.Tensor, 0, len(rj.Inputs))}
	if rj.ID != nil {
		req.id, req.hasID = *rj.ID, true
	}
	if raw, ok := rj.Parameters["binary_data_output"]; ok {
		if req.binaryAll, ok = rawBool(raw); !ok {
			return nil, restBadRequest("parameters.binary_data_output must be true or false, not %s", clipValue(raw))
		}
	}
	if raw, ok := rj.Parameters[paramTimeout]; ok {
		var err error
		if req.timeout, err = restTimeoutParam(raw); err != nil {
			return nil, err
		}
	}
	if raw, ok := rj.Parameters[paramPriority]; ok {
		var err error
		if req.priority, err = restPriorityParam(raw); err != nil {
			return nil, err
		}
	}
	in := restInputDecoder{lim: lim, hasBinary: headerLen >= 0, binary: binPart, shm: shm, mem: mem}
	var names map[string]struct{}
	for i := range rj.Inputs {
		t, err := in.decode(i, &rj.Inputs[i])
		if err != nil {
			return nil, err
		}
		if len(rj.Inputs) > 1 {
			if err := uniqueName(&names, "input", t.Name); err != nil {
				return nil, err
			}
		}
		req.inputs = append(req.inputs, t)
	}
	if len(in.binary) > 0 {
		return nil, restBadRequest("binary data has %d bytes that no input's binary_data_size accounts for", len(in.binary))
	}

	if len(rj.Outputs) > 0 {
		req.outputs = make([]restOutput, len(rj.Outputs))
		names = nil
	}
	for i, oj := range rj.Outputs {
		if oj.Name == nil {
			return nil, restBadRequest("outputs[%d] has no name", i)
		}
		o := restOutput{name: *oj.Name}
		if _, ok := oj.Parameters["classification"]; ok {
			return nil, restBadRequest("output %q: the classification extension is not supported", o.name)
		}
		if sharedMemory(oj.Parameters) {
			if shm == nil {
				return nil, restBadRequest("output %q: the shared memory extension is not supported", o.name)
			}
			target, err := restShmOutput(shm, o.name, oj.Parameters)
			if err != nil {
				return nil, err
			}
			req.shm = append(req.shm, target)
		}
		if raw, ok := oj.Parameters["binary_data"]; ok {
			if o.binary, ok = rawBool(raw); !ok {
				return nil, restBadRequest("output %q: parameters.binary_data must be true or false, not %s", o.name, clipValue(raw))
			}
			o.binarySet = true
		}
		if len(rj.Outputs) > 1 {
			if err := uniqueName(&names, "output", o.name); err != nil {
				return nil, err
			}
		}
		req.outputs[i] = o
	}
	return req, nil
}

// decodeRESTStructure decodes the structure of a request with encoding/json,
// for requests parseRESTFast does not read.
func decodeRESTStructure(jsonPart []byte, rj *restRequestJSON) error {
	dec := json.NewDecoder(bytes.NewReader(jsonPart))
	if err := dec.Decode(rj); err != nil {
		return restJSONError(err)
	}
	if len(bytes.TrimSpace(jsonPart[dec.InputOffset():])) != 0 {
		return restBadRequest("malformed JSON: data after the request object")
	}
	if key, dup := duplicateJSONKey(jsonPart); dup {
		return restBadRequest("malformed JSON: key %q appears twice in one object", clipValue(key))
	}
	return nil
}

// restTimeoutParam reads the request parameter timeout, in microseconds.
func restTimeoutParam(raw json.RawMessage) (time.Duration, error) {
	raw = bytes.TrimSpace(raw)
	neg, us, err := parseJSONInteger(raw)
	switch {
	case err == errIntRange && !bytes.HasPrefix(raw, []byte{'-'}):
		us = math.MaxUint64 // too long, and said so
	case err != nil:
		neg, us = true, 0 // not a positive integer
	}
	d, problem := timeoutFromMicros(neg, us)
	if problem != "" {
		return 0, restBadRequest("parameters.%s %s, not %s", paramTimeout, problem, clipValue(raw))
	}
	return d, nil
}

// restPriorityParam reads the request parameter priority.
func restPriorityParam(raw json.RawMessage) (int, error) {
	raw = bytes.TrimSpace(raw)
	neg, p, err := parseJSONInteger(raw)
	switch {
	case err == errIntRange && !bytes.HasPrefix(raw, []byte{'-'}):
		p = math.MaxUint64 // too large, and said so
	case err != nil:
		neg, p = true, 1 // not an integer >= 0
	}
	v, problem := priorityFromUint(neg, p)
	if problem != "" {
		return 0, restBadRequest("parameters.%s %s, not %s", paramPriority, problem, clipValue(raw))
	}
	return v, nil
}

// restJSONError turns an encoding/json error into a bad request.
func restJSONError(err error) error {
	var (
		syn *json.SyntaxError
		typ *json.UnmarshalTypeError
	)
	switch {
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return restBadRequest("malformed JSON: unexpected end of input")
	case errors.As(err, &syn):
		return restBadRequest("malformed JSON at offset %d: %v", syn.Offset, err)
	case errors.As(err, &typ) && typ.Field == "":
		return restBadRequest("the request must be a JSON object, not %s", typ.Value)
	case errors.As(err, &typ):
		return restBadRequest("%s must be %s, not %s", typ.Field, jsonKindOf(typ.Type), clipValue(typ.Value))
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		return restBadRequest("%s", strings.TrimPrefix(err.Error(), "json: "))
	default:
		return restBadRequest("malformed JSON: %v", err)
	}
}

// jsonKindOf names the JSON values a Go type decodes from.
func jsonKindOf(t reflect.Type) string {
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return fmt.Sprintf("an integer that fits in %d bits", t.Bits())
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Map, reflect.Struct:
		return "an object"
	}
	return "a " + t.String()
}

// rawBool reads a raw JSON value that must be true or false; ok is false
// when it is anything else.
func rawBool(raw json.RawMessage) (v, ok bool) {
	switch string(bytes.TrimSpace(raw)) {
	case "true":
		return true, true
	case "false":
		return false, true
	}
	return false, false
}

// sharedMemory reports whether tensor parameters ask for the shared memory
// extension.
func sharedMemory(params map[string]json.RawMessage) bool {
	for _, k := range []string{paramShmRegion, paramShmSize, paramShmOffset} {
		if _, ok := params[k]; ok {
			return true
		}
	}
	return false
}

// uniqueName records name in the set *names and fails if it is already there.
func uniqueName(names *map[string]struct{}, kind, name string) error {
	if *names == nil {
		*names = make(map[string]struct{})
	}
	if _, dup := (*names)[name]; dup {
		return restBadRequest("%s %q appears twice", kind, name)
	}
	(*names)[name] = struct{}{}
	return nil
}

// restInputDecoder turns the inputs of one request into tensors, taking
// binary data from the body in input order.
type restInputDecoder struct {
	lim       Limits
	hasBinary bool   // the request has a binary part
	binary    []byte // binary data not yet taken by an input
	shm       *shmUse
	mem       *Reservation // the request's memory; nil: not counted
}

// decode converts inputs[i] into a tensor.
func (d *restInputDecoder) decode(i int, ij *restInputJSON) (runtime.Tensor, error) {
	if ij.Name == nil {
		return runtime.Tensor{}, restBadRequest("inputs[%d] has no name", i)
	}
	name := *ij.Name
	switch {
	case ij.DataType == nil:
		return runtime.Tensor{}, restBadRequest("input %q has no datatype", name)
	case ij.Shape == nil:
		return runtime.Tensor{}, restBadRequest("input %q has no shape", name)
	}
	dt, ok := runtime.ParseDataType(*ij.DataType)
	if !ok {
		return runtime.Tensor{}, restBadRequest("input %q has unknown datatype %q", name, clipValue(*ij.DataType))
	}
	for k, dim := range ij.Shape {
		if dim < 0 {
			return runtime.Tensor{}, restBadRequest("input %q: dimension %d of shape %v is negative", name, k, ij.Shape)
		}
	}
	n, err := runtime.ElementCount(ij.Shape, d.lim.MaxTensorElements)
	if err != nil {
		if d.lim.MaxTensorElements > 0 {
			return runtime.Tensor{}, fmt.Errorf("%w: input %q: shape %v has more than the %d elements allowed",
				errTooLarge, name, ij.Shape, d.lim.MaxTensorElements)
		}
		return runtime.Tensor{}, fmt.Errorf("%w: input %q: shape %v has too many elements", errTooLarge, name, ij.Shape)
	}

	if sharedMemory(ij.Parameters) {
		if d.shm == nil {
			return runtime.Tensor{}, restBadRequest("input %q: the shared memory extension is not supported", name)
		}
		return restShmInput(d.shm, ij, dt, n)
	}
	binarySize := int64(-1)
	if raw, ok := ij.Parameters["binary_data_size"]; ok {
		binarySize, err = strconv.ParseInt(string(bytes.TrimSpace(raw)), 10, 64)
		if err != nil || binarySize < 0 {
			return runtime.Tensor{}, restBadRequest("input %q: parameters.binary_data_size must be a non-negative integer, not %s",
				name, clipValue(raw))
		}
	}
	hasData := ij.Data != nil && string(ij.Data) != "null"

	t := runtime.Tensor{Name: name, DataType: dt, Shape: ij.Shape}
	switch {
	case binarySize >= 0 && hasData:
		err = restBadRequest("input %q has both data and binary_data_size", name)
	case binarySize >= 0:
		t.Data, err = d.take(name, binarySize, dt, ij.Shape, n)
	case hasData:
		// The decoded data's size, reserved before it is allocated (a shape
		// too large for the data is refused inside without allocating).
		size := n * int64(dt.Size())
		if dt == runtime.Bytes {
			size = 4*n + int64(len(ij.Data))
		}
		if n <= int64(len(ij.Data))/2+1 {
			if err := d.mem.Grow(size, fmt.Sprintf("input %q", name)); err != nil {
				return t, err
			}
		}
		t.Data, err = decodeJSONData(name, ij.Data, dt, n, len(ij.Shape)+1)
	default:
		err = restBadRequest("input %q has neither data nor binary_data_size", name)
	}
	return t, err
}

// take takes size bytes of binary data for an input.
func (d *restInputDecoder) take(name string, size int64, dt runtime.DataType, shape []int64, n int64) ([]byte, error) {
	switch {
	case !d.hasBinary:
		return nil, restBadRequest("input %q has binary_data_size but the request has no %s header", name, headerInferenceLength)
	case size > int64(len(d.binary)):
		return nil, restBadRequest("input %q: binary_data_size is %d but only %d bytes of binary data remain", name, size, len(d.binary))
	}
	data := d.binary[:size:size] // a full slice: appending must not touch the next input
	d.binary = d.binary[size:]
	if dt == runtime.Bytes {
		if err := runtime.CheckBytes(data, n); err != nil {
			return nil, restBadRequest("input %q: %v", name, err)
		}
		return data, nil
	}
	es := int64(dt.Size())
	if size%es != 0 || size/es != n {
		return nil, restBadRequest("input %q: binary_data_size is %d but shape %v of %s needs %d bytes", name, size, shape, dt, n*es)
	}
	return data, nil
}

// clipValue shortens a value quoted in an error message.
func clipValue[S ~string | ~[]byte](v S) string {
	const max = 40
	if len(v) > max {
		return string(v[:max]) + "..."
	}
	return string(v)
}

// jsonDataScanner walks the scalar elements of a JSON "data" value in row-major
// order, flattening nested arrays. Its input has already been checked by
// encoding/json, but it does not rely on that to stay in bounds.
type jsonDataScanner struct {
	buf      []byte
	pos      int
	depth    int
	maxDepth int
	done     bool
}

// errDataTruncated reports a data value that ended inside an array; encoding/json
// has normally refused such input already.
var errDataTruncated = errors.New("data ends inside an array")

// start positions the scanner inside the outermost array.
func (s *jsonDataScanner) start() error {
	s.skipSpace()
	if s.pos >= len(s.buf) || s.buf[s.pos] != '[' {
		return errors.New("data must be an array")
	}
	s.pos++
	s.depth = 1
	return nil
}

func (s *jsonDataScanner) skipSpace() {
	for s.pos < len(s.buf) {
		switch s.buf[s.pos] {
		case ' ', '\t', '\n', '\r':
			s.pos++
		default:
			return
		}
	}
}

// next returns the next scalar token (a string with its quotes, a number, or
// a literal), or ok == false after the outermost array has closed.
func (s *jsonDataScanner) next() (tok []byte, ok bool, err error) {
	for {
		if s.done {
			return nil, false, nil
		}
		s.skipSpace()
		if s.pos >= len(s.buf) {
			return nil, false, errDataTruncated
		}
		switch c := s.buf[s.pos]; c {
		case ',':
			s.pos++
		case '[':
			s.depth++
			if s.depth > s.maxDepth {
				return nil, false, fmt.Errorf("data nests arrays more than %d deep", s.maxDepth)
			}
			s.pos++
		case ']':
			s.depth--
			s.pos++
			if s.depth == 0 {
				s.done = true
				return nil, false, nil
			}
		case '{':
			return nil, false, errors.New("data holds an object")
		case '"':
			begin := s.pos
			s.pos++
			for s.pos < len(s.buf) && s.buf[s.pos] != '"' {
				if s.buf[s.pos] == '\\' {
					s.pos++
				}
				s.pos++
			}
			if s.pos >= len(s.buf) {
				return nil, false, errDataTruncated
			}
			s.pos++
			return s.buf[begin:s.pos], true, nil
		default:
			begin := s.pos
			for s.pos < len(s.buf) {
				c := s.buf[s.pos]
				if c == ',' || c == ']' || c == ' ' || c == '\t' || c == '\n' || c == '\r' {
					break
				}
				s.pos++
			}
			return s.buf[begin:s.pos], true, nil
		}
	}
}

// countJSONData counts the scalar elements of a data value, for error messages.
func countJSONData(raw []byte, maxDepth int) (int64, error) {
	s := jsonDataScanner{buf: raw, maxDepth: maxDepth}
	if err := s.start(); err != nil {
		return 0, err
	}
	var n int64
	for {
		_, ok, err := s.next()
		if err != nil {
			return 0, err
		}
		if !ok {
			return n, nil
		}
		n++
	}
}

// decodeJSONData converts the JSON "data" value of input name, holding n
// elements of type dt, into a tensor buffer. Arrays may nest at most maxDepth
// deep.
func decodeJSONData(name string, raw []byte, dt runtime.DataType, n int64, maxDepth int) ([]byte, error) {
	// Every element takes at least one byte and a separator, so a shape that
	// claims more elements than that cannot match: refuse it before
	// allocating for it.
	if n > int64(len(raw))/2+1 {
		return nil, jsonCountMismatch(name, raw, n, maxDepth)
	}
	if dt == runtime.FP32 {
		if out, ok := decodeFlatFP32(raw, n); ok {
			return out, nil
		}
	}
	return decodeJSONDataGeneral(name, raw, dt, n, maxDepth)
}

// decodeJSONDataGeneral is decodeJSONData for any data, element by element.
func decodeJSONDataGeneral(name string, raw []byte, dt runtime.DataType, n int64, maxDepth int) ([]byte, error) {
	s := jsonDataScanner{buf: raw, maxDepth: maxDepth}
	if err := s.start(); err != nil {
		return nil, restBadRequest("input %q: %v", name, err)
	}
	var out []byte
	if dt == runtime.Bytes {
		out = make([]byte, 0, 4*n+int64(len(raw)))
	} else {
		out = make([]byte, 0, n*int64(dt.Size()))
	}
	var i int64
	for ; ; i++ {
		tok, ok, err := s.next()
		if err != nil {
			return nil, restBadRequest("input %q: %v", name, err)
		}
		if !ok {
			break
		}
		if i == n {
			return nil, jsonCountMismatch(name, raw, n, maxDepth)
		}
		out, err = appendJSONElement(out, dt, tok)
		if err != nil {
			return nil, restBadRequest("input %q: element %d: %v", name, i, err)
		}
	}
	if i != n {
		return nil, jsonCountMismatch(name, raw, n, maxDepth)
	}
	return out, nil
}

// decodeFlatFP32 is decodeJSONData for the usual FP32 data: a flat array
// (checked against the JSON grammar already) of exactly n numbers that
// parseFloat32Fast takes, read in one loop into a new tensor buffer. For
// anything else it reports false, and the general path decodes (or refuses)
// the data as before.
func decodeFlatFP32(raw []byte, n int64) ([]byte, bool) {
	i := skipJSONSpace(raw, 0)
	if i >= len(raw) || raw[i] != '[' {
		return nil, false
	}
	i = skipJSONSpace(raw, i+1)
	if i < len(raw) && raw[i] == ']' {
		if n != 0 || skipJSONSpace(raw, i+1) != len(raw) {
			return nil, false
		}
		return make([]byte, 0), true
	}
	out := make([]byte, 4*n)
	var k int64
	for {
		begin := i
		for i < len(raw) && raw[i] != ',' && raw[i] != ']' && raw[i] != ' ' && raw[i] != '\t' && raw[i] != '\n' && raw[i] != '\r' {
			i++
		}
		if k == n {
			return nil, false
		}
		f, ok := parseFloat32Fast(raw[begin:i])
		if !ok {
			return nil, false
		}
		binary.LittleEndian.PutUint32(out[4*k:], math.Float32bits(f))
		k++
		i = skipJSONSpace(raw, i)
		if i >= len(raw) {
			return nil, false
		}
		if raw[i] == ']' {
			break
		}
		if raw[i] != ',' {
			return nil, false
		}
		i = skipJSONSpace(raw, i+1)
	}
	return out, k == n && skipJSONSpace(raw, i+1) == len(raw)
}

// skipJSONSpace returns the index of the first byte of b at or after i that
// is not JSON whitespace.
func skipJSONSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// jsonCountMismatch reports data whose element count does not match the shape.
func jsonCountMismatch(name string, raw []byte, want int64, maxDepth int) error {
	got, err := countJSONData(raw, maxDepth)
	if err != nil {
		return restBadRequest("input %q: %v", name, err)
	}
	return restBadRequest("input %q: shape needs %d elements but data has %d", name, want, got)
}

// appendJSONElement parses one scalar token as a dt element and appends it in
// the tensor layout.
func appendJSONElement(out []byte, dt runtime.DataType, tok []byte) ([]byte, error) {
	le := binary.LittleEndian
	switch dt {
	case runtime.Bool:
		switch string(tok) {
		case "true":
			return append(out, 1), nil
		case "false":
			return append(out, 0), nil
		}
		return out, jsonWrongKind(tok, dt, "true or false")
	case runtime.Bytes:
		if len(tok) < 2 || tok[0] != '"' {
			return out, jsonWrongKind(tok, dt, "strings")
		}
		if !utf8.Valid(tok) {
			return out, errors.New("the string is not valid UTF-8, which JSON text must be; send arbitrary BYTES with the binary tensor data extension")
		}
		at := len(out)
		out = append(out, 0, 0, 0, 0)
		out = appendJSONUnescaped(out, tok[1:len(tok)-1])
		le.PutUint32(out[at:], uint32(len(out)-at-4))
		return out, nil
	}
	if len(tok) == 0 || tok[0] != '-' && (tok[0] < '0' || tok[0] > '9') {
		return out, jsonWrongKind(tok, dt, "numbers")
	}
	switch dt {
	case runtime.Uint8, runtime.Uint16, runtime.Uint32, runtime.Uint64:
		bits := uint(dt.Size() * 8)
		neg, mag, err := parseJSONInteger(tok)
		if err == nil && (neg && mag != 0 || bits < 64 && mag >= 1<<bits) {
			err = errIntRange
		}
		if err != nil {
			return out, jsonIntError(tok, dt, err)
		}
		return appendUintLE(out, mag, dt.Size()), nil
	case runtime.Int8, runtime.Int16, runtime.Int32, runtime.Int64:
		bits := uint(dt.Size() * 8)
		neg, mag, err := parseJSONInteger(tok)
		limit := uint64(1) << (bits - 1) // -limit .. limit-1
		if err == nil && (!neg && mag >= limit || neg && mag > limit) {
			err = errIntRange
		}
		if err != nil {
			return out, jsonIntError(tok, dt, err)
		}
		v := mag
		if neg {
			v = -mag // two's complement
		}
		return appendUintLE(out, v, dt.Size()), nil
	case runtime.FP32:
		if f, ok := parseFloat32Fast(tok); ok {
			return le.AppendUint32(out, math.Float32bits(f)), nil
		}
		f, err := strconv.ParseFloat(string(tok), 32)
		if err != nil {
			return out, jsonFloatError(tok, dt, err)
		}
		return le.AppendUint32(out, math.Float32bits(float32(f))), nil
	case runtime.FP64:
		if f, ok := parseFloat64Fast(tok); ok {
			return le.AppendUint64(out, math.Float64bits(f)), nil
		}
		f, err := strconv.ParseFloat(string(tok), 64)
		if err != nil {
			return out, jsonFloatError(tok, dt, err)
		}
		return le.AppendUint64(out, math.Float64bits(f)), nil
	case runtime.FP16, runtime.BF16:
		f, err := strconv.ParseFloat(string(tok), 64)
		if err != nil {
			return out, jsonFloatError(tok, dt, err)
		}
		var h uint16
		if dt == runtime.FP16 {
			h = fp16FromFloat64(f)
		} else {
			h = bf16FromFloat64(f)
		}
		if h&0x7fff == halfInfBits(dt) {
			return out, fmt.Errorf("%s is out of range for %s", clipValue(tok), dt)
		}
		return le.AppendUint16(out, h), nil
	}
	return out, fmt.Errorf("datatype %s cannot be decoded", dt)
}

// readJSONDecimal reads a number token (checked against the JSON grammar
// already) with at most 19 significant digits as m * 10^exp; ok is false
// for any other token.
func readJSONDecimal(tok []byte) (neg bool, m uint64, exp int, ok bool) {
	i := 0
	neg = len(tok) > 0 && tok[0] == '-'
	if neg {
		i++
	}
	digits := 0
	for ; i < len(tok) && tok[i] >= '0' && tok[i] <= '9'; i++ {
		if m != 0 || tok[i] != '0' {
			digits++
		}
		m = m*10 + uint64(tok[i]-'0')
	}
	if i < len(tok) && tok[i] == '.' {
		for i++; i < len(tok) && tok[i] >= '0' && tok[i] <= '9'; i++ {
			if m != 0 || tok[i] != '0' {
				digits++
			}
			m = m*10 + uint64(tok[i]-'0')
			exp--
		}
	}
	if digits > 19 {
		return false, 0, 0, false
	}
	if i < len(tok) && (tok[i] == 'e' || tok[i] == 'E') {
		i++
		eneg := i < len(tok) && tok[i] == '-'
		if i < len(tok) && (tok[i] == '-' || tok[i] == '+') {
			i++
		}
		start, e := i, 0
		for ; i < len(tok) && tok[i] >= '0' && tok[i] <= '9' && e < 1000; i++ {
			e = e*10 + int(tok[i]-'0')
		}
		if i == start {
			return false, 0, 0, false
		}
		if eneg {
			e = -e
		}
		exp += e
	}
	if i != len(tok) || i == 0 || tok[i-1] == '-' {
		return false, 0, 0, false
	}
	return neg, m, exp, true
}

// parseFloat64Fast converts a JSON number token with at most 19 significant
// digits whose value is m * 10^e with m < 2^53 and |e| <= 22 (nearly every
// number a client writes) to the nearest float64: m and 10^e are exact
// float64s, so one multiplication or division rounds once, correctly
// (Clinger's fast path, as strconv takes it after a slower scan). ok is
// false for any other token; strconv.ParseFloat then decides.
func parseFloat64Fast(tok []byte) (f float64, ok bool) {
	neg, m, exp, ok := readJSONDecimal(tok)
	switch {
	case !ok:
		return 0, false
	case m == 0:
		f = 0
	case m >= 1<<53 || exp < -22 || exp > 22:
		return 0, false
	case exp >= 0:
		f = float64(m) * pow10Table[exp]
	default:
		f = float64(m) / pow10Table[-exp]
	}
	if neg {
		f = -f
	}
	return f, true
}

// float32Guard is how many float64 units in the last place from a float32
// midpoint parseFloat32Fast leaves to strconv when its float64 was rounded
// more than once (at most four times, each by half a unit: 2 units, 4 in
// the units of a lower binade).
const float32Guard = 8

// parseFloat32Fast converts a JSON number token with at most 19 significant
// digits to the nearest float32, through a float64 near the number. A
// float64 rounds to the float32 nearest the number unless the number and
// the float64 lie on two sides of a float32 midpoint (a value halfway
// between two float32s, which float64 represents): those float64s, the
// ones within float32Guard units of a midpoint (exactly on it when the
// float64 is the nearest to the number, as parseFloat64Fast's are), give ok
// false, as do values a float32 cannot hold and exponents past +-66.
// Python's json.dumps writes a float32 as the float64 it equals, in up to
// 17 digits (tritonclient's JSON requests): those take the rounded path
// here, not strconv.
func parseFloat32Fast(tok []byte) (float32, bool) {
	neg, m, exp, ok := readJSONDecimal(tok)
	if !ok {
		return 0, false
	}
	var f float64
	guard := uint64(0)
	switch {
	case m == 0:
	case m < 1<<53 && exp >= -22 && exp <= 22:
		// Exact operands: one correctly rounded operation.
		if exp >= 0 {
			f = float64(m) * pow10Table[exp]
		} else {
			f = float64(m) / pow10Table[-exp]
		}
	case exp >= -66 && exp <= 66:
		// m rounded to float64, then scaled by at most three exact powers
		// of ten: within 2 units of the number.
		f, guard = float64(m), float32Guard
		for exp > 0 {
			k := min(exp, 22)
			f *= pow10Table[k]
			exp -= k
		}
		for exp < 0 {
			k := min(-exp, 22)
			f /= pow10Table[k]
			exp += k
		}
	default:
		return 0, false
	}
	if low := math.Float64bits(f) & (1<<29 - 1); low+guard >= 1<<28 && low <= 1<<28+guard {
		return 0, false // at or near a float32 midpoint
	}
	if a := math.Abs(f); a != 0 && (a < math.SmallestNonzeroFloat32*(1<<23) || a > math.MaxFloat32) {
		return 0, false // subnormal or out of range: strconv decides
	}
	if neg {
		f = -f
	}
	return float32(f), true
}

// halfInfBits is the bit pattern of +Inf in a 16-bit floating-point type.
func halfInfBits(dt runtime.DataType) uint16 {
	if dt == runtime.FP16 {
		return 0x7c00
	}
	return 0x7f80
}

// jsonWrongKind reports a JSON value of the wrong kind for dt.
func jsonWrongKind(tok []byte, dt runtime.DataType, want string) error {
	kind := "a number"
	switch {
	case len(tok) > 0 && tok[0] == '"':
		kind = "a string"
	case string(tok) == "true" || string(tok) == "false":
		kind = "a boolean"
	case string(tok) == "null":
		return fmt.Errorf("null is not allowed; %s data must be %s", dt, want)
	}
	return fmt.Errorf("%s is %s; %s data must be %s", clipValue(tok), kind, dt, want)
}

// jsonFloatError explains a strconv.ParseFloat failure.
func jsonFloatError(tok []byte, dt runtime.DataType, err error) error {
	if errors.Is(err, strconv.ErrRange) {
		return fmt.Errorf("%s is out of range for %s", clipValue(tok), dt)
	}
	return fmt.Errorf("%s is not a valid %s number", clipValue(tok), dt)
}

// Why parseJSONInteger refused a number.
var (
	errNotInteger = errors.New("not an integer")
	errIntRange   = errors.New("out of range")
)

// parseJSONInteger parses a JSON number token that must hold an integer: its
// sign and magnitude. Numbers with a fraction or exponent are accepted when
// their value is integral (4.0, 1e3). It fails with errNotInteger or
// errIntRange.
func parseJSONInteger(tok []byte) (neg bool, mag uint64, err error) {
	digits := tok
	if len(digits) > 0 && digits[0] == '-' {
		neg, digits = true, digits[1:]
	}
	if len(digits) == 0 {
		return false, 0, errNotInteger
	}
	plain := true
	for _, c := range digits {
		if c < '0' || c > '9' {
			plain = false
			break
		}
		d := uint64(c - '0')
		if mag > (math.MaxUint64-d)/10 {
			return false, 0, errIntRange
		}
		mag = mag*10 + d
	}
	if plain {
		return neg, mag, nil
	}
	f, perr := strconv.ParseFloat(string(tok), 64)
	switch {
	case perr != nil && !errors.Is(perr, strconv.ErrRange):
		return false, 0, errNotInteger
	case perr != nil || math.Abs(f) >= 1<<64:
		return false, 0, errIntRange
	case f != math.Trunc(f):
		return false, 0, errNotInteger
	}
	return neg, uint64(math.Abs(f)), nil
}

// jsonIntError explains why tok is not a dt element.
func jsonIntError(tok []byte, dt runtime.DataType, err error) error {
	if err == errNotInteger {
		return fmt.Errorf("%s is not an integer; %s data must be integers", clipValue(tok), dt)
	}
	return fmt.Errorf("%s is out of range for %s", clipValue(tok), dt)
}

// appendUintLE appends the low size bytes of v, little-endian.
func appendUintLE(out []byte, v uint64, size int) []byte {
	for range size {
		out = append(out, byte(v))
		v >>= 8
	}
	return out
}

// appendJSONUnescaped appends the bytes of a JSON string body (without quotes),
// decoding its escapes. Other bytes are copied as they are.
func appendJSONUnescaped(out, s []byte) []byte {
	for len(s) > 0 {
		i := bytes.IndexByte(s, '\\')
		if i < 0 {
			return append(out, s...)
		}
		out = append(out, s[:i]...)
		s = s[i:]
		if len(s) < 2 {
			return append(out, s...) // not valid JSON; keep the byte
		}
		switch c := s[1]; c {
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			r, n := jsonUnescapeRune(s)
			out = utf8.AppendRune(out, r)
			s = s[n:]
			continue
		default: // '"', '\\', '/'
			out = append(out, c)
		}
		s = s[2:]
	}
	return out
}

// jsonUnescapeRune decodes the \uXXXX escape (or surrogate pair of escapes) at
// the start of s, returning the rune and the bytes used. Unpaired
// surrogates and malformed escapes give U+FFFD, as in encoding/json.
func jsonUnescapeRune(s []byte) (rune, int) {
	r, ok := jsonHex4(s)
	if !ok {
		return utf8.RuneError, 2
	}
	if r < 0xd800 || r > 0xdfff {
		return r, 6
	}
	if r < 0xdc00 && len(s) >= 12 && s[6] == '\\' && s[7] == 'u' {
		if lo, ok := jsonHex4(s[6:]); ok && lo >= 0xdc00 && lo <= 0xdfff {
			return 0x10000 + (r-0xd800)<<10 + (lo - 0xdc00), 12
		}
	}
	return utf8.RuneError, 6
}

// jsonHex4 parses the four hex digits of a \uXXXX escape at the start of s.
func jsonHex4(s []byte) (rune, bool) {
	if len(s) < 6 {
		return 0, false
	}
	var r rune
	for _, c := range s[2:6] {
		switch {
		case c >= '0' && c <= '9':
			c -= '0'
		case c >= 'a' && c <= 'f':
			c -= 'a' - 10
		case c >= 'A' && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, false
		}
		r = r<<4 | rune(c)
	}
	return r, true
}

// Half-precision conversions. FP16 is IEEE 754 binary16 (5 exponent bits,
// 10 fraction bits); BF16 is bfloat16 (8 exponent bits, 7 fraction bits).

func fp16FromFloat64(f float64) uint16 { return narrowFloat64(f, 5, 10) }
func bf16FromFloat64(f float64) uint16 { return narrowFloat64(f, 8, 7) }
func fp16ToFloat64(h uint16) float64   { return widenToFloat64(h, 5, 10) }
func bf16ToFloat64(h uint16) float64   { return widenToFloat64(h, 8, 7) }
func halfToFloat64(dt runtime.DataType, h uint16) float64 {
	if dt == runtime.FP16 {
		return fp16ToFloat64(h)
	}
	return bf16ToFloat64(h)
}

// narrowFloat64 rounds f to the nearest value of a binary floating-point
// format with expBits exponent bits and manBits fraction bits, ties to even,
// and returns its bit pattern. Values beyond the largest finite one become
// infinities; NaNs stay NaNs (quiet, keeping the top payload bits).
func narrowFloat64(f float64, expBits, manBits uint) uint16 {
	b := math.Float64bits(f)
	sign := uint16(b>>63) << (expBits + manBits)
	exp := int(b>>52) & 0x7ff
	frac := b & (1<<52 - 1)
	expMax := 1<<expBits - 1 // the exponent field of infinities and NaNs
	inf := sign | uint16(expMax)<<manBits
	switch exp {
	case 0x7ff:
		if frac == 0 {
			return inf
		}
		return inf | 1<<(manBits-1) | uint16(frac>>(52-manBits))
	case 0:
		return sign // zero, or a float64 subnormal: far below half the smallest target subnormal
	}
	bias := 1<<(expBits-1) - 1
	e := exp - 1023 + bias // the target's biased exponent
	sig := frac | 1<<52    // the significand with its leading one
	shift := 52 - manBits
	if e < 1 {
		// A subnormal of the target: its unit is the smallest subnormal.
		shift += uint(1 - e)
		if shift > 63 {
			return sign
		}
	}
	q := sig >> shift
	rem := sig & (1<<shift - 1)
	half := uint64(1) << (shift - 1)
	if rem > half || rem == half && q&1 == 1 {
		q++
	}
	if e < 1 {
		// q <= 1<<manBits; when rounding reaches it, it is the bit pattern of
		// the smallest normal number.
		return sign | uint16(q)
	}
	if q == 1<<(manBits+1) { // rounding carried into the exponent
		q >>= 1
		e++
	}
	if e >= expMax {
		return inf
	}
	return sign | uint16(e)<<manBits | uint16(q)&(1<<manBits-1)
}

// widenToFloat64 converts the bit pattern of a format with expBits exponent
// bits and manBits fraction bits to float64, exactly.
func widenToFloat64(h uint16, expBits, manBits uint) float64 {
	sign := uint64(h>>(expBits+manBits)) & 1
	exp := int(h>>manBits) & (1<<expBits - 1)
	frac := uint64(h) & (1<<manBits - 1)
	bias := 1<<(expBits-1) - 1
	switch exp {
	case 1<<expBits - 1:
		return math.Float64frombits(sign<<63 | 0x7ff<<52 | frac<<(52-manBits))
	case 0:
		v := math.Ldexp(float64(frac), 1-bias-int(manBits))
		if sign != 0 {
			v = -v
		}
		return v
	}
	return math.Float64frombits(sign<<63 | uint64(exp-bias+1023)<<52 | frac<<(52-manBits))
}

// Response encoding.

// restBufPool holds response buffers; oversized ones are dropped.
var restBufPool = sync.Pool{New: func() any {
	b := make([]byte, 0, 4096)
	return &b
}}

const restMaxPooledBuffer = 1 << 20

func getRESTBuffer() *[]byte { return restBufPool.Get().(*[]byte) }

// restBodyPool holds the buffers of JSON inference request bodies: a
// request decoded from JSON holds nothing of its body (tensors decoded from
// JSON are memory of their own), so the buffer can read the next body
// rather than be garbage, at every request, of tens of kilobytes.
var restBodyPool = sync.Pool{New: func() any { return new([]byte) }}

// restMaxPooledBody is the largest body buffer kept for reuse.
const restMaxPooledBody = 1 << 20

func getRESTBody() *[]byte { return restBodyPool.Get().(*[]byte) }

func putRESTBody(b *[]byte) {
	if cap(*b) > restMaxPooledBody {
		return
	}
	*b = (*b)[:0]
	restBodyPool.Put(b)
}

func putRESTBuffer(b *[]byte) {
	if cap(*b) > restMaxPooledBuffer {
		return
	}
	*b = (*b)[:0]
	restBufPool.Put(b)
}

// appendRESTResponse appends the JSON of an inference response to buf. It
// returns the data of the outputs sent in binary, in output order, to be
// written after the JSON; they share memory with outs. An output whose data
// does not match its datatype and shape is an internal error.
func appendRESTResponse(buf []byte, model, version string, req *restRequest, outs []runtime.Tensor) ([]byte, [][]byte, error) {
	var parts [][]byte
	buf = append(buf, `{"model_name":`...)
	buf = appendJSONString(buf, model)
	buf = append(buf, `,"model_version":`...)
	buf = appendJSONString(buf, version)
	if req.hasID {
		buf = append(buf, `,"id":`...)
		buf = appendJSONString(buf, req.id)
	}
	buf = append(buf, `,"outputs":[`...)
	for i := range outs {
		t := &outs[i]
		if i > 0 {
			buf = append(buf, ',')
		}
		n, err := checkOutputTensor(t)
		if err != nil {
			return buf, nil, err
		}
		buf = append(buf, `{"name":`...)
		buf = appendJSONString(buf, t.Name)
		buf = append(buf, `,"datatype":`...)
		buf = appendJSONString(buf, string(t.DataType))
		buf = append(buf, `,"shape":[`...)
		for k, d := range t.Shape {
			if k > 0 {
				buf = append(buf, ',')
			}
			buf = strconv.AppendInt(buf, d, 10)
		}
		buf = append(buf, ']')
		if target := req.shmTarget(t.Name); target != nil {
			written, err := target.write(t)
			if err != nil {
				return buf, nil, err
			}
			buf = appendRESTShmParams(buf, target, written)
			continue
		}
		if req.binaryOutput(t.Name) {
			buf = append(buf, `,"parameters":{"binary_data_size":`...)
			buf = strconv.AppendInt(buf, int64(len(t.Data)), 10)
			buf = append(buf, "}}"...)
			parts = append(parts, t.Data)
			continue
		}
		buf = append(buf, `,"data":`...)
		buf = appendJSONData(buf, t, n)
		buf = append(buf, '}')
	}
	buf = append(buf, "]}"...)
	return buf, parts, nil
}

// restResponseBound is the most bytes appendRESTResponse can write for
// outs: what to reserve before encoding them.
func restResponseBound(req *restRequest, outs []runtime.Tensor) int64 {
	n := int64(128 + 6*len(req.id))
	for i := range outs {
		t := &outs[i]
		n += 128 + 6*int64(len(t.Name)+len(t.DataType)) + 21*int64(len(t.Shape))
		if req.shmTarget(t.Name) != nil || req.binaryOutput(t.Name) {
			continue
		}
		if t.DataType == runtime.Bytes {
			// Each byte escaped at most 6 to 1, quotes and a separator per
			// element, whose 4-byte length prefix is not written.
			n += 6*int64(len(t.Data)) + 2
			continue
		}
		if info, _ := t.DataType.Info(); info.Size > 0 {
			n += int64(len(t.Data))/int64(info.Size)*int64(info.JSONMaxBytes) + 2
		}
	}
	return n
}

// outputBytes is the size of the outputs' data.
func outputBytes(outs []runtime.Tensor) int64 {
	var n int64
	for i := range outs {
		n += int64(len(outs[i].Data))
	}
	return n
}

// checkOutputTensor checks that an output's data matches its datatype and shape
// and returns its element count.
func checkOutputTensor(t *runtime.Tensor) (int64, error) {
	if !t.DataType.Valid() {
		return 0, fmt.Errorf("output %q has unknown datatype %q", t.Name, t.DataType)
	}
	n, err := runtime.ElementCount(t.Shape, 0)
	if err != nil {
		return 0, fmt.Errorf("output %q: %w", t.Name, err)
	}
	if t.DataType == runtime.Bytes {
		if err := runtime.CheckBytes(t.Data, n); err != nil {
			return 0, fmt.Errorf("output %q: %w", t.Name, err)
		}
		return n, nil
	}
	es := int64(t.DataType.Size())
	if int64(len(t.Data))%es != 0 || int64(len(t.Data))/es != n {
		return 0, fmt.Errorf("output %q has %d bytes of data; shape %v of %s needs %d", t.Name, len(t.Data), t.Shape, t.DataType, n*es)
	}
	return n, nil
}

// appendJSONData appends the flat JSON array of a tensor checked by checkOutputTensor.
func appendJSONData(buf []byte, t *runtime.Tensor, n int64) []byte {
	le := binary.LittleEndian
	data := t.Data
	buf = append(buf, '[')
	for i := range n {
		if i > 0 {
			buf = append(buf, ',')
		}
		switch t.DataType {
		case runtime.Bool:
			if data[i] != 0 {
				buf = append(buf, "true"...)
			} else {
				buf = append(buf, "false"...)
			}
		case runtime.Uint8:
			buf = strconv.AppendUint(buf, uint64(data[i]), 10)
		case runtime.Uint16:
			buf = strconv.AppendUint(buf, uint64(le.Uint16(data[2*i:])), 10)
		case runtime.Uint32:
			buf = strconv.AppendUint(buf, uint64(le.Uint32(data[4*i:])), 10)
		case runtime.Uint64:
			buf = strconv.AppendUint(buf, le.Uint64(data[8*i:]), 10)
		case runtime.Int8:
			buf = strconv.AppendInt(buf, int64(int8(data[i])), 10)
		case runtime.Int16:
			buf = strconv.AppendInt(buf, int64(int16(le.Uint16(data[2*i:]))), 10)
		case runtime.Int32:
			buf = strconv.AppendInt(buf, int64(int32(le.Uint32(data[4*i:]))), 10)
		case runtime.Int64:
			buf = strconv.AppendInt(buf, int64(le.Uint64(data[8*i:])), 10)
		case runtime.FP32:
			buf = appendJSONFloat(buf, float64(math.Float32frombits(le.Uint32(data[4*i:]))), 32)
		case runtime.FP64:
			buf = appendJSONFloat(buf, math.Float64frombits(le.Uint64(data[8*i:])), 64)
		case runtime.FP16, runtime.BF16:
			buf = appendJSONHalf(buf, t.DataType, le.Uint16(data[2*i:]))
		case runtime.Bytes:
			l := le.Uint32(data)
			buf = appendJSONString(buf, data[4:4+l])
			data = data[4+l:]
		}
	}
	return append(buf, ']')
}

// appendJSONFloat appends f as a JSON number with the fewest digits that read
// back as the same float of the given bit size, in plain notation unless the
// magnitude is tiny or huge (as encoding/json does). NaN and infinities are
// not JSON numbers and are written as null.
func appendJSONFloat(buf []byte, f float64, bits int) []byte {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return append(buf, "null"...)
	}
	abs := math.Abs(f)
	format := byte('f')
	if abs != 0 {
		if bits == 64 && (abs < 1e-6 || abs >= 1e21) || bits == 32 && (float32(abs) < 1e-6 || float32(abs) >= 1e21) {
			format = 'e'
		}
	}
	at := len(buf)
	buf = strconv.AppendFloat(buf, f, format, -1, bits)
	if format == 'e' {
		// Shorten e-09 to e-9.
		if n := len(buf) - at; n >= 4 && buf[len(buf)-4] == 'e' && buf[len(buf)-3] == '-' && buf[len(buf)-2] == '0' {
			buf[len(buf)-2] = buf[len(buf)-1]
			buf = buf[:len(buf)-1]
		}
	}
	return buf
}

// appendJSONHalf appends an FP16 or BF16 value as a JSON number with the
// fewest significant digits that convert back to the same bit pattern (as
// numpy prints them: an FP16 0.1 is written 0.1, 65504 is written 65500).
// NaN and infinities are written as null.
//
// For p = 1, 2, ... it takes the p-digit decimal nearest the value and stops
// at the first that narrows back to h; 16-bit formats need at most 5 digits.
// This is a few float operations per digit count, against a strconv format
// and parse per count in the obvious search (tested equal for every pattern).
func appendJSONHalf(buf []byte, dt runtime.DataType, h uint16) []byte {
	f := halfToFloat64(dt, h)
	switch {
	case math.IsNaN(f) || math.IsInf(f, 0):
		return append(buf, "null"...)
	case f == 0:
		return appendJSONFloat(buf, f, 64)
	}
	narrow := fp16FromFloat64
	if dt == runtime.BF16 {
		narrow = bf16FromFloat64
	}
	a := math.Abs(f)
	// The decimal exponent: 10^e <= a < 10^(e+1). Log10 may be one off next
	// to a power of ten.
	e := int(math.Floor(math.Log10(a)))
	if mulPow10(a, -e) < 1 {
		e--
	} else if mulPow10(a, -e) >= 10 {
		e++
	}
	for p := 1; p <= 17; p++ {
		x := e - p + 1 // the exponent of the last digit kept
		q := math.RoundToEven(mulPow10(a, -x))
		c := decimalFloat(q, x)
		if narrow(math.Copysign(c, f)) == h {
			return appendJSONFloat(buf, math.Copysign(c, f), 64)
		}
	}
	return appendJSONFloat(buf, f, 64) // exact; not reached for 16-bit formats
}

// pow10Table holds the powers of ten that float64 represents exactly.
var pow10Table = [...]float64{1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
	1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22}

// mulPow10 approximates a * 10^k.
func mulPow10(a float64, k int) float64 {
	switch {
	case k >= 0 && k < len(pow10Table):
		return a * pow10Table[k]
	case k < 0 && -k < len(pow10Table):
		return a / pow10Table[-k]
	}
	return a * math.Pow10(k)
}

// decimalFloat returns the float64 nearest q * 10^x for an integer q below
// 10^17.
func decimalFloat(q float64, x int) float64 {
	// With an exact power of ten this is one correctly rounded operation.
	switch {
	case x >= 0 && x < len(pow10Table):
		return q * pow10Table[x]
	case x < 0 && -x < len(pow10Table):
		return q / pow10Table[-x]
	}
	var scratch [40]byte
	text := strconv.AppendFloat(scratch[:0], q, 'f', 0, 64)
	text = append(text, 'e')
	text = strconv.AppendInt(text, int64(x), 10)
	c, _ := strconv.ParseFloat(string(text), 64) // q*10^x is within float64's range here
	return c
}

const jsonHexDigits = "0123456789abcdef"

// appendJSONString appends s as a JSON string. Invalid UTF-8 becomes U+FFFD;
// control characters and U+2028/U+2029 are escaped.
func appendJSONString[S string | []byte](buf []byte, s S) []byte {
	buf = append(buf, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			buf = append(buf, s[start:i]...)
			switch c {
			case '"', '\\':
				buf = append(buf, '\\', c)
			case '\n':
				buf = append(buf, '\\', 'n')
			case '\r':
				buf = append(buf, '\\', 'r')
			case '\t':
				buf = append(buf, '\\', 't')
			default:
				buf = append(buf, '\\', 'u', '0', '0', jsonHexDigits[c>>4], jsonHexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(string(s[i:min(i+utf8.UTFMax, len(s))]))
		switch {
		case r == utf8.RuneError && size == 1:
			buf = append(buf, s[start:i]...)
			buf = append(buf, `\ufffd`...)
		case r == '\u2028' || r == '\u2029':
			buf = append(buf, s[start:i]...)
			buf = append(buf, '\\', 'u', '2', '0', '2', jsonHexDigits[r&0xf])
		default:
			i += size
			continue
		}
		i += size
		start = i
	}
	buf = append(buf, s[start:]...)
	return append(buf, '"')
}
