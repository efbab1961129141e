package configs

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"strings"
)

// TLS client authentication modes (tls.client_auth).
const (
	ClientAuthNone    = "none"    // no client certificate asked for
	ClientAuthRequest = "request" // verified against client_ca_file when the client sends one
	ClientAuthRequire = "require" // every client must present a certificate from client_ca_file
)

// TLS minimum versions (tls.min_version).
const (
	TLSVersion12 = "1.2"
	TLSVersion13 = "1.3"
)

// MinTokenLength is the least number of characters a bearer token has.
const MinTokenLength = 16

// TLS configures the REST and gRPC listeners (and, with Metrics, the
// metrics listener) to speak TLS. Empty CertFile: plain TCP.
type TLS struct {
	CertFile string `yaml:"cert_file"` // PEM certificate chain, leaf first
	KeyFile  string `yaml:"key_file"`  // PEM private key of the leaf
	// ClientCAFile holds the PEM certificates client certificates are
	// verified against (mutual TLS).
	ClientCAFile string `yaml:"client_ca_file"`
	// ClientAuth is ClientAuthNone, ClientAuthRequest or ClientAuthRequire;
	// "" means require when ClientCAFile is set, else none.
	ClientAuth string `yaml:"client_auth"`
	MinVersion string `yaml:"min_version"` // TLSVersion12 or TLSVersion13
	// Metrics serves the metrics listener over TLS too (same certificate
	// and client authentication).
	Metrics bool `yaml:"metrics"`
}

// Enabled reports whether the listeners speak TLS.
func (t TLS) Enabled() bool { return t.CertFile != "" }

// ClientAuthMode is ClientAuth with the default resolved.
func (t TLS) ClientAuthMode() string {
	switch {
	case t.ClientAuth != "":
		return t.ClientAuth
	case t.ClientCAFile != "":
		return ClientAuthRequire
	default:
		return ClientAuthNone
	}
}

// MinTLSVersion is MinVersion as a crypto/tls constant.
func (t TLS) MinTLSVersion() uint16 {
	if t.MinVersion == TLSVersion13 {
		return tls.VersionTLS13
	}
	return tls.VersionTLS12
}

// Auth configures bearer tokens. A token comes from its file (the file's
// content with surrounding whitespace trimmed) or, for deployments that
// hand secrets over in the environment, from the value itself
// (SLOSERVE_AUTH_ADMIN_TOKEN); not both.
type Auth struct {
	// InferenceTokenFile: when set, every call except health (and the
	// metrics listener) needs this token or the admin token.
	InferenceTokenFile string `yaml:"inference_token_file"`
	// AdminTokenFile: when set, the admin calls (repository load/unload,
	// share pins, config reload) need this token; when no admin token is
	// configured they are refused from peers that are not loopback.
	AdminTokenFile string `yaml:"admin_token_file"`
	InferenceToken Secret `yaml:"inference_token"`
	AdminToken     Secret `yaml:"admin_token"`
	// RequireTokenForHealth and RequireTokenForMetrics close the health
	// endpoints and the metrics listener to callers without a token.
	RequireTokenForHealth  bool `yaml:"require_token_for_health"`
	RequireTokenForMetrics bool `yaml:"require_token_for_metrics"`
	// AllowedHosts are host names, besides localhost, IP addresses and the
	// listen.http host, that the Host header of an admin call may name
	// when no admin token is configured (a defence against DNS rebinding).
	AllowedHosts []string `yaml:"allowed_hosts"`
}

// Secret is a config value that is never shown: printing, logging or
// marshalling it gives "[redacted]" (or "" when it is empty).
type Secret string

const redacted = "[redacted]"

func (s Secret) String() string {
	if s == "" {
		return ""
	}
	return redacted
}

// GoString keeps %#v from showing the value.
func (s Secret) GoString() string { return `configs.Secret("` + s.String() + `")` }

// LogValue keeps slog from showing the value.
func (s Secret) LogValue() slog.Value { return slog.StringValue(s.String()) }

// MarshalYAML keeps a marshalled config from showing the value.
func (s Secret) MarshalYAML() (any, error) { return s.String(), nil }

// MarshalText keeps encoding/json and friends from showing the value.
func (s Secret) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// Tokens reads the inference and admin tokens; "" for one not configured.
// Problems name the key and never include a token.
func (a Auth) Tokens() (inference, admin string, err error) {
	var p problems
	inference, admin = a.tokens(&p)
	if len(p) > 0 {
		return "", "", p.join()
	}
	return inference, admin, nil
}

func (a Auth) tokens(p *problems) (inference, admin string) {
	inference = readToken(p, "auth.inference_token", a.InferenceTokenFile, a.InferenceToken)
	admin = readToken(p, "auth.admin_token", a.AdminTokenFile, a.AdminToken)
	if inference != "" && inference == admin {
		key := "auth.admin_token"
		if a.AdminTokenFile != "" {
			key += "_file"
		}
		p.add(key, "the admin token must differ from the inference token (with one token for both, every inference client could administer the server)")
	}
	return inference, admin
}

// readToken reads the token of key (key+"_file" names its file).
func readToken(p *problems, key, file string, value Secret) string {
	fileKey := key + "_file"
	if file != "" && value != "" {
		p.add(key, "set either %s or %s, not both", fileKey, key)
		return ""
	}
	path, token := key, string(value)
	if file != "" {
		data, err := ReadFile(file)
		if err != nil {
			p.add(fileKey, "cannot read the token: %v", err)
			return ""
		}
		path, token = fileKey, string(data)
	} else if value == "" {
		return ""
	}
	token = strings.TrimSpace(token)
	switch {
	case token == "" && file != "":
		p.add(path, "%s is empty", file)
	case token == "":
		p.add(path, "is empty")
	case strings.IndexFunc(token, func(r rune) bool { return r <= ' ' || r > '~' }) >= 0:
		p.add(path, "the token must be printable ASCII without spaces (it travels in an HTTP header)")
	case len(token) < MinTokenLength:
		p.add(path, "the token has %d characters; use at least %d (e.g. `openssl rand -hex 32`)", len(token), MinTokenLength)
	default:
		return token
	}
	return ""
}

func (t *TLS) validate(p *problems) {
	p.oneOf("tls.min_version", t.MinVersion, TLSVersion12, TLSVersion13)
	if t.ClientAuth != "" {
		p.oneOf("tls.client_auth", t.ClientAuth, ClientAuthNone, ClientAuthRequest, ClientAuthRequire)
	}
	switch {
	case t.CertFile == "" && t.KeyFile != "":
		p.add("tls.cert_file", "required when tls.key_file is set")
	case t.CertFile != "" && t.KeyFile == "":
		p.add("tls.key_file", "required when tls.cert_file is set")
	case t.CertFile != "":
		if _, err := LoadKeyPair(t.CertFile, t.KeyFile); err != nil {
			p.add("tls.cert_file", "%v", err)
		}
	}
	if t.CertFile == "" {
		for _, f := range []struct {
			key string
			set bool
		}{{"tls.client_ca_file", t.ClientCAFile != ""}, {"tls.client_auth", t.ClientAuth != "" && t.ClientAuth != ClientAuthNone}, {"tls.metrics", t.Metrics}} {
			if f.set {
				p.add(f.key, "needs tls.cert_file and tls.key_file (the listeners do not speak TLS)")
			}
		}
		return
	}
	mode := t.ClientAuthMode()
	switch {
	case t.ClientCAFile != "":
		if _, err := LoadCertPool(t.ClientCAFile); err != nil {
			p.add("tls.client_ca_file", "%v", err)
		}
		if mode == ClientAuthNone {
			p.add("tls.client_auth", "is none, so tls.client_ca_file would not be used; remove one of them")
		}
	case mode != ClientAuthNone:
		p.add("tls.client_ca_file", "required when tls.client_auth is %s", mode)
	}
}

func (a *Auth) validate(p *problems) {
	a.tokens(p)
	for i, h := range a.AllowedHosts {
		if h == "" || strings.ContainsAny(h, ":/[] \t@") {
			p.add(fmt.Sprintf("auth.allowed_hosts[%d]", i), "want a host name such as sloserve.internal, without scheme or port; got %q", h)
		}
	}
	for _, f := range []struct {
		key string
		set bool
	}{{"auth.require_token_for_health", a.RequireTokenForHealth}, {"auth.require_token_for_metrics", a.RequireTokenForMetrics}} {
		if f.set && a.InferenceTokenFile == "" && a.InferenceToken == "" {
			p.add(f.key, "needs an inference token (auth.inference_token_file)")
		}
	}
}

// LoadKeyPair reads a PEM certificate chain and its private key.
func LoadKeyPair(certFile, keyFile string) (*tls.Certificate, error) {
	certPEM, err := ReadFile(certFile)
	if err != nil {
		return nil, fmt.Errorf("cannot read the certificate: %w", err)
	}
	keyPEM, err := ReadFile(keyFile)
	if err != nil {
		return nil, fmt.Errorf("cannot read the key (tls.key_file): %w", err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("%s and %s: %w", certFile, keyFile, err)
	}
	return &cert, nil
}

// LoadCertPool reads PEM CA certificates.
func LoadCertPool(file string) (*x509.CertPool, error) {
	data, err := ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("cannot read the CA certificates: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data) {
		return nil, fmt.Errorf("%s holds no PEM certificate", file)
	}
	return pool, nil
}
