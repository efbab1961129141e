package qos

import (
	"math/rand/v2"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// busyHost is a core the model's runner shares with other work, as CPU
// burners share it: the runner has the core for a while, then waits
// while others run, in turns of random length (a time-based stall, not
// one per execution). An execution needing cpu of the core's time takes
// from its start until the runner has had that much of it.
type busyHost struct {
	start  time.Time
	turns  []time.Duration // alternating: the runner's turn, others' turn, ...
	ends   []time.Duration // end of each turn since start
	on     [2]time.Duration
	off    [2]time.Duration
	rng    *rand.Rand
	mu     sync.Mutex
	offSum time.Duration
}

// newBusyHost gives the runner turns of on[0]..on[1] and others turns of
// off[0]..off[1], uniformly, from a seeded source; it must be made inside
// the test's bubble (its clock starts there).
func newBusyHost(seed uint64, on, off [2]time.Duration) *busyHost {
	return &busyHost{start: time.Now(), on: on, off: off, rng: rand.New(rand.NewPCG(seed, seed+1))}
}

func (h *busyHost) uniform(r [2]time.Duration) time.Duration {
	return r[0] + time.Duration(h.rng.Int64N(int64(r[1]-r[0])+1))
}

// took is how long an execution needing cpu, started now, takes.
func (h *busyHost) took(cpu time.Duration) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := time.Since(h.start)
	at, need := now, cpu
	for i := 0; ; i++ {
		for i >= len(h.ends) {
			r := h.on
			if len(h.ends)%2 == 1 {
				r = h.off
			}
			d := h.uniform(r)
			end := d
			if n := len(h.ends); n > 0 {
				end += h.ends[n-1]
			}
			h.turns, h.ends = append(h.turns, d), append(h.ends, end)
		}
		if h.ends[i] <= at {
			continue
		}
		if i%2 == 1 { // others' turn: wait for its end
			at = h.ends[i]
			continue
		}
		if left := h.ends[i] - at; left >= need {
			return at + need - now
		} else {
			need -= left
			at = h.ends[i]
		}
	}
}

// busyHostTurns are the turns of the tests below: the runner has the core
// for 4-8 ms, then waits 4-10 ms (about 46% of the core; a burner's time
// slices are a few milliseconds).
var busyHostTurns = struct{ on, off [2]time.Duration }{
	on:  [2]time.Duration{4 * ms, 8 * ms},
	off: [2]time.Duration{4 * ms, 10 * ms},
}

// Sixteen closed-loop clients of a model needing 0.6 ms of the core per
// execution, on the busy host above, against a 40 ms SLO. The estimate is
// a fixed 1 ms, the typical execution as the predictor's correction (a
// geometric mean) learns it, while the mean is about 1.3 ms and one
// execution in ten holds a stall of 4-10 ms (ratios of 5 to 11 over the
// prediction). Sixteen requests take about 21 ms and, delayed by one
// stall beyond the average, about 30: the model has the capacity, and
// none is refused. The room as a ratio per execution (its 95th
// percentile, about 7.5x, over sqrt(16), capped at 3x) missed 40 ms on
// 16 ms predicted, and refused about a third of the requests (issue 33).
func TestBusyHostClosedLoopNotRefused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{Estimator: fixedEstimator(ms)})
		host := newBusyHost(33, busyHostTurns.on, busyHostTurns.off)
		h.model(ModelSpec{Name: "a", Class: lc, SLO: 40 * ms, QueueCapacity: 100}, func([]int64) time.Duration {
			return host.took(600 * time.Microsecond)
		})
		h.run()
		const clients, each = 16, 200
		start := time.Now()
		first := submitClosedLoop(t, h, clients, each)
		took := time.Since(start)
		st, _ := h.s.Stats("a")
		h.s.mu.Lock()
		drift := h.s.models["a"].tail.drift
		room := h.s.models["a"].room(16 * ms)
		h.s.mu.Unlock()
		t.Logf("arrived %d good %d late %d rejected %d dropped %d in %v (%.0f/s); drift %.2f; room for 16ms predicted %v",
			st.Arrived, st.Good, st.Late, st.Rejected, st.Dropped, took, float64(st.Good+st.Late)/took.Seconds(),
			drift, room)
		if st.Rejected != 0 {
			t.Errorf("%d of %d refused (last: %v), want none: the model has the capacity", st.Rejected, clients*each, first)
		}
		// The model has the capacity: the requests finish in time (a
		// few behind two stalls in a row may not).
		if late := st.Late + st.Dropped; float64(late) > 0.01*float64(st.Arrived) {
			t.Errorf("%d late and %d dropped of %d, want at most 1%%", st.Late, st.Dropped, st.Arrived)
		}
		if st.Arrived != clients*each {
			t.Errorf("%d arrived, want %d", st.Arrived, clients*each)
		}
	})
}

// The same host and model far past capacity: Poisson arrivals at four
// times what it serves. Admission refuses most; the requests it admits
// finish on time, and the model serves about its capacity.
func TestBusyHostOverloadAdmittedOnTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{Estimator: fixedEstimator(ms)})
		host := newBusyHost(34, busyHostTurns.on, busyHostTurns.off)
		h.model(ModelSpec{Name: "a", Class: lc, SLO: 40 * ms, QueueCapacity: 1000}, func([]int64) time.Duration {
			return host.took(600 * time.Microsecond)
		})
		h.run()
		// The host gives the runner 6 ms of 13 on average: 0.6 ms of
		// the core an execution is about 770 executions a second.
		const (
			capacity = 6.0 / 13 / 0.0006
			rate     = 4 * capacity
			dur      = 5 * time.Second
		)
		submitPoisson(t, h, rand.New(rand.NewPCG(35, 36)), rate, dur)
		st, _ := h.s.Stats("a")
		admitted := st.Good + st.Late + st.Dropped
		good := float64(st.Good) / dur.Seconds() / capacity
		t.Logf("arrived %d good %d late %d rejected %d dropped %d; good/capacity %.2f, late or dropped %.2f%% of admitted",
			st.Arrived, st.Good, st.Late, st.Rejected, st.Dropped, good, 100*float64(st.Late+st.Dropped)/float64(admitted))
		if st.Rejected == 0 {
			t.Error("nothing refused at 4x capacity")
		}
		if share := float64(st.Late+st.Dropped) / float64(admitted); share > 0.01 {
			t.Errorf("%.2f%% of the admitted requests late or dropped, want at most 1%%", 100*share)
		}
		if good < 0.8 {
			t.Errorf("goodput %.2f of capacity, want at least 0.8", good)
		}
	})
}

// submitPoisson submits requests of model "a", each on a goroutine of its
// own, at Poisson arrivals of rate a second drawn from arrivals, for dur,
// and waits for every answer.
func submitPoisson(t *testing.T, h *harness, arrivals *rand.Rand, rate float64, dur time.Duration) {
	var wg sync.WaitGroup
	id := int64(0)
	for start := time.Now(); time.Since(start) < dur; {
		<-time.After(time.Duration(arrivals.ExpFloat64() / rate * float64(time.Second)))
		id++
		req := idRequest(id)
		wg.Go(func() { h.s.Submit(t.Context(), "a", req, RequestOptions{}) })
	}
	wg.Wait()
}
