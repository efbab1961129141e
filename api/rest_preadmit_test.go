package api

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sloserve/sloserve/qos"
)

// countingReader is a large request body that counts what the server read.
type countingReader struct {
	left int64
	read *atomic.Int64
}

func (r *countingReader) Read(p []byte) (int, error) {
	if r.left == 0 {
		return 0, io.EOF
	}
	n := min(int64(len(p)), r.left)
	for i := range p[:n] {
		p[i] = ' '
	}
	r.left -= n
	r.read.Add(n)
	return int(n), nil
}

// A request the model would refuse is refused before its body is read: a
// real server and client, a 64 MiB body, and the bytes the client got to
// send counted.
func TestRESTRefusedBeforeBody(t *testing.T) {
	const size = 64 << 20
	tests := []struct {
		name       string
		err        error
		wantStatus int
	}{
		{"queue full", fmt.Errorf("%w: m holds 8 requests", qos.ErrQueueFull), http.StatusTooManyRequests},
		{"predicted miss", fmt.Errorf("%w: predicted completion misses the deadline by 3.0ms", qos.ErrRejected), http.StatusTooManyRequests},
		{"server overloaded", fmt.Errorf("%w: limit 4", qos.ErrOverloaded), http.StatusTooManyRequests},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, fb := newRESTTest(Limits{MaxRequestBytes: 1 << 30, MaxTensorElements: 1 << 12})
			fb.preadmitErr = tc.err
			srv := httptest.NewServer(h)
			defer srv.Close()
			var read atomic.Int64
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/v2/models/sum/infer",
				&countingReader{left: size, read: &read})
			if err != nil {
				t.Fatal(err)
			}
			req.ContentLength = size
			req.Header.Set(headerTimeoutMillis, "250")
			start := time.Now()
			resp, err := srv.Client().Do(req)
			if err != nil {
				t.Fatalf("the client got no answer: %v", err)
			}
			answered := time.Since(start)
			t.Logf("answered after %v, %d KiB sent", answered, read.Load()>>10)
			defer resp.Body.Close()
			msg, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.wantStatus || !strings.Contains(string(msg), tc.err.Error()) {
				t.Fatalf("status %d %s, want %d with %q", resp.StatusCode, msg, tc.wantStatus, tc.err)
			}
			// What the kernel's socket buffers took before the answer, not
			// the body: a few MiB at most.
			if n := read.Load(); n > 16<<20 {
				t.Errorf("the client sent %d MiB of the %d MiB body before the refusal", n>>20, size>>20)
			}
			if !resp.Close {
				t.Error("the answer keeps the connection open; want Connection: close, the rest of the body is never read")
			}
			if fb.preadmitCalls != 1 {
				t.Errorf("Preadmit called %d times", fb.preadmitCalls)
			}
			if d := fb.preadmitDL.Sub(start); d < 250*time.Millisecond || d > 250*time.Millisecond+answered {
				t.Errorf("Preadmit deadline %v after the request, want the header's 250ms", d)
			}
		})
	}
}

// An admissible request is read and served as before.
func TestRESTPreadmitPasses(t *testing.T) {
	h, fb := newRESTTest(restLimits)
	rec := restCall{method: http.MethodPost, path: "/v2/models/sum/versions/1/infer",
		body: `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}`}.do(t, t.Context(), h)
	if rec.Code != http.StatusOK {
		t.Fatalf("status %d: %s", rec.Code, rec.Body)
	}
	if fb.preadmitCalls != 1 || !fb.preadmitDL.IsZero() {
		t.Errorf("Preadmit calls %d, deadline %v; want 1 with none (no timeout header)", fb.preadmitCalls, fb.preadmitDL)
	}
}
