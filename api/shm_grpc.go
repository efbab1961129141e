package api

// The shared-memory extensions over gRPC: the system shared-memory RPCs,
// the CUDA ones (as Triton without GPUs: no regions, unregister a no-op,
// register INVALID_ARGUMENT, not UNAVAILABLE, since a retry can never
// succeed), and the tensor parameters of inference requests.

import (
	"context"
	"fmt"

	"google.golang.org/grpc/peer"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/runtime"
)

// grpcSharedMemory reports whether tensor parameters ask for shared memory.
func grpcSharedMemory(params map[string]*inference.InferParameter) bool {
	for _, k := range []string{paramShmRegion, paramShmSize, paramShmOffset} {
		if _, ok := params[k]; ok {
			return true
		}
	}
	return false
}

// grpcShmParams reads a tensor's shared-memory parameters: the region (a
// string_param) and byte size (an int64_param or uint64_param >= 0) are
// required, the offset defaults to 0.
func grpcShmParams(kind, name string, params map[string]*inference.InferParameter) (shmParams, error) {
	var p shmParams
	region, ok := params[paramShmRegion]
	if !ok {
		return p, fmt.Errorf("%w: %s %q: %s and %s need %s", errBadRequest, kind, name, paramShmOffset, paramShmSize, paramShmRegion)
	}
	sp, ok := region.GetParameterChoice().(*inference.InferParameter_StringParam)
	if !ok {
		return p, fmt.Errorf("%w: %s %q: parameter %q must be a string_param, not %s", errBadRequest, kind, name, paramShmRegion, grpcParamKind(region))
	}
	p.region = sp.StringParam
	u64 := func(key string) (uint64, error) {
		neg, v, err := grpcIntParam(key, params[key])
		if err != nil {
			return 0, fmt.Errorf("%s %q: %w", kind, name, err)
		}
		if neg {
			return 0, fmt.Errorf("%w: %s %q: parameter %q must be >= 0, not %s", errBadRequest, kind, name, key, grpcIntString(neg, v))
		}
		return v, nil
	}
	if _, ok := params[paramShmSize]; !ok {
		return p, fmt.Errorf("%w: %s %q: %s needs %s", errBadRequest, kind, name, paramShmRegion, paramShmSize)
	}
	var err error
	if p.size, err = u64(paramShmSize); err != nil {
		return p, err
	}
	if _, ok := params[paramShmOffset]; ok {
		if p.offset, err = u64(paramShmOffset); err != nil {
			return p, err
		}
	}
	return p, nil
}

// grpcShmInput reads an input's data from shared memory; it must carry no
// contents of its own.
func grpcShmInput(u *shmUse, in *inference.ModelInferRequest_InferInputTensor, lim Limits) (runtime.Tensor, error) {
	name := in.GetName()
	if set := grpcSetContents(in.GetContents()); len(set) > 0 {
		return runtime.Tensor{}, fmt.Errorf("%w: input %q has both %s and %s", errBadRequest, name, set[0], paramShmRegion)
	}
	dt, shape, n, err := grpcCheckInput(in, lim)
	if err != nil {
		return runtime.Tensor{}, err
	}
	p, err := grpcShmParams("input", name, in.GetParameters())
	if err != nil {
		return runtime.Tensor{}, err
	}
	data, err := u.input(name, dt, shape, n, p)
	if err != nil {
		return runtime.Tensor{}, err
	}
	return runtime.Tensor{Name: name, DataType: dt, Shape: shape, Data: data, Mapped: true}, nil
}

// grpcShmOutput checks a requested output's shared-memory parameters.
func grpcShmOutput(u *shmUse, name string, params map[string]*inference.InferParameter) (shmTarget, error) {
	p, err := grpcShmParams("output", name, params)
	if err != nil {
		return shmTarget{}, err
	}
	return u.output(name, p)
}

// writeGRPCShmOutputs writes the outputs that have a shared-memory target
// into their regions: in the response their raw_output_contents entry is
// empty (kept, so that entries still line up with outputs) and their
// parameters name the region, offset and bytes written.
func writeGRPCShmOutputs(msg *inference.ModelInferResponse, outs []runtime.Tensor, targets []shmTarget) error {
	for i := range targets {
		t := &targets[i]
		for k := range outs {
			if outs[k].Name != t.name {
				continue
			}
			written, err := t.write(&outs[k])
			if err != nil {
				return err
			}
			msg.RawOutputContents[k] = nil
			msg.Outputs[k].Parameters = map[string]*inference.InferParameter{
				paramShmRegion: {ParameterChoice: &inference.InferParameter_StringParam{StringParam: t.params.region}},
				paramShmOffset: {ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: int64(t.params.offset)}},
				paramShmSize:   {ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: int64(written)}},
			}
		}
	}
	return nil
}

// grpcShmCaller describes the caller of a call (shmCallerOf).
func grpcShmCaller(ctx context.Context) shmCaller {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return shmCaller{uid: -1}
	}
	return shmCallerOf(p.Addr.String(), netAddrString(p.LocalAddr))
}

// SystemSharedMemoryStatus describes the caller's regions (all, or the one
// named).
func (s *grpcService) SystemSharedMemoryStatus(ctx context.Context, req *inference.SystemSharedMemoryStatusRequest) (*inference.SystemSharedMemoryStatusResponse, error) {
	st, err := s.lim.SharedMemory.Status(grpcAuthHeader(ctx), req.GetName())
	if err != nil {
		return nil, s.grpcError("SystemSharedMemoryStatus", err)
	}
	resp := &inference.SystemSharedMemoryStatusResponse{Regions: make(map[string]*inference.SystemSharedMemoryStatusResponse_RegionStatus, len(st))}
	for _, r := range st {
		resp.Regions[r.Name] = &inference.SystemSharedMemoryStatusResponse_RegionStatus{
			Name: r.Name, Key: r.Key, Offset: r.Offset, ByteSize: r.ByteSize,
		}
	}
	return resp, nil
}

// SystemSharedMemoryRegister registers a region of a POSIX shared-memory
// object; only callers on the server's host may.
func (s *grpcService) SystemSharedMemoryRegister(ctx context.Context, req *inference.SystemSharedMemoryRegisterRequest) (*inference.SystemSharedMemoryRegisterResponse, error) {
	err := s.lim.SharedMemory.Register(grpcAuthHeader(ctx), grpcShmCaller(ctx),
		req.GetName(), req.GetKey(), req.GetOffset(), req.GetByteSize())
	if err != nil {
		return nil, s.grpcError("SystemSharedMemoryRegister", err)
	}
	return &inference.SystemSharedMemoryRegisterResponse{}, nil
}

// SystemSharedMemoryUnregister unregisters one of the caller's regions, or
// all of them.
func (s *grpcService) SystemSharedMemoryUnregister(ctx context.Context, req *inference.SystemSharedMemoryUnregisterRequest) (*inference.SystemSharedMemoryUnregisterResponse, error) {
	if err := s.lim.SharedMemory.Unregister(grpcAuthHeader(ctx), req.GetName()); err != nil {
		return nil, s.grpcError("SystemSharedMemoryUnregister", err)
	}
	return &inference.SystemSharedMemoryUnregisterResponse{}, nil
}

// CudaSharedMemoryStatus lists no regions (NOT_FOUND for a named one):
// none can be registered. See errCUDASharedMemory.
func (s *grpcService) CudaSharedMemoryStatus(_ context.Context, req *inference.CudaSharedMemoryStatusRequest) (*inference.CudaSharedMemoryStatusResponse, error) {
	if req.GetName() != "" {
		return nil, s.grpcError("CudaSharedMemoryStatus", errCUDARegionUnknown(req.GetName()))
	}
	return &inference.CudaSharedMemoryStatusResponse{}, nil
}

// CudaSharedMemoryRegister fails: there is no CUDA shared memory.
func (s *grpcService) CudaSharedMemoryRegister(context.Context, *inference.CudaSharedMemoryRegisterRequest) (*inference.CudaSharedMemoryRegisterResponse, error) {
	return nil, s.grpcError("CudaSharedMemoryRegister", errCUDASharedMemory())
}

// CudaSharedMemoryUnregister succeeds with nothing to do: no CUDA region
// is ever registered.
func (s *grpcService) CudaSharedMemoryUnregister(context.Context, *inference.CudaSharedMemoryUnregisterRequest) (*inference.CudaSharedMemoryUnregisterResponse, error) {
	return &inference.CudaSharedMemoryUnregisterResponse{}, nil
}

// grpcUsesSharedMemory reports whether any tensor of req asks for shared
// memory, so that the call's credential is read only then.
func grpcUsesSharedMemory(req *inference.ModelInferRequest) bool {
	for _, in := range req.GetInputs() {
		if grpcSharedMemory(in.GetParameters()) {
			return true
		}
	}
	for _, out := range req.GetOutputs() {
		if grpcSharedMemory(out.GetParameters()) {
			return true
		}
	}
	return false
}
