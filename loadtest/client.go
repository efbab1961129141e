package loadtest

// The protocol clients: one model's inference requests over REST JSON, REST
// with the binary tensor data extension, or gRPC, each request classified
// into an Outcome as the server's statusOf maps its errors (429 and
// RESOURCE_EXHAUSTED: rejected; 504 and DEADLINE_EXCEEDED: dropped).
//
// The generator must not be the bottleneck, so all the work that does not
// depend on the request is done once in NewClient: the REST body is encoded
// whole and sent with its request line and headers, written once, over
// HTTP/1.1 connections of the client's own (client_wire.go), and the gRPC
// message is marshalled once and its bytes sent by every request as they
// are (clientCodec), spread round-robin over several connections, as ghz
// does: one HTTP/2 connection carries its calls' messages one frame at a
// time through one writer, so large messages on one connection queue
// behind each other. Responses are read to
// their end, so connections are reused, but only parsed as far as needed to
// check that they are inference responses of the right model: the JSON
// without the contents of its data arrays (see clientSkim), and for binary
// responses only the JSON header, with the binary part counted rather than
// kept.

import (
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/runtime"
)

// Protocols a Client can speak.
const (
	ProtoREST       = "rest"
	ProtoRESTBinary = "rest-binary"
	ProtoGRPC       = "grpc"
)

// clientHeaderInferenceLength is the binary tensor data extension's header:
// the length of the JSON part at the start of a body.
const clientHeaderInferenceLength = "Inference-Header-Content-Length"

// clientMaxTimeout is the longest timeout parameter the server accepts.
const clientMaxTimeout = time.Hour

// clientMaxMessage caps gRPC messages both ways, as the server caps its
// responses.
const clientMaxMessage = 1 << 30

// clientDetailLen is about how much of a server's error message a detail
// keeps.
const clientDetailLen = 80

// ClientOptions configures a Client.
type ClientOptions struct {
	// Protocol is ProtoREST, ProtoRESTBinary or ProtoGRPC.
	Protocol string
	// HTTPBase is the server's REST address, e.g. "http://127.0.0.1:8000".
	HTTPBase string
	// GRPCAddr is the server's gRPC address, host:port, used when GRPCConn
	// is nil.
	GRPCAddr string
	// Model and Version name what to infer; an empty Version lets the
	// server choose.
	Model, Version string
	// Inputs are the tensors every request sends (see BuildInputs).
	Inputs []Tensor
	// Timeout is the client's own deadline per request; 0: none. Requests
	// also carry it to the server as the "timeout" parameter
	// (microseconds), so the server schedules against it.
	Timeout time.Duration
	// ServerTimeout, when above 0, is sent as the "timeout" parameter
	// instead of Timeout; below 0, no timeout parameter is sent.
	ServerTimeout time.Duration
	// HTTPClient, when set, carries the REST requests through net/http
	// (a proxy, a transport of the caller's); nil: the client sends them
	// over HTTP/1.1 connections of its own, the same bytes net/http would
	// write (no proxy, no compression), for a fraction of the CPU: keep-
	// alive, up to 1024 idle connections, no overall timeout.
	HTTPClient *http.Client
	// TLS is the client side of TLS for an https:// HTTPBase when
	// HTTPClient is nil; nil: the system's roots.
	TLS *tls.Config
	// Header holds headers every REST request carries besides its own,
	// e.g. Authorization.
	Header http.Header
	// GRPCConn is a shared connection for gRPC; nil: the client dials
	// Connections connections to GRPCAddr with GRPCDialOptions and closes
	// them on Close.
	GRPCConn *grpc.ClientConn
	// Connections is how many gRPC connections the client dials when
	// GRPCConn is nil; its requests take them in turn. 0:
	// DefaultConnections.
	Connections int
	// GRPCDialOptions are the options of the connections the client dials;
	// nil: no TLS.
	GRPCDialOptions []grpc.DialOption
}

// DefaultConnections is how many gRPC connections a client dials unless
// told otherwise. One connection writes its calls' messages through one
// writer, a frame of each in turn, so a megabyte message at hundreds of
// calls a second waits behind all the others; a few connections let them
// go out side by side, without the memory and handshakes of one per call.
const DefaultConnections = 4

// clientMaxConnections bounds Connections: a generator needs a few, and
// each costs the server a slot of its limits.max_connections.
const clientMaxConnections = 256

// Client sends one model's inference requests with prepared inputs. It is
// safe for concurrent use.
type Client struct {
	model, version string
	timeout        time.Duration

	// REST.
	httpClient *http.Client  // nil: wire
	httpReq    *http.Request // a template: each send copies it with its context and a body
	body       []byte        // the encoded request body, a JSON object first (clientIDPrefix)
	headerLen  int           // rest-binary: the JSON part's length; 0: REST JSON
	wire       *restWire     // without HTTPClient: the client's own connections

	// gRPC.
	grpcConns  []*grpc.ClientConn // requests take them in turn
	ownConns   bool
	next       atomic.Uint32
	grpcClient inference.GRPCInferenceServiceClient // on grpcConns[0]: the ordinary path, for tests
	grpcReq    *inference.ModelInferRequest         // never mutated after NewClient
	grpcMsg    *clientEncoded                       // grpcReq marshalled
	callOpts   []grpc.CallOption

	closeOnce sync.Once
	closeErr  error
}

// NewClient checks opts and prepares the requests: the REST body is encoded
// here once, the gRPC message built once. A REST JSON client cannot send FP16
// or BF16 inputs (JSON numbers would convert them; use rest-binary), NaN or
// infinite values, or BYTES elements that are not UTF-8.
func NewClient(opts ClientOptions) (*Client, error) {
	if opts.Model == "" {
		return nil, errors.New("client: no model")
	}
	if opts.Timeout < 0 {
		return nil, fmt.Errorf("client: timeout %v is negative", opts.Timeout)
	}
	timeoutUS, err := clientTimeoutMicros(opts.Timeout, opts.ServerTimeout)
	if err != nil {
		return nil, err
	}
	for i := range opts.Inputs {
		if _, err := clientCheckTensor(&opts.Inputs[i]); err != nil {
			return nil, fmt.Errorf("client: model %q: %w", opts.Model, err)
		}
	}
	c := &Client{model: opts.Model, version: opts.Version, timeout: opts.Timeout}
	switch opts.Protocol {
	case ProtoREST, ProtoRESTBinary:
		err = c.initREST(opts, timeoutUS)
	case ProtoGRPC:
		err = c.initGRPC(opts, timeoutUS)
	default:
		err = fmt.Errorf("client: unknown protocol %q: want %s, %s or %s", opts.Protocol, ProtoREST, ProtoRESTBinary, ProtoGRPC)
	}
	if err != nil {
		return nil, err
	}
	return c, nil
}

// clientTimeoutMicros is the timeout parameter to send, in microseconds
// (rounded up), or 0 for none.
func clientTimeoutMicros(timeout, server time.Duration) (int64, error) {
	t := server
	if t == 0 {
		t = timeout
	}
	if t <= 0 {
		return 0, nil
	}
	if t > clientMaxTimeout {
		return 0, fmt.Errorf("client: server timeout %v is over the %v the server accepts", t, clientMaxTimeout)
	}
	return int64((t + time.Microsecond - 1) / time.Microsecond), nil
}

// clientCheckTensor checks that t's data matches its datatype and shape and
// returns its element count.
func clientCheckTensor(t *Tensor) (int64, error) {
	size, ok := inputElementSize(t.DataType)
	if !ok {
		return 0, fmt.Errorf("input %q: unsupported datatype %q", t.Name, t.DataType)
	}
	for k, d := range t.Shape {
		if d < 0 {
			return 0, fmt.Errorf("input %q: dimension %d of shape %v is negative", t.Name, k, t.Shape)
		}
	}
	n, err := inputElementCount(t.Shape)
	if err != nil {
		return 0, fmt.Errorf("input %q: %w", t.Name, err)
	}
	if size > 0 {
		if n > math.MaxInt64/int64(size) || int64(len(t.Raw)) != n*int64(size) {
			return 0, fmt.Errorf("input %q has %d bytes; shape %v of %s needs %d elements of %d bytes",
				t.Name, len(t.Raw), t.Shape, t.DataType, n, size)
		}
		return n, nil
	}
	var count int64
	for data := t.Raw; len(data) > 0; count++ {
		if len(data) < 4 || uint64(binary.LittleEndian.Uint32(data)) > uint64(len(data)-4) {
			return 0, fmt.Errorf("input %q: BYTES element %d is truncated", t.Name, count)
		}
		data = data[4+binary.LittleEndian.Uint32(data):]
	}
	if count != n {
		return 0, fmt.Errorf("input %q has %d BYTES elements; shape %v needs %d", t.Name, count, t.Shape, n)
	}
	return n, nil
}

// initREST encodes the body and the request template.
func (c *Client) initREST(opts ClientOptions, timeoutUS int64) error {
	base, err := url.Parse(strings.TrimRight(opts.HTTPBase, "/"))
	if err != nil || (base.Scheme != "http" && base.Scheme != "https") || base.Host == "" {
		return fmt.Errorf("client: HTTP base %q is not an http:// or https:// address", opts.HTTPBase)
	}
	path := "/v2/models/" + url.PathEscape(opts.Model)
	if opts.Version != "" {
		path += "/versions/" + url.PathEscape(opts.Version)
	}
	target := base.String() + path + "/infer"

	binaryBody := opts.Protocol == ProtoRESTBinary
	body, headerLen, err := clientEncodeREST(opts.Inputs, timeoutUS, binaryBody)
	if err != nil {
		return fmt.Errorf("client: model %q: %w", opts.Model, err)
	}
	req, err := http.NewRequest(http.MethodPost, target, nil)
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	req.ContentLength = int64(len(body))
	req.GetBody = func() (io.ReadCloser, error) { return clientNewBody(body), nil }
	if binaryBody {
		req.Header.Set("Content-Type", "application/octet-stream")
		req.Header.Set(clientHeaderInferenceLength, strconv.Itoa(headerLen))
	} else {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range opts.Header {
		req.Header[http.CanonicalHeaderKey(k)] = v
	}

	c.httpReq, c.body = req, body
	if binaryBody {
		c.headerLen = headerLen
	}
	c.httpClient = opts.HTTPClient
	if c.httpClient == nil {
		c.wire, err = newRESTWire(req, body, opts.TLS)
	}
	return err
}

// clientNewHTTP makes a net/http client for load, as the REST protocols
// used before they had connections of their own (and the tests' reference
// for the bytes those send): many kept-alive connections to one server, no
// overall timeout (each request has its own), no proxy between generator
// and server, and no gzip to decode.
func clientNewHTTP() *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.Proxy = nil
	tr.MaxIdleConns = 0
	tr.MaxIdleConnsPerHost = 1024
	tr.DisableCompression = true
	return &http.Client{Transport: tr}
}

// clientEncodeREST encodes the body of a REST inference request. With
// binaryBody the inputs' data follows the JSON part, whose length is
// headerLen, and the outputs are asked for in binary.
func clientEncodeREST(inputs []Tensor, timeoutUS int64, binaryBody bool) (body []byte, headerLen int, err error) {
	b := []byte{'{'}
	if binaryBody || timeoutUS > 0 {
		b = append(b, `"parameters":{`...)
		if binaryBody {
			b = append(b, `"binary_data_output":true`...)
		}
		if timeoutUS > 0 {
			if binaryBody {
				b = append(b, ',')
			}
			b = append(b, `"timeout":`...)
			b = strconv.AppendInt(b, timeoutUS, 10)
		}
		b = append(b, "},"...)
	}
	b = append(b, `"inputs":[`...)
	for i := range inputs {
		t := &inputs[i]
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"name":`...)
		b = clientAppendJSONString(b, t.Name)
		b = append(b, `,"datatype":`...)
		b = clientAppendJSONString(b, t.DataType)
		b = append(b, `,"shape":[`...)
		for k, d := range t.Shape {
			if k > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendInt(b, d, 10)
		}
		b = append(b, ']')
		if binaryBody {
			b = append(b, `,"parameters":{"binary_data_size":`...)
			b = strconv.AppendInt(b, int64(len(t.Raw)), 10)
			b = append(b, "}}"...)
			continue
		}
		b = append(b, `,"data":`...)
		if b, err = clientAppendJSONData(b, t); err != nil {
			return nil, 0, err
		}
		b = append(b, '}')
	}
	b = append(b, "]}"...)
	if !binaryBody {
		return b, len(b), nil
	}
	headerLen = len(b)
	total := headerLen
	for i := range inputs {
		total += len(inputs[i].Raw)
	}
	body = make([]byte, 0, total)
	body = append(body, b...)
	for i := range inputs {
		body = append(body, inputs[i].Raw...)
	}
	return body, headerLen, nil
}

// clientAppendJSONString appends s as a JSON string.
func clientAppendJSONString(b []byte, s string) []byte {
	q, _ := json.Marshal(s) // a string always encodes
	return append(b, q...)
}

// clientAppendJSONData appends a checked tensor's data as a flat JSON array,
// reading each element as runtime's datatype table describes it.
func clientAppendJSONData(b []byte, t *Tensor) ([]byte, error) {
	le := binary.LittleEndian
	info, _ := runtime.DataType(t.DataType).Info()
	if info.Kind == runtime.KindFloat && info.Size < 4 || info.Kind == 0 {
		return nil, fmt.Errorf("input %q: %s data cannot be sent as JSON; use %s", t.Name, t.DataType, ProtoRESTBinary)
	}
	raw := t.Raw
	b = append(b, '[')
	for i := 0; len(raw) > 0; i++ {
		if i > 0 {
			b = append(b, ',')
		}
		if info.Kind == runtime.KindString {
			l := le.Uint32(raw)
			s := raw[4 : 4+l]
			if !utf8.Valid(s) {
				return nil, fmt.Errorf("input %q: BYTES element %d is not UTF-8, which JSON cannot carry exactly; use %s", t.Name, i, ProtoRESTBinary)
			}
			b = clientAppendJSONString(b, string(s))
			raw = raw[4+l:]
			continue
		}
		var v uint64
		switch info.Size {
		case 1:
			v = uint64(raw[0])
		case 2:
			v = uint64(le.Uint16(raw))
		case 4:
			v = uint64(le.Uint32(raw))
		case 8:
			v = le.Uint64(raw)
		}
		raw = raw[info.Size:]
		switch info.Kind {
		case runtime.KindBool:
			b = strconv.AppendBool(b, v != 0)
		case runtime.KindUnsigned:
			b = strconv.AppendUint(b, v, 10)
		case runtime.KindSigned:
			shift := 64 - 8*info.Size
			b = strconv.AppendInt(b, int64(v<<shift)>>shift, 10) // sign-extended
		case runtime.KindFloat:
			f, bits := math.Float64frombits(v), 64
			if info.Size == 4 {
				f, bits = float64(math.Float32frombits(uint32(v))), 32
			}
			if math.IsNaN(f) || math.IsInf(f, 0) {
				return nil, fmt.Errorf("input %q: element %d is %v, which JSON cannot carry; use %s", t.Name, i, f, ProtoRESTBinary)
			}
			b = strconv.AppendFloat(b, f, 'g', -1, bits)
		}
	}
	return append(b, ']'), nil
}

// initGRPC builds and marshals the message and dials the connections.
func (c *Client) initGRPC(opts ClientOptions, timeoutUS int64) error {
	req := &inference.ModelInferRequest{
		ModelName:        opts.Model,
		ModelVersion:     opts.Version,
		Inputs:           make([]*inference.ModelInferRequest_InferInputTensor, len(opts.Inputs)),
		RawInputContents: make([][]byte, len(opts.Inputs)),
	}
	for i, t := range opts.Inputs {
		req.Inputs[i] = &inference.ModelInferRequest_InferInputTensor{Name: t.Name, Datatype: t.DataType, Shape: t.Shape}
		req.RawInputContents[i] = t.Raw
	}
	if timeoutUS > 0 {
		req.Parameters = map[string]*inference.InferParameter{
			"timeout": {ParameterChoice: &inference.InferParameter_Int64Param{Int64Param: timeoutUS}},
		}
	}
	b, err := proto.Marshal(req)
	if err != nil {
		return fmt.Errorf("client: model %q: %w", opts.Model, err)
	}
	if opts.GRPCConn != nil {
		c.grpcConns = []*grpc.ClientConn{opts.GRPCConn}
	} else {
		if opts.GRPCAddr == "" {
			return errors.New("client: no gRPC address")
		}
		n := opts.Connections
		if n == 0 {
			n = DefaultConnections
		}
		if n < 0 || n > clientMaxConnections {
			return fmt.Errorf("client: connections %d: want 1 to %d", n, clientMaxConnections)
		}
		dial := opts.GRPCDialOptions
		if dial == nil {
			dial = []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
		}
		for range n {
			conn, err := grpc.NewClient(opts.GRPCAddr, dial...)
			if err != nil {
				for _, open := range c.grpcConns {
					open.Close()
				}
				return fmt.Errorf("client: %w", err)
			}
			c.grpcConns = append(c.grpcConns, conn)
		}
		c.ownConns = true
	}
	c.grpcReq, c.grpcMsg = req, &clientEncoded{b: b}
	c.grpcClient = inference.NewGRPCInferenceServiceClient(c.grpcConns[0])
	c.callOpts = []grpc.CallOption{grpc.MaxCallRecvMsgSize(clientMaxMessage), grpc.MaxCallSendMsgSize(clientMaxMessage),
		grpc.ForceCodecV2(clientCodec{})}
	return nil
}

// clientEncoded is a request message marshalled once, which clientCodec
// sends as it is, after prefix (a field of its own, or nil).
type clientEncoded struct{ prefix, b []byte }

// withID is the message with its id field (ModelInferRequest.id, field
// 3) set to id: the field before the message's own bytes, which have no id.
func (e *clientEncoded) withID(id string) *clientEncoded {
	if id == "" {
		return e
	}
	p := protowire.AppendTag(make([]byte, 0, len(id)+6), 3, protowire.BytesType)
	return &clientEncoded{prefix: protowire.AppendString(p, id), b: e.b}
}

// clientCodec is the codec of the client's calls: a *clientEncoded goes
// out as its bytes, neither marshalled again nor copied, an answer read
// into a *clientAnswer is skimmed (client_answer.go), and anything else is
// protobuf as usual. Its name is protobuf's, so the
// call's content type is the ordinary one.
type clientCodec struct{}

var clientProto = encoding.GetCodecV2(grpcproto.Name)

func (clientCodec) Marshal(v any) (mem.BufferSlice, error) {
	if e, ok := v.(*clientEncoded); ok {
		// A SliceBuffer's Free does nothing: the bytes outlive the call.
		if e.prefix != nil {
			return mem.BufferSlice{mem.SliceBuffer(e.prefix), mem.SliceBuffer(e.b)}, nil
		}
		return mem.BufferSlice{mem.SliceBuffer(e.b)}, nil
	}
	return clientProto.Marshal(v)
}

func (clientCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if a, ok := v.(*clientAnswer); ok {
		return a.unmarshal(data)
	}
	return clientProto.Unmarshal(data, v)
}

func (clientCodec) Name() string { return grpcproto.Name }

var _ encoding.CodecV2 = clientCodec{}

// Close releases what the client made itself: its gRPC connections, its HTTP
// client's idle connections. Shared clients and connections stay open.
func (c *Client) Close() error {
	c.closeOnce.Do(func() {
		if c.ownConns {
			for _, conn := range c.grpcConns {
				c.closeErr = errors.Join(c.closeErr, conn.Close())
			}
		}
		if c.wire != nil {
			c.wire.close()
		}
	})
	return c.closeErr
}

// Infer sends one request and classifies how it ended: Good when answered
// with a valid response (the caller turns it into Late by comparing the
// latency with the SLO), Rejected on HTTP 429 or RESOURCE_EXHAUSTED, Dropped
// on HTTP 504 or DEADLINE_EXCEEDED and when the client's own timeout expires,
// Failed on anything else: other statuses and codes, connection errors, a
// cancelled ctx, and answers that are not an inference response of the
// model. detail is "" when answered, else the status or code and the start
// of the error ("503: model ocr-det is not ready", "client timeout").
//
// gRPC RESOURCE_EXHAUSTED also reports messages over a size limit; those are
// Failed, not Rejected.
func (c *Client) Infer(ctx context.Context) (o Outcome, detail string) {
	return c.InferID(ctx, "")
}

// InferID is Infer for a request with an id (the protocol's optional
// `id`; "": none), which the server echoes in its response and sloserve
// names the request by in its debug lines: a run's records are joined to
// the server's lines by it (scripts/late-causes.py). The id is written
// before the prepared message, which is not copied: a gRPC message's
// fields may come in any order, and a REST body's JSON object gets the id
// as its first member. A response with another id is Failed; one without
// an id is taken (the protocol asks servers to echo it; a server that does
// not still answers).
func (c *Client) InferID(ctx context.Context, id string) (o Outcome, detail string) {
	if c.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.timeout)
		defer cancel()
	}
	switch {
	case c.grpcMsg != nil:
		return c.inferGRPC(ctx, id)
	case c.wire != nil:
		return c.inferWire(ctx, id)
	}
	return c.inferREST(ctx, id)
}

// clientIDPrefix is what goes before a REST body's first byte past its
// opening brace to give the request id: `{"id":"ID",`; nil without an id.
func clientIDPrefix(id string) []byte {
	if id == "" {
		return nil
	}
	b := append(make([]byte, 0, len(id)+9), `{"id":`...)
	b = clientAppendJSONString(b, id)
	return append(b, ',')
}

// clientCheckID checks a response's id against the request's.
func clientCheckID(got, want string) string {
	if got != "" && got != want {
		return fmt.Sprintf("id %q, want %q", got, want)
	}
	return ""
}

// clientNewBody is a request body over the encoded bytes. It must be an
// io.NopCloser over a *bytes.Reader, which net/http recognizes as in memory:
// for any other reader it sends the headers in a TCP packet of their own
// before the body (which made big bodies take twice as long).
func clientNewBody(b []byte) io.ReadCloser {
	return io.NopCloser(bytes.NewReader(b))
}

func (c *Client) inferREST(ctx context.Context, id string) (Outcome, string) {
	req := c.httpReq.WithContext(ctx)
	req.Body = clientNewBody(c.body)
	if prefix := clientIDPrefix(id); prefix != nil {
		// The net/http path (a caller's HTTPClient) copies the body: it
		// must be one bytes.Reader (clientNewBody).
		body := append(append(make([]byte, 0, len(prefix)+len(c.body)-1), prefix...), c.body[1:]...)
		req.Body, req.ContentLength = clientNewBody(body), int64(len(body))
		req.GetBody = func() (io.ReadCloser, error) { return clientNewBody(body), nil }
		if c.headerLen > 0 {
			req.Header = req.Header.Clone()
			req.Header.Set(clientHeaderInferenceLength, strconv.Itoa(c.headerLen+len(prefix)-1))
		}
	}
	resp, err := c.httpClient.Do(req)
	if err != nil {
		return clientErrOutcome(ctx, err)
	}
	defer resp.Body.Close()
	o, detail, err := c.readREST(resp, id)
	if err != nil {
		return clientErrOutcome(ctx, err)
	}
	return o, detail
}

// clientMaxErrorBody is how much of an error body is read for its message;
// the rest is discarded.
const clientMaxErrorBody = 4 << 10

// clientMaxSkimmed caps a response's JSON once its data arrays are left
// out: names, shapes and parameters only.
const clientMaxSkimmed = 1 << 20

// clientReadBuf is what reading one response takes.
type clientReadBuf struct {
	chunk [32 << 10]byte
	skim  clientSkim
}

// clientReadBufs holds read buffers for reuse.
var clientReadBufs = sync.Pool{New: func() any { return new(clientReadBuf) }}

// readREST reads a response to its end and classifies it. err is a failure
// to read the body.
func (c *Client) readREST(resp *http.Response, id string) (Outcome, string, error) {
	rb := clientReadBufs.Get().(*clientReadBuf)
	defer clientReadBufs.Put(rb)

	if resp.StatusCode != http.StatusOK {
		n, err := io.ReadFull(resp.Body, rb.chunk[:clientMaxErrorBody])
		if err == nil || err == io.ErrUnexpectedEOF || err == io.EOF {
			_, err = io.Copy(io.Discard, resp.Body)
		}
		if err != nil {
			return 0, "", err
		}
		o := Failed
		switch resp.StatusCode {
		case http.StatusTooManyRequests:
			o = Rejected
		case http.StatusGatewayTimeout:
			o = Dropped
		}
		return o, clientDetail(strconv.Itoa(resp.StatusCode), clientErrorText(rb.chunk[:n])), nil
	}

	// The JSON part: the whole body, or with the binary extension the
	// header's length of it.
	var jsonPart io.Reader = resp.Body
	headerLen := int64(-1)
	if h := resp.Header.Get(clientHeaderInferenceLength); h != "" {
		n, err := strconv.ParseInt(h, 10, 64)
		if err != nil || n < 0 {
			_, err := io.Copy(io.Discard, resp.Body)
			return Failed, clientDetail("200", "invalid "+clientHeaderInferenceLength+" "+strconv.Quote(h)), err
		}
		headerLen = n
		jsonPart = io.LimitReader(resp.Body, n)
	}
	rb.skim.reset()
	var read int64
	for {
		n, err := jsonPart.Read(rb.chunk[:])
		read += int64(n)
		if n > 0 && rb.skim.write(rb.chunk[:n]) {
			_, err := io.Copy(io.Discard, resp.Body)
			return Failed, clientDetail("200", fmt.Sprintf("invalid response: over %d bytes of JSON without the data", clientMaxSkimmed)), err
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return 0, "", err
		}
	}
	binaryLen := int64(-1) // the bytes after the JSON header; -1: no binary part
	if headerLen >= 0 {
		if read < headerLen {
			return 0, "", io.ErrUnexpectedEOF
		}
		var err error
		if binaryLen, err = io.Copy(io.Discard, resp.Body); err != nil {
			return 0, "", err
		}
	}
	if problem := c.checkRESTResponse(rb.skim.out, binaryLen, id); problem != "" {
		return Failed, clientDetail("200", "invalid response: "+problem), nil
	}
	return Good, "", nil
}

// clientSkim copies a JSON document as it streams by, except for what is
// inside "data" arrays, which it leaves out: {"data":[1,2,[3]]} becomes
// {"data":[]}. Inference responses are almost all data, which encoding/json
// would read at about 100 MB/s, as slow as the server writes it; skimmed,
// the rest is small and decoded whole. The skim only follows strings and
// brackets: what it leaves out is not checked, and a document it cannot
// follow comes out as invalid JSON.
type clientSkim struct {
	out      []byte
	state    uint8
	strStart int  // where in out the string being copied starts
	escape   bool // the previous byte of a string was a backslash
	depth    int  // nesting inside the data array being skipped
}

// States of a clientSkim.
const (
	clientSkimOutside     = iota // copying, outside strings
	clientSkimString             // copying a string
	clientSkimAfterData          // after a "data" string: maybe a key
	clientSkimAfterColon         // after "data": a value may be an array
	clientSkimArray              // skipping a data array
	clientSkimArrayString        // skipping a string in a data array
)

func (s *clientSkim) reset() {
	if cap(s.out) > clientMaxSkimmed {
		s.out = nil
	}
	*s = clientSkim{out: s.out[:0]}
}

// write takes the next bytes of the document; it reports whether the copy
// has grown over clientMaxSkimmed.
func (s *clientSkim) write(p []byte) (tooLarge bool) {
	for i := 0; i < len(p); {
		switch s.state {
		case clientSkimOutside:
			j := bytes.IndexByte(p[i:], '"')
			if j < 0 {
				s.out = append(s.out, p[i:]...)
				i = len(p)
				break
			}
			s.out = append(s.out, p[i:i+j+1]...)
			s.strStart = len(s.out) - 1
			s.state = clientSkimString
			i += j + 1
		case clientSkimString:
			for i < len(p) {
				c := p[i]
				s.out = append(s.out, c)
				i++
				if s.escape {
					s.escape = false
				} else if c == '\\' {
					s.escape = true
				} else if c == '"' {
					s.state = clientSkimOutside
					if string(s.out[s.strStart:]) == `"data"` {
						s.state = clientSkimAfterData
					}
					break
				}
			}
		case clientSkimAfterData, clientSkimAfterColon:
			switch c := p[i]; {
			case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			case c == ':' && s.state == clientSkimAfterData:
				s.state = clientSkimAfterColon
			case c == '[' && s.state == clientSkimAfterColon:
				s.state, s.depth = clientSkimArray, 1
			default:
				s.state = clientSkimOutside // not a data array: copy as usual
				continue
			}
			s.out = append(s.out, p[i])
			i++
		case clientSkimArray:
			j := bytes.IndexAny(p[i:], `"[]`)
			if j < 0 {
				i = len(p)
				break
			}
			i += j
			switch p[i] {
			case '"':
				s.state = clientSkimArrayString
			case '[':
				s.depth++
			case ']':
				if s.depth--; s.depth == 0 {
					s.out = append(s.out, ']')
					s.state = clientSkimOutside
				}
			}
			i++
		case clientSkimArrayString:
			for i < len(p) {
				c := p[i]
				i++
				if s.escape {
					s.escape = false
				} else if c == '\\' {
					s.escape = true
				} else if c == '"' {
					s.state = clientSkimArray
					break
				}
			}
		}
	}
	return len(s.out) > clientMaxSkimmed
}

// clientPresent records that a JSON field is present and not null, without
// keeping (or copying) its value.
type clientPresent bool

func (p *clientPresent) UnmarshalJSON(b []byte) error {
	*p = string(b) != "null"
	return nil
}

// clientRESTResponse is as much of a REST inference response as the client
// checks.
type clientRESTResponse struct {
	ID           string `json:"id"`
	ModelName    string `json:"model_name"`
	ModelVersion string `json:"model_version"`
	Outputs      []struct {
		Name       string        `json:"name"`
		Data       clientPresent `json:"data"`
		Parameters struct {
			BinaryDataSize *int64 `json:"binary_data_size"`
		} `json:"parameters"`
	} `json:"outputs"`
}

// checkRESTResponse checks a 200 response's JSON part; binaryLen is the
// length of the binary part, -1 when there is none. It returns what is wrong,
// or "".
func (c *Client) checkRESTResponse(header []byte, binaryLen int64, id string) string {
	var r clientRESTResponse
	if err := json.Unmarshal(header, &r); err != nil {
		return "not JSON: " + err.Error()
	}
	if problem := cmp.Or(c.checkModel(r.ModelName, r.ModelVersion, len(r.Outputs)), clientCheckID(r.ID, id)); problem != "" {
		return problem
	}
	var declared int64
	for i, o := range r.Outputs {
		switch {
		case o.Name == "":
			return fmt.Sprintf("outputs[%d] has no name", i)
		case o.Parameters.BinaryDataSize != nil && binaryLen < 0:
			return fmt.Sprintf("output %q has binary_data_size but the response has no binary part", o.Name)
		case o.Parameters.BinaryDataSize != nil:
			declared += *o.Parameters.BinaryDataSize
		case !bool(o.Data):
			return fmt.Sprintf("output %q has no data", o.Name)
		}
	}
	if binaryLen >= 0 && declared != binaryLen {
		return fmt.Sprintf("outputs declare %d bytes of binary data; the response has %d", declared, binaryLen)
	}
	return ""
}

// checkModel checks a response's model name and version and that it has
// outputs.
func (c *Client) checkModel(name, version string, outputs int) string {
	switch {
	case name != c.model:
		return fmt.Sprintf("model_name %q, want %q", name, c.model)
	case c.version != "" && version != c.version:
		return fmt.Sprintf("model_version %q, want %q", version, c.version)
	case outputs == 0:
		return "no outputs"
	}
	return ""
}

func (c *Client) inferGRPC(ctx context.Context, id string) (Outcome, string) {
	conn := c.grpcConns[0]
	if len(c.grpcConns) > 1 {
		conn = c.grpcConns[(c.next.Add(1)-1)%uint32(len(c.grpcConns))]
	}
	var resp clientAnswer
	err := conn.Invoke(ctx, inference.GRPCInferenceService_ModelInfer_FullMethodName, c.grpcMsg.withID(id), &resp, c.callOpts...)
	if err != nil {
		st := status.Convert(err)
		code, msg := st.Code(), st.Message()
		switch {
		case code == codes.ResourceExhausted && clientTooLarge(msg):
			return Failed, clientDetail(code.String(), msg)
		case code == codes.ResourceExhausted:
			return Rejected, clientDetail(code.String(), msg)
		case (code == codes.DeadlineExceeded || code == codes.Canceled) && ctx.Err() != nil:
			return clientErrOutcome(ctx, ctx.Err())
		case code == codes.DeadlineExceeded && clientDeadlinePassed(ctx):
			// The server stopped the call at the deadline the client sent
			// it before the client's own timer fired.
			return Dropped, "client timeout"
		case code == codes.DeadlineExceeded:
			return Dropped, clientDetail(code.String(), msg)
		}
		return Failed, clientDetail(code.String(), msg)
	}
	if problem := cmp.Or(c.checkGRPCAnswer(&resp), clientCheckID(resp.id, id)); problem != "" {
		return Failed, clientDetail(codes.OK.String(), "invalid response: "+problem)
	}
	return Good, ""
}

// clientTooLarge reports whether a RESOURCE_EXHAUSTED message is about a
// size limit (sloserve's "request too large", gRPC's "message larger than
// max") rather than admission.
func clientTooLarge(msg string) bool {
	return strings.Contains(msg, "too large") || strings.Contains(msg, "larger than max")
}

// checkGRPCAnswer checks an answer; it returns what is wrong, or "".
func (c *Client) checkGRPCAnswer(r *clientAnswer) string {
	if problem := c.checkModel(r.modelName, r.modelVersion, len(r.outputs)); problem != "" {
		return problem
	}
	if len(r.raw) != 0 && len(r.raw) != len(r.outputs) {
		return fmt.Sprintf("%d raw_output_contents for %d outputs", len(r.raw), len(r.outputs))
	}
	for i, o := range r.outputs {
		switch {
		case o.name == "":
			return fmt.Sprintf("outputs[%d] has no name", i)
		case len(r.raw) == 0 && !o.hasContents:
			return fmt.Sprintf("output %q has no data", o.name)
		}
	}
	return ""
}

// clientErrOutcome classifies a request that got no answer: Dropped when
// the context's deadline (the client's timeout) expired, Failed otherwise.
func clientErrOutcome(ctx context.Context, err error) (Outcome, string) {
	switch ctx.Err() {
	case context.DeadlineExceeded:
		return Dropped, "client timeout"
	case context.Canceled:
		return Failed, "canceled"
	}
	return Failed, clientDetail("transport", clientTransportText(err))
}

// clientDeadlinePassed reports whether ctx has a deadline and it has passed.
func clientDeadlinePassed(ctx context.Context) bool {
	dl, ok := ctx.Deadline()
	return ok && !time.Now().Before(dl)
}

// clientTransportText describes a connection error without what varies per
// connection (the local port, the URL), so that reports can count alike
// failures together: "dial: connect: connection refused", "read: connection
// reset by peer", "EOF".
func clientTransportText(err error) string {
	var op *net.OpError
	if errors.As(err, &op) && op.Err != nil {
		return op.Op + ": " + op.Err.Error()
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	return err.Error()
}

// clientDetail is a failure's detail: what failed (a status, a code name)
// and the start of the message, with durations elided so that the same
// failure at different times counts as one kind in a report.
func clientDetail(what, msg string) string {
	msg = clientDurations.ReplaceAllString(strings.TrimSpace(msg), "…")
	if msg == "" {
		return what
	}
	if len(msg) > clientDetailLen {
		cut := clientDetailLen
		for cut > 0 && !utf8.RuneStart(msg[cut]) {
			cut--
		}
		msg = msg[:cut]
	}
	return what + ": " + msg
}

// clientDurations matches the durations in server messages ("by 1.7ms",
// "queued: 54.3ms late").
var clientDurations = regexp.MustCompile(`[0-9]+(\.[0-9]+)?(ns|µs|us|ms|s|m|h)\b`)

// clientErrorText is the message of an error body: the "error" of a JSON
// {"error": ...} object, else the body itself.
func clientErrorText(body []byte) string {
	var e struct {
		Error *string `json:"error"`
	}
	if json.Unmarshal(body, &e) == nil && e.Error != nil {
		return *e.Error
	}
	return strings.ToValidUTF8(strings.TrimSpace(string(body)), "\uFFFD")
}
