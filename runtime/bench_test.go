package runtime

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	ort "github.com/yalue/onnxruntime_go"
	"golang.org/x/sys/unix"

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

// BenchmarkMailboxSpareProc compares, call by call in one run, a runner
// whose Go scheduler has a spare processor beside its mailbox worker (the
// default, runnerFlags.goProcs) with one that has as many as its calls
// (--procs 1, as before), on example_dynamic_axes through the mailbox.
// It reports each one's median call, their ratio and the runner's thread
// sleeps per call. The calls are spaced by a pause, as a server's calls
// to one runner mostly are; back to back, the worker never sleeps long
// enough for the difference to show.
func BenchmarkMailboxSpareProc(b *testing.B) {
	model := testModel(b, "example_dynamic_axes.onnx")
	start := func(args []string) *Runner {
		cfg := testRunnerConfig(b, model)
		cfg.Logger = slog.New(slog.DiscardHandler)
		cfg.Args = args
		cfg.HealthInterval = time.Hour
		return startTestRunner(b, cfg)
	}
	runners := []*Runner{start(nil), start([]string{"runner", "--procs", "1"})}
	names := []string{"spare", "procs=calls"}
	req, _ := rowSumsRequest(rand.New(rand.NewPCG(1, 1)), 1)
	for range 50 {
		for _, r := range runners {
			if _, err := r.Infer(b.Context(), req); err != nil {
				b.Fatal(err)
			}
		}
	}
	var ds [2][]time.Duration
	var before [2]int64
	for i, r := range runners {
		before[i] = voluntarySwitches(b, r.Pid())
	}
	b.ReportAllocs()
	for b.Loop() {
		for i, r := range runners {
			time.Sleep(200 * time.Microsecond)
			t0 := time.Now()
			if _, err := r.Infer(b.Context(), req); err != nil {
				b.Fatal(err)
			}
			ds[i] = append(ds[i], time.Since(t0))
		}
	}
	b.StopTimer()
	var p50 [2]float64
	for i, r := range runners {
		slices.Sort(ds[i])
		p50[i] = float64(ds[i][len(ds[i])/2].Nanoseconds()) / 1e3
		b.ReportMetric(p50[i], names[i]+"-p50-µs")
		b.ReportMetric(float64(voluntarySwitches(b, r.Pid())-before[i])/float64(len(ds[i])), names[i]+"-sleeps/call")
	}
	b.ReportMetric(p50[0]/p50[1], "spare/procs=calls-p50")
}

// voluntarySwitches is how many times the threads of process pid have
// gone to sleep so far (voluntary_ctxt_switches over /proc/pid/task):
// each is a wake-up the process paid for, a count that moves far less
// with the machine's load than a time does.
func voluntarySwitches(t testing.TB, pid int) int64 {
	t.Helper()
	paths, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	if err != nil || len(paths) == 0 {
		t.Skipf("no /proc/%d/task/*/status here", pid)
	}
	var n int64
	for _, path := range paths {
		b, err := os.ReadFile(path)
		if err != nil {
			continue // a thread that ended meanwhile
		}
		for line := range strings.Lines(string(b)) {
			if v, ok := strings.CutPrefix(line, "voluntary_ctxt_switches:"); ok {
				k, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
				if err != nil {
					t.Fatalf("%s: %q: %v", path, line, err)
				}
				n += k
			}
		}
	}
	return n
}

// BenchmarkMailboxPoll compares, in one run, a runner whose mailbox
// polls (the caller for its answer, the worker for the next call; the
// default) with one that only sleeps (--mailbox-spin 0 and no polling by
// its callers), on example_dynamic_axes through the mailbox. The two
// alternate in blocks of calls, so that the CPU time of each block (this
// process as the server, by getrusage; the runner's threads, by their
// schedstat) is one configuration's. It reports each one's median call,
// their ratio, and the CPU time per call on each side. "gap=0" calls back
// to back; "gap=200µs" spaces the calls as a server's calls to one
// runner mostly are, so that the worker sleeps between them.
func BenchmarkMailboxPoll(b *testing.B) {
	model := testModel(b, "example_dynamic_axes.onnx")
	start := func(args []string) *Runner {
		cfg := testRunnerConfig(b, model)
		cfg.Logger = slog.New(slog.DiscardHandler)
		cfg.Args = args
		cfg.HealthInterval = time.Hour
		return startTestRunner(b, cfg)
	}
	runners := []*Runner{start(nil), start([]string{"runner", "--mailbox-spin", "0"})}
	runners[1].serving.Load().arena.box.spin = spinPolicy{}
	names := []string{"poll", "sleep"}
	req, _ := rowSumsRequest(rand.New(rand.NewPCG(1, 1)), 1)
	for _, gap := range []time.Duration{0, 200 * time.Microsecond} {
		b.Run(fmt.Sprintf("gap=%v", gap), func(b *testing.B) {
			const block = 50
			var ds [2][]time.Duration
			var serverCPU, runnerCPU [2]time.Duration
			call := func(i int) {
				if gap > 0 {
					time.Sleep(gap)
				}
				t0 := time.Now()
				if _, err := runners[i].Infer(b.Context(), req); err != nil {
					b.Fatal(err)
				}
				ds[i] = append(ds[i], time.Since(t0))
			}
			for i := range runners {
				for range block {
					call(i)
				}
				ds[i] = ds[i][:0]
			}
			box := runners[0].serving.Load().arena.box
			spins, caught, sleeps := box.stats.spins.Load(), box.stats.caught.Load(), box.stats.sleeps.Load()
			k0, take0, run0, seen0 := box.stats.calls.Load(), box.stats.toTake.Load(), box.stats.toAnswer.Load(), box.stats.toSeen.Load()
			b.ReportAllocs()
			for b.Loop() {
				for i, r := range runners {
					s0, r0 := selfCPU(b), threadsCPU(b, r.Pid())
					for range block {
						call(i)
					}
					serverCPU[i] += selfCPU(b) - s0
					runnerCPU[i] += threadsCPU(b, r.Pid()) - r0
				}
			}
			b.StopTimer()
			var p50 [2]float64
			for i := range runners {
				slices.Sort(ds[i])
				p50[i] = float64(ds[i][len(ds[i])/2].Nanoseconds()) / 1e3
				n := float64(len(ds[i]))
				b.ReportMetric(p50[i], names[i]+"-p50-µs")
				b.ReportMetric(float64(serverCPU[i].Nanoseconds())/1e3/n, names[i]+"-server-cpu-µs/call")
				b.ReportMetric(float64(runnerCPU[i].Nanoseconds())/1e3/n, names[i]+"-runner-cpu-µs/call")
			}
			b.ReportMetric(p50[0]/p50[1], "poll/sleep-p50")
			// How the polling runner's callers waited.
			n := float64(len(ds[0]))
			b.ReportMetric(float64(box.stats.spins.Load()-spins)/n, "poll-polled/call")
			b.ReportMetric(float64(box.stats.caught.Load()-caught)/n, "poll-caught/call")
			b.ReportMetric(float64(box.stats.sleeps.Load()-sleeps)/n, "poll-sleeps/call")
			b.ReportMetric(float64(box.answerNs.Load())/1e3, "poll-answer-µs")
			// Where the polling runner's calls spent their time (means):
			// the worker's coming, the run, the caller's coming.
			if k := float64(box.stats.calls.Load() - k0); k > 0 {
				b.ReportMetric(float64(box.stats.toTake.Load()-take0)/1e3/k, "poll-to-take-µs")
				b.ReportMetric(float64(box.stats.toAnswer.Load()-run0)/1e3/k, "poll-run-µs")
				b.ReportMetric(float64(box.stats.toSeen.Load()-seen0)/1e3/k, "poll-to-seen-µs")
			}
		})
	}
}

// selfCPU is this process's CPU time so far (user and system).
func selfCPU(t testing.TB) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// threadsCPU is the CPU time the threads of process pid have run so far
// (the first field of each /proc/pid/task/*/schedstat, in nanoseconds;
// getrusage reads only this process and the children it has reaped).
func threadsCPU(t testing.TB, pid int) time.Duration {
	t.Helper()
	paths, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
	if err != nil || len(paths) == 0 {
		t.Skipf("no /proc/%d/task/*/schedstat here", pid)
	}
	var n int64
	for _, path := range paths {
		b, err := os.ReadFile(path)
		if err != nil {
			continue // a thread that ended meanwhile
		}
		f := strings.Fields(string(b))
		if len(f) == 0 {
			continue
		}
		k, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			t.Fatalf("%s: %q: %v", path, b, err)
		}
		n += k
	}
	return time.Duration(n)
}
