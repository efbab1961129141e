package api

import (
	"context"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/api/modelmesh"
)

// ModelMesh is what the ModelMesh runtime SPI needs of the server: models
// loaded from a folder under an id ModelMesh chooses, sized in bytes
// against a capacity.
type ModelMesh interface {
	// MeshStatus describes the runtime. With purge, every model loaded
	// through MeshLoad before is unloaded first (ModelMesh restarted and
	// no longer knows them).
	MeshStatus(ctx context.Context, purge bool) (MeshStatus, error)
	// MeshLoad loads the model in folder path as id and returns its size
	// once it serves.
	MeshLoad(ctx context.Context, id, path string) (uint64, error)
	// MeshUnload unloads id; one not loaded is no error.
	MeshUnload(ctx context.Context, id string) error
	// MeshModelSize is the size of a loaded model.
	MeshModelSize(id string) (uint64, error)
	// MeshPredictSize estimates, at once, the size the model in path would
	// have loaded.
	MeshPredictSize(path string) (uint64, error)
}

// MeshStatus is the runtime's status and parameters.
type MeshStatus struct {
	Ready            bool
	Capacity         uint64 // bytes all models may take
	LoadTimeout      time.Duration
	DefaultModelSize uint64
	Version          string
}

// ModelMeshModelIDHeader is the gRPC metadata key ModelMesh names the
// model with when it forwards an inference request to a runtime. The v2
// gRPC service serves that model, whatever the request's model_name says.
const ModelMeshModelIDHeader = "mm-model-id"

// meshMethods are the inference methods ModelMesh may forward, each with
// the field of its request that names the model (model_name and name are
// field 1 of their messages), which ModelMesh overwrites with the model id.
var meshMethods = []string{
	inference.GRPCInferenceService_ModelInfer_FullMethodName,
	inference.GRPCInferenceService_ModelMetadata_FullMethodName,
	inference.GRPCInferenceService_ModelReady_FullMethodName,
}

// NewModelMesh returns a gRPC server for ModelMesh's model-runtime SPI
// (mmesh.ModelRuntime). It is meant for the ModelMesh container of the same
// pod, on a listener of its own.
func NewModelMesh(m ModelMesh, logger *slog.Logger, opts ...grpc.ServerOption) *grpc.Server {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	logger = logger.With("component", "modelmesh")
	base := []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(grpcRecoverUnary(logger)),
		grpc.ChainStreamInterceptor(grpcRecoverStream(logger)),
	}
	srv := grpc.NewServer(append(base, opts...)...)
	modelmesh.RegisterModelRuntimeServer(srv, &meshService{m: m, logger: logger})
	return srv
}

type meshService struct {
	modelmesh.UnimplementedModelRuntimeServer
	m      ModelMesh
	logger *slog.Logger
}

func (s *meshService) error(method string, err error) error {
	_, code := statusOf(err)
	if code == codes.Internal {
		s.logger.Error("model runtime call failed", "method", method, "err", err)
	}
	return status.Error(code, clipMessage(err.Error()))
}

func (s *meshService) RuntimeStatus(ctx context.Context, _ *modelmesh.RuntimeStatusRequest) (*modelmesh.RuntimeStatusResponse, error) {
	st, err := s.m.MeshStatus(ctx, true)
	if err != nil {
		return nil, s.error("runtimeStatus", err)
	}
	resp := &modelmesh.RuntimeStatusResponse{
		Status:                  modelmesh.RuntimeStatusResponse_STARTING,
		CapacityInBytes:         st.Capacity,
		MaxLoadingConcurrency:   1,
		ModelLoadingTimeoutMs:   uint32(min(st.LoadTimeout.Milliseconds(), 1<<31)),
		DefaultModelSizeInBytes: st.DefaultModelSize,
		RuntimeVersion:          st.Version,
		MethodInfos:             map[string]*modelmesh.RuntimeStatusResponse_MethodInfo{},
	}
	if st.Ready {
		resp.Status = modelmesh.RuntimeStatusResponse_READY
	}
	for _, m := range meshMethods {
		// Full method names start with a slash; ModelMesh's keys do not.
		resp.MethodInfos[m[1:]] = &modelmesh.RuntimeStatusResponse_MethodInfo{IdInjectionPath: []uint32{1}}
	}
	return resp, nil
}

func (s *meshService) LoadModel(ctx context.Context, req *modelmesh.LoadModelRequest) (*modelmesh.LoadModelResponse, error) {
	if req.GetModelId() == "" || req.GetModelPath() == "" {
		return nil, status.Error(codes.InvalidArgument, "loadModel needs modelId and modelPath")
	}
	size, err := s.m.MeshLoad(ctx, req.GetModelId(), req.GetModelPath())
	if err != nil {
		return nil, s.error("loadModel", err)
	}
	return &modelmesh.LoadModelResponse{SizeInBytes: size}, nil
}

func (s *meshService) UnloadModel(ctx context.Context, req *modelmesh.UnloadModelRequest) (*modelmesh.UnloadModelResponse, error) {
	if req.GetModelId() == "" {
		return nil, status.Error(codes.InvalidArgument, "unloadModel needs modelId")
	}
	if err := s.m.MeshUnload(ctx, req.GetModelId()); err != nil {
		return nil, s.error("unloadModel", err)
	}
	return &modelmesh.UnloadModelResponse{}, nil
}

func (s *meshService) ModelSize(_ context.Context, req *modelmesh.ModelSizeRequest) (*modelmesh.ModelSizeResponse, error) {
	size, err := s.m.MeshModelSize(req.GetModelId())
	if err != nil {
		return nil, s.error("modelSize", err)
	}
	return &modelmesh.ModelSizeResponse{SizeInBytes: size}, nil
}

func (s *meshService) PredictModelSize(_ context.Context, req *modelmesh.PredictModelSizeRequest) (*modelmesh.PredictModelSizeResponse, error) {
	if req.GetModelPath() == "" {
		return nil, status.Error(codes.InvalidArgument, "predictModelSize needs modelPath")
	}
	size, err := s.m.MeshPredictSize(req.GetModelPath())
	if err != nil {
		return nil, s.error("predictModelSize", err)
	}
	return &modelmesh.PredictModelSizeResponse{SizeInBytes: size}, nil
}

// ModelMeshModelIDBinHeader is the binary form of the model id header,
// which ModelMesh sends for ids that are not plain ASCII; gRPC carries it
// base64-encoded and hands it over decoded.
const ModelMeshModelIDBinHeader = ModelMeshModelIDHeader + "-bin"

// meshModelName is the model a v2 gRPC call is for: the one ModelMesh names
// in its header (text, else binary), else the request's own.
func meshModelName(ctx context.Context, name string) string {
	for _, key := range [...]string{ModelMeshModelIDHeader, ModelMeshModelIDBinHeader} {
		if ids := metadata.ValueFromIncomingContext(ctx, key); len(ids) > 0 && ids[0] != "" {
			return ids[0]
		}
	}
	return name
}
