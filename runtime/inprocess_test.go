package runtime

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"
)

// A call to an in-process instance whose runs are short runs on its
// caller's goroutine: Infer allocates nothing beyond the run's own (a
// goroutine, its closure, a channel and a result took four), and answers
// the same.
func TestInProcessShortRunsOnTheCallersGoroutine(t *testing.T) {
	ip := startTestInProcess(t, testModel(t, "example_dynamic_axes.onnx"))
	req, want := rowSumsRequest(rand.New(rand.NewPCG(5, 5)), 3)
	for range 10 {
		resp, err := ip.Infer(t.Context(), req)
		if err != nil {
			t.Fatal(err)
		}
		checkRowSums(t, resp, want)
	}
	if !ip.inlineRun(t.Context()) {
		t.Fatalf("runs of %v: not inline", time.Duration(ip.runNs.Load()))
	}
	run := testing.AllocsPerRun(50, func() {
		if _, err := ip.run(req); err != nil {
			t.Fatal(err)
		}
	})
	infer := testing.AllocsPerRun(50, func() {
		if _, err := ip.Infer(t.Context(), req); err != nil {
			t.Fatal(err)
		}
	})
	if infer > run {
		t.Errorf("Infer allocates %v times, the run alone %v: want no more", infer, run)
	}
}

// Which calls run inline: not before a run has been timed, not when runs
// take longer than inlineMax, not when a run would take more than a
// quarter of the time left to the call's deadline.
func TestInProcessInlineRun(t *testing.T) {
	ip := &InProcess{}
	ctx := context.Background()
	soon, cancel := context.WithTimeout(ctx, 30*time.Microsecond)
	defer cancel()
	later, cancel2 := context.WithTimeout(ctx, time.Hour)
	defer cancel2()
	for _, tt := range []struct {
		name string
		est  time.Duration
		ctx  context.Context
		want bool
	}{
		{"nothing learnt", 0, ctx, false},
		{"short runs, no deadline", 20 * time.Microsecond, ctx, true},
		{"short runs, a far deadline", 20 * time.Microsecond, later, true},
		{"short runs, a near deadline", 20 * time.Microsecond, soon, false},
		{"long runs", 2 * inlineMax, ctx, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ip.runNs.Store(int64(tt.est))
			if got := ip.inlineRun(tt.ctx); got != tt.want {
				t.Errorf("inlineRun = %v, want %v", got, tt.want)
			}
		})
	}
}
