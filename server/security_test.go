package server

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sloserve/sloserve/configs"
)

// issueCert signs a certificate for CN name with parent (self-signed CA
// when parent is nil) and returns it with its key, PEM-encoded.
func issueCert(t *testing.T, name string, serial int64, parent *tls.Certificate) (certPEM, keyPEM []byte, cert tls.Certificate) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
	}
	signer, signerKey := tmpl, any(key)
	if parent == nil {
		tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
	} else {
		signer, signerKey = parent.Leaf, parent.PrivateKey
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, &key.PublicKey, signerKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM = pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	if cert, err = tls.X509KeyPair(certPEM, keyPEM); err != nil {
		t.Fatal(err)
	}
	return certPEM, keyPEM, cert
}

func writeBytes(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// serveTLS accepts connections on a loopback listener with cfg and
// answers each with "ok" once the handshake is done.
func serveTLS(t *testing.T, cfg *tls.Config) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	tln := tls.NewListener(ln, cfg)
	go func() {
		for {
			c, err := tln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				c.SetDeadline(time.Now().Add(5 * time.Second))
				if c.(*tls.Conn).Handshake() == nil {
					_, _ = c.Write([]byte("ok"))
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// dial connects and reads the server's answer; it returns the serial of
// the server's certificate and the error of the exchange.
func dial(addr string, roots *x509.CertPool, cert *tls.Certificate) (int64, error) {
	cfg := &tls.Config{RootCAs: roots}
	if cert != nil {
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert, nil }
	}
	c, err := tls.Dial("tcp", addr, cfg)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	b, err := io.ReadAll(c)
	if err == nil && string(b) != "ok" {
		err = io.ErrUnexpectedEOF
	}
	return c.ConnectionState().PeerCertificates[0].SerialNumber.Int64(), err
}

// TestCertFiles checks client authentication in request mode and that
// changed files are read again: a pair that does not load leaves the
// previous one serving and is counted, a good one replaces it.
func TestCertFiles(t *testing.T) {
	dir := t.TempDir()
	caPEM, _, ca := issueCert(t, "ca", 1, nil)
	_, _, otherCA := issueCert(t, "other ca", 2, nil)
	certPEM, keyPEM, server := issueCert(t, "server", 10, &ca)
	_, _, client := issueCert(t, "client", 20, &ca)
	_, _, stranger := issueCert(t, "stranger", 21, &otherCA)
	cfg := configs.TLS{
		CertFile: filepath.Join(dir, "tls.crt"), KeyFile: filepath.Join(dir, "tls.key"),
		ClientCAFile: filepath.Join(dir, "ca.crt"), ClientAuth: configs.ClientAuthRequest, MinVersion: configs.TLSVersion12,
	}
	writeBytes(t, cfg.CertFile, certPEM)
	writeBytes(t, cfg.KeyFile, keyPEM)
	writeBytes(t, cfg.ClientCAFile, caPEM)
	reg := prometheus.NewRegistry()
	f, err := newCertFiles(cfg, reg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	// The serving certificate's expiry, not its CA's: the two are issued
	// an hour ahead of their own issue, and on a busy machine a second
	// may pass between them.
	if got := testutil.ToFloat64(f.expiry); got != float64(server.Leaf.NotAfter.Unix()) {
		t.Errorf("expiry gauge %v, want %v", got, server.Leaf.NotAfter.Unix())
	}
	f.every = time.Hour // only recheck makes it look
	addr := serveTLS(t, f.serverConfig("h2"))
	roots := x509.NewCertPool()
	roots.AddCert(ca.Leaf)

	for _, c := range []struct {
		name string
		cert *tls.Certificate
		err  string
	}{
		{"no certificate", nil, ""},
		{"from the client CA", &client, ""},
		{"from another CA", &stranger, "unknown certificate authority"},
	} {
		serial, err := dial(addr, roots, c.cert)
		if c.err == "" && (err != nil || serial != 10) {
			t.Errorf("request mode, %s: serial %d, %v", c.name, serial, err)
		}
		if c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)) {
			t.Errorf("request mode, %s: %v, want %q", c.name, err, c.err)
		}
	}

	// A broken certificate: the previous one keeps serving.
	writeBytes(t, cfg.CertFile, []byte("-----BEGIN CERTIFICATE-----\nbroken\n-----END CERTIFICATE-----\n"))
	f.recheck()
	if serial, err := dial(addr, roots, nil); err != nil || serial != 10 {
		t.Errorf("after a broken write: serial %d, %v; want the previous certificate", serial, err)
	}
	if got := testutil.ToFloat64(f.loads.WithLabelValues("failure")); got != 1 {
		t.Errorf("failed reloads %v, want 1", got)
	}
	// Until the next check the files are not looked at again.
	newCert, newKey, _ := issueCert(t, "server renewed", 11, &ca)
	writeBytes(t, cfg.KeyFile, newKey)
	writeBytes(t, cfg.CertFile, newCert)
	if serial, _ := dial(addr, roots, nil); serial != 10 {
		t.Errorf("before the next check: serial %d, want 10", serial)
	}
	f.recheck()
	if serial, err := dial(addr, roots, nil); err != nil || serial != 11 {
		t.Errorf("after the renewal: serial %d, %v; want 11", serial, err)
	}
	if got := testutil.ToFloat64(f.loads.WithLabelValues("success")); got != 1 {
		t.Errorf("successful reloads %v, want 1", got)
	}
}
