package api

import (
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/sloserve/sloserve/api/inference"
)

// bytesAllocated is the heap allocated by n calls of f, per call.
func bytesAllocated(n int, f func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range n {
		f()
	}
	runtime.ReadMemStats(&after)
	return (after.TotalAlloc - before.TotalAlloc) / uint64(n)
}

// TestDecodersIgnoreDeclaredSizes: requests that declare tensors of tens of
// gigabytes, within a generous element limit, and send a few bytes are
// refused having allocated about what they sent, not what they declared.
func TestDecodersIgnoreDeclaredSizes(t *testing.T) {
	lim := Limits{MaxRequestBytes: 1 << 30, MaxTensorElements: 1 << 40}
	const declared = "[1073741824,10]" // 10.7e9 elements, 86 GB of FP64
	jsonBody := []byte(`{"inputs":[{"name":"x","datatype":"FP64","shape":` + declared + `,"data":[1]}]}`)
	binHeader := `{"inputs":[{"name":"x","datatype":"FP64","shape":` + declared + `,"parameters":{"binary_data_size":8}}]}`
	binBody := append([]byte(binHeader), make([]byte, 8)...)
	bytesBody := []byte(`{"inputs":[{"name":"s","datatype":"BYTES","shape":` + declared + `,"data":["` + strings.Repeat("a", 100) + `"]}]}`)
	type tensor = inference.ModelInferRequest_InferInputTensor
	rawMsg := &inference.ModelInferRequest{Inputs: []*tensor{{Name: "x", Datatype: "FP64", Shape: []int64{1 << 30, 10}}},
		RawInputContents: [][]byte{make([]byte, 8)}}
	typedMsg := &inference.ModelInferRequest{Inputs: []*tensor{{Name: "x", Datatype: "FP64", Shape: []int64{1 << 30, 10},
		Contents: &inference.InferTensorContents{Fp64Contents: []float64{1}}}}}
	bytesMsg := &inference.ModelInferRequest{Inputs: []*tensor{{Name: "s", Datatype: "BYTES", Shape: []int64{1 << 30, 10},
		Contents: &inference.InferTensorContents{BytesContents: [][]byte{[]byte("a")}}}}}

	for _, tc := range []struct {
		name   string
		decode func() error
	}{
		{"rest json", func() error { _, err := decodeRESTInfer(jsonBody, -1, lim); return err }},
		{"rest binary", func() error { _, err := decodeRESTInfer(binBody, int64(len(binHeader)), lim); return err }},
		{"rest json bytes", func() error { _, err := decodeRESTInfer(bytesBody, -1, lim); return err }},
		{"grpc raw", func() error { _, err := decodeGRPCInfer(rawMsg, lim, time.Now()); return err }},
		{"grpc typed", func() error { _, err := decodeGRPCInfer(typedMsg, lim, time.Now()); return err }},
		{"grpc bytes", func() error { _, err := decodeGRPCInfer(bytesMsg, lim, time.Now()); return err }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.decode(); err == nil {
				t.Fatal("a request with 10.7e9 elements and one value was accepted")
			}
			per := bytesAllocated(20, func() { _ = tc.decode() })
			t.Logf("%d bytes allocated per refusal", per)
			if per > 16<<10 {
				t.Errorf("%d bytes allocated per refusal, want under 16 KiB", per)
			}
		})
	}
}
