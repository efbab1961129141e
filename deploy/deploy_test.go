package deploy

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/limiter"
)

const (
	chartDir = "helm/sloserve"
	// The Kubernetes version the chart is rendered for: helm built with
	// `go install` does not know its own default, and the chart needs
	// 1.30 or later (native sidecars from 1.29, the preStop sleep action
	// on by default from 1.30).
	kubeVersion = "1.34.0"
	release     = "sloserve"
)

// The custom resources, as far as the manifests use them: the fields of
// their CRDs (KServe serving.kserve.io, KEDA keda.sh, prometheus-operator
// monitoring.coreos.com), with the Kubernetes types where the CRDs embed
// them. Their Go modules pull in controller-runtime and much more; these
// few structs are enough to decode strictly.

type serviceMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Selector  metav1.LabelSelector `json:"selector"`
		Endpoints []struct {
			Port     string `json:"port"`
			Path     string `json:"path"`
			Interval string `json:"interval"`
		} `json:"endpoints"`
	} `json:"spec"`
}

// prometheusRule is prometheus-operator's PrometheusRule: rule groups as
// Prometheus's rule files have them.
type prometheusRule struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              ruleGroups `json:"spec"`
}

type ruleGroups struct {
	Groups []struct {
		Name     string `json:"name"`
		Interval string `json:"interval,omitempty"`
		Rules    []struct {
			Record      string            `json:"record,omitempty"`
			Alert       string            `json:"alert,omitempty"`
			Expr        string            `json:"expr"`
			For         string            `json:"for,omitempty"`
			Labels      map[string]string `json:"labels,omitempty"`
			Annotations map[string]string `json:"annotations,omitempty"`
		} `json:"rules"`
	} `json:"groups"`
}

type servingRuntime struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Annotations           map[string]string `json:"annotations"`
		SupportedModelFormats []struct {
			Name       string `json:"name"`
			Version    string `json:"version"`
			AutoSelect *bool  `json:"autoSelect"`
			Priority   *int32 `json:"priority"`
		} `json:"supportedModelFormats"`
		ProtocolVersions []string           `json:"protocolVersions"`
		MultiModel       *bool              `json:"multiModel"`
		GRPCEndpoint     string             `json:"grpcEndpoint"`
		GRPCDataEndpoint string             `json:"grpcDataEndpoint"`
		Containers       []corev1.Container `json:"containers"`
	} `json:"spec"`
}

type inferenceService struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Predictor struct {
			MinReplicas *int32 `json:"minReplicas"`
			MaxReplicas int32  `json:"maxReplicas"`
			// KServe's model spec embeds a corev1.Container; these are the
			// container fields the examples set.
			Model struct {
				ModelFormat struct {
					Name    string `json:"name"`
					Version string `json:"version"`
				} `json:"modelFormat"`
				Runtime         string                      `json:"runtime"`
				ProtocolVersion string                      `json:"protocolVersion"`
				StorageURI      string                      `json:"storageUri"`
				Resources       corev1.ResourceRequirements `json:"resources"`
				Ports           []corev1.ContainerPort      `json:"ports"`
			} `json:"model"`
		} `json:"predictor"`
	} `json:"spec"`
}

type scaledObject struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		ScaleTargetRef struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Name       string `json:"name"`
		} `json:"scaleTargetRef"`
		MinReplicaCount *int32 `json:"minReplicaCount"`
		MaxReplicaCount *int32 `json:"maxReplicaCount"`
		PollingInterval *int32 `json:"pollingInterval"`
		CooldownPeriod  *int32 `json:"cooldownPeriod"`
		Advanced        struct {
			HorizontalPodAutoscalerConfig struct {
				Behavior *autoscalingv2.HorizontalPodAutoscalerBehavior `json:"behavior"`
			} `json:"horizontalPodAutoscalerConfig"`
		} `json:"advanced"`
		Triggers []struct {
			Type       string            `json:"type"`
			Name       string            `json:"name"`
			MetricType string            `json:"metricType"`
			Metadata   map[string]string `json:"metadata"`
		} `json:"triggers"`
	} `json:"spec"`
}

// adapterRules is prometheus-adapter's config, external rules only.
type adapterRules struct {
	ExternalRules []struct {
		SeriesQuery string `json:"seriesQuery"`
		Name        struct {
			As string `json:"as"`
		} `json:"name"`
		MetricsQuery string `json:"metricsQuery"`
	} `json:"externalRules"`
}

// helm finds the helm `make test-tools` installs into .tools/bin, else one
// on PATH; without one the test skips, or fails where
// SLOSERVE_REQUIRE_HELM=1 (make test) says it must run.
func helm(t *testing.T) string {
	t.Helper()
	if p, err := filepath.Abs("../.tools/bin/helm"); err == nil {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if p, err := exec.LookPath("helm"); err == nil {
		return p
	}
	msg := "helm not found in .tools/bin or on PATH; `make test-tools` installs it"
	if os.Getenv("SLOSERVE_REQUIRE_HELM") == "1" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

// render runs `helm template` on the chart with extra arguments (-f, --set)
// and returns its documents, or helm's error output.
func render(t *testing.T, args ...string) ([][]byte, error) {
	t.Helper()
	cmd := exec.Command(helm(t), append([]string{"template", release, chartDir, "--kube-version", kubeVersion}, args...)...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("helm template %v: %w\n%s", args, err, errOut.String())
	}
	return splitDocs(out.Bytes()), nil
}

var docSep = regexp.MustCompile(`(?m)^---[ \t]*$`)

// splitDocs splits a YAML stream into its non-empty documents.
func splitDocs(b []byte) [][]byte {
	var docs [][]byte
	for _, d := range docSep.Split(string(b), -1) {
		if strings.TrimSpace(stripComments(d)) != "" {
			docs = append(docs, []byte(d))
		}
	}
	return docs
}

func stripComments(s string) string {
	var b strings.Builder
	for _, line := range strings.Split(s, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

// strict decodes a YAML document as the API server does: field names are
// case-sensitive, and unknown or duplicate fields are errors. (yaml's own
// UnmarshalStrict goes through encoding/json, which matches field names
// case-insensitively: storageURI would pass for storageUri.)
func strict(doc []byte, into any) error {
	j, err := yaml.YAMLToJSON(doc)
	if err != nil {
		return err
	}
	strictErrs, err := sigsjson.UnmarshalStrict(j, into, sigsjson.DisallowDuplicateFields, sigsjson.DisallowUnknownFields)
	if err != nil {
		return err
	}
	return errors.Join(strictErrs...)
}

// objects are the rendered objects of a chart or manifest, decoded.
type objects struct {
	deployment      *appsv1.Deployment
	service         *corev1.Service
	configMap       *corev1.ConfigMap
	dashboard       *corev1.ConfigMap
	serviceAccount  *corev1.ServiceAccount
	pdb             *policyv1.PodDisruptionBudget
	prometheusRule  *prometheusRule
	serviceMonitor  *serviceMonitor
	hpa             *autoscalingv2.HorizontalPodAutoscaler
	servingRuntime  *servingRuntime
	isvcs           []*inferenceService
	scaledObject    *scaledObject
	kinds           []string
	deploymentCount int
}

// decode decodes every document strictly (unknown and duplicate fields are
// errors) into the type its apiVersion and kind name.
func decode(t *testing.T, docs [][]byte) *objects {
	t.Helper()
	var o objects
	for _, d := range docs {
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal(d, &tm); err != nil {
			t.Fatalf("%v\n%s", err, d)
		}
		gvk := tm.APIVersion + "/" + tm.Kind
		var into any
		switch gvk {
		case "apps/v1/Deployment":
			o.deployment = &appsv1.Deployment{}
			into = o.deployment
		case "v1/Service":
			o.service = &corev1.Service{}
			into = o.service
		case "v1/ConfigMap":
			cm := &corev1.ConfigMap{}
			if bytes.Contains(d, []byte("sloserve-dashboard.json:")) {
				o.dashboard = cm
			} else {
				o.configMap = cm
			}
			into = cm
		case "v1/ServiceAccount":
			o.serviceAccount = &corev1.ServiceAccount{}
			into = o.serviceAccount
		case "policy/v1/PodDisruptionBudget":
			o.pdb = &policyv1.PodDisruptionBudget{}
			into = o.pdb
		case "monitoring.coreos.com/v1/PrometheusRule":
			o.prometheusRule = &prometheusRule{}
			into = o.prometheusRule
		case "monitoring.coreos.com/v1/ServiceMonitor":
			o.serviceMonitor = &serviceMonitor{}
			into = o.serviceMonitor
		case "autoscaling/v2/HorizontalPodAutoscaler":
			o.hpa = &autoscalingv2.HorizontalPodAutoscaler{}
			into = o.hpa
		case "serving.kserve.io/v1alpha1/ClusterServingRuntime", "serving.kserve.io/v1alpha1/ServingRuntime":
			o.servingRuntime = &servingRuntime{}
			into = o.servingRuntime
		case "serving.kserve.io/v1beta1/InferenceService":
			isvc := &inferenceService{}
			o.isvcs = append(o.isvcs, isvc)
			into = isvc
		case "keda.sh/v1alpha1/ScaledObject":
			o.scaledObject = &scaledObject{}
			into = o.scaledObject
		default:
			t.Fatalf("unexpected object %s:\n%s", gvk, d)
		}
		if err := strict(d, into); err != nil {
			t.Fatalf("%s does not decode strictly: %v\n%s", gvk, err, d)
		}
		o.kinds = append(o.kinds, tm.Kind)
	}
	slices.Sort(o.kinds)
	return &o
}

func readManifest(t *testing.T, path string) *objects {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return decode(t, splitDocs(b))
}

// serverConfig loads the ConfigMap's server.yaml as the server would.
func serverConfig(t *testing.T, cm *corev1.ConfigMap) *configs.Server {
	t.Helper()
	data, ok := cm.Data["server.yaml"]
	if !ok {
		t.Fatalf("ConfigMap %s has no server.yaml: %v", cm.Name, cm.Data)
	}
	p := filepath.Join(t.TempDir(), "server.yaml")
	if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := configs.LoadServer(p)
	if err != nil {
		t.Fatalf("the chart's server config does not load: %v\n%s", err, data)
	}
	return cfg
}

func port(t *testing.T, addr string) int32 {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return int32(n)
}

func container(t *testing.T, spec *corev1.PodSpec, name string) *corev1.Container {
	t.Helper()
	for _, cs := range [][]corev1.Container{spec.Containers, spec.InitContainers} {
		for i := range cs {
			if cs[i].Name == name {
				return &cs[i]
			}
		}
	}
	t.Fatalf("no container %q", name)
	return nil
}

func env(c *corev1.Container, name string) string {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value
		}
	}
	return ""
}

// checkPod checks what must hold of the pod whatever the values: every
// container non-root and locked down, every mount backed by a volume.
func checkPod(t *testing.T, spec *corev1.PodSpec) {
	t.Helper()
	psc := spec.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser == 0 {
		t.Errorf("pod securityContext: want runAsNonRoot and a non-zero runAsUser, got %+v", psc)
	}
	volumes := map[string]bool{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = true
	}
	for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
		sc := c.SecurityContext
		if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
			sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
			sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
			t.Errorf("container %s: want no privilege escalation, a read-only root and every capability dropped, got %+v", c.Name, sc)
		}
		if c.Image == "" {
			t.Errorf("container %s has no image", c.Name)
		}
		for _, m := range c.VolumeMounts {
			if !volumes[m.Name] {
				t.Errorf("container %s mounts %s, which is no volume of the pod", c.Name, m.Name)
			}
		}
	}
}

// TestChartLint runs helm's own checks, warnings failing too.
func TestChartLint(t *testing.T) {
	for _, values := range []string{"values.yaml", "values-gpu.yaml"} {
		t.Run(values, func(t *testing.T) {
			out, err := exec.Command(helm(t), "lint", "--strict", "--kube-version", kubeVersion, chartDir, "-f", filepath.Join(chartDir, values)).CombinedOutput()
			if err != nil {
				t.Errorf("helm lint: %v\n%s", err, out)
			}
		})
	}
}

func TestChartDefault(t *testing.T) {
	docs, err := render(t)
	if err != nil {
		t.Fatal(err)
	}
	o := decode(t, docs)
	if want := []string{"ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"}; !slices.Equal(o.kinds, want) {
		t.Fatalf("objects %v, want %v", o.kinds, want)
	}
	if r := o.deployment.Spec.Replicas; r == nil || *r != 1 {
		t.Errorf("replicas %v, want 1 when the chart owns the count", r)
	}
	// The pods run as their own account, with no API token.
	if sa := o.serviceAccount; sa.AutomountServiceAccountToken == nil || *sa.AutomountServiceAccountToken {
		t.Error("the ServiceAccount mounts a token; the server calls no Kubernetes API")
	}
	if spec := o.deployment.Spec.Template.Spec; spec.ServiceAccountName != o.serviceAccount.Name || spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Errorf("pods run as %q (token %v), want %q with no token", spec.ServiceAccountName, spec.AutomountServiceAccountToken, o.serviceAccount.Name)
	}
	// The disruption budget covers the pods and lets a drain proceed.
	if pdb := o.pdb; pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() < 1 || pdb.Spec.Selector == nil {
		t.Errorf("PodDisruptionBudget %+v, want maxUnavailable >= 1 and a selector", pdb.Spec)
	} else {
		for k, v := range pdb.Spec.Selector.MatchLabels {
			if o.deployment.Spec.Template.Labels[k] != v {
				t.Errorf("PodDisruptionBudget selects %s=%s, the pods have %q", k, v, o.deployment.Spec.Template.Labels[k])
			}
		}
	}
	cfg := serverConfig(t, o.configMap)
	def := configs.DefaultServer()
	// The chart's ports are the server's own defaults.
	for _, l := range []struct{ name, got, want string }{
		{"http", cfg.Listen.HTTP, def.Listen.HTTP}, {"grpc", cfg.Listen.GRPC, def.Listen.GRPC}, {"metrics", cfg.Listen.Metrics, def.Listen.Metrics},
	} {
		if l.got != l.want {
			t.Errorf("listen.%s = %q, want the default %q", l.name, l.got, l.want)
		}
	}
	if !slices.Equal(cfg.Repositories, []string{"/models"}) {
		t.Errorf("repositories = %v, want [/models]", cfg.Repositories)
	}

	pod := &o.deployment.Spec.Template.Spec
	checkPod(t, pod)
	c := container(t, pod, "sloserve")
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	for name, addr := range map[string]string{"http": cfg.Listen.HTTP, "grpc": cfg.Listen.GRPC, "metrics": cfg.Listen.Metrics} {
		if ports[name] != port(t, addr) {
			t.Errorf("container port %s = %d, the server listens on %s", name, ports[name], addr)
		}
	}
	svcPorts := map[string]int32{}
	for _, p := range o.service.Spec.Ports {
		svcPorts[p.Name] = p.Port
		if p.TargetPort.StrVal != p.Name {
			t.Errorf("service port %s targets %q, want the container port of its name", p.Name, p.TargetPort.String())
		}
	}
	if len(svcPorts) != 3 || svcPorts["http"] != 8000 || svcPorts["grpc"] != 8001 || svcPorts["metrics"] != 8002 {
		t.Errorf("service ports %v, want http 8000, grpc 8001, metrics 8002", svcPorts)
	}
	for _, k := range []string{"app.kubernetes.io/name", "app.kubernetes.io/instance"} {
		if v := o.service.Spec.Selector[k]; v == "" || o.deployment.Spec.Template.Labels[k] != v {
			t.Errorf("service selector %s=%q does not select the pods (%v)", k, v, o.deployment.Spec.Template.Labels)
		}
	}

	// Probes on the health endpoints of the REST port.
	for _, p := range []struct {
		what  string
		probe *corev1.Probe
		path  string
	}{{"liveness", c.LivenessProbe, "/v2/health/live"}, {"readiness", c.ReadinessProbe, "/v2/health/ready"}} {
		if p.probe == nil || p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != p.path || p.probe.HTTPGet.Port.StrVal != "http" {
			t.Errorf("%s probe %+v, want GET %s on port http", p.what, p.probe, p.path)
		}
	}

	// Shutdown: the preStop sleep is the server's shutdown_delay, and the
	// termination grace period covers both and the grace period.
	if c.Lifecycle == nil || c.Lifecycle.PreStop == nil || c.Lifecycle.PreStop.Sleep == nil {
		t.Fatalf("no preStop sleep: %+v", c.Lifecycle)
	}
	sleep := time.Duration(c.Lifecycle.PreStop.Sleep.Seconds) * time.Second
	if sleep <= 0 || sleep != cfg.Limits.ShutdownDelay {
		t.Errorf("preStop sleeps %v, limits.shutdown_delay is %v: want them equal and > 0", sleep, cfg.Limits.ShutdownDelay)
	}
	grace := time.Duration(*pod.TerminationGracePeriodSeconds) * time.Second
	if need := sleep + cfg.Limits.ShutdownDelay + cfg.Limits.GracePeriod; grace <= need {
		t.Errorf("terminationGracePeriodSeconds %v, want more than preStop + shutdown_delay + grace_period = %v", grace, need)
	}

	// The model repository: an emptyDir the init container fills, read-only
	// for the server.
	var models *corev1.Volume
	for i := range pod.Volumes {
		if pod.Volumes[i].Name == "models" {
			models = &pod.Volumes[i]
		}
	}
	if models == nil || models.EmptyDir == nil {
		t.Fatalf("models volume %+v, want an emptyDir by default", models)
	}
	init := container(t, pod, "models")
	if !slices.ContainsFunc(init.VolumeMounts, func(m corev1.VolumeMount) bool { return m.Name == "models" && m.MountPath == "/models" && !m.ReadOnly }) {
		t.Errorf("the init container does not write the models volume: %+v", init.VolumeMounts)
	}
	if !slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.Name == "models" && m.MountPath == "/models" && m.ReadOnly }) {
		t.Errorf("the server does not mount the models read-only at /models: %+v", c.VolumeMounts)
	}
	if cache := cfg.Control.Profile.CacheDir; !slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return strings.HasPrefix(cache, m.MountPath+"/") }) {
		t.Errorf("control.profile.cache_dir %s is on the read-only root file system", cache)
	}
	if _, ok := c.Resources.Limits["nvidia.com/gpu"]; ok {
		t.Error("a GPU is asked for without gpu.enabled")
	}
	// Shares are enforced as the non-root user the pod runs as: the
	// limiter may pick the unprivileged backend, whose process units live
	// in TMPDIR (/tmp), which must be writable; no capability is needed.
	if l := cfg.Control.Limiter; (l != limiter.BackendAuto && l != limiter.BackendUnprivileged) || cfg.Control.Policy == control.SharePolicyShared {
		t.Errorf("control.limiter %q, policy %q: the chart's pods would enforce no shares", l, cfg.Control.Policy)
	}
	if !slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == "/tmp" && !m.ReadOnly }) {
		t.Errorf("no writable /tmp for the runners' sockets and process units: %+v", c.VolumeMounts)
	}
	if o.deployment.Spec.Template.Annotations["checksum/config"] == "" {
		t.Error("no checksum/config annotation: a changed config would not roll the pods")
	}
}

func TestChartGPU(t *testing.T) {
	docs, err := render(t, "-f", filepath.Join(chartDir, "values-gpu.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	o := decode(t, docs)
	serverConfig(t, o.configMap)
	pod := &o.deployment.Spec.Template.Spec
	checkPod(t, pod)
	c := container(t, pod, "sloserve")
	if q := c.Resources.Limits["nvidia.com/gpu"]; q.Cmp(resource.MustParse("1")) != 0 {
		t.Errorf("nvidia.com/gpu limit = %v, want 1", q.String())
	}
	if q := c.Resources.Limits[corev1.ResourceMemory]; q.IsZero() {
		t.Error("the GPU values lost the memory limit")
	}
	if pod.RuntimeClassName == nil || *pod.RuntimeClassName != "nvidia" {
		t.Errorf("runtimeClassName %v, want nvidia", pod.RuntimeClassName)
	}
	mps := container(t, pod, "mps-control-daemon")
	if mps.RestartPolicy == nil || *mps.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Error("the MPS daemon is not a native sidecar (an init container with restartPolicy Always)")
	}
	if !slices.Contains(mps.Command, "nvidia-cuda-mps-control") {
		t.Errorf("the sidecar runs %v, not nvidia-cuda-mps-control", mps.Command)
	}
	// Both see the same pipe directory, on the same emptyDir volume.
	pipe := env(mps, "CUDA_MPS_PIPE_DIRECTORY")
	if pipe == "" || env(c, "CUDA_MPS_PIPE_DIRECTORY") != pipe {
		t.Fatalf("CUDA_MPS_PIPE_DIRECTORY: daemon %q, server %q", pipe, env(c, "CUDA_MPS_PIPE_DIRECTORY"))
	}
	mountOf := func(c *corev1.Container) string {
		for _, m := range c.VolumeMounts {
			if strings.HasPrefix(pipe, m.MountPath+"/") {
				return m.Name
			}
		}
		return ""
	}
	shared := mountOf(mps)
	if shared == "" || mountOf(c) != shared {
		t.Errorf("the pipe directory %s is not on one volume both containers mount (daemon %q, server %q)", pipe, shared, mountOf(c))
	}
	for _, v := range pod.Volumes {
		if v.Name == shared && v.EmptyDir == nil {
			t.Errorf("volume %s is not an emptyDir", v.Name)
		}
	}
}

func TestChartOptions(t *testing.T) {
	t.Run("service monitor", func(t *testing.T) {
		docs, err := render(t, "--set", "serviceMonitor.enabled=true")
		if err != nil {
			t.Fatal(err)
		}
		o := decode(t, docs)
		sm := o.serviceMonitor
		if sm == nil || len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != "metrics" || sm.Spec.Endpoints[0].Path != "/metrics" {
			t.Fatalf("ServiceMonitor %+v, want one endpoint on port metrics, /metrics", sm)
		}
		for k, v := range sm.Spec.Selector.MatchLabels {
			if o.service.Labels[k] != v {
				t.Errorf("ServiceMonitor selects %s=%s, the Service has %q", k, v, o.service.Labels[k])
			}
		}
	})
	t.Run("pvc", func(t *testing.T) {
		docs, err := render(t, "--set", "modelRepository.source=pvc", "--set", "modelRepository.pvc.claimName=models")
		if err != nil {
			t.Fatal(err)
		}
		pod := &decode(t, docs).deployment.Spec.Template.Spec
		checkPod(t, pod)
		if len(pod.InitContainers) != 0 {
			t.Errorf("init containers %d, want none with a PVC", len(pod.InitContainers))
		}
		if !slices.ContainsFunc(pod.Volumes, func(v corev1.Volume) bool {
			return v.Name == "models" && v.PersistentVolumeClaim != nil && v.PersistentVolumeClaim.ClaimName == "models" && v.PersistentVolumeClaim.ReadOnly
		}) {
			t.Errorf("no read-only models volume from claim models: %+v", pod.Volumes)
		}
	})
	t.Run("host path", func(t *testing.T) {
		docs, err := render(t, "--set", "modelRepository.source=hostPath", "--set", "modelRepository.hostPath.path=/srv/models")
		if err != nil {
			t.Fatal(err)
		}
		pod := &decode(t, docs).deployment.Spec.Template.Spec
		if !slices.ContainsFunc(pod.Volumes, func(v corev1.Volume) bool {
			return v.Name == "models" && v.HostPath != nil && v.HostPath.Path == "/srv/models"
		}) {
			t.Errorf("no models volume from /srv/models: %+v", pod.Volumes)
		}
	})
	t.Run("config merged", func(t *testing.T) {
		docs, err := render(t, "--set", "config.qos.policy=fifo", "--set", "ports.http=9000", "--set", "config.listen.http=:1")
		if err != nil {
			t.Fatal(err)
		}
		o := decode(t, docs)
		cfg := serverConfig(t, o.configMap)
		if cfg.QoS.Policy != "fifo" || cfg.Listen.HTTP != ":9000" {
			t.Errorf("qos.policy %q, listen.http %q: want the values' fifo and the chart's own :9000", cfg.QoS.Policy, cfg.Listen.HTTP)
		}
	})
	t.Run("autoscaling", func(t *testing.T) {
		docs, err := render(t, "--set", "autoscaling.enabled=true", "--set", "replicas=3")
		if err != nil {
			t.Fatal(err)
		}
		// An HPA or KEDA owns the count: a rendered count would reset the
		// scale on every upgrade.
		if r := decode(t, docs).deployment.Spec.Replicas; r != nil {
			t.Errorf("replicas %d rendered with autoscaling.enabled", *r)
		}
	})
	t.Run("profile cache on a claim", func(t *testing.T) {
		docs, err := render(t, "--set", "profileCache.source=pvc", "--set", "profileCache.pvc.claimName=profiles")
		if err != nil {
			t.Fatal(err)
		}
		o := decode(t, docs)
		cfg := serverConfig(t, o.configMap)
		pod := &o.deployment.Spec.Template.Spec
		var mount *corev1.VolumeMount
		for _, m := range container(t, pod, "sloserve").VolumeMounts {
			if strings.HasPrefix(cfg.Control.Profile.CacheDir, m.MountPath+"/") {
				mount = &m
			}
		}
		if mount == nil || mount.ReadOnly {
			t.Fatalf("control.profile.cache_dir %s is on no writable mount", cfg.Control.Profile.CacheDir)
		}
		if !slices.ContainsFunc(pod.Volumes, func(v corev1.Volume) bool {
			return v.Name == mount.Name && v.PersistentVolumeClaim != nil && v.PersistentVolumeClaim.ClaimName == "profiles" && !v.PersistentVolumeClaim.ReadOnly
		}) {
			t.Errorf("the profile cache's volume %s is not the writable claim profiles: %+v", mount.Name, pod.Volumes)
		}
	})
	t.Run("prometheus rule", func(t *testing.T) {
		docs, err := render(t, "--set", "prometheusRule.enabled=true", "--set", "prometheusRule.labels.release=kube-prometheus")
		if err != nil {
			t.Fatal(err)
		}
		o := decode(t, docs)
		pr := o.prometheusRule
		if pr == nil || pr.Labels["release"] != "kube-prometheus" {
			t.Fatalf("PrometheusRule %+v, want one with the values' labels", pr)
		}
		// Every group and rule of the project's rule file, unchanged.
		b, err := os.ReadFile("../configs/prometheus/rules.yml")
		if err != nil {
			t.Fatal(err)
		}
		var want ruleGroups
		if err := strict(b, &want); err != nil {
			t.Fatal(err)
		}
		got, _ := yaml.Marshal(pr.Spec)
		wantB, _ := yaml.Marshal(want)
		if len(want.Groups) == 0 || !bytes.Equal(got, wantB) {
			t.Errorf("the PrometheusRule's groups differ from configs/prometheus/rules.yml:\n%s\nwant\n%s", got, wantB)
		}
	})
	t.Run("grafana dashboard", func(t *testing.T) {
		docs, err := render(t, "--set", "grafanaDashboard.enabled=true")
		if err != nil {
			t.Fatal(err)
		}
		cm := decode(t, docs).dashboard
		if cm == nil || cm.Labels["grafana_dashboard"] != "1" {
			t.Fatalf("dashboard ConfigMap %v, want one labelled grafana_dashboard=1 for Grafana's sidecar", cm)
		}
		b, err := os.ReadFile("../configs/grafana/sloserve-dashboard.json")
		if err != nil {
			t.Fatal(err)
		}
		if got := cm.Data["sloserve-dashboard.json"]; strings.TrimSpace(got) != strings.TrimSpace(string(b)) {
			t.Errorf("the ConfigMap's dashboard (%d bytes) is not configs/grafana/sloserve-dashboard.json (%d bytes)", len(got), len(b))
		}
	})
	t.Run("kubernetes 1.29 refused", func(t *testing.T) {
		// The preStop sleep action is on by default only from 1.30.
		out, err := exec.Command(helm(t), "template", release, chartDir, "--kube-version", "1.29.9").CombinedOutput()
		if err == nil || !strings.Contains(string(out), "kubeVersion") {
			t.Errorf("rendering for 1.29: %v\n%s; want the chart's kubeVersion refusing it", err, out)
		}
	})
	// values.schema.json: a misspelt key or a wrong type fails the
	// install, naming the value, instead of being ignored.
	for _, bad := range []struct{ set, want string }{
		{"replica=2", "additional properties 'replica' not allowed"},
		{"replicas=two", "/replicas"},
		{"ports.http=0", "/ports/http"},
		{"service.type=Ingress", "/service/type"},
		{"profileCache.source=s3", "/profileCache/source"},
		{"gpu.enabeld=true", "additional properties 'enabeld' not allowed"},
	} {
		t.Run("schema "+bad.set, func(t *testing.T) {
			_, err := render(t, "--set", bad.set)
			if err == nil || !strings.Contains(err.Error(), bad.want) {
				t.Errorf("render = %v, want the schema refusing it (%q)", err, bad.want)
			}
		})
	}
	for _, bad := range []struct{ name, want string }{
		{"profileCache.source=pvc", "profileCache.pvc.claimName is required"},
		{"modelRepository.source=pvc", "claimName is required"},
		{"modelRepository.source=hostPath", "hostPath.path is required"},
		{"modelRepository.source=s3", "value must be one of 'emptyDir', 'pvc', 'hostPath'"},
	} {
		t.Run(bad.name, func(t *testing.T) {
			_, err := render(t, "--set", bad.name)
			if err == nil || !strings.Contains(err.Error(), bad.want) {
				t.Errorf("render = %v, want a failure saying %q", err, bad.want)
			}
		})
	}
}

// flagValue returns the value of --name=value in args.
func flagValue(args []string, name string) string {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v
		}
	}
	return ""
}

func TestKServe(t *testing.T) {
	rt := readManifest(t, "kserve/clusterservingruntime.yaml").servingRuntime
	if rt == nil {
		t.Fatal("no ClusterServingRuntime")
	}
	s := rt.Spec
	if !slices.ContainsFunc(s.SupportedModelFormats, func(f struct {
		Name       string `json:"name"`
		Version    string `json:"version"`
		AutoSelect *bool  `json:"autoSelect"`
		Priority   *int32 `json:"priority"`
	}) bool {
		// Selected only when named: an auto-selected runtime would take
		// over every ONNX InferenceService that names none.
		return f.Name == "onnx" && (f.AutoSelect == nil || !*f.AutoSelect) && f.Priority == nil
	}) {
		t.Errorf("supportedModelFormats %+v: want onnx, not auto-selected, no priority", s.SupportedModelFormats)
	}
	if !slices.Equal(s.ProtocolVersions, []string{"v2", "grpc-v2"}) {
		t.Errorf("protocolVersions %v, want [v2 grpc-v2]", s.ProtocolVersions)
	}
	if len(s.Containers) != 1 || s.Containers[0].Name != "kserve-container" {
		t.Fatalf("want one container named kserve-container (KServe merges the InferenceService's into it), got %d", len(s.Containers))
	}
	c := s.Containers[0]
	if c.Args[0] != "serve" || flagValue(c.Args, "model-dir") != "/mnt/models" || flagValue(c.Args, "model-name") != "{{.Name}}" {
		t.Errorf("args %v: want serve --model-dir=/mnt/models --model-name={{.Name}}", c.Args)
	}
	httpPort, grpcPort, metricsPort := port(t, flagValue(c.Args, "http-addr")), port(t, flagValue(c.Args, "grpc-addr")), port(t, flagValue(c.Args, "metrics-addr"))
	if len(c.Ports) != 1 || c.Ports[0].ContainerPort != httpPort {
		t.Errorf("ports %+v, want the one REST port %d", c.Ports, httpPort)
	}
	if got := s.Annotations["prometheus.kserve.io/port"]; got != strconv.Itoa(int(metricsPort)) || s.Annotations["prometheus.kserve.io/path"] != "/metrics" {
		t.Errorf("prometheus annotations %v, want port %d path /metrics", s.Annotations, metricsPort)
	}
	for _, p := range []struct {
		what  string
		probe *corev1.Probe
		path  string
	}{{"liveness", c.LivenessProbe, "/v2/health/live"}, {"readiness", c.ReadinessProbe, "/v2/health/ready"}} {
		if p.probe == nil || p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != p.path || p.probe.HTTPGet.Port.IntVal != httpPort {
			t.Errorf("%s probe %+v, want GET %s on %d", p.what, p.probe, p.path, httpPort)
		}
	}
	if sc := c.SecurityContext; sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Errorf("securityContext %+v: want non-root, no privilege escalation", sc)
	}
	// Every environment variable the runtime sets is a server setting.
	keys := map[string]bool{}
	for _, k := range configs.Keys() {
		keys[configs.EnvVar(k)] = true
	}
	for _, e := range c.Env {
		if strings.HasPrefix(e.Name, configs.EnvPrefix) && !keys[e.Name] {
			t.Errorf("env %s is no server setting", e.Name)
		}
		if e.Name == "SLOSERVE_LIMITS_SHUTDOWN_DELAY" {
			cfg := configs.DefaultServer()
			if err := cfg.ApplyEnv([]string{e.Name + "=" + e.Value}); err != nil {
				t.Error(err)
			}
		}
	}

	isvcs := readManifest(t, "kserve/inferenceservice.yaml").isvcs
	if len(isvcs) != 2 {
		t.Fatalf("%d InferenceServices, want 2 (REST and gRPC)", len(isvcs))
	}
	for _, isvc := range isvcs {
		m := isvc.Spec.Predictor.Model
		if m.Runtime != rt.Name || m.ModelFormat.Name != "onnx" || !slices.Contains(s.ProtocolVersions, m.ProtocolVersion) || m.StorageURI == "" {
			t.Errorf("%s: runtime %q, format %q, protocol %q, storage %q: want the runtime %s, onnx, one of %v",
				isvc.Name, m.Runtime, m.ModelFormat.Name, m.ProtocolVersion, m.StorageURI, rt.Name, s.ProtocolVersions)
		}
		if m.ProtocolVersion == "grpc-v2" {
			if len(m.Ports) != 1 || m.Ports[0].Name != "h2c" || m.Ports[0].ContainerPort != grpcPort {
				t.Errorf("%s: ports %+v, want h2c on the runtime's gRPC port %d", isvc.Name, m.Ports, grpcPort)
			}
		}
	}
}

func TestModelMeshRuntime(t *testing.T) {
	rt := readManifest(t, "modelmesh/servingruntime.yaml").servingRuntime
	if rt == nil || rt.Kind != "ServingRuntime" {
		t.Fatal("no ServingRuntime")
	}
	s := rt.Spec
	if s.MultiModel == nil || !*s.MultiModel || len(s.Containers) != 1 {
		t.Fatalf("want a multi-model runtime with one container, got multiModel %v, %d containers", s.MultiModel, len(s.Containers))
	}
	// The container's arguments make a valid server config, and the
	// endpoints ModelMesh is told are the ports it listens on.
	cfg := configs.DefaultServer()
	args := s.Containers[0].Args
	if args[0] != "serve" {
		t.Fatalf("args %v do not run serve", args)
	}
	shorthand := map[string]string{"model-control": "model_control", "grpc-addr": "listen.grpc", "http-addr": "listen.http", "metrics-addr": "listen.metrics", "log-format": "log.format"}
	for _, a := range args[1:] {
		name, value, ok := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !ok {
			t.Fatalf("argument %q: want --flag=value", a)
		}
		key := shorthand[name]
		if name == "set" {
			key, value, _ = strings.Cut(value, "=")
		}
		if key == "" {
			t.Fatalf("argument %q is no serve flag this test knows", a)
		}
		if err := cfg.Set(key, value); err != nil {
			t.Fatal(err)
		}
	}
	// The capacity ModelMesh fills is the container's memory request,
	// through the Downward API (in bytes, as the kubelet gives it), and
	// the limit leaves the server its own room above it.
	c := s.Containers[0]
	var budgetEnv *corev1.EnvVar
	for i := range c.Env {
		if c.Env[i].Name == configs.EnvVar("control.memory_budget") {
			budgetEnv = &c.Env[i]
		}
	}
	if budgetEnv == nil || budgetEnv.ValueFrom == nil || budgetEnv.ValueFrom.ResourceFieldRef == nil {
		t.Fatalf("no %s from the Downward API: %+v", configs.EnvVar("control.memory_budget"), c.Env)
	}
	ref := budgetEnv.ValueFrom.ResourceFieldRef
	if ref.Resource != "requests.memory" || ref.ContainerName != c.Name || (!ref.Divisor.IsZero() && ref.Divisor.Value() != 1) {
		t.Errorf("capacity from %+v, want requests.memory of %s in bytes", ref, c.Name)
	}
	request, limit := c.Resources.Requests[corev1.ResourceMemory], c.Resources.Limits[corev1.ResourceMemory]
	if err := cfg.ApplyEnv([]string{budgetEnv.Name + "=" + strconv.FormatInt(request.Value(), 10)}); err != nil {
		t.Fatalf("the kubelet's value of the request does not set the budget: %v", err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("the runtime's arguments make an invalid config: %v", err)
	}
	if int64(cfg.Control.MemoryBudget) != request.Value() || request.Value() <= 0 {
		t.Errorf("control.memory_budget %d, want the memory request %d", cfg.Control.MemoryBudget, request.Value())
	}
	if room := limit.Value() - request.Value(); room < int64(cfg.Limits.MaxMemory)+256<<20 {
		t.Errorf("memory limit %s leaves %d bytes above the request, want at least limits.max_memory %d + 256 MiB", limit.String(), room, cfg.Limits.MaxMemory)
	}
	for _, e := range []struct{ endpoint, addr string }{{s.GRPCEndpoint, cfg.Listen.ModelMesh}, {s.GRPCDataEndpoint, cfg.Listen.GRPC}} {
		if e.endpoint != fmt.Sprintf("port:%d", port(t, e.addr)) {
			t.Errorf("endpoint %q, the server listens on %s", e.endpoint, e.addr)
		}
	}
}

// recorded returns the recording rules of configs/prometheus/rules.yml.
func recorded(t *testing.T) map[string]bool {
	t.Helper()
	b, err := os.ReadFile("../configs/prometheus/rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Rules []struct {
				Record string `json:"record"`
			} `json:"rules"`
		} `json:"groups"`
	}
	if err := yaml.Unmarshal(b, &rules); err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Record != "" {
				names[r.Record] = true
			}
		}
	}
	return names
}

// seriesRE finds the recorded series (level:metric:operations) a query names.
var seriesRE = regexp.MustCompile(`[a-z_]+:sloserve_[a-z0-9_]+:[a-z0-9_]+`)

func checkQuery(t *testing.T, what, query string, rules map[string]bool) {
	t.Helper()
	names := seriesRE.FindAllString(query, -1)
	if len(names) == 0 {
		t.Errorf("%s: query %q reads no recording rule of configs/prometheus/rules.yml", what, query)
	}
	for _, n := range names {
		if !rules[n] {
			t.Errorf("%s: %s is not recorded by configs/prometheus/rules.yml", what, n)
		}
	}
}

func TestAutoscaling(t *testing.T) {
	rules := recorded(t)
	docs, err := render(t)
	if err != nil {
		t.Fatal(err)
	}
	deployment := decode(t, docs).deployment.Name

	so := readManifest(t, "autoscaling/keda-scaledobject.yaml").scaledObject
	if so == nil {
		t.Fatal("no ScaledObject")
	}
	ref := so.Spec.ScaleTargetRef
	if ref.APIVersion != "apps/v1" || ref.Kind != "Deployment" || ref.Name != deployment {
		t.Errorf("scaleTargetRef %+v, want the chart's Deployment %s", ref, deployment)
	}
	if so.Spec.MinReplicaCount == nil || so.Spec.MaxReplicaCount == nil || *so.Spec.MinReplicaCount < 1 || *so.Spec.MaxReplicaCount <= *so.Spec.MinReplicaCount {
		t.Errorf("replicas %v..%v, want 1 <= min < max", so.Spec.MinReplicaCount, so.Spec.MaxReplicaCount)
	}
	if b := so.Spec.Advanced.HorizontalPodAutoscalerConfig.Behavior; b == nil || b.ScaleDown == nil || b.ScaleDown.StabilizationWindowSeconds == nil {
		t.Error("no scale-down stabilization: the burn-rate trigger would scale down the moment the SLO is met")
	}
	if len(so.Spec.Triggers) == 0 {
		t.Fatal("no triggers")
	}
	for _, tr := range so.Spec.Triggers {
		if tr.Type != "prometheus" || !slices.Contains([]string{"Value", "AverageValue"}, tr.MetricType) {
			t.Errorf("trigger %s: type %q, metricType %q", tr.Name, tr.Type, tr.MetricType)
		}
		for k := range tr.Metadata {
			if !slices.Contains([]string{"serverAddress", "query", "threshold", "activationThreshold"}, k) {
				t.Errorf("trigger %s: metadata %s is not a setting of KEDA's prometheus scaler", tr.Name, k)
			}
		}
		if _, err := strconv.ParseFloat(tr.Metadata["threshold"], 64); err != nil || tr.Metadata["serverAddress"] == "" {
			t.Errorf("trigger %s: threshold %q, serverAddress %q", tr.Name, tr.Metadata["threshold"], tr.Metadata["serverAddress"])
		}
		checkQuery(t, "KEDA trigger "+tr.Name, tr.Metadata["query"], rules)
	}

	b, err := os.ReadFile("autoscaling/prometheus-adapter-rules.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var adapter adapterRules
	if err := strict(b, &adapter); err != nil {
		t.Fatalf("prometheus-adapter rules: %v", err)
	}
	external := map[string]bool{}
	for _, r := range adapter.ExternalRules {
		external[r.Name.As] = true
		checkQuery(t, "adapter rule "+r.Name.As, r.SeriesQuery+" "+r.MetricsQuery, rules)
	}
	hpa := readManifest(t, "autoscaling/hpa.yaml").hpa
	if hpa == nil {
		t.Fatal("no HorizontalPodAutoscaler")
	}
	if r := hpa.Spec.ScaleTargetRef; r.APIVersion != "apps/v1" || r.Kind != "Deployment" || r.Name != deployment {
		t.Errorf("scaleTargetRef %+v, want the chart's Deployment %s", r, deployment)
	}
	if len(hpa.Spec.Metrics) == 0 {
		t.Fatal("the HPA has no metrics")
	}
	for _, m := range hpa.Spec.Metrics {
		if m.Type != autoscalingv2.ExternalMetricSourceType || m.External == nil || !external[m.External.Metric.Name] {
			t.Errorf("HPA metric %+v is not one of the adapter's external metrics %v", m, external)
		}
	}
}
