package api

import (
	"os"
	"testing"
	"time"
	"unsafe"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/runtime"
)

// shmFuzzRegion registers region "r": 64 bytes at offset 4090 of an object
// of two pages, so that the region straddles a page boundary.
func shmFuzzRegion(f *testing.F) (*SharedMemory, *shmRegion) {
	shm := newTestSharedMemory(f, SharedMemoryOptions{MaxRegions: 1, MaxBytes: 1 << 20})
	key := shmObject(f, 8192)
	if err := shm.Register("", localCaller(), "r", key, 4090, 64); err != nil {
		f.Fatal(err)
	}
	// Fuzzing workers are killed without their cleanups: the mapping and
	// the open file keep the object alive without its name.
	if err := os.Remove(shmDir + key); err != nil {
		f.Fatal(err)
	}
	return shm, shm.spaces[""]["r"]
}

// checkShmAliases fails unless every tensor that points into r's mapping
// lies within the region's bytes.
func checkShmAliases(t *testing.T, r *shmRegion, inputs []runtime.Tensor) {
	t.Helper()
	mapStart := uintptr(unsafe.Pointer(unsafe.SliceData(r.mapping)))
	mapEnd := mapStart + uintptr(len(r.mapping))
	regStart := uintptr(unsafe.Pointer(unsafe.SliceData(r.data)))
	regEnd := regStart + uintptr(len(r.data))
	for _, in := range inputs {
		if len(in.Data) == 0 {
			continue
		}
		p := uintptr(unsafe.Pointer(unsafe.SliceData(in.Data)))
		if p >= mapStart && p < mapEnd && (p < regStart || p+uintptr(len(in.Data)) > regEnd) {
			t.Fatalf("input %q has %d bytes at %#x, outside region [%#x, %#x)", in.Name, len(in.Data), p, regStart, regEnd)
		}
	}
}

// FuzzSharedMemoryREST decodes arbitrary REST requests with shared memory
// on: no panic, no tensor outside the region, refusals are client errors.
func FuzzSharedMemoryREST(f *testing.F) {
	for _, s := range []string{
		`{"inputs":[{"name":"x","datatype":"FP32","shape":[2,4],"parameters":{"shared_memory_region":"r","shared_memory_byte_size":32}}]}`,
		`{"inputs":[{"name":"x","datatype":"FP32","shape":[2,4],"parameters":{"shared_memory_region":"r","shared_memory_offset":32,"shared_memory_byte_size":32}}]}`,
		`{"inputs":[{"name":"x","datatype":"UINT8","shape":[64],"parameters":{"shared_memory_region":"r","shared_memory_offset":1,"shared_memory_byte_size":64}}]}`,
		`{"inputs":[{"name":"x","datatype":"UINT8","shape":[0],"parameters":{"shared_memory_region":"r","shared_memory_offset":64,"shared_memory_byte_size":0}}]}`,
		`{"inputs":[{"name":"s","datatype":"BYTES","shape":[2],"parameters":{"shared_memory_region":"r","shared_memory_byte_size":8}}]}`,
		`{"inputs":[{"name":"x","datatype":"INT8","shape":[8],"parameters":{"shared_memory_region":"r","shared_memory_offset":18446744073709551615,"shared_memory_byte_size":8}}]}`,
		`{"inputs":[{"name":"x","datatype":"INT8","shape":[1],"data":[1]}],"outputs":[{"name":"y","parameters":{"shared_memory_region":"r","shared_memory_offset":60,"shared_memory_byte_size":8}}]}`,
		`{"inputs":[{"name":"x","datatype":"INT8","shape":[1],"parameters":{"shared_memory_region":"q","shared_memory_byte_size":1}}]}`,
	} {
		f.Add(s)
	}
	shm, r := shmFuzzRegion(f)
	lim := Limits{MaxRequestBytes: 1 << 12, MaxTensorElements: 64}
	f.Fuzz(func(t *testing.T, body string) {
		u := &shmUse{s: shm}
		defer u.release()
		req, err := decodeRESTInferShm([]byte(body), -1, lim, u)
		if err != nil {
			if status, _ := statusOf(err); status >= 500 {
				t.Fatalf("refusal %v is a server error (%d)", err, status)
			}
			return
		}
		checkShmAliases(t, r, req.inputs)
		for _, target := range req.shm {
			checkShmAliases(t, r, []runtime.Tensor{{Name: target.name, Data: target.dst}})
		}
	})
}

// FuzzSharedMemoryGRPC is FuzzSharedMemoryREST for ModelInferRequest.
func FuzzSharedMemoryGRPC(f *testing.F) {
	type input = inference.ModelInferRequest_InferInputTensor
	for _, s := range []*inference.ModelInferRequest{
		{Inputs: []*input{{Name: "x", Datatype: "FP32", Shape: []int64{2, 4}, Parameters: shmParam("r", 0, 32)}}},
		{Inputs: []*input{{Name: "x", Datatype: "UINT8", Shape: []int64{64}, Parameters: shmParam("r", 1, 64)}}},
		{Inputs: []*input{{Name: "x", Datatype: "INT8", Shape: []int64{8}, Parameters: shmParam("r", -8, 8)}}},
		{Inputs: []*input{
			{Name: "x", Datatype: "INT8", Shape: []int64{8}, Parameters: shmParam("r", 56, 8)},
			{Name: "y", Datatype: "INT8", Shape: []int64{1}},
		}, RawInputContents: [][]byte{{1}}},
		{Inputs: []*input{{Name: "s", Datatype: "BYTES", Shape: []int64{1}, Parameters: shmParam("r", 0, 6)}}},
	} {
		b, err := proto.Marshal(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	shm, r := shmFuzzRegion(f)
	lim := Limits{MaxRequestBytes: 1 << 12, MaxTensorElements: 64}
	f.Fuzz(func(t *testing.T, data []byte) {
		var msg inference.ModelInferRequest
		if err := proto.Unmarshal(data, &msg); err != nil {
			t.Skip()
		}
		u := &shmUse{s: shm}
		defer u.release()
		req, targets, err := decodeGRPCInferShm(&msg, lim, time.Now(), u)
		if err != nil {
			if _, code := statusOf(err); code == codes.Internal || code == codes.Unknown {
				t.Fatalf("refusal %v is %s", err, code)
			}
			return
		}
		checkShmAliases(t, r, req.Inputs)
		for _, target := range targets {
			checkShmAliases(t, r, []runtime.Tensor{{Name: target.name, Data: target.dst}})
		}
	})
}
