package runtime

import (
	"fmt"
	"math"
	goruntime "runtime"
	"strings"
	"testing"
	"time"
)

// The per-call work of the server's side of a runner call allocates
// nothing it does not have to: these tests pin what was removed.

// An output of dynamic shape makes outputReserve fall back to the learnt
// output-to-input ratio without building an error on every call.
func TestOutputReserveDynamicAllocatesNothing(t *testing.T) {
	r := &Runner{outputs: []TensorSpec{{Name: "y", DataType: FP32, Shape: []int64{-1}}}}
	r.outRatio.Store(math.Float64bits(0.5))
	req := &InferRequest{}
	if got, want := r.outputReserve(req, 64), uint64(32+arenaAlign); got != want {
		t.Fatalf("reserve %d, want %d", got, want)
	}
	if n := testing.AllocsPerRun(100, func() { r.outputReserve(req, 64) }); n != 0 {
		t.Fatalf("outputReserve allocates %v times a call, want 0", n)
	}
	// A fixed shape is reserved exactly.
	r.outputs = []TensorSpec{{Name: "y", DataType: FP32, Shape: []int64{2, 3}}}
	if got, want := r.outputReserve(req, 64), uint64(24+arenaAlign); got != want {
		t.Fatalf("fixed reserve %d, want %d", got, want)
	}
}

// A runner's Go scheduler gets one processor per call it runs at once, at
// most the CPUs; a runner of one call at a time on the socket has no
// second thread to wake for each call. With a mailbox it has one more
// where the CPUs allow, so that a worker waiting in the mailbox keeps its own
// (runnerFlags.goProcs; measured by BenchmarkMailboxSpareProc).
func TestRunnerProcessorsFollowCalls(t *testing.T) {
	if goruntime.NumCPU() < 2 {
		t.Skip("needs 2 CPUs to tell 1 processor from the default")
	}
	for _, tt := range []struct {
		calls, slots int
		spare        int
	}{{0, 0, 1}, {1, 0, 1}, {2, 0, 1}, {64, 0, 1}, {1, -1, 0}, {64, -1, 0}} {
		t.Run(fmt.Sprintf("calls=%d/mailbox=%d", tt.calls, tt.slots), func(t *testing.T) {
			cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
			cfg.Calls = tt.calls
			cfg.MailboxSlots = tt.slots
			r := startTestRunner(t, cfg)
			want := fmt.Sprintf("procs=%d", min(max(1, tt.calls)+tt.spare, goruntime.NumCPU()))
			// The line may reach the server's copy of the output after
			// the runner answers.
			p := r.serving.Load()
			waitFor(t, 10*time.Second, "the runner's ready line with "+want, func() bool {
				return strings.Contains(p.output.Tail(outputTailLines), want)
			})
		})
	}
	if _, err := parseRunnerFlags([]string{"--socket", "s", "--model", "m", "--library", "l", "--procs", "-1"}); err == nil {
		t.Error("--procs -1 accepted")
	}
	if _, err := parseRunnerFlags([]string{"--socket", "s", "--model", "m", "--library", "l", "--calls", "-1"}); err == nil {
		t.Error("--calls -1 accepted")
	}
}

// A call of one input is built in one allocation: message, tensor,
// descriptors and the pending call together.
func TestNewCallOneAllocation(t *testing.T) {
	r := &Runner{outputs: []TensorSpec{{Name: "y", DataType: FP32, Shape: []int64{-1}}}}
	req := &InferRequest{Inputs: []Tensor{{Name: "x", DataType: FP32, Shape: []int64{1, 2}, Data: make([]byte, 8)}}}
	if n := testing.AllocsPerRun(100, func() { r.newCall(nil, req, nil) }); n > 1 {
		t.Errorf("newCall allocates %v times, want 1", n)
	}
	msg, call, _, _ := r.newCall(nil, req, nil)
	if call == nil || len(msg.GetInputs()) != 1 || msg.GetInputs()[0].GetName() != "x" || len(msg.GetInputs()[0].GetData()) != 8 {
		t.Errorf("message %v, call %v", msg, call)
	}
}
