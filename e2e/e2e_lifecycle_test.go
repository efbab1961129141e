package e2e

import (
	"bytes"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
)

var multiBody = []byte(`{"inputs":[{"name":"InputA","datatype":"UINT8","shape":[1,1,1],"data":[3]},` +
	`{"name":"InputB","datatype":"FP64","shape":[1,2,2],"data":[1,2,3,4]}]}`)

// Explicit model control: nothing loads at start; the repository API loads
// and unloads over REST and gRPC.
func TestE2EExplicitModelControl(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo,
		repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"},
		repoModel{"bad", testModel(t, "example_dynamic_axes.onnx"), "instances: 0\n"},
	)
	s := startServer(t, repo, "model_control: explicit\n")
	if code, _, _ := s.do(t, "POST", "/v2/models/dyn/infer", dynBody); code != 503 {
		t.Errorf("infer before load: %d, want 503", code)
	}
	if code, b, _ := s.do(t, "POST", "/v2/repository/models/dyn/load", nil); code != 200 {
		t.Fatalf("load: %d %s", code, b)
	}
	if code, b, _ := s.do(t, "POST", "/v2/models/dyn/infer", dynBody); code != 200 {
		t.Fatalf("infer after load: %d %s", code, b)
	}
	code, b, _ := s.do(t, "POST", "/v2/repository/models/bad/load", nil)
	if code != 400 || !bytes.Contains(b, []byte("instances")) {
		t.Errorf("loading a bad config: %d %s, want 400 naming the field", code, b)
	}
	code, b, _ = s.do(t, "POST", "/v2/repository/models/..%2F..%2Fetc/load", nil)
	if code != 400 && code != 404 {
		t.Errorf("path traversal load: %d %s", code, b)
	}
	if _, err := s.grpc.RepositoryModelUnload(t.Context(), &inference.RepositoryModelUnloadRequest{ModelName: "dyn"}); err != nil {
		t.Fatal(err)
	}
	if r, err := s.grpc.ModelReady(t.Context(), &inference.ModelReadyRequest{Name: "dyn"}); err != nil || r.Ready {
		t.Errorf("ready after unload = %v, %v", r, err)
	}
	idx, err := s.grpc.RepositoryIndex(t.Context(), &inference.RepositoryIndexRequest{})
	if err != nil {
		t.Fatal(err)
	}
	states := map[string]string{}
	for _, m := range idx.Models {
		states[m.Name] = m.State + ":" + m.Reason
	}
	if !strings.HasPrefix(states["dyn"], "UNAVAILABLE") || !strings.Contains(states["bad"], "instances") {
		t.Errorf("index = %v", states)
	}
	_, err = s.grpc.RepositoryModelLoad(t.Context(), &inference.RepositoryModelLoadRequest{ModelName: "missing"})
	if status.Code(err) != codes.NotFound {
		t.Errorf("load of a missing model: %v, want NotFound", err)
	}
}

// Poll mode: a model folder added while the server runs is loaded, and one
// removed is unloaded.
func TestE2EPollRepository(t *testing.T) {
	repo := t.TempDir()
	dyn := testModel(t, "example_dynamic_axes.onnx")
	writeRepo(t, repo, repoModel{"dyn", dyn, "max_batch_size: 8\n"})
	s := startServer(t, repo, "model_control: poll\npoll_interval: 200ms\n")
	addModel(t, repo, repoModel{"multi", testModel(t, "example_multitype.onnx"), ""}, 1)
	waitFor(t, "multi to load", 30*time.Second, func() bool {
		code, _, _ := s.do(t, "POST", "/v2/models/multi/infer", multiBody)
		return code == 200
	})
	if err := os.RemoveAll(filepath.Join(repo, "dyn")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "dyn to unload", 30*time.Second, func() bool {
		code, _, _ := s.do(t, "GET", "/v2/models/dyn", nil)
		return code == 404
	})
	waitFor(t, "dyn's runner to exit", 10*time.Second, func() bool { return len(s.runnerPids(t, filepath.Join(repo, "dyn"))) == 0 })
}

// The embedded default config serves the demo repository from the current
// directory: what `make run` starts.
func TestE2EDefaultConfigServesDemoModels(t *testing.T) {
	demo := need(t, "SLOSERVE_DEMO_REPOSITORY")
	// The server reads SLOSERVE_ONNXRUNTIME_LIBRARY from the environment.
	s := startServer(t, "", "", withCommandLine(filepath.Dir(demo), "--log-format", "json"))
	base := s.http
	resp, err := http.Post(base+"/v2/repository/index", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	var idx []struct{ Name, Version, State, Reason string }
	if err := json.NewDecoder(resp.Body).Decode(&idx); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	var ready []string
	for _, e := range idx {
		if e.State == "READY" {
			ready = append(ready, e.Name)
		} else {
			t.Errorf("demo model %s is %s: %s", e.Name, e.State, e.Reason)
		}
	}
	if strings.Join(ready, ",") != "ocr-cls,ocr-det,ocr-rec,wakeword-hello,wakeword-namaste" {
		t.Errorf("ready demo models = %v", ready)
	}
	// The classifier answers a 2-class probability distribution.
	body := `{"inputs":[{"name":"x","datatype":"FP32","shape":[1,3,48,192],"data":[` +
		strings.TrimSuffix(strings.Repeat("0.5,", 3*48*192), ",") + `]}]}`
	resp, err = http.Post(base+"/v2/models/ocr-cls/infer", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out jsonInferResponse
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || len(out.Outputs) != 1 || len(out.Outputs[0].Data) != 2 {
		t.Fatalf("ocr-cls: %d %+v", resp.StatusCode, out)
	}
	if p := out.Outputs[0].Data; p[0] < 0 || p[1] < 0 || p[0]+p[1] < 0.999 || p[0]+p[1] > 1.001 {
		t.Errorf("ocr-cls probabilities %v do not sum to 1", p)
	}
	if !strings.Contains(s.log.String(), `"msg":"server ready"`) {
		t.Error("--log-format json did not produce JSON logs")
	}
}
