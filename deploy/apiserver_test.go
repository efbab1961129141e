package deploy

import (
	"bytes"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

// A real Kubernetes API server for the manifests: kube-apiserver and etcd,
// built by `make test-tools` from Kubernetes' and etcd's own Go modules
// (tools/kube), with the CRDs of KServe, KEDA and
// prometheus-operator from their modules. Objects are applied server-side
// with strict field validation, as `kubectl apply --server-side
// --validate=strict` does: an unknown or misspelt field, a wrong type or a
// value the API's validation refuses is an error, for built-in kinds and
// for custom resources against their CRDs' schemas.

// kubeTools returns the folder holding kube-apiserver, etcd and crds/, or
// skips (fails where SLOSERVE_REQUIRE_KUBE=1, as under make test).
func kubeTools(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs("../.tools")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"bin/kube-apiserver", "bin/etcd", "crds"} {
		if _, err := os.Stat(filepath.Join(dir, p)); err != nil {
			msg := fmt.Sprintf("%s not found; `make test-tools` builds it", filepath.Join(dir, p))
			if os.Getenv("SLOSERVE_REQUIRE_KUBE") == "1" {
				t.Fatal(msg)
			}
			t.Skip(msg)
		}
	}
	return dir
}

// apiServer is a running kube-apiserver the test may do anything on.
type apiServer struct {
	url    string
	token  string
	client *http.Client
	// resources maps "group/version/Kind" to its resource name and whether
	// it lives in a namespace, from the server's discovery.
	resources map[string]apiResource
}

type apiResource struct {
	Name       string `json:"name"`
	Kind       string `json:"kind"`
	Namespaced bool   `json:"namespaced"`
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// startProcess starts a tool whose output goes to a file, printed when the
// test fails, and stops it when the test ends.
func startProcess(t *testing.T, name string, args ...string) {
	t.Helper()
	logf, err := os.Create(filepath.Join(t.TempDir(), filepath.Base(name)+".log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			if len(b) > 8000 {
				b = b[len(b)-8000:]
			}
			t.Logf("%s's last output:\n%s", filepath.Base(name), b)
		}
		logf.Close()
	})
}

// waitHTTP polls url until it answers 200, or fails the test after limit
// (a start that never finishes, not a timing bound).
func waitHTTP(t *testing.T, c *http.Client, url, token string, limit time.Duration) {
	t.Helper()
	deadline := time.Now().Add(limit)
	var last string
	for time.Now().Before(deadline) {
		req, _ := http.NewRequest("GET", url, nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := c.Do(req)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
			last = fmt.Sprintf("%d %s", resp.StatusCode, b)
		} else {
			last = err.Error()
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("%s did not answer 200 within %v: %s", url, limit, last)
}

// startAPIServer starts etcd and kube-apiserver on free loopback ports with
// temporary data, an admin token in system:masters and RBAC, and installs
// the CRDs the manifests use.
func startAPIServer(t *testing.T) *apiServer {
	t.Helper()
	tools := kubeTools(t)
	dir := t.TempDir()

	client, peer := freeAddr(t), freeAddr(t)
	startProcess(t, filepath.Join(tools, "bin/etcd"),
		"--name", "default", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", "http://"+client, "--advertise-client-urls", "http://"+client,
		"--listen-peer-urls", "http://"+peer, "--initial-advertise-peer-urls", "http://"+peer,
		"--initial-cluster", "default=http://"+peer, "--log-level", "warn")
	waitHTTP(t, http.DefaultClient, "http://"+client+"/health", "", 2*time.Minute)

	// The service-account token signer.
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	saKey := write("sa.key", pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}))
	saPub := write("sa.pub", pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}))
	token := fmt.Sprintf("sloserve-test-%d", time.Now().UnixNano())
	tokens := write("tokens.csv", []byte(token+",admin,admin-uid,system:masters\n"))

	addr := freeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	certDir := filepath.Join(dir, "certs")
	startProcess(t, filepath.Join(tools, "bin/kube-apiserver"),
		"--etcd-servers", "http://"+client,
		"--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", port,
		"--cert-dir", certDir,
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", saPub, "--service-account-signing-key-file", saKey,
		"--token-auth-file", tokens, "--authorization-mode", "RBAC",
		"--service-cluster-ip-range", "10.96.0.0/24",
		"--enable-priority-and-fairness=false")
	// The server writes its self-signed certificate at start; trust it.
	pool := x509.NewCertPool()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if b, err := os.ReadFile(filepath.Join(certDir, "apiserver.crt")); err == nil && pool.AppendCertsFromPEM(b) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("kube-apiserver wrote no certificate in its cert dir")
		}
		time.Sleep(100 * time.Millisecond)
	}
	s := &apiServer{
		url:    "https://" + addr,
		token:  token,
		client: &http.Client{Timeout: time.Minute, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: "127.0.0.1"}}},
	}
	waitHTTP(t, s.client, s.url+"/readyz", token, 3*time.Minute)

	// The custom resources' definitions, established before use.
	crds, err := filepath.Glob(filepath.Join(tools, "crds", "*.yaml"))
	if err != nil || len(crds) == 0 {
		t.Fatalf("no CRDs in %s: %v", filepath.Join(tools, "crds"), err)
	}
	for _, f := range crds {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var meta struct {
			Metadata struct{ Name string } `json:"metadata"`
		}
		if err := yaml.Unmarshal(b, &meta); err != nil {
			t.Fatal(err)
		}
		path := "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/" + meta.Metadata.Name
		if code, body := s.apply(t, path, b); code >= 300 {
			t.Fatalf("CRD %s: %d %s", meta.Metadata.Name, code, body)
		}
		s.waitEstablished(t, path)
	}
	s.discover(t)
	return s
}

func (s *apiServer) do(t *testing.T, method, path, contentType string, body []byte) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, s.url+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+s.token)
	req.Header.Set("Accept", "application/json")
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := s.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if w := resp.Header.Values("Warning"); len(w) > 0 && resp.StatusCode < 300 {
		// Strict validation makes unknown fields errors; a warning left is
		// something else the API server wants said (a deprecation).
		return resp.StatusCode, append(b, []byte("\nwarnings: "+strings.Join(w, "; "))...)
	}
	return resp.StatusCode, b
}

// apply applies a YAML object at path server-side, with strict field
// validation.
func (s *apiServer) apply(t *testing.T, path string, doc []byte) (int, []byte) {
	t.Helper()
	return s.do(t, "PATCH", path+"?fieldManager=sloserve-test&force=true&fieldValidation=Strict", "application/apply-patch+yaml", doc)
}

func (s *apiServer) waitEstablished(t *testing.T, path string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		_, b := s.do(t, "GET", path, "", nil)
		var crd struct {
			Status struct {
				Conditions []struct{ Type, Status string } `json:"conditions"`
			} `json:"status"`
		}
		if json.Unmarshal(b, &crd) == nil {
			for _, c := range crd.Status.Conditions {
				if c.Type == "Established" && c.Status == "True" {
					return
				}
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("%s not established", path)
}

// discover reads every group version's resources.
func (s *apiServer) discover(t *testing.T) {
	t.Helper()
	s.resources = map[string]apiResource{}
	var list struct {
		Resources []apiResource `json:"resources"`
	}
	read := func(path, gv string) {
		code, b := s.do(t, "GET", path, "", nil)
		if code != 200 {
			t.Fatalf("discovery %s: %d %s", path, code, b)
		}
		list.Resources = nil
		if err := json.Unmarshal(b, &list); err != nil {
			t.Fatal(err)
		}
		for _, r := range list.Resources {
			if !strings.Contains(r.Name, "/") {
				s.resources[gv+"/"+r.Kind] = r
			}
		}
	}
	read("/api/v1", "v1")
	code, b := s.do(t, "GET", "/apis", "", nil)
	if code != 200 {
		t.Fatalf("discovery /apis: %d %s", code, b)
	}
	var groups struct {
		Groups []struct {
			Versions []struct {
				GroupVersion string `json:"groupVersion"`
			} `json:"versions"`
		} `json:"groups"`
	}
	if err := json.Unmarshal(b, &groups); err != nil {
		t.Fatal(err)
	}
	for _, g := range groups.Groups {
		for _, v := range g.Versions {
			read("/apis/"+v.GroupVersion, v.GroupVersion)
		}
	}
}

// version is the server's Kubernetes version, as helm's --kube-version
// takes it.
func (s *apiServer) version(t *testing.T) string {
	t.Helper()
	_, b := s.do(t, "GET", "/version", "", nil)
	var v struct {
		GitVersion string `json:"gitVersion"`
	}
	if err := json.Unmarshal(b, &v); err != nil || v.GitVersion == "" {
		t.Fatalf("version: %v %s", err, b)
	}
	return strings.TrimPrefix(strings.SplitN(v.GitVersion, "-", 2)[0], "v")
}

// applyDoc applies one manifest document into namespace ns (for
// namespaced kinds) and returns the object the server stored.
func (s *apiServer) applyDoc(t *testing.T, ns string, doc []byte) (int, []byte, string) {
	t.Helper()
	var o struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name string `json:"name"`
		} `json:"metadata"`
	}
	if err := yaml.Unmarshal(doc, &o); err != nil {
		t.Fatalf("%v\n%s", err, doc)
	}
	r, ok := s.resources[o.APIVersion+"/"+o.Kind]
	if !ok {
		t.Fatalf("the API server serves no %s %s", o.APIVersion, o.Kind)
	}
	path := "/api/v1"
	if o.APIVersion != "v1" {
		path = "/apis/" + o.APIVersion
	}
	if r.Namespaced {
		path += "/namespaces/" + ns
	}
	path += "/" + r.Name + "/" + o.Metadata.Name
	code, body := s.apply(t, path, doc)
	return code, body, o.Kind + "/" + o.Metadata.Name
}

func (s *apiServer) namespace(t *testing.T, name string) {
	t.Helper()
	if code, b := s.apply(t, "/api/v1/namespaces/"+name, []byte("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: "+name+"\n")); code >= 300 {
		t.Fatalf("namespace %s: %d %s", name, code, b)
	}
}

// TestAPIServerApply applies every manifest the project ships to a real
// API server: the chart with its default, GPU and optional objects, the
// KServe runtime and InferenceServices, the ModelMesh runtime and the
// autoscalers. Each object must be accepted with strict validation and no
// warning, and the fields that matter must survive the round trip.
func TestAPIServerApply(t *testing.T) {
	s := startAPIServer(t)
	kube := s.version(t)
	t.Logf("kube-apiserver %s", kube)
	s.namespace(t, "sloserve")

	applyAll := func(t *testing.T, docs [][]byte) map[string][]byte {
		t.Helper()
		stored := map[string][]byte{}
		for _, d := range docs {
			code, body, what := s.applyDoc(t, "sloserve", d)
			if code >= 300 || bytes.Contains(body, []byte("\nwarnings: ")) {
				t.Errorf("%s: %d %s", what, code, body)
				continue
			}
			stored[what] = body
		}
		return stored
	}
	chart := func(t *testing.T, args ...string) map[string][]byte {
		t.Helper()
		cmd := exec.Command(helm(t), append([]string{"template", release, chartDir, "--namespace", "sloserve", "--kube-version", kube}, args...)...)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("helm template %v: %v", args, err)
		}
		return applyAll(t, splitDocs(out))
	}
	file := func(t *testing.T, path string) map[string][]byte {
		t.Helper()
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		return applyAll(t, splitDocs(b))
	}
	// pod reads the stored Deployment's pod spec, as the API server keeps it.
	pod := func(t *testing.T, stored map[string][]byte) (spec struct {
		ServiceAccountName           string `json:"serviceAccountName"`
		AutomountServiceAccountToken *bool  `json:"automountServiceAccountToken"`
		InitContainers               []struct {
			Name          string `json:"name"`
			RestartPolicy string `json:"restartPolicy"`
		} `json:"initContainers"`
		Containers []struct {
			Name      string `json:"name"`
			Lifecycle struct {
				PreStop struct {
					Sleep *struct {
						Seconds int `json:"seconds"`
					} `json:"sleep"`
				} `json:"preStop"`
			} `json:"lifecycle"`
		} `json:"containers"`
	}, replicas *int) {
		t.Helper()
		b, ok := stored["Deployment/"+release]
		if !ok {
			t.Fatalf("no Deployment stored: %v", keys(stored))
		}
		var d struct {
			Spec struct {
				Replicas *int `json:"replicas"`
				Template struct {
					Spec json.RawMessage `json:"spec"`
				} `json:"template"`
			} `json:"spec"`
		}
		if err := json.Unmarshal(b, &d); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(d.Spec.Template.Spec, &spec); err != nil {
			t.Fatal(err)
		}
		return spec, d.Spec.Replicas
	}

	t.Run("chart", func(t *testing.T) {
		stored := chart(t)
		for _, want := range []string{"Deployment/" + release, "Service/" + release, "ConfigMap/" + release, "ServiceAccount/" + release, "PodDisruptionBudget/" + release} {
			if _, ok := stored[want]; !ok {
				t.Errorf("%s not stored (got %v)", want, keys(stored))
			}
		}
		spec, _ := pod(t, stored)
		// The fields the chart's behaviour rests on are kept by the API
		// (a field the server did not know would have been refused, or
		// dropped by an older server).
		if len(spec.Containers) == 0 || spec.Containers[0].Lifecycle.PreStop.Sleep == nil || spec.Containers[0].Lifecycle.PreStop.Sleep.Seconds != 5 {
			t.Errorf("the preStop sleep did not survive: %+v", spec.Containers)
		}
		if spec.ServiceAccountName != release || spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
			t.Errorf("pods run as %q with token %v", spec.ServiceAccountName, spec.AutomountServiceAccountToken)
		}
	})
	t.Run("chart with every option", func(t *testing.T) {
		// Applied over the default release: an upgrade to autoscaling must
		// leave the count to the autoscaler.
		stored := chart(t, "--set", "autoscaling.enabled=true", "--set", "serviceMonitor.enabled=true",
			"--set", "prometheusRule.enabled=true", "--set", "grafanaDashboard.enabled=true",
			"--set", "profileCache.source=pvc", "--set", "profileCache.pvc.claimName=profiles")
		for _, want := range []string{"ServiceMonitor/" + release, "PrometheusRule/" + release, "ConfigMap/" + release + "-dashboard"} {
			if _, ok := stored[want]; !ok {
				t.Errorf("%s not stored (got %v)", want, keys(stored))
			}
		}
		// An autoscaler scales the Deployment through its scale
		// subresource; the next upgrade of the chart keeps its count.
		scale := "/apis/apps/v1/namespaces/sloserve/deployments/" + release + "/scale"
		if code, b := s.do(t, "PATCH", scale+"?fieldManager=autoscaler", "application/merge-patch+json", []byte(`{"spec":{"replicas":3}}`)); code != 200 {
			t.Fatalf("scale: %d %s", code, b)
		}
		replicasAfter := func(args ...string) int {
			t.Helper()
			_, r := pod(t, chart(t, args...))
			if r == nil {
				t.Fatal("no replicas stored")
			}
			return *r
		}
		if got := replicasAfter("--set", "autoscaling.enabled=true"); got != 3 {
			t.Errorf("an upgrade with autoscaling.enabled set replicas %d, want the autoscaler's 3", got)
		}
		// The test can tell: a chart that names the count takes it back.
		if got := replicasAfter(); got != 1 {
			t.Errorf("an upgrade naming replicas 1 left %d", got)
		}
	})
	t.Run("chart on GPUs", func(t *testing.T) {
		stored := chart(t, "-f", filepath.Join(chartDir, "values-gpu.yaml"))
		spec, _ := pod(t, stored)
		sidecar := false
		for _, c := range spec.InitContainers {
			sidecar = sidecar || (c.Name == "mps-control-daemon" && c.RestartPolicy == "Always")
		}
		if !sidecar {
			t.Errorf("the MPS daemon is no native sidecar once stored: %+v", spec.InitContainers)
		}
	})
	t.Run("kserve", func(t *testing.T) {
		stored := file(t, "kserve/clusterservingruntime.yaml")
		if len(stored) != 1 {
			t.Fatalf("stored %v", keys(stored))
		}
		if got := file(t, "kserve/inferenceservice.yaml"); len(got) != 2 {
			t.Errorf("InferenceServices stored: %v, want 2", keys(got))
		}
	})
	t.Run("modelmesh", func(t *testing.T) {
		if got := file(t, "modelmesh/servingruntime.yaml"); len(got) != 1 {
			t.Errorf("stored %v", keys(got))
		}
	})
	t.Run("autoscaling", func(t *testing.T) {
		for _, f := range []string{"autoscaling/hpa.yaml", "autoscaling/keda-scaledobject.yaml"} {
			if got := file(t, f); len(got) != 1 {
				t.Errorf("%s: stored %v", f, keys(got))
			}
		}
	})
	// The validation is real: a misspelt field is refused, for a built-in
	// kind and for a custom resource against its CRD's schema.
	t.Run("strict validation refuses", func(t *testing.T) {
		for _, bad := range []struct{ what, doc string }{
			{"Deployment", "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: bad}\nspec:\n  replica: 1\n  selector: {matchLabels: {a: b}}\n  template:\n    metadata: {labels: {a: b}}\n    spec: {containers: [{name: c, image: i}]}\n"},
			{"InferenceService", "apiVersion: serving.kserve.io/v1beta1\nkind: InferenceService\nmetadata: {name: bad}\nspec:\n  predictor:\n    model:\n      modelFormat: {name: onnx}\n      storageURI: s3://x\n"},
			{"PrometheusRule", "apiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\nmetadata: {name: bad}\nspec:\n  groups: [{name: g, rules: [{record: a, expresion: up}]}]\n"},
		} {
			code, body, _ := s.applyDoc(t, "sloserve", []byte(bad.doc))
			// Server-side apply types the patch against the schema first,
			// and refuses a field the schema does not declare.
			if code < 400 || !strings.Contains(string(body), "field not declared in schema") {
				t.Errorf("%s with a misspelt field: %d %s; want it refused as a field the schema does not declare", bad.what, code, body)
			}
		}
	})
}

func keys(m map[string][]byte) []string {
	var k []string
	for n := range m {
		k = append(k, n)
	}
	return k
}
