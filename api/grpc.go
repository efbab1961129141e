package api

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"math"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/models"
)

// grpcMaxSendMsgBytes caps a response message. Outputs are produced by models the
// operator configured, so the cap only guards against runaway responses.
const grpcMaxSendMsgBytes = 1 << 30

// grpcHealthWatchInterval is how often a health Watch stream re-reads readiness.
const grpcHealthWatchInterval = time.Second

// NewGRPC returns a gRPC server that serves b over the Open Inference
// Protocol v2 (inference.GRPCInferenceService), the standard health service
// (grpc.health.v1, SERVING while b is ready) and server reflection.
//
// Messages over lim.MaxRequestBytes are refused by gRPC with
// RESOURCE_EXHAUSTED; a handler panic becomes INTERNAL and is logged. opts
// are applied after sloserve's own options, so they may override them;
// interceptors in opts run inside the panic recovery.
func NewGRPC(b Backend, lim Limits, logger *slog.Logger, opts ...grpc.ServerOption) *grpc.Server {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	logger = logger.With("component", "grpc")
	mem := newGRPCMemory(lim.Memory, lim.MaxRequestBytes, lim.MaxHeaderBytes)
	mem.bodyTimeout, mem.logger, mem.slow = lim.BodyTimeout, logger, lim.SlowClients
	// A request its model would refuse anyway is refused before it is
	// decoded, as REST refuses one before its body is read. The deadline
	// is the model's SLO from now; the call's own deadline and timeout
	// parameter are checked at admission, once it is decoded.
	codec := newGRPCDecodeCodec(lim.Memory, func(name, version string) error {
		return b.Preadmit(context.Background(), name, version, time.Time{})
	})
	base := []grpc.ServerOption{
		grpc.ForceServerCodecV2(codec),
		grpc.InTapHandle(grpcTap(lim.RefuseUnread, mem)),
		grpc.StatsHandler(grpcMemoryStats{codec: codec, write: writeLimit{lim.WriteTimeout, lim.SlowClients, logger}}),
		grpc.MaxSendMsgSize(grpcMaxSendMsgBytes),
		grpc.NumStreamWorkers(grpcStreamWorkers),
		grpc.ChainUnaryInterceptor(grpcCallStreamUnary, grpcRecoverUnary(logger)),
		grpc.ChainStreamInterceptor(grpcCallStreamStream, grpcRecoverStream(logger)),
	}
	if lim.MaxRequestBytes > 0 {
		base = append(base, grpc.MaxRecvMsgSize(int(min(lim.MaxRequestBytes, math.MaxInt32))))
	}
	srv := grpc.NewServer(append(base, opts...)...)
	inference.RegisterGRPCInferenceServiceServer(srv, &grpcService{b: b, lim: lim, logger: logger, codec: codec})
	grpc_health_v1.RegisterHealthServer(srv, &grpcHealthServer{b: b, interval: grpcHealthWatchInterval})
	reflection.Register(srv)
	mem.setMethods(srv)
	return srv
}

// GRPCTransportOptions are the gRPC server's transport settings for
// tensors of megabytes, for NewGRPC's opts: flow-control windows large
// enough that a large request is not paced by window updates, and a read
// buffer of grpcReadBufferSize.
func GRPCTransportOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.InitialWindowSize(16 << 20), grpc.InitialConnWindowSize(64 << 20),
		grpc.ReadBufferSize(grpcReadBufferSize), grpc.WriteBufferSize(grpcWriteBufferSize),
	}
}

// grpcReadBufferSize is the buffer a connection's frames are read
// through, held for the connection's life and reserved with the rest of
// the connection from limits.max_memory (GRPCConnectionBytes). Frames carry at most 16 KiB of a
// message each, and grpc-go copies each out of the buffer into one of its
// own: the buffer's size sets how many reads a message takes, each a
// system call and a turn of the connection's memory accounting
// (connReading.arrived). A refused 1.2 MB message took 1.36-1.56 ms of
// the server's CPU on one connection with grpc-go's 32 KiB, 0.91-1.24 ms
// with 128 KiB (medians of 3 in three runs on a shared machine); 256 KiB
// and 1 MiB gained no more (BenchmarkGRPCRefusedReceive).
const grpcReadBufferSize = 128 << 10

// grpcStreamWorkers is how many goroutines serve calls, reused from call to
// call: a fresh goroutine per call starts with a small stack and grows it,
// by copying, through the whole request path (decode, scheduler, runner
// call) on every call. Calls beyond this many at once get a goroutine of
// their own, as without workers.
const grpcStreamWorkers = 64

// grpcArrivalKey keys the time a call's headers arrived in its context.
type grpcArrivalKey struct{}

// grpcTap notes when a call's headers arrived, before its message is
// read: a request's SLO counts from then, as over REST, so that the time a
// large message takes to arrive is not hidden from the scheduler. A
// ModelInfer call that refuse refuses is ended here with
// RESOURCE_EXHAUSTED, before its message is read.
//
// Every call's message is given its memory here (grpcMemory.reserve, by
// its connection's accounting when the LimitedListener accepted it): one
// that does not fit in the budget is ended with RESOURCE_EXHAUSTED. A call
// on a connection whose frames are followed (GRPCCredentials) keeps its
// answer's memory until the answer is written (connWrites).
func grpcTap(refuse func() error, mem *grpcMemory) tap.ServerInHandle {
	return func(ctx context.Context, info *tap.Info) (context.Context, error) {
		if refuse != nil && info.FullMethodName == inference.GRPCInferenceService_ModelInfer_FullMethodName {
			if err := refuse(); err != nil {
				return ctx, status.Error(codes.ResourceExhausted, err.Error())
			}
		}
		var conn *connReading
		var writes *connWrites
		if p, ok := peer.FromContext(ctx); ok {
			conn, writes = connReadingOf(p.Addr), connWritesOf(p.Addr)
		}
		ctx, err := mem.reserve(ctx, info.FullMethodName, conn, grpcHeaderBytes(info.Header))
		if err != nil {
			return ctx, status.Error(codes.ResourceExhausted, err.Error())
		}
		call, _ := ctx.Value(grpcCallKey{}).(*grpcCall)
		if err := ctx.Err(); err != nil {
			// grpc-go ends a call whose deadline passed by the time its
			// tap returns without running it (no stats.End): what it
			// reserved is given back here.
			call.abandon()
			return ctx, status.FromContextError(err).Err()
		}
		if call != nil {
			call.writes = writes
		}
		return context.WithValue(ctx, grpcArrivalKey{}, time.Now()), nil
	}
}

// grpcArrival is when the call's headers arrived, or now if not known.
func grpcArrival(ctx context.Context) time.Time {
	if t, ok := ctx.Value(grpcArrivalKey{}).(time.Time); ok {
		return t
	}
	return time.Now()
}

// grpcService implements the inference service over a Backend.
type grpcService struct {
	inference.UnimplementedGRPCInferenceServiceServer

	b      Backend
	lim    Limits
	logger *slog.Logger
	codec  *grpcDecodeCodec // nil: messages decoded without reservations
}

var _ inference.GRPCInferenceServiceServer = (*grpcService)(nil)

// grpcError turns an error from decoding or from the Backend into a gRPC
// status error. Internal errors are logged: the client only sees the message.
func (s *grpcService) grpcError(method string, err error) error {
	_, code := statusOf(err)
	if code == codes.Internal {
		s.logger.Error("request failed", "method", method, "err", err)
	}
	return status.Error(code, clipMessage(err.Error()))
}

// ServerLive reports whether the server can answer requests.
func (s *grpcService) ServerLive(context.Context, *inference.ServerLiveRequest) (*inference.ServerLiveResponse, error) {
	return &inference.ServerLiveResponse{Live: s.b.Live()}, nil
}

// ServerReady reports whether the server is ready for inference.
func (s *grpcService) ServerReady(context.Context, *inference.ServerReadyRequest) (*inference.ServerReadyResponse, error) {
	return &inference.ServerReadyResponse{Ready: s.b.Ready()}, nil
}

// ModelReady reports whether a model version is ready; an unknown model or
// version is not ready (OK, ready false), as Triton answers.
func (s *grpcService) ModelReady(ctx context.Context, req *inference.ModelReadyRequest) (*inference.ModelReadyResponse, error) {
	ready, err := modelReady(s.b, meshModelName(ctx, req.GetName()), req.GetVersion())
	if err != nil {
		return nil, s.grpcError("ModelReady", err)
	}
	return &inference.ModelReadyResponse{Ready: ready}, nil
}

// ServerMetadata gives the server's name, version and extensions.
func (s *grpcService) ServerMetadata(context.Context, *inference.ServerMetadataRequest) (*inference.ServerMetadataResponse, error) {
	return &inference.ServerMetadataResponse{
		Name:       ServerName,
		Version:    s.b.ServerVersion(),
		Extensions: extensionsOf(s.lim.SharedMemory),
	}, nil
}

// ModelMetadata describes a model or one of its versions.
func (s *grpcService) ModelMetadata(ctx context.Context, req *inference.ModelMetadataRequest) (*inference.ModelMetadataResponse, error) {
	md, err := s.b.Metadata(meshModelName(ctx, req.GetName()), req.GetVersion())
	if err != nil {
		return nil, s.grpcError("ModelMetadata", err)
	}
	return grpcModelMetadata(md), nil
}

// ModelInfer runs one inference. The client's deadline flows to the Backend
// through ctx; the timeout parameter and the model's SLO count from when the
// call's headers arrived.
func (s *grpcService) ModelInfer(ctx context.Context, req *inference.ModelInferRequest) (*inference.ModelInferResponse, error) {
	arrival := grpcArrival(ctx)
	// The message is in and decoded, its wire form given back: the call
	// holds what its decoded form took (reserved by the codec) and
	// reserves its response's before handing it to gRPC.
	mem := grpcCallMemory(ctx)
	decoded, err := s.codec.takeDecoded(ctx, req)
	mem.ShrinkTo(0)
	if err != nil {
		return nil, s.grpcError("ModelInfer", err)
	}
	defer decoded.Release()
	var shm *shmUse
	if s.lim.SharedMemory != nil && grpcUsesSharedMemory(req) {
		// The regions the request names stay mapped until its outputs
		// are written.
		shm = &shmUse{s: s.lim.SharedMemory, authHeader: grpcAuthHeader(ctx)}
		defer shm.release()
	}
	in, targets, err := decodeGRPCInferShm(req, s.lim, arrival, shm)
	if err != nil {
		return nil, s.grpcError("ModelInfer", err)
	}
	in.Arrival = arrival
	name := meshModelName(ctx, req.GetModelName())
	ctx, tr := startInferTrace(ctx, s.lim.Tracer, grpcTraceCarrier(ctx), arrival, "grpc", name, req.GetModelVersion())
	goTraceLog(ctx, "infer", name, req.GetId())
	out, version, err := s.b.Infer(ctx, name, req.GetModelVersion(), in)
	defer func() { tr.end(err) }()
	if err != nil {
		return nil, s.grpcError("ModelInfer", err)
	}
	goTraceLog(ctx, "answer", name, req.GetId())
	tr.answering(ctx, version)
	// The outputs, and their copy in the message gRPC encodes.
	if err = mem.Grow(2*outputBytes(out.Outputs), "the response"); err != nil {
		return nil, s.grpcError("ModelInfer", err)
	}
	msg := encodeGRPCInferResponse(name, version, req.GetId(), out)
	if err = writeGRPCShmOutputs(msg, out.Outputs, targets); err != nil {
		return nil, s.grpcError("ModelInfer", err)
	}
	return msg, nil
}

// ModelStatistics reports per model version statistics in Triton's shape.
func (s *grpcService) ModelStatistics(_ context.Context, req *inference.ModelStatisticsRequest) (*inference.ModelStatisticsResponse, error) {
	stats, err := s.b.Statistics(req.GetName(), req.GetVersion())
	if err != nil {
		return nil, s.grpcError("ModelStatistics", err)
	}
	return grpcStatistics(stats), nil
}

// RepositoryIndex lists the models of the repository.
func (s *grpcService) RepositoryIndex(ctx context.Context, req *inference.RepositoryIndexRequest) (*inference.RepositoryIndexResponse, error) {
	if err := grpcCheckRepositoryName(req.GetRepositoryName()); err != nil {
		return nil, s.grpcError("RepositoryIndex", err)
	}
	idx, err := s.b.RepositoryIndex(ctx, req.GetReady())
	if err != nil {
		return nil, s.grpcError("RepositoryIndex", err)
	}
	resp := &inference.RepositoryIndexResponse{Models: make([]*inference.RepositoryIndexResponse_ModelIndex, len(idx))}
	for i, e := range idx {
		resp.Models[i] = &inference.RepositoryIndexResponse_ModelIndex{
			Name:    e.Name,
			Version: e.Version,
			State:   string(e.State),
			Reason:  e.Reason,
		}
	}
	return resp, nil
}

// RepositoryModelLoad loads or reloads a model and waits until it is ready.
// The parameter "config" (a string_param holding a Triton ModelConfig in
// JSON, as tritonclient's load_model(config=...) sends it:
// grpc/_client.py load_model) is a config override; file overrides are
// refused (checkLoadParams).
func (s *grpcService) RepositoryModelLoad(ctx context.Context, req *inference.RepositoryModelLoadRequest) (*inference.RepositoryModelLoadResponse, error) {
	repo, model := grpcRepositoryTarget(req.GetRepositoryName(), req.GetModelName())
	err := grpcCheckRepositoryRequest(repo, model, nil, nil)
	var config []byte
	var rest []string
	for k, p := range req.GetParameters() {
		if k != loadParamConfig {
			rest = append(rest, k)
			continue
		}
		sp, ok := p.GetParameterChoice().(*inference.ModelRepositoryParameter_StringParam)
		if !ok {
			err = cmp.Or(err, fmt.Errorf("%w: parameter %q must be a string_param holding the model config in JSON", errBadRequest, loadParamConfig))
			continue
		}
		config = []byte(sp.StringParam)
	}
	if err == nil {
		err = checkLoadParams(rest)
	}
	if err == nil {
		err = s.b.LoadModel(ctx, model, config)
	}
	if err != nil {
		return nil, s.grpcError("RepositoryModelLoad", err)
	}
	return &inference.RepositoryModelLoadResponse{}, nil
}

// loadParamConfig is the load parameter of Triton's config override.
const loadParamConfig = "config"

// checkLoadParams refuses the load parameters other than config: file
// overrides ("file:<path>", model files sent with the request, which
// sloserve never writes to disk) and anything else.
func checkLoadParams(keys []string) error {
	if len(keys) == 0 {
		return nil
	}
	slices.Sort(keys)
	for _, k := range keys {
		if strings.HasPrefix(k, "file:") {
			return fmt.Errorf("%w: load parameter %q: file overrides are not supported: sloserve writes nothing a request sends to disk; "+
				"put the model files in the repository and load it, with a config override if needed", errBadRequest, clipValue(k))
		}
	}
	return fmt.Errorf("%w: parameters not supported: %s (a load takes only %q)", errBadRequest, clipValue(strings.Join(keys, ", ")), loadParamConfig)
}

// grpcUnloadParams are the unload parameters accepted and ignored.
// tritonclient always sends "unload_dependents"; sloserve has no ensembles,
// so a model has no dependents to unload.
var grpcUnloadParams = []string{"unload_dependents"}

// RepositoryModelUnload unloads a model after its in-flight requests finish.
func (s *grpcService) RepositoryModelUnload(ctx context.Context, req *inference.RepositoryModelUnloadRequest) (*inference.RepositoryModelUnloadResponse, error) {
	repo, model := grpcRepositoryTarget(req.GetRepositoryName(), req.GetModelName())
	err := grpcCheckRepositoryRequest(repo, model, req.GetParameters(), grpcUnloadParams)
	if err == nil {
		err = s.b.UnloadModel(ctx, model)
	}
	if err != nil {
		return nil, s.grpcError("RepositoryModelUnload", err)
	}
	return &inference.RepositoryModelUnloadResponse{}, nil
}

// grpcRepositoryTarget reads the model a load or unload request names.
// KServe's Python protocol puts model_name in field 1, which is Triton's
// repository_name; a request with only field 1 set is read the KServe way.
func grpcRepositoryTarget(repo, model string) (string, string) {
	if model == "" && repo != "" {
		return "", repo
	}
	return repo, model
}

// grpcCheckRepositoryName accepts only the unnamed repository: sloserve serves one
// model repository and does not name it.
func grpcCheckRepositoryName(name string) error {
	if name != "" {
		return fmt.Errorf("%w: repository_name is not supported (got %q)", errBadRequest, name)
	}
	return nil
}

// grpcCheckRepositoryRequest validates a load or unload request: the repository
// name, the model name, and the parameters, of which only those in allowed
// are accepted.
func grpcCheckRepositoryRequest(repo, model string, params map[string]*inference.ModelRepositoryParameter, allowed []string) error {
	if err := grpcCheckRepositoryName(repo); err != nil {
		return err
	}
	if err := grpcCheckModelName(model); err != nil {
		return err
	}
	var refused []string
	for k := range params {
		if !slices.Contains(allowed, k) {
			refused = append(refused, k)
		}
	}
	if len(refused) > 0 {
		slices.Sort(refused)
		return fmt.Errorf("%w: parameters not supported: %s", errBadRequest, strings.Join(refused, ", "))
	}
	return nil
}

// grpcCheckModelName refuses model names that are empty or could be read as a
// path; the backend may use a name to find a folder in the repository.
func grpcCheckModelName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: model_name is required", errBadRequest)
	case strings.ContainsAny(name, "/\\\x00"), strings.Contains(name, ".."):
		return fmt.Errorf("%w: invalid model name %q", errBadRequest, name)
	}
	return nil
}

// grpcRecoverUnary turns a panic in a unary handler into an INTERNAL error.
func grpcRecoverUnary(logger *slog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
		defer func() {
			if r := recover(); r != nil {
				logger.Error("handler panic", "method", info.FullMethod, "panic", r, "stack", string(debug.Stack()))
				resp, err = nil, status.Error(codes.Internal, "internal error")
			}
		}()
		return handler(ctx, req)
	}
}

// grpcRecoverStream turns a panic in a streaming handler (health Watch,
// reflection) into an INTERNAL error.
func grpcRecoverStream(logger *slog.Logger) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) (err error) {
		defer func() {
			if r := recover(); r != nil {
				logger.Error("handler panic", "method", info.FullMethod, "panic", r, "stack", string(debug.Stack()))
				err = status.Error(codes.Internal, "internal error")
			}
		}()
		return handler(srv, ss)
	}
}

// grpcHealthServer is grpc.health.v1 over a Backend: the server ("") and the
// inference service are SERVING while the backend is ready. It reads
// readiness on every call, so nothing has to push status changes to it.
type grpcHealthServer struct {
	grpc_health_v1.UnimplementedHealthServer

	b Backend
	// interval is how often Watch re-reads readiness.
	interval time.Duration
}

var _ grpc_health_v1.HealthServer = (*grpcHealthServer)(nil)

// grpcHealthServices are the service names the health server knows.
var grpcHealthServices = []string{"", inference.GRPCInferenceService_ServiceDesc.ServiceName}

func (h *grpcHealthServer) status() grpc_health_v1.HealthCheckResponse_ServingStatus {
	if h.b.Ready() {
		return grpc_health_v1.HealthCheckResponse_SERVING
	}
	return grpc_health_v1.HealthCheckResponse_NOT_SERVING
}

// Check reports the status of the server or of the inference service.
func (h *grpcHealthServer) Check(_ context.Context, req *grpc_health_v1.HealthCheckRequest) (*grpc_health_v1.HealthCheckResponse, error) {
	if !slices.Contains(grpcHealthServices, req.GetService()) {
		return nil, status.Errorf(codes.NotFound, "unknown service %q", req.GetService())
	}
	return &grpc_health_v1.HealthCheckResponse{Status: h.status()}, nil
}

// List reports the status of every known service.
func (h *grpcHealthServer) List(context.Context, *grpc_health_v1.HealthListRequest) (*grpc_health_v1.HealthListResponse, error) {
	st := h.status()
	resp := &grpc_health_v1.HealthListResponse{Statuses: make(map[string]*grpc_health_v1.HealthCheckResponse, len(grpcHealthServices))}
	for _, name := range grpcHealthServices {
		resp.Statuses[name] = &grpc_health_v1.HealthCheckResponse{Status: st}
	}
	return resp, nil
}

// Watch sends the current status, then a new message whenever it changes,
// polling readiness every interval on the stream's own goroutine. An unknown
// service is reported as SERVICE_UNKNOWN, as the protocol asks, and never
// changes. Its one message is in: the memory and the health slot its
// reading took are given back for the stream's long life.
func (h *grpcHealthServer) Watch(req *grpc_health_v1.HealthCheckRequest, stream grpc.ServerStreamingServer[grpc_health_v1.HealthCheckResponse]) error {
	grpcCallMemory(stream.Context()).Release()
	known := slices.Contains(grpcHealthServices, req.GetService())
	current := func() grpc_health_v1.HealthCheckResponse_ServingStatus {
		if !known {
			return grpc_health_v1.HealthCheckResponse_SERVICE_UNKNOWN
		}
		return h.status()
	}
	last := current()
	if err := stream.Send(&grpc_health_v1.HealthCheckResponse{Status: last}); err != nil {
		return err
	}
	tick := time.NewTicker(h.interval)
	defer tick.Stop()
	for {
		select {
		case <-stream.Context().Done():
			return status.FromContextError(stream.Context().Err()).Err()
		case <-tick.C:
			if st := current(); st != last {
				if err := stream.Send(&grpc_health_v1.HealthCheckResponse{Status: st}); err != nil {
					return err
				}
				last = st
			}
		}
	}
}

// grpcModelMetadata converts model metadata to its protocol message.
func grpcModelMetadata(md models.Metadata) *inference.ModelMetadataResponse {
	resp := &inference.ModelMetadataResponse{
		Name:     md.Name,
		Versions: md.Versions,
		Platform: md.Platform,
		Inputs:   make([]*inference.ModelMetadataResponse_TensorMetadata, len(md.Inputs)),
		Outputs:  make([]*inference.ModelMetadataResponse_TensorMetadata, len(md.Outputs)),
	}
	for i, t := range md.Inputs {
		resp.Inputs[i] = &inference.ModelMetadataResponse_TensorMetadata{Name: t.Name, Datatype: string(t.DataType), Shape: t.Shape}
	}
	for i, t := range md.Outputs {
		resp.Outputs[i] = &inference.ModelMetadataResponse_TensorMetadata{Name: t.Name, Datatype: string(t.DataType), Shape: t.Shape}
	}
	return resp
}

// grpcStatistics converts statistics to Triton's message: last_inference
// in milliseconds since the epoch (0: never), durations in nanoseconds.
func grpcStatistics(stats []models.Statistics) *inference.ModelStatisticsResponse {
	resp := &inference.ModelStatisticsResponse{ModelStats: make([]*inference.ModelStatistics, len(stats))}
	for i, st := range stats {
		var last uint64
		if !st.LastInference.IsZero() {
			last = uint64(max(st.LastInference.UnixMilli(), 0))
		}
		resp.ModelStats[i] = &inference.ModelStatistics{
			Name:           st.Name,
			Version:        st.Version,
			LastInference:  last,
			InferenceCount: st.InferenceCount,
			ExecutionCount: st.ExecutionCount,
			InferenceStats: &inference.InferStatistics{
				Success:       grpcDuration(st.Success),
				Fail:          grpcDuration(st.Fail),
				Queue:         grpcDuration(st.Queue),
				ComputeInput:  grpcDuration(st.ComputeInput),
				ComputeInfer:  grpcDuration(st.ComputeInfer),
				ComputeOutput: grpcDuration(st.ComputeOutput),
			},
		}
		for _, b := range st.Batches {
			resp.ModelStats[i].BatchStats = append(resp.ModelStats[i].BatchStats, &inference.InferBatchStatistics{
				BatchSize:     uint64(max(b.BatchSize, 0)),
				ComputeInput:  grpcDuration(b.ComputeInput),
				ComputeInfer:  grpcDuration(b.ComputeInfer),
				ComputeOutput: grpcDuration(b.ComputeOutput),
			})
		}
		if q := st.SLO; q != nil {
			resp.ModelStats[i].Slo = &inference.SLOStatistics{
				Class: q.Class, LatencyTargetMs: float64(q.LatencyTarget) / float64(time.Millisecond),
				Arrived: q.Arrived, Good: q.Good, Late: q.Late, Rejected: q.Rejected,
				Dropped: q.Dropped, Failed: q.Failed, Canceled: q.Canceled,
				QueueDepth: uint64(max(q.QueueDepth, 0)), Goodput: q.Goodput, Attainment: q.Attainment,
				MeanQueueDelayNs: uint64(max(q.MeanQueueDelay.Nanoseconds(), 0)),
			}
		}
	}
	return resp
}

func grpcDuration(d models.Duration) *inference.StatisticDuration {
	return &inference.StatisticDuration{Count: d.Count, Ns: uint64(max(d.Total.Nanoseconds(), 0))}
}
