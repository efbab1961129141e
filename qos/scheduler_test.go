package qos

import (
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/runtime"
)

const (
	lc = ClassLatencyCritical
	be = ClassBestEffort
	ms = time.Millisecond
)

func constant(d time.Duration) func([]int64) time.Duration {
	return func([]int64) time.Duration { return d }
}

// calls formats the executions as model[ids]@start.
func calls(h *harness) []string {
	var out []string
	for _, c := range h.rec.snapshot() {
		out = append(out, c.String())
	}
	return out
}

func checkOrder(t *testing.T, h *harness, want ...string) {
	t.Helper()
	if got := h.rec.order(); !slices.Equal(got, want) {
		t.Errorf("executions = %v\nwant %v", got, want)
	}
}

func checkCalls(t *testing.T, h *harness, want ...string) {
	t.Helper()
	if got := calls(h); !slices.Equal(got, want) {
		t.Errorf("executions = %v\nwant %v", got, want)
	}
}

func TestEDFAcrossLatencyCriticalModels(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		h.model(ModelSpec{Name: "a", Class: lc, SLO: 100 * ms}, nil)
		h.model(ModelSpec{Name: "b", Class: lc, SLO: 50 * ms}, nil)
		h.model(ModelSpec{Name: "c", Class: lc, SLO: 80 * ms}, nil)
		ctx := t.Context()
		short, cancel := context.WithTimeout(ctx, 20*ms)
		defer cancel()
		// All arrive at once, before the dispatcher starts.
		ps := []*pending{
			h.submit(ctx, "a", RequestOptions{}, 1),                                  // deadline 100ms
			h.submit(ctx, "b", RequestOptions{}, 2),                                  // 50ms
			h.submit(ctx, "c", RequestOptions{}, 3),                                  // 80ms
			h.submit(ctx, "a", RequestOptions{Deadline: time.Now().Add(30 * ms)}, 4), // its own deadline tightens the SLO
			h.submit(ctx, "c", RequestOptions{Priority: 1}, 5),                       // 80ms too; priority 1 goes before the default
			h.submit(short, "a", RequestOptions{}, 6),                                // the context's deadline: 20ms
		}
		h.run()
		mustSucceed(t, ps...)
		checkOrder(t, h, "a:6", "a:4", "b:2", "c:5", "c:3", "a:1")
		for _, m := range []string{"a", "b", "c"} {
			if st, _ := h.s.Stats(m); st.Good != st.Arrived || st.Late != 0 {
				t.Errorf("%s: %+v", m, st)
			}
		}
	})
}

func TestBestEffortYieldsAtBatchBoundaries(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{BestEffortFloor: -1})
		h.model(ModelSpec{Name: "be", Class: be}, constant(20*ms))
		h.model(ModelSpec{Name: "lc", Class: lc, SLO: 100 * ms}, nil)
		h.run()
		ctx := t.Context()
		ps := []*pending{h.submit(ctx, "be", RequestOptions{}, 1), h.submit(ctx, "be", RequestOptions{}, 2), h.submit(ctx, "be", RequestOptions{}, 3)}
		time.Sleep(5 * ms)
		ps = append(ps, h.submit(ctx, "lc", RequestOptions{}, 10))
		mustSucceed(t, ps...)
		// Best-effort ran while the device was idle; the latency-critical
		// request waited for the running batch, not for the queued ones.
		checkCalls(t, h, "be[1]@0s", "lc[10]@20ms", "be[2]@30ms", "be[3]@50ms")
	})
}

func TestBestEffortFloor(t *testing.T) {
	tests := []struct {
		floor float64
		want  []string
	}{
		{0.25, []string{"lc:1", "lc:2", "lc:3", "be:101", "lc:4", "lc:5", "lc:6", "be:102", "lc:7", "lc:8", "be:103", "be:104"}},
		{-1, []string{"lc:1", "lc:2", "lc:3", "lc:4", "lc:5", "lc:6", "lc:7", "lc:8", "be:101", "be:102", "be:103", "be:104"}},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint("floor=", tt.floor), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				h := newHarness(t, Options{BestEffortFloor: tt.floor})
				h.model(ModelSpec{Name: "lc", Class: lc, SLO: 10 * time.Second}, constant(ms))
				h.model(ModelSpec{Name: "be", Class: be}, constant(ms))
				var ps []*pending
				for i := range int64(8) {
					ps = append(ps, h.submit(t.Context(), "lc", RequestOptions{}, i+1))
				}
				for i := range int64(4) {
					ps = append(ps, h.submit(t.Context(), "be", RequestOptions{}, 101+i))
				}
				h.run()
				mustSucceed(t, ps...)
				checkOrder(t, h, tt.want...)
			})
		})
	}
}

func TestBatching(t *testing.T) {
	withOutputs := func(id int64) *runtime.InferRequest {
		r := idRequest(id)
		r.Outputs = []string{"y"}
		return r
	}
	tests := []struct {
		name   string
		policy string
		spec   ModelSpec
		reqs   []*runtime.InferRequest // queued before the dispatcher starts
		want   []string
	}{
		{"up to max", PolicyQoS, ModelSpec{MaxBatchSize: 4},
			[]*runtime.InferRequest{idRequest(1), idRequest(2), idRequest(3), idRequest(4), idRequest(5), idRequest(6), idRequest(7), idRequest(8), idRequest(9), idRequest(10)},
			[]string{"m:1,2,3,4", "m:5,6,7,8", "m:9,10"}},
		{"multi-row requests", PolicyQoS, ModelSpec{MaxBatchSize: 4},
			[]*runtime.InferRequest{idRequest(1, 2), idRequest(3), idRequest(4, 5, 6)},
			[]string{"m:1,2,3", "m:4,5,6"}},
		{"preferred sizes", PolicyQoS, ModelSpec{MaxBatchSize: 8, PreferredBatchSizes: []int{2, 3}},
			[]*runtime.InferRequest{idRequest(1), idRequest(2), idRequest(3), idRequest(4), idRequest(5), idRequest(6), idRequest(7)},
			[]string{"m:1,2,3", "m:4,5,6", "m:7"}},
		{"no batch dimension", PolicyQoS, ModelSpec{},
			[]*runtime.InferRequest{idRequest(1), idRequest(2)},
			[]string{"m:1", "m:2"}},
		{"different outputs not merged", PolicyQoS, ModelSpec{MaxBatchSize: 4},
			[]*runtime.InferRequest{idRequest(1), withOutputs(2), idRequest(3), withOutputs(4)},
			[]string{"m:1,3", "m:2,4"}},
		{"fifo up to max", PolicyFIFO, ModelSpec{MaxBatchSize: 4},
			[]*runtime.InferRequest{idRequest(1), idRequest(2), idRequest(3), idRequest(4), idRequest(5), idRequest(6)},
			[]string{"m:1,2,3,4", "m:5,6"}},
		{"fifo does not reach past a request", PolicyFIFO, ModelSpec{MaxBatchSize: 4},
			[]*runtime.InferRequest{idRequest(1), withOutputs(2), idRequest(3)},
			[]string{"m:1", "m:2", "m:3"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				h := newHarness(t, Options{Policy: tt.policy})
				tt.spec.Name = "m"
				h.model(tt.spec, nil)
				var ps []*pending
				for _, r := range tt.reqs {
					ps = append(ps, h.submitRequest(t.Context(), "m", RequestOptions{}, r))
				}
				h.run()
				mustSucceed(t, ps...)
				checkOrder(t, h, tt.want...)
			})
		})
	}
}

func TestMaxQueueDelay(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		h.model(ModelSpec{Name: "m", MaxBatchSize: 4, MaxQueueDelay: 10 * ms}, nil)
		h.run()
		ctx := t.Context()
		ps := []*pending{h.submit(ctx, "m", RequestOptions{}, 1)}
		time.Sleep(4 * ms)
		ps = append(ps, h.submit(ctx, "m", RequestOptions{}, 2))
		time.Sleep(26 * ms)
		for id := range int64(4) {
			ps = append(ps, h.submit(ctx, "m", RequestOptions{}, 3+id))
		}
		mustSucceed(t, ps...)
		// The first batch waited the head's 10ms; the full one went at once.
		checkCalls(t, h, "m[1 2]@10ms", "m[3 4 5 6]@30ms")
	})
}

func TestMaxQueueDelayBoundedBySlack(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		h.model(ModelSpec{Name: "m", Class: lc, SLO: 20 * ms, MaxBatchSize: 4, MaxQueueDelay: 50 * ms}, constant(8*ms))
		h.seed("m", 4, constant(8*ms))
		h.run()
		p := h.submit(t.Context(), "m", RequestOptions{}, 1)
		mustSucceed(t, p)
		// It waited only until it could still finish in time: 20ms - 8ms.
		checkCalls(t, h, "m[1]@12ms")
		if st, _ := h.s.Stats("m"); st.Good != 1 {
			t.Errorf("stats = %+v", st)
		}
	})
}

func TestDeadlineAwareBatchSize(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		took := linear(5*ms, 10*ms) // batch b takes 5ms + 10ms*b
		h := newHarness(t, Options{})
		h.model(ModelSpec{Name: "m", Class: lc, SLO: 50 * ms, MaxBatchSize: 8}, took)
		var ps []*pending
		for id := range int64(8) {
			ps = append(ps, h.submit(t.Context(), "m", RequestOptions{}, id+1))
		}
		// The estimates arrive after admission, so all eight were admitted.
		h.seed("m", 8, took)
		h.run()
		// A batch of 4 takes 45ms and meets the 50ms deadline; 5 would take 55ms.
		mustSucceed(t, ps[:4]...)
		for _, p := range ps[4:] {
			err := p.wait(t)
			if !errors.Is(err, ErrDropped) {
				t.Errorf("request %v: %v, want ErrDropped", p.ids, err)
			}
			// Dropped as soon as even a batch of one (15ms) could not make it.
			if p.at != 35*ms+1 {
				t.Errorf("request %v dropped at %v, want 35ms", p.ids, p.at)
			}
		}
		checkCalls(t, h, "m[1 2 3 4]@0s")
		st, _ := h.s.Stats("m")
		if st.Good != 4 || st.Dropped != 4 || st.QueueDepth != 0 {
			t.Errorf("stats = %+v", st)
		}
	})
}

func TestAdmission(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		h.model(ModelSpec{Name: "a", Class: lc, SLO: 50 * ms}, constant(30*ms))
		h.model(ModelSpec{Name: "b", Class: lc, SLO: 40 * ms}, constant(20*ms))
		h.model(ModelSpec{Name: "fresh", Class: lc, SLO: ms}, nil)
		h.seed("a", 1, constant(30*ms))
		h.seed("b", 1, constant(20*ms))
		h.run()
		ctx := t.Context()
		first := h.submit(ctx, "a", RequestOptions{}, 1) // 30ms of 50: admitted, starts at once
		tests := []struct {
			name  string
			model string
			miss  string // empty: admitted
		}{
			// 30ms left of the running one + 30ms = 60ms > 50ms.
			{"model queue", "a", "misses the deadline by 10.0ms"},
			// The device is busy with a for 30ms more; 30 + 20 = 50 > 40.
			{"device queue", "b", "misses the deadline by 10.0ms"},
			{"nothing known yet", "fresh", ""},
		}
		var admitted []*pending
		for i, tt := range tests {
			p := h.submit(ctx, tt.model, RequestOptions{}, int64(10+i))
			if tt.miss == "" {
				admitted = append(admitted, p)
				continue
			}
			<-p.done
			if !errors.Is(p.err, ErrRejected) || !strings.Contains(p.err.Error(), tt.miss) {
				t.Errorf("%s: error = %v, want ErrRejected saying %q", tt.name, p.err, tt.miss)
			}
			if p.at != 0 {
				t.Errorf("%s: rejected after %v, want at once", tt.name, p.at)
			}
		}
		mustSucceed(t, first)
		for _, p := range admitted {
			<-p.done // the fresh model's 10ms run misses its 1ms SLO or is dropped; either way it was admitted
			if errors.Is(p.err, ErrRejected) {
				t.Errorf("request %v rejected: %v", p.ids, p.err)
			}
		}
		for _, m := range []string{"a", "b"} {
			if st, _ := h.s.Stats(m); st.Rejected != 1 {
				t.Errorf("%s: %+v", m, st)
			}
		}
		if h.rec.saw(10) || h.rec.saw(11) {
			t.Error("a rejected request was executed")
		}
	})
}

func TestAdmissionCountsLatencyCriticalWorkAhead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		h.model(ModelSpec{Name: "a", Class: lc, SLO: 100 * ms}, constant(30*ms))
		h.model(ModelSpec{Name: "b", Class: lc, SLO: 105 * ms}, constant(20*ms))
		h.model(ModelSpec{Name: "c", Class: be, SLO: 60 * ms}, constant(20*ms))
		h.seed("a", 1, constant(30*ms))
		h.seed("b", 1, constant(20*ms))
		h.seed("c", 1, constant(20*ms))
		h.warm("a")
		h.warm("b")
		h.run()
		ctx := t.Context()
		// a: one running (until 30ms), two queued with deadlines at 100ms.
		ps := []*pending{h.submit(ctx, "a", RequestOptions{}, 1), h.submit(ctx, "a", RequestOptions{}, 2), h.submit(ctx, "a", RequestOptions{}, 3)}
		// b's deadline (105ms) comes after theirs: 30 + 60 + 20 = 110ms.
		rejected := h.submit(ctx, "b", RequestOptions{}, 4)
		<-rejected.done
		if !errors.Is(rejected.err, ErrRejected) || !strings.Contains(rejected.err.Error(), "by 5.0ms") {
			t.Errorf("b: %v, want rejected by 5.0ms", rejected.err)
		}
		// A tighter deadline puts it ahead of a's queue: 30 + 20 = 50ms.
		ps = append(ps, h.submit(ctx, "b", RequestOptions{Deadline: time.Now().Add(50 * ms)}, 5))
		// Best-effort work waits for all queued latency-critical work: it
		// would start at 30 + 60 (a) + 20 (b) = 110ms, past its 60ms target.
		beLate := h.submit(ctx, "c", RequestOptions{}, 6)
		<-beLate.done
		if !errors.Is(beLate.err, ErrRejected) || !strings.Contains(beLate.err.Error(), "by 70.0ms") {
			t.Errorf("c: %v, want rejected by 70.0ms", beLate.err)
		}
		mustSucceed(t, ps[0], ps[1], ps[3])
		// b's request went first (EDF), so a's last could no longer finish
		// by 100ms once a:2 ran (80 + 30): it is dropped, not run late.
		if err := ps[2].wait(t); !errors.Is(err, ErrDropped) {
			t.Errorf("request %v: %v, want ErrDropped", ps[2].ids, err)
		}
		checkCalls(t, h, "a[1]@0s", "b[5]@30ms", "a[2]@50ms")
	})
}

func TestDropExpiredRequests(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		h.model(ModelSpec{Name: "m", Class: lc, SLO: time.Second}, constant(50*ms))
		h.run()
		ctx := t.Context()
		first := h.submit(ctx, "m", RequestOptions{}, 1)
		byOption := h.submit(ctx, "m", RequestOptions{Deadline: time.Now().Add(20 * ms)}, 2)
		short, cancel := context.WithTimeout(ctx, 30*ms)
		defer cancel()
		byContext := h.submit(short, "m", RequestOptions{}, 3)
		mustSucceed(t, first)

		if err := byOption.wait(t); !errors.Is(err, ErrDropped) || !strings.Contains(err.Error(), "deadline passed") {
			t.Errorf("request 2: %v, want ErrDropped", err)
		}
		if byOption.at != 20*ms+1 {
			t.Errorf("request 2 dropped at %v, want just after its 20ms deadline", byOption.at)
		}
		if err := byContext.wait(t); !errors.Is(err, context.DeadlineExceeded) || byContext.at != 30*ms {
			t.Errorf("request 3: %v at %v, want context.DeadlineExceeded at 30ms", err, byContext.at)
		}
		if h.rec.saw(2) || h.rec.saw(3) {
			t.Errorf("expired requests were executed: %v", calls(h))
		}
		st, _ := h.s.Stats("m")
		if st.Good != 1 || st.Dropped != 2 || st.QueueDepth != 0 {
			t.Errorf("stats = %+v", st)
		}
	})
}

func TestQueueFull(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		h.model(ModelSpec{Name: "m", QueueCapacity: 2}, constant(100*ms))
		h.run()
		ctx := t.Context()
		ps := []*pending{h.submit(ctx, "m", RequestOptions{}, 1), h.submit(ctx, "m", RequestOptions{}, 2), h.submit(ctx, "m", RequestOptions{}, 3)}
		over := h.submit(ctx, "m", RequestOptions{}, 4)
		<-over.done
		if !errors.Is(over.err, ErrQueueFull) || over.at != 0 {
			t.Errorf("over capacity: %v at %v, want ErrQueueFull at once", over.err, over.at)
		}
		mustSucceed(t, ps...)
		if st, _ := h.s.Stats("m"); st.Rejected != 1 || st.Good != 3 || st.Arrived != 4 {
			t.Errorf("stats = %+v", st)
		}
	})
}

func TestCancellation(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		h.model(ModelSpec{Name: "m", MaxBatchSize: 4}, constant(100*ms))
		h.run()
		ctx := t.Context()
		first := h.submit(ctx, "m", RequestOptions{}, 1)
		queuedCtx, cancelQueued := context.WithCancel(ctx)
		queued := h.submit(queuedCtx, "m", RequestOptions{}, 2)
		if st, _ := h.s.Stats("m"); st.QueueDepth != 1 {
			t.Fatalf("queue depth = %d, want 1", st.QueueDepth)
		}
		time.Sleep(10 * ms)
		cancelQueued()
		synctest.Wait()
		if err := queued.wait(t); !errors.Is(err, context.Canceled) || queued.at != 10*ms {
			t.Errorf("canceled request: %v at %v", err, queued.at)
		}
		if st, _ := h.s.Stats("m"); st.QueueDepth != 0 || st.Canceled != 1 {
			t.Errorf("stats = %+v", st)
		}
		// Canceling the only member of a running batch cancels the execution
		// and frees its slot at once.
		mustSucceed(t, first)
		runningCtx, cancelRunning := context.WithCancel(ctx)
		running := h.submit(runningCtx, "m", RequestOptions{}, 3)
		time.Sleep(10 * ms)
		cancelRunning()
		next := h.submit(ctx, "m", RequestOptions{}, 4)
		if err := running.wait(t); !errors.Is(err, context.Canceled) {
			t.Errorf("canceled running request: %v", err)
		}
		mustSucceed(t, next)
		checkCalls(t, h, "m[1]@0s", "m[3]@100ms", "m[4]@110ms")
		if st, _ := h.s.Stats("m"); st.Canceled != 2 || st.Good != 2 || st.Failed != 0 {
			t.Errorf("stats = %+v", st)
		}
	})
}

func TestExecutionFailureFailsTheBatch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		f := h.model(ModelSpec{Name: "m", MaxBatchSize: 4}, nil)
		boom := errors.New("runner crashed")
		f.fail = boom
		var ps []*pending
		for id := range int64(3) {
			ps = append(ps, h.submit(t.Context(), "m", RequestOptions{}, id+1))
		}
		h.run()
		for _, p := range ps {
			if err := p.wait(t); !errors.Is(err, boom) {
				t.Errorf("request %v: %v", p.ids, err)
			}
		}
		checkOrder(t, h, "m:1,2,3")
		if st, _ := h.s.Stats("m"); st.Failed != 3 {
			t.Errorf("stats = %+v", st)
		}
	})
}

func TestRemoveModel(t *testing.T) {
	t.Run("drains", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			h := newHarness(t, Options{})
			h.model(ModelSpec{Name: "m"}, nil)
			ctx := t.Context()
			ps := []*pending{h.submit(ctx, "m", RequestOptions{}, 1), h.submit(ctx, "m", RequestOptions{}, 2), h.submit(ctx, "m", RequestOptions{}, 3)}
			removed := make(chan error, 1)
			go func() { removed <- h.s.RemoveModel(ctx, "m") }()
			synctest.Wait()
			if _, err := h.s.Submit(ctx, "m", idRequest(4), RequestOptions{}); !errors.Is(err, ErrModelRemoved) {
				t.Errorf("Submit while removing: %v", err)
			}
			h.run()
			if err := <-removed; err != nil {
				t.Fatal(err)
			}
			if d := time.Since(h.rec.start); d != 30*ms {
				t.Errorf("removal took %v, want the 30ms of its queue", d)
			}
			mustSucceed(t, ps...)
			if _, ok := h.s.Stats("m"); ok {
				t.Error("stats of a removed model")
			}
			if _, err := h.s.Submit(ctx, "m", idRequest(5), RequestOptions{}); !errors.Is(err, ErrUnknownModel) {
				t.Errorf("Submit after removal: %v", err)
			}
			h.model(ModelSpec{Name: "m"}, nil) // can come back
		})
	})
	t.Run("gives up", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			h := newHarness(t, Options{})
			h.model(ModelSpec{Name: "m"}, nil)
			h.run()
			ctx := t.Context()
			ps := []*pending{h.submit(ctx, "m", RequestOptions{}, 1), h.submit(ctx, "m", RequestOptions{}, 2), h.submit(ctx, "m", RequestOptions{}, 3)}
			rctx, cancel := context.WithTimeout(ctx, 15*ms)
			defer cancel()
			// At 15ms request 2 runs and 3 waits.
			if err := h.s.RemoveModel(rctx, "m"); !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("RemoveModel: %v", err)
			}
			mustSucceed(t, ps[:2]...)
			if err := ps[2].wait(t); !errors.Is(err, ErrModelRemoved) {
				t.Errorf("queued request: %v", err)
			}
			synctest.Wait()
			if _, ok := h.s.Stats("m"); ok {
				t.Error("the model stayed after its last execution")
			}
			checkOrder(t, h, "m:1", "m:2")
		})
	})
}

func TestStatsWindow(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{Window: 10 * time.Second})
		h.model(ModelSpec{Name: "m", Class: lc, SLO: 100 * ms}, func(ids []int64) time.Duration {
			if ids[0] == 6 {
				return 200 * ms // estimated at 10ms, it finishes late
			}
			return 10 * ms
		})
		h.seed("m", 1, constant(10*ms))
		h.warm("m")
		h.run()
		ctx := t.Context()
		var ps []*pending
		for id := range int64(6) {
			ps = append(ps, h.submit(ctx, "m", RequestOptions{}, id+1))
		}
		rejected := h.submit(ctx, "m", RequestOptions{Deadline: time.Now().Add(-ms)}, 7)
		mustSucceed(t, ps...)
		if err := rejected.wait(t); !errors.Is(err, ErrRejected) {
			t.Errorf("request 7: %v", err)
		}
		time.Sleep(time.Second - time.Since(h.rec.start))

		want := Stats{
			Model: "m", Class: lc,
			Arrived: 7, Good: 5, Late: 1, Rejected: 1, SLO: 100 * ms,
			WindowGood: 5, WindowSettled: 7,
			Goodput:        5,       // 5 good in the 1s since the model was added
			Attainment:     5.0 / 7, // late and rejected count against it
			MeanQueueDelay: 25 * ms, // 0, 10, 20, 30, 40, 50ms
		}
		st, _ := h.s.Stats("m")
		// Answered in 10, 20, 30, 40 and 50ms, and the late one in 50+200ms
		// (queued 50ms, then the slow run), each counted in a bucket at most 5% above.
		lat := st.Latency
		if lat.Count() != 6 {
			t.Errorf("latency count = %d, want 6", lat.Count())
		}
		for _, c := range []struct {
			q    float64
			want time.Duration
		}{{0, 10 * ms}, {0.5, 30 * ms}, {0.8, 50 * ms}, {1, 250 * ms}} {
			if got := lat.Quantile(c.q); got < c.want || float64(got) > 1.05*float64(c.want) {
				t.Errorf("latency quantile %.1f = %s, want %s (+5%%)", c.q, got, c.want)
			}
		}
		want.Latency = lat
		// Triton's statistics: the six answered in 400ms in all, after
		// 150ms queued; the rejected one failed at once.
		want.Success, want.Queue, want.Fail = Duration{6, 400 * ms}, Duration{6, 150 * ms}, Duration{1, 0}
		want.ComputeInput, want.ComputeInfer, want.ComputeOutput = Duration{Count: 6}, Duration{Count: 6}, Duration{Count: 6}
		want.Inferences, want.LastInference = 6, h.rec.start.Add(250*ms)
		want.Executions, want.Batches = 6, []BatchStats{{Size: 1, Count: 6}}
		if !reflect.DeepEqual(st, want) || batchTotal(st.Batches) != st.Executions {
			t.Errorf("at 1s: %+v\nwant %+v", st, want)
		}
		if cs := h.s.ClassStats(lc); cs.MeanQueueDelay != 25*ms || cs.QueueDepth != 0 {
			t.Errorf("class stats = %+v", cs)
		}

		// 12s in, those requests have left the window; the counters stay.
		time.Sleep(11 * time.Second)
		want.WindowGood, want.WindowSettled, want.Goodput, want.Attainment, want.MeanQueueDelay = 0, 0, 0, 0, 0
		if st, _ := h.s.Stats("m"); !reflect.DeepEqual(st, want) {
			t.Errorf("at 12s: %+v\nwant %+v", st, want)
		}
		h.seed("m", 1, constant(10*ms)) // the late run taught it 200ms
		mustSucceed(t, h.submit(ctx, "m", RequestOptions{}, 8), h.submit(ctx, "m", RequestOptions{}, 9))
		time.Sleep(time.Second)
		want.Arrived, want.Good = 9, 7
		want.WindowGood, want.WindowSettled, want.Goodput, want.Attainment, want.MeanQueueDelay = 2, 2, 0.2, 1, 5*ms
		st, _ = h.s.Stats("m")
		if d := st.Latency.Sub(&lat); d.Count() != 2 || d.Quantile(1) < 20*ms || d.Quantile(1) > 21*ms {
			t.Errorf("latency since 1s: count %d, max %s; want 2, the later in 20ms", d.Count(), d.Quantile(1))
		}
		want.Latency = st.Latency
		want.Success, want.Queue = Duration{8, 430 * ms}, Duration{8, 160 * ms}
		want.ComputeInput, want.ComputeInfer, want.ComputeOutput = Duration{Count: 8}, Duration{Count: 8}, Duration{Count: 8}
		want.Inferences, want.LastInference = 8, st.LastInference
		want.Executions, want.Batches = 8, []BatchStats{{Size: 1, Count: 8}}
		if !reflect.DeepEqual(st, want) || batchTotal(st.Batches) != st.Executions {
			t.Errorf("at 13s: %+v\nwant %+v", st, want)
		}
	})
}

func TestFIFOPolicy(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{Policy: PolicyFIFO})
		h.model(ModelSpec{Name: "a", Class: lc, SLO: 50 * ms}, constant(100*ms))
		h.model(ModelSpec{Name: "b", Class: be}, nil)
		h.seed("a", 1, constant(100*ms)) // qos would reject every request to a
		ctx := t.Context()
		ps := []*pending{
			h.submit(ctx, "b", RequestOptions{}, 1),
			h.submit(ctx, "a", RequestOptions{}, 2),
			h.submit(ctx, "b", RequestOptions{Priority: 1}, 3),
			h.submit(ctx, "a", RequestOptions{}, 4),
		}
		h.run()
		mustSucceed(t, ps...)
		// Arrival order across models, whatever the class, priority or deadline;
		// late requests are run, not rejected or dropped.
		checkCalls(t, h, "b[1]@0s", "a[2]@10ms", "b[3]@110ms", "a[4]@120ms")
		if st, _ := h.s.Stats("a"); st.Late != 2 || st.Rejected != 0 || st.Dropped != 0 {
			t.Errorf("stats = %+v", st)
		}
	})
}

func TestDeviceAndModelSlots(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{DeviceSlots: 3})
		h.model(ModelSpec{Name: "a", Slots: 2}, nil)
		h.model(ModelSpec{Name: "b", Slots: 2}, constant(15*ms))
		var ps []*pending
		for id := range int64(3) {
			ps = append(ps, h.submit(t.Context(), "a", RequestOptions{}, id+1))
		}
		for id := range int64(2) {
			ps = append(ps, h.submit(t.Context(), "b", RequestOptions{}, id+11))
		}
		h.run()
		mustSucceed(t, ps...)
		// Three device slots, at most two per model. Executions that start
		// together call the executor in any order.
		want := []string{"a[1]@0s", "a[2]@0s", "b[11]@0s", "a[3]@10ms", "b[12]@10ms"}
		if got := calls(h); !slices.Equal(sorted(got), sorted(want)) {
			t.Errorf("executions = %v, want %v in any order", got, want)
		}
	})
}

func TestSubmitValidation(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		h.model(ModelSpec{Name: "m", MaxBatchSize: 2}, nil)
		ctx := t.Context()
		if _, err := h.s.Submit(ctx, "m", idRequest(1, 2, 3), RequestOptions{}); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("batch over max: %v", err)
		}
		if _, err := h.s.Submit(ctx, "nope", idRequest(1), RequestOptions{}); !errors.Is(err, ErrUnknownModel) {
			t.Errorf("unknown model: %v", err)
		}
		if err := h.s.AddModel(ModelSpec{Name: "m", Executor: &fakeModel{}}); err == nil {
			t.Error("a model added twice")
		}
		if err := h.s.AddModel(ModelSpec{Name: "x", Class: "gold", MaxBatchSize: 2, PreferredBatchSizes: []int{3}}); err == nil ||
			!strings.Contains(err.Error(), "gold") || !strings.Contains(err.Error(), "preferred") || !strings.Contains(err.Error(), "executor") {
			t.Errorf("bad spec: %v", err)
		}
		ctx2, cancel := context.WithCancel(ctx)
		done := make(chan error)
		go func() { done <- h.s.Run(ctx2) }()
		synctest.Wait()
		if err := h.s.Run(ctx); err == nil {
			t.Error("Run ran twice")
		}
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		if _, err := h.s.Submit(ctx, "m", idRequest(1), RequestOptions{}); !errors.Is(err, ErrStopped) {
			t.Errorf("Submit after Run: %v", err)
		}
	})
	for _, o := range []Options{{Policy: "lottery"}, {BestEffortFloor: 2}, {DeviceSlots: -1}} {
		if _, err := NewScheduler(o); err == nil {
			t.Errorf("NewScheduler(%+v) accepted", o)
		}
	}
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

// Best-effort work that holds one device slot does not delay a
// latency-critical request that has a free slot: it is admitted and runs at
// once.
func TestAdmissionIgnoresBestEffortOnOtherSlots(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{DeviceSlots: 2})
		h.model(ModelSpec{Name: "be", Class: be}, constant(100*ms))
		h.model(ModelSpec{Name: "lc", Class: lc, SLO: 30 * ms}, constant(10*ms))
		h.seed("be", 1, constant(100*ms))
		h.seed("lc", 1, constant(10*ms))
		h.run()
		ctx := t.Context()
		long := h.submit(ctx, "be", RequestOptions{}, 1)
		synctest.Wait() // the best-effort batch holds a slot until 100ms
		quick := h.submit(ctx, "lc", RequestOptions{}, 2)
		mustSucceed(t, quick, long)
		checkCalls(t, h, "be[1]@0s", "lc[2]@0s")

		// With both slots held, the wait is until the first one frees.
		h2 := newHarness(t, Options{DeviceSlots: 1})
		h2.model(ModelSpec{Name: "be", Class: be}, constant(100*ms))
		h2.model(ModelSpec{Name: "lc", Class: lc, SLO: 30 * ms}, constant(10*ms))
		h2.seed("be", 1, constant(100*ms))
		h2.seed("lc", 1, constant(10*ms))
		h2.run()
		blocking := h2.submit(ctx, "be", RequestOptions{}, 1)
		synctest.Wait()
		refused := h2.submit(ctx, "lc", RequestOptions{}, 2)
		<-refused.done
		if !errors.Is(refused.err, ErrRejected) || !strings.Contains(refused.err.Error(), "by 80.0ms (queue ahead 100.0ms") {
			t.Errorf("lc behind a 100ms batch on the only slot: %v, want rejected by 80.0ms", refused.err)
		}
		mustSucceed(t, blocking)
	})
}

const gib = int64(1) << 30

func TestModelSpecShareFields(t *testing.T) {
	exec := ExecutorFunc(func(context.Context, *runtime.InferRequest) (*runtime.InferResponse, error) { return nil, nil })
	for _, tc := range []struct {
		spec ModelSpec
		want string
	}{
		{ModelSpec{MinShare: 1.5}, "min share 1.5 or max share 0 is not a fraction"},
		{ModelSpec{MaxShare: -0.1}, "is not a fraction"},
		{ModelSpec{MinShare: 0.5, MaxShare: 0.2}, "min share 0.5 is over max share 0.2"},
		{ModelSpec{Pin: &limiter.Share{Compute: math.NaN()}}, "pinned share"},
		{ModelSpec{Pin: &limiter.Share{Memory: -1}}, "pinned share"},
		{ModelSpec{Memory: -1}, "memory share -1 is negative"},
	} {
		spec := tc.spec
		spec.Name, spec.Executor = "m", exec
		if err := validateSpec(&spec); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.spec, err, tc.want)
		}
	}
	pin := &limiter.Share{Compute: 0.5}
	spec := ModelSpec{Name: "m", Executor: exec, MinShare: 0.1, MaxShare: 0.9, Pin: pin, Memory: gib}
	if err := validateSpec(&spec); err != nil {
		t.Fatal(err)
	}
	pin.Compute = 0.7
	if spec.Pin.Compute != 0.5 {
		t.Error("the spec shares its pin with the caller")
	}
}

// batchTotal sums the executions of every batch size.
func batchTotal(bs []BatchStats) uint64 {
	var n uint64
	for _, b := range bs {
		n += b.Count
	}
	return n
}
