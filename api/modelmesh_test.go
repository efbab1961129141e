package api

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/modelmesh"
	"github.com/sloserve/sloserve/models"
)

type fakeMesh struct {
	purged bool
	loaded map[string]uint64
}

func (f *fakeMesh) MeshStatus(_ context.Context, purge bool) (MeshStatus, error) {
	f.purged = purge
	return MeshStatus{Ready: true, Capacity: 1 << 30, LoadTimeout: 90 * time.Second, DefaultModelSize: 1 << 20, Version: "v"}, nil
}

func (f *fakeMesh) MeshLoad(_ context.Context, id, path string) (uint64, error) {
	if path == "bad" {
		return 0, models.ErrInvalidInput
	}
	f.loaded[id] = 42
	return 42, nil
}

func (f *fakeMesh) MeshUnload(_ context.Context, id string) error { delete(f.loaded, id); return nil }

func (f *fakeMesh) MeshModelSize(id string) (uint64, error) {
	if s, ok := f.loaded[id]; ok {
		return s, nil
	}
	return 0, models.ErrModelNotFound
}

func (f *fakeMesh) MeshPredictSize(string) (uint64, error) { return 0, errors.New("broken disk") }

func TestModelMeshService(t *testing.T) {
	f := &fakeMesh{loaded: map[string]uint64{}}
	s := &meshService{m: f, logger: slog.New(slog.DiscardHandler)}
	ctx := t.Context()
	st, err := s.RuntimeStatus(ctx, &modelmesh.RuntimeStatusRequest{})
	if err != nil || !f.purged || st.Status != modelmesh.RuntimeStatusResponse_READY || st.CapacityInBytes != 1<<30 || st.ModelLoadingTimeoutMs != 90000 {
		t.Errorf("RuntimeStatus = %v, %v (purged %v)", st, err, f.purged)
	}
	for _, m := range []string{"inference.GRPCInferenceService/ModelInfer", "inference.GRPCInferenceService/ModelMetadata", "inference.GRPCInferenceService/ModelReady"} {
		if st.MethodInfos[m] == nil {
			t.Errorf("no methodInfo for %s", m)
		}
	}
	if r, err := s.LoadModel(ctx, &modelmesh.LoadModelRequest{ModelId: "m", ModelPath: "/p"}); err != nil || r.SizeInBytes != 42 {
		t.Errorf("LoadModel = %v, %v", r, err)
	}
	for _, tt := range []struct {
		name string
		call func() error
		want codes.Code
	}{
		{"load without a path", func() error { _, err := s.LoadModel(ctx, &modelmesh.LoadModelRequest{ModelId: "m"}); return err }, codes.InvalidArgument},
		{"load a bad folder", func() error {
			_, err := s.LoadModel(ctx, &modelmesh.LoadModelRequest{ModelId: "m", ModelPath: "bad"})
			return err
		}, codes.InvalidArgument},
		{"size of an unknown model", func() error { _, err := s.ModelSize(ctx, &modelmesh.ModelSizeRequest{ModelId: "x"}); return err }, codes.NotFound},
		{"unload without an id", func() error { _, err := s.UnloadModel(ctx, &modelmesh.UnloadModelRequest{}); return err }, codes.InvalidArgument},
		{"predict failing", func() error {
			_, err := s.PredictModelSize(ctx, &modelmesh.PredictModelSizeRequest{ModelPath: "/p"})
			return err
		}, codes.Internal},
	} {
		if err := tt.call(); status.Code(err) != tt.want {
			t.Errorf("%s: %v, want %v", tt.name, err, tt.want)
		}
	}
}

func TestMeshModelName(t *testing.T) {
	if got := meshModelName(t.Context(), "own"); got != "own" {
		t.Errorf("without the header: %q", got)
	}
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs(ModelMeshModelIDHeader, "mesh-id"))
	if got := meshModelName(ctx, "own"); got != "mesh-id" {
		t.Errorf("with the header: %q", got)
	}
	ctx = metadata.NewIncomingContext(t.Context(), metadata.Pairs(ModelMeshModelIDHeader, ""))
	if got := meshModelName(ctx, "own"); got != "own" {
		t.Errorf("with an empty header: %q", got)
	}
	// The binary header, as gRPC hands it over (decoded): an id that is
	// not plain ASCII.
	ctx = metadata.NewIncomingContext(t.Context(), metadata.Pairs(ModelMeshModelIDBinHeader, "modèle__isvc-1"))
	if got := meshModelName(ctx, "own"); got != "modèle__isvc-1" {
		t.Errorf("with the binary header: %q", got)
	}
}
