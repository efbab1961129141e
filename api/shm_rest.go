package api

// The shared-memory extensions over REST: the system shared-memory
// endpoints, the CUDA ones (no regions; register answers 400), and the tensor parameters of
// inference requests.

import (
	"bytes"
	"encoding/json"
	"net"
	"net/http"
	"strconv"

	"github.com/gin-gonic/gin"

	"github.com/sloserve/sloserve/runtime"
)

// routeSharedMemory adds the shared-memory endpoints.
func (s *restServer) routeSharedMemory(e *gin.Engine) {
	e.GET("/v2/systemsharedmemory/status", s.shmStatus)
	e.GET("/v2/systemsharedmemory/region/:region/status", s.shmStatus)
	e.POST("/v2/systemsharedmemory/region/:region/register", s.shmRegister)
	e.POST("/v2/systemsharedmemory/unregister", s.shmUnregister)
	e.POST("/v2/systemsharedmemory/region/:region/unregister", s.shmUnregister)
	e.GET("/v2/cudasharedmemory/status", s.cudaStatus)
	e.GET("/v2/cudasharedmemory/region/:region/status", s.cudaStatus)
	e.POST("/v2/cudasharedmemory/region/:region/register", s.cudaRegister)
	e.POST("/v2/cudasharedmemory/unregister", s.cudaUnregister)
	e.POST("/v2/cudasharedmemory/region/:region/unregister", s.cudaUnregister)
}

// shmStatus serves GET /v2/systemsharedmemory[/region/{r}]/status: a JSON
// array of {name, key, offset, byte_size}.
func (s *restServer) shmStatus(c *gin.Context) {
	st, err := s.lim.SharedMemory.Status(c.Request.Header.Get("Authorization"), c.Param("region"))
	if err != nil {
		s.writeError(c, err)
		return
	}
	s.writeValue(c, http.StatusOK, st)
}

// shmRegister serves POST /v2/systemsharedmemory/region/{r}/register with
// {"key": string, "offset": number, "byte_size": number}; offset may be
// left out (0).
func (s *restServer) shmRegister(c *gin.Context) {
	body, err := s.readJSONBody(c)
	if err != nil {
		s.writeError(c, err)
		return
	}
	var req struct {
		Key      *string `json:"key"`
		Offset   uint64  `json:"offset"`
		ByteSize *uint64 `json:"byte_size"`
	}
	if err := decodeJSONBody(body, &req, true); err != nil {
		s.writeError(c, err)
		return
	}
	switch {
	case req.Key == nil:
		s.writeError(c, restBadRequest("the register request needs a key"))
		return
	case req.ByteSize == nil:
		s.writeError(c, restBadRequest("the register request needs a byte_size"))
		return
	}
	local, _ := c.Request.Context().Value(http.LocalAddrContextKey).(net.Addr)
	err = s.lim.SharedMemory.Register(c.Request.Header.Get("Authorization"), shmCallerOf(c.Request.RemoteAddr, netAddrString(local)),
		c.Param("region"), *req.Key, req.Offset, *req.ByteSize)
	if err != nil {
		s.writeError(c, err)
		return
	}
	writeRESTBody(c, http.StatusOK, "application/json", []byte("{}"))
}

// shmUnregister serves POST /v2/systemsharedmemory[/region/{r}]/unregister.
func (s *restServer) shmUnregister(c *gin.Context) {
	if err := s.lim.SharedMemory.Unregister(c.Request.Header.Get("Authorization"), c.Param("region")); err != nil {
		s.writeError(c, err)
		return
	}
	writeRESTBody(c, http.StatusOK, "application/json", []byte("{}"))
}

// cudaStatus serves GET /v2/cudasharedmemory[/region/{r}]/status: an
// empty list, or NOT_FOUND for a named region (see errCUDASharedMemory).
func (s *restServer) cudaStatus(c *gin.Context) {
	if r := c.Param("region"); r != "" {
		s.writeError(c, errCUDARegionUnknown(r))
		return
	}
	writeRESTBody(c, http.StatusOK, "application/json", []byte("[]"))
}

// cudaRegister answers POST /v2/cudasharedmemory/region/{r}/register with
// 400: there is no GPU memory to share.
func (s *restServer) cudaRegister(c *gin.Context) {
	s.writeError(c, errCUDASharedMemory())
}

// cudaUnregister serves POST /v2/cudasharedmemory[/region/{r}]/unregister:
// nothing is registered, so there is nothing to do.
func (s *restServer) cudaUnregister(c *gin.Context) {
	writeRESTBody(c, http.StatusOK, "application/json", []byte("{}"))
}

// restShmParams reads a tensor's shared-memory parameters: the region (a
// string) and byte size are required, the offset defaults to 0.
func restShmParams(kind, name string, params map[string]json.RawMessage) (shmParams, error) {
	var p shmParams
	raw, ok := params[paramShmRegion]
	if !ok {
		return p, restBadRequest("%s %q: %s and %s need %s", kind, name, paramShmOffset, paramShmSize, paramShmRegion)
	}
	if err := json.Unmarshal(raw, &p.region); err != nil {
		return p, restBadRequest("%s %q: parameters.%s must be a string, not %s", kind, name, paramShmRegion, clipValue(raw))
	}
	u64 := func(key string, dst *uint64) error {
		raw := bytes.TrimSpace(params[key])
		neg, v, err := parseJSONInteger(raw)
		if err != nil || neg && v != 0 {
			return restBadRequest("%s %q: parameters.%s must be a non-negative integer, not %s", kind, name, key, clipValue(raw))
		}
		*dst = v
		return nil
	}
	if _, ok := params[paramShmSize]; !ok {
		return p, restBadRequest("%s %q: %s needs %s", kind, name, paramShmRegion, paramShmSize)
	}
	if err := u64(paramShmSize, &p.size); err != nil {
		return p, err
	}
	if _, ok := params[paramShmOffset]; ok {
		if err := u64(paramShmOffset, &p.offset); err != nil {
			return p, err
		}
	}
	return p, nil
}

// restShmInput reads an input's data from shared memory. The input must not
// also carry data or binary data.
func restShmInput(u *shmUse, ij *restInputJSON, dt runtime.DataType, n int64) (runtime.Tensor, error) {
	name := *ij.Name
	if ij.Data != nil && string(ij.Data) != "null" {
		return runtime.Tensor{}, restBadRequest("input %q has both data and %s", name, paramShmRegion)
	}
	if _, ok := ij.Parameters["binary_data_size"]; ok {
		return runtime.Tensor{}, restBadRequest("input %q has both binary_data_size and %s", name, paramShmRegion)
	}
	p, err := restShmParams("input", name, ij.Parameters)
	if err != nil {
		return runtime.Tensor{}, err
	}
	data, err := u.input(name, dt, ij.Shape, n, p)
	if err != nil {
		return runtime.Tensor{}, err
	}
	return runtime.Tensor{Name: name, DataType: dt, Shape: ij.Shape, Data: data, Mapped: true}, nil
}

// restShmOutput checks a requested output's shared-memory parameters. As
// in Triton, only "binary_data": true conflicts with a region: tritonclient
// sends false on every output it puts in shared memory
// (http/_requested_output.py set_shared_memory).
func restShmOutput(u *shmUse, name string, params map[string]json.RawMessage) (shmTarget, error) {
	if raw, ok := params["binary_data"]; ok {
		binary, ok := rawBool(raw)
		switch {
		case !ok:
			return shmTarget{}, restBadRequest("output %q: parameters.binary_data must be true or false, not %s", name, clipValue(raw))
		case binary:
			return shmTarget{}, restBadRequest("output %q has both binary_data true and %s", name, paramShmRegion)
		}
	}
	p, err := restShmParams("output", name, params)
	if err != nil {
		return shmTarget{}, err
	}
	return u.output(name, p)
}

// shmTarget is the shared-memory target of the output called name, or nil.
func (r *restRequest) shmTarget(name string) *shmTarget {
	for i := range r.shm {
		if r.shm[i].name == name {
			return &r.shm[i]
		}
	}
	return nil
}

// appendRESTShmParams closes an output written into shared memory: its
// parameters name the region, offset and the bytes written, and it has no
// data.
func appendRESTShmParams(buf []byte, t *shmTarget, written int) []byte {
	buf = append(buf, `,"parameters":{"shared_memory_region":`...)
	buf = appendJSONString(buf, t.params.region)
	buf = append(buf, `,"shared_memory_offset":`...)
	buf = strconv.AppendUint(buf, t.params.offset, 10)
	buf = append(buf, `,"shared_memory_byte_size":`...)
	buf = strconv.AppendInt(buf, int64(written), 10)
	return append(buf, "}}"...)
}
