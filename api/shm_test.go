package api

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/runtime"
)

// shmObject creates a POSIX shared-memory object of size bytes in /dev/shm
// for the test and returns its key ("/name"); it is removed when the test
// ends.
func shmObject(t testing.TB, size int) string {
	t.Helper()
	name := fmt.Sprintf("sloserve-test-%d-%s", os.Getpid(), strings.NewReplacer("/", "-", " ", "_").Replace(t.Name()))
	path := shmDir + "/" + name
	if err := os.WriteFile(path, make([]byte, size), 0o600); err != nil {
		t.Skipf("cannot create a shared memory object: %v", err)
	}
	t.Cleanup(func() { os.Remove(path) })
	// Readable and writable by others: the REST tests' callers
	// (httptest) cannot be identified, so only these bits count for them.
	if err := os.Chmod(path, 0o666); err != nil {
		t.Fatal(err)
	}
	return "/" + name
}

// shmWrite writes data at offset of the object key.
func shmWrite(t *testing.T, key string, offset int64, data []byte) {
	t.Helper()
	f, err := os.OpenFile(shmDir+key, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(data, offset); err != nil {
		t.Fatal(err)
	}
}

// shmRead reads n bytes at offset of the object key.
func shmRead(t *testing.T, key string, offset int64, n int) []byte {
	t.Helper()
	f, err := os.Open(shmDir + key)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, offset); err != nil {
		t.Fatal(err)
	}
	return b
}

// gaugeValue reads a gauge without labels from reg.
func gaugeValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// newTestSharedMemory returns a registry closed when the test ends.
func newTestSharedMemory(t testing.TB, opts SharedMemoryOptions) *SharedMemory {
	t.Helper()
	shm, err := NewSharedMemory(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(shm.Close)
	return shm
}

// newShmREST returns a REST handler with shared memory over b.
func newShmREST(t *testing.T, b Backend, opts SharedMemoryOptions) (http.Handler, *SharedMemory) {
	t.Helper()
	if opts.MaxRegions == 0 {
		opts.MaxRegions = 8
	}
	if opts.MaxBytes == 0 {
		opts.MaxBytes = 1 << 20
	}
	shm := newTestSharedMemory(t, opts)
	lim := restLimits
	lim.SharedMemory = shm
	return NewREST(b, lim, slog.New(slog.DiscardHandler)), shm
}

// shmCall serves one REST request from a loopback peer (or from remote).
func shmCall(t *testing.T, h http.Handler, method, path, body string, headers ...string) *httptest.ResponseRecorder {
	t.Helper()
	req := httptest.NewRequestWithContext(t.Context(), method, path, strings.NewReader(body))
	req.RemoteAddr = "127.0.0.1:40000"
	req.Host = "localhost:8000"
	for i := 0; i+1 < len(headers); i += 2 {
		switch headers[i] {
		case "RemoteAddr":
			req.RemoteAddr = headers[i+1]
			continue
		case "Host":
			req.Host = headers[i+1]
			continue
		}
		req.Header.Set(headers[i], headers[i+1])
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// wantREST fails unless rec has status, and for errors a message with msg.
func wantREST(t *testing.T, rec *httptest.ResponseRecorder, status int, msg string) {
	t.Helper()
	if rec.Code != status {
		t.Fatalf("status %d, want %d; body %s", rec.Code, status, rec.Body)
	}
	if msg != "" {
		if got := restErrorBody(t, rec); !strings.Contains(got, msg) {
			t.Fatalf("error %q, want it to contain %q", got, msg)
		}
	}
}

func registerBody(key string, offset, size uint64) string {
	return fmt.Sprintf(`{"key":%q,"offset":%d,"byte_size":%d}`, key, offset, size)
}

func TestSharedMemoryRegisterStatusUnregister(t *testing.T) {
	reg := prometheus.NewRegistry()
	h, shm := newShmREST(t, newFakeBackend(), SharedMemoryOptions{Registerer: reg})
	gauges := func() string {
		t.Helper()
		var b strings.Builder
		for _, name := range []string{"sloserve_shared_memory_regions", "sloserve_shared_memory_mapped_bytes"} {
			fmt.Fprintf(&b, "%s=%v ", name, gaugeValue(t, reg, name))
		}
		return b.String()
	}
	key := shmObject(t, 8192)

	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/in/register", registerBody(key, 0, 64)), 200, "")
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/out/register", registerBody(key, 4100, 100)), 200, "")
	rec := shmCall(t, h, "GET", "/v2/systemsharedmemory/status", "")
	wantREST(t, rec, 200, "")
	want := fmt.Sprintf(`[{"name":"in","key":%q,"offset":0,"byte_size":64},{"name":"out","key":%q,"offset":4100,"byte_size":100}]`, key, key)
	if !jsonEqual(t, rec.Body.Bytes(), []byte(want)) {
		t.Fatalf("status %s, want %s", rec.Body, want)
	}
	rec = shmCall(t, h, "GET", "/v2/systemsharedmemory/region/out/status", "")
	wantREST(t, rec, 200, "")
	if !strings.Contains(rec.Body.String(), `"name":"out"`) || strings.Contains(rec.Body.String(), `"name":"in"`) {
		t.Fatalf("status of out: %s", rec.Body)
	}
	if n, b := shm.Mapped(); n != 2 || b != 164 {
		t.Fatalf("mapped %d regions, %d bytes; want 2, 164", n, b)
	}
	if g := gauges(); g != "sloserve_shared_memory_regions=2 sloserve_shared_memory_mapped_bytes=164 " {
		t.Fatalf("gauges: %s", g)
	}
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/in/register", registerBody(key, 0, 64)), 400, "already registered")
	wantREST(t, shmCall(t, h, "GET", "/v2/systemsharedmemory/region/nope/status", ""), 400, `no region named "nope"`)
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/in/unregister", ""), 200, "")
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/in/unregister", ""), 400, `no region named "in"`)
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/unregister", ""), 200, "")
	if n, b := shm.Mapped(); n != 0 || b != 0 {
		t.Fatalf("after unregistering all: %d regions, %d bytes mapped", n, b)
	}
	if g := gauges(); g != "sloserve_shared_memory_regions=0 sloserve_shared_memory_mapped_bytes=0 " {
		t.Fatalf("gauges after unregistering: %s", g)
	}
	rec = shmCall(t, h, "GET", "/v2/systemsharedmemory/status", "")
	if rec.Code != 200 || strings.TrimSpace(rec.Body.String()) != "[]" {
		t.Fatalf("status after unregistering all: %d %s", rec.Code, rec.Body)
	}
}

func TestSharedMemoryRegisterHostile(t *testing.T) {
	h, _ := newShmREST(t, newFakeBackend(), SharedMemoryOptions{MaxRegions: 2, MaxBytes: 8192})
	key := shmObject(t, 4096)
	link := key + "-link"
	if err := os.Symlink(shmDir+key, shmDir+link); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(shmDir + link) })
	fifo := key + "-fifo"
	if err := syscall.Mkfifo(shmDir+fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(shmDir + fifo) })
	dir := key + "-dir"
	if err := os.Mkdir(shmDir+dir, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(shmDir + dir) })

	for _, tc := range []struct {
		name, body string
		status     int
		msg        string
	}{
		{"missing file", registerBody("/sloserve-test-no-such-object", 0, 8), 400, "does not exist"},
		{"symlink", registerBody(link, 0, 8), 400, "symbolic link"},
		{"fifo", registerBody(fifo, 0, 8), 400, "not a regular file"},
		{"directory", registerBody(dir, 0, 8), 400, ""},
		{"path outside /dev/shm", registerBody("/../etc/passwd", 0, 8), 400, "not a POSIX shared memory name"},
		{"nested path", registerBody("a/b", 0, 8), 400, "not a POSIX shared memory name"},
		{"dot dot", registerBody("..", 0, 8), 400, "not a POSIX shared memory name"},
		{"empty key", registerBody("", 0, 8), 400, "key must name"},
		{"no key", `{"byte_size":8}`, 400, "needs a key"},
		{"no byte_size", fmt.Sprintf(`{"key":%q}`, key), 400, "needs a byte_size"},
		{"zero size", registerBody(key, 0, 0), 400, "byte_size must be > 0"},
		{"offset beyond size", registerBody(key, 4096, 1), 400, "beyond the object's 4096 bytes"},
		{"size beyond object", registerBody(key, 0, 4097), 400, "beyond the object's 4096 bytes"},
		{"size overflow", registerBody(key, 16, math.MaxUint64-8), 400, "beyond any object's size"},
		{"offset overflow", registerBody(key, math.MaxUint64-8, 16), 400, "beyond any object's size"},
		{"negative offset", fmt.Sprintf(`{"key":%q,"offset":-1,"byte_size":8}`, key), 400, "offset"},
		{"unknown field", fmt.Sprintf(`{"key":%q,"byte_size":8,"raw_handle":{}}`, key), 400, "unknown field"},
		{"over the byte limit", registerBody(key, 0, 4096) + "", 200, ""},
		{"not from loopback", registerBody(key, 0, 8), 403, "loopback"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var hdr []string
			if tc.name == "not from loopback" {
				hdr = []string{"RemoteAddr", "192.0.2.7:5000"}
			}
			wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/r-"+strings.NewReplacer(" ", "-", "/", "-").Replace(tc.name)+"/register", tc.body, hdr...), tc.status, tc.msg)
		})
	}
	// One region of 4096 is registered: the byte limit (8192) allows
	// another 4096, not 4097; the region limit (2) allows one more.
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/big/register", registerBody(key, 0, 4096)), 200, "")
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/third/register", registerBody(key, 0, 1)), 400, "limits.max_shared_memory_regions")
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/unregister", ""), 200, "")
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/a/register", registerBody(key, 0, 4096)), 200, "")
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/b/register", registerBody(key, 0, 4096)), 200, "")
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/unregister", ""), 200, "")
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/a/register", registerBody(key, 0, 4096)), 200, "")
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/b/register", registerBody(key, 1, 4095)), 200, "")
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/b/unregister", ""), 200, "")
	big := shmObject(t, 8193)
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/b/register", registerBody(big, 0, 4097)), 400, "limits.max_shared_memory_bytes")
}

func TestSharedMemoryCUDAAndOff(t *testing.T) {
	h, _ := newShmREST(t, newFakeBackend(), SharedMemoryOptions{})
	// As Triton on a host without GPUs: no regions, unregister a no-op
	// (tritonclient.http posts an empty body with no Content-Type,
	// http/_client.py unregister_cuda_shared_memory), register refused.
	if rec := shmCall(t, h, "GET", "/v2/cudasharedmemory/status", ""); rec.Code != 200 || rec.Body.String() != "[]" {
		t.Fatalf("CUDA status: %d %s, want 200 []", rec.Code, rec.Body)
	}
	wantREST(t, shmCall(t, h, "GET", "/v2/cudasharedmemory/region/r/status", ""), 400, "Unable to find cuda shared memory region: 'r'")
	for _, p := range []string{"/v2/cudasharedmemory/unregister", "/v2/cudasharedmemory/region/r/unregister"} {
		if rec := shmCall(t, h, "POST", p, ""); rec.Code != 200 || rec.Body.String() != "{}" {
			t.Fatalf("%s: %d %s, want 200 {}", p, rec.Code, rec.Body)
		}
	}
	wantREST(t, shmCall(t, h, "POST", "/v2/cudasharedmemory/region/r/register", `{"raw_handle":{"b64":"AA=="},"device_id":0,"byte_size":8}`,
		"Content-Type", "application/json"), 400, "CUDA shared memory is not supported")
	rec := shmCall(t, h, "GET", "/v2", "")
	if !strings.Contains(rec.Body.String(), `"system_shared_memory"`) || strings.Contains(rec.Body.String(), "cuda") {
		t.Fatalf("server metadata with shared memory: %s", rec.Body)
	}

	off := NewREST(newFakeBackend(), restLimits, nil)
	wantREST(t, shmCall(t, off, "POST", "/v2/systemsharedmemory/region/r/register", registerBody("/x", 0, 8)), 400, "turned off")
	wantREST(t, shmCall(t, off, "GET", "/v2/systemsharedmemory/status", ""), 400, "turned off")
	if rec := shmCall(t, off, "GET", "/v2", ""); strings.Contains(rec.Body.String(), "shared_memory") {
		t.Fatalf("server metadata without shared memory: %s", rec.Body)
	}
}

func fp32Bytes(vals ...float32) []byte { return grpcFP32Bytes(vals...) }

// sumShmRequest asks the fake "sum" model for rows x 4 FP32 from region
// "in" and its output y into region "out".
func sumShmRequest(rows int, inParams, outParams string) string {
	return fmt.Sprintf(`{"inputs":[{"name":"x","datatype":"FP32","shape":[%d,4],"parameters":{%s}}],"outputs":[{"name":"y","parameters":{%s}},{"name":"count"}]}`,
		rows, inParams, outParams)
}

func TestSharedMemoryInferREST(t *testing.T) {
	h, _ := newShmREST(t, newFakeBackend(), SharedMemoryOptions{})
	key := shmObject(t, 4096)
	shmWrite(t, key, 128, fp32Bytes(1, 2, 3, 4, 10, 20, 30, 40))
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/in/register", registerBody(key, 100, 200)), 200, "")
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/out/register", registerBody(key, 1024, 64)), 200, "")

	body := sumShmRequest(2, `"shared_memory_region":"in","shared_memory_offset":28,"shared_memory_byte_size":32`,
		`"shared_memory_region":"out","shared_memory_offset":8,"shared_memory_byte_size":16`)
	rec := shmCall(t, h, "POST", "/v2/models/sum/infer", body)
	wantREST(t, rec, 200, "")
	want := `{"model_name":"sum","model_version":"1","outputs":[
		{"name":"y","datatype":"FP32","shape":[2],"parameters":{"shared_memory_region":"out","shared_memory_offset":8,"shared_memory_byte_size":8}},
		{"name":"count","datatype":"INT64","shape":[2],"data":[4,4]}]}`
	if !jsonEqual(t, rec.Body.Bytes(), []byte(want)) {
		t.Fatalf("response %s, want %s", rec.Body, want)
	}
	if got, want := shmRead(t, key, 1024+8, 8), fp32Bytes(10, 100); !bytes.Equal(got, want) {
		t.Fatalf("output region holds %v, want %v", got, want)
	}

	for _, tc := range []struct {
		name, in, out string
		msg           string
	}{
		{"unknown region", `"shared_memory_region":"nope","shared_memory_byte_size":32`, "", `no region named "nope"`},
		{"offset beyond region", `"shared_memory_region":"in","shared_memory_offset":200,"shared_memory_byte_size":32`, "", "beyond region"},
		{"size beyond region", `"shared_memory_region":"in","shared_memory_offset":180,"shared_memory_byte_size":32`, "", "beyond region"},
		{"offset overflow", `"shared_memory_region":"in","shared_memory_offset":18446744073709551600,"shared_memory_byte_size":32`, "", "beyond region"},
		{"size not the shape's", `"shared_memory_region":"in","shared_memory_byte_size":36`, "", "needs 32 bytes"},
		{"no byte size", `"shared_memory_region":"in"`, "", "needs shared_memory_byte_size"},
		{"no region", `"shared_memory_byte_size":32`, "", "need shared_memory_region"},
		{"region not a string", `"shared_memory_region":7,"shared_memory_byte_size":32`, "", "must be a string"},
		{"negative size", `"shared_memory_region":"in","shared_memory_byte_size":-32`, "", "non-negative integer"},
		{"output region too small", `"shared_memory_region":"in","shared_memory_offset":28,"shared_memory_byte_size":32`,
			`"shared_memory_region":"out","shared_memory_byte_size":4`, "its shared memory region \"out\" gives 4"},
		{"output unknown region", `"shared_memory_region":"in","shared_memory_offset":28,"shared_memory_byte_size":32`,
			`"shared_memory_region":"gone","shared_memory_byte_size":4`, `no region named "gone"`},
		{"output beyond region", `"shared_memory_region":"in","shared_memory_offset":28,"shared_memory_byte_size":32`,
			`"shared_memory_region":"out","shared_memory_offset":60,"shared_memory_byte_size":8`, "beyond region"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantREST(t, shmCall(t, h, "POST", "/v2/models/sum/infer", sumShmRequest(2, tc.in, tc.out)), 400, tc.msg)
		})
	}
	t.Run("binary_data false, as tritonclient sends it", func(t *testing.T) {
		// http/_requested_output.py set_shared_memory turns binary_data to
		// false and keeps it.
		shmWrite(t, key, 1024, make([]byte, 16))
		out := `"binary_data":false,"shared_memory_region":"out","shared_memory_byte_size":16`
		rec := shmCall(t, h, "POST", "/v2/models/sum/infer", sumShmRequest(2, `"shared_memory_region":"in","shared_memory_offset":28,"shared_memory_byte_size":32`, out))
		wantREST(t, rec, 200, "")
		if !strings.Contains(rec.Body.String(), `"parameters":{"shared_memory_region":"out","shared_memory_offset":0,"shared_memory_byte_size":8}`) {
			t.Fatalf("response %s", rec.Body)
		}
		if got, want := shmRead(t, key, 1024, 8), fp32Bytes(10, 100); !bytes.Equal(got, want) {
			t.Fatalf("output region holds %v, want %v", got, want)
		}
	})
	for _, tc := range []struct{ name, binary, msg string }{
		{"binary_data true and region", "true", "both binary_data true and shared_memory_region"},
		{"binary_data not a bool with region", `"no"`, "must be true or false"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := `"binary_data":` + tc.binary + `,"shared_memory_region":"out","shared_memory_byte_size":16`
			wantREST(t, shmCall(t, h, "POST", "/v2/models/sum/infer",
				sumShmRequest(2, `"shared_memory_region":"in","shared_memory_offset":28,"shared_memory_byte_size":32`, out)), 400, tc.msg)
		})
	}
	t.Run("data and region", func(t *testing.T) {
		body := `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4],"parameters":{"shared_memory_region":"in","shared_memory_byte_size":16}}]}`
		wantREST(t, shmCall(t, h, "POST", "/v2/models/sum/infer", body), 400, "both data and shared_memory_region")
	})
	t.Run("another credential's region", func(t *testing.T) {
		auth, err := NewAuth(AuthOptions{InferenceToken: "inference-token-0123456789", AdminToken: "admin-token-0123456789"}, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		h, _ := newShmREST(t, newFakeBackend(), SharedMemoryOptions{Auth: auth})
		inf := []string{"Authorization", "Bearer inference-token-0123456789"}
		adm := []string{"Authorization", "Bearer admin-token-0123456789"}
		wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/in/register", registerBody(key, 100, 200), inf...), 200, "")
		in := `"shared_memory_region":"in","shared_memory_offset":28,"shared_memory_byte_size":32`
		wantREST(t, shmCall(t, h, "POST", "/v2/models/sum/infer", sumShmRequest(2, in, ""), inf...), 200, "")
		wantREST(t, shmCall(t, h, "POST", "/v2/models/sum/infer", sumShmRequest(2, in, ""), adm...), 400, `no region named "in"`)
		wantREST(t, shmCall(t, h, "GET", "/v2/systemsharedmemory/region/in/status", "", adm...), 400, `no region named "in"`)
		wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/in/unregister", "", adm...), 400, `no region named "in"`)
		// The admin token has its own namespace: the same name is free there.
		wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/in/register", registerBody(key, 0, 8), adm...), 200, "")
		wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/unregister", "", adm...), 200, "")
		wantREST(t, shmCall(t, h, "POST", "/v2/models/sum/infer", sumShmRequest(2, in, ""), inf...), 200, "")
	})
}

func TestSharedMemoryBytesInput(t *testing.T) {
	h, _ := newShmREST(t, newFakeBackend(), SharedMemoryOptions{})
	key := shmObject(t, 4096)
	var elems []byte
	for _, s := range []string{"ab", "", "xyz"} {
		elems = runtime.AppendBytesElement(elems, []byte(s))
	}
	shmWrite(t, key, 0, elems)
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/s/register", registerBody(key, 0, 4096)), 200, "")
	req := func(size int) string {
		return fmt.Sprintf(`{"inputs":[{"name":"s","datatype":"BYTES","shape":[3],"parameters":{"shared_memory_region":"s","shared_memory_byte_size":%d}}]}`, size)
	}
	rec := shmCall(t, h, "POST", "/v2/models/echo/infer", req(len(elems)))
	wantREST(t, rec, 200, "")
	if !strings.Contains(rec.Body.String(), `"data":["ab","","xyz"]`) {
		t.Fatalf("BYTES from shared memory: %s", rec.Body)
	}
	wantREST(t, shmCall(t, h, "POST", "/v2/models/echo/infer", req(len(elems)-1)), 400, "shared memory data")
	wantREST(t, shmCall(t, h, "POST", "/v2/models/echo/infer", req(len(elems)+4)), 400, "shared memory data")
}

func TestSharedMemoryTruncatedObject(t *testing.T) {
	h, _ := newShmREST(t, newFakeBackend(), SharedMemoryOptions{})
	key := shmObject(t, 8192)
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/in/register", registerBody(key, 4096, 32)), 200, "")
	if err := os.Truncate(shmDir+key, 100); err != nil {
		t.Fatal(err)
	}
	in := `"shared_memory_region":"in","shared_memory_byte_size":32`
	wantREST(t, shmCall(t, h, "POST", "/v2/models/sum/infer", sumShmRequest(2, in, "")), 400, "truncated")
}

// shmBlockingBackend holds every Infer until release is closed, reading
// its inputs only then.
type shmBlockingBackend struct {
	*fakeBackend
	entered chan struct{}
	release chan struct{}
}

func (b *shmBlockingBackend) Infer(ctx context.Context, name, version string, req *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	b.entered <- struct{}{}
	<-b.release
	return b.fakeBackend.Infer(ctx, name, version, req)
}

func TestSharedMemoryUnregisterDuringRequest(t *testing.T) {
	b := &shmBlockingBackend{fakeBackend: newFakeBackend(), entered: make(chan struct{}, 1), release: make(chan struct{})}
	h, shm := newShmREST(t, b, SharedMemoryOptions{})
	key := shmObject(t, 4096)
	shmWrite(t, key, 0, fp32Bytes(1, 2, 3, 4))
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/in/register", registerBody(key, 0, 16)), 200, "")
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/out/register", registerBody(key, 64, 16)), 200, "")

	done := make(chan *httptest.ResponseRecorder)
	go func() {
		done <- shmCall(t, h, "POST", "/v2/models/sum/infer", sumShmRequest(1,
			`"shared_memory_region":"in","shared_memory_byte_size":16`, `"shared_memory_region":"out","shared_memory_byte_size":16`))
	}()
	select {
	case <-b.entered:
	case rec := <-done:
		t.Fatalf("the request ended before reaching the backend: %d %s", rec.Code, rec.Body)
	}
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/unregister", ""), 200, "")
	if n, bytes := shm.Mapped(); n != 0 || bytes != 32 {
		t.Fatalf("during the request: %d regions registered, %d bytes mapped; want 0 and 32 (still mapped)", n, bytes)
	}
	// The name is free at once, and the request keeps its mapping.
	wantREST(t, shmCall(t, h, "POST", "/v2/models/sum/infer", sumShmRequest(1, `"shared_memory_region":"in","shared_memory_byte_size":16`, "")), 400, `no region named "in"`)
	close(b.release)
	rec := <-done
	wantREST(t, rec, 200, "")
	if got, want := shmRead(t, key, 64, 4), fp32Bytes(10); !bytes.Equal(got, want) {
		t.Fatalf("output region holds %v, want %v (the sum of the inputs read after unregistering)", got, want)
	}
	if n, bytes := shm.Mapped(); n != 0 || bytes != 0 {
		t.Fatalf("after the request: %d regions, %d bytes mapped", n, bytes)
	}
}

// startShmGRPC serves b with shared memory on a loopback TCP listener.
func startShmGRPC(t *testing.T, b Backend) (inference.GRPCInferenceServiceClient, *SharedMemory) {
	t.Helper()
	shm, err := NewSharedMemory(SharedMemoryOptions{MaxRegions: 8, MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	lim := restLimits
	lim.SharedMemory = shm
	srv := NewGRPC(b, lim, slog.New(slog.DiscardHandler))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
		<-done
		shm.Close()
	})
	return inference.NewGRPCInferenceServiceClient(conn), shm
}

func shmParam(region string, offset, size int64) map[string]*inference.InferParameter {
	p := map[string]*inference.InferParameter{
		paramShmRegion: {ParameterChoice: &inference.InferParameter_StringParam{StringParam: region}},
		paramShmSize:   {ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: size}},
	}
	if offset != 0 {
		p[paramShmOffset] = &inference.InferParameter{ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: offset}}
	}
	return p
}

func TestSharedMemoryGRPC(t *testing.T) {
	c, shm := startShmGRPC(t, newFakeBackend())
	ctx := t.Context()
	key := shmObject(t, 4096)
	shmWrite(t, key, 16, fp32Bytes(1, 2, 3, 4, 5, 6, 7, 8))

	md, err := c.ServerMetadata(ctx, &inference.ServerMetadataRequest{})
	if err != nil || !strings.Contains(strings.Join(md.GetExtensions(), ","), "system_shared_memory") {
		t.Fatalf("server metadata %v, %v", md.GetExtensions(), err)
	}
	if _, err := c.SystemSharedMemoryRegister(ctx, &inference.SystemSharedMemoryRegisterRequest{Name: "in", Key: key, Offset: 16, ByteSize: 32}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.SystemSharedMemoryRegister(ctx, &inference.SystemSharedMemoryRegisterRequest{Name: "out", Key: key, Offset: 512, ByteSize: 64}); err != nil {
		t.Fatal(err)
	}
	_, err = c.SystemSharedMemoryRegister(ctx, &inference.SystemSharedMemoryRegisterRequest{Name: "bad", Key: key, Offset: 4000, ByteSize: 200})
	wantGRPCCode(t, err, codes.InvalidArgument, "beyond the object's 4096 bytes")
	st, err := c.SystemSharedMemoryStatus(ctx, &inference.SystemSharedMemoryStatusRequest{})
	if err != nil || len(st.GetRegions()) != 2 || st.GetRegions()["in"].GetOffset() != 16 || st.GetRegions()["out"].GetByteSize() != 64 {
		t.Fatalf("status %v, %v", st, err)
	}
	_, err = c.SystemSharedMemoryStatus(ctx, &inference.SystemSharedMemoryStatusRequest{Name: "nope"})
	wantGRPCCode(t, err, codes.NotFound, `no region named "nope"`)

	// x from shared memory, y into it, count in the response; a second
	// input from raw_input_contents on the echo model shows the raw entries
	// skip the shared-memory input.
	resp, err := c.ModelInfer(ctx, &inference.ModelInferRequest{
		ModelName: "sum",
		Inputs:    []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{2, 4}, Parameters: shmParam("in", 0, 32)}},
		Outputs: []*inference.ModelInferRequest_InferRequestedOutputTensor{
			{Name: "y", Parameters: shmParam("out", 4, 8)}, {Name: "count"},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetRawOutputContents()) != 2 || len(resp.GetRawOutputContents()[0]) != 0 ||
		!bytes.Equal(resp.GetRawOutputContents()[1], grpcInt64Bytes(4, 4)) {
		t.Fatalf("raw outputs %v", resp.GetRawOutputContents())
	}
	if p := resp.GetOutputs()[0].GetParameters(); p[paramShmRegion].GetStringParam() != "out" || p[paramShmSize].GetInt64Param() != 8 {
		t.Fatalf("output parameters %v", p)
	}
	if got, want := shmRead(t, key, 516, 8), fp32Bytes(10, 26); !bytes.Equal(got, want) {
		t.Fatalf("output region holds %v, want %v", got, want)
	}
	resp, err = c.ModelInfer(ctx, &inference.ModelInferRequest{
		ModelName: "echo",
		Inputs: []*inference.ModelInferRequest_InferInputTensor{
			{Name: "a", Datatype: "FP32", Shape: []int64{2}, Parameters: shmParam("in", 8, 8)},
			{Name: "b", Datatype: "INT64", Shape: []int64{1}},
		},
		RawInputContents: [][]byte{grpcInt64Bytes(42)},
	})
	if err != nil {
		t.Fatal(err)
	}
	if raw := resp.GetRawOutputContents(); len(raw) != 2 || !bytes.Equal(raw[0], fp32Bytes(3, 4)) || !bytes.Equal(raw[1], grpcInt64Bytes(42)) {
		t.Fatalf("echo raw outputs %v", raw)
	}

	for _, tc := range []struct {
		name string
		req  *inference.ModelInferRequest
		code codes.Code
		msg  string
	}{
		{"unknown region", &inference.ModelInferRequest{ModelName: "sum",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{2, 4}, Parameters: shmParam("nope", 0, 32)}}},
			codes.InvalidArgument, `no region named "nope"`},
		{"beyond region", &inference.ModelInferRequest{ModelName: "sum",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{2, 4}, Parameters: shmParam("in", 16, 32)}}},
			codes.InvalidArgument, "beyond region"},
		{"negative offset", &inference.ModelInferRequest{ModelName: "sum",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{2, 4}, Parameters: shmParam("in", -16, 32)}}},
			codes.InvalidArgument, "must be >= 0"},
		{"size not the shape's", &inference.ModelInferRequest{ModelName: "sum",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1, 4}, Parameters: shmParam("in", 0, 32)}}},
			codes.InvalidArgument, "needs 16 bytes"},
		{"contents and region", &inference.ModelInferRequest{ModelName: "sum",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1, 4}, Parameters: shmParam("in", 0, 16),
				Contents: &inference.InferTensorContents{Fp32Contents: []float32{1, 2, 3, 4}}}}},
			codes.InvalidArgument, "both fp32_contents and shared_memory_region"},
		{"raw entries counted without shared memory inputs", &inference.ModelInferRequest{ModelName: "sum",
			Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{2, 4}, Parameters: shmParam("in", 0, 32)}},
			RawInputContents: [][]byte{fp32Bytes(1, 2, 3, 4, 5, 6, 7, 8)}},
			codes.InvalidArgument, "raw_input_contents has 1 entries for the 0 inputs not in shared memory"},
		// The same checks of datatype and shape as an input in the message.
		{"no datatype", &inference.ModelInferRequest{ModelName: "sum",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Shape: []int64{2, 4}, Parameters: shmParam("in", 0, 32)}}},
			codes.InvalidArgument, `input "x" has no datatype`},
		{"unknown datatype", &inference.ModelInferRequest{ModelName: "sum",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FLOAT32", Shape: []int64{2, 4}, Parameters: shmParam("in", 0, 32)}}},
			codes.InvalidArgument, `unknown datatype "FLOAT32"`},
		{"no shape", &inference.ModelInferRequest{ModelName: "sum",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Parameters: shmParam("in", 0, 32)}}},
			codes.InvalidArgument, `input "x" has no shape`},
		{"output region too small", &inference.ModelInferRequest{ModelName: "sum",
			Inputs:  []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{2, 4}, Parameters: shmParam("in", 0, 32)}},
			Outputs: []*inference.ModelInferRequest_InferRequestedOutputTensor{{Name: "y", Parameters: shmParam("out", 0, 4)}}},
			codes.InvalidArgument, `region "out" gives 4`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.ModelInfer(ctx, tc.req)
			wantGRPCCode(t, err, tc.code, tc.msg)
		})
	}

	_, err = c.CudaSharedMemoryRegister(ctx, &inference.CudaSharedMemoryRegisterRequest{Name: "g", RawHandle: []byte{1}, ByteSize: 8})
	wantGRPCCode(t, err, codes.InvalidArgument, "CUDA shared memory is not supported")
	// The rest as Triton without GPUs answers them.
	if st, err := c.CudaSharedMemoryStatus(ctx, &inference.CudaSharedMemoryStatusRequest{}); err != nil || len(st.GetRegions()) != 0 {
		t.Fatalf("CUDA status: %v %v, want no regions", st, err)
	}
	_, err = c.CudaSharedMemoryStatus(ctx, &inference.CudaSharedMemoryStatusRequest{Name: "g"})
	wantGRPCCode(t, err, codes.NotFound, "Unable to find cuda shared memory region: 'g'")
	for _, name := range []string{"", "g"} {
		if _, err := c.CudaSharedMemoryUnregister(ctx, &inference.CudaSharedMemoryUnregisterRequest{Name: name}); err != nil {
			t.Fatalf("CUDA unregister %q: %v, want a no-op", name, err)
		}
	}

	if _, err := c.SystemSharedMemoryUnregister(ctx, &inference.SystemSharedMemoryUnregisterRequest{Name: "in"}); err != nil {
		t.Fatal(err)
	}
	_, err = c.SystemSharedMemoryUnregister(ctx, &inference.SystemSharedMemoryUnregisterRequest{Name: "in"})
	wantGRPCCode(t, err, codes.NotFound, `no region named "in"`)
	if _, err := c.SystemSharedMemoryUnregister(ctx, &inference.SystemSharedMemoryUnregisterRequest{}); err != nil {
		t.Fatal(err)
	}
	if n, b := shm.Mapped(); n != 0 || b != 0 {
		t.Fatalf("after unregistering: %d regions, %d bytes", n, b)
	}
}

// TestSharedMemoryGRPCCredentials: a region is seen only with the token
// that registered it, and registering from a non-loopback peer is refused.
func TestSharedMemoryGRPCCredentials(t *testing.T) {
	auth, err := NewAuth(AuthOptions{InferenceToken: "inference-token-0123456789", AdminToken: "admin-token-0123456789"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	shm := newTestSharedMemory(t, SharedMemoryOptions{MaxRegions: 4, MaxBytes: 1 << 20, Auth: auth})
	key := shmObject(t, 4096)
	s := &grpcService{b: newFakeBackend(), lim: Limits{SharedMemory: shm}, logger: slog.New(slog.DiscardHandler)}
	withToken := func(token string) context.Context {
		return metadata.NewIncomingContext(t.Context(), metadata.Pairs("authorization", "Bearer "+token))
	}
	// No peer in the context: not loopback.
	_, err = s.SystemSharedMemoryRegister(withToken("inference-token-0123456789"), &inference.SystemSharedMemoryRegisterRequest{Name: "r", Key: key, ByteSize: 8})
	wantGRPCCode(t, err, codes.PermissionDenied, "loopback")
	if err := shm.Register("Bearer inference-token-0123456789", localCaller(), "r", key, 0, 8); err != nil {
		t.Fatal(err)
	}
	st, err := s.SystemSharedMemoryStatus(withToken("admin-token-0123456789"), &inference.SystemSharedMemoryStatusRequest{})
	if err != nil || len(st.GetRegions()) != 0 {
		t.Fatalf("the admin token sees %v, %v; want no regions", st.GetRegions(), err)
	}
	st, err = s.SystemSharedMemoryStatus(withToken("inference-token-0123456789"), &inference.SystemSharedMemoryStatusRequest{})
	if err != nil || len(st.GetRegions()) != 1 {
		t.Fatalf("the inference token sees %v, %v; want r", st.GetRegions(), err)
	}
}

// TestSharedMemoryStragglerReadsZeros: once the last reference is gone,
// the region's address range holds zero pages, so an execution that
// outlived its request reads zeros rather than faulting.
func TestSharedMemoryStragglerReadsZeros(t *testing.T) {
	shm := newTestSharedMemory(t, SharedMemoryOptions{MaxRegions: 1, MaxBytes: 1 << 20})
	key := shmObject(t, 4096)
	shmWrite(t, key, 0, []byte{1, 2, 3, 4})
	if err := shm.Register("", localCaller(), "r", key, 0, 4); err != nil {
		t.Fatal(err)
	}
	u := &shmUse{s: shm}
	data, err := u.input("x", runtime.Uint8, []int64{4}, 4, shmParams{region: "r", size: 4})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(data, []byte{1, 2, 3, 4}) {
		t.Fatalf("input %v", data)
	}
	if err := shm.Unregister("", ""); err != nil {
		t.Fatal(err)
	}
	if data[2] != 3 {
		t.Fatal("unmapped under a request that still holds the region")
	}
	u.release()
	if !bytes.Equal(data, make([]byte, 4)) {
		t.Fatalf("a late reader sees %v, want zeros", data)
	}
	if got := shmRead(t, key, 0, 4); !bytes.Equal(got, []byte{1, 2, 3, 4}) {
		t.Fatalf("the object itself changed: %v", got)
	}
}

// TestSharedMemoryTruncatedUnderWrite: an object truncated after the
// request's checks makes the output copy fault (SIGBUS); that is an error
// for the request, not a crash of the server.
func TestSharedMemoryTruncatedUnderWrite(t *testing.T) {
	shm := newTestSharedMemory(t, SharedMemoryOptions{MaxRegions: 1, MaxBytes: 1 << 20})
	key := shmObject(t, 3*4096)
	if err := shm.Register("", localCaller(), "out", key, 4096, 8192); err != nil {
		t.Fatal(err)
	}
	u := &shmUse{s: shm}
	defer u.release()
	target, err := u.output("y", shmParams{region: "out", size: 8192})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(shmDir+key, 0); err != nil {
		t.Fatal(err)
	}
	out := runtime.Tensor{Name: "y", DataType: runtime.Uint8, Shape: []int64{8192}, Data: bytes.Repeat([]byte{7}, 8192)}
	_, err = target.write(&out)
	if !errors.Is(err, runtime.ErrMappedFault) || !errors.Is(err, errBadRequest) || !strings.Contains(err.Error(), "truncated under its mapping") {
		t.Fatalf("write into a truncated object: %v, want a fault turned into an error", err)
	}
}

// TestSharedMemoryFromBrowsers: a web page on the server's host must not
// make the server map, read or write the host's shared memory: the calls
// get the admin calls' browser checks.
func TestSharedMemoryFromBrowsers(t *testing.T) {
	auth, err := NewAuth(AuthOptions{AdminToken: "admin-token-0123456789"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	shm := newTestSharedMemory(t, SharedMemoryOptions{MaxRegions: 4, MaxBytes: 1 << 20, Auth: auth})
	lim := restLimits
	lim.SharedMemory = shm
	h := NewREST(newFakeBackend(), lim, slog.New(slog.DiscardHandler), auth.REST())
	key := shmObject(t, 4096)
	register := "/v2/systemsharedmemory/region/r/register"
	json := []string{"Content-Type", "application/json"}
	for _, tc := range []struct {
		name    string
		headers []string
		status  int
		msg     string
	}{
		{"cross-site fetch", append([]string{"Sec-Fetch-Site", "cross-site"}, json...), 403, "shared memory calls from a web page of another site"},
		{"other origin", append([]string{"Origin", "http://evil.example"}, json...), 403, "another origin"},
		{"rebound host name", append([]string{"Host", "evil.example:8000"}, json...), 403, "DNS-rebinding"},
		{"a page's text/plain post", []string{"Content-Type", "text/plain", "Sec-Fetch-Site", "same-origin"}, 415, "Content-Type: application/json"},
		{"same origin", append([]string{"Origin", "http://localhost:8000"}, json...), 200, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantREST(t, shmCall(t, h, "POST", register, registerBody(key, 0, 64), tc.headers...), tc.status, tc.msg)
		})
	}
	// Triton's clients register with no Content-Type (tritonclient.http)
	// or a non-JSON one (tritonclient.http.aio), and no browser headers.
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/t/register", registerBody(key, 0, 64),
		"User-Agent", "python/gevent-http-client-2.0"), 200, "")
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/u/register", registerBody(key, 0, 64),
		"Content-Type", "text/plain; charset=utf-8"), 200, "")
	// The region registered above, named by a page's inference request.
	body := sumShmRequest(1, `"shared_memory_region":"r","shared_memory_byte_size":16`, "")
	wantREST(t, shmCall(t, h, "POST", "/v2/models/sum/infer", body, "Sec-Fetch-Site", "cross-site"), 403, "another site")
	wantREST(t, shmCall(t, h, "POST", "/v2/models/sum/infer", body, "Host", "evil.example"), 403, "DNS-rebinding")
	wantREST(t, shmCall(t, h, "POST", "/v2/models/sum/infer", body), 200, "")
	// Inference without shared memory is not affected.
	wantREST(t, shmCall(t, h, "POST", "/v2/models/sum/infer", `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}`,
		"Sec-Fetch-Site", "cross-site"), 200, "")
}

// localCaller is a caller on the server's host with the test's own uid.
func localCaller() shmCaller { return shmCaller{loopback: true, uid: os.Geteuid()} }
