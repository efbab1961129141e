package qos

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

// boundedModel is a fakeModel on instances whose memory holds batches up
// to bound: a larger batch fails as a simulated MPS client's arena would,
// with out-of-memory.
type boundedModel struct {
	*fakeModel
	bound atomic.Int64
}

var _ MemoryBound = (*boundedModel)(nil)

func (b *boundedModel) MaxBatch() (int, bool) { return int(b.bound.Load()), true }

func (b *boundedModel) Execute(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
	if n := req.Inputs[0].Shape[0]; n > b.bound.Load() {
		b.rec.record(call{model: b.name, ids: decodeIDs(req.Inputs[0]), at: time.Since(b.rec.start)})
		return nil, fmt.Errorf("%w: arena for a batch of %d over the pinned limit", runtime.ErrInference, n)
	}
	return b.fakeModel.Execute(ctx, req)
}

// boundedModelSpec adds a model whose instances hold batches up to bound.
func (h *harness) boundedModel(spec ModelSpec, took func(ids []int64) time.Duration, bound int) *boundedModel {
	h.t.Helper()
	b := &boundedModel{fakeModel: &fakeModel{name: spec.Name, rec: h.rec, took: took}}
	b.bound.Store(int64(bound))
	spec.Executor = b
	if err := h.s.AddModel(spec); err != nil {
		h.t.Fatal(err)
	}
	return b
}

// batchSizes are the sizes of the recorded executions of a model.
func batchSizes(calls []call, model string) []int {
	var out []int
	for _, c := range calls {
		if c.model == model {
			out = append(out, len(c.ids))
		}
	}
	return out
}

// Batches are formed within what the instances' memory holds now (a
// shrunk MPS memory share), not the model's maximum: a queue of seven
// behind a running request goes as batches of at most three, and none
// fails; once the memory has grown, the next queue goes as one batch.
func TestBatchWithinInstanceMemory(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{DeviceSlots: 1})
		h.run()
		m := h.boundedModel(ModelSpec{Name: "m", MaxBatchSize: 8}, linear(20*time.Millisecond, time.Millisecond), 3)
		first := h.submit(t.Context(), "m", RequestOptions{}, 1)
		var ps []*pending
		for id := int64(2); id <= 8; id++ {
			ps = append(ps, h.submit(t.Context(), "m", RequestOptions{}, id))
		}
		mustSucceed(t, append(ps, first)...)
		sizes := batchSizes(h.rec.snapshot(), "m")
		want := []int{1, 3, 3, 1}
		if fmt.Sprint(sizes) != fmt.Sprint(want) {
			t.Fatalf("batch sizes %v with memory for 3, want %v", sizes, want)
		}

		m.bound.Store(8) // the share grew
		first = h.submit(t.Context(), "m", RequestOptions{}, 11)
		ps = ps[:0]
		for id := int64(12); id <= 19; id++ {
			ps = append(ps, h.submit(t.Context(), "m", RequestOptions{}, id))
		}
		mustSucceed(t, append(ps, first)...)
		sizes = batchSizes(h.rec.snapshot(), "m")[len(want):]
		if fmt.Sprint(sizes) != "[1 8]" {
			t.Errorf("batch sizes %v with memory for 8, want [1 8]", sizes)
		}
		st, _ := h.s.Stats("m")
		if st.Failed != 0 {
			t.Errorf("%d failed requests, want none", st.Failed)
		}
	})
}

// A request that alone is a larger batch than the instances hold waits for
// their memory to grow and then runs; while it waits, another model's work
// runs on the device. One whose memory never grows is refused with
// ErrNoMemory after MemoryWait, never run into an out-of-memory failure.
func TestRequestLargerThanMemoryWaitsOrIsRefused(t *testing.T) {
	t.Run("grows", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			h := newHarness(t, Options{DeviceSlots: 1})
			h.run()
			m := h.boundedModel(ModelSpec{Name: "lc", Class: ClassLatencyCritical, MaxBatchSize: 8}, nil, 2)
			h.model(ModelSpec{Name: "be", MaxBatchSize: 8}, nil)
			big := h.submit(t.Context(), "lc", RequestOptions{}, 1, 2, 3, 4)
			other := h.submit(t.Context(), "be", RequestOptions{}, 9)
			mustSucceed(t, other) // the device is not kept for a request that waits for memory
			time.Sleep(time.Second)
			synctest.Wait()
			if sizes := batchSizes(h.rec.snapshot(), "lc"); len(sizes) != 0 {
				t.Fatalf("lc ran %v with memory for 2, want nothing before it grows", sizes)
			}
			m.bound.Store(4)
			mustSucceed(t, big)
			if sizes := batchSizes(h.rec.snapshot(), "lc"); fmt.Sprint(sizes) != "[4]" {
				t.Errorf("lc ran %v, want one batch of 4 once the memory holds it", sizes)
			}
			if big.at < time.Second || big.at > time.Second+200*time.Millisecond {
				t.Errorf("the large request answered at %v, want soon after the growth at 1s", big.at)
			}
		})
	})
	t.Run("refused", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			h := newHarness(t, Options{DeviceSlots: 1})
			h.run()
			h.boundedModel(ModelSpec{Name: "m", MaxBatchSize: 8}, nil, 2)
			big := h.submit(t.Context(), "m", RequestOptions{}, 1, 2, 3, 4)
			small := h.submit(t.Context(), "m", RequestOptions{}, 5)
			<-big.done
			if !errors.Is(big.err, ErrNoMemory) {
				t.Fatalf("a batch of 4 with memory for 2: %v, want ErrNoMemory", big.err)
			}
			if big.at != MemoryWait {
				t.Errorf("refused at %v, want after MemoryWait (%v)", big.at, MemoryWait)
			}
			mustSucceed(t, small) // behind it, and fits
			if sizes := batchSizes(h.rec.snapshot(), "m"); fmt.Sprint(sizes) != "[1]" {
				t.Errorf("executions %v, want only the small request's", sizes)
			}
			st, _ := h.s.Stats("m")
			if st.Rejected != 1 || st.Failed != 0 {
				t.Errorf("rejected %d, failed %d; want 1 and 0", st.Rejected, st.Failed)
			}
		})
	})
}
