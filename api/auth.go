package api

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
)

// AuthOptions say which bearer tokens the server takes and what they
// protect. An empty token is not configured.
type AuthOptions struct {
	// InferenceToken, when set, is needed (or AdminToken) for every call
	// except health.
	InferenceToken string
	// AdminToken, when set, is needed for the admin calls. When it is not
	// set, admin calls are refused from peers that are not loopback.
	AdminToken string
	// RequireTokenForHealth and RequireTokenForMetrics put health and the
	// metrics listener behind the inference token too.
	RequireTokenForHealth  bool
	RequireTokenForMetrics bool
	// AllowedHosts are the host names, besides localhost and IP
	// addresses, that the Host header of an admin call let through for
	// coming from loopback may name (the listen host, names the server is
	// reached by). See REST.
	AllowedHosts []string
}

// Auth is the access control at the edge: a gin middleware for REST,
// interceptors for gRPC and a wrapper for the metrics handler. What each
// call needs:
//
//   - health (REST /v2/health/*, /v2/models/{m}[/versions/{v}]/ready; gRPC
//     ServerLive, ServerReady, ModelReady, grpc.health.v1): nothing, or
//     the inference token with RequireTokenForHealth;
//   - admin (REST POST /v2/repository/models/{m}/load and /unload, PUT and
//     DELETE /v2/models/{m}/share, POST /v2/config/reload, POST
//     /v2/logging, POST /v2/trace/setting; gRPC RepositoryModelLoad,
//     RepositoryModelUnload, and LogSettings and TraceSetting when they
//     name a setting to change): the admin token when one
//     is configured; otherwise a loopback peer (and the inference token
//     when one is configured);
//   - the dashboard page's static files (/dashboard, /dashboard/*): nothing;
//     they hold no data, and the page asks for a token when its JSON calls
//     are refused;
//   - the system shared-memory calls (REST /v2/systemsharedmemory/...,
//     gRPC SystemSharedMemory*): what inference needs, with the admin
//     calls' browser checks over REST (see sharedMemoryBrowserCheck);
//     registering also needs a loopback peer (SharedMemory.Register);
//   - everything else, read-only views (/v2/control, /v2/dashboard) and
//     unknown routes included: the inference token when one is
//     configured. The admin token is accepted wherever the inference token
//     is.
//
// Tokens are kept as SHA-256 digests and compared in constant time, so
// neither their content nor their length shows in the timing. No token or
// Authorization header is ever logged. Options change atomically with Set
// (config reloads).
type Auth struct {
	state    atomic.Pointer[authState]
	failures *prometheus.CounterVec
	logger   *slog.Logger
}

type authState struct {
	inference, admin       [sha256.Size]byte
	hasInference, hasAdmin bool
	health, metrics        bool
	hosts                  map[string]bool // AllowedHosts, lower case
}

// access is what a call needs.
type access int

const (
	accessOpen access = iota // the dashboard's static files
	accessHealth
	accessInference
	accessAdmin
)

var accessNames = [...]string{accessOpen: "open", accessHealth: "health", accessInference: "inference", accessAdmin: "admin"}

// Reasons a call is refused, the reason label of sloserve_auth_failures_total.
const (
	authMissing           = "missing"            // no Authorization header (or metadata)
	authMalformed         = "malformed"          // not "Bearer <token>"
	authInvalid           = "invalid"            // a token that matches none
	authInsufficientScope = "insufficient_scope" // the inference token on an admin call
	authNotLoopback       = "not_loopback"       // an admin call from the network with no admin token configured
	authCrossSite         = "cross_site"         // an admin call a browser sent from another site (Origin, Sec-Fetch-Site)
	authHostNotAllowed    = "host_not_allowed"   // a loopback-trusted admin call naming another host (DNS rebinding)
	authContentType       = "content_type"       // an admin call with a body that is not JSON: 415
)

// authRefusal is why a call is refused, with what the client is told.
type authRefusal struct {
	reason string
	msg    string
}

func (r *authRefusal) unauthenticated() bool {
	return r.reason == authMissing || r.reason == authMalformed || r.reason == authInvalid
}

// NewAuth returns the access control for opts, with its refusal counter
// registered in reg.
func NewAuth(opts AuthOptions, reg prometheus.Registerer, logger *slog.Logger) (*Auth, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	a := &Auth{
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sloserve_auth_failures_total",
			Help: "Calls refused by access control, by protocol (rest, grpc, http for the metrics listener), surface (health, inference, admin, metrics) and reason (missing, malformed or invalid token: 401/UNAUTHENTICATED; insufficient_scope, not_loopback, and for REST admin calls cross_site, host_not_allowed: 403/PERMISSION_DENIED; content_type, a browser's non-JSON body: 415).",
		}, []string{"protocol", "surface", "reason"}),
		logger: logger,
	}
	if reg != nil {
		if err := reg.Register(a.failures); err != nil {
			return nil, errors.Join(errors.New("api: registering auth metrics"), err)
		}
	}
	for _, proto := range []string{"rest", "grpc"} {
		for _, surface := range []string{"health", "inference", "admin"} {
			for _, reason := range []string{authMissing, authMalformed, authInvalid} {
				a.failures.WithLabelValues(proto, surface, reason)
			}
		}
		a.failures.WithLabelValues(proto, "admin", authInsufficientScope)
		a.failures.WithLabelValues(proto, "admin", authNotLoopback)
	}
	for _, reason := range []string{authCrossSite, authHostNotAllowed, authContentType} {
		a.failures.WithLabelValues("rest", "admin", reason)
	}
	for _, reason := range []string{authMissing, authMalformed, authInvalid} {
		a.failures.WithLabelValues("http", "metrics", reason)
	}
	a.Set(opts)
	return a, nil
}

// Set puts opts in effect for the calls that arrive from now on.
func (a *Auth) Set(opts AuthOptions) {
	st := &authState{health: opts.RequireTokenForHealth, metrics: opts.RequireTokenForMetrics, hosts: map[string]bool{}}
	for _, h := range opts.AllowedHosts {
		st.hosts[strings.ToLower(strings.TrimSuffix(h, "."))] = true
	}
	if opts.InferenceToken != "" {
		st.inference, st.hasInference = sha256.Sum256([]byte(opts.InferenceToken)), true
	}
	if opts.AdminToken != "" {
		st.admin, st.hasAdmin = sha256.Sum256([]byte(opts.AdminToken)), true
	}
	a.state.Store(st)
}

// tokenMatch is which configured token a presented one is.
type tokenMatch int

const (
	matchNone tokenMatch = iota
	matchInference
	matchAdmin
)

// match compares token with both configured tokens, always both and in
// constant time over fixed-length digests.
func (st *authState) match(token string) tokenMatch {
	d := sha256.Sum256([]byte(token))
	inf := subtle.ConstantTimeCompare(d[:], st.inference[:]) & boolInt(st.hasInference)
	adm := subtle.ConstantTimeCompare(d[:], st.admin[:]) & boolInt(st.hasAdmin)
	switch {
	case adm == 1:
		return matchAdmin
	case inf == 1:
		return matchInference
	}
	return matchNone
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// bearer takes the token out of an Authorization value ("Bearer <token>",
// the scheme in any case). ok is false when the value is not of that form.
func bearer(header string) (token string, ok bool) {
	scheme, token, found := strings.Cut(strings.TrimSpace(header), " ")
	token = strings.TrimSpace(token)
	if !found || !strings.EqualFold(scheme, "Bearer") || token == "" {
		return "", false
	}
	return token, true
}

// check decides a call that needs need, made with the Authorization value
// header (present says whether there was one) from a peer that is or is not
// loopback. It returns nil to let the call through.
func (a *Auth) check(need access, header string, present, loopback bool) *authRefusal {
	st := a.state.Load()
	switch {
	case need == accessOpen, need == accessHealth && !st.health:
		return nil
	case need == accessAdmin && !st.hasAdmin && !loopback:
		return &authRefusal{authNotLoopback, "admin calls are refused from non-loopback addresses when no admin token is configured; " +
			"call from the server's host, or set auth.admin_token_file and send Authorization: Bearer <admin token>"}
	}
	wantAdmin := need == accessAdmin && st.hasAdmin
	if !wantAdmin && !st.hasInference {
		return nil
	}
	which := "the inference or admin token"
	if wantAdmin {
		which = "the admin token"
	}
	if !present {
		return &authRefusal{authMissing, "this call needs a bearer token: send Authorization: Bearer <token> with " + which}
	}
	token, ok := bearer(header)
	if !ok {
		return &authRefusal{authMalformed, `the Authorization header must be "Bearer <token>"`}
	}
	switch m := st.match(token); {
	case m == matchNone:
		return &authRefusal{authInvalid, "the bearer token is not valid; this call needs " + which}
	case wantAdmin && m != matchAdmin:
		return &authRefusal{authInsufficientScope, "this call needs the admin token; the inference token does not allow it"}
	}
	return nil
}

// refused counts and logs a refusal. The log names the call and the peer,
// never the token.
func (a *Auth) refused(protocol string, need access, r *authRefusal, method, peerAddr string) {
	surface := accessNames[need]
	if protocol == "http" {
		surface = "metrics"
	}
	a.failures.WithLabelValues(protocol, surface, r.reason).Inc()
	a.logger.Debug("call refused by access control", "protocol", protocol, "method", method,
		"peer", peerAddr, "surface", surface, "reason", r.reason)
}

// admitted logs an admin call let through: the audit trail of changes.
func (a *Auth) admitted(protocol string, need access, method, peerAddr string) {
	if need == accessAdmin {
		a.logger.Info("admin call", "protocol", protocol, "method", method, "peer", peerAddr)
	}
}

// addrLoopback is isLoopback for a peer's address, without formatting a
// TCP address first.
func addrLoopback(addr net.Addr) bool {
	switch a := addr.(type) {
	case nil:
		return false
	case *net.TCPAddr:
		return a.IP.IsLoopback()
	default:
		return isLoopback(a.String())
	}
}

// addrString is a peer's address as logs show it; "" when unknown.
func addrString(addr net.Addr) string {
	if addr == nil {
		return ""
	}
	return addr.String()
}

// isLoopback reports whether addr ("host:port" or a bare IP) is a loopback
// address; anything it cannot read is not.
func isLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		host = addr
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// restAccess is what a REST route needs; fullPath is gin's route pattern,
// "" for no route (which needs the inference token like any other call, so
// a client without one cannot map the routes).
func restAccess(method, fullPath string) access {
	switch fullPath {
	case "/v2/health/live", "/v2/health/ready", "/v2/models/:model/ready", "/v2/models/:model/versions/:version/ready":
		if method == http.MethodGet {
			return accessHealth
		}
	case "/v2/repository/models/:model/load", "/v2/repository/models/:model/unload", "/v2/config/reload":
		return accessAdmin
	case "/v2/models/:model/share":
		return accessAdmin
	case "/v2/logging":
		if method != http.MethodGet {
			return accessAdmin // changes what the server logs
		}
	case "/v2/trace/setting":
		if method != http.MethodGet {
			return accessAdmin // changes what the server traces
		}
	case "/dashboard", "/dashboard/*file":
		return accessOpen
	}
	return accessInference
}

// REST returns the gin middleware. The peer is the TCP peer of the
// connection (Request.RemoteAddr): X-Forwarded-For and the like are not
// trusted. Admin calls (all of which change state) are also kept from
// browsers, which would otherwise let any web page a user opens drive them
// from loopback: see browserCheck.
func (a *Auth) REST() gin.HandlerFunc {
	return func(c *gin.Context) {
		r := c.Request
		need := restAccess(r.Method, c.FullPath())
		values, present := r.Header["Authorization"]
		header := ""
		if present && len(values) > 0 {
			header = values[0]
		}
		if len(values) > 1 {
			header = "" // two Authorization headers: malformed
		}
		ref := a.check(need, header, present, isLoopback(r.RemoteAddr))
		switch {
		case ref != nil:
		case need == accessAdmin:
			ref = a.state.Load().browserCheck(r)
		case strings.HasPrefix(c.FullPath(), "/v2/systemsharedmemory/"):
			ref = a.sharedMemoryBrowserCheck(r, true)
		}
		if ref == nil {
			a.admitted("rest", need, r.Method+" "+r.URL.Path, r.RemoteAddr)
			c.Next()
			return
		}
		a.refused("rest", need, ref, r.Method+" "+r.URL.Path, r.RemoteAddr)
		writeAuthRefusal(c.Writer, ref)
		c.Abort()
	}
}

// browserCheck refuses an admin call that a web browser may have sent on
// behalf of another site; tools such as curl send none of what it looks
// at and pass. The call is refused (403) when
//
//   - Sec-Fetch-Site says cross-site or same-site (a page of another
//     origin), or Origin is present and its host:port is not the Host the
//     call was sent to (a cross-origin fetch or form post; "null" too);
//   - no admin token is configured, so the call is let through for coming
//     from loopback, and the Host header names a host other than an IP
//     address, localhost or one of AllowedHosts: a page whose name was
//     rebound to 127.0.0.1 (DNS rebinding) sends its own name;
//
// and answered 415 when a browser (fromBrowser) sends it with a body whose
// Content-Type is not application/json, which a page cannot send
// cross-origin without a CORS preflight the server never grants. Tools
// send any Content-Type or none: Triton's clients do.
func (st *authState) browserCheck(r *http.Request) *authRefusal {
	return st.browserRefusal(r, browserCalls{"admin calls", "an admin call", "an admin token"}, !st.hasAdmin, true)
}

// browserCalls names a kind of call in browserRefusal's messages.
type browserCalls struct {
	plural, singular string
	token            string // the token that makes loopback trust moot
}

// browserRefusal is browserCheck for calls of kind what: the Host check
// applies when loopbackTrusted, the Content-Type check when checkBody.
func (st *authState) browserRefusal(r *http.Request, what browserCalls, loopbackTrusted, checkBody bool) *authRefusal {
	switch r.Header.Get("Sec-Fetch-Site") {
	case "cross-site", "same-site":
		return &authRefusal{authCrossSite, what.plural + " from a web page of another site are refused (Sec-Fetch-Site: " +
			r.Header.Get("Sec-Fetch-Site") + "); call from curl or another tool"}
	}
	if origins, ok := r.Header["Origin"]; ok {
		if len(origins) != 1 || !sameHost(origins[0], r.Host) {
			return &authRefusal{authCrossSite, what.plural + " from a web page of another origin are refused (its Origin is not the Host called); call from curl or another tool"}
		}
	}
	if loopbackTrusted && !st.hostAllowed(r.Host) {
		return &authRefusal{authHostNotAllowed, what.plural + " trusted for coming from loopback must name localhost, an IP address or a host in auth.allowed_hosts in their Host header " +
			"(this one names another host, as a DNS-rebinding web page would); add the name to auth.allowed_hosts or configure " + what.token}
	}
	if checkBody && fromBrowser(r) && (r.ContentLength != 0 || len(r.TransferEncoding) > 0) {
		mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
		if err != nil || mt != "application/json" {
			return &authRefusal{authContentType, what.singular + " with a body must send it as Content-Type: application/json"}
		}
	}
	return nil
}

// fromBrowser reports whether r carries what browsers add to every
// cross-origin POST, PUT and DELETE and tools do not: an Origin, or any
// Fetch Metadata header (Sec-Fetch-Site, -Mode, -Dest, -User). Triton's
// clients send neither, and no Content-Type (tritonclient.http, whose
// geventhttpclient posts a bare body: http/_client.py _post) or a
// non-JSON one (tritonclient.http.aio, aiohttp's default for the body it
// posts: http/aio/__init__.py _post), so the Content-Type check applies
// to browsers only.
func fromBrowser(r *http.Request) bool {
	if _, ok := r.Header["Origin"]; ok {
		return true
	}
	for k := range r.Header {
		if strings.HasPrefix(k, "Sec-Fetch-") {
			return true
		}
	}
	return false
}

// sharedMemoryCalls names the shared-memory calls in refusals.
var sharedMemoryCalls = browserCalls{"shared memory calls", "a shared memory call", "an inference token"}

// sharedMemoryBrowserCheck refuses a REST call that registers,
// unregisters or lists shared-memory regions, or an inference request
// naming one (body false: its body is JSON or binary), when a web browser
// may have sent it for another site, as browserCheck does for admin calls:
// such calls are trusted for coming from the server's host, and a page
// must not make the server map, read or write the host's shared memory.
// The Host check applies when no inference token is configured (a page
// cannot send one). A nil Auth is no tokens.
func (a *Auth) sharedMemoryBrowserCheck(r *http.Request, body bool) *authRefusal {
	st := &authState{}
	if a != nil {
		st = a.state.Load()
	}
	return st.browserRefusal(r, sharedMemoryCalls, !st.hasInference, body)
}

// sameHost reports whether the Origin value origin ("scheme://host[:port]")
// names host (the request's Host: "host[:port]"), ports included.
func sameHost(origin, host string) bool {
	u, err := url.Parse(origin)
	if err != nil || u.Host == "" || u.Scheme == "" || host == "" {
		return false
	}
	oh, op := splitHostPort(u.Host)
	hh, hp := splitHostPort(host)
	if op == "" {
		op = map[string]string{"http": "80", "https": "443"}[strings.ToLower(u.Scheme)]
	}
	if hp == "" {
		hp = op // the client's default port for the scheme
	}
	return strings.EqualFold(oh, hh) && op == hp
}

// splitHostPort splits "host[:port]" ("[::1]:80" too), without brackets.
func splitHostPort(hostport string) (host, port string) {
	if h, p, err := net.SplitHostPort(hostport); err == nil {
		return h, p
	}
	return strings.TrimSuffix(strings.TrimPrefix(hostport, "["), "]"), ""
}

// hostAllowed reports whether a Host header names this server for a call
// trusted for coming from loopback: an IP address (a rebound name never
// is one), localhost, or an allowed name. No Host at all (HTTP/1.0) is not
// a browser's.
func (st *authState) hostAllowed(hostport string) bool {
	if hostport == "" {
		return true
	}
	host, _ := splitHostPort(hostport)
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	if net.ParseIP(host) != nil || host == "localhost" || strings.HasSuffix(host, ".localhost") {
		return true
	}
	return st.hosts[host]
}

// writeAuthRefusal answers 401 with a WWW-Authenticate challenge (RFC 6750)
// or 403 (415 for a wrong content type), and {"error": ...}.
func writeAuthRefusal(w http.ResponseWriter, r *authRefusal) {
	status := http.StatusForbidden
	switch r.reason {
	case authMissing:
		w.Header().Set("WWW-Authenticate", `Bearer realm="sloserve"`)
		status = http.StatusUnauthorized
	case authMalformed:
		w.Header().Set("WWW-Authenticate", `Bearer realm="sloserve", error="invalid_request"`)
		status = http.StatusUnauthorized
	case authInvalid:
		w.Header().Set("WWW-Authenticate", `Bearer realm="sloserve", error="invalid_token"`)
		status = http.StatusUnauthorized
	case authInsufficientScope:
		w.Header().Set("WWW-Authenticate", `Bearer realm="sloserve", error="insufficient_scope"`)
	case authContentType:
		status = http.StatusUnsupportedMediaType
	}
	body := appendJSONString([]byte(`{"error":`), r.msg)
	body = append(body, '}')
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// Metrics wraps the metrics handler: with RequireTokenForMetrics it needs
// the inference or admin token.
func (a *Auth) Metrics(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st := a.state.Load()
		if !st.metrics {
			h.ServeHTTP(w, r)
			return
		}
		values, present := r.Header["Authorization"]
		header := ""
		if len(values) == 1 {
			header = values[0]
		}
		ref := a.check(accessInference, header, present, isLoopback(r.RemoteAddr))
		if ref != nil {
			a.refused("http", accessInference, ref, r.Method+" "+r.URL.Path, r.RemoteAddr)
			writeAuthRefusal(w, ref)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// grpcAccess is what a gRPC method needs.
func grpcAccess(fullMethod string) access {
	switch fullMethod {
	case "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch", "/grpc.health.v1.Health/List",
		"/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady",
		"/inference.GRPCInferenceService/ModelReady":
		return accessHealth
	case "/inference.GRPCInferenceService/RepositoryModelLoad", "/inference.GRPCInferenceService/RepositoryModelUnload":
		return accessAdmin
	}
	return accessInference
}

// grpcUnaryAccess is what a unary call needs, its message read: a
// LogSettings call that changes a setting is an admin call, as POST
// /v2/logging is; one that only reads them is not, as GET /v2/logging.
func grpcUnaryAccess(fullMethod string, req any) access {
	if r, ok := req.(*inference.LogSettingsRequest); ok && fullMethod == inference.GRPCInferenceService_LogSettings_FullMethodName {
		if len(r.GetSettings()) > 0 {
			return accessAdmin
		}
		return accessInference
	}
	if r, ok := req.(*inference.TraceSettingRequest); ok && fullMethod == inference.GRPCInferenceService_TraceSetting_FullMethodName {
		if len(r.GetSettings()) > 0 {
			return accessAdmin
		}
		return accessInference
	}
	return grpcAccess(fullMethod)
}

// grpcCheck decides a gRPC call that needs need from its metadata and peer.
func (a *Auth) grpcCheck(ctx context.Context, fullMethod string, need access) error {
	// One key, not a copy of all the call's metadata.
	values := metadata.ValueFromIncomingContext(ctx, "authorization")
	header := ""
	if len(values) == 1 {
		header = values[0]
	}
	var addr net.Addr
	if p, ok := peer.FromContext(ctx); ok {
		addr = p.Addr
	}
	ref := a.check(need, header, len(values) > 0, addrLoopback(addr))
	if ref == nil {
		if need == accessAdmin {
			a.admitted("grpc", need, fullMethod, addrString(addr))
		}
		return nil
	}
	a.refused("grpc", need, ref, fullMethod, addrString(addr))
	if ref.unauthenticated() {
		return status.Error(codes.Unauthenticated, ref.msg)
	}
	return status.Error(codes.PermissionDenied, ref.msg)
}

// UnaryInterceptor checks unary calls.
func (a *Auth) UnaryInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if err := a.grpcCheck(ctx, info.FullMethod, grpcUnaryAccess(info.FullMethod, req)); err != nil {
			return nil, err
		}
		return handler(ctx, req)
	}
}

// StreamInterceptor checks streaming calls (health Watch, reflection).
func (a *Auth) StreamInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if err := a.grpcCheck(ss.Context(), info.FullMethod, grpcAccess(info.FullMethod)); err != nil {
			return err
		}
		return handler(srv, ss)
	}
}

// ServerOptions are the gRPC server options that install the interceptors.
func (a *Auth) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(a.UnaryInterceptor()),
		grpc.ChainStreamInterceptor(a.StreamInterceptor()),
	}
}
