package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"os"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gin-gonic/gin"
	"go.opentelemetry.io/otel/propagation"

	"github.com/sloserve/sloserve/models"
)

// restServer holds what the REST handlers share.
type restServer struct {
	b      Backend
	lim    Limits
	logger *slog.Logger
}

// NewREST returns the Open Inference Protocol v2 REST API over b: health,
// server and model metadata, inference (JSON and the binary tensor data
// extension), the model repository extension, the statistics extension and,
// when lim.SharedMemory is set, the system shared-memory extension, all
// under /v2. Request bodies over lim.MaxRequestBytes are refused with 413
// (no limit when it is 0 or less). Errors are JSON objects {"error": "..."}
// with the status statusOf gives. Inference reads the request parameters
// timeout (microseconds) and priority and the header Inference-Timeout-Ms
// (milliseconds), as request_options.go describes. As in Triton, GET
// /v2/models/stats is the statistics of all models, so a model named "stats"
// has no unversioned metadata path; its other paths work.
//
// The middleware (access control: Auth.REST) runs before every handler,
// the answers to unknown routes and methods included.
//
// NewREST sets gin's global mode to release.
func NewREST(b Backend, lim Limits, logger *slog.Logger, middleware ...gin.HandlerFunc) http.Handler {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	s := &restServer{b: b, lim: lim, logger: logger}

	gin.SetMode(gin.ReleaseMode)
	e := gin.New()
	e.HandleMethodNotAllowed = true
	e.RedirectTrailingSlash = false
	// No proxy is trusted: a client's address is the connection's peer,
	// never what X-Forwarded-For claims.
	_ = e.SetTrustedProxies(nil)
	e.Use(s.recoverPanic, s.overflowGuard, s.closeWhileNotReady, s.releaseMemory)
	e.Use(middleware...)
	e.NoRoute(s.noRoute)
	e.NoMethod(s.noMethod)

	e.GET("/v2", s.serverMetadata)
	e.GET("/v2/health/live", s.live)
	e.GET("/v2/health/ready", s.ready)
	e.GET("/v2/models/stats", s.statistics)
	for _, p := range []string{"/v2/models/:model", "/v2/models/:model/versions/:version"} {
		e.GET(p, s.modelMetadata)
		e.GET(p+"/ready", s.modelReady)
		e.GET(p+"/config", s.modelConfig)
		e.POST(p+"/infer", s.infer)
		e.GET(p+"/stats", s.statistics)
	}
	e.POST("/v2/repository/index", s.repositoryIndex)
	e.POST("/v2/repository/models/:model/load", s.load)
	e.POST("/v2/repository/models/:model/unload", s.unload)
	e.POST("/v2/config/reload", s.reloadConfig)
	e.GET("/v2/control", s.control)
	e.GET("/v2/control/events", s.controlEvents)
	e.PUT("/v2/models/:model/share", s.pinShare)
	e.DELETE("/v2/models/:model/share", s.unpinShare)
	e.GET("/v2/dashboard", s.dashboardOverview)
	e.GET("/v2/dashboard/models/:model", s.dashboardHistory)
	s.routeSharedMemory(e)
	if lim.LogLevel != nil {
		e.GET("/v2/logging", s.logSettings)
		e.POST("/v2/logging", s.updateLogSettings)
	}
	if lim.Trace != nil {
		e.GET("/v2/trace/setting", s.traceSetting)
		e.POST("/v2/trace/setting", s.updateTraceSetting)
		e.GET("/v2/models/:model/trace/setting", s.modelTraceSetting)
		e.POST("/v2/models/:model/trace/setting", s.modelTraceSetting)
	}
	e.GET("/dashboard", s.dashboardPage)
	e.GET("/dashboard/*file", dashboardFiles())
	return e
}

// recoverPanic turns a panic in a handler into a logged 500.
func (s *restServer) recoverPanic(c *gin.Context) {
	defer func() {
		p := recover()
		if p == nil {
			return
		}
		if p == http.ErrAbortHandler {
			panic(p)
		}
		s.logger.Error("panic in REST handler", "method", c.Request.Method, "path", c.Request.URL.Path,
			"panic", p, "stack", string(debug.Stack()))
		if !c.Writer.Written() {
			s.writeErrorStatus(c, http.StatusInternalServerError, "internal server error")
		}
		c.Abort()
	}()
	c.Next()
}

// overflowGuard serves only health probes on a connection accepted over the
// listener's connection limit (see LimitedListener); every answer on such a
// connection closes it.
func (s *restServer) overflowGuard(c *gin.Context) {
	l := overflowListener(c.Request.Context())
	if l == nil {
		c.Next()
		return
	}
	c.Header("Connection", "close")
	if c.Request.Method == http.MethodGet {
		switch c.Request.URL.Path {
		case "/v2/health/live", "/v2/health/ready":
			c.Next()
			return
		}
	}
	c.Header("Retry-After", "1")
	s.writeError(c, fmt.Errorf("%w: the server has its %d connections open; retry later", errTooManyConnections, l.Serving()))
	c.Abort()
}

// closeWhileNotReady closes a connection after its response while the
// server is not ready: starting, or draining after SIGTERM. During the
// shutdown delay every client with a request in flight then moves to a new
// connection, which the server still accepts and the listener's close
// later refuses, so that no keep-alive connection is left for the drain to
// close while a request the server never read is on its way (an HTTP
// client sees that as the connection closing under a sent request, EOF,
// and retries it only if it knows the request to be idempotent).
func (s *restServer) closeWhileNotReady(c *gin.Context) {
	if !s.b.Ready() {
		c.Header("Connection", "close")
	}
	c.Next()
}

func (s *restServer) noRoute(c *gin.Context) {
	s.writeErrorStatus(c, http.StatusNotFound, fmt.Sprintf("no route for %s %s", c.Request.Method, c.Request.URL.Path))
}

func (s *restServer) noMethod(c *gin.Context) {
	s.writeErrorStatus(c, http.StatusMethodNotAllowed,
		fmt.Sprintf("method %s not allowed for %s", c.Request.Method, c.Request.URL.Path))
}

// writeError answers with the status for err and an {"error"} body. Server
// faults are logged as errors; refusals, overload (503) and missed deadlines
// (504), which come in floods when the server is saturated, only at debug,
// and the record is not even built unless debug is on: no lock is held
// here, and at 10x overload a refusal then costs no allocation for a log
// line nobody reads.
func (s *restServer) writeError(c *gin.Context, err error) {
	status, _ := statusOf(err)
	if status >= 500 && status != http.StatusServiceUnavailable && status != http.StatusGatewayTimeout {
		s.logger.Error("REST request failed", "method", c.Request.Method, "path", c.Request.URL.Path,
			"status", status, "err", err)
	} else if s.logger.Enabled(c.Request.Context(), slog.LevelDebug) {
		s.logger.Debug("REST request refused", "method", c.Request.Method, "path", c.Request.URL.Path,
			"status", status, "err", err)
	}
	if errors.Is(err, errMemory) {
		c.Header("Retry-After", "1") // memory is given back as requests end
	}
	s.writeErrorStatus(c, status, err.Error())
}

// writeErrorStatus answers with status and {"error": msg}.
func (s *restServer) writeErrorStatus(c *gin.Context, status int, msg string) {
	bp := getRESTBuffer()
	defer putRESTBuffer(bp)
	b := append((*bp)[:0], `{"error":`...)
	b = appendJSONString(b, clipMessage(msg))
	b = append(b, '}')
	*bp = b
	writeRESTBody(c, status, "application/json", b)
}

// writeRESTBody answers with status and one body; an error is the
// write's (the client has gone, or did not read in time).
func writeRESTBody(c *gin.Context, status int, contentType string, body []byte) error {
	h := c.Writer.Header()
	h.Set("Content-Type", contentType)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	c.Writer.WriteHeader(status)
	_, err := c.Writer.Write(body)
	return err
}

// writeValue answers with status and v as JSON, for the endpoints off the
// inference path.
func (s *restServer) writeValue(c *gin.Context, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		s.writeError(c, fmt.Errorf("encoding response: %w", err))
		return
	}
	writeRESTBody(c, status, "application/json", body)
}

// readBody reads the request body within the configured size limit. The
// body's memory is reserved from the memory budget before it is read: the
// declared Content-Length at once, a body of unknown length as it grows.
// A body that does not fit is refused unread (errMemory, and the connection
// closes). The reservation lasts until the handler returns (requestMemory).
// A body in gzip or deflate (Content-Encoding) is decompressed as it is
// read, and its limits and reservation are those of what it decompresses
// to (compress.go).
func (s *restServer) readBody(c *gin.Context) ([]byte, error) {
	return s.readBodyInto(c, nil)
}

// readBodyInto is readBody into buf's memory when the body's declared
// length fits in it.
func (s *restServer) readBodyInto(c *gin.Context, buf []byte) ([]byte, error) {
	r := c.Request
	decode, err := restContentDecoder(r.Header.Get("Content-Encoding"))
	if err != nil {
		return nil, err
	}
	if r.Body == nil {
		return nil, nil
	}
	limit := s.lim.MaxRequestBytes
	if limit > 0 && r.ContentLength > limit {
		return nil, fmt.Errorf("%w: the body has %d bytes, the limit is %d", errTooLarge, r.ContentLength, limit)
	}
	res := requestMemory(c, s.lim.Memory)
	declared := r.ContentLength
	if decode != nil {
		// The wire bytes stream through the decompressor; the decompressed
		// body's length is not known until it ends.
		declared = -1
		if err := res.Grow(restDecoderMemory, "decompressing the request body"); err != nil {
			c.Header("Connection", "close")
			return nil, err
		}
	} else if r.ContentLength > 0 {
		if err := res.Grow(r.ContentLength, "the request body"); err != nil {
			c.Header("Connection", "close") // the body stays unread
			return nil, err
		}
	}
	var body io.Reader = r.Body
	if limit > 0 {
		body = http.MaxBytesReader(c.Writer, r.Body, limit)
	}
	if decode != nil {
		body = newDecodingReader(body, decode, strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Encoding"))), limit)
	}
	// The body's own deadline, cleared once it is in: the connection's
	// read deadline also bounds the server's watch for a client that goes
	// away, which must last as long as the request runs. A body that failed
	// keeps it, so that the server does not wait for the rest of the body
	// before it closes the connection.
	var rc *http.ResponseController
	if s.lim.BodyTimeout > 0 {
		rc = http.NewResponseController(c.Writer)
		if rc.SetReadDeadline(time.Now().Add(s.lim.BodyTimeout)) != nil {
			rc = nil // not a connection with deadlines (a test recorder)
		}
	}
	buf, err = restReadAll(body, declared, res, buf)
	if rc != nil && err == nil {
		_ = rc.SetReadDeadline(time.Time{})
	}
	var tooLarge *http.MaxBytesError
	var undecodable *decodeError
	switch {
	case errors.Is(err, errDecodedTooLarge):
		c.Header("Connection", "close") // the rest of the body stays unread
		return nil, fmt.Errorf("%w: the body decompresses to more than the %d bytes allowed (limits.max_request_bytes)", errTooLarge, limit)
	case errors.As(err, &undecodable):
		return nil, restBadRequest("the body does not decompress as Content-Encoding %s says: %v", undecodable.encoding, undecodable.err)
	case errors.As(err, &tooLarge):
		return nil, fmt.Errorf("%w: the body has more than the %d bytes allowed", errTooLarge, tooLarge.Limit)
	case errors.Is(err, errMemory):
		c.Header("Connection", "close") // the rest of the body stays unread
		return nil, err
	case errors.Is(err, io.ErrUnexpectedEOF):
		return nil, restBadRequest("the body is shorter than its Content-Length")
	case errors.Is(err, os.ErrDeadlineExceeded):
		c.Header("Connection", "close")
		s.lim.SlowClients.add(slowREST, slowBody)
		s.logger.Warn("REST body cut off: it did not arrive within limits.body_timeout; answered 408, its connection closed",
			"peer", c.Request.RemoteAddr, "path", c.Request.URL.Path, "bytes", len(buf), "body_timeout", s.lim.BodyTimeout)
		return nil, fmt.Errorf("%w: the body did not arrive within %v (limits.body_timeout); %d bytes came", errBodyTimeout, s.lim.BodyTimeout, len(buf))
	case err != nil:
		// The client went away or broke the framing: nobody to answer, and
		// not the server's fault.
		return nil, restBadRequest("reading the body: %v", err)
	}
	return buf, nil
}

// writeDeadline bounds the time the response may take to be written
// (limits.write_timeout): a client that does not read it loses its
// connection, and the response's memory is given back.
func (s *restServer) writeDeadline(c *gin.Context) {
	if s.lim.WriteTimeout > 0 {
		_ = http.NewResponseController(c.Writer).SetWriteDeadline(time.Now().Add(s.lim.WriteTimeout))
	}
}

// readJSONBody is readBody for a body decoded whole as JSON
// (decodeRESTBody), which holds restJSONCopies more copies of it while it
// decodes: those are reserved too.
func (s *restServer) readJSONBody(c *gin.Context) ([]byte, error) {
	body, err := s.readBody(c)
	if err != nil {
		return nil, err
	}
	if err := requestMemory(c, s.lim.Memory).Grow(restJSONCopies*int64(len(body)), "decoding the request's JSON"); err != nil {
		return nil, err
	}
	return body, nil
}

// requestMemoryKey keys a REST request's memory reservation in its gin
// context.
const requestMemoryKey = "sloserve.memory"

// requestMemory is the reservation of the REST request c in budget, made
// empty on first use; releaseMemory gives it back when the handler returns.
func requestMemory(c *gin.Context, budget *MemoryBudget) *Reservation {
	if v, ok := c.Get(requestMemoryKey); ok {
		return v.(*Reservation)
	}
	res, _ := budget.Reserve(0, "")
	c.Set(requestMemoryKey, res)
	return res
}

// releaseMemory gives back the memory the request reserved (its body, its
// decoded form, its response) once its handler has returned: the response
// has then been written, or the connection has failed.
func (s *restServer) releaseMemory(c *gin.Context) {
	defer func() {
		if v, ok := c.Get(requestMemoryKey); ok {
			v.(*Reservation).Release()
		}
	}()
	c.Next()
}

// restReadAll reads r to its end. A body of declared length (reserved in
// res already) is read into one buffer of that size, into into's memory
// when it has room; one of unknown length (declared -1) into a buffer that
// doubles as the data arrives, each growth reserved in res first.
func restReadAll(r io.Reader, declared int64, res *Reservation, into []byte) ([]byte, error) {
	var buf []byte
	if declared >= 0 {
		if int64(cap(into)) > declared {
			buf = into[:0]
		} else {
			buf = make([]byte, 0, declared+1) // +1: to see the end without growing
		}
	} else {
		if err := res.Grow(512, "the request body"); err != nil {
			return nil, err
		}
		buf = make([]byte, 0, 512)
	}
	for {
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if err == io.EOF {
			if declared >= 0 && int64(len(buf)) < declared {
				return nil, io.ErrUnexpectedEOF
			}
			return buf, nil
		}
		if err != nil {
			return buf, err // buf for the error message
		}
		if len(buf) == cap(buf) {
			if declared >= 0 {
				return nil, errors.New("the body is longer than its Content-Length")
			}
			grow := int64(cap(buf)) // doubling: few copies
			if err := res.Grow(int64(cap(buf))+grow, "the request body"); err != nil {
				return nil, err
			}
			next := make([]byte, len(buf), int64(cap(buf))+grow)
			copy(next, buf)
			res.ShrinkTo(res.Size() - int64(cap(buf))) // the old buffer is garbage now
			buf = next
		}
	}
}

func (s *restServer) live(c *gin.Context) {
	c.Status(restHealthStatus(s.b.Live()))
}

func (s *restServer) ready(c *gin.Context) {
	c.Status(restHealthStatus(s.b.Ready()))
}

// restHealthStatus answers a health probe: 200 when ok, 503 when not (with an
// empty body, as Triton does).
func restHealthStatus(ok bool) int {
	if ok {
		return http.StatusOK
	}
	return http.StatusServiceUnavailable
}

// serverMetadataJSON is the body of GET /v2.
type serverMetadataJSON struct {
	Name       string   `json:"name"`
	Version    string   `json:"version"`
	Extensions []string `json:"extensions"`
	// Limiters (sloserve's own field) names how shares are enforced on
	// each device: device -> cgroup-v2, cgroup-v1, mps or none.
	Limiters map[string]string `json:"sloserve_limiters,omitempty"`
}

func (s *restServer) serverMetadata(c *gin.Context) {
	s.writeValue(c, http.StatusOK, serverMetadataJSON{
		Name:       ServerName,
		Version:    s.b.ServerVersion(),
		Extensions: extensionsOf(s.lim.SharedMemory),
		Limiters:   s.b.Limiters(),
	})
}

// tensorMetadataJSON describes one model input or output.
type tensorMetadataJSON struct {
	Name     string  `json:"name"`
	DataType string  `json:"datatype"`
	Shape    []int64 `json:"shape"`
}

// modelMetadataJSON is the body of GET /v2/models/{m}[/versions/{v}].
type modelMetadataJSON struct {
	Name     string               `json:"name"`
	Versions []string             `json:"versions"`
	Platform string               `json:"platform"`
	Inputs   []tensorMetadataJSON `json:"inputs"`
	Outputs  []tensorMetadataJSON `json:"outputs"`
}

func (s *restServer) modelMetadata(c *gin.Context) {
	md, err := s.b.Metadata(c.Param("model"), c.Param("version"))
	if err != nil {
		s.writeError(c, err)
		return
	}
	body := modelMetadataJSON{
		Name:     md.Name,
		Versions: md.Versions,
		Platform: md.Platform,
		Inputs:   make([]tensorMetadataJSON, len(md.Inputs)),
		Outputs:  make([]tensorMetadataJSON, len(md.Outputs)),
	}
	if body.Versions == nil {
		body.Versions = []string{}
	}
	for i, t := range md.Inputs {
		body.Inputs[i] = tensorMetadataJSON{Name: t.Name, DataType: string(t.DataType), Shape: shapeOrEmpty(t.Shape)}
	}
	for i, t := range md.Outputs {
		body.Outputs[i] = tensorMetadataJSON{Name: t.Name, DataType: string(t.DataType), Shape: shapeOrEmpty(t.Shape)}
	}
	s.writeValue(c, http.StatusOK, body)
}

// shapeOrEmpty makes a nil shape (a scalar) encode as [] rather than null.
func shapeOrEmpty(shape []int64) []int64 {
	if shape == nil {
		return []int64{}
	}
	return shape
}

// modelReady answers 200 when the model (version) is ready and, as Triton
// does, 400 when it is not, unknown models and versions included; the body
// of a 400 says which.
func (s *restServer) modelReady(c *gin.Context) {
	name, version := c.Param("model"), c.Param("version")
	ok, err := modelReady(s.b, name, version)
	switch {
	case err != nil:
		s.writeError(c, err)
	case !ok:
		msg := fmt.Sprintf("model %q is not ready", name)
		if version != "" {
			msg = fmt.Sprintf("model %q version %q is not ready", name, version)
		}
		s.writeErrorStatus(c, http.StatusBadRequest, msg)
	default:
		c.Status(http.StatusOK)
	}
}

// infer serves POST /v2/models/{m}[/versions/{v}]/infer. The request's
// deadline counts from when the handler starts: the parameter timeout or the
// header Inference-Timeout-Ms, whichever is shorter.
//
// A request the model would refuse anyway (its queue full, or its predicted
// completion past the deadline the headers and the SLO give) is refused
// before its body is read: under overload, reading and decoding the bodies
// of refused requests would take the CPU the admitted ones need. The server
// then closes the connection rather than read the rest of a large body.
func (s *restServer) infer(c *gin.Context) {
	arrival := time.Now()
	headerLen := int64(-1)
	if h := c.Request.Header.Get(headerInferenceLength); h != "" {
		var err error
		headerLen, err = strconv.ParseInt(h, 10, 64)
		if err != nil || headerLen < 0 {
			s.writeError(c, restBadRequest("%s must be a non-negative integer, not %q", headerInferenceLength, clipValue(h)))
			return
		}
	}
	var headerTimeout time.Duration
	if h := c.Request.Header.Get(headerTimeoutMillis); h != "" {
		var problem string
		if headerTimeout, problem = parseTimeoutMillis(h); problem != "" {
			s.writeError(c, restBadRequest("%s %s, not %q", headerTimeoutMillis, problem, clipValue(h)))
			return
		}
	}
	name, version := c.Param("model"), c.Param("version")
	if err := s.b.Preadmit(c.Request.Context(), name, version, requestDeadline(arrival, 0, headerTimeout)); err != nil {
		if c.Request.ContentLength != 0 {
			c.Header("Connection", "close") // the body stays unread
		}
		s.writeError(c, err)
		return
	}
	bodyBuf := getRESTBody()
	body, err := s.readBodyInto(c, *bodyBuf)
	if err != nil {
		s.writeError(c, err)
		return
	}
	// The regions the request names stay mapped until its response is
	// written.
	var shm *shmUse
	if s.lim.SharedMemory != nil {
		shm = &shmUse{s: s.lim.SharedMemory, authHeader: c.Request.Header.Get("Authorization"), httpReq: c.Request}
		defer shm.release()
	}
	mem := requestMemory(c, s.lim.Memory)
	req, err := decodeRESTInferMem(body, headerLen, s.lim, shm, mem)
	if headerLen < 0 {
		// Nothing decoded from a JSON body aliases it (binary inputs
		// would): its buffer serves the next request.
		*bodyBuf = body
		putRESTBody(bodyBuf)
	}
	if err != nil {
		s.writeError(c, err)
		return
	}
	rr := req.runtimeRequest()
	rr.Deadline = requestDeadline(arrival, req.timeout, headerTimeout)
	rr.Arrival = arrival
	ctx, tr := startInferTrace(c.Request.Context(), s.lim.Tracer, propagation.HeaderCarrier(c.Request.Header), arrival, "rest", name, version)
	goTraceLog(ctx, "infer", name, req.id)
	resp, version, err := s.b.Infer(ctx, name, version, rr)
	defer func() { tr.end(err) }()
	if err != nil {
		s.writeError(c, err)
		return
	}
	goTraceLog(ctx, "answer", name, req.id)
	tr.answering(ctx, version)

	// The outputs (in memory already) and their JSON are reserved before the
	// JSON is written, at its largest, then shrunk to what it took.
	held := mem.Size()
	if err = mem.Grow(outputBytes(resp.Outputs)+restResponseBound(req, resp.Outputs), "the response"); err != nil {
		s.writeError(c, fmt.Errorf("model %q: %w", name, err))
		return
	}
	bp := getRESTBuffer()
	defer putRESTBuffer(bp)
	out, parts, err := appendRESTResponse((*bp)[:0], name, version, req, resp.Outputs)
	*bp = out
	if err != nil {
		s.writeError(c, fmt.Errorf("model %q: %w", name, err))
		return
	}
	mem.ShrinkTo(held + int64(cap(out)) + outputBytes(resp.Outputs))
	s.writeDeadline(c)
	if parts == nil {
		if err := writeRESTBody(c, http.StatusOK, "application/json", out); err != nil {
			s.writeFailed(c, err)
		}
		return
	}
	total := len(out)
	for _, p := range parts {
		total += len(p)
	}
	h := c.Writer.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set(headerInferenceLength, strconv.Itoa(len(out)))
	h.Set("Content-Length", strconv.Itoa(total))
	c.Writer.WriteHeader(http.StatusOK)
	if _, err := c.Writer.Write(out); err != nil {
		s.writeFailed(c, err)
		return
	}
	for _, p := range parts {
		if _, err := c.Writer.Write(p); err != nil {
			s.writeFailed(c, err)
			return
		}
	}
}

// writeFailed notes a response write that failed with err: one cut off at
// limits.write_timeout is counted and logged at WARN (its connection is
// closed); one whose client went away is nobody's business.
func (s *restServer) writeFailed(c *gin.Context, err error) {
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		return
	}
	s.lim.SlowClients.add(slowREST, slowWrite)
	s.logger.Warn("REST response cut off: the client did not take it within limits.write_timeout; its connection is closed",
		"peer", c.Request.RemoteAddr, "path", c.Request.URL.Path, "write_timeout", s.lim.WriteTimeout)
}

// durationJSON is a count and total time in the statistics extension.
type durationJSON struct {
	Count uint64 `json:"count"`
	NS    uint64 `json:"ns"`
}

func newDurationJSON(d models.Duration) durationJSON {
	return durationJSON{Count: d.Count, NS: uint64(max(d.Total.Nanoseconds(), 0))}
}

// inferStatsJSON is the inference_stats object of one model version.
type inferStatsJSON struct {
	Success       durationJSON `json:"success"`
	Fail          durationJSON `json:"fail"`
	Queue         durationJSON `json:"queue"`
	ComputeInput  durationJSON `json:"compute_input"`
	ComputeInfer  durationJSON `json:"compute_infer"`
	ComputeOutput durationJSON `json:"compute_output"`
}

// batchStatsJSON is the executions of one batch size.
type batchStatsJSON struct {
	BatchSize     uint64       `json:"batch_size"`
	ComputeInput  durationJSON `json:"compute_input"`
	ComputeInfer  durationJSON `json:"compute_infer"`
	ComputeOutput durationJSON `json:"compute_output"`
}

// modelStatsJSON is one model version's statistics.
type modelStatsJSON struct {
	Name           string           `json:"name"`
	Version        string           `json:"version"`
	LastInference  int64            `json:"last_inference"` // ms since the epoch, 0 if never
	InferenceCount uint64           `json:"inference_count"`
	ExecutionCount uint64           `json:"execution_count"`
	InferenceStats inferStatsJSON   `json:"inference_stats"`
	BatchStats     []batchStatsJSON `json:"batch_stats"`
	// SLO is sloserve's extension: the version's SLO accounting.
	SLO *sloStatsJSON `json:"slo,omitempty"`
}

// sloStatsJSON is the SLO accounting of one model version.
type sloStatsJSON struct {
	Class            string  `json:"class"`
	LatencyTargetMS  float64 `json:"latency_target_ms"`
	Arrived          uint64  `json:"arrived"`
	Good             uint64  `json:"good"`
	Late             uint64  `json:"late"`
	Rejected         uint64  `json:"rejected"`
	Dropped          uint64  `json:"dropped"`
	Failed           uint64  `json:"failed"`
	Canceled         uint64  `json:"canceled"`
	QueueDepth       int     `json:"queue_depth"`
	Goodput          float64 `json:"goodput"`
	Attainment       float64 `json:"attainment"`
	MeanQueueDelayNS int64   `json:"mean_queue_delay_ns"`
}

// statisticsJSON is the body of the statistics endpoints.
type statisticsJSON struct {
	ModelStats []modelStatsJSON `json:"model_stats"`
}

// statistics serves GET /v2/models[/{m}[/versions/{v}]]/stats.
func (s *restServer) statistics(c *gin.Context) {
	stats, err := s.b.Statistics(c.Param("model"), c.Param("version"))
	if err != nil {
		s.writeError(c, err)
		return
	}
	body := statisticsJSON{ModelStats: make([]modelStatsJSON, len(stats))}
	for i, st := range stats {
		var last int64
		if !st.LastInference.IsZero() {
			last = st.LastInference.UnixMilli()
		}
		body.ModelStats[i] = modelStatsJSON{
			Name:           st.Name,
			Version:        st.Version,
			LastInference:  last,
			InferenceCount: st.InferenceCount,
			ExecutionCount: st.ExecutionCount,
			InferenceStats: inferStatsJSON{
				Success:       newDurationJSON(st.Success),
				Fail:          newDurationJSON(st.Fail),
				Queue:         newDurationJSON(st.Queue),
				ComputeInput:  newDurationJSON(st.ComputeInput),
				ComputeInfer:  newDurationJSON(st.ComputeInfer),
				ComputeOutput: newDurationJSON(st.ComputeOutput),
			},
			BatchStats: make([]batchStatsJSON, len(st.Batches)),
		}
		for j, b := range st.Batches {
			body.ModelStats[i].BatchStats[j] = batchStatsJSON{
				BatchSize:     uint64(max(b.BatchSize, 0)),
				ComputeInput:  newDurationJSON(b.ComputeInput),
				ComputeInfer:  newDurationJSON(b.ComputeInfer),
				ComputeOutput: newDurationJSON(b.ComputeOutput),
			}
		}
		if q := st.SLO; q != nil {
			body.ModelStats[i].SLO = &sloStatsJSON{
				Class: q.Class, LatencyTargetMS: float64(q.LatencyTarget) / float64(time.Millisecond),
				Arrived: q.Arrived, Good: q.Good, Late: q.Late, Rejected: q.Rejected,
				Dropped: q.Dropped, Failed: q.Failed, Canceled: q.Canceled,
				QueueDepth: q.QueueDepth, Goodput: q.Goodput, Attainment: q.Attainment,
				MeanQueueDelayNS: q.MeanQueueDelay.Nanoseconds(),
			}
		}
	}
	s.writeValue(c, http.StatusOK, body)
}

// indexEntryJSON is one row of the repository index.
type indexEntryJSON struct {
	Name    string `json:"name"`
	Version string `json:"version,omitempty"`
	State   string `json:"state"`
	Reason  string `json:"reason,omitempty"`
}

// decodeRESTBody decodes a JSON object body into v; an empty body
// leaves v as it is.
func decodeRESTBody(body []byte, v any) error { return decodeJSONBody(body, v, false) }

// decodeJSONBody is decodeRESTBody; strict refuses fields v does not have.
func decodeJSONBody(body []byte, v any, strict bool) error {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if strict {
		dec.DisallowUnknownFields()
	}
	if err := dec.Decode(v); err != nil {
		return restJSONError(err)
	}
	if len(bytes.TrimSpace(body[dec.InputOffset():])) != 0 {
		return restBadRequest("malformed JSON: data after the request object")
	}
	if key, dup := duplicateJSONKey(body); dup {
		return restBadRequest("malformed JSON: key %q appears twice in one object", clipValue(key))
	}
	return nil
}

// repositoryIndex serves POST /v2/repository/index.
func (s *restServer) repositoryIndex(c *gin.Context) {
	body, err := s.readJSONBody(c)
	if err != nil {
		s.writeError(c, err)
		return
	}
	var req struct {
		Ready bool `json:"ready"`
	}
	if err := decodeRESTBody(body, &req); err != nil {
		s.writeError(c, err)
		return
	}
	entries, err := s.b.RepositoryIndex(c.Request.Context(), req.Ready)
	if err != nil {
		s.writeError(c, err)
		return
	}
	out := make([]indexEntryJSON, len(entries))
	for i, e := range entries {
		out[i] = indexEntryJSON{Name: e.Name, Version: e.Version, State: string(e.State), Reason: e.Reason}
	}
	s.writeValue(c, http.StatusOK, out)
}

// load serves POST /v2/repository/models/{m}/load. The parameter "config",
// a string holding a Triton ModelConfig in JSON (as tritonclient's
// load_model(config=...) sends it: http/_client.py load_model), is a config
// override; file overrides ("file:<path>") and other parameters are
// refused: nothing a request sends is written to disk.
func (s *restServer) load(c *gin.Context) {
	body, err := s.readJSONBody(c)
	if err != nil {
		s.writeError(c, err)
		return
	}
	var req struct {
		Parameters map[string]json.RawMessage `json:"parameters"`
	}
	if err := decodeRESTBody(body, &req); err != nil {
		s.writeError(c, err)
		return
	}
	var config []byte
	if raw, ok := req.Parameters[loadParamConfig]; ok {
		var text string
		if err := json.Unmarshal(raw, &text); err != nil {
			s.writeError(c, restBadRequest("parameters.config must be a string holding the model config in JSON, not %s", clipValue(raw)))
			return
		}
		config = []byte(text)
		delete(req.Parameters, loadParamConfig)
	}
	if err := checkLoadParams(slices.Collect(maps.Keys(req.Parameters))); err != nil {
		s.writeError(c, err)
		return
	}
	if err := s.b.LoadModel(c.Request.Context(), c.Param("model"), config); err != nil {
		s.writeError(c, err)
		return
	}
	writeRESTBody(c, http.StatusOK, "application/json", []byte("{}"))
}

// unload serves POST /v2/repository/models/{m}/unload. Its parameters
// (unload_dependents) do not apply to sloserve and are ignored.
func (s *restServer) unload(c *gin.Context) {
	body, err := s.readJSONBody(c)
	if err != nil {
		s.writeError(c, err)
		return
	}
	var req struct{}
	if err := decodeRESTBody(body, &req); err != nil {
		s.writeError(c, err)
		return
	}
	if err := s.b.UnloadModel(c.Request.Context(), c.Param("model")); err != nil {
		s.writeError(c, err)
		return
	}
	writeRESTBody(c, http.StatusOK, "application/json", []byte("{}"))
}

// reloadConfig serves POST /v2/config/reload: the server rereads its config
// and answers {"reloaded": true, "applied": [keys], "restart_needed":
// [keys]}, or 400 with the error when the config is invalid (nothing
// changed then).
func (s *restServer) reloadConfig(c *gin.Context) {
	res, err := s.b.ReloadConfig(c.Request.Context())
	if err != nil {
		s.writeError(c, err)
		return
	}
	s.writeValue(c, http.StatusOK, struct {
		Reloaded      bool     `json:"reloaded"`
		Applied       []string `json:"applied"`
		RestartNeeded []string `json:"restart_needed"`
	}{true, nonNil(res.Applied), nonNil(res.RestartNeeded)})
}

// nonNil makes a nil list encode as [].
func nonNil(xs []string) []string {
	if xs == nil {
		return []string{}
	}
	return xs
}
