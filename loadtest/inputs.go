package loadtest

// Request inputs: a model's metadata (GET /v2/models/{m}) and a scenario's
// wishes for each input make the tensors every request of that model sends.
// The tensors are built once, before the run, so their cost never shows up
// in the generator's send path.

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"

	"github.com/sloserve/sloserve/runtime"
)

// TensorMeta is one input or output as GET /v2/models/{m} describes it. A
// dimension of -1 is dynamic.
type TensorMeta struct {
	Name     string  `json:"name"`
	DataType string  `json:"datatype"`
	Shape    []int64 `json:"shape"`
}

// ModelMeta is the body of GET /v2/models/{m}[/versions/{v}].
type ModelMeta struct {
	Name     string       `json:"name"`
	Versions []string     `json:"versions"`
	Inputs   []TensorMeta `json:"inputs"`
	Outputs  []TensorMeta `json:"outputs"`
}

// inputMaxMetadataBytes caps a body getJSON reads (metadata, control
// status, events).
const inputMaxMetadataBytes = 16 << 20

// FetchMetadata reads GET {baseURL}/v2/models/{model}, or
// /v2/models/{model}/versions/{version} when version is not empty. An error
// answer's error carries the status and the server's {"error": ...} text.
func FetchMetadata(ctx context.Context, hc *http.Client, baseURL, model, version string) (*ModelMeta, error) {
	u := strings.TrimRight(baseURL, "/") + "/v2/models/" + url.PathEscape(model)
	if version != "" {
		u += "/versions/" + url.PathEscape(version)
	}
	var md ModelMeta
	if err := getJSON(ctx, hc, u, &md); err != nil {
		return nil, fmt.Errorf("metadata of model %q: %w", model, err)
	}
	return &md, nil
}

// getJSON reads a JSON answer of the server into v. A status other than
// 200 is an error carrying the status and the server's {"error": ...} text;
// bodies over inputMaxMetadataBytes are refused.
// httpStatusError is an answer other than 200 OK.
type httpStatusError struct {
	code int
	msg  string
}

func (e *httpStatusError) Error() string { return e.msg }

func getJSON(ctx context.Context, hc *http.Client, u string, v any) error {
	if hc == nil {
		hc = http.DefaultClient
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, inputMaxMetadataBytes+1))
	if err != nil {
		return fmt.Errorf("reading the response: %w", err)
	}
	if len(body) > inputMaxMetadataBytes {
		return fmt.Errorf("the response has more than %d bytes", inputMaxMetadataBytes)
	}
	if resp.StatusCode != http.StatusOK {
		return &httpStatusError{code: resp.StatusCode, msg: fmt.Sprintf("%s: %s", resp.Status, clientErrorText(body))}
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("decoding the response: %w", err)
	}
	return nil
}

// InputSpec is how a scenario wants one input filled.
type InputSpec struct {
	// Shape is the concrete shape to send. It is required when the model
	// declares dynamic (-1) dimensions other than a leading batch dimension,
	// which defaults to 1; it must keep the declared rank and fixed sizes.
	Shape []int64
	// Data is "random" (the default: uniform in [0, 1) for floating-point
	// types, integers in [0, 16) for integer types, 0 or 1 for BOOL, and
	// strings of 1 to 16 random letters and digits for BYTES), "zeros" or
	// "ones" (for BYTES the strings "0" and "1").
	Data string
	// File names a file of raw little-endian tensor data to send instead;
	// its size must be the shape's element count times the element size.
	// Not supported for BYTES.
	File string
}

// Data fillings of InputSpec.
const (
	inputDataRandom = "random"
	inputDataZeros  = "zeros"
	inputDataOnes   = "ones"
)

// Tensor is one prepared request input.
type Tensor struct {
	Name     string
	DataType string
	Shape    []int64
	// Raw is the data, little-endian, as raw_input_contents and the REST
	// binary extension carry it: for BYTES, each element is a 4-byte
	// little-endian length followed by its bytes.
	Raw []byte
}

// inputMaxBytes caps the data of one input.
const inputMaxBytes = 1 << 30

// inputRandomIntLimit bounds random integers: small and non-negative, so
// they are valid indices for most models that take integers (token ids,
// class ids) and fit every integer type.
const inputRandomIntLimit = 16

// inputMaxRandomString bounds the length of random BYTES elements.
const inputMaxRandomString = 16

// inputElementSize is the size in bytes of one element of a datatype: 0 for
// BYTES, whose elements vary. ok is false for datatypes the load generator
// does not know.
func inputElementSize(dt string) (size int, ok bool) {
	info, ok := runtime.DataType(dt).Info()
	return info.Size, ok
}

// BuildInputs makes the inputs of one request to the model md, in md's input
// order. specs is keyed by input name; inputs it does not name are filled
// with random data in their declared shape (with a dynamic leading batch
// dimension of 1). Random data depends only on seed and the input's position.
//
// It fails on an input name that md does not have, a shape that does not
// keep the declared rank or fixed dimensions, dynamic dimensions left unset,
// an unknown datatype or filling, a file of the wrong size, and an input over
// 1 GiB.
func BuildInputs(md *ModelMeta, specs map[string]InputSpec, seed uint64) ([]Tensor, error) {
	if md == nil {
		return nil, errors.New("no model metadata")
	}
	var unknown []string
	for name := range specs {
		if !slices.ContainsFunc(md.Inputs, func(t TensorMeta) bool { return t.Name == name }) {
			unknown = append(unknown, name)
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		names := make([]string, len(md.Inputs))
		for i, t := range md.Inputs {
			names[i] = t.Name
		}
		return nil, fmt.Errorf("model %q has no input %q; its inputs are %q", md.Name, unknown[0], names)
	}

	out := make([]Tensor, 0, len(md.Inputs))
	for i, tm := range md.Inputs {
		t, err := inputBuild(tm, specs[tm.Name], rand.New(rand.NewPCG(seed, uint64(i))))
		if err != nil {
			return nil, fmt.Errorf("model %q: input %q: %w", md.Name, tm.Name, err)
		}
		out = append(out, t)
	}
	return out, nil
}

// inputBuild makes one input.
func inputBuild(tm TensorMeta, spec InputSpec, rng *rand.Rand) (Tensor, error) {
	size, ok := inputElementSize(tm.DataType)
	if !ok {
		return Tensor{}, fmt.Errorf("unsupported datatype %q", tm.DataType)
	}
	shape, err := inputShape(tm.Shape, spec.Shape)
	if err != nil {
		return Tensor{}, err
	}
	n, err := inputElementCount(shape)
	if err != nil {
		return Tensor{}, err
	}
	data := spec.Data
	switch {
	case spec.File != "" && data != "":
		return Tensor{}, fmt.Errorf("both data %q and file %q", spec.Data, spec.File)
	case spec.File != "" && size == 0:
		return Tensor{}, fmt.Errorf("file %q: BYTES inputs cannot be read from a file", spec.File)
	case data == "":
		data = inputDataRandom
	case data != inputDataRandom && data != inputDataZeros && data != inputDataOnes:
		return Tensor{}, fmt.Errorf("unknown data %q: want random, zeros or ones", spec.Data)
	}
	// The most bytes an element can take: BYTES elements are a 4-byte
	// length and a string of 1 (zeros, ones) to inputMaxRandomString bytes.
	elemMax := int64(size)
	switch {
	case size == 0 && data == inputDataRandom:
		elemMax = 4 + inputMaxRandomString
	case size == 0:
		elemMax = 5
	}
	if n > inputMaxBytes/elemMax {
		return Tensor{}, fmt.Errorf("shape %v of %s may take more than the %d bytes allowed", shape, tm.DataType, inputMaxBytes)
	}

	t := Tensor{Name: tm.Name, DataType: tm.DataType, Shape: shape}
	if spec.File != "" {
		t.Raw, err = inputReadFile(spec.File, n*int64(size), shape, tm.DataType)
		return t, err
	}
	if size == 0 {
		t.Raw = inputFillBytes(n, data, rng)
		return t, nil
	}
	t.Raw = make([]byte, n*int64(size))
	switch data {
	case inputDataOnes:
		inputFillOnes(t.Raw, tm.DataType)
	case inputDataRandom:
		inputFillRandom(t.Raw, tm.DataType, rng)
	}
	return t, nil
}

// inputShape is the concrete shape of an input declared with decl, from the
// spec's shape when it gives one.
func inputShape(decl, want []int64) ([]int64, error) {
	if want == nil {
		shape := slices.Clone(decl)
		for k, d := range decl {
			switch {
			case d >= 0:
			case k == 0:
				shape[0] = 1 // the batch dimension
			default:
				return nil, fmt.Errorf("dimension %d of shape %v is dynamic: the scenario must give the shape", k, decl)
			}
		}
		return shape, nil
	}
	if len(want) != len(decl) {
		return nil, fmt.Errorf("shape %v has rank %d; the model declares %v, rank %d", want, len(want), decl, len(decl))
	}
	for k, d := range want {
		switch {
		case d < 0:
			return nil, fmt.Errorf("shape %v: dimension %d is negative", want, k)
		case decl[k] >= 0 && d != decl[k]:
			return nil, fmt.Errorf("shape %v: dimension %d must be %d, as the model declares %v", want, k, decl[k], decl)
		}
	}
	return slices.Clone(want), nil
}

// inputElementCount multiplies the dimensions of a concrete shape, failing
// when the product overflows int64.
func inputElementCount(shape []int64) (int64, error) {
	if slices.Contains(shape, 0) {
		return 0, nil
	}
	n := int64(1)
	for _, d := range shape {
		if n > math.MaxInt64/d {
			return 0, fmt.Errorf("shape %v has more elements than an int64 counts", shape)
		}
		n *= d
	}
	return n, nil
}

// inputReadFile reads a file of raw tensor data that must hold exactly want
// bytes.
func inputReadFile(name string, want int64, shape []int64, dt string) ([]byte, error) {
	fi, err := os.Stat(name)
	if err != nil {
		return nil, err
	}
	if fi.Size() != want {
		return nil, fmt.Errorf("file %q has %d bytes; shape %v of %s needs %d", name, fi.Size(), shape, dt, want)
	}
	raw, err := os.ReadFile(name)
	if err != nil {
		return nil, err
	}
	if int64(len(raw)) != want {
		return nil, fmt.Errorf("file %q has %d bytes; shape %v of %s needs %d", name, len(raw), shape, dt, want)
	}
	return raw, nil
}

// inputFillOnes sets every element of raw to one.
func inputFillOnes(raw []byte, dt string) {
	le := binary.LittleEndian
	switch dt {
	case "BOOL", "UINT8", "INT8":
		for i := range raw {
			raw[i] = 1
		}
	case "UINT16", "INT16":
		for i := 0; i < len(raw); i += 2 {
			le.PutUint16(raw[i:], 1)
		}
	case "FP16":
		for i := 0; i < len(raw); i += 2 {
			le.PutUint16(raw[i:], 0x3c00)
		}
	case "BF16":
		for i := 0; i < len(raw); i += 2 {
			le.PutUint16(raw[i:], 0x3f80)
		}
	case "UINT32", "INT32":
		for i := 0; i < len(raw); i += 4 {
			le.PutUint32(raw[i:], 1)
		}
	case "FP32":
		for i := 0; i < len(raw); i += 4 {
			le.PutUint32(raw[i:], math.Float32bits(1))
		}
	case "UINT64", "INT64":
		for i := 0; i < len(raw); i += 8 {
			le.PutUint64(raw[i:], 1)
		}
	case "FP64":
		for i := 0; i < len(raw); i += 8 {
			le.PutUint64(raw[i:], math.Float64bits(1))
		}
	}
}

// inputFillRandom fills raw with random elements: uniform in [0, 1) for
// floating-point types, in [0, inputRandomIntLimit) for integers.
func inputFillRandom(raw []byte, dt string, rng *rand.Rand) {
	le := binary.LittleEndian
	switch dt {
	case "BOOL":
		for i := range raw {
			raw[i] = byte(rng.IntN(2))
		}
	case "UINT8", "INT8":
		for i := range raw {
			raw[i] = byte(rng.IntN(inputRandomIntLimit))
		}
	case "UINT16", "INT16":
		for i := 0; i < len(raw); i += 2 {
			le.PutUint16(raw[i:], uint16(rng.IntN(inputRandomIntLimit)))
		}
	case "UINT32", "INT32":
		for i := 0; i < len(raw); i += 4 {
			le.PutUint32(raw[i:], uint32(rng.IntN(inputRandomIntLimit)))
		}
	case "UINT64", "INT64":
		for i := 0; i < len(raw); i += 8 {
			le.PutUint64(raw[i:], uint64(rng.IntN(inputRandomIntLimit)))
		}
	case "FP16":
		for i := 0; i < len(raw); i += 2 {
			le.PutUint16(raw[i:], inputHalfFraction(uint32(rng.IntN(1<<11)), 11, 15, 10))
		}
	case "BF16":
		for i := 0; i < len(raw); i += 2 {
			le.PutUint16(raw[i:], inputHalfFraction(uint32(rng.IntN(1<<8)), 8, 127, 7))
		}
	case "FP32":
		for i := 0; i < len(raw); i += 4 {
			le.PutUint32(raw[i:], math.Float32bits(rng.Float32()))
		}
	case "FP64":
		for i := 0; i < len(raw); i += 8 {
			le.PutUint64(raw[i:], math.Float64bits(rng.Float64()))
		}
	}
}

// inputHalfFraction encodes k / 2^p, for 0 <= k < 2^p, as a 16-bit float
// with the given exponent bias and mantissa bits. p is the format's
// precision (mantissa bits + 1), so the value is exact.
func inputHalfFraction(k uint32, p, bias, mant int) uint16 {
	if k == 0 {
		return 0
	}
	e := bits.Len32(k) - 1 // k = 1.m * 2^e, the value 1.m * 2^(e-p)
	exp := uint16(e - p + bias)
	m := uint16(k<<(mant-e)) & (1<<mant - 1)
	return exp<<mant | m
}

// inputRandomChars are the characters of random BYTES elements: plain ASCII,
// so JSON carries them byte for byte.
const inputRandomChars = "abcdefghijklmnopqrstuvwxyz0123456789"

// inputFillBytes makes n BYTES elements with their length prefixes.
func inputFillBytes(n int64, data string, rng *rand.Rand) []byte {
	le := binary.LittleEndian
	switch data {
	case inputDataZeros, inputDataOnes:
		c := byte('0')
		if data == inputDataOnes {
			c = '1'
		}
		raw := make([]byte, 5*n)
		for i := int64(0); i < n; i++ {
			le.PutUint32(raw[5*i:], 1)
			raw[5*i+4] = c
		}
		return raw
	}
	raw := make([]byte, 0, n*(4+(1+inputMaxRandomString)/2))
	for range n {
		l := 1 + rng.IntN(inputMaxRandomString)
		raw = le.AppendUint32(raw, uint32(l))
		for range l {
			raw = append(raw, inputRandomChars[rng.IntN(len(inputRandomChars))])
		}
	}
	return raw
}
