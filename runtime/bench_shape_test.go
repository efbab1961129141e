package runtime

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// BenchmarkRunnerShapeSwitch asks whether a change of input shape costs
// the next execution, as a profile sweep that interleaves shapes (and
// serving of mixed shapes) would pay: the OCR recogniser (an LSTM whose
// buffers scale with the input's width) runs blocks of 4 executions of a
// batch of 4, each block at a width drawn at random from 48x160 to
// 48x1280 (all warmed first). switch-first/rest is the median over blocks
// after a change of width of the block's first execution over the median
// of its other three; same-first/rest the same after a block of the same
// width (switch-blocks and same-blocks count them). Equal ratios: a
// switch costs nothing the next runs do not pay. Each iteration is a
// block. Beside other work on 2 CPUs (load average 22), 2026-11-29:
// 1.023 after a switch (109 blocks), 1.042 after the same width (40).
//
//	go test -run '^$' -bench BenchmarkRunnerShapeSwitch -benchtime 200x ./runtime
func BenchmarkRunnerShapeSwitch(b *testing.B) {
	cfg := testRunnerConfig(b, demoModel(b, "ocr-rec"))
	cfg.Provider = ProviderOptions{IntraOpThreads: 1, InterOpThreads: 1}
	r := startTestRunner(b, cfg)
	widths := []int64{160, 320, 640, 1280}
	const batch, block = 4, 4
	reqs := make([]*InferRequest, len(widths))
	for i, w := range widths {
		reqs[i] = &InferRequest{Inputs: []Tensor{{Name: "x", DataType: FP32, Shape: []int64{batch, 3, 48, w}, Data: make([]byte, 4*batch*3*48*w)}}}
	}
	exec := func(req *InferRequest) float64 {
		start := time.Now()
		if _, err := r.Infer(b.Context(), req); err != nil {
			b.Fatal(err)
		}
		return time.Since(start).Seconds()
	}
	for _, req := range reqs {
		for range 3 {
			exec(req)
		}
	}
	rng := rand.New(rand.NewPCG(29, 1))
	var switched, same []float64
	last := -1
	for b.Loop() {
		i := rng.IntN(len(widths))
		var took []float64
		for range block {
			took = append(took, exec(reqs[i]))
		}
		rest := slices.Clone(took[1:])
		slices.Sort(rest)
		ratio := took[0] / rest[len(rest)/2]
		if i == last {
			same = append(same, ratio)
		} else if last >= 0 {
			switched = append(switched, ratio)
		}
		last = i
	}
	for _, m := range []struct {
		name string
		xs   []float64
	}{{"switch", switched}, {"same", same}} {
		if len(m.xs) > 0 {
			slices.Sort(m.xs)
			b.ReportMetric(m.xs[len(m.xs)/2], m.name+"-first/rest")
			b.ReportMetric(float64(len(m.xs)), m.name+"-blocks")
		}
	}
}

// BenchmarkRunnerWaitVsCPU tells how much of the spread of an execution's
// time is the work itself and how much waiting for a CPU: the OCR
// recogniser's batch of 4 at 48x640 and the detector's batch of 1 at
// 320x320, each in a runner of its own (no quota), alternate execution by
// execution; per model, wall-cv% is the coefficient of variation of the
// executions' wall times and cpu-cv% that of the CPU time the runner's
// threads ran meanwhile (/proc/PID/task/*/schedstat, the Go runtime's
// threads included). Each iteration is one execution of each.
//
//	go test -run '^$' -bench BenchmarkRunnerWaitVsCPU -benchtime 150x ./runtime
func BenchmarkRunnerWaitVsCPU(b *testing.B) {
	type model struct {
		name  string
		shape []int64
		r     *Runner
		req   *InferRequest
		wall  []float64
		cpu   []float64
	}
	ms := []*model{{name: "ocr-rec", shape: []int64{4, 3, 48, 640}}, {name: "ocr-det", shape: []int64{1, 3, 320, 320}}}
	for _, m := range ms {
		m.r = startTestRunner(b, testRunnerConfig(b, demoModel(b, m.name)))
		n := int64(4)
		for _, d := range m.shape {
			n *= d
		}
		m.req = &InferRequest{Inputs: []Tensor{{Name: "x", DataType: FP32, Shape: m.shape, Data: make([]byte, n)}}}
		for range 3 {
			if _, err := m.r.Infer(b.Context(), m.req); err != nil {
				b.Fatal(err)
			}
		}
	}
	for b.Loop() {
		for _, m := range ms {
			cpu0 := ranNanos(m.r.Pid())
			start := time.Now()
			if _, err := m.r.Infer(b.Context(), m.req); err != nil {
				b.Fatal(err)
			}
			m.wall = append(m.wall, time.Since(start).Seconds())
			m.cpu = append(m.cpu, float64(ranNanos(m.r.Pid())-cpu0)/1e9)
		}
	}
	for _, m := range ms {
		b.ReportMetric(100*coefVar(m.wall), m.name+"-wall-cv%")
		b.ReportMetric(100*coefVar(m.cpu), m.name+"-cpu-cv%")
	}
}

// ranNanos is the CPU time the threads of process pid have run, in ns,
// from their schedstat (0 when unreadable).
func ranNanos(pid int) int64 {
	files, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
	var sum int64
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if fields := strings.Fields(string(data)); len(fields) > 0 {
			n, _ := strconv.ParseInt(fields[0], 10, 64)
			sum += n
		}
	}
	return sum
}

// coefVar is the sample standard deviation of xs over their mean.
func coefVar(xs []float64) float64 {
	if len(xs) < 2 {
		return 0
	}
	var s float64
	for _, x := range xs {
		s += x
	}
	mu := s / float64(len(xs))
	var v float64
	for _, x := range xs {
		v += (x - mu) * (x - mu)
	}
	return math.Sqrt(v/float64(len(xs)-1)) / mu
}
