package api

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// echoJSONRequest is a request to the fake echo model with one FP32 input
// of n zeros in JSON, its output asked for in binary; inputsKey spells the
// "inputs" key (another case sends it to encoding/json, as the one-pass
// parser gives up on it).
func echoJSONRequest(n int, inputsKey string) (string, int) {
	body := fmt.Sprintf(`{%q:[{"name":"x","datatype":"FP32","shape":[%d],"data":[0%s]}],"parameters":{"binary_data_output":true}}`,
		inputsKey, n, strings.Repeat(",0", n-1))
	return fmt.Sprintf("POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body), len(body)
}

// postRaw sends one raw HTTP request to addr and returns the answer's
// status and body.
func postRaw(t *testing.T, addr, req string) (int, string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// TestRESTJSONCopiesReserved: decoding a JSON request reserves the copies
// of its JSON only where they are made. The one-pass parser leaves the
// data arrays in the body, so a request it reads holds restJSONCopies
// times its JSON less than one encoding/json decodes (the same request
// with "Inputs" for "inputs"); in a budget that fits the first exactly, it
// is served and the second is refused with 429 naming the limit. (Both
// reserved the two copies before.)
func TestRESTJSONCopiesReserved(t *testing.T) {
	const n = 1 << 18
	peak := func(key string) (int64, int) {
		mem := NewMemoryBudget(0)
		addr := serveRESTMem(t, newFakeBackend(), Limits{MaxRequestBytes: 8 << 20, MaxTensorElements: 1 << 24, Memory: mem})
		req, size := echoJSONRequest(n, key)
		start := time.Now()
		if status, body := postRaw(t, addr, req); status != http.StatusOK {
			t.Fatalf("%q: status %d %.200s", key, status, body)
		}
		// The handler gives its reservation back once the answer is out.
		if !waitFor(100*time.Since(start), func() bool { return mem.Used() == 0 }) {
			t.Fatalf("%q: %d bytes still reserved", key, mem.Used())
		}
		return mem.Peak(), size
	}
	fast, size := peak("inputs")
	slow, _ := peak("Inputs")
	t.Logf("a %d KiB JSON request: peak reservation %d KiB read in one pass, %d KiB through encoding/json", size>>10, fast>>10, slow>>10)
	if got, want := slow-fast, int64(restJSONCopies*size); got < want-1024 || got > want+1024 {
		t.Errorf("encoding/json reserves %d bytes more than the one-pass parser, want its %d copies of the %d-byte JSON", got, restJSONCopies, size)
	}
	if fast > int64(size)+2*4*n+64<<10 {
		t.Errorf("one-pass: peak %d bytes, want the body (%d), the tensor and its output (%d each) and little more", fast, size, 4*n)
	}

	mem := NewMemoryBudget(fast)
	addr := serveRESTMem(t, newFakeBackend(), Limits{MaxRequestBytes: 8 << 20, MaxTensorElements: 1 << 24, Memory: mem})
	req, _ := echoJSONRequest(n, "inputs")
	start := time.Now()
	if status, body := postRaw(t, addr, req); status != http.StatusOK {
		t.Errorf("one-pass request in a budget of its peak: status %d %.200s", status, body)
	}
	req, _ = echoJSONRequest(n, "Inputs")
	if status, body := postRaw(t, addr, req); status != http.StatusTooManyRequests || !strings.Contains(body, "limits.max_memory") {
		t.Errorf("encoding/json request in that budget: status %d %.200s, want 429 naming the limit", status, body)
	}
	if !waitFor(100*time.Since(start), func() bool { return mem.Used() == 0 }) {
		t.Errorf("%d bytes still reserved", mem.Used())
	}
}
