package loadtest

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A generator whose server holds every request: arrivals at 2,000 a second
// for 1.5 s of megabyte requests, at most 16 in flight, over REST (the
// server reads each body, then holds it) and gRPC (the server does not
// read the messages: their data waits in the client). The heap stays
// within two requests' size per request the generator may have in flight
// (the body is shared: what a request in flight costs is its connection,
// stream, buffers and goroutines), and every arrival is counted once:
// sent and ended, or dropped by the generator. Without the bound every
// arrival is in flight at once and the heap grows past it.
func TestPacerBoundsMemory(t *testing.T) {
	for _, proto := range []string{ProtoRESTBinary, ProtoGRPC} {
		t.Run("proto="+proto, func(t *testing.T) { pacerTestMemory(t, proto) })
	}
}

// pacerTestHold holds every gRPC call it is given, without reading its
// message, until released, and then refuses it: the call's data waits in
// the client, as on a server too busy to read.
func pacerTestHold(release <-chan struct{}, held *atomic.Int64) grpc.StreamHandler {
	return func(_ any, stream grpc.ServerStream) error {
		held.Add(1)
		select {
		case <-release:
		case <-stream.Context().Done():
		}
		return status.Error(codes.ResourceExhausted, "held")
	}
}

func pacerTestMemory(t *testing.T, proto string) {
	const (
		maxInFlight = 16
		arrivals    = 3000
		size        = 1 << 20
	)
	release := make(chan struct{})
	var held atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			return
		}
		held.Add(1)
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		header := `{"model_name":"m","outputs":[{"name":"y","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":4}}]}`
		w.Header().Set(clientHeaderInferenceLength, strconv.Itoa(len(header)))
		_, _ = io.WriteString(w, header+"\x00\x00\x00\x00")
	}))
	defer srv.Close()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.UnknownServiceHandler(pacerTestHold(release, &held)))
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()
	in := Tensor{Name: "x", DataType: "FP32", Shape: []int64{1, size / 4}, Raw: make([]byte, size)}
	c, err := NewClient(ClientOptions{Protocol: proto, HTTPBase: srv.URL, GRPCAddr: lis.Addr().String(), Model: "m", Inputs: []Tensor{in}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	offsets := make([]time.Duration, arrivals)
	for i := range offsets {
		offsets[i] = time.Duration(i) * 500 * time.Microsecond
	}
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	base := ms.HeapAlloc
	var peak atomic.Uint64
	stopSampling := make(chan struct{})
	var sampling sync.WaitGroup
	sampling.Go(func() {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			if ms.HeapAlloc > peak.Load() {
				peak.Store(ms.HeapAlloc)
			}
			select {
			case <-stopSampling:
				return
			case <-tick.C:
			}
		}
	})

	var mu sync.Mutex
	outcomes := map[Outcome]int{}
	var sent, dropped atomic.Int64
	seen := make([]atomic.Int32, arrivals)
	p := Pacer{Start: time.Now(), MaxInFlight: maxInFlight,
		Send: func(i int, _ time.Duration) {
			seen[i].Add(1)
			sent.Add(1)
			o, _ := c.Infer(t.Context())
			mu.Lock()
			outcomes[o]++
			mu.Unlock()
		},
		Drop: func(i int, _ time.Duration, detail string) {
			seen[i].Add(1)
			dropped.Add(1)
			if detail != generatorDetail {
				t.Errorf("arrival %d dropped: %q, want %q", i, detail, generatorDetail)
			}
		},
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.Run(t.Context(), offsets)
	}()
	// Every arrival sent or dropped, with every slot held: then let them
	// go. Waiting for the pacer, not for the clock: on a busy host the
	// pacer ran behind its arrivals, and a slot freed before it was done
	// let a late arrival through (17 held).
	for sent.Load()+dropped.Load() < arrivals {
		time.Sleep(10 * time.Millisecond)
	}
	close(release)
	<-done
	close(stopSampling)
	sampling.Wait()

	if n := held.Load(); n > maxInFlight {
		t.Errorf("the server held %d requests at once, want at most %d", n, maxInFlight)
	}
	for i := range seen {
		if n := seen[i].Load(); n != 1 {
			t.Fatalf("arrival %d was counted %d times, want once", i, n)
		}
	}
	total := 0
	for _, n := range outcomes {
		total += n
	}
	answer := Good // the REST server answers, the gRPC one refuses
	if proto == ProtoGRPC {
		answer = Rejected
	}
	if s, d := sent.Load(), dropped.Load(); s+d != arrivals || int64(total) != s || d == 0 || outcomes[answer] != int(s) {
		t.Errorf("sent %d (outcomes %v) + dropped by the generator %d, want %d arrivals, every sent one %v, some dropped", s, outcomes, d, arrivals, answer)
	}
	grew := int64(peak.Load()) - int64(base)
	bound := int64(2 * size * maxInFlight)
	t.Logf("heap grew by %.1f MiB at most (bound %.0f MiB); %d sent, %d dropped", float64(grew)/(1<<20), float64(bound)/(1<<20), sent.Load(), dropped.Load())
	if grew > bound {
		t.Errorf("the heap grew by %d bytes, over %d (2 x %d-byte requests x %d in flight)", grew, bound, size, maxInFlight)
	}
}

// An arrival the generator comes to later than MaxLag after its time is
// dropped as behind schedule, never sent; the others are sent.
func TestPacerDropsLate(t *testing.T) {
	offsets := make([]time.Duration, 100)
	for i := range offsets {
		offsets[i] = time.Duration(i) * 100 * time.Millisecond // 0 to 9.9 s
	}
	var sent, late atomic.Int64
	p := Pacer{Start: time.Now().Add(-5 * time.Second), MaxLag: 2 * time.Second,
		Send: func(int, time.Duration) { sent.Add(1) },
		Drop: func(_ int, at time.Duration, detail string) {
			late.Add(1)
			if detail != generatorLateDetail || at > 3*time.Second+50*time.Millisecond {
				t.Errorf("arrival at %v dropped: %q", at, detail)
			}
		},
	}
	p.Run(t.Context(), offsets[:45]) // up to 4.4 s: all due already
	// Due more than 2 s ago: 0 to 2.9 s (30 arrivals, give or take the one
	// at the edge).
	if l := late.Load(); l < 29 || l > 31 || sent.Load()+l != 45 {
		t.Errorf("%d dropped late, %d sent; want about 30 and 45 in all", l, sent.Load())
	}
}
