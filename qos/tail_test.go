package qos

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// The room for error is counted in time: the larger of what the window's
// runs of consecutive executions as long as the queue took over their
// predictions (mean plus two standard deviations), and the drift plus one
// stall and one standard deviation of independent errors (at most two);
// at most (maxTailRatio-1) times the queue.
func TestTailRoom(t *testing.T) {
	const p = 1e-3 // every execution predicted at 1 ms
	sec := func(f float64) time.Duration { return time.Duration(f * float64(time.Second)) }
	// One stall of 20 ms among 256: 16 of the 241 runs of 16 hold it.
	f := 16.0 / 241
	oneStall := 16e-3 * (1.25*f + 2*1.25*math.Sqrt(f*(1-f)))
	for _, tc := range []struct {
		name  string
		took  func(i int) float64 // seconds, of execution i
		count int
		queue time.Duration
		want  time.Duration
	}{
		{"too few", func(int) float64 { return 2 * p }, minTail - 1, 16 * ms, 0},
		{"as predicted", func(int) float64 { return p }, 100, 16 * ms, 0},
		// A steady 1.2x: 0.2 of the queue.
		{"steady drift", func(int) float64 { return 1.2 * p }, 100, 10 * ms, 2 * ms},
		// 1x and 2x in turn: every run of two or four took 1.5x, but
		// the errors are independent: drift 0.5 (2 ms on 4) plus one
		// stall of 0.5 ms and one deviation, 0.5*sqrt(1*4) ms.
		{"alternating", func(i int) float64 { return float64(1+i%2) * p }, 100, 4 * ms, sec(2e-3 + 0.5e-3 + 1e-3)},
		// One stall of 20 ms: the runs of 16 that hold it are 6.6%;
		// their mean and two deviations are more than the drift and
		// one deviation (S is 0: the 95th percentile is no stall).
		{"one stall", func(i int) float64 {
			if i == 100 {
				return 21 * p
			}
			return p
		}, 256, 16 * ms, sec(oneStall)},
		// A queue of one execution, one in ten stalling 10 ms: the
		// room is at most 2x the queue.
		{"at most the cap", func(i int) float64 {
			if i%10 == 0 {
				return 11 * p
			}
			return p
		}, 256, ms, 2 * ms},
		{"drift capped too", func(int) float64 { return 5 * p }, 100, 10 * ms, 20 * ms},
		// The window slides: 400 executions, the first 144 at 3x, the
		// last 256 as predicted; only the last 256 count.
		{"window slides", func(i int) float64 {
			if i < 144 {
				return 3 * p
			}
			return p
		}, 400, 16 * ms, 0},
		{"never below 0", func(int) float64 { return 0.5 * p }, 100, 16 * ms, 0},
		{"NaN and Inf ignored", func(i int) float64 {
			switch i % 3 {
			case 0:
				return math.NaN()
			case 1:
				return math.Inf(1)
			}
			return 1.5 * p
		}, 300, 10 * ms, 5 * ms},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var tl tail
			for i := range tc.count {
				tl.observe(p, tc.took(i))
			}
			if tl.n >= minTail {
				tl.refresh() // the window as it stands, not as of the last refresh
			}
			if got := tl.room(tc.queue); absDuration(got-tc.want) > time.Microsecond {
				t.Errorf("room(%v) = %v, want %v (drift %.4f, spans %.4g, runs' mean %.4g and deviation %.4g)",
					tc.queue, got, tc.want, tl.drift, tl.spans, tl.runMean, tl.runSD)
			}
		})
	}
}

func absDuration(d time.Duration) time.Duration {
	if d < 0 {
		return -d
	}
	return d
}

// Sixteen closed-loop clients of a 1 ms model against a 40 ms SLO on a
// busy host, where now and then (every 40-80 ms) the runner is
// descheduled for 12-18 ms: sixteen requests of about 1 ms each are far
// inside the SLO even behind a stall, and none is refused. With the room
// from the ratios' mean and standard deviation, the stalls held it at its
// 3x cap and 16 ms ahead at 3x missed 40 ms: hundreds of 429s (issue 33).
// (Stalls that strike executions independently, one in fifty, put two in
// a queue of sixteen about 4% of the time, and two miss 40 ms: those are
// refused now, where a stall strikes the host in time it is not.)
func TestClosedLoopStallsNotRefused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// The estimate stays at the usual 1 ms, as the predictor's
		// correction does: it clamps each execution's ratio (see
		// predictor.ObserveSize), while an EWMA of raw times jumps 2x on
		// each stall and refuses on the mean.
		h := newHarness(t, Options{Estimator: fixedEstimator(ms)})
		host := newBusyHost(33, [2]time.Duration{40 * ms, 80 * ms}, [2]time.Duration{12 * ms, 18 * ms})
		h.model(ModelSpec{Name: "a", Class: lc, SLO: 40 * ms, QueueCapacity: 100}, func([]int64) time.Duration {
			return host.took(ms)
		})
		h.run()
		ctx := t.Context()
		const clients, each = 16, 200
		var wg sync.WaitGroup
		var mu sync.Mutex
		refused := 0
		var first error
		for c := range clients {
			wg.Go(func() {
				for i := range each {
					if _, err := h.s.Submit(ctx, "a", idRequest(int64(c*each+i)), RequestOptions{}); err != nil {
						mu.Lock()
						refused++
						if errors.Is(err, ErrRejected) {
							first = err
						}
						mu.Unlock()
					}
				}
			})
		}
		wg.Wait()
		st, _ := h.s.Stats("a")
		h.s.mu.Lock()
		room := h.s.models["a"].room(16 * ms)
		h.s.mu.Unlock()
		t.Logf("arrived %d good %d late %d rejected %d dropped %d; room for 16ms predicted %v",
			st.Arrived, st.Good, st.Late, st.Rejected, st.Dropped, room)
		// Refusals (429) are the bug; a request that waited behind a
		// stall until its deadline passed is dropped (504), which no
		// admission rule can prevent.
		if st.Rejected != 0 {
			t.Errorf("%d of %d refused (last: %v), want none: the model has the capacity", st.Rejected, clients*each, first)
		}
		if st.Good+st.Late+st.Dropped+st.Rejected != clients*each || refused != int(st.Rejected+st.Dropped) {
			t.Errorf("%d good, %d late, %d dropped, %d errors of %d requests: some went missing",
				st.Good, st.Late, st.Dropped, refused, clients*each)
		}
	})
}

// fixedEstimator predicts every execution at its time per row and learns
// nothing.
type fixedEstimator time.Duration

func (f fixedEstimator) Estimate(_ string, batch int) (time.Duration, bool) {
	return time.Duration(f) * time.Duration(max(batch, 1)), true
}

func (fixedEstimator) Observe(string, int, time.Duration) {}

// BenchmarkTailObserve is the cost one execution adds under the
// scheduler's lock: its times into the window, and every tailRefresh a
// reading of it.
func BenchmarkTailObserve(b *testing.B) {
	b.ReportAllocs()
	var tl tail
	rng := rand.New(rand.NewPCG(1, 2))
	for b.Loop() {
		tl.observe(1e-3, (0.5+rng.Float64())*1e-3)
	}
}

// selectNth finds what a sort would put at every index, with duplicates
// and any order.
func TestSelectNth(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for n := 1; n <= 300; n += 7 {
		xs := make([]float64, n)
		for i := range xs {
			xs[i] = float64(rng.IntN(20)) // duplicates
		}
		sorted := slices.Clone(xs)
		slices.Sort(sorted)
		for k := range n {
			work := slices.Clone(xs)
			if got := selectNth(work, k); got != sorted[k] {
				t.Fatalf("n=%d k=%d: %v, want %v", n, k, got, sorted[k])
			}
			for i := range k {
				if work[i] > work[k] {
					t.Fatalf("n=%d k=%d: %v before it at %d", n, k, work[i], i)
				}
			}
		}
	}
}

// On c slots a plan of P holds about c*P of predicted executions, and a
// stall on one slot delays the plan by its share: the room is the room of
// the work, c*P, over c. A stall of the host that holds both slots at
// once comes twice into the work and delays the plan by itself. On one
// slot the reading is the room of the queue, as before.
func TestTailShared(t *testing.T) {
	const p = 1e-3 // every execution predicted at 1 ms
	sec := func(f float64) time.Duration { return time.Duration(f * float64(time.Second)) }
	// meanTwoSD is the mean plus two standard deviations of the excess
	// per second predicted of runs of 32 ms: 481 of them in 512, held
	// holds[x] of them with x ms over.
	meanTwoSD := func(holds map[float64]int) float64 {
		var sum, sq float64
		for x, k := range holds {
			sum += float64(k) * x / 32
			sq += float64(k) * (x / 32) * (x / 32)
		}
		mean := sum / 481
		return mean + 2*math.Sqrt(sq/481-mean*mean)
	}
	for _, tc := range []struct {
		name  string
		slots int
		took  func(i int) float64 // seconds, of execution i
		queue time.Duration       // the plan, on the slots
		work  time.Duration       // its predicted executions
		want  time.Duration
	}{
		// Two slots, one execution among 512 stalled 20 ms: the 32 runs
		// of 32 that hold it are read; half of that is the plan's. The
		// window of two slots still holds it 411 executions later.
		{"stall on one slot", 2, func(i int) float64 {
			if i == 100 {
				return 21 * p
			}
			return p
		}, 16 * ms, 32 * ms, sec(16e-3 * meanTwoSD(map[float64]int{20: 32}))},
		// Both slots stalled 20 ms at once (two executions in a row):
		// 31 runs hold both, two runs one; about twice the room.
		{"stall of the host", 2, func(i int) float64 {
			if i == 100 || i == 101 {
				return 21 * p
			}
			return p
		}, 16 * ms, 32 * ms, sec(16e-3 * meanTwoSD(map[float64]int{40: 31, 20: 2}))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var tl tail
			tl.setSlots(tc.slots)
			for i := range 512 {
				tl.observe(p, tc.took(i))
			}
			tl.refresh() // the window as it stands, not as of the last refresh
			if got := tl.shared(tc.queue, tc.work); absDuration(got-tc.want) > time.Microsecond {
				t.Errorf("shared(%v, %v) = %v, want %v (drift %.4f, spans %.4g, runs' mean %.4g and deviation %.4g)",
					tc.queue, tc.work, got, tc.want, tl.drift, tl.spans, tl.runMean, tl.runSD)
			}
		})
	}
	// One slot: shared is room, and the window is tailWindow, as before.
	var one, unset tail
	one.setSlots(1)
	for i := range 400 {
		took := p
		if i%37 == 0 {
			took = 15 * p
		}
		one.observe(p, took)
		unset.observe(p, took)
	}
	for _, q := range []time.Duration{ms, 16 * ms, 100 * ms} {
		if a, b, c := one.shared(q, q), one.room(q), unset.room(q); a != b || b != c {
			t.Errorf("one slot, queue %v: shared %v, room %v, room of a tail never sized %v; want all equal", q, a, b, c)
		}
	}
	if one.n != tailWindow {
		t.Errorf("one slot holds %d executions, want %d", one.n, tailWindow)
	}
	// Resizing keeps the most recent executions, the oldest first.
	var grow tail
	for i := range 300 {
		grow.observe(p, float64(i+1)*p)
	}
	grow.setSlots(2)
	if grow.n != tailWindow || grow.took[0] != 45*p || grow.took[tailWindow-1] != 300*p {
		t.Errorf("resized to two slots: %d executions, first %v, last %v; want %d, 45ms, 300ms",
			grow.n, grow.took[0], grow.took[grow.n-1], tailWindow)
	}
}

// risk reads the room's readings as a chance: a plan whose slack is
// shorter than its room is read as more likely late than a normal
// tail at tailZ deviations (about 2.3%), one whose slack is longer as
// less, on windows of every kind (drift, jitter, stalls one in a
// hundred, a host's turns) and plans of every length, on one slot or
// two; before the window fills it is the cold prior's (coldRoom), at the
// cap 0, past the deadline 1.
func TestTailRiskAtRoom(t *testing.T) {
	const p = 1e-3 // every execution predicted at 1 ms
	atZ := 0.5 * math.Erfc(tailZ/math.Sqrt2)
	hosts := []struct {
		name string
		took func(rng *rand.Rand, i int) float64
	}{
		{"steady drift", func(*rand.Rand, int) float64 { return 1.2 * p }},
		{"jitter", func(rng *rand.Rand, _ int) float64 { return p * (1 + 0.6*rng.Float64()) }},
		{"stalls", func(rng *rand.Rand, _ int) float64 {
			if rng.IntN(100) == 0 {
				return p * (15 + 5*rng.Float64())
			}
			return p * (1 + 0.3*rng.Float64())
		}},
		{"turns", func(_ *rand.Rand, i int) float64 {
			if i%40 < 4 {
				return 6 * p
			}
			return p
		}},
	}
	checked := 0
	for _, host := range hosts {
		for _, slots := range []int{1, 2} {
			var tl tail
			tl.setSlots(slots)
			// Before any execution: the cold prior's room and its chance.
			cold := tl.shared(16*ms, time.Duration(slots)*16*ms)
			if want := time.Duration(coldRoom * float64(16*ms)); cold != want {
				t.Errorf("%s, %d slots: room %v before any execution, want the cold prior's %v", host.name, slots, cold, want)
			}
			if r := tl.risk(16*ms, time.Duration(slots)*16*ms, cold); math.Abs(r-atZ) > 1e-9 {
				t.Errorf("%s, %d slots: risk %v at the cold room, want %v", host.name, slots, r, atZ)
			}
			if lo, hi := tl.risk(16*ms, 16*ms, cold*99/100), tl.risk(16*ms, 16*ms, cold*101/100); !(lo > atZ && hi < atZ) {
				t.Errorf("%s, %d slots: risk %v and %v 1%% short of and past the cold room, want above and below %v", host.name, slots, lo, hi, atZ)
			}
			rng := rand.New(rand.NewPCG(7, uint64(slots)))
			for i := range 600 * slots {
				tl.observe(p, host.took(rng, i))
			}
			tl.refresh()
			for _, q := range []time.Duration{ms, 3 * ms, 16 * ms, 40 * ms, 300 * ms, 2 * time.Second} {
				w := time.Duration(slots) * q
				room := tl.shared(q, w)
				if r := tl.risk(q, w, -time.Microsecond); r != 1 {
					t.Errorf("%s, %d slots, plan %v: risk %v past the deadline, want 1", host.name, slots, q, r)
				}
				if r := tl.risk(q, w, (maxTailRatio-1)*q); r != 0 {
					t.Errorf("%s, %d slots, plan %v: risk %v with the most slack admission asks for, want 0", host.name, slots, q, r)
				}
				step := max(room/100, 10*time.Microsecond)
				if short := room - step; short >= 0 {
					if r := tl.risk(q, w, short); !(r > atZ) {
						t.Errorf("%s, %d slots, plan %v: slack %v short of the room %v, risk %.5f, want more than %.5f",
							host.name, slots, q, short, room, r, atZ)
					}
					checked++
				}
				if long := room + step; long < (maxTailRatio-1)*q {
					if r := tl.risk(q, w, long); !(r < atZ) {
						t.Errorf("%s, %d slots, plan %v: slack %v past the room %v, risk %.5f, want less than %.5f",
							host.name, slots, q, long, room, r, atZ)
					}
					checked++
				}
			}
		}
	}
	if checked < 40 {
		t.Errorf("only %d plans had a room to read around", checked)
	}
}

// The room's deviations learn from the outcomes of requests admitted at
// the margin: one late in 1/marginLateAim leaves them where they are,
// late ones raise them (and the room with them) up to maxTailZ, requests
// on time bring them back to tailZ and never below; admissions away from
// the margin relax them by a factor e in relaxAdmissions, and a model
// found idle forgets them. Only a request whose slack is at most
// marginRoom times its room, with the room read from the window, is at
// the margin.
func TestTailLearnsAtTheMargin(t *testing.T) {
	const p = 1e-3
	var tl tail
	if tl.atMargin(16*ms, 16*ms) {
		t.Error("at the margin before the window is read: the cold prior's room would teach the window's")
	}
	rng := rand.New(rand.NewPCG(3, 4))
	for range 600 {
		took := p * (1 + 0.3*rng.Float64())
		if rng.IntN(100) == 0 {
			took = 15 * p
		}
		tl.observe(p, took)
	}
	if tl.z() != tailZ {
		t.Fatalf("z %v before any outcome, want %v", tl.z(), tailZ)
	}
	base := tl.room(16 * ms)
	for _, c := range []struct {
		slack, room time.Duration
		want        bool
	}{{10 * ms, 10 * ms, true}, {11 * ms, 10 * ms, true}, {11*ms + 100*time.Microsecond, 10 * ms, false}, {5 * ms, 10 * ms, true}, {10 * ms, 0, false}} {
		if got := tl.atMargin(c.slack, c.room); got != c.want {
			t.Errorf("slack %v, room %v: at the margin %v, want %v", c.slack, c.room, got, c.want)
		}
	}

	// One late in 200 (marginLateAim 0.5%): no net move.
	for range 5 {
		tl.learn(true)
		for range 199 {
			tl.learn(false)
		}
	}
	if math.Abs(tl.z()-tailZ) > 1e-6 {
		t.Errorf("z %v after 1 late in 200 five times, want %v", tl.z(), tailZ)
	}
	tl.forget()
	for range 10 {
		tl.learn(true)
	}
	want := tailZ + 10*zStep*(1-marginLateAim)
	if math.Abs(tl.z()-want) > 1e-9 {
		t.Errorf("z %v after 10 late, want %v", tl.z(), want)
	}
	if grown := tl.room(16 * ms); grown <= base {
		t.Errorf("room %v at z %v, want more than %v at %v", grown, tl.z(), base, tailZ)
	}
	for range 1000 {
		tl.learn(true)
	}
	if tl.z() != maxTailZ {
		t.Errorf("z %v after 1,000 late, want the cap %v", tl.z(), float64(maxTailZ))
	}
	excess := tl.z() - tailZ
	for range relaxAdmissions {
		tl.relax()
	}
	if got, want := tl.z()-tailZ, excess/math.E; math.Abs(got-want) > 0.01*want {
		t.Errorf("excess %v after %d admissions away from the margin, want about %v", got, relaxAdmissions, want)
	}
	for range 100000 {
		tl.learn(false)
	}
	if tl.z() != tailZ {
		t.Errorf("z %v after 100,000 on time, want the floor %v", tl.z(), tailZ)
	}
	if tl.room(16*ms) != base {
		t.Errorf("room %v back at the floor, want %v", tl.room(16*ms), base)
	}
	tl.learn(true)
	tl.forget()
	if tl.z() != tailZ {
		t.Errorf("z %v forgotten, want %v", tl.z(), tailZ)
	}
}
