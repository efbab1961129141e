package api

import (
	"bytes"
	"compress/gzip"
	"compress/zlib"
	"log/slog"
	"runtime"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/sloserve/sloserve/api/inference"
)

// gzipped and zlibbed compress b as Python's gzip.compress and
// zlib.compress do, which tritonclient.http applies to a request body
// (http/_client.py infer).
func gzipped(t testing.TB, b []byte) string {
	var buf bytes.Buffer
	w := gzip.NewWriter(&buf)
	if _, err := w.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.String()
}

func zlibbed(t testing.TB, b []byte) string {
	var buf bytes.Buffer
	w := zlib.NewWriter(&buf)
	if _, err := w.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.String()
}

// zipBomb is n zero bytes gzipped (about n/1000 bytes).
func zipBomb(t testing.TB, n int) string {
	var buf bytes.Buffer
	w, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	zeros := make([]byte, 1<<20)
	for n > 0 {
		k := min(n, len(zeros))
		if _, err := w.Write(zeros[:k]); err != nil {
			t.Fatal(err)
		}
		n -= k
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.String()
}

// TestRESTCompressedBody: bodies in gzip and deflate, JSON and binary, as
// tritonclient.http sends them (Content-Encoding, and the
// Inference-Header-Content-Length of the uncompressed JSON), are answered
// as the same bodies uncompressed; admin bodies decompress too.
func TestRESTCompressedBody(t *testing.T) {
	h, _ := newRESTTest(restLimits)
	jsonBody := `{"inputs":[{"name":"x","datatype":"FP32","shape":[2,4],"data":[1,2,3,4,5,6,7,8]}]}`
	binBody, binHdr := binaryRequest(`{"inputs":[{"name":"x","datatype":"FP32","shape":[2,4],"parameters":{"binary_data_size":32}}]}`,
		f32s(1, 2, 3, 4, 5, 6, 7, 8))
	plain := restCall{path: "/v2/models/sum/infer", body: jsonBody}.do(t, t.Context(), h)
	if plain.Code != 200 {
		t.Fatalf("uncompressed: %d %s", plain.Code, plain.Body)
	}
	for _, tc := range []struct {
		name, enc, body string
		hdr             map[string]string
	}{
		{"gzip JSON", "gzip", gzipped(t, []byte(jsonBody)), nil},
		{"deflate JSON", "deflate", zlibbed(t, []byte(jsonBody)), nil},
		{"gzip binary", "gzip", gzipped(t, []byte(binBody)), binHdr},
		{"deflate binary", "deflate", zlibbed(t, []byte(binBody)), binHdr},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hdr := map[string]string{"Content-Encoding": tc.enc}
			for k, v := range tc.hdr {
				hdr[k] = v
			}
			rec := restCall{path: "/v2/models/sum/infer", body: tc.body, headers: hdr}.do(t, t.Context(), h)
			if rec.Code != 200 || rec.Body.String() != plain.Body.String() {
				t.Fatalf("%d %s, want %s", rec.Code, rec.Body, plain.Body)
			}
		})
	}
	rec := restCall{path: "/v2/repository/index", body: gzipped(t, []byte(`{"ready":true}`)),
		headers: map[string]string{"Content-Encoding": "gzip"}}.do(t, t.Context(), h)
	if rec.Code != 200 || strings.Contains(rec.Body.String(), "unready") {
		t.Fatalf("gzipped index: %d %s", rec.Code, rec.Body)
	}
	rec = restCall{path: "/v2/models/sum/infer", body: zlibbed(t, []byte(jsonBody)),
		headers: map[string]string{"Content-Encoding": "gzip"}}.do(t, t.Context(), h)
	if rec.Code != 400 || !strings.Contains(restErrorBody(t, rec), "does not decompress as Content-Encoding gzip says: gzip: invalid header") {
		t.Fatalf("zlib sent as gzip: %d %s", rec.Code, rec.Body)
	}
}

// TestRESTZipBomb: a 64 KiB gzip body that inflates to 64 MiB is refused
// at limits.max_request_bytes (413) having decompressed little more than
// the limit, and without a request limit at the memory budget (429); the
// server's allocations stay far below what the bomb inflates to.
func TestRESTZipBomb(t *testing.T) {
	const inflated = 64 << 20
	bomb := zipBomb(t, inflated)
	infer := func(lim Limits) (int, string, uint64) {
		h := NewREST(newFakeBackend(), lim, slog.New(slog.DiscardHandler))
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		rec := restCall{path: "/v2/models/sum/infer", body: bomb, headers: map[string]string{"Content-Encoding": "gzip"}}.do(t, t.Context(), h)
		runtime.ReadMemStats(&after)
		return rec.Code, rec.Body.String(), after.TotalAlloc - before.TotalAlloc
	}
	budget := NewMemoryBudget(8 << 20)
	code, body, alloc := infer(Limits{MaxRequestBytes: 1 << 20, Memory: budget})
	if code != 413 || !strings.Contains(body, "decompresses to more than the 1048576 bytes allowed") {
		t.Fatalf("bomb under max_request_bytes: %d %s", code, body)
	}
	if alloc > inflated/8 {
		t.Fatalf("the bomb cost %d bytes of allocation, want far below the %d it inflates to", alloc, inflated)
	}
	if budget.Used() != 0 || budget.Peak() > 4<<20 {
		t.Fatalf("budget used %d, peak %d", budget.Used(), budget.Peak())
	}
	budget = NewMemoryBudget(4 << 20)
	code, body, alloc = infer(Limits{Memory: budget})
	if code != 429 {
		t.Fatalf("bomb with no request limit, under the memory budget: %d %s", code, body)
	}
	if alloc > inflated/8 {
		t.Fatalf("the bomb cost %d bytes of allocation, want far below the %d it inflates to", alloc, inflated)
	}
}

// TestGRPCCompressed: gRPC messages in gzip and deflate, as
// tritonclient.grpc's compression_algorithm asks its channel for them, are
// decompressed; one that inflates past max_request_bytes is
// RESOURCE_EXHAUSTED.
func TestGRPCCompressed(t *testing.T) {
	conn := serveGRPC(t, NewGRPC(newFakeBackend(), grpcTestLimits, slog.New(slog.DiscardHandler)))
	c := inference.NewGRPCInferenceServiceClient(conn)
	req := &inference.ModelInferRequest{ModelName: "sum", Inputs: []*inference.ModelInferRequest_InferInputTensor{{
		Name: "x", Datatype: "FP32", Shape: []int64{2, 4},
		Contents: &inference.InferTensorContents{Fp32Contents: []float32{1, 2, 3, 4, 5, 6, 7, 8}}}}}
	for _, name := range []string{"gzip", "deflate"} {
		resp, err := c.ModelInfer(t.Context(), req, grpc.UseCompressor(name))
		if err != nil || len(resp.GetOutputs()) == 0 {
			t.Fatalf("%s: %v %v", name, resp, err)
		}
	}
	big := &inference.ModelInferRequest{ModelName: "sum", RawInputContents: [][]byte{make([]byte, 2*grpcTestLimits.MaxRequestBytes)}}
	_, err := c.ModelInfer(t.Context(), big, grpc.UseCompressor("gzip"))
	wantGRPCCode(t, err, codes.ResourceExhausted, "larger than max")
}
