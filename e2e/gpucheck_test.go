package e2e

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestGPUCheckScript runs scripts/gpu-check.sh, the real-GPU day, on this
// machine, which has no GPU: it must refuse with exit code 2 and the
// reason, before it starts anything. Stand-ins for nvidia-smi (shell
// scripts printing what the real one prints for the query the script
// makes) give it a GPU in each mode it refuses, and one it accepts,
// which then stops at the missing CUDA build of ONNX Runtime (exit 1).
func TestGPUCheckScript(t *testing.T) {
	script, err := filepath.Abs(filepath.Join("..", "scripts", "gpu-check.sh"))
	if err != nil {
		t.Fatal(err)
	}
	// A PATH with the tools the script needs and no nvidia-smi.
	base := t.TempDir()
	for _, tool := range []string{"bash", "head", "wc", "dirname", "seq", "mktemp", "mkdir", "cat", "sha256sum", "cut", "awk", "mkfifo", "sleep", "env", "touch"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Fatalf("%s: %v", tool, err)
		}
		if err := os.Symlink(p, filepath.Join(base, tool)); err != nil {
			t.Fatal(err)
		}
	}
	cases := []struct {
		name   string
		smi    string // nvidia-smi's output for the script's query; "" no nvidia-smi
		fail   bool   // nvidia-smi exits 9
		code   int
		reason string
	}{
		{name: "no driver", code: 2, reason: "no NVIDIA driver here (nvidia-smi not found)"},
		{name: "driver fails", smi: "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver", fail: true, code: 2, reason: "nvidia-smi failed: NVIDIA-SMI has failed"},
		{name: "no GPU", smi: "", code: 2, reason: "nvidia-smi lists no GPU"},
		{name: "prohibited", smi: "0, NVIDIA A10, Prohibited, Disabled", code: 2, reason: "compute mode Prohibited, which refuses MPS clients"},
		{name: "MIG", smi: "0, NVIDIA A100-SXM4-40GB, Default, Enabled", code: 2, reason: "GPU 0 is in MIG mode"},
		{name: "usable GPU, no CUDA build", smi: "0, NVIDIA A10, Default, Disabled\n1, NVIDIA A10, Default, Disabled", code: 1, reason: "no CUDA build of ONNX Runtime at /nonexistent/libonnxruntime.so.1.30.0: run make setup-gpu first"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			bin := t.TempDir()
			if c.name != "no driver" {
				exit := "0"
				if c.fail {
					exit = "9"
				}
				body := "#!/bin/bash\n"
				if c.smi != "" {
					body += "cat <<'OUT'\n" + c.smi + "\nOUT\n"
				}
				body += "exit " + exit + "\n"
				if err := os.WriteFile(filepath.Join(bin, "nvidia-smi"), []byte(body), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			pipes := filepath.Join(t.TempDir(), "mps")
			cmd := exec.Command(script)
			cmd.Env = []string{
				"PATH=" + bin + ":" + base,
				"SLOSERVE_ONNXRUNTIME_GPU_LIBRARY=/nonexistent/libonnxruntime.so.1.30.0",
				"CUDA_MPS_PIPE_DIRECTORY=" + pipes,
			}
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			err := cmd.Run()
			var exitErr *exec.ExitError
			if !errors.As(err, &exitErr) || exitErr.ExitCode() != c.code {
				t.Fatalf("exit: %v, want code %d; stderr:\n%s", err, c.code, stderr.String())
			}
			if !strings.Contains(stderr.String(), c.reason) {
				t.Errorf("stderr does not give the reason %q:\n%s", c.reason, stderr.String())
			}
			// Nothing was started: no MPS pipe folder was made.
			if _, err := os.Stat(pipes); err == nil {
				t.Errorf("the script made an MPS pipe folder before refusing")
			}
		})
	}
}

// TestGPUCheckScriptRunsTheDay follows the script past its checks with
// stand-ins for the driver's tools and for sloserve: it starts an MPS
// control daemon on GPU 0 when none runs, runs the day once per
// POLICY_RUNS under the CUDA library, and stops the daemon it started.
func TestGPUCheckScriptRunsTheDay(t *testing.T) {
	script, err := filepath.Abs(filepath.Join("..", "scripts", "gpu-check.sh"))
	if err != nil {
		t.Fatal(err)
	}
	bin, dir := t.TempDir(), t.TempDir()
	for _, tool := range []string{"bash", "head", "wc", "dirname", "seq", "mktemp", "mkdir", "cat", "mkfifo", "sleep", "env", "touch"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Fatalf("%s: %v", tool, err)
		}
		if err := os.Symlink(p, filepath.Join(bin, tool)); err != nil {
			t.Fatal(err)
		}
	}
	log := filepath.Join(dir, "calls")
	write := func(name, body string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(bin, name), []byte("#!/bin/bash\n"+body), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write("nvidia-smi", "echo '0, NVIDIA A10, Default, Disabled'\n")
	// The daemon opens its control pipe; "quit" on stdin is logged.
	write("nvidia-cuda-mps-control", `if [ "$1" = -d ]; then
  echo "daemon gpus=$CUDA_VISIBLE_DEVICES" >>`+log+`
  mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"
else
  echo "control $(cat)" >>`+log+`
fi
`)
	write("sloserve", `echo "sloserve $* lib=$SLOSERVE_ONNXRUNTIME_LIBRARY" >>`+log+"\n")
	lib := filepath.Join(dir, "ort", "libonnxruntime.so.1.30.0")
	if err := os.MkdirAll(filepath.Dir(lib), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{lib, filepath.Join(dir, "ort", "libonnxruntime_providers_cuda.so")} {
		if err := os.WriteFile(f, nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out := filepath.Join(dir, "day")
	cmd := exec.Command(script)
	cmd.Env = []string{
		"PATH=" + bin,
		"SLOSERVE_ONNXRUNTIME_GPU_LIBRARY=" + lib,
		"SLOSERVE_BIN=" + filepath.Join(bin, "sloserve"),
		"CUDA_MPS_PIPE_DIRECTORY=" + filepath.Join(dir, "mps"),
		"CUDA_MPS_LOG_DIRECTORY=" + filepath.Join(dir, "mpslog"),
		"GPU_CHECK_OUT=" + out,
		"POLICY_RUNS=2",
		"SLOSERVE_CONTROL_PROFILE_CACHE_DIR=" + filepath.Join(dir, "profiles"),
	}
	// Two runs end in scripts/policy-medians.py, which needs python3 and
	// the runs' comparison.json: the stand-in writes none, so the
	// medians step fails; the runs before it are what is checked.
	stderr, _ := cmd.CombinedOutput()
	calls, err := os.ReadFile(log)
	if err != nil {
		t.Fatalf("no calls logged: %v\n%s", err, stderr)
	}
	scenario, _ := filepath.Abs(filepath.Join("..", "loadtest", "scenarios", "gpu-day-cuda.yaml"))
	want := "daemon gpus=0\n" +
		"sloserve loadtest --compare --out " + out + "-1 " + scenario + " lib=" + lib + "\n" +
		"sloserve loadtest --compare --out " + out + "-2 " + scenario + " lib=" + lib + "\n" +
		"control quit\n"
	if string(calls) != want {
		t.Errorf("calls:\n%s\nwant:\n%s\noutput:\n%s", calls, want, stderr)
	}
}
