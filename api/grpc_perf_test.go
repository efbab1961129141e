package api

import (
	"context"
	"net"
	"testing"

	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
)

// A call's metadata as a typical client sends it, with a token.
func perfCallContext() context.Context {
	ctx := peer.NewContext(context.Background(), &peer.Peer{Addr: &net.TCPAddr{IP: net.ParseIP("192.0.2.7"), Port: 40000}})
	return metadata.NewIncomingContext(ctx, metadata.Pairs(
		"authorization", "Bearer "+testInferenceToken,
		"user-agent", "grpc-go/1.85.0",
		"content-type", "application/grpc",
		":authority", "localhost:8001",
		"grpc-accept-encoding", "identity,deflate,gzip",
		"x-request-id", "4b1c0f6e",
	))
}

// The per-call reads of one metadata key (the token, ModelMesh's model
// header) and the peer's loopback check copy nothing but the key's values:
// the whole metadata (a map and a slice per key) and the peer's address
// string were copied on every call.
func TestGRPCCallMetadataAllocations(t *testing.T) {
	ctx := perfCallContext()
	a, _ := newTestAuth(t, AuthOptions{InferenceToken: testInferenceToken})
	const infer = "/inference.GRPCInferenceService/ModelInfer"
	for _, tc := range []struct {
		name string
		f    func()
		max  float64
	}{
		{"grpcCheck", func() {
			if err := a.grpcCheck(ctx, infer, grpcAccess(infer)); err != nil {
				t.Fatal(err)
			}
		}, 1},
		{"meshModelName", func() { meshModelName(ctx, "m") }, 0},
		{"grpcAuthHeader", func() { grpcAuthHeader(ctx) }, 1},
	} {
		if n := testing.AllocsPerRun(100, tc.f); n > tc.max {
			t.Errorf("%s allocates %v times a call, want at most %v", tc.name, n, tc.max)
		}
	}
}
