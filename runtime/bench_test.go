package runtime

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	ort "github.com/yalue/onnxruntime_go"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// inProcessORT initialises ONNX Runtime in the test process once, for the
// tests and benchmarks that compare against or probe it directly. It is
// never torn down: the environment cannot be created twice per process.
var (
	inProcessOnce sync.Once
	inProcessErr  error
)

func inProcessORT(tb testing.TB) {
	tb.Helper()
	lib := ortLibrary(tb)
	inProcessOnce.Do(func() { inProcessErr = sharedORT(lib) })
	if inProcessErr != nil {
		tb.Fatal(inProcessErr)
	}
}

func TestSessionOptionsCUDAWithoutCUDA(t *testing.T) {
	inProcessORT(t)
	_, err := newSessionOptions(ProviderOptions{Kind: ProviderCUDA, DeviceID: 0})
	if !errors.Is(err, ErrNoCUDA) {
		t.Fatalf("newSessionOptions(cuda) = %v, want ErrNoCUDA", err)
	}
	t.Log(err)
}

var benchBatches = []int{1, 64}

// BenchmarkDirectORT runs example_dynamic_axes in this process: "raw" is
// the bare onnxruntime_go session with its input tensor made once; "runner"
// is the runner's own request path (checks, conversions) without the
// process hop. Compare with BenchmarkRunnerInfer.
func BenchmarkDirectORT(b *testing.B) {
	inProcessORT(b)
	model := testModel(b, "example_dynamic_axes.onnx")
	provider := ProviderOptions{IntraOpThreads: 1, InterOpThreads: 1}
	for _, batch := range benchBatches {
		req, _ := rowSumsRequest(rand.New(rand.NewPCG(1, 1)), batch)
		b.Run(fmt.Sprintf("raw/batch=%d", batch), func(b *testing.B) {
			opts, err := newSessionOptions(provider)
			if err != nil {
				b.Fatal(err)
			}
			defer opts.Destroy()
			sess, err := ort.NewDynamicAdvancedSession(model, []string{"input_vectors"}, []string{"output_scalars"}, opts)
			if err != nil {
				b.Fatal(err)
			}
			defer sess.Destroy()
			in, err := ort.NewCustomDataTensor(ort.Shape(req.Inputs[0].Shape), req.Inputs[0].Data, ort.TensorElementDataTypeFloat)
			if err != nil {
				b.Fatal(err)
			}
			defer in.Destroy()
			b.ReportAllocs()
			for b.Loop() {
				outs := []ort.Value{nil}
				if err := sess.Run([]ort.Value{in}, outs); err != nil {
					b.Fatal(err)
				}
				outs[0].Destroy()
			}
		})
		b.Run(fmt.Sprintf("runner/batch=%d", batch), func(b *testing.B) {
			sess, err := newORTSession(ortSessionConfig{ModelPath: model, Provider: provider})
			if err != nil {
				b.Fatal(err)
			}
			defer sess.destroy()
			pb := requestToProto(req)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := sess.run(pb, nil); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkRunnerInfer runs example_dynamic_axes through a runner child
// process and the child's request path, with the tensors in the
// shared-memory arena and the call in its mailbox ("arena", the default),
// the tensors in the arena and the call on the Unix socket
// ("arena-socket", as before the mailbox), or the tensors inline in the
// socket's messages ("inline"), and through an in-process instance
// ("in-process").
func BenchmarkRunnerInfer(b *testing.B) {
	for _, tt := range []struct {
		name  string
		arena int64
		slots int
	}{{"arena", 0, 0}, {"arena-socket", 0, -1}, {"inline", -1, 0}} {
		b.Run(tt.name, func(b *testing.B) { benchRunnerInfer(b, tt.arena, tt.slots) })
	}
	b.Run("in-process", func(b *testing.B) {
		ip, err := StartInProcess(b.Context(), InProcessConfig{
			ModelPath: testModel(b, "example_dynamic_axes.onnx"),
			Library:   ortLibrary(b),
			Provider:  ProviderOptions{IntraOpThreads: 1, InterOpThreads: 1},
			Logger:    slog.New(slog.DiscardHandler),
		})
		if err != nil {
			b.Fatal(err)
		}
		defer ip.Stop(context.Background())
		for _, batch := range benchBatches {
			req, _ := rowSumsRequest(rand.New(rand.NewPCG(1, 1)), batch)
			b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					if _, err := ip.Infer(b.Context(), req); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	})
}

func benchRunnerInfer(b *testing.B, arena int64, slots int) {
	cfg := testRunnerConfig(b, testModel(b, "example_dynamic_axes.onnx"))
	cfg.Logger = slog.New(slog.DiscardHandler) // keep the benchmark output clean
	cfg.ArenaSize = arena
	cfg.MailboxSlots = slots
	r := startTestRunner(b, cfg)
	// The bare round trip: a Describe call does no work in the runner.
	b.Run("describe", func(b *testing.B) {
		client := r.serving.Load().runner
		b.ReportAllocs()
		for b.Loop() {
			if _, err := client.Describe(b.Context(), &runnerpb.DescribeRequest{}); err != nil {
				b.Fatal(err)
			}
		}
	})
	for _, batch := range benchBatches {
		req, _ := rowSumsRequest(rand.New(rand.NewPCG(1, 1)), batch)
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			b.ReportAllocs()
			var ds []time.Duration
			for b.Loop() {
				t0 := time.Now()
				if _, err := r.Infer(b.Context(), req); err != nil {
					b.Fatal(err)
				}
				ds = append(ds, time.Since(t0))
			}
			// The median call: on a busy machine the mean follows the
			// slowest few.
			slices.Sort(ds)
			b.ReportMetric(float64(ds[len(ds)/2].Nanoseconds())/1e3, "p50-µs")
		})
	}
}
