package qos

import (
	"errors"
	"testing"
	"testing/synctest"
	"time"
)

// Admission plays a model's own queue forward as the dispatcher will batch
// it. A 15 ms model of 6 ms executions (batch 4 at most) whose traffic
// mostly runs alone, so that its typical batch is 1, gets clumps of
// arrivals: the first runs at once, and the ones that arrive while it runs
// are batched together when it ends. Counted in typical batches, the third
// of a clump waited for two executions ahead of its own (6 + 6 + 6 ms >
// 15 ms) and was refused, although the dispatcher answers it in the second
// batch at 12.3 ms. The sixth of a clump, after a full batch of four, does
// miss (6 + 6.4 + 6.1 ms) and is still refused; no admitted request is late.
func TestAdmissionPlaysTheQueueAsItWillBatch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		took := linear(6*ms, 100*time.Microsecond)
		h.model(ModelSpec{Name: "mob", Class: lc, SLO: 15 * ms, MaxBatchSize: 4}, took)
		h.seed("mob", 4, took)
		h.run()
		ctx := t.Context()

		id := int64(0)
		single := func() {
			id++
			mustSucceed(t, h.submit(ctx, "mob", RequestOptions{}, id))
			time.Sleep(20 * ms)
		}
		// Runs alone: the typical batch is 1.
		for range 20 {
			single()
		}
		const clumps = 10
		var refusedPreadmit int
		var all []*pending
		for range clumps {
			// Three arrive within a millisecond.
			for range 3 {
				id++
				all = append(all, h.submit(ctx, "mob", RequestOptions{}, id))
				time.Sleep(400 * time.Microsecond)
			}
			// Asked before its body is read, the fourth gets the same
			// answer as the third.
			if err := h.s.Preadmit(ctx, "mob", RequestOptions{}); err != nil {
				refusedPreadmit++
			}
			for range 3 {
				id++
				all = append(all, h.submit(ctx, "mob", RequestOptions{}, id))
				time.Sleep(100 * time.Microsecond)
			}
			time.Sleep(30 * ms)
			for range 10 {
				single()
			}
		}
		var good, rejected int
		for i, p := range all {
			err := p.wait(t)
			switch {
			case err == nil:
				good++
			case errors.Is(err, ErrRejected):
				rejected++
				if i%6 != 5 {
					t.Errorf("request %d of its clump refused: %v", i%6+1, err)
				}
			default:
				t.Errorf("request %v: %v", p.ids, err)
			}
		}
		st, _ := h.s.Stats("mob")
		t.Logf("clumps of 6: good %d, refused %d; late %d, dropped %d", good, rejected, st.Late, st.Dropped)
		if good != 5*clumps || rejected != clumps {
			t.Errorf("clumps of 6: %d good and %d refused, want %d and %d (the sixth of each)", good, rejected, 5*clumps, clumps)
		}
		if refusedPreadmit != 0 {
			t.Errorf("Preadmit refused %d of the clumps' fourth requests, which Submit admits", refusedPreadmit)
		}
		if st.Late != 0 || st.Dropped != 0 {
			t.Errorf("%d admitted requests late, %d dropped: admission promised what the batches did not keep", st.Late, st.Dropped)
		}
	})
}

// What admission costs behind a long queue of one-row requests (256, the
// default capacity), played forward in batches of 8: estimates are asked
// once per batch size, not once per request.
func BenchmarkAdmitLongQueue(b *testing.B) {
	s, err := NewScheduler(Options{})
	if err != nil {
		b.Fatal(err)
	}
	est := NewEWMAEstimator(1)
	for n := 1; n <= 8; n++ {
		est.Observe("m", n, time.Duration(n)*time.Millisecond)
	}
	s.est = sized(est)
	if err := s.AddModel(ModelSpec{Name: "m", Class: lc, SLO: time.Hour, MaxBatchSize: 8, Executor: &fakeModel{name: "m", rec: &recorder{}}}); err != nil {
		b.Fatal(err)
	}
	m := s.models["m"]
	now := time.Now()
	for i := range DefaultQueueCapacity - 1 {
		r, err := newRequest(b.Context(), m, idRequest(int64(i)), RequestOptions{}, now)
		if err != nil {
			b.Fatal(err)
		}
		r.seq = uint64(i + 1)
		m.q.push(r)
	}
	r, err := newRequest(b.Context(), m, idRequest(1000), RequestOptions{}, now)
	if err != nil {
		b.Fatal(err)
	}
	r.seq = DefaultQueueCapacity
	b.ReportAllocs()
	s.mu.Lock()
	defer s.mu.Unlock()
	for b.Loop() {
		if err := s.admitLocked(m, r, now); err != nil {
			b.Fatal(err)
		}
	}
}
