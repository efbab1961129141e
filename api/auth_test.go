package api

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

const (
	testInferenceToken = "inference-token-0123456789"
	testAdminToken     = "admin-token-9876543210abc"
	remotePeer         = "192.0.2.7:40000"
	loopbackPeer       = "127.0.0.1:40000"
)

// authRoute is one REST call and what it needs.
type authRoute struct {
	method, path, body string
	need               access
}

var authRoutes = []authRoute{
	{"GET", "/v2/health/live", "", accessHealth},
	{"GET", "/v2/health/ready", "", accessHealth},
	{"GET", "/v2/models/sum/ready", "", accessHealth},
	{"GET", "/v2/models/sum/versions/1/ready", "", accessHealth},
	{"GET", "/v2", "", accessInference},
	{"GET", "/v2/models/sum", "", accessInference},
	{"POST", "/v2/models/sum/infer", `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}`, accessInference},
	{"GET", "/v2/models/stats", "", accessInference},
	{"POST", "/v2/repository/index", "", accessInference},
	{"GET", "/v2/control", "", accessInference},
	{"GET", "/v2/control/events", "", accessInference},
	{"GET", "/v2/dashboard", "", accessInference},
	{"GET", "/v2/nothing-here", "", accessInference},
	{"GET", "/v2/config/reload", "", accessInference}, // 405: no route for GET
	{"POST", "/v2/repository/models/sum/load", "", accessAdmin},
	{"POST", "/v2/repository/models/sum/unload", "", accessAdmin},
	{"PUT", "/v2/models/sum/share", `{"compute":0.5}`, accessAdmin},
	{"DELETE", "/v2/models/sum/share", "", accessAdmin},
	{"POST", "/v2/config/reload", "", accessAdmin},
	{"GET", "/dashboard/", "", accessOpen},
	{"GET", "/dashboard/app.js", "", accessOpen},
}

// serveREST answers one request with a fresh fake backend, behind auth when
// it is not nil.
func serveREST(t *testing.T, a *Auth, method, path, body, remote string, header ...string) *httptest.ResponseRecorder {
	t.Helper()
	var mw []gin.HandlerFunc
	if a != nil {
		mw = append(mw, a.REST())
	}
	h := NewREST(newFakeBackend(), Limits{}, nil, mw...)
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	req.RemoteAddr = remote
	// As curl sends them: the address called, JSON bodies typed.
	req.Host = "127.0.0.1:8000"
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(header); i += 2 {
		switch {
		case strings.EqualFold(header[i], "Host"):
			req.Host = header[i+1]
		case strings.EqualFold(header[i], "Content-Type"):
			req.Header.Set(header[i], header[i+1])
		default:
			req.Header.Add(header[i], header[i+1])
		}
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	return w
}

func newTestAuth(t *testing.T, opts AuthOptions) (*Auth, *bytes.Buffer) {
	t.Helper()
	var log bytes.Buffer
	a, err := NewAuth(opts, prometheus.NewRegistry(), slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelDebug})))
	if err != nil {
		t.Fatal(err)
	}
	return a, &log
}

// TestRESTAuthTable runs every route with no token, a wrong one, the
// inference and the admin token, from a loopback and a remote peer, under
// each way of configuring tokens, and checks the exact status: the
// unprotected handler's status when the call is let through, else 401 or 403.
func TestRESTAuthTable(t *testing.T) {
	configs := []struct {
		name string
		opts AuthOptions
	}{
		{"no tokens", AuthOptions{}},
		{"inference token", AuthOptions{InferenceToken: testInferenceToken}},
		{"admin token", AuthOptions{AdminToken: testAdminToken}},
		{"both tokens", AuthOptions{InferenceToken: testInferenceToken, AdminToken: testAdminToken}},
		{"both tokens, health closed", AuthOptions{InferenceToken: testInferenceToken, AdminToken: testAdminToken, RequireTokenForHealth: true}},
	}
	presented := []struct{ name, header string }{
		{"no token", ""},
		{"wrong token", "Bearer wrong-token-0123456789"},
		{"inference token", "Bearer " + testInferenceToken},
		{"admin token", "Bearer " + testAdminToken},
	}
	for _, cfg := range configs {
		t.Run(cfg.name, func(t *testing.T) {
			a, log := newTestAuth(t, cfg.opts)
			for _, r := range authRoutes {
				base := serveREST(t, nil, r.method, r.path, r.body, loopbackPeer)
				if base.Code == 401 || base.Code == 403 {
					t.Fatalf("%s %s: %d without access control", r.method, r.path, base.Code)
				}
				for _, peerAddr := range []string{loopbackPeer, remotePeer} {
					for _, p := range presented {
						var hdr []string
						if p.header != "" {
							hdr = []string{"Authorization", p.header}
						}
						want := expectedStatus(cfg.opts, r.need, p.name, peerAddr == loopbackPeer, base.Code)
						w := serveREST(t, a, r.method, r.path, r.body, peerAddr, hdr...)
						if w.Code != want {
							t.Errorf("%s %s from %s with %s: %d %s, want %d", r.method, r.path, peerAddr, p.name, w.Code, w.Body, want)
							continue
						}
						if want == 401 || want == 403 {
							checkRefusalBody(t, w)
						}
					}
				}
			}
			for _, tok := range []string{testInferenceToken, testAdminToken, "wrong-token"} {
				if strings.Contains(log.String(), tok) {
					t.Errorf("the log shows a token:\n%s", log)
				}
			}
		})
	}
}

// expectedStatus is the rule the table checks against, written out
// independently of Auth.check.
func expectedStatus(o AuthOptions, need access, token string, loopback bool, base int) int {
	hasInf, hasAdm := o.InferenceToken != "", o.AdminToken != ""
	valid := token == "admin token" && hasAdm || token == "inference token" && hasInf
	switch need {
	case accessOpen:
		return base
	case accessHealth:
		if !o.RequireTokenForHealth || valid {
			return base
		}
		return 401
	case accessAdmin:
		if hasAdm {
			switch {
			case token == "admin token":
				return base
			case token == "inference token" && hasInf:
				return 403
			}
			return 401
		}
		if !loopback {
			return 403
		}
	}
	if !hasInf || valid {
		return base
	}
	return 401
}

func checkRefusalBody(t *testing.T, w *httptest.ResponseRecorder) {
	t.Helper()
	var body map[string]string
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil || body["error"] == "" || len(body) != 1 {
		t.Errorf("body %q is not {\"error\": ...}", w.Body)
	}
	if ct := w.Header().Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q", ct)
	}
	challenge := w.Header().Get("WWW-Authenticate")
	if w.Code == 401 && !strings.HasPrefix(challenge, `Bearer realm="sloserve"`) {
		t.Errorf("401 with WWW-Authenticate %q", challenge)
	}
}

// TestRESTAuthDetails checks the messages, challenges, malformed headers,
// forwarded-for headers and the failure counter.
func TestRESTAuthDetails(t *testing.T) {
	a, _ := newTestAuth(t, AuthOptions{InferenceToken: testInferenceToken, AdminToken: testAdminToken})
	cases := []struct {
		name, method, path, remote string
		header                     []string
		code                       int
		challenge, msg, reason     string
		surface                    string
	}{
		{"missing", "GET", "/v2", remotePeer, nil, 401, `Bearer realm="sloserve"`,
			"this call needs a bearer token: send Authorization: Bearer <token> with the inference or admin token", authMissing, "inference"},
		{"basic scheme", "GET", "/v2", remotePeer, []string{"Authorization", "Basic dXNlcjpwYXNz"}, 401, `Bearer realm="sloserve", error="invalid_request"`,
			`the Authorization header must be "Bearer <token>"`, authMalformed, "inference"},
		{"bearer without token", "GET", "/v2", remotePeer, []string{"Authorization", "Bearer "}, 401, `Bearer realm="sloserve", error="invalid_request"`,
			`the Authorization header must be "Bearer <token>"`, authMalformed, "inference"},
		{"two headers", "GET", "/v2", remotePeer, []string{"Authorization", "Bearer " + testInferenceToken, "Authorization", "Bearer " + testInferenceToken}, 401,
			`Bearer realm="sloserve", error="invalid_request"`, `the Authorization header must be "Bearer <token>"`, authMalformed, "inference"},
		{"token prefix", "GET", "/v2", remotePeer, []string{"Authorization", "Bearer " + testInferenceToken[:20]}, 401, `Bearer realm="sloserve", error="invalid_token"`,
			"the bearer token is not valid; this call needs the inference or admin token", authInvalid, "inference"},
		{"lower-case scheme", "GET", "/v2", remotePeer, []string{"Authorization", "bearer " + testInferenceToken}, 200, "", "", "", ""},
		{"inference on admin", "POST", "/v2/config/reload", loopbackPeer, []string{"Authorization", "Bearer " + testInferenceToken}, 403, `Bearer realm="sloserve", error="insufficient_scope"`,
			"this call needs the admin token; the inference token does not allow it", authInsufficientScope, "admin"},
		{"admin missing", "POST", "/v2/config/reload", loopbackPeer, nil, 401, `Bearer realm="sloserve"`,
			"this call needs a bearer token: send Authorization: Bearer <token> with the admin token", authMissing, "admin"},
		{"admin over the network", "POST", "/v2/repository/models/sum/load", remotePeer, []string{"Authorization", "Bearer " + testAdminToken}, 200, "", "", "", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var before float64
			if c.reason != "" {
				before = testutil.ToFloat64(a.failures.WithLabelValues("rest", c.surface, c.reason))
			}
			w := serveREST(t, a, c.method, c.path, "", c.remote, c.header...)
			if w.Code != c.code {
				t.Fatalf("%d %s, want %d", w.Code, w.Body, c.code)
			}
			if got := w.Header().Get("WWW-Authenticate"); got != c.challenge {
				t.Errorf("WWW-Authenticate %q, want %q", got, c.challenge)
			}
			if c.msg == "" {
				return
			}
			var body map[string]string
			_ = json.Unmarshal(w.Body.Bytes(), &body)
			if body["error"] != c.msg {
				t.Errorf("error %q, want %q", body["error"], c.msg)
			}
			if got := testutil.ToFloat64(a.failures.WithLabelValues("rest", c.surface, c.reason)); got != before+1 {
				t.Errorf("sloserve_auth_failures_total{protocol=rest,surface=%s,reason=%s} = %v, want %v", c.surface, c.reason, got, before+1)
			}
		})
	}

	t.Run("no admin token: forwarded headers do not make a peer local", func(t *testing.T) {
		a, _ := newTestAuth(t, AuthOptions{})
		w := serveREST(t, a, "POST", "/v2/config/reload", "", remotePeer,
			"X-Forwarded-For", "127.0.0.1", "X-Real-IP", "127.0.0.1", "Forwarded", "for=127.0.0.1")
		if w.Code != 403 || !strings.Contains(w.Body.String(), "set auth.admin_token_file") {
			t.Errorf("%d %s, want 403 saying how to enable", w.Code, w.Body)
		}
		if got := testutil.ToFloat64(a.failures.WithLabelValues("rest", "admin", authNotLoopback)); got != 1 {
			t.Errorf("not_loopback count %v, want 1", got)
		}
		for _, local := range []string{"127.0.0.1:1", "[::1]:1", "127.8.9.10:1", "[::ffff:127.0.0.1]:1"} {
			if w := serveREST(t, a, "POST", "/v2/config/reload", "", local); w.Code != 200 {
				t.Errorf("from %s: %d %s", local, w.Code, w.Body)
			}
		}
	})

	t.Run("Set rotates tokens", func(t *testing.T) {
		a, _ := newTestAuth(t, AuthOptions{InferenceToken: testInferenceToken})
		const next = "next-inference-token-000"
		a.Set(AuthOptions{InferenceToken: next})
		if w := serveREST(t, a, "GET", "/v2", "", remotePeer, "Authorization", "Bearer "+testInferenceToken); w.Code != 401 {
			t.Errorf("old token: %d", w.Code)
		}
		if w := serveREST(t, a, "GET", "/v2", "", remotePeer, "Authorization", "Bearer "+next); w.Code != 200 {
			t.Errorf("new token: %d", w.Code)
		}
		a.Set(AuthOptions{})
		if w := serveREST(t, a, "GET", "/v2", "", remotePeer); w.Code != 200 {
			t.Errorf("no token configured: %d", w.Code)
		}
	})
}

func TestMetricsAuth(t *testing.T) {
	metrics := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("metrics")) })
	for _, c := range []struct {
		name   string
		opts   AuthOptions
		header string
		code   int
	}{
		{"open by default", AuthOptions{InferenceToken: testInferenceToken}, "", 200},
		{"closed, no token", AuthOptions{InferenceToken: testInferenceToken, RequireTokenForMetrics: true}, "", 401},
		{"closed, wrong token", AuthOptions{InferenceToken: testInferenceToken, RequireTokenForMetrics: true}, "Bearer nope-nope-nope-nope", 401},
		{"closed, inference token", AuthOptions{InferenceToken: testInferenceToken, RequireTokenForMetrics: true}, "Bearer " + testInferenceToken, 200},
		{"closed, admin token", AuthOptions{InferenceToken: testInferenceToken, AdminToken: testAdminToken, RequireTokenForMetrics: true}, "Bearer " + testAdminToken, 200},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, _ := newTestAuth(t, c.opts)
			req := httptest.NewRequest("GET", "/metrics", nil)
			if c.header != "" {
				req.Header.Set("Authorization", c.header)
			}
			w := httptest.NewRecorder()
			a.Metrics(metrics).ServeHTTP(w, req)
			if w.Code != c.code {
				t.Errorf("%d %s, want %d", w.Code, w.Body, c.code)
			}
			if c.code == 401 && testutil.ToFloat64(a.failures.WithLabelValues("http", "metrics", map[bool]string{true: authMissing, false: authInvalid}[c.header == ""])) != 1 {
				t.Error("refusal not counted")
			}
		})
	}
}

// TestGRPCAuth drives the interceptors with the metadata and peers a real
// connection would give.
func TestGRPCAuth(t *testing.T) {
	const svc = "/inference.GRPCInferenceService/"
	a, log := newTestAuth(t, AuthOptions{InferenceToken: testInferenceToken, AdminToken: testAdminToken})
	noAdmin, _ := newTestAuth(t, AuthOptions{InferenceToken: testInferenceToken})
	remote := &net.TCPAddr{IP: net.ParseIP("192.0.2.7"), Port: 40000}
	local := &net.TCPAddr{IP: net.ParseIP("127.0.0.1"), Port: 40000}
	cases := []struct {
		name   string
		a      *Auth
		method string
		addr   net.Addr
		auth   []string
		code   codes.Code
	}{
		{"health open", a, "/grpc.health.v1.Health/Check", remote, nil, codes.OK},
		{"ServerReady open", a, svc + "ServerReady", remote, nil, codes.OK},
		{"ModelReady open", a, svc + "ModelReady", remote, nil, codes.OK},
		{"infer no token", a, svc + "ModelInfer", remote, nil, codes.Unauthenticated},
		{"infer wrong token", a, svc + "ModelInfer", remote, []string{"Bearer wrong-wrong-wrong-wrong"}, codes.Unauthenticated},
		{"infer malformed", a, svc + "ModelInfer", remote, []string{testInferenceToken}, codes.Unauthenticated},
		{"infer two tokens", a, svc + "ModelInfer", remote, []string{"Bearer " + testInferenceToken, "Bearer " + testInferenceToken}, codes.Unauthenticated},
		{"infer inference token", a, svc + "ModelInfer", remote, []string{"Bearer " + testInferenceToken}, codes.OK},
		{"infer admin token", a, svc + "ModelInfer", remote, []string{"Bearer " + testAdminToken}, codes.OK},
		{"reflection needs a token", a, "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", remote, nil, codes.Unauthenticated},
		{"metadata needs a token", a, svc + "ModelMetadata", local, nil, codes.Unauthenticated},
		{"load no token", a, svc + "RepositoryModelLoad", local, nil, codes.Unauthenticated},
		{"load inference token", a, svc + "RepositoryModelLoad", local, []string{"Bearer " + testInferenceToken}, codes.PermissionDenied},
		{"unload admin token", a, svc + "RepositoryModelUnload", remote, []string{"Bearer " + testAdminToken}, codes.OK},
		{"no admin token, remote", noAdmin, svc + "RepositoryModelLoad", remote, []string{"Bearer " + testInferenceToken}, codes.PermissionDenied},
		{"no admin token, local", noAdmin, svc + "RepositoryModelLoad", local, []string{"Bearer " + testInferenceToken}, codes.OK},
		{"no admin token, local, no token", noAdmin, svc + "RepositoryModelUnload", local, nil, codes.Unauthenticated},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctx := peer.NewContext(context.Background(), &peer.Peer{Addr: c.addr})
			md := metadata.MD{}
			for _, v := range c.auth {
				md.Append("authorization", v)
			}
			ctx = metadata.NewIncomingContext(ctx, md)
			called := false
			_, err := c.a.UnaryInterceptor()(ctx, nil, &grpc.UnaryServerInfo{FullMethod: c.method}, func(context.Context, any) (any, error) {
				called = true
				return "ok", nil
			})
			if got := status.Code(err); got != c.code {
				t.Fatalf("code %v (%v), want %v", got, err, c.code)
			}
			if called != (c.code == codes.OK) {
				t.Errorf("handler called: %v", called)
			}
			// The stream interceptor decides the same way.
			err = c.a.StreamInterceptor()(nil, &fakeServerStream{ctx: ctx}, &grpc.StreamServerInfo{FullMethod: c.method}, func(any, grpc.ServerStream) error { return nil })
			if got := status.Code(err); got != c.code {
				t.Errorf("stream: code %v, want %v", got, c.code)
			}
		})
	}
	if got := testutil.ToFloat64(a.failures.WithLabelValues("grpc", "admin", authInsufficientScope)); got != 2 {
		t.Errorf("insufficient_scope count %v, want 2 (unary and stream)", got)
	}
	if strings.Contains(log.String(), testInferenceToken) || strings.Contains(log.String(), testAdminToken) {
		t.Errorf("the log shows a token:\n%s", log)
	}
	if !strings.Contains(log.String(), "admin call") {
		t.Errorf("admitted admin calls are not logged:\n%s", log)
	}
}

type fakeServerStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *fakeServerStream) Context() context.Context { return s.ctx }

func TestBearer(t *testing.T) {
	for in, want := range map[string]string{
		"Bearer abc": "abc", "bearer abc": "abc", "BEARER  abc ": "abc", " Bearer abc": "abc",
		"Bearer": "", "Bearer ": "", "Basic abc": "", "abc": "", "": "", "Bearerabc": "",
	} {
		got, ok := bearer(in)
		if got != want || ok != (want != "") {
			t.Errorf("bearer(%q) = %q, %v; want %q", in, got, ok, want)
		}
	}
}

// A client cannot choose the address gin reports for it.
func TestRESTTrustsNoProxy(t *testing.T) {
	var got string
	h := NewREST(newFakeBackend(), Limits{}, nil, func(c *gin.Context) { got = c.ClientIP(); c.Next() })
	req := httptest.NewRequest(http.MethodGet, "/v2/health/live", nil)
	req.RemoteAddr = "192.0.2.7:4000"
	req.Header.Set("X-Forwarded-For", "127.0.0.1")
	req.Header.Set("X-Real-IP", "127.0.0.1")
	h.ServeHTTP(httptest.NewRecorder(), req)
	if got != "192.0.2.7" {
		t.Errorf("ClientIP = %q, want the peer 192.0.2.7", got)
	}
}
