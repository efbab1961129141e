package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// A model with execution.isolation in-process runs inside the server: no
// runner process, the same answers as the same model in a runner process
// (to the last bits, see below), bad input refused as for any model, and
// concurrent requests served through its one session.
func TestE2EInProcess(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo,
		repoModel{"tiny", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\nexecution: {isolation: in-process, intra_op_threads: 1}\n"},
		repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\nexecution: {intra_op_threads: 1}\n"},
	)
	s := startServer(t, repo, "")

	if pids := s.runnerPids(t, "/tiny/1/model.onnx"); len(pids) != 0 {
		t.Errorf("in-process model has runner processes %v", pids)
	}
	if pids := s.runnerPids(t, "/dyn/1/model.onnx"); len(pids) != 1 {
		t.Errorf("process model has runner processes %v, want one", pids)
	}
	if code, b, _ := s.do(t, "GET", "/v2/models/tiny/ready", nil); code != 200 {
		t.Fatalf("tiny not ready: %d %s", code, b)
	}

	// Binary in and out, so that the comparison is bit for bit.
	infer := func(t *testing.T, model string, rows int, flat []float32) []byte {
		t.Helper()
		header, _ := json.Marshal(jsonInferRequest{
			Inputs: []jsonTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{int64(rows), 10},
				Parameters: map[string]any{"binary_data_size": 40 * rows}}},
			Parameters: map[string]any{"binary_data_output": true},
		})
		code, b, h := s.do(t, "POST", "/v2/models/"+model+"/infer", append(header, f32bytes(flat)...),
			"Inference-Header-Content-Length", strconv.Itoa(len(header)), "Content-Type", "application/octet-stream")
		if code != 200 {
			t.Fatalf("%s: status %d: %s", model, code, b)
		}
		n, err := strconv.Atoi(h.Get("Inference-Header-Content-Length"))
		if err != nil || n > len(b) {
			t.Fatalf("%s: header length %q: %v", model, h.Get("Inference-Header-Content-Length"), err)
		}
		return b[n:]
	}
	rng := rand.New(rand.NewPCG(17, 1))
	for _, rows := range []int{1, 5, 8} {
		m, flat := randomRows(rng, rows, 10)
		got := infer(t, "tiny", rows, flat)
		closeTo(t, "row sums", bytesF32(got), rowSums(m), 1e-5)
		// Not bit for bit: ONNX Runtime's kernels sum in an order that
		// depends on the alignment of the input, which here is wherever the
		// tensor starts in the request body, and in the runner the arena's.
		closeTo(t, "in-process against the runner process", bytesF32(got), bytesF32(infer(t, "dyn", rows, flat)), 1e-6)
	}

	var bad jsonInferResponse
	code := s.json(t, "POST", "/v2/models/tiny/infer", jsonInferRequest{
		Inputs: []jsonTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{1, 9}, Data: make([]float32, 9)}},
	}, &bad)
	if code != 400 || bad.Error == "" {
		t.Errorf("wrong shape: status %d, error %q; want 400 with a message", code, bad.Error)
	}

	// Many requests at once through the one session; goroutines report
	// instead of failing the test themselves.
	post := func(flat []float32) (jsonInferResponse, error) {
		var resp jsonInferResponse
		body, _ := json.Marshal(jsonInferRequest{
			Inputs: []jsonTensor{{Name: "input_vectors", Datatype: "FP32", Shape: []int64{3, 10}, Data: flat}},
		})
		r, err := s.client.Post(s.http+"/v2/models/tiny/infer", "application/json", bytes.NewReader(body))
		if err != nil {
			return resp, err
		}
		defer r.Body.Close()
		if err := json.NewDecoder(r.Body).Decode(&resp); err != nil {
			return resp, err
		}
		if r.StatusCode != 200 {
			return resp, fmt.Errorf("status %d: %s", r.StatusCode, resp.Error)
		}
		return resp, nil
	}
	errs := make(chan error, 32)
	for w := range 4 {
		go func() {
			r := rand.New(rand.NewPCG(uint64(w), 3))
			for range 8 {
				m, flat := randomRows(r, 3, 10)
				resp, err := post(flat)
				if err == nil && (len(resp.Outputs) != 1 || len(resp.Outputs[0].Data) != 3) {
					err = fmt.Errorf("outputs %+v", resp.Outputs)
				}
				if err == nil {
					for i, want := range rowSums(m) {
						if d := resp.Outputs[0].Data[i] - want; d > 1e-3 || d < -1e-3 {
							err = fmt.Errorf("row %d sums to %v, want %v", i, resp.Outputs[0].Data[i], want)
						}
					}
				}
				errs <- err
			}
		}()
	}
	for range 32 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}

	if err := s.stop(); err != nil {
		t.Errorf("stop: %v", err)
	}
	if log := s.log.String(); !strings.Contains(log, "in-process instance started") {
		t.Errorf("no start of the in-process instance in the log:\n%s", log)
	}
}

// TestE2EInProcessWritesNoTelemetry: a server that loads ONNX Runtime
// itself, for an in-process model, keeps ONNX Runtime's telemetry off:
// nothing under $HOME, no mat-debug or .ses file in TMPDIR, before and
// after its stop. With ORT_DISABLE_TELEMETRY=0 in its environment the same
// server writes ONNX Runtime's database under $HOME: what the test watches
// for does show up where it looks. ONNX Runtime turns its telemetry off by
// itself where a CI system's variable is set, so the test clears those.
func TestE2EInProcessWritesNoTelemetry(t *testing.T) {
	for _, v := range []string{"ORT_DISABLE_TELEMETRY", "CI", "TF_BUILD", "GITHUB_ACTIONS", "GITLAB_CI", "CIRCLECI", "TRAVIS",
		"JENKINS_URL", "CODEBUILD_BUILD_ID", "BUILDKITE", "TEAMCITY_VERSION", "APPVEYOR", "BITBUCKET_BUILD_NUMBER", "XDG_CACHE_HOME"} {
		t.Setenv(v, "")
		os.Unsetenv(v)
	}
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{"tiny", testModel(t, "example_dynamic_axes.onnx"),
		"max_batch_size: 8\nexecution: {isolation: in-process, intra_op_threads: 1}\n"})
	db := filepath.Join(".cache", "Microsoft", "DeveloperTools", ".onnxruntime", "onnxruntime.db")
	// How long the database took to appear with telemetry on: the server
	// with it off is watched for twice as long.
	var took time.Duration
	for _, on := range []bool{true, false} {
		home, tmp := t.TempDir(), t.TempDir()
		t.Setenv("HOME", home)
		t.Setenv("TMPDIR", tmp)
		var opts []serverOption
		if on {
			opts = append(opts, withCommand("", nil, "ORT_DISABLE_TELEMETRY=0"))
		}
		start := time.Now()
		s := startServer(t, repo, "", opts...)
		var resp jsonInferResponse
		if code := s.json(t, "POST", "/v2/models/tiny/infer", json.RawMessage(dynBody), &resp); code != 200 || len(resp.Outputs) != 1 {
			t.Fatalf("telemetry on %v: infer: %d %+v", on, code, resp)
		}
		closeTo(t, "row sum", resp.Outputs[0].Data, []float64{55}, 1e-6)
		if on {
			waitFor(t, "ONNX Runtime's telemetry database under HOME with ORT_DISABLE_TELEMETRY=0", 30*time.Second, func() bool {
				_, err := os.Stat(filepath.Join(home, db))
				return err == nil
			})
			took = time.Since(start)
			if err := s.stop(); err != nil {
				t.Fatal(err)
			}
			continue
		}
		for time.Since(start) < 2*took {
			time.Sleep(10 * time.Millisecond)
		}
		// What the server wrote: under HOME nothing; in TMPDIR only its
		// own sloserve-<pid>-* folders, without ONNX Runtime's files.
		check := func(when string) {
			filepath.WalkDir(home, func(path string, d os.DirEntry, err error) error {
				if err == nil && path != home {
					t.Errorf("%s: written under HOME: %s", when, path)
				}
				return nil
			})
			filepath.WalkDir(tmp, func(path string, d os.DirEntry, err error) error {
				if err != nil || path == tmp {
					return nil
				}
				rel, _ := filepath.Rel(tmp, path)
				if !strings.HasPrefix(rel, fmt.Sprintf("sloserve-%d-", s.cmd.Process.Pid)) || strings.Contains(d.Name(), "mat-debug") || d.Name() == ".ses" {
					t.Errorf("%s: written in TMPDIR: %s", when, rel)
				}
				return nil
			})
		}
		check(fmt.Sprintf("%s after the start (the database took %s with telemetry on)", time.Since(start).Round(time.Millisecond), took.Round(time.Millisecond)))
		if err := s.stop(); err != nil {
			t.Fatal(err)
		}
		check("after the stop")
	}
}
