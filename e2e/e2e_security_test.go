package e2e

// End-to-end tests of the tls and auth sections: TLS and mutual TLS on the
// REST, gRPC and metrics listeners, bearer tokens over every surface, admin
// calls from loopback and non-loopback peers, certificate and token
// rotation, and logs that never show a token.

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
)

const (
	e2eInferenceToken = "e2e-inference-3f9a1c7d52e84b06"
	e2eAdminToken     = "e2e-admin-8b2d4e6f0a1c3e5f7a9b"
	e2eWrongToken     = "e2e-wrong-0000111122223333"
)

// testCA is a throwaway certificate authority.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t *testing.T, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          randomSerial(t),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

func randomSerial(t *testing.T) *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 64))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// issue signs a leaf certificate for name: a server certificate for ips
// (and localhost) when server, else a client certificate. It returns the
// PEM certificate and key, and the serial.
func (ca *testCA) issue(t *testing.T, name string, server bool, ips ...net.IP) (certPEM, keyPEM []byte, serial *big.Int) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: randomSerial(t),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = ips
		tmpl.DNSNames = []string{"localhost"}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), tmpl.SerialNumber
}

func (ca *testCA) clientCert(t *testing.T, name string) tls.Certificate {
	t.Helper()
	certPEM, keyPEM, _ := ca.issue(t, name, false)
	c, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// writeAtomic writes a file beside path and renames it over path, as a
// deployment renewing certificates or tokens would.
func writeAtomic(t *testing.T, path string, data []byte) {
	t.Helper()
	tmp := path + ".new"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// nonLoopbackIPv4 is an IPv4 address of this host that is not loopback, so
// a connection to it comes from a non-loopback peer address. Without one,
// as root, it adds one on a dummy interface; otherwise the test is skipped
// (failed on project machines, SLOSERVE_REQUIRE_CGROUPS=1).
func nonLoopbackIPv4(t *testing.T) net.IP {
	t.Helper()
	if ip := firstNonLoopbackIPv4(); ip != nil {
		return ip
	}
	if os.Geteuid() == 0 {
		const link, addr = "sloservetest0", "192.0.2.222"
		for _, args := range [][]string{
			{"link", "add", link, "type", "dummy"},
			{"addr", "add", addr + "/32", "dev", link},
			{"link", "set", link, "up"},
		} {
			if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
				exec.Command("ip", "link", "del", link).Run()
				skipUnless(t, "SLOSERVE_REQUIRE_CGROUPS", fmt.Sprintf("no non-loopback IPv4 address, and `ip %s` failed: %v: %s", strings.Join(args, " "), err, out))
			}
		}
		t.Cleanup(func() { exec.Command("ip", "link", "del", link).Run() })
		return net.ParseIP(addr).To4()
	}
	skipUnless(t, "SLOSERVE_REQUIRE_CGROUPS", "this host has no non-loopback IPv4 address and the test is not root to add one (ip link add sloservetest0 type dummy)")
	return nil
}

func firstNonLoopbackIPv4() net.IP {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		if ip := ipn.IP.To4(); ip != nil && !ip.IsLoopback() && !ip.IsLinkLocalUnicast() {
			return ip
		}
	}
	return nil
}

// at is base (a URL or host:port) with its host replaced by ip.
func at(base string, ip net.IP) string {
	scheme, hostport, ok := strings.Cut(base, "://")
	if !ok {
		hostport, scheme = base, ""
	}
	_, port, _ := net.SplitHostPort(hostport)
	out := net.JoinHostPort(ip.String(), port)
	if scheme != "" {
		out = scheme + "://" + out
	}
	return out
}

// request sends one REST request with client and returns its status, body
// and header, or the transport error.
func request(ctx context.Context, client *http.Client, method, url string, body []byte, header ...string) (int, []byte, http.Header, error) {
	var rd io.Reader
	if body != nil {
		rd = strings.NewReader(string(body))
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		return 0, nil, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, resp.Header, err
}

func withBearer(ctx context.Context, token string) context.Context {
	if token == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
}

// presentedTokens are the four ways a caller can come: no token, a wrong
// one, the inference token and the admin token.
var presentedTokens = []struct{ name, token string }{
	{"none", ""}, {"wrong", e2eWrongToken}, {"inference", e2eInferenceToken}, {"admin", e2eAdminToken},
}

// securedServer starts a server with TLS (client certificates required
// when mtls), both tokens and the models dyn and spare in explicit mode,
// listening on every interface.
type securedServer struct {
	*testServer
	ca, wrongCA        *testCA
	certFile, keyFile  string
	roots              *x509.CertPool
	clientCert         tls.Certificate
	serverIP           net.IP // non-loopback
	inferenceTokenFile string
	caFile             string // the CA of the server's and the clients' certificates
}

func startSecuredServer(t *testing.T) *securedServer {
	t.Helper()
	ip := nonLoopbackIPv4(t)
	dir := t.TempDir()
	ss := &securedServer{ca: newTestCA(t, "sloserve test CA"), wrongCA: newTestCA(t, "some other CA"), serverIP: ip}
	certPEM, keyPEM, _ := ss.ca.issue(t, "sloserve", true, net.ParseIP("127.0.0.1"), ip)
	ss.certFile, ss.keyFile = filepath.Join(dir, "server.crt"), filepath.Join(dir, "server.key")
	caFile := filepath.Join(dir, "clients-ca.crt")
	ss.caFile = caFile
	writeAtomic(t, ss.certFile, certPEM)
	writeAtomic(t, ss.keyFile, keyPEM)
	writeAtomic(t, caFile, ss.ca.pem)
	ss.inferenceTokenFile = filepath.Join(dir, "inference.token")
	adminFile := filepath.Join(dir, "admin.token")
	writeAtomic(t, ss.inferenceTokenFile, []byte(e2eInferenceToken+"\n"))
	writeAtomic(t, adminFile, []byte(e2eAdminToken+"\n"))
	ss.roots = x509.NewCertPool()
	ss.roots.AppendCertsFromPEM(ss.ca.pem)
	ss.clientCert = ss.ca.clientCert(t, "good client")

	repo := t.TempDir()
	dyn := testModel(t, "example_dynamic_axes.onnx")
	// dyn is latency-critical: a best-effort runner sits in the idle class
	// and gets no CPU while anything else on a busy machine wants it (the
	// loadtest subtest's requests then fail or time out), which is not what
	// this test is about.
	writeRepo(t, repo, repoModel{"dyn", dyn, "max_batch_size: 8\nslo: {latency_ms: 1000, class: latency-critical}\n"},
		repoModel{"spare", dyn, "max_batch_size: 8\n"})
	extra := fmt.Sprintf(`model_control: explicit
startup_models: ["*"]
tls: {cert_file: %q, key_file: %q, client_ca_file: %q, metrics: true}
auth: {inference_token_file: %q, admin_token_file: %q}
`, ss.certFile, ss.keyFile, caFile, ss.inferenceTokenFile, adminFile)
	ss.testServer = startServer(t, repo, extra,
		func(s *serverSetup) {
			s.listenHost = "0.0.0.0"
			s.tls = &tls.Config{RootCAs: ss.roots, Certificates: []tls.Certificate{ss.clientCert}}
			s.metricsTLS = true
		})
	return ss
}

// tlsConfig trusts the test CA and presents the first of certs, if any,
// whichever CAs the server asks for (as a misconfigured client would).
func (ss *securedServer) tlsConfig(certs ...tls.Certificate) *tls.Config {
	cfg := &tls.Config{RootCAs: ss.roots}
	if len(certs) > 0 {
		cert := certs[0]
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }
	}
	return cfg
}

// client is an HTTP client that trusts the test CA and presents certs.
func (ss *securedServer) client(t *testing.T, certs ...tls.Certificate) *http.Client {
	c := &http.Client{Transport: &http.Transport{
		TLSClientConfig:   ss.tlsConfig(certs...),
		ForceAttemptHTTP2: true,
		DisableKeepAlives: true,
	}, Timeout: 30 * time.Second}
	t.Cleanup(c.CloseIdleConnections)
	return c
}

// TestE2ESecurityTLS: REST, gRPC and metrics over TLS with client
// certificates required; plain connections and clients without a good
// certificate refused at the handshake; the token table over REST and
// gRPC; refusals counted; no token in the logs; a renewed certificate used
// without a restart.
func TestE2ESecurityTLS(t *testing.T) {
	ss := startSecuredServer(t)
	ctx := t.Context()

	t.Run("REST and gRPC over TLS", func(t *testing.T) {
		c := ss.client(t, ss.clientCert)
		req, _ := http.NewRequestWithContext(ctx, "POST", ss.http+"/v2/models/dyn/infer", strings.NewReader(string(dynBody)))
		req.Header.Set("Authorization", "Bearer "+e2eInferenceToken)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.TLS == nil || resp.Proto != "HTTP/2.0" || resp.TLS.Version != tls.VersionTLS13 {
			t.Fatalf("%d %s over %s, TLS %+v", resp.StatusCode, body, resp.Proto, resp.TLS)
		}
		var out struct {
			Outputs []struct {
				Name string    `json:"name"`
				Data []float64 `json:"data"`
			} `json:"outputs"`
		}
		if err := json.Unmarshal(body, &out); err != nil || len(out.Outputs) != 1 || len(out.Outputs[0].Data) != 1 || out.Outputs[0].Data[0] != 55 {
			t.Fatalf("infer answered %s", body)
		}

		res, err := ss.grpc.ModelInfer(withBearer(ctx, e2eInferenceToken), &inference.ModelInferRequest{
			ModelName: "dyn",
			Inputs: []*inference.ModelInferRequest_InferInputTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{1, 10},
				Contents: &inference.InferTensorContents{Fp32Contents: []float32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}}}},
		})
		if err != nil || len(res.RawOutputContents) != 1 || len(res.RawOutputContents[0]) != 4 {
			t.Fatalf("gRPC infer over TLS: %v %v", res, err)
		}
		// The metrics listener speaks TLS too (tls.metrics) and stays open.
		if _, ok := ss.metricValue(t, `sloserve_auth_failures_total{protocol="rest",reason="missing",surface="admin"}`); !ok {
			t.Error("no auth failure series on the metrics listener")
		}
	})

	t.Run("plain connections to TLS ports", func(t *testing.T) {
		code, body, _, err := request(ctx, http.DefaultClient, "GET", strings.Replace(ss.http, "https://", "http://", 1)+"/v2/health/live", nil)
		if err != nil || code != 400 || !strings.Contains(string(body), "Client sent an HTTP request to an HTTPS server") {
			t.Errorf("plain HTTP to the REST port: %d %q %v; want 400 from the TLS layer", code, body, err)
		}
		// The failed handshake is logged through the server's logger, at
		// debug, not printed raw to stderr.
		waitFor(t, "the failed handshake in the log", 5*time.Second, func() bool {
			return ss.logHas("level=DEBUG", "TLS handshake error", "component=rest")
		})
		code, body, _, err = request(ctx, http.DefaultClient, "GET", strings.Replace(ss.metrics, "https://", "http://", 1)+"/metrics", nil)
		if err != nil || code != 400 || strings.Contains(string(body), "sloserve_") {
			t.Errorf("plain HTTP to the metrics port: %d %v; want 400 from the TLS layer", code, err)
		}
		conn, err := grpc.NewClient(ss.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		_, err = inference.NewGRPCInferenceServiceClient(conn).ServerLive(cctx, &inference.ServerLiveRequest{})
		if code := status.Code(err); code != codes.Unavailable && code != codes.DeadlineExceeded {
			t.Errorf("insecure gRPC to the TLS port: %v, want UNAVAILABLE", err)
		}
	})

	t.Run("client certificates", func(t *testing.T) {
		for _, c := range []struct {
			name  string
			certs []tls.Certificate
			want  string // in the client's error; "" for success
		}{
			{"none", nil, "certificate required"},
			{"from another CA", []tls.Certificate{ss.wrongCA.clientCert(t, "stranger")}, "unknown certificate authority"},
			{"from the client CA", []tls.Certificate{ss.clientCert}, ""},
		} {
			t.Run(c.name, func(t *testing.T) {
				code, body, _, err := request(ctx, ss.client(t, c.certs...), "GET", ss.http+"/v2/health/live", nil)
				if (c.want == "") != (err == nil && code == 200) {
					t.Errorf("REST: %d %s %v", code, body, err)
				}
				// The server's verdict is the TLS alert it sends: in TLS
				// 1.3 the client sees it on its first read.
				tc, err := tls.Dial("tcp", strings.TrimPrefix(ss.http, "https://"), ss.tlsConfig(c.certs...))
				if err != nil {
					t.Fatal(err)
				}
				tc.SetDeadline(time.Now().Add(5 * time.Second))
				_, err = tc.Write([]byte("GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
				if err == nil {
					_, err = io.ReadAll(tc)
				}
				tc.Close()
				switch {
				case c.want == "" && err != nil:
					t.Errorf("TLS: %v", err)
				case c.want != "" && (err == nil || !strings.Contains(err.Error(), "remote error: tls: "+c.want)):
					t.Errorf("TLS: %v; want the alert %q", err, c.want)
				}
				conn, err := grpc.NewClient(ss.grpcAddr, grpc.WithTransportCredentials(credentials.NewTLS(ss.tlsConfig(c.certs...))))
				if err != nil {
					t.Fatal(err)
				}
				defer conn.Close()
				cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				defer cancel()
				_, err = grpc_health_v1.NewHealthClient(conn).Check(cctx, &grpc_health_v1.HealthCheckRequest{})
				if want := map[bool]codes.Code{true: codes.OK, false: codes.Unavailable}[c.want == ""]; status.Code(err) != want {
					t.Errorf("gRPC: %v, want %v", err, want)
				}
			})
		}
	})

	// The REST table, from the non-loopback address: with an admin token
	// configured, admin calls work from the network with it.
	t.Run("REST tokens", func(t *testing.T) {
		c := ss.client(t, ss.clientCert)
		base := at(ss.http, ss.serverIP)
		cases := []struct {
			method, path string
			body         []byte
			want         [4]int // none, wrong, inference, admin
		}{
			{"GET", "/v2/health/live", nil, [4]int{200, 200, 200, 200}},
			{"GET", "/v2/health/ready", nil, [4]int{200, 200, 200, 200}},
			{"GET", "/v2/models/dyn/ready", nil, [4]int{200, 200, 200, 200}},
			{"GET", "/dashboard/", nil, [4]int{200, 200, 200, 200}},
			{"GET", "/v2", nil, [4]int{401, 401, 200, 200}},
			{"GET", "/v2/models/dyn", nil, [4]int{401, 401, 200, 200}},
			{"POST", "/v2/models/dyn/infer", dynBody, [4]int{401, 401, 200, 200}},
			{"GET", "/v2/models/dyn/stats", nil, [4]int{401, 401, 200, 200}},
			{"POST", "/v2/repository/index", nil, [4]int{401, 401, 200, 200}},
			{"GET", "/v2/control", nil, [4]int{401, 401, 200, 200}},
			{"GET", "/v2/dashboard", nil, [4]int{401, 401, 200, 200}},
			{"GET", "/v2/no-such-route", nil, [4]int{401, 401, 404, 404}},
			{"PUT", "/v2/models/dyn/share", []byte(`{"compute":0.5}`), [4]int{401, 401, 403, 200}},
			{"DELETE", "/v2/models/dyn/share", nil, [4]int{401, 401, 403, 200}},
			{"POST", "/v2/repository/models/spare/unload", nil, [4]int{401, 401, 403, 200}},
			{"POST", "/v2/repository/models/spare/load", nil, [4]int{401, 401, 403, 200}},
			{"POST", "/v2/config/reload", nil, [4]int{401, 401, 403, 200}},
		}
		for _, tc := range cases {
			for i, p := range presentedTokens {
				var hdr []string
				if p.token != "" {
					hdr = []string{"Authorization", "Bearer " + p.token}
				}
				code, body, h, err := request(ctx, c, tc.method, base+tc.path, tc.body, hdr...)
				if err != nil {
					t.Fatal(err)
				}
				if code != tc.want[i] {
					t.Errorf("%s %s with %s token: %d %s, want %d", tc.method, tc.path, p.name, code, body, tc.want[i])
					continue
				}
				if code == 401 || code == 403 {
					var e map[string]string
					if json.Unmarshal(body, &e) != nil || e["error"] == "" {
						t.Errorf("%s %s: body %s is not {\"error\": ...}", tc.method, tc.path, body)
					}
				}
				if code == 401 && !strings.HasPrefix(h.Get("WWW-Authenticate"), `Bearer realm="sloserve"`) {
					t.Errorf("%s %s: 401 with WWW-Authenticate %q", tc.method, tc.path, h.Get("WWW-Authenticate"))
				}
			}
		}
		series := ss.scrape(t)
		for key, want := range map[string]float64{
			// Eight inference routes, each without a token and with a wrong one.
			`sloserve_auth_failures_total{protocol="rest",reason="missing",surface="inference"}`:        8,
			`sloserve_auth_failures_total{protocol="rest",reason="invalid",surface="inference"}`:        8,
			`sloserve_auth_failures_total{protocol="rest",reason="missing",surface="admin"}`:            5,
			`sloserve_auth_failures_total{protocol="rest",reason="insufficient_scope",surface="admin"}`: 5,
			`sloserve_auth_failures_total{protocol="rest",reason="not_loopback",surface="admin"}`:       0,
			`sloserve_auth_failures_total{protocol="rest",reason="missing",surface="health"}`:           0,
		} {
			if series[key] != want {
				t.Errorf("%s = %v, want %v", key, series[key], want)
			}
		}
	})

	t.Run("gRPC tokens", func(t *testing.T) {
		calls := []struct {
			name string
			call func(context.Context) error
			want [4]codes.Code // none, wrong, inference, admin
		}{
			{"ServerLive", func(ctx context.Context) error {
				_, err := ss.grpc.ServerLive(ctx, &inference.ServerLiveRequest{})
				return err
			}, [4]codes.Code{codes.OK, codes.OK, codes.OK, codes.OK}},
			{"ModelReady", func(ctx context.Context) error {
				_, err := ss.grpc.ModelReady(ctx, &inference.ModelReadyRequest{Name: "dyn"})
				return err
			}, [4]codes.Code{codes.OK, codes.OK, codes.OK, codes.OK}},
			{"ModelMetadata", func(ctx context.Context) error {
				_, err := ss.grpc.ModelMetadata(ctx, &inference.ModelMetadataRequest{Name: "dyn"})
				return err
			}, [4]codes.Code{codes.Unauthenticated, codes.Unauthenticated, codes.OK, codes.OK}},
			{"RepositoryIndex", func(ctx context.Context) error {
				_, err := ss.grpc.RepositoryIndex(ctx, &inference.RepositoryIndexRequest{})
				return err
			}, [4]codes.Code{codes.Unauthenticated, codes.Unauthenticated, codes.OK, codes.OK}},
			{"ModelMetadata of an unknown model", func(ctx context.Context) error {
				_, err := ss.grpc.ModelMetadata(ctx, &inference.ModelMetadataRequest{Name: "nope"})
				return err
			}, [4]codes.Code{codes.Unauthenticated, codes.Unauthenticated, codes.NotFound, codes.NotFound}},
			{"RepositoryModelUnload", func(ctx context.Context) error {
				_, err := ss.grpc.RepositoryModelUnload(ctx, &inference.RepositoryModelUnloadRequest{ModelName: "spare"})
				return err
			}, [4]codes.Code{codes.Unauthenticated, codes.Unauthenticated, codes.PermissionDenied, codes.OK}},
			{"RepositoryModelLoad", func(ctx context.Context) error {
				_, err := ss.grpc.RepositoryModelLoad(ctx, &inference.RepositoryModelLoadRequest{ModelName: "spare"})
				return err
			}, [4]codes.Code{codes.Unauthenticated, codes.Unauthenticated, codes.PermissionDenied, codes.OK}},
		}
		for _, c := range calls {
			for i, p := range presentedTokens {
				if got := status.Code(c.call(withBearer(ctx, p.token))); got != c.want[i] {
					t.Errorf("%s with %s token: %v, want %v", c.name, p.name, got, c.want[i])
				}
			}
		}
		if v, _ := ss.metricValue(t, `sloserve_auth_failures_total{protocol="grpc",reason="insufficient_scope",surface="admin"}`); v != 2 {
			t.Errorf("gRPC insufficient_scope refusals = %v, want 2", v)
		}
	})

	t.Run("loadtest", func(t *testing.T) {
		dir := t.TempDir()
		certPEM, keyPEM, _ := ss.ca.issue(t, "loadtest", false)
		certFile, keyFile := filepath.Join(dir, "client.crt"), filepath.Join(dir, "client.key")
		writeAtomic(t, certFile, certPEM)
		writeAtomic(t, keyFile, keyPEM)
		before := ss.scrape(t)
		out, stdout := runLoadtest(t, `name: secured
duration: 2s
models:
  - {model: dyn, protocol: grpc, rate: {constant: 20}, slo: 1s, inputs: {input_vectors: {shape: [1, 10]}}}
  - {model: dyn, protocol: rest, rate: {constant: 20}, slo: 1s, inputs: {input_vectors: {shape: [1, 10]}}}
`, "--http", at(ss.http, ss.serverIP), "--grpc", ss.grpcAddr, "--warmup", "0s", "--quiet",
			"--token-file", ss.inferenceTokenFile, "--ca-file", ss.caFile, "--cert-file", certFile, "--key-file", keyFile)
		sum := readSummary(t, filepath.Join(out, "summary.json"))
		if len(sum.Models) != 2 {
			t.Fatalf("summary has %d models:\n%s", len(sum.Models), stdout)
		}
		for _, m := range sum.Models {
			if m.Requests < 20 || m.Outcomes["good"] != m.Requests {
				t.Errorf("%s over %s: %d requests, outcomes %v, errors %v; want all good", m.Name, m.Protocol, m.Requests, m.Outcomes, m.Errors)
			}
		}
		after := ss.scrape(t)
		for k, v := range after {
			if strings.HasPrefix(k, "sloserve_auth_failures_total") && v != before[k] {
				t.Errorf("%s went from %v to %v during the loadtest", k, before[k], v)
			}
		}
	})

	t.Run("no token in the logs", func(t *testing.T) {
		log := ss.log.String()
		for _, tok := range []string{e2eInferenceToken, e2eAdminToken, e2eWrongToken, "Bearer"} {
			if strings.Contains(log, tok) {
				t.Errorf("the server log shows %q", tok)
			}
		}
		// The calls above were logged, without their tokens.
		for _, want := range []string{"call refused by access control", "reason=invalid", "reason=insufficient_scope", "admin call"} {
			if !strings.Contains(log, want) {
				t.Errorf("the server log lacks %q", want)
			}
		}
	})

	t.Run("certificate renewed without a restart", func(t *testing.T) {
		certPEM, keyPEM, serial := ss.ca.issue(t, "sloserve renewed", true, net.ParseIP("127.0.0.1"), ss.serverIP)
		writeAtomic(t, ss.keyFile, keyPEM)
		writeAtomic(t, ss.certFile, certPEM)
		var seen *big.Int
		waitFor(t, "the renewed certificate on new connections", 15*time.Second, func() bool {
			conn, err := tls.Dial("tcp", strings.TrimPrefix(ss.http, "https://"), &tls.Config{
				RootCAs: ss.roots, Certificates: []tls.Certificate{ss.clientCert}})
			if err != nil {
				return false
			}
			defer conn.Close()
			seen = conn.ConnectionState().PeerCertificates[0].SerialNumber
			return seen.Cmp(serial) == 0
		})
		// gRPC handshakes get it too.
		conn, err := grpc.NewClient(ss.grpcAddr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
			RootCAs: ss.roots, Certificates: []tls.Certificate{ss.clientCert},
			VerifyPeerCertificate: func(_ [][]byte, chains [][]*x509.Certificate) error {
				if got := chains[0][0].SerialNumber; got.Cmp(serial) != 0 {
					return fmt.Errorf("gRPC served serial %v, want the renewed %v", got, serial)
				}
				return nil
			}})))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if _, err := inference.NewGRPCInferenceServiceClient(conn).ServerLive(ctx, &inference.ServerLiveRequest{}); err != nil {
			t.Error(err)
		}
		if v, _ := ss.metricValue(t, `sloserve_tls_certificate_reloads_total{result="success"}`); v < 1 {
			t.Errorf("certificate reloads = %v, want >= 1", v)
		}
	})
}

// TestE2ESecurityAdminLoopback: with no admin token, admin calls are
// refused from a non-loopback peer and allowed from loopback (with the
// inference token, which is configured); health and metrics closed by
// configuration; the inference token rotated by a config reload.
func TestE2ESecurityAdminLoopback(t *testing.T) {
	ip := nonLoopbackIPv4(t)
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "inference.token")
	writeAtomic(t, tokenFile, []byte(e2eInferenceToken+"\n"))
	repo := t.TempDir()
	dyn := testModel(t, "example_dynamic_axes.onnx")
	writeRepo(t, repo, repoModel{"dyn", dyn, "max_batch_size: 8\n"}, repoModel{"spare", dyn, "max_batch_size: 8\n"})
	extra := fmt.Sprintf(`model_control: explicit
startup_models: ["*"]
auth: {inference_token_file: %q, require_token_for_health: true, require_token_for_metrics: true}
`, tokenFile)
	s := startServer(t, repo, extra, func(s *serverSetup) {
		s.listenHost = "0.0.0.0"
		s.readyHeader = []string{"Authorization", "Bearer " + e2eInferenceToken}
	})
	ctx := t.Context()
	remote := at(s.http, ip)
	bearerInf := []string{"Authorization", "Bearer " + e2eInferenceToken}

	t.Run("REST", func(t *testing.T) {
		for _, c := range []struct {
			base, method, path string
			header             []string
			want               int
			in                 string
		}{
			{remote, "POST", "/v2/repository/models/spare/unload", bearerInf, 403, "set auth.admin_token_file"},
			{remote, "POST", "/v2/config/reload", bearerInf, 403, "admin calls are refused from non-loopback addresses"},
			{remote, "PUT", "/v2/models/dyn/share", bearerInf, 403, "set auth.admin_token_file"},
			{remote, "POST", "/v2/repository/models/spare/unload", []string{"X-Forwarded-For", "127.0.0.1", "Authorization", "Bearer " + e2eInferenceToken}, 403, ""},
			{s.http, "POST", "/v2/repository/models/spare/unload", nil, 401, "bearer token"},
			{s.http, "POST", "/v2/repository/models/spare/unload", bearerInf, 200, ""},
			{s.http, "POST", "/v2/repository/models/spare/load", bearerInf, 200, ""},
			{remote, "POST", "/v2/models/dyn/infer", bearerInf, 200, ""},
			{remote, "GET", "/v2/health/ready", nil, 401, ""},
			{remote, "GET", "/v2/health/ready", bearerInf, 200, ""},
		} {
			var body []byte
			if strings.HasSuffix(c.path, "/infer") {
				body = dynBody
			}
			if strings.HasSuffix(c.path, "/share") {
				body = []byte(`{"compute":0.5}`)
			}
			code, b, _, err := request(ctx, http.DefaultClient, c.method, c.base+c.path, body, c.header...)
			if err != nil {
				t.Fatal(err)
			}
			if code != c.want || !strings.Contains(string(b), c.in) {
				t.Errorf("%s %s%s: %d %s, want %d with %q", c.method, c.base, c.path, code, b, c.want, c.in)
			}
		}
		if v, _ := s.metricValueWith(t, `sloserve_auth_failures_total{protocol="rest",reason="not_loopback",surface="admin"}`, bearerInf); v != 4 {
			t.Errorf("not_loopback refusals = %v, want 4", v)
		}
	})

	t.Run("gRPC", func(t *testing.T) {
		conn, err := grpc.NewClient(at(s.grpcAddr, ip), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		remoteClient := inference.NewGRPCInferenceServiceClient(conn)
		authed := withBearer(ctx, e2eInferenceToken)
		_, err = remoteClient.RepositoryModelUnload(authed, &inference.RepositoryModelUnloadRequest{ModelName: "spare"})
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "auth.admin_token_file") {
			t.Errorf("unload from %s: %v, want PERMISSION_DENIED saying how to enable", ip, err)
		}
		if _, err := remoteClient.ModelMetadata(authed, &inference.ModelMetadataRequest{Name: "dyn"}); err != nil {
			t.Errorf("metadata from %s: %v", ip, err)
		}
		if _, err := remoteClient.ServerReady(ctx, &inference.ServerReadyRequest{}); status.Code(err) != codes.Unauthenticated {
			t.Errorf("ServerReady without a token, health closed: %v, want UNAUTHENTICATED", err)
		}
		if _, err := s.grpc.RepositoryModelUnload(authed, &inference.RepositoryModelUnloadRequest{ModelName: "spare"}); err != nil {
			t.Errorf("unload from loopback: %v", err)
		}
		if _, err := s.grpc.RepositoryModelLoad(authed, &inference.RepositoryModelLoadRequest{ModelName: "spare"}); err != nil {
			t.Errorf("load from loopback: %v", err)
		}
	})

	t.Run("metrics closed", func(t *testing.T) {
		code, _, h, err := request(ctx, http.DefaultClient, "GET", s.metrics+"/metrics", nil)
		if err != nil || code != 401 || h.Get("WWW-Authenticate") != `Bearer realm="sloserve"` {
			t.Errorf("metrics without a token: %d %v %v", code, h, err)
		}
		code, _, _, err = request(ctx, http.DefaultClient, "GET", s.metrics+"/metrics", nil, "Authorization", "Bearer "+e2eWrongToken)
		if err != nil || code != 401 {
			t.Errorf("metrics with a wrong token: %d %v", code, err)
		}
	})

	t.Run("token rotated by a reload", func(t *testing.T) {
		const next = "e2e-rotated-5555666677778888"
		writeAtomic(t, tokenFile, []byte(next+"\n"))
		code, b, _, err := request(ctx, http.DefaultClient, "POST", s.http+"/v2/config/reload", nil, bearerInf...)
		if err != nil || code != 200 {
			t.Fatalf("reload: %d %s %v", code, b, err)
		}
		for tok, want := range map[string]int{e2eInferenceToken: 401, next: 200} {
			code, b, _, err := request(ctx, http.DefaultClient, "GET", remote+"/v2", nil, "Authorization", "Bearer "+tok)
			if err != nil || code != want {
				t.Errorf("after the reload, GET /v2: %d %s %v; want %d", code, b, err, want)
			}
		}
		if strings.Contains(s.log.String(), next) || strings.Contains(s.log.String(), e2eInferenceToken) {
			t.Error("the server log shows a token")
		}
	})
}

// metricValueWith scrapes the metrics listener with request headers (a
// token when require_token_for_metrics is set).
func (s *testServer) metricValueWith(t *testing.T, series string, header []string) (float64, bool) {
	t.Helper()
	code, body, _, err := request(t.Context(), s.client, "GET", s.metrics+"/metrics", nil, header...)
	if err != nil || code != 200 {
		t.Fatalf("scrape: %d %v", code, err)
	}
	for line := range strings.SplitSeq(string(body), "\n") {
		if name, value, ok := strings.Cut(line, " "); ok && name == series {
			var v float64
			_, err := fmt.Sscan(value, &v)
			return v, err == nil
		}
	}
	return 0, false
}

// TestE2EDashboardToken: with an inference token configured, the dashboard
// page loads, asks for the token, refuses a wrong one, works with the right
// one, and never puts the token in a URL.
func TestE2EDashboardToken(t *testing.T) {
	requireChromium(t)
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "inference.token")
	writeAtomic(t, tokenFile, []byte(e2eInferenceToken+"\n"))
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
	s := startServer(t, repo, fmt.Sprintf("auth: {inference_token_file: %q}\n", tokenFile))
	b := newBrowser(t, s.http, 1280, 800)
	b.do(t, chromedp.Navigate(s.http+"/dashboard/"))
	b.waitJS(t, "the token form", 20*time.Second, `document.getElementById('token-form')`)
	if n := len(b.exceptionsNow()); n != 0 {
		t.Fatalf("the page threw: %v", b.exceptionsNow())
	}
	submit := func(token string) {
		var ok bool
		b.eval(t, fmt.Sprintf(`(() => { document.getElementById('token-input').value = %q;
			document.getElementById('token-form').requestSubmit(); return true; })()`, token), &ok)
	}
	submit(e2eWrongToken)
	b.waitJS(t, "the form again, saying the token was refused", 20*time.Second,
		`(document.querySelector('#token-form .token-message') || {}).textContent?.includes('The token was not accepted')`)
	submit(e2eInferenceToken)
	b.waitJS(t, "the overview with the model", 20*time.Second,
		`document.querySelector('tr[data-model="dyn"]') && !document.getElementById('token-form')`)
	b.checkNetwork(t)
	b.mu.Lock()
	requests := append([]string(nil), b.requests...)
	b.mu.Unlock()
	for _, u := range requests {
		if strings.Contains(u, e2eInferenceToken) || strings.Contains(u, e2eWrongToken) {
			t.Errorf("the page put a token in a URL: %s", u)
		}
	}
	if strings.Contains(s.log.String(), e2eInferenceToken) || strings.Contains(s.log.String(), e2eWrongToken) {
		t.Error("the server log shows a token")
	}
	if v, _ := s.metricValue(t, `sloserve_auth_failures_total{protocol="rest",reason="invalid",surface="inference"}`); v < 1 {
		t.Errorf("the wrong token was not counted: %v", v)
	}
}

func (b *browserTab) exceptionsNow() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.exceptions...)
}

// TestE2EAdminFromBrowsers replays the probe of issue 15 against the
// default access control (no tokens: admin calls trusted from loopback): a
// web page's cross-site unload, a DNS-rebound one and a page's text/plain
// one are refused with {"error": ...}, and the same call from curl still works.
func TestE2EAdminFromBrowsers(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
	s := startServer(t, repo, "model_control: explicit\nstartup_models: [\"*\"]\n")
	const unload = "/v2/repository/models/dyn/unload"
	for _, c := range []struct {
		name   string
		body   []byte
		header []string
		want   int
		in     string
	}{
		{"evil page", []byte("x"), []string{"Origin", "http://evil.example", "Content-Type", "text/plain"}, 403, "another origin"},
		{"rebound name", nil, []string{"Host", "evil.example:8000"}, 403, "auth.allowed_hosts"},
		{"a page's text/plain", []byte("x"), []string{"Content-Type", "text/plain", "Sec-Fetch-Site", "same-origin", "Sec-Fetch-Mode", "no-cors"}, 415, "application/json"},
	} {
		code, b, _ := s.do(t, "POST", unload, c.body, c.header...)
		var e struct{ Error string }
		if code != c.want || json.Unmarshal(b, &e) != nil || !strings.Contains(e.Error, c.in) {
			t.Errorf("%s: %d %s, want %d with an error naming %q", c.name, code, b, c.want, c.in)
		}
	}
	if code, b, _ := s.do(t, "GET", "/v2/models/dyn/ready", nil); code != 200 {
		t.Fatalf("dyn not ready after the refused unloads: %d %s", code, b)
	}
	if code, b, _ := s.do(t, "POST", unload, nil); code != 200 {
		t.Errorf("unload as curl sends it: %d %s", code, b)
	}
}
