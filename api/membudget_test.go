package api

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	goruntime "runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/sloserve/sloserve/api/inference"
)

func TestMemoryBudget(t *testing.T) {
	b := NewMemoryBudget(100)
	r1, err := b.Reserve(60, "first")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Reserve(50, "second"); !errors.Is(err, errMemory) ||
		!strings.Contains(err.Error(), "second needs 50B") || !strings.Contains(err.Error(), "hold 60B of the 100B allowed") {
		t.Fatalf("over the budget: %v", err)
	}
	if err := r1.Grow(41, "more"); !errors.Is(err, errMemory) {
		t.Fatalf("growing over the budget: %v", err)
	}
	if err := r1.Grow(40, "more"); err != nil {
		t.Fatal(err)
	}
	if b.Used() != 100 || r1.Size() != 100 || b.Peak() != 100 || b.Refused() != 2 {
		t.Fatalf("used %d size %d peak %d refused %d, want 100 100 100 2", b.Used(), r1.Size(), b.Peak(), b.Refused())
	}
	r1.ShrinkTo(30)
	r1.ShrinkTo(80) // never grows
	if b.Used() != 30 || r1.Size() != 30 {
		t.Fatalf("after ShrinkTo(30): used %d size %d", b.Used(), r1.Size())
	}
	done := 0
	f := b.force(500, func() { done++ })
	if b.Used() != 530 || b.Peak() != 530 {
		t.Fatalf("forced: used %d peak %d, want 530 530", b.Used(), b.Peak())
	}
	f.Release()
	f.Release()
	r1.Release()
	r1.Release()
	if b.Used() != 0 || done != 1 {
		t.Fatalf("after release: used %d, done %d times; want 0, 1", b.Used(), done)
	}

	// Concurrent reservations never pass the limit together.
	b = NewMemoryBudget(1000)
	var wg sync.WaitGroup
	var mu sync.Mutex
	held := 0
	for range 100 {
		wg.Go(func() {
			if _, err := b.Reserve(30, "x"); err != nil {
				return
			}
			mu.Lock()
			held++
			mu.Unlock()
		})
	}
	wg.Wait()
	if held != 33 || b.Used() != 990 || b.Peak() > 1000 {
		t.Fatalf("%d reservations of 30 in 1000 (used %d, peak %d), want 33", held, b.Used(), b.Peak())
	}

	// A nil budget reserves nothing and refuses nothing.
	var nb *MemoryBudget
	r, err := nb.Reserve(1<<40, "x")
	if err != nil || r.Grow(1<<40, "x") != nil || nb.Used() != 0 {
		t.Fatalf("nil budget: %v", err)
	}
	r.Release()
	var nr *Reservation
	if nr.Grow(1, "x") != nil || nr.Size() != 0 {
		t.Fatal("nil reservation")
	}
	nr.Release()
}

// serveRESTMem serves NewREST(b, lim) on a loopback listener with the
// listener's http.Server settings, and returns its address.
func serveRESTMem(t *testing.T, b Backend, lim Limits) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: NewREST(b, lim, slog.New(slog.DiscardHandler)), ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String()
}

// echoBinaryRequest is a request to the fake echo model with one FP32 input
// of n zeros in binary, its output asked for in binary (binary) or JSON.
func echoBinaryRequest(n int, binary bool) string {
	header := fmt.Sprintf(`{"inputs":[{"name":"x","datatype":"FP32","shape":[%d],"parameters":{"binary_data_size":%d}}],"parameters":{"binary_data_output":%v}}`, n, 4*n, binary)
	return fmt.Sprintf("POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\nInference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s%s",
		len(header), len(header)+4*n, header, make([]byte, 4*n))
}

// TestRESTResponseMemory: a response's JSON is reserved, at its largest,
// before it is written: one that does not fit is refused with 429 naming
// the limit, and the budget is whole again after every request.
func TestRESTResponseMemory(t *testing.T) {
	const n = 1 << 20 // 4 MiB of FP32: its JSON may take 24 MiB
	mem := NewMemoryBudget(24 << 20)
	addr := serveRESTMem(t, newFakeBackend(), Limits{MaxRequestBytes: 8 << 20, MaxTensorElements: 1 << 24, Memory: mem})
	for _, tc := range []struct {
		name   string
		binary bool
		status int
	}{
		{"binary output fits", true, http.StatusOK},
		{"JSON output does not", false, http.StatusTooManyRequests},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if _, err := io.WriteString(c, echoBinaryRequest(n, tc.binary)); err != nil {
				t.Fatal(err)
			}
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d %.200s, want %d", resp.StatusCode, body, tc.status)
			}
			if tc.status == http.StatusTooManyRequests {
				if !bytes.Contains(body, []byte("the response needs")) || !bytes.Contains(body, []byte("limits.max_memory")) ||
					resp.Header.Get("Retry-After") != "1" {
					t.Fatalf("429 %s (Retry-After %q): want the response and the limit named", body, resp.Header.Get("Retry-After"))
				}
			} else if len(body) < 4*n {
				t.Fatalf("answer of %d bytes, want the %d of the output", len(body), 4*n)
			}
			if mem.Used() != 0 {
				t.Fatalf("%d bytes still reserved after the answer", mem.Used())
			}
		})
	}
	if p := mem.Peak(); p > 24<<20 || p < 8<<20 {
		t.Fatalf("peak reservation %d, want the body and output (8 MiB) and at most the budget", p)
	}
}

// TestRESTUnreadResponse: a client that never reads its response loses its
// connection after limits.write_timeout, and the memory the response held
// is given back; a client that reads gets its whole answer.
func TestRESTUnreadResponse(t *testing.T) {
	const n = 8 << 20 // 32 MiB of output in binary, far more than socket buffers
	req := echoBinaryRequest(n, true)
	lim := Limits{MaxRequestBytes: 64 << 20, MaxTensorElements: 1 << 24}
	// read sends req to addr and reads the answer, and says how long that
	// took.
	read := func(addr string) time.Duration {
		start := time.Now()
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
		got, _ := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || got < 4*n {
			t.Fatalf("read response: %d, %d bytes", resp.StatusCode, got)
		}
		return time.Since(start)
	}
	// Baseline: the time a request and its answer take, without a write
	// timeout; the timeout is set well above it.
	baseline := read(serveRESTMem(t, newFakeBackend(), lim))
	lim.Memory = NewMemoryBudget(1 << 30)
	lim.WriteTimeout = max(3*baseline, 100*time.Millisecond)
	addr := serveRESTMem(t, newFakeBackend(), lim)
	read(addr) // a client that reads is not cut off

	u, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer u.Close()
	if err := u.(*net.TCPConn).SetReadBuffer(4096); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(u, req); err != nil {
		t.Fatal(err)
	}
	mem := lim.Memory
	start := time.Now()
	limit := 10 * (baseline + lim.WriteTimeout)
	for mem.Used() == 0 && time.Since(start) < limit {
		time.Sleep(time.Millisecond)
	}
	if mem.Used() == 0 {
		t.Fatal("the unread response never reserved its memory")
	}
	for mem.Used() != 0 && time.Since(start) < limit {
		time.Sleep(5 * time.Millisecond)
	}
	if mem.Used() != 0 {
		t.Fatalf("an unread response still holds %d bytes after %v (write timeout %v, a read one took %v)", mem.Used(), limit, lim.WriteTimeout, baseline)
	}
	t.Logf("an unread response's memory (peak %d MiB) was given back %v after it was sent (write timeout %v; a read one took %v)",
		mem.Peak()>>20, time.Since(start).Round(time.Millisecond), lim.WriteTimeout, baseline.Round(time.Millisecond))
}

// rawMessage sends a message already in wire form.
type rawMessage struct{}

func (rawMessage) Marshal(v any) ([]byte, error) { return *v.(*[]byte), nil }
func (rawMessage) Unmarshal(data []byte, v any) error {
	*v.(*[]byte) = append([]byte(nil), data...)
	return nil
}
func (rawMessage) Name() string { return "proto" }

// TestGRPCDecodeCost: a message that decodes into many times its size
// (16 million empty bytes_contents, 32 million shape entries, a million
// parameters in 8 MiB) is refused with RESOURCE_EXHAUSTED before it is
// decoded: the server allocates about the message, not the structures it
// would decode into. A message that fits is decoded and served.
func TestGRPCDecodeCost(t *testing.T) {
	tensor := func(fields ...[]byte) []byte {
		var b []byte
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		b = protowire.AppendString(b, "x")
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendString(b, "BYTES")
		for _, f := range fields {
			b = append(b, f...)
		}
		return b
	}
	request := func(input []byte, extra ...byte) []byte {
		var b []byte
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		b = protowire.AppendString(b, "echo")
		b = append(b, extra...)
		b = protowire.AppendTag(b, 5, protowire.BytesType)
		return protowire.AppendBytes(b, input)
	}
	const size = 32 << 20
	var contents []byte
	for len(contents) < size {
		contents = protowire.AppendTag(contents, 8, protowire.BytesType)
		contents = protowire.AppendBytes(contents, nil)
	}
	contentsField := protowire.AppendTag(nil, 5, protowire.BytesType)
	contentsField = protowire.AppendBytes(contentsField, contents)
	emptyBytes := request(tensor(contentsField))
	shapeField := protowire.AppendTag(nil, 3, protowire.BytesType)
	shapeField = protowire.AppendBytes(shapeField, make([]byte, size))
	shapes := request(tensor(shapeField))
	var params []byte
	for i := 0; len(params) < 8<<20; i++ {
		var entry []byte
		entry = protowire.AppendTag(entry, 1, protowire.BytesType)
		entry = protowire.AppendString(entry, strconv.Itoa(i))
		params = protowire.AppendTag(params, 4, protowire.BytesType)
		params = protowire.AppendBytes(params, entry)
	}
	parameters := request(tensor(), params...)

	// The call's received buffers (64 MiB, the largest message) and room
	// for less than the parameters' decoded structures.
	mem := NewMemoryBudget(192 << 20)
	conn := serveGRPC(t, NewGRPC(newFakeBackend(), Limits{MaxRequestBytes: 64 << 20, MaxTensorElements: 1 << 30, Memory: mem}, slog.New(slog.DiscardHandler)))
	for _, tc := range []struct {
		name string
		msg  []byte
	}{
		{"empty bytes_contents", emptyBytes},
		{"shape entries", shapes},
		{"parameters", parameters},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var before, after goruntime.MemStats
			goruntime.GC()
			goruntime.ReadMemStats(&before)
			var out []byte
			err := conn.Invoke(t.Context(), inference.GRPCInferenceService_ModelInfer_FullMethodName, &tc.msg, &out, grpc.ForceCodec(rawMessage{}))
			goruntime.ReadMemStats(&after)
			allocated := int64(after.TotalAlloc - before.TotalAlloc)
			t.Logf("%d MiB message: %v; %d MiB allocated", len(tc.msg)>>20, err, allocated>>20)
			if st := status.Convert(err); st.Code() != codes.ResourceExhausted || !strings.Contains(st.Message(), "limits.max_memory") {
				t.Fatalf("got %v, want RESOURCE_EXHAUSTED naming limits.max_memory", err)
			}
			// The message on both sides of the connection and its
			// contiguous copy; not the structures it would decode into.
			if limit := int64(6 * len(tc.msg)); allocated > limit {
				t.Errorf("%d MiB allocated for a %d MiB message, want at most %d MiB", allocated>>20, len(tc.msg)>>20, limit>>20)
			}
			// The call's headers come back as its server side ends,
			// which may follow the client's reading of its status.
			if !waitFor(time.Minute, func() bool { return mem.Used() == 0 }) {
				t.Errorf("%d bytes still reserved", mem.Used())
			}
		})
	}
	// A message that fits is decoded and served, its memory given back
	// when the call ends (just after the client has its answer).
	start := time.Now()
	resp, err := inference.NewGRPCInferenceServiceClient(conn).ModelInfer(t.Context(), &inference.ModelInferRequest{
		ModelName: "echo",
		Inputs: []*inference.ModelInferRequest_InferInputTensor{{
			Name: "x", Datatype: "BYTES", Shape: []int64{3},
			Contents: &inference.InferTensorContents{BytesContents: [][]byte{[]byte("a"), []byte("bc"), nil}},
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.GetRawOutputContents(); len(got) != 1 || len(got[0]) != 3*4+3 {
		t.Fatalf("echo answered %q", got)
	}
	took := time.Since(start)
	for mem.Used() != 0 && time.Since(start) < 100*took {
		time.Sleep(took / 10)
	}
	if mem.Used() != 0 {
		t.Errorf("%d bytes still reserved %v after a call that took %v", mem.Used(), time.Since(start), took)
	}
}

// TestSharedMemoryBytesCheckedInPlace: a request of a few bytes naming a
// 64 MiB region of zeros as BYTES [16777216] (16 million empty elements)
// is checked where it lies: the server does not build a slice header per
// element (384 MiB) for it.
func TestSharedMemoryBytesCheckedInPlace(t *testing.T) {
	const size = 64 << 20
	shm := newTestSharedMemory(t, SharedMemoryOptions{MaxRegions: 1, MaxBytes: size})
	h := NewREST(newFakeBackend(), Limits{MaxRequestBytes: 1 << 16, MaxTensorElements: 1 << 25, SharedMemory: shm}, slog.New(slog.DiscardHandler))
	key := shmObject(t, size)
	wantREST(t, shmCall(t, h, "POST", "/v2/systemsharedmemory/region/z/register", registerBody(key, 0, size)), 200, "")
	body := fmt.Sprintf(`{"inputs":[{"name":"x","datatype":"BYTES","shape":[%d],"parameters":{"shared_memory_region":"z","shared_memory_byte_size":%d}}]}`, size/4, size)
	var before, after goruntime.MemStats
	goruntime.GC()
	goruntime.ReadMemStats(&before)
	rec := shmCall(t, h, "POST", "/v2/models/sum/infer", body)
	goruntime.ReadMemStats(&after)
	allocated := int64(after.TotalAlloc - before.TotalAlloc)
	t.Logf("%d empty BYTES elements in shared memory: %d; %d KiB allocated", size/4, rec.Code, allocated>>10)
	wantREST(t, rec, http.StatusBadRequest, "sum wants x FP32")
	if allocated > 1<<20 {
		t.Errorf("%d KiB allocated for a %d-byte request, want under 1 MiB", allocated>>10, len(body))
	}
}

// TestGRPCStreamMemory: an open ModelStreamInfer stream holds the buffer
// of its next message (max_request_bytes) for its whole life, so
// streams past the budget are refused with RESOURCE_EXHAUSTED when they
// open; the others serve, and everything is given back when they close.
func TestGRPCStreamMemory(t *testing.T) {
	const message = 16 << 20
	mem := NewMemoryBudget(4*message + 1<<20) // four streams and their small requests
	conn := serveGRPC(t, NewGRPC(newFakeBackend(), Limits{MaxRequestBytes: message, MaxTensorElements: 1 << 20, Memory: mem}, slog.New(slog.DiscardHandler)))
	client := inference.NewGRPCInferenceServiceClient(conn)
	var streams []grpc.BidiStreamingClient[inference.ModelInferRequest, inference.ModelStreamInferResponse]
	opening := time.Now()
	for i := range 5 {
		st, err := client.ModelStreamInfer(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if err := st.Send(&inference.ModelInferRequest{ModelName: "echo", Id: strconv.Itoa(i), Inputs: []*inference.ModelInferRequest_InferInputTensor{{
			Name: "x", Datatype: "INT32", Shape: []int64{2}, Contents: &inference.InferTensorContents{IntContents: []int32{int32(i), 7}},
		}}}); err != nil && i < 4 {
			t.Fatal(err)
		}
		resp, err := st.Recv()
		if i == 4 {
			if st := status.Convert(err); st.Code() != codes.ResourceExhausted || !strings.Contains(st.Message(), "limits.max_memory") {
				t.Fatalf("fifth stream: %v, %v; want RESOURCE_EXHAUSTED naming limits.max_memory", resp, err)
			}
			break
		}
		if err != nil || resp.GetErrorMessage() != "" || resp.GetInferResponse().GetId() != strconv.Itoa(i) {
			t.Fatalf("stream %d: %v, %v", i, resp, err)
		}
		streams = append(streams, st)
	}
	// Each request's memory is given back once its answer is sent.
	opened := time.Since(opening)
	start := time.Now()
	for mem.Used() != 4*message && time.Since(start) < 100*opened {
		time.Sleep(time.Millisecond)
	}
	if got := mem.Used(); got != 4*message {
		t.Fatalf("four open streams hold %d bytes, want %d", got, 4*message)
	}
	start = time.Now()
	for _, st := range streams {
		if err := st.CloseSend(); err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err == nil {
			t.Fatal("stream answered after CloseSend")
		}
	}
	took := time.Since(start)
	for mem.Used() != 0 && time.Since(start) < 100*took {
		time.Sleep(took / 10)
	}
	if mem.Used() != 0 {
		t.Fatalf("%d bytes still reserved after the streams closed", mem.Used())
	}
}

// TestGRPCHealthOverBudget: health calls are answered while clients'
// traffic holds the whole budget, and a Watch stream gives back what
// reading its request took, so that more watchers than the health calls
// read at once (16) can stay open.
func TestGRPCHealthOverBudget(t *testing.T) {
	mem := NewMemoryBudget(1 << 30)
	conn := serveGRPC(t, NewGRPC(newFakeBackend(), Limits{MaxRequestBytes: 64 << 20, MaxTensorElements: 1 << 20, Memory: mem}, slog.New(slog.DiscardHandler)))
	full, err := mem.Reserve(1<<30, "everything")
	if err != nil {
		t.Fatal(err)
	}
	defer full.Release()
	if _, err := inference.NewGRPCInferenceServiceClient(conn).ServerLive(t.Context(), &inference.ServerLiveRequest{}); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("ServerLive over the budget: %v, want RESOURCE_EXHAUSTED", err)
	}
	health := grpc_health_v1.NewHealthClient(conn)
	if resp, err := health.Check(t.Context(), &grpc_health_v1.HealthCheckRequest{}); err != nil || resp.GetStatus() != grpc_health_v1.HealthCheckResponse_SERVING {
		t.Fatalf("Check over the budget: %v, %v", resp, err)
	}
	for i := range 2 * grpcHealthReading {
		w, err := health.Watch(t.Context(), &grpc_health_v1.HealthCheckRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if resp, err := w.Recv(); err != nil || resp.GetStatus() != grpc_health_v1.HealthCheckResponse_SERVING {
			t.Fatalf("watcher %d: %v, %v", i, resp, err)
		}
	}
	if got := mem.Used(); got != 1<<30 {
		t.Fatalf("open watchers hold %d bytes over the budget's", got-(1<<30))
	}
}
