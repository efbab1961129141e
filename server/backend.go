package server

import (
	"context"
	"sync/atomic"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/runtime"
)

// backend serves the protocol handlers from the model registry.
type backend struct {
	reg      *models.Registry
	ready    atomic.Bool // initial loads done and not shutting down
	stopping atomic.Bool
}

var _ api.Backend = (*backend)(nil)

func (b *backend) Live() bool            { return !b.stopping.Load() }
func (b *backend) Ready() bool           { return b.ready.Load() && !b.stopping.Load() }
func (b *backend) ServerVersion() string { return Version }

func (b *backend) ModelReady(name, version string) (bool, error) {
	return b.reg.ModelReady(name, version)
}

func (b *backend) ModelMetadata(name, version string) (models.Metadata, error) {
	return b.reg.Metadata(name, version)
}

func (b *backend) Infer(ctx context.Context, name, version string, req *runtime.InferRequest) (*runtime.InferResponse, string, error) {
	return b.reg.Infer(ctx, name, version, req)
}

func (b *backend) Statistics(name, version string) ([]models.Statistics, error) {
	return b.reg.Statistics(name, version)
}

func (b *backend) RepositoryIndex(ctx context.Context, readyOnly bool) ([]models.IndexEntry, error) {
	return b.reg.Index(readyOnly), nil
}

func (b *backend) LoadModel(ctx context.Context, name string) error {
	return b.reg.Load(ctx, name)
}

func (b *backend) UnloadModel(ctx context.Context, name string) error {
	return b.reg.Unload(ctx, name)
}
