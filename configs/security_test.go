package configs

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"log/slog"
	"math/big"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"
)

// writeSelfSigned writes a self-signed ECDSA certificate and its key into
// dir as name.crt and name.key and returns their paths.
func writeSelfSigned(t *testing.T, dir, name string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
	writeFile(t, certFile, string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})))
	writeFile(t, keyFile, string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})))
	return certFile, keyFile
}

func TestSecurityConfig(t *testing.T) {
	dir := t.TempDir()
	cert, key := writeSelfSigned(t, dir, "server")
	otherCert, otherKey := writeSelfSigned(t, dir, "other")
	notPEM := filepath.Join(dir, "not.pem")
	writeFile(t, notPEM, "just text\n")
	const infTok, admTok = "inference-0123456789abcdef", "admin-0123456789abcdef"
	infFile, admFile := filepath.Join(dir, "inference"), filepath.Join(dir, "admin")
	writeFile(t, infFile, "  "+infTok+"\n")
	writeFile(t, admFile, admTok+"\n")
	spaced := filepath.Join(dir, "spaced")
	writeFile(t, spaced, "two words and more than sixteen\n")

	good := []struct {
		name, yaml       string
		clientAuth       string
		min              uint16
		inference, admin string
	}{
		{name: "tls", yaml: fmt.Sprintf("tls: {cert_file: %q, key_file: %q}", cert, key),
			clientAuth: ClientAuthNone, min: tls.VersionTLS12},
		{name: "mtls default require", yaml: fmt.Sprintf("tls: {cert_file: %q, key_file: %q, client_ca_file: %q, min_version: '1.3'}", cert, key, otherCert),
			clientAuth: ClientAuthRequire, min: tls.VersionTLS13},
		{name: "mtls request", yaml: fmt.Sprintf("tls: {cert_file: %q, key_file: %q, client_ca_file: %q, client_auth: request}", cert, key, otherCert),
			clientAuth: ClientAuthRequest, min: tls.VersionTLS12},
		{name: "token files", yaml: fmt.Sprintf("auth: {inference_token_file: %q, admin_token_file: %q, require_token_for_health: true}", infFile, admFile),
			clientAuth: ClientAuthNone, min: tls.VersionTLS12, inference: infTok, admin: admTok},
		{name: "token values", yaml: fmt.Sprintf("auth: {admin_token: %q}", admTok),
			clientAuth: ClientAuthNone, min: tls.VersionTLS12, admin: admTok},
	}
	for _, c := range good {
		t.Run(c.name, func(t *testing.T) {
			s, err := ParseServer("s.yaml", []byte(c.yaml))
			if err != nil {
				t.Fatal(err)
			}
			if got := s.TLS.ClientAuthMode(); got != c.clientAuth {
				t.Errorf("ClientAuthMode = %q, want %q", got, c.clientAuth)
			}
			if got := s.TLS.MinTLSVersion(); got != c.min {
				t.Errorf("MinTLSVersion = %x, want %x", got, c.min)
			}
			inf, adm, err := s.Auth.Tokens()
			if err != nil || inf != c.inference || adm != c.admin {
				t.Errorf("Tokens = %q, %q, %v; want %q, %q", inf, adm, err, c.inference, c.admin)
			}
		})
	}

	bad := []struct{ name, yaml, want string }{
		{"key of another cert", fmt.Sprintf("tls: {cert_file: %q, key_file: %q}", cert, otherKey),
			"s.yaml: tls.cert_file: " + cert + " and " + otherKey + ": tls: private key does not match public key (line 1)"},
		{"key unreadable", fmt.Sprintf("tls: {cert_file: %q, key_file: %q}", cert, filepath.Join(dir, "nope.key")),
			"tls.cert_file: cannot read the key (tls.key_file): open " + filepath.Join(dir, "nope.key") + ": no such file or directory"},
		{"cert not PEM", fmt.Sprintf("tls: {cert_file: %q, key_file: %q}", notPEM, key),
			"tls.cert_file: " + notPEM + " and " + key + ": tls: failed to find any PEM data in certificate input"},
		{"ca not PEM", fmt.Sprintf("tls: {cert_file: %q, key_file: %q, client_ca_file: %q}", cert, key, notPEM),
			"tls.client_ca_file: " + notPEM + " holds no PEM certificate"},
		{"ca with none", fmt.Sprintf("tls: {cert_file: %q, key_file: %q, client_ca_file: %q, client_auth: none}", cert, key, otherCert),
			"tls.client_auth: is none, so tls.client_ca_file would not be used; remove one of them"},
		{"require without ca", fmt.Sprintf("tls: {cert_file: %q, key_file: %q, client_auth: require}", cert, key),
			"tls.client_ca_file: required when tls.client_auth is require"},
		{"same token", fmt.Sprintf("auth: {inference_token_file: %q, admin_token_file: %q}", infFile, infFile),
			"auth.admin_token_file: the admin token must differ from the inference token"},
		{"space in token", fmt.Sprintf("auth: {inference_token_file: %q}", spaced),
			"auth.inference_token_file: the token must be printable ASCII without spaces"},
		{"token from a device", "auth: {inference_token_file: /dev/zero}",
			"auth.inference_token_file: cannot read the token: /dev/zero is not a regular file"},
		{"cert is a folder", fmt.Sprintf("tls: {cert_file: %q, key_file: %q}", dir, key),
			"tls.cert_file: cannot read the certificate: " + dir + " is not a regular file"},
		{"short value", "auth: {admin_token: tooshort}",
			"auth.admin_token: the token has 8 characters; use at least 16"},
	}
	for _, c := range bad {
		t.Run(c.name, func(t *testing.T) {
			s, err := ParseServer("s.yaml", []byte(c.yaml))
			if err == nil {
				t.Fatalf("no error; config %+v", s)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error lacks %q; got:\n%v", c.want, err)
			}
			for _, secret := range []string{infTok, "tooshort", "two words"} {
				if strings.Contains(err.Error(), secret) {
					t.Errorf("error shows the token %q: %v", secret, err)
				}
			}
		})
	}

	t.Run("env and set", func(t *testing.T) {
		s := DefaultServer()
		if err := s.ApplyEnv([]string{"SLOSERVE_AUTH_ADMIN_TOKEN=" + admTok, "SLOSERVE_TLS_CERT_FILE=" + cert, "SLOSERVE_TLS_KEY_FILE=" + key}); err != nil {
			t.Fatal(err)
		}
		if err := s.Set("auth.inference_token_file", infFile); err != nil {
			t.Fatal(err)
		}
		if err := s.Validate(); err != nil {
			t.Fatal(err)
		}
		if inf, adm, err := s.Auth.Tokens(); err != nil || inf != infTok || adm != admTok || !s.TLS.Enabled() {
			t.Errorf("Tokens = %q, %q, %v; TLS %+v", inf, adm, err, s.TLS)
		}
		if err := s.Set("auth.inference_token", "short"); err != nil {
			t.Fatal(err)
		}
		err := s.Validate()
		if want := "auth.inference_token: set either auth.inference_token_file or auth.inference_token, not both (set by override)"; err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate = %v, want %q", err, want)
		}
	})
}

// TestSecretNotShown checks that a token given as a value does not come
// out of the config by printing, logging or marshalling it.
func TestSecretNotShown(t *testing.T) {
	const token = "do-not-show-0123456789"
	s := DefaultServer()
	s.Auth.AdminToken = token
	var out bytes.Buffer
	fmt.Fprintf(&out, "%v %+v %#v %s\n", s, s, s, s.Auth.AdminToken)
	slog.New(slog.NewTextHandler(&out, nil)).Info("config", "auth", s.Auth, "token", s.Auth.AdminToken)
	slog.New(slog.NewJSONHandler(&out, nil)).Info("config", "token", s.Auth.AdminToken)
	y, err := yaml.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	j, err := json.Marshal(s.Auth)
	if err != nil {
		t.Fatal(err)
	}
	out.Write(y)
	out.Write(j)
	if strings.Contains(out.String(), token) {
		t.Errorf("the token shows in:\n%s", out.String())
	}
	if !strings.Contains(out.String(), "[redacted]") {
		t.Errorf("no [redacted] in:\n%s", out.String())
	}
	if got := Secret("").String(); got != "" {
		t.Errorf("empty Secret prints %q", got)
	}
}
