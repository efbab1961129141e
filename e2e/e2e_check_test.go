package e2e

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// checkOutput runs sloserve check and returns its output and exit code.
func checkOutput(t *testing.T, args ...string) (string, int) {
	t.Helper()
	stdout, stderr, err := runSloserve(append([]string{"check"}, args...)...)
	code := 0
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		code = exit.ExitCode()
	case err != nil:
		t.Fatal(err)
	}
	return stdout + stderr, code
}

// problemsOf is the problem lines check printed under a model's FAILED.
func problemsOf(out, model string) []string {
	var lines []string
	in := false
	for _, l := range strings.Split(out, "\n") {
		switch {
		case strings.HasPrefix(l, "  "+model+": FAILED"):
			in = true
		case in && strings.HasPrefix(l, "    "):
			lines = append(lines, strings.TrimSpace(l))
		case in:
			return lines
		}
	}
	return lines
}

// sloserve check validates a server config and a repository of both
// formats without serving, prints each problem as the server words it
// (file, field, line), and exits 1 on any; a good one exits 0.
func TestE2ECheck(t *testing.T) {
	dyn := testModel(t, "example_dynamic_axes.onnx")
	good := t.TempDir()
	writeRepo(t, good, repoModel{"yaml", dyn, "max_batch_size: 8\nslo: {latency_ms: 50}\n"})
	// A warning is no failure.

	tritonFolder(t, good, "pbtxt", dyn, "max_batch_size: 2\ninput [ { name: \"input_vectors\", data_type: TYPE_FP32, dims: [ 10 ] } ]\n")
	tritonFolder(t, good, "auto", dyn, "")

	t.Run("good", func(t *testing.T) {
		out, code := checkOutput(t, "--repository", good)
		if code != 0 {
			t.Fatalf("exit %d:\n%s", code, out)
		}
		for _, want := range []string{
			"Checking server config the embedded default\n  SUCCESS",
			"Checking repository " + good,
			"  auto: SUCCESS (no config file, completed from the model; versions [1]; max_batch_size 4, 1 inputs, 1 outputs, auto",
			"  pbtxt: SUCCESS (config.pbtxt; versions [1]; max_batch_size 2, 1 inputs, 1 outputs, auto (cpu here; the GPU on a server with one))",
			"  yaml: SUCCESS (config.yaml; versions [1]; max_batch_size 8, 0 inputs, 0 outputs, cpu, best-effort 50ms)",
		} {
			if !strings.Contains(out, want) {
				t.Errorf("output lacks %q:\n%s", want, out)
			}
		}
		if !strings.Contains(out, "pbtxt/config.pbtxt: dynamic_batching: not given") {
			t.Errorf("no warning for pbtxt's config:\n%s", out)
		}
	})

	t.Run("bad server config", func(t *testing.T) {
		cfg := filepath.Join(t.TempDir(), "server.yaml")
		if err := os.WriteFile(cfg, []byte("repositories: ["+good+"]\npoll_intervall: 1s\nlimits: {max_batch_size: -1}\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		out, code := checkOutput(t, "--config", cfg)
		if code != 1 || !strings.Contains(out, "  FAILED\n") ||
			!strings.Contains(out, cfg+": poll_intervall: unknown field (line 2)") || strings.Contains(out, "Checking repository") {
			t.Errorf("exit %d:\n%s", code, out)
		}
		// The same config as serve reads it: serve refuses it with the
		// same words.
		_, stderr, err := runSloserve("serve", "--config", cfg)
		if err == nil || !strings.Contains(stderr, cfg+": poll_intervall: unknown field (line 2)") {
			t.Errorf("serve: %v %s", err, stderr)
		}
	})

	t.Run("usage and a missing repository", func(t *testing.T) {
		if out, code := checkOutput(t, "extra"); code != 1 || !strings.Contains(out, `sloserve check: unexpected arguments ["extra"]`) || strings.Contains(out, "Checking") {
			t.Errorf("an argument: exit %d:\n%s", code, out)
		}
		missing := filepath.Join(t.TempDir(), "nothere")
		if out, code := checkOutput(t, "--repository", missing); code != 1 || !strings.Contains(out, "Checking repository "+missing+"\n  FAILED\n    open "+missing+": no such file or directory") {
			t.Errorf("a missing repository: exit %d:\n%s", code, out)
		}
	})

	bad := t.TempDir()
	writeRepo(t, bad, repoModel{"yamltypo", dyn, "max_batch: 4\nslo: {latency_ms: -1}\n"})
	tritonFolder(t, bad, "unsupported", dyn, "max_batch_size: 4\nsequence_batching {}\n")
	tritonFolder(t, bad, "mismatch", dyn, "max_batch_size: 4\ninput [ { name: \"input_vectors\", data_type: TYPE_FP32, dims: [ 11 ] } ]\n")
	tritonFolder(t, bad, "fixedbatch", testModel(t, "example_unicode.onnx"), "max_batch_size: 4\n")
	tritonFolder(t, bad, "overlimit", dyn, "max_batch_size: 64\n")
	if err := os.MkdirAll(filepath.Join(bad, "noversion"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bad, "noversion", "config.pbtxt"), []byte("max_batch_size: 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tritonFolder(t, bad, "fine", dyn, "")
	want := map[string][]string{
		"yamltypo":    {filepath.Join(bad, "yamltypo", "config.yaml") + ": max_batch: unknown field (line 2)", filepath.Join(bad, "yamltypo", "config.yaml") + ": slo.latency_ms: must be > 0, got -1 (line 3)"},
		"unsupported": {filepath.Join(bad, "unsupported", "config.pbtxt") + ": sequence_batching: not supported by sloserve (or not a Triton model config field) (line 2)"},
		"mismatch":    {`version 1: ` + filepath.Join(bad, "mismatch", "config.pbtxt") + `: input "input_vectors": config says shape [-1 11], the model file has [-1 10]`},
		"fixedbatch":  {filepath.Join(bad, "fixedbatch", "config.pbtxt") + `: max_batch_size: is 4, but "in" in `},
		"overlimit":   {filepath.Join(bad, "overlimit", "config.pbtxt") + ": max_batch_size: 64 is over the server's limits.max_batch_size (32)"},
		"noversion":   {filepath.Join(bad, "noversion") + ": no version folder with a model.onnx matches the version policy (found [])"},
	}
	out, code := checkOutput(t, "--repository", bad, "--set", "limits.max_batch_size=32")
	if code != 1 || !strings.Contains(out, "  fine: SUCCESS") {
		t.Fatalf("exit %d, want 1 and fine checked:\n%s", code, out)
	}
	for model, lines := range want {
		got := problemsOf(out, model)
		if len(got) != len(lines) {
			t.Errorf("%s: problems %q, want %q", model, got, lines)
			continue
		}
		for i := range lines {
			if !strings.HasPrefix(got[i], lines[i]) {
				t.Errorf("%s: problem %q, want it to start %q", model, got[i], lines[i])
			}
		}
	}

	t.Run("the server's words", func(t *testing.T) {
		// The server loading the same repository gives the same problems
		// (its index reasons hold check's lines), but for the model file
		// check, which the server leaves to ONNX Runtime.
		s := startServer(t, bad, "", withSet("limits.max_batch_size=32"))
		var index []struct {
			Name, State, Reason string
		}
		if code := s.json(t, "POST", "/v2/repository/index", nil, &index); code != 200 {
			t.Fatalf("index: %d", code)
		}
		reasons := map[string]string{}
		for _, e := range index {
			reasons[e.Name] += e.Reason
		}
		for model := range want {
			for _, line := range problemsOf(out, model) {
				if !strings.Contains(reasons[model], strings.TrimPrefix(line, "version 1: ")) {
					t.Errorf("%s: check says %q, the server %q", model, line, reasons[model])
				}
			}
		}
	})
}
