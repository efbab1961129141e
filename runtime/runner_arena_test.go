package runtime

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// pathCase is one way a request reaches ONNX Runtime.
type pathCase struct {
	name  string
	start func(t *testing.T, model string) Instance
}

func runnerWithArena(size int64) func(t *testing.T, model string) Instance {
	return runnerWith(size, 0)
}

func runnerWith(size int64, slots int) func(t *testing.T, model string) Instance {
	return func(t *testing.T, model string) Instance {
		cfg := testRunnerConfig(t, model)
		cfg.ArenaSize = size
		cfg.MailboxSlots = slots
		return startTestRunner(t, cfg)
	}
}

func startTestInProcess(t *testing.T, model string) *InProcess {
	t.Helper()
	ip, err := StartInProcess(t.Context(), InProcessConfig{
		ModelPath: model,
		Library:   ortLibrary(t),
		Provider:  ProviderOptions{IntraOpThreads: 1, InterOpThreads: 1},
		Logger:    testLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := ip.Stop(context.Background()); err != nil {
			t.Error(err)
		}
	})
	return ip
}

// The request paths: the arena (default size) with the calls in its
// mailbox, the arena with the calls on the socket (as before the mailbox),
// no arena (every tensor inline on the stream, as before the arena), an
// arena too small for the larger requests (they fall back to inline), and
// in the server process.
var pathCases = []pathCase{
	{"arena", runnerWithArena(0)},
	{"arena without mailbox", runnerWith(0, -1)},
	{"inline", runnerWithArena(-1)},
	{"small arena", runnerWithArena(4096)},
	{"in-process", func(t *testing.T, model string) Instance { return startTestInProcess(t, model) }},
}

// Every path answers bit for bit the same on the test models, large
// requests and static outputs (which ONNX Runtime writes straight into the
// arena) included.
func TestRequestPathsIdentical(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	var rowSums []*InferRequest
	for _, batch := range []int{1, 3, 0, 2000} {
		req, _ := rowSumsRequest(rng, batch)
		rowSums = append(rowSums, req)
	}
	f16 := make([]byte, 16)
	for i := range f16 {
		f16[i] = byte(rng.IntN(60)) // small positive halves, no NaN
	}
	var words []byte
	for _, w := range []string{"a", "", "héllo", strings.Repeat("z", 5000)} {
		words = AppendBytesElement(words, []byte(w))
	}
	big := make([]byte, 4*30000)
	for i := range big {
		big[i] = byte(rng.IntN(256) & 0x3f) // finite floats
	}
	identity := writeIdentityModel(t,
		identityPair{in: "s", out: "s_out", elemType: onnxString, dims: []any{"n"}},
		identityPair{in: "f", out: "f_out", elemType: onnxFloat, dims: []any{"m"}},
		identityPair{in: "fixed", out: "fixed_out", elemType: onnxFloat, dims: []any{2, 3}},
		identityPair{in: "scalar", out: "scalar_out", elemType: onnxInt64},
		identityPair{in: "flags", out: "flags_out", elemType: onnxBool, dims: []any{2, "k"}},
	)
	models := []struct {
		model string
		reqs  []*InferRequest
	}{
		{testModel(t, "example_dynamic_axes.onnx"), rowSums},
		{testModel(t, "example_multitype.onnx"), []*InferRequest{
			{Inputs: []Tensor{
				{Name: "InputA", DataType: Uint8, Shape: []int64{1, 1, 1}, Data: []byte{200}},
				{Name: "InputB", DataType: FP64, Shape: []int64{1, 2, 2}, Data: f64Bytes([]float64{0.5, -3, 7.25, 1e3})},
			}},
			{Outputs: []string{"OutputB"}, Inputs: []Tensor{
				{Name: "InputA", DataType: Uint8, Shape: []int64{1, 1, 1}, Data: []byte{3}},
				{Name: "InputB", DataType: FP64, Shape: []int64{1, 2, 2}, Data: f64Bytes([]float64{1, 2, 3, 4})},
			}},
		}},
		{testModel(t, "example_float16.onnx"), []*InferRequest{
			{Inputs: []Tensor{{Name: "InputA", DataType: FP16, Shape: []int64{1, 2, 2, 2}, Data: f16}}},
		}},
		{identity, []*InferRequest{
			{Inputs: []Tensor{
				{Name: "s", DataType: Bytes, Shape: []int64{4}, Data: words},
				{Name: "f", DataType: FP32, Shape: []int64{30000}, Data: big},
				{Name: "fixed", DataType: FP32, Shape: []int64{2, 3}, Data: f32Bytes([]float32{1, 2, 3, 4, 5, 6})},
				{Name: "scalar", DataType: Int64, Shape: []int64{}, Data: binary.LittleEndian.AppendUint64(nil, 42)},
				{Name: "flags", DataType: Bool, Shape: []int64{2, 2}, Data: []byte{1, 0, 0, 1}},
			}},
		}},
	}
	for _, m := range models {
		t.Run(filepath.Base(m.model), func(t *testing.T) {
			var want [][]Tensor
			for _, pc := range pathCases {
				inst := pc.start(t, m.model)
				for i, req := range m.reqs {
					resp, err := inst.Infer(t.Context(), req)
					if err != nil {
						t.Fatalf("%s: request %d: %v", pc.name, i, err)
					}
					if len(want) <= i {
						want = append(want, resp.Outputs)
						continue
					}
					if !slices.EqualFunc(resp.Outputs, want[i], tensorEqual) {
						t.Errorf("%s: request %d answers %v, the arena path %v", pc.name, i, summary(resp.Outputs), summary(want[i]))
					}
				}
			}
		})
	}
}

func tensorEqual(a, b Tensor) bool {
	return a.Name == b.Name && a.DataType == b.DataType && slices.Equal(a.Shape, b.Shape) && bytes.Equal(a.Data, b.Data)
}

func summary(ts []Tensor) []string {
	var s []string
	for _, t := range ts {
		s = append(s, fmt.Sprintf("%s %s %v (%d bytes)", t.Name, t.DataType, t.Shape, len(t.Data)))
	}
	return s
}

// arenaEntries counts this process's mappings and descriptors of runner
// arenas, and all its descriptors.
func arenaEntries(t *testing.T) (maps, fds, allFDs int) {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	maps = strings.Count(string(b), "memfd:sloserve-arena")
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.Contains(target, "sloserve-arena") {
			fds++
		}
	}
	return maps, fds, len(entries)
}

func stopRunner(t *testing.T, r *Runner) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.Stop(ctx); err != nil {
		t.Error(err)
	}
}

// A runner killed while a call holds a slot of its arena: the call fails
// as unavailable, the arena is unmapped and closed once the process is
// reaped, the new process gets a fresh one, and after Stop no mapping or
// descriptor is left.
func TestRunnerKilledMidCallReclaimsArena(t *testing.T) {
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	// A first runner warms up what the process opens once (the poller).
	r, err := StartRunner(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	stopRunner(t, r)
	maps0, fds0, all0 := arenaEntries(t)

	r, err = StartRunner(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer stopRunner(t, r)
	if maps, fds, _ := arenaEntries(t); maps != maps0+1 || fds != fds0 {
		t.Errorf("with a runner: %d arena mappings, %d arena descriptors; want %d, %d (the child holds the descriptor)", maps, fds, maps0+1, fds0)
	}
	ar := r.serving.Load().arena
	pid := r.Pid()
	freeze(t, pid)
	req, _ := rowSumsRequest(rand.New(rand.NewPCG(1, 1)), 5000)
	done := make(chan error, 1)
	go func() {
		_, err := r.Infer(context.Background(), req)
		done <- err
	}()
	waitFor(t, 10*time.Second, "the call to hold a slot", func() bool { return ar.alloc.bytesInUse() >= uint64(len(req.Inputs[0].Data)) })
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, ErrUnavailable) {
			t.Errorf("call on a killed runner: %v, want ErrUnavailable", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("call on a killed runner did not return")
	}
	waitFor(t, 20*time.Second, "the restart", func() bool { return r.Restarts() == 1 && r.State() == RunnerReady })
	if maps, _, _ := arenaEntries(t); maps != maps0+1 {
		t.Errorf("after the restart: %d arena mappings, want %d (the dead process's arena unmapped)", maps, maps0+1)
	}
	want := rowSums(req)
	resp, err := r.Infer(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	checkRowSums(t, resp, want)

	stopRunner(t, r)
	maps, fds, all := arenaEntries(t)
	if maps != maps0 || fds != fds0 || all > all0 {
		t.Errorf("after Stop: %d arena mappings, %d arena descriptors, %d descriptors; before: %d, %d, %d", maps, fds, all, maps0, fds0, all0)
	}
}

func rowSums(req *InferRequest) []float32 {
	d := decodeF32(req.Inputs[0].Data)
	sums := make([]float32, len(d)/10)
	for i, x := range d {
		sums[i/10] += x
	}
	return sums
}

// A call whose context ends before the answer returns at once; its slot
// stays reserved until the runner answers, then is freed.
func TestRunnerAbandonedCallFreesSlot(t *testing.T) {
	r := startTestRunner(t, testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx")))
	ar := r.serving.Load().arena
	pid := r.Pid()
	freeze(t, pid)
	stopped := true
	defer func() {
		if stopped {
			syscall.Kill(pid, syscall.SIGCONT)
		}
	}()
	req, want := rowSumsRequest(rand.New(rand.NewPCG(3, 3)), 100)
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	_, err := r.Infer(ctx, req)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("call past its deadline: %v", err)
	}
	if ar.alloc.bytesInUse() == 0 {
		t.Fatal("the abandoned call's slot was freed while the runner may still read it")
	}
	syscall.Kill(pid, syscall.SIGCONT)
	stopped = false
	waitFor(t, 10*time.Second, "the slot to be freed", func() bool { return ar.alloc.bytesInUse() == 0 })
	resp, err := r.Infer(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	checkRowSums(t, resp, want)
	if r.Pid() != pid {
		t.Errorf("runner replaced (pid %d, was %d)", r.Pid(), pid)
	}
}

// ONNX Runtime is initialised once per process: a second library is
// refused, the same one is shared.
func TestSharedORT(t *testing.T) {
	lib := ortLibrary(t)
	if err := sharedORT(lib); err != nil {
		t.Fatal(err)
	}
	if err := sharedORT(lib); err != nil {
		t.Errorf("second call with the same library: %v", err)
	}
	other := filepath.Join(t.TempDir(), "libonnxruntime.so")
	if err := os.WriteFile(other, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := sharedORT(other); err == nil || !strings.Contains(err.Error(), "already initialised") {
		t.Errorf("another library: %v, want already initialised", err)
	}
}

func TestInProcess(t *testing.T) {
	ip := startTestInProcess(t, testModel(t, "example_dynamic_axes.onnx"))
	req, want := rowSumsRequest(rand.New(rand.NewPCG(4, 4)), 9)
	resp, err := ip.Infer(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	checkRowSums(t, resp, want)
	bad := &InferRequest{Inputs: []Tensor{{Name: "input_vectors", DataType: FP32, Shape: []int64{1, 9}, Data: make([]byte, 36)}}}
	if _, err := ip.Infer(t.Context(), bad); !errors.Is(err, ErrInvalidTensor) || !errors.Is(err, ErrInference) {
		t.Errorf("bad shape: %v, want ErrInvalidTensor", err)
	}
	if err := ip.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	if _, err := ip.Infer(t.Context(), req); !errors.Is(err, ErrUnavailable) {
		t.Errorf("after Stop: %v, want ErrUnavailable", err)
	}
	if _, err := StartInProcess(t.Context(), InProcessConfig{ModelPath: filepath.Join(t.TempDir(), "none.onnx"), Library: ortLibrary(t)}); !errors.Is(err, ErrModelLoad) {
		t.Errorf("missing model: %v, want ErrModelLoad", err)
	}
}

// With room in the arena, inputs and outputs travel as descriptors only:
// static outputs written there by ONNX Runtime, dynamic ones copied.
func TestRunnerTensorsInArena(t *testing.T) {
	for _, tt := range []struct {
		model string
		req   *InferRequest
	}{
		{"example_dynamic_axes.onnx", func() *InferRequest { r, _ := rowSumsRequest(rand.New(rand.NewPCG(8, 8)), 64); return r }()},
		{"example_multitype.onnx", &InferRequest{Inputs: []Tensor{
			{Name: "InputA", DataType: Uint8, Shape: []int64{1, 1, 1}, Data: []byte{7}},
			{Name: "InputB", DataType: FP64, Shape: []int64{1, 2, 2}, Data: f64Bytes([]float64{1, 2, 3, 4})},
		}}},
	} {
		t.Run(tt.model, func(t *testing.T) {
			r := startTestRunner(t, testRunnerConfig(t, testModel(t, tt.model)))
			p := r.serving.Load()
			if !p.arena.acquire() {
				t.Fatal("arena closed")
			}
			defer p.arena.release()
			msg, call, region, _ := r.newCall(p, tt.req, p.arena.mem)
			if !call.hasSlot || region == nil {
				t.Fatalf("no slot or no output region: %+v %v", call, region)
			}
			defer p.arena.free(call.slot)
			for _, in := range msg.GetInputs() {
				if in.GetArena() == nil || len(in.GetData()) > 0 {
					t.Errorf("input %s sent inline", in.GetName())
				}
			}
			resp, err := p.stream.call(t.Context(), msg, call)
			if err == nil {
				err = replyStatus(resp)
			}
			if err != nil {
				t.Fatal(err)
			}
			for _, out := range resp.GetOutputs() {
				if out.GetArena() == nil || len(out.GetData()) > 0 {
					t.Errorf("output %s came back inline", out.GetName())
				}
			}
			if _, err := readResponse(resp, p.arena.mem, region); err != nil {
				t.Error(err)
			}
		})
	}
}

// A real runner takes its calls through the mailbox: each rings the
// doorbell once, and the answers are the model's. Without a mailbox the
// same calls go on the socket.
func TestRunnerCallsThroughTheMailbox(t *testing.T) {
	model := testModel(t, "example_dynamic_axes.onnx")
	for _, tt := range []struct {
		name  string
		slots int
	}{{"mailbox", 0}, {"socket", -1}} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := testRunnerConfig(t, model)
			cfg.MailboxSlots = tt.slots
			r := startTestRunner(t, cfg)
			rng := rand.New(rand.NewPCG(3, 3))
			const calls = 50
			for i := range calls {
				req, want := rowSumsRequest(rng, 1+i%7)
				resp, err := r.Infer(t.Context(), req)
				if err != nil {
					t.Fatal(err)
				}
				checkRowSums(t, resp, want)
			}
			box := r.serving.Load().arena.box
			if tt.slots < 0 {
				if box != nil {
					t.Fatal("a mailbox with MailboxSlots < 0")
				}
				return
			}
			if box == nil || box.slots != DefaultMailboxSlots {
				t.Fatalf("mailbox %v, want %d slots", box, DefaultMailboxSlots)
			}
			if got := *box.doorbell(); got != calls {
				t.Errorf("doorbell rang %d times for %d calls", got, calls)
			}
			if n := box.freeSlots(); n != DefaultMailboxSlots {
				t.Errorf("%d free slots after the calls, want %d", n, DefaultMailboxSlots)
			}
		})
	}
}
