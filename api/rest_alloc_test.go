package api

import (
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"testing"
)

// restPyBody is a request of the fake "sum" model with rows x 4 FP32
// values written as Python's json.dumps writes a float32 (the float64 it
// equals, in up to 17 digits), as tritonclient sends JSON tensors.
func restPyBody(rows int) string {
	rng := rand.New(rand.NewPCG(3, 4))
	var sb strings.Builder
	sb.WriteString(`{"inputs": [{"name": "x", "shape": [` + strconv.Itoa(rows) + `, 4], "datatype": "FP32", "data": [`)
	for i := range rows * 4 {
		if i > 0 {
			sb.WriteString(", ")
		}
		sb.WriteString(strconv.FormatFloat(float64(float32(rng.Float64()*2-1)), 'g', -1, 64))
	}
	sb.WriteString(`]}]}`)
	return sb.String()
}

// restHeapPerRequest is the heap bytes and allocations one request of body
// to h takes, from the runtime's counts over many requests.
func restHeapPerRequest(t *testing.T, h http.Handler, path, body string) (bytes, allocs float64) {
	t.Helper()
	do := func() {
		req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != http.StatusOK {
			t.Fatalf("status %d: %s", rec.Code, rec.Body)
		}
	}
	for range 20 {
		do()
	}
	const n = 200
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range n {
		do()
	}
	runtime.ReadMemStats(&after)
	return float64(after.TotalAlloc-before.TotalAlloc) / n, float64(after.Mallocs-before.Mallocs) / n
}

// A JSON inference request's body is read into a buffer that the next
// request reuses: nothing decoded from JSON aliases it. Each request then
// allocates about its decoded tensor, not its body as well (a 2,400-value
// request of 45 KB allocated the body whole every time).
func TestRESTJSONBodyReused(t *testing.T) {
	if raceEnabled {
		t.Skip("heap counts under the race detector do not measure the code")
	}
	h, _ := newRESTTest(restLimits)
	body := restPyBody(600)
	bytes, allocs := restHeapPerRequest(t, h, "/v2/models/sum/infer", body)
	t.Logf("a %d-byte JSON request: %.0f bytes in %.1f allocations per request", len(body), bytes, allocs)
	// Without reuse a request allocates its body and its tensor (more than
	// the body); with it, the tensor.
	if bytes > float64(len(body)) {
		t.Errorf("a %d-byte JSON request allocates %.0f bytes: its body is not reused", len(body), bytes)
	}
}
