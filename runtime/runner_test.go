package runtime

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sloserve/sloserve/internal/syncbuf"
)

// Little-endian encoders and decoders for test tensors.

func f32Bytes(v []float32) []byte {
	b := make([]byte, 0, 4*len(v))
	for _, x := range v {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(x))
	}
	return b
}

func f64Bytes(v []float64) []byte {
	b := make([]byte, 0, 8*len(v))
	for _, x := range v {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(x))
	}
	return b
}

func decodeF32(b []byte) []float32 {
	v := make([]float32, len(b)/4)
	for i := range v {
		v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return v
}

// f16Bits encodes a float32 that is exactly representable as a normal
// IEEE half (or zero) into its bits.
func f16Bits(t *testing.T, x float32) uint16 {
	t.Helper()
	if x == 0 {
		return 0
	}
	b := math.Float32bits(x)
	sign := uint16(b>>16) & 0x8000
	exp := int(b>>23&0xff) - 127 + 15
	mant := b & 0x7fffff
	if exp <= 0 || exp >= 31 || mant&0x1fff != 0 {
		t.Fatalf("%v is not a normal half", x)
	}
	return sign | uint16(exp)<<10 | uint16(mant>>13)
}

// bf16Value decodes bfloat16 bits: the top half of a float32.
func bf16Value(bits uint16) float32 { return math.Float32frombits(uint32(bits) << 16) }

func outputNamed(t *testing.T, resp *InferResponse, name string) Tensor {
	t.Helper()
	for _, o := range resp.Outputs {
		if o.Name == name {
			return o
		}
	}
	t.Fatalf("no output %q in %v", name, resp.Outputs)
	return Tensor{}
}

// rowSumsRequest is a random [batch,10] request for example_dynamic_axes
// and the row sums it should produce.
func rowSumsRequest(rng *rand.Rand, batch int) (*InferRequest, []float32) {
	in := make([]float32, 10*batch)
	want := make([]float32, batch)
	for i := range in {
		in[i] = rng.Float32()*2 - 1
		want[i/10] += in[i]
	}
	return &InferRequest{Inputs: []Tensor{{Name: "input_vectors", DataType: FP32, Shape: []int64{int64(batch), 10}, Data: f32Bytes(in)}}}, want
}

func checkRowSums(t *testing.T, resp *InferResponse, want []float32) {
	t.Helper()
	out := outputNamed(t, resp, "output_scalars")
	if out.DataType != FP32 || !slices.Equal(out.Shape, []int64{int64(len(want))}) {
		t.Fatalf("output is %s %v, want FP32 [%d]", out.DataType, out.Shape, len(want))
	}
	got := decodeF32(out.Data)
	for i := range want {
		if math.Abs(float64(got[i]-want[i])) > 1e-5 {
			t.Errorf("row %d: sum = %v, want %v", i, got[i], want[i])
		}
	}
}

func TestRunnerDynamicAxes(t *testing.T) {
	r := startTestRunner(t, testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx")))
	wantIn := []TensorSpec{{Name: "input_vectors", DataType: FP32, Shape: []int64{-1, 10}}}
	wantOut := []TensorSpec{{Name: "output_scalars", DataType: FP32, Shape: []int64{-1}}}
	if !slices.EqualFunc(r.Inputs(), wantIn, specEqual) || !slices.EqualFunc(r.Outputs(), wantOut, specEqual) {
		t.Errorf("specs = %v -> %v, want %v -> %v", r.Inputs(), r.Outputs(), wantIn, wantOut)
	}
	if r.State() != RunnerReady || r.Pid() == 0 || r.Pid() == os.Getpid() {
		t.Fatalf("state %s pid %d", r.State(), r.Pid())
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for _, batch := range []int{1, 7, 0} {
		t.Run(fmt.Sprint("batch=", batch), func(t *testing.T) {
			req, want := rowSumsRequest(rng, batch)
			resp, err := r.Infer(t.Context(), req)
			if err != nil {
				t.Fatal(err)
			}
			checkRowSums(t, resp, want)
			if resp.Timing.Infer <= 0 {
				t.Errorf("timing %+v has no inference time", resp.Timing)
			}
		})
	}
	cpu, rss, err := r.Usage()
	if err != nil || cpu <= 0 || rss < 1<<20 {
		t.Errorf("Usage() = %v s, %d bytes, %v", cpu, rss, err)
	}
}

func specEqual(a, b TensorSpec) bool {
	return a.Name == b.Name && a.DataType == b.DataType && slices.Equal(a.Shape, b.Shape)
}

// Calls run concurrently in the runner (ORT sessions are thread-safe).
func TestRunnerConcurrent(t *testing.T) {
	r := startTestRunner(t, testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx")))
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 9))
			for i := range 25 {
				req, want := rowSumsRequest(rng, 1+(w+i)%16)
				resp, err := r.Infer(t.Context(), req)
				if err != nil {
					t.Error(err)
					return
				}
				checkRowSums(t, resp, want)
			}
		})
	}
	wg.Wait()
}

// example_multitype: OutputA = int16(InputB*InputA - 512), OutputB =
// int64(InputA)*1234 (generate_network_different_types.py).
func TestRunnerMultitype(t *testing.T) {
	r := startTestRunner(t, testRunnerConfig(t, testModel(t, "example_multitype.onnx")))
	rng := rand.New(rand.NewPCG(3, 4))
	a := uint8(rng.IntN(256))
	b := []float64{rng.Float64(), rng.Float64(), rng.Float64() * -1, 1.25}
	req := &InferRequest{Inputs: []Tensor{
		{Name: "InputA", DataType: Uint8, Shape: []int64{1, 1, 1}, Data: []byte{a}},
		{Name: "InputB", DataType: FP64, Shape: []int64{1, 2, 2}, Data: f64Bytes(b)},
	}}
	resp, err := r.Infer(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	outA := outputNamed(t, resp, "OutputA")
	if outA.DataType != Int16 || !slices.Equal(outA.Shape, []int64{1, 2, 2}) || len(outA.Data) != 8 {
		t.Fatalf("OutputA is %s %v with %d bytes", outA.DataType, outA.Shape, len(outA.Data))
	}
	for i, x := range b {
		want := int16(x*float64(a) - 512) // truncates toward zero, as ONNX Cast does
		if got := int16(binary.LittleEndian.Uint16(outA.Data[2*i:])); got != want {
			t.Errorf("OutputA[%d] = %d, want %d (a=%d b=%v)", i, got, want, a, x)
		}
	}
	outB := outputNamed(t, resp, "OutputB")
	if outB.DataType != Int64 || !slices.Equal(outB.Shape, []int64{1, 1, 1}) {
		t.Fatalf("OutputB is %s %v", outB.DataType, outB.Shape)
	}
	if got, want := int64(binary.LittleEndian.Uint64(outB.Data)), int64(a)*1234; got != want {
		t.Errorf("OutputB = %d, want %d", got, want)
	}

	t.Run("requested outputs", func(t *testing.T) {
		for _, names := range [][]string{{"OutputB"}, {"OutputB", "OutputA"}, {"OutputA"}} {
			req.Outputs = names
			resp, err := r.Infer(t.Context(), req)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, o := range resp.Outputs {
				got = append(got, o.Name)
			}
			if !slices.Equal(got, names) {
				t.Errorf("asked for %q, got %q", names, got)
			}
		}
		req.Outputs = []string{"OutputC"}
		_, err := r.Infer(t.Context(), req)
		if !errors.Is(err, ErrInvalidTensor) || !errors.Is(err, ErrInference) || !strings.Contains(err.Error(), `no output "OutputC"`) {
			t.Errorf("unknown output: err = %v", err)
		}
	})
}

// example_float16: OutputA (BF16) = InputA (FP16) * 3.
func TestRunnerFloat16(t *testing.T) {
	r := startTestRunner(t, testRunnerConfig(t, testModel(t, "example_float16.onnx")))
	in := []float32{0, 1, 2.5, -4, 0.5, -1.25, 10.5, 7}
	var data []byte
	for _, x := range in {
		data = binary.LittleEndian.AppendUint16(data, f16Bits(t, x))
	}
	resp, err := r.Infer(t.Context(), &InferRequest{Inputs: []Tensor{{Name: "InputA", DataType: FP16, Shape: []int64{1, 2, 2, 2}, Data: data}}})
	if err != nil {
		t.Fatal(err)
	}
	out := outputNamed(t, resp, "OutputA")
	if out.DataType != BF16 || !slices.Equal(out.Shape, []int64{1, 2, 2, 2}) || len(out.Data) != 16 {
		t.Fatalf("OutputA is %s %v with %d bytes", out.DataType, out.Shape, len(out.Data))
	}
	for i, x := range in {
		// Every x*3 here is exact in both half formats.
		if got := bf16Value(binary.LittleEndian.Uint16(out.Data[2*i:])); got != 3*x {
			t.Errorf("OutputA[%d] = %v, want %v", i, got, 3*x)
		}
	}
}

func TestRunnerBadInputs(t *testing.T) {
	r := startTestRunner(t, testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx")))
	pid := r.Pid()
	good, _ := rowSumsRequest(rand.New(rand.NewPCG(5, 6)), 2)
	tests := []struct {
		name string
		in   Tensor
		want string
	}{
		{"wrong datatype", Tensor{Name: "input_vectors", DataType: FP64, Shape: []int64{2, 10}, Data: make([]byte, 160)}, "datatype is FP64, the model expects FP32"},
		{"wrong shape", Tensor{Name: "input_vectors", DataType: FP32, Shape: []int64{2, 11}, Data: make([]byte, 88)}, "does not fit the model's [?,10]"},
		{"wrong rank", Tensor{Name: "input_vectors", DataType: FP32, Shape: []int64{20}, Data: make([]byte, 80)}, "rank 1"},
		{"short data", Tensor{Name: "input_vectors", DataType: FP32, Shape: []int64{2, 10}, Data: make([]byte, 79)}, "data has 79 bytes"},
		{"unknown input", Tensor{Name: "vectors", DataType: FP32, Shape: []int64{2, 10}, Data: make([]byte, 80)}, `no input "vectors"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := r.Infer(t.Context(), &InferRequest{Inputs: []Tensor{tt.in}})
			if !errors.Is(err, ErrInvalidTensor) || !errors.Is(err, ErrInference) {
				t.Fatalf("err = %v, want ErrInvalidTensor and ErrInference", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("err = %q, want it to contain %q", err, tt.want)
			}
		})
	}
	t.Run("missing input", func(t *testing.T) {
		_, err := r.Infer(t.Context(), &InferRequest{})
		if !errors.Is(err, ErrInvalidTensor) || !strings.Contains(err.Error(), `input "input_vectors" is missing`) {
			t.Errorf("err = %v", err)
		}
	})
	// The runner keeps serving.
	if _, err := r.Infer(t.Context(), good); err != nil {
		t.Fatalf("good request after bad ones: %v", err)
	}
	if r.Pid() != pid || r.Restarts() != 0 || r.State() != RunnerReady {
		t.Errorf("runner disturbed: pid %d->%d restarts %d state %s", pid, r.Pid(), r.Restarts(), r.State())
	}
}

func TestRunnerRestartsAfterSIGKILL(t *testing.T) {
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	cfg.HealthInterval = 5 * time.Second // this test is not about hangs
	cfg.BackoffInitial = 200 * time.Millisecond
	var reasons []string
	var mu sync.Mutex
	cfg.OnRestart = func(reason string) {
		mu.Lock()
		defer mu.Unlock()
		reasons = append(reasons, reason)
	}
	r := startTestRunner(t, cfg)
	oldPid := r.Pid()

	// A stream of requests from a few workers.
	type result struct {
		end time.Time
		err error
	}
	var (
		stop    = make(chan struct{})
		wg      sync.WaitGroup
		resMu   sync.Mutex
		results []result
	)
	for w := range 3 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for {
				select {
				case <-stop:
					return
				default:
				}
				req, want := rowSumsRequest(rng, 3)
				resp, err := r.Infer(t.Context(), req)
				if err == nil {
					checkRowSums(t, resp, want)
				}
				resMu.Lock()
				results = append(results, result{time.Now(), err})
				resMu.Unlock()
				if err != nil {
					time.Sleep(time.Millisecond)
				}
			}
		})
	}
	waitFor(t, 10*time.Second, "requests to flow", func() bool {
		resMu.Lock()
		defer resMu.Unlock()
		return len(results) > 20
	})

	// Make sure a call is in flight at the kill: freeze the runner, start a
	// call, then kill the runner.
	freeze(t, oldPid)
	inflight := make(chan result, 1)
	go func() {
		req, _ := rowSumsRequest(rand.New(rand.NewPCG(7, 7)), 1)
		_, err := r.Infer(context.Background(), req)
		inflight <- result{time.Now(), err}
	}()
	time.Sleep(100 * time.Millisecond)
	killed := time.Now()
	if err := syscall.Kill(oldPid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case res := <-inflight:
		if !errors.Is(res.err, ErrUnavailable) {
			t.Errorf("in-flight call: err = %v, want ErrUnavailable", res.err)
		}
		if d := res.end.Sub(killed); d > time.Second {
			t.Errorf("in-flight call failed %s after the kill, want < 1s", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("in-flight call still blocked 5s after the kill")
	}

	waitFor(t, 5*time.Second, "state restarting", func() bool { return r.State() == RunnerRestarting })
	waitFor(t, 30*time.Second, "state ready", func() bool { return r.State() == RunnerReady })
	resMu.Lock()
	restartedAt := len(results)
	resMu.Unlock()
	waitFor(t, 10*time.Second, "requests to flow again", func() bool {
		resMu.Lock()
		defer resMu.Unlock()
		return len(results) > restartedAt+20
	})
	close(stop)
	wg.Wait()

	if r.Restarts() != 1 {
		t.Errorf("Restarts() = %d, want 1", r.Restarts())
	}
	if r.Pid() == oldPid || r.Pid() == 0 {
		t.Errorf("pid %d after restart, was %d", r.Pid(), oldPid)
	}
	if !processGone(oldPid) {
		t.Errorf("old runner %d still exists", oldPid)
	}
	mu.Lock()
	if len(reasons) != 1 || !strings.Contains(reasons[0], "signal: killed") {
		t.Errorf("OnRestart reasons = %q, want one naming the kill", reasons)
	}
	mu.Unlock()
	var failed int
	for _, res := range results {
		if res.err == nil {
			continue
		}
		failed++
		if !errors.Is(res.err, ErrUnavailable) {
			t.Errorf("call failed with %v, want ErrUnavailable", res.err)
		}
		if d := res.end.Sub(killed); d < 0 {
			t.Errorf("call failed %s before the kill: %v", -d, res.err)
		}
	}
	t.Logf("%d calls, %d failed while the runner restarted", len(results), failed)
	if res := results[len(results)-1]; res.err != nil {
		t.Errorf("last call failed: %v", res.err)
	}
}

// A restart goes through the config's Restarting hook: called before the
// new process is spawned, its ready once that process answers, before it
// serves. A ready that fails fails that start: the process is killed and
// never serves, and the runner tries again (the hook with it) as after any
// failed restart.
func TestRunnerRestartReadiedBeforeServing(t *testing.T) {
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	cfg.HealthInterval = 5 * time.Second // this test is not about hangs
	cfg.BackoffInitial = 50 * time.Millisecond
	type readied struct {
		pid, restartingPid, readyPid int
		alive                        bool
		state                        RunnerState
		inferErr                     error
	}
	var (
		mu        sync.Mutex
		r         *Runner
		restarted int
		seen      []readied
	)
	refused := errors.New("share refused")
	cfg.Restarting = func() func(int) error {
		mu.Lock()
		at := r.Pid() // no process between the old one and the new
		mu.Unlock()
		return func(readyPid int) error {
			req, _ := rowSumsRequest(rand.New(rand.NewPCG(1, 1)), 1)
			_, err := r.Infer(t.Context(), req)
			pid := r.Pid()
			mu.Lock()
			defer mu.Unlock()
			seen = append(seen, readied{pid: pid, restartingPid: at, readyPid: readyPid, alive: pid > 0 && syscall.Kill(pid, 0) == nil, state: r.State(), inferErr: err})
			if len(seen) == 1 {
				return refused
			}
			return nil
		}
	}
	cfg.OnRestart = func(string) {
		mu.Lock()
		defer mu.Unlock()
		restarted++
	}
	mu.Lock()
	r = startTestRunner(t, cfg)
	mu.Unlock()
	oldPid := r.Pid()
	if err := syscall.Kill(oldPid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the runner ready again", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen) == 2 && r.State() == RunnerReady
	})
	req, want := rowSumsRequest(rand.New(rand.NewPCG(2, 2)), 2)
	resp, err := r.Infer(t.Context(), req)
	if err != nil {
		t.Fatalf("a call once restarted: %v", err)
	}
	checkRowSums(t, resp, want)

	mu.Lock()
	defer mu.Unlock()
	for i, s := range seen {
		if s.restartingPid != 0 {
			t.Errorf("try %d: Restarting called with process %d live, want before the new one is spawned", i, s.restartingPid)
		}
		if s.readyPid != s.pid {
			t.Errorf("try %d: ready told pid %d, want the new process's %d", i, s.readyPid, s.pid)
		}
		if !s.alive || s.pid == oldPid {
			t.Errorf("try %d: ready called with pid %d (alive %v; the killed one was %d), want the new process, alive", i, s.pid, s.alive, oldPid)
		}
		if s.state == RunnerReady || !errors.Is(s.inferErr, ErrUnavailable) {
			t.Errorf("try %d: during ready the runner was %s and a call got %v, want not ready and ErrUnavailable", i, s.state, s.inferErr)
		}
	}
	if !processGone(seen[0].pid) {
		t.Errorf("the process whose ready failed (%d) still exists", seen[0].pid)
	}
	if r.Pid() != seen[1].pid {
		t.Errorf("serving pid %d, want the second try's %d", r.Pid(), seen[1].pid)
	}
	if r.Restarts() != 1 || restarted != 1 {
		t.Errorf("Restarts() = %d, OnRestart called %d times; want 1 and 1 (the failed try is no restart)", r.Restarts(), restarted)
	}
}

func TestStartRunnerFailsFast(t *testing.T) {
	t.Run("bad model path", func(t *testing.T) {
		cfg := testRunnerConfig(t, filepath.Join(t.TempDir(), "missing.onnx"))
		start := time.Now()
		r, err := StartRunner(t.Context(), cfg)
		if err == nil {
			r.Stop(t.Context())
			t.Fatal("StartRunner succeeded")
		}
		for _, want := range []string{"exited before it was ready", "exit status 1", "missing.onnx"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("err = %q, want it to contain %q", err, want)
			}
		}
		// Fails fast: on the exit, not at the ready timeout (a generous
		// watchdog at half of it, whatever the machine's load).
		if d := time.Since(start); d > cfg.ReadyTimeout/2 {
			t.Errorf("took %s, the ready timeout is %s", d, cfg.ReadyTimeout)
		}
		if m, _ := filepath.Glob(filepath.Join(cfg.SocketDir, "*")); len(m) > 0 {
			t.Errorf("left behind %v", m)
		}
	})
	t.Run("bad executable", func(t *testing.T) {
		cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
		cfg.Executable = filepath.Join(t.TempDir(), "no-such-binary")
		_, err := StartRunner(t.Context(), cfg)
		if err == nil || !strings.Contains(err.Error(), "no-such-binary") {
			t.Errorf("err = %v", err)
		}
	})
	t.Run("unsupported model", func(t *testing.T) {
		// A text file is no model.
		bad := filepath.Join(t.TempDir(), "bad.onnx")
		os.WriteFile(bad, []byte("not a model"), 0o644)
		_, err := StartRunner(t.Context(), testRunnerConfig(t, bad))
		if err == nil || !strings.Contains(err.Error(), "bad.onnx") {
			t.Errorf("err = %v", err)
		}
	})
	t.Run("ready timeout", func(t *testing.T) {
		cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
		cfg.ReadyTimeout = time.Millisecond
		_, err := StartRunner(t.Context(), cfg)
		if err == nil || !strings.Contains(err.Error(), "not ready within 1ms") {
			t.Errorf("err = %v", err)
		}
	})
	t.Run("describe fails", func(t *testing.T) {
		// A runner that answers Describe with an error is killed, and the
		// error says what failed. The kill ends the start's ready clock as
		// well, which must not turn the failure into a ready timeout (it
		// did: "not ready within 1m0s" for a runner 15 s after its start,
		// in TestE2EStopManyIdleBestEffort).
		cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
		cfg.Env = []string{runnerChildEnv + "=" + describeFailsChild, "GORACE=atexit_sleep_ms=0"}
		cfg.ReadyTimeout = 10 * time.Minute
		_, err := StartRunner(t.Context(), cfg)
		if err == nil {
			t.Fatal("StartRunner succeeded")
		}
		for _, want := range []string{"describe:", "Unimplemented"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("err = %q, want it to contain %q", err, want)
			}
		}
		if strings.Contains(err.Error(), "not ready within") {
			t.Errorf("err = %q: a failed Describe reported as the ready timeout", err)
		}
	})
	t.Run("connection lost during describe", func(t *testing.T) {
		// The first Describe loses its connection (Unavailable) while the
		// process lives: it is asked again, and the start succeeds. On a
		// starved host gRPC closed a connection just made, with Describe
		// on it, and one runner in 40 failed to start
		// (TestE2EStopManyIdleBestEffort).
		cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
		cfg.Env = []string{runnerChildEnv + "=" + describeOnceLostChild, "GORACE=atexit_sleep_ms=0"}
		cfg.ReadyTimeout = 10 * time.Minute
		r, err := StartRunner(t.Context(), cfg)
		if err != nil {
			t.Fatalf("StartRunner: %v", err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = r.Stop(ctx) // the stand-in does not say goodbye; it ends on the signal
	})
	t.Run("config", func(t *testing.T) {
		_, err := StartRunner(t.Context(), RunnerConfig{Provider: ProviderOptions{Kind: "tpu"}})
		for _, want := range []string{"ModelPath is required", "Library is required", `"tpu"`} {
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("err = %v, want it to contain %q", err, want)
			}
		}
	})
}

func TestRunnerFailsAfterMaxRestarts(t *testing.T) {
	model := filepath.Join(t.TempDir(), "model.onnx")
	data, err := os.ReadFile(testModel(t, "example_dynamic_axes.onnx"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(model, data, 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := testRunnerConfig(t, model)
	cfg.MaxRestarts = 2
	restarted := false
	cfg.OnRestart = func(string) { restarted = true }
	r := startTestRunner(t, cfg)

	// Take the model away and kill the runner: every restart now fails.
	os.Remove(model)
	syscall.Kill(r.Pid(), syscall.SIGKILL)
	waitFor(t, 30*time.Second, "state failed", func() bool { return r.State() == RunnerFailed })
	for _, want := range []string{"gave up after 2 restarts", "exited before it was ready", "model.onnx"} {
		if !strings.Contains(r.Reason(), want) {
			t.Errorf("Reason() = %q, want it to contain %q", r.Reason(), want)
		}
	}
	req, _ := rowSumsRequest(rand.New(rand.NewPCG(1, 1)), 1)
	if _, err := r.Infer(t.Context(), req); !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "failed") {
		t.Errorf("Infer on a failed runner: %v", err)
	}
	if r.Restarts() != 0 || restarted || r.Pid() != 0 {
		t.Errorf("restarts %d, OnRestart called %v, pid %d", r.Restarts(), restarted, r.Pid())
	}
}

func TestRunnerReplacesHungProcess(t *testing.T) {
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	cfg.HealthInterval = 150 * time.Millisecond
	reasons := make(chan string, 1)
	cfg.OnRestart = func(reason string) { reasons <- reason }
	r := startTestRunner(t, cfg)
	oldPid := r.Pid()
	freeze(t, oldPid)
	select {
	case reason := <-reasons:
		if !strings.Contains(reason, "hung") {
			t.Errorf("restart reason = %q, want hung", reason)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("hung runner not replaced; state %s: %s", r.State(), r.Reason())
	}
	if r.State() != RunnerReady || r.Pid() == oldPid || r.Restarts() != 1 {
		t.Errorf("state %s pid %d (was %d) restarts %d", r.State(), r.Pid(), oldPid, r.Restarts())
	}
	if !processGone(oldPid) {
		t.Errorf("hung runner %d still exists", oldPid)
	}
	req, want := rowSumsRequest(rand.New(rand.NewPCG(2, 2)), 4)
	resp, err := r.Infer(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	checkRowSums(t, resp, want)
}

func TestRunnerStop(t *testing.T) {
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	r, err := StartRunner(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	pid := r.Pid()
	if m, _ := filepath.Glob(filepath.Join(cfg.SocketDir, "*.sock")); len(m) != 1 {
		t.Errorf("sockets while running: %v", m)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := r.Stop(ctx); err != nil {
		t.Errorf("Stop: %v", err)
	}
	if !processGone(pid) {
		t.Errorf("runner %d still exists after Stop", pid)
	}
	if m, _ := filepath.Glob(filepath.Join(cfg.SocketDir, "*")); len(m) > 0 {
		t.Errorf("left behind %v", m)
	}
	if r.State() != RunnerStopped || r.Pid() != 0 {
		t.Errorf("after Stop: state %s pid %d", r.State(), r.Pid())
	}
	req, _ := rowSumsRequest(rand.New(rand.NewPCG(1, 1)), 1)
	if _, err := r.Infer(t.Context(), req); !errors.Is(err, ErrUnavailable) {
		t.Errorf("Infer after Stop: %v", err)
	}
	if _, _, err := r.Usage(); !errors.Is(err, ErrUnavailable) {
		t.Errorf("Usage after Stop: %v", err)
	}
	if err := r.Stop(ctx); err != nil {
		t.Errorf("second Stop: %v", err)
	}
}

// A runner that ignores SIGTERM (here: frozen) is killed at Stop's deadline.
func TestRunnerStopKillsAtDeadline(t *testing.T) {
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	cfg.HealthInterval = time.Minute
	r, err := StartRunner(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	pid := r.Pid()
	freeze(t, pid)
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = r.Stop(ctx)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "killed") {
		t.Errorf("Stop = %v, want a kill after the deadline", err)
	}
	// Killed at the 200ms deadline, not after the frozen runner's grace
	// (defaultStopGrace, which a context without a deadline gets) or never:
	// a generous watchdog at half the grace.
	if d := time.Since(start); d > defaultStopGrace/2 {
		t.Errorf("Stop took %s", d)
	}
	if !processGone(pid) {
		t.Errorf("runner %d still exists", pid)
	}
}

func TestRunnerCUDAWithoutCUDA(t *testing.T) {
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	cfg.Provider = ProviderOptions{Kind: ProviderCUDA, GPUMemLimit: 1 << 30}
	_, err := StartRunner(t.Context(), cfg)
	if !errors.Is(err, ErrNoCUDA) {
		t.Fatalf("err = %v, want ErrNoCUDA", err)
	}
	t.Log(err)
}

// TestRunnerFailedCallLeavesService: a call that cannot reach its process
// (killed, its exit perhaps not yet reaped) takes the runner out of
// service before it returns, so the caller's retry, or any other call,
// does not pick the dead process again (issue 15: one request in 456 got
// 503 "connection refused" under a busy machine).
func TestRunnerFailedCallLeavesService(t *testing.T) {
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	cfg.HealthInterval = 5 * time.Second
	cfg.BackoffInitial = time.Second // the restart must not hide the state
	r := startTestRunner(t, cfg)
	pid := r.Pid()
	rng := rand.New(rand.NewPCG(1, 1))
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for {
		req, _ := rowSumsRequest(rng, 1)
		_, err := r.Infer(t.Context(), req)
		if err == nil {
			continue // sent before the kill landed
		}
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("call on a killed runner: %v, want ErrUnavailable", err)
		}
		if st := r.State(); st == RunnerReady {
			t.Fatalf("runner %s right after a call could not reach its killed process: %v", st, err)
		}
		return
	}
}

// A model whose process dies after every call it answers runs out of
// restarts: answering earns the count back at most once per stable period.
func TestRunnerDyingAfterEveryCallFails(t *testing.T) {
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	cfg.MaxRestarts = 2
	cfg.BackoffInitial = 50 * time.Millisecond
	cfg.HealthInterval = 5 * time.Second // stable period: 30s, the default BackoffMax
	r := startTestRunner(t, cfg)
	rng := rand.New(rand.NewPCG(1, 2))
	kills := 0
	for r.State() != RunnerFailed && kills < 10 {
		waitFor(t, 30*time.Second, "ready or failed", func() bool {
			return r.State() == RunnerReady || r.State() == RunnerFailed
		})
		if r.State() == RunnerFailed {
			break
		}
		req, want := rowSumsRequest(rng, 2)
		resp, err := r.Infer(t.Context(), req)
		if err != nil {
			t.Fatalf("call %d: %v", kills+1, err)
		}
		checkRowSums(t, resp, want)
		pid := r.Pid()
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		kills++
		waitFor(t, 10*time.Second, "the kill to be noticed", func() bool { return r.Pid() != pid })
	}
	waitFor(t, 30*time.Second, "state failed", func() bool { return r.State() == RunnerFailed })
	// Two restarts, and the third death is one too many (before answering
	// was rate-bounded, every answered call earned the count back and the
	// runner restarted for ever).
	if kills != cfg.MaxRestarts+1 {
		t.Errorf("failed after %d deaths, want %d", kills, cfg.MaxRestarts+1)
	}
	if !strings.Contains(r.Reason(), "gave up after 2 restarts") {
		t.Errorf("Reason() = %q", r.Reason())
	}
}

// A health check that is answered reads nothing from /proc: the CPU
// times that tell a starved runner from a hung one are read only for a
// check still unanswered after checkQuiet. Before, every check read the
// schedstat of every thread of the runner and of the server (health
// checks of 40 idle runners cost about a fifth of a core). Counted in
// read system calls of this process (/proc/self/io), against the same
// number of bare health calls.
func TestHealthCheckAnsweredReadsNoProc(t *testing.T) {
	if _, err := os.ReadFile("/proc/self/io"); err != nil {
		t.Skipf("no /proc/self/io: %v", err)
	}
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	cfg.HealthInterval = time.Hour // only the test's checks
	r := startTestRunner(t, cfg)
	p := r.live.Load()
	reads := func() int64 {
		b, err := os.ReadFile("/proc/self/io")
		if err != nil {
			t.Fatal(err)
		}
		for line := range strings.Lines(string(b)) {
			if v, ok := strings.CutPrefix(line, "syscr:"); ok {
				n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
				if err != nil {
					t.Fatal(err)
				}
				return n
			}
		}
		t.Fatal("no syscr in /proc/self/io")
		return 0
	}
	const n = 100
	for range 10 { // warm the connection
		if err := p.checkHealth(t.Context(), 10*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	// The count is the whole test process's: other goroutines read too,
	// more on a busy host (beside two CPU burners, 789 against 236 bare
	// once). Noise only adds, so each count is the least of three rounds.
	bare, checked := int64(math.MaxInt64), int64(math.MaxInt64)
	for range 3 {
		start := reads()
		for range n {
			if err := p.checkHealth(t.Context(), 10*time.Second); err != nil {
				t.Fatal(err)
			}
		}
		bare = min(bare, reads()-start)
		start = reads()
		for range n {
			if _, _, err := r.check(p, 10*time.Second); err != nil {
				t.Fatal(err)
			}
		}
		checked = min(checked, reads()-start)
	}
	t.Logf("read system calls for %d health checks: %d bare, %d by the runner's check", n, bare, checked)
	if checked > 2*bare+n {
		t.Errorf("%d health checks made %d read calls, %d bare: the answered checks read /proc", n, checked, bare)
	}
}

// A runner that stops as asked exits without tearing down its session and
// ONNX Runtime. The teardown flushed ONNX Runtime's telemetry into one
// SQLite database in the user's cache folder
// ($HOME/.cache/Microsoft/DeveloperTools/.onnxruntime), under its file
// locks: 40 idle runners stopping at once queued on them, and a stop of N
// took about N times one. The stop writes nothing there now; the runner's
// answers and logs are out before it exits, as the test's last call and
// the stop's log line show.
func TestRunnerStopWritesNoTelemetry(t *testing.T) {
	if raceEnabled {
		// The race detector's exit runs the C++ static destructors, which
		// flush ONNX Runtime's telemetry whatever the runner does; a
		// sloserve binary's exit does not.
		t.Skip("a runner under the race detector flushes ONNX Runtime's telemetry as it exits")
	}
	home := t.TempDir()
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	// The telemetry on, as an operator may turn it (runners keep it off),
	// where the test can watch it after the runner's own folder is gone.
	telemetryAsDeployed(t)
	cfg.Env = append(cfg.Env, TelemetryEnv+"=0", "HOME="+home, "XDG_CACHE_HOME="+filepath.Join(home, ".cache"))
	var log syncbuf.Buffer
	cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(t.Output(), &log), &slog.HandlerOptions{Level: slog.LevelDebug}))
	r, err := StartRunner(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	req, want := rowSumsRequest(rand.New(rand.NewPCG(4, 4)), 3)
	resp, err := r.Infer(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	checkRowSums(t, resp, want)
	// What the process wrote under HOME while it ran, by size.
	written := func() map[string]int64 {
		m := map[string]int64{}
		filepath.WalkDir(home, func(path string, d os.DirEntry, err error) error {
			if err == nil && !d.IsDir() {
				if fi, err := d.Info(); err == nil {
					m[path] = fi.Size()
				}
			}
			return nil
		})
		return m
	}
	// ONNX Runtime writes the database at start too, from a thread of its
	// own: what the stop writes is counted from a second in which nothing
	// changed.
	before := written()
	for quiet := time.Now(); time.Since(quiet) < time.Second; {
		time.Sleep(100 * time.Millisecond)
		if now := written(); !maps.Equal(now, before) {
			before, quiet = now, time.Now()
		}
	}
	if len(before) == 0 {
		t.Fatal("no telemetry written at start where the test watches")
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := r.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	after := written()
	for path, n := range after {
		if before[path] != n {
			t.Errorf("the stop wrote %s: %d bytes, were %d", path, n, before[path])
		}
	}
	if !strings.Contains(log.String(), "runner stopping") {
		t.Error("the runner's log of its stop is lost")
	}
}
