package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/sloserve/sloserve/api/inference"
)

// TestE2EBadModelConfigs: model configs that once killed the whole server
// (an input shape of 3e16 elements, a profile shape of 3.3e12, 20000
// intra-op threads, 17 versions served at once) each fail their own model
// with a reason naming the field, before any runner starts for them; the
// server starts, and the good model beside them serves the right numbers.
func TestE2EBadModelConfigs(t *testing.T) {
	repo := t.TempDir()
	det := demoModel(t, "ocr-det")
	writeRepo(t, repo,
		repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"},
		repoModel{"huge-dims", det, "max_batch_size: 2\ninputs: [{name: x, datatype: FP32, shape: [-1, 3, 100000000, 100000000]}]\n"},
		repoModel{"huge-profile", det, "max_batch_size: 2\nprofile: {shapes: {x: [1, 3, 1048576, 1048576]}}\n"},
		repoModel{"threads", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\nexecution: {intra_op_threads: 20000}\n"},
	)
	for v := 1; v <= 17; v++ {
		addModel(t, repo, repoModel{"versions", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\nversion_policy: {all: {}}\n"}, v)
	}
	s := startServer(t, repo, "")

	var resp jsonInferResponse
	if code := s.json(t, "POST", "/v2/models/dyn/infer", json.RawMessage(dynBody), &resp); code != 200 || len(resp.Outputs) != 1 {
		t.Fatalf("dyn beside the bad models: %d %+v", code, resp)
	}
	closeTo(t, "dyn's row sum", resp.Outputs[0].Data, []float64{55}, 1e-6)

	want := map[string]string{
		"huge-dims":    "inputs[0].shape: [-1 3 100000000 100000000] has more than limits.max_tensor_elements",
		"huge-profile": "profile.shapes.x: [1 3 1048576 1048576] has more than limits.max_tensor_elements",
		"threads":      "execution.intra_op_threads: must be between 0 and",
		"versions":     "version_policy: selects 17 versions, at most 16 may be served at once",
	}
	for _, e := range s.index(t) {
		if e.Name == "dyn" {
			if e.State != "READY" {
				t.Errorf("dyn: %+v, want READY", e)
			}
			continue
		}
		if e.State != "UNAVAILABLE" || !strings.Contains(e.Reason, want[e.Name]) || !strings.Contains(e.Reason, filepath.Join(repo, e.Name, "config.yaml")) {
			t.Errorf("%s: %+v, want UNAVAILABLE naming its config.yaml and %q", e.Name, e, want[e.Name])
		}
		if code, body, _ := s.do(t, "POST", "/v2/models/"+e.Name+"/infer", dynBody); code != http.StatusServiceUnavailable && code != http.StatusBadRequest {
			t.Errorf("infer %s: %d %s, want the model unavailable", e.Name, code, body)
		}
	}
	for name := range want {
		if pids := s.runnerPids(t, filepath.Join(repo, name)); len(pids) != 0 {
			t.Errorf("%s has runners %v, want none", name, pids)
		}
	}
	if pids := s.runnerPids(t, repo); len(pids) != 1 {
		t.Errorf("runners %v, want dyn's one", pids)
	}
}

// TestE2EKServeModelDirNotReady: with --model-dir, the server's readiness
// is its one model's: a model that fails to load leaves the server live
// (200) but not ready (REST 503, gRPC ServerReady false), so that KServe
// sends it no traffic.
func TestE2EKServeModelDirNotReady(t *testing.T) {
	lib := need(t, "SLOSERVE_ONNXRUNTIME_LIBRARY")
	mnt := t.TempDir()
	if err := os.WriteFile(filepath.Join(mnt, "model.onnx"), []byte("not an ONNX model"), 0o644); err != nil {
		t.Fatal(err)
	}
	ports := freePorts(t, 3)
	args := append([]string{"serve", "--http-addr", ports[0], "--grpc-addr", ports[1], "--metrics-addr", ports[2]}, kserveArgs(t, mnt, "broken")...)
	cmd := exec.Command(sloserveBin, args...)
	cmd.Dir = t.TempDir()
	cmd.Env = append(os.Environ(), "SLOSERVE_ONNXRUNTIME_LIBRARY="+lib)
	log := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("server exit: %v", err)
			}
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			t.Error("the server did not stop on SIGTERM")
		}
		if t.Failed() {
			t.Logf("server log:\n%s", log.String())
		}
	})
	base := "http://" + ports[0]
	get := func(path string) int {
		resp, err := http.Get(base + path)
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	// The load has failed once the index says so, with the reason.
	waitFor(t, "the model's load to fail", 60*time.Second, func() bool {
		resp, err := http.Post(base+"/v2/repository/index", "application/json", strings.NewReader("{}"))
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var idx []indexEntry
		if json.NewDecoder(resp.Body).Decode(&idx) != nil {
			return false
		}
		return len(idx) == 1 && idx[0].Name == "broken" && idx[0].State == "UNAVAILABLE" && idx[0].Reason != ""
	})
	if code := get("/v2/health/live"); code != 200 {
		t.Errorf("live: %d, want 200", code)
	}
	if code := get("/v2/health/ready"); code != http.StatusServiceUnavailable {
		t.Errorf("ready with its only model failed: %d, want 503", code)
	}
	if code := get("/v2/models/broken/ready"); code == 200 {
		t.Errorf("model ready: %d, want not 200", code)
	}
	conn, err := grpc.NewClient(ports[1], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if r, err := inference.NewGRPCInferenceServiceClient(conn).ServerReady(t.Context(), &inference.ServerReadyRequest{}); err != nil || r.Ready {
		t.Errorf("gRPC ServerReady: %v, %v; want not ready", r, err)
	}
}

// TestE2ERunnerTempFiles: 20 load and unload cycles leave nothing in the
// server's TMPDIR; ONNX Runtime's telemetry files (mat-debug-<pid>.log and
// .ses, one set per runner process) went to each runner's own folder in
// the socket folder and were removed with it.
func TestE2ERunnerTempFiles(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"})
	s := startServer(t, repo, "model_control: explicit\n")
	const cycles = 20
	for i := range cycles {
		if code, body, _ := s.do(t, "POST", "/v2/repository/models/dyn/load", nil); code != 200 {
			t.Fatalf("load %d: %d %s", i, code, body)
		}
		var resp jsonInferResponse
		if code := s.json(t, "POST", "/v2/models/dyn/infer", json.RawMessage(dynBody), &resp); code != 200 || len(resp.Outputs) != 1 {
			t.Fatalf("infer %d: %d %+v", i, code, resp)
		}
		closeTo(t, fmt.Sprintf("row sum %d", i), resp.Outputs[0].Data, []float64{55}, 1e-6)
		if code, body, _ := s.do(t, "POST", "/v2/repository/models/dyn/unload", nil); code != 200 {
			t.Fatalf("unload %d: %d %s", i, code, body)
		}
	}
	// The server's own folders (sloserve-<pid>-*) hold no runner's files
	// once the runners are gone; nothing else is there.
	var left []string
	filepath.WalkDir(tmp, func(path string, d os.DirEntry, err error) error {
		if err != nil || path == tmp {
			return err
		}
		rel, _ := filepath.Rel(tmp, path)
		if !strings.HasPrefix(rel, fmt.Sprintf("sloserve-%d-", s.cmd.Process.Pid)) || strings.Contains(rel, "runner-tmp-") || strings.Contains(d.Name(), "mat-debug") || d.Name() == ".ses" {
			left = append(left, rel)
		}
		return nil
	})
	if len(left) != 0 {
		t.Errorf("after %d load/unload cycles the server's TMPDIR holds %d entries: %v", cycles, len(left), left)
	}
}
