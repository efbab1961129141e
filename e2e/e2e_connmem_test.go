package e2e

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/api/inference"
)

// TestE2EConnectionBuffersInMemoryCeiling: each connection's buffers are
// reserved from limits.max_memory, in the connections' share of it. With a
// 32 MiB budget (a quarter for connections: about 23 gRPC connections of
// 192 KiB), idle gRPC connections are accepted until the share is full and
// refused after; the memory metrics count them; a call on a connection
// already open is served and health answers throughout; closing
// connections frees their share, and a new connection then succeeds.
// Idle REST connections past their share leave health probes the
// overflow's.
func TestE2EConnectionBuffersInMemoryCeiling(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), pinnedDyn(1)})
	s := startServer(t, repo, "  max_memory: 32MiB\n  max_request_bytes: 4MiB\n  header_timeout: 60s\n")
	if log := s.log.String(); !strings.Contains(log, "limits.max_connections: the connections' buffers") {
		t.Errorf("no warning at start that max_connections do not fit in max_memory's quarter:\n%s", log)
	}
	metric := func(name, listener string) float64 {
		t.Helper()
		v, ok := s.metricValue(t, fmt.Sprintf("%s{listener=%q}", name, listener))
		if !ok {
			t.Fatalf("no series %s{listener=%q}", name, listener)
		}
		return v
	}
	health := func(when string) {
		t.Helper()
		resp, err := http.Get(s.http + "/v2/health/live")
		if err != nil {
			t.Fatalf("health %s: %v", when, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("health %s: %d", when, resp.StatusCode)
		}
	}
	const per = api.GRPCConnectionBytes
	share := metric("sloserve_connections_memory_limit_bytes", "grpc")
	holds := int(share / per)
	if holds < 4 || holds > 64 {
		t.Fatalf("the gRPC listener's share is %v bytes (%d connections of %d): want a few connections out of a quarter of 32 MiB", share, holds, per)
	}
	if limit, _ := s.metricValue(t, "sloserve_memory_limit_bytes"); limit >= 32<<20 || limit < 24<<20 {
		t.Fatalf("requests' budget %v: want 32 MiB less the connections' share", limit)
	}

	// The harness's own gRPC client holds one connection already.
	if _, err := s.grpc.ServerLive(t.Context(), &inference.ServerLiveRequest{}); err != nil {
		t.Fatal(err)
	}
	open := int(metric("sloserve_connections_open", "grpc"))
	if got := metric("sloserve_connections_memory_reserved_bytes", "grpc"); got != float64(open*per) {
		t.Fatalf("%d gRPC connections open reserve %v bytes, want %d", open, got, open*per)
	}
	var conns []*grpc.ClientConn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	dial := func() (*grpc.ClientConn, error) {
		c, err := grpc.NewClient(s.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		_, err = inference.NewGRPCInferenceServiceClient(c).ServerLive(t.Context(), &inference.ServerLiveRequest{})
		if err != nil {
			c.Close()
			return nil, err
		}
		return c, nil
	}
	// Idle connections until one is refused: the share, not
	// max_connections (4096), is the limit.
	var refusal error
	for range 4 * holds {
		c, err := dial()
		if err != nil {
			refusal = err
			break
		}
		conns = append(conns, c)
		health("during the flood")
	}
	if status.Code(refusal) != codes.Unavailable {
		t.Fatalf("after %d connections: %v, want a connection refused (UNAVAILABLE)", len(conns), refusal)
	}
	open = int(metric("sloserve_connections_open", "grpc"))
	if open != holds {
		t.Errorf("%d gRPC connections open when refused, want the %d the share holds", open, holds)
	}
	if got := metric("sloserve_connections_memory_reserved_bytes", "grpc"); got != float64(open*per) || got > share {
		t.Errorf("%d connections reserve %v bytes, want %d, within the share of %v", open, got, open*per, share)
	}
	if n := metric("sloserve_connections_refused_memory_total", "grpc"); n < 1 {
		t.Errorf("sloserve_connections_refused_memory_total = %v, want >= 1", n)
	}
	if n := metric("sloserve_connections_refused_total", "grpc"); n < 1 {
		t.Errorf("sloserve_connections_refused_total = %v, want >= 1", n)
	}
	t.Logf("gRPC share %.0f bytes: %d connections of %d open, refused after (%v)", share, open, per, refusal)
	health("with the gRPC share full")
	// A connection already open is served.
	if _, err := inference.NewGRPCInferenceServiceClient(conns[0]).ModelInfer(t.Context(), grpcDynRequest()); err != nil {
		t.Fatalf("a call on a connection open before the share was full: %v", err)
	}

	// Closing connections frees their share: a new one then fits.
	for _, c := range conns[len(conns)/2:] {
		c.Close()
	}
	conns = conns[:len(conns)/2]
	waitFor(t, "the closed connections' share back", 10*time.Second, func() bool {
		return metric("sloserve_connections_memory_reserved_bytes", "grpc") == float64(int(metric("sloserve_connections_open", "grpc"))*per) &&
			int(metric("sloserve_connections_open", "grpc")) < holds
	})
	c, err := dial()
	if err != nil {
		t.Fatalf("a connection after others closed: %v", err)
	}
	conns = append(conns, c)
	if _, err := inference.NewGRPCInferenceServiceClient(c).ModelInfer(t.Context(), grpcDynRequest()); err != nil {
		t.Fatalf("a call on the new connection: %v", err)
	}

	// REST: idle connections fill its share; a health probe then gets
	// an overflow connection, and answers.
	restHolds := int(metric("sloserve_connections_memory_limit_bytes", "rest")/api.RESTConnectionBytes) - 64 // less the overflow's
	addr := strings.TrimPrefix(s.http, "http://")
	idle := dialIdle(t, addr, restHolds)
	waitFor(t, "the REST share full", 10*time.Second, func() bool {
		return metric("sloserve_connections_memory_reserved_bytes", "rest") >= float64(restHolds*api.RESTConnectionBytes)
	})
	refusedBefore := metric("sloserve_connections_refused_memory_total", "rest")
	cl := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := cl.Get(s.http + "/v2/health/live")
	if err != nil {
		t.Fatalf("health with the REST share full: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("health with the REST share full: %d", resp.StatusCode)
	}
	if n := metric("sloserve_connections_refused_memory_total", "rest"); n <= refusedBefore {
		t.Errorf("the health probe's connection was not past the REST share (refused for memory %v, before %v)", n, refusedBefore)
	}
	for _, c := range idle {
		c.Close()
	}
	waitFor(t, "the REST share back", 10*time.Second, func() bool {
		return metric("sloserve_connections_memory_reserved_bytes", "rest") < float64(restHolds*api.RESTConnectionBytes)
	})
	s.stillServing(t)
}
