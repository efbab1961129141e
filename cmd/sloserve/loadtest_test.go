package main

// Unit tests of the command line: how loadtest's flags become client
// options. The end-to-end tests of the built binary live in package e2e.

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sloserve/sloserve/loadtest"
)

// TestLoadtestClientSecurity checks how the loadtest flags become client
// options, without a server.
func TestLoadtestClientSecurity(t *testing.T) {
	dir := t.TempDir()
	tokenFile, emptyFile := filepath.Join(dir, "token"), filepath.Join(dir, "empty")
	writeTestFile(t, tokenFile, []byte(" file-token-0123456789\n"))
	writeTestFile(t, emptyFile, []byte("\n"))
	caPEM, certPEM, keyPEM := caAndClientCert(t)
	caFile := filepath.Join(dir, "ca.crt")
	writeTestFile(t, caFile, caPEM)
	certFile, keyFile := filepath.Join(dir, "c.crt"), filepath.Join(dir, "c.key")
	writeTestFile(t, certFile, certPEM)
	writeTestFile(t, keyFile, keyPEM)
	env := func(v string) func(string) string {
		return func(name string) string {
			if name == tokenEnv {
				return v
			}
			return ""
		}
	}
	for _, c := range []struct {
		name    string
		sec     clientSecurity
		base    string
		env     string
		token   string
		tls     bool
		certs   int
		wantErr string
	}{
		{name: "plain, no token", base: "http://h:1"},
		{name: "token from the environment", base: "http://h:1", env: "env-token", token: "env-token"},
		{name: "file wins over the environment", sec: clientSecurity{tokenFile: tokenFile}, base: "http://h:1", env: "env-token", token: "file-token-0123456789"},
		{name: "empty token file", sec: clientSecurity{tokenFile: emptyFile}, base: "http://h:1", wantErr: "--token-file: " + emptyFile + " is empty"},
		{name: "https with system roots", base: "https://h:1", tls: true},
		{name: "mutual TLS", sec: clientSecurity{caFile: caFile, certFile: certFile, keyFile: keyFile}, base: "https://h:1", tls: true, certs: 1},
		{name: "cert without key", sec: clientSecurity{certFile: certFile}, base: "https://h:1", wantErr: "--cert-file and --key-file go together"},
		{name: "TLS flags with http", sec: clientSecurity{caFile: caFile}, base: "http://h:1", wantErr: "use https://"},
		{name: "CA file not PEM", sec: clientSecurity{caFile: tokenFile}, base: "https://h:1", wantErr: "--ca-file: " + tokenFile + " holds no PEM certificate"},
	} {
		t.Run(c.name, func(t *testing.T) {
			opts := &loadtest.Options{HTTPBase: c.base}
			err := c.sec.apply(opts, env(c.env))
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("err %v, want %q", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if opts.Token != c.token || (opts.TLS != nil) != c.tls {
				t.Errorf("token %q, TLS %v; want %q, %v", opts.Token, opts.TLS != nil, c.token, c.tls)
			}
			if opts.TLS != nil && (len(opts.TLS.Certificates) != c.certs || (c.sec.caFile != "") != (opts.TLS.RootCAs != nil)) {
				t.Errorf("TLS config %+v", opts.TLS)
			}
		})
	}
}

// caAndClientCert makes a throwaway CA and a client certificate it signed,
// all PEM: the CA certificate, the client certificate and its key.
func caAndClientCert(t *testing.T) (caPEM, certPEM, keyPEM []byte) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	ca := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	if ca, err = x509.ParseCertificate(caDER); err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	leaf := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "client"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, leaf, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
}

func writeTestFile(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}
