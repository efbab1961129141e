package qos

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// hostTally is what a closed loop of clients on a noisy host came to:
// requests sent, refused, the refusals' bursts (a client refused at one
// instant sends its next request at that instant and is refused again
// until the state changes, so one refusal can cost a client all its
// remaining requests: a burst is a client's run of refusals at one
// instant), and admitted requests that finished after their deadline
// (late or dropped); and of the answered, those answered after more
// than 40 ms.
type hostTally struct {
	arrived, refused, bursts, late, slow int
}

func (h hostTally) String() string {
	return fmt.Sprintf("%4d refused (%3d bursts) %3d late", h.refused, h.bursts, h.late)
}

// closedLoopTally runs clients closed-loop clients of model "a" on h,
// each sending each requests one after another, and tallies them; a
// request is late when its answer took longer than slo (whatever the
// model's own SLO: a model of a long SLO admits everything, and the
// tally then says what admitting everything comes to) or when it was
// dropped.
func closedLoopTally(t *testing.T, h *harness, clients, each int, slo time.Duration) hostTally {
	var mu sync.Mutex
	var tally hostTally
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			refusedAt := time.Time{}
			for i := range each {
				start := time.Now()
				_, err := h.s.Submit(t.Context(), "a", idRequest(int64(c*each+i)), RequestOptions{})
				mu.Lock()
				tally.arrived++
				switch {
				case errors.Is(err, ErrRejected):
					tally.refused++
					if !refusedAt.Equal(start) {
						tally.bursts++
					}
					refusedAt = start
				case errors.Is(err, ErrDropped) || err == nil && time.Since(start) > slo:
					tally.late++
				case err != nil:
					t.Errorf("request %d: %v", c*each+i, err)
				}
				if err == nil && time.Since(start) > 40*ms {
					tally.slow++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return tally
}

// hostArrival is what simulateHost tells an admission of a request at
// its arrival.
type hostArrival struct {
	at, deadline time.Duration
	finish       time.Duration // when it would finish: only an oracle knows
	late         int           // of the admitted so far
	// The slots' state, which admission sees: the starts of the
	// executions running, how many slots are idle, and the deadlines of
	// the requests admitted that wait, in order.
	running []time.Duration
	idle    int
	ahead   []time.Duration
}

// hostAdmission decides at a request's arrival whether to admit it.
type hostAdmission func(r *hostArrival) bool

// simulateHost plays the closed loop of closedLoopTally on the noisy
// host of seed (noisySlots: the host's random stream draws each
// execution's time as it starts) with admission decided by admit, which
// sees each request's real finish: clients closed-loop clients of each
// requests on slots slots, the requests served in arrival order (the
// model's requests have one SLO, so earliest deadline first is arrival
// order), one at a time, each on the slot that frees first. A request
// admitted is never overtaken by a later one, so its finish is known at
// its arrival: the executions ahead of it are the ones admitted before
// it, and the host's stream gives the times of theirs and its own in the
// order they start.
func simulateHost(seed uint64, slots, clients, each int, slo time.Duration, admit hostAdmission) hostTally {
	rng := rand.New(rand.NewPCG(seed, 1))
	free := make([]time.Duration, slots) // when each slot frees
	next := make([]time.Duration, clients)
	left := make([]int, clients)
	refusedAt := make([]time.Duration, clients)
	for c := range clients {
		left[c], refusedAt[c] = each, -1
	}
	var tally hostTally
	var draws []time.Duration // the host's stream, as far as drawn
	var runs []hostRun        // admitted, not yet finished, in start order
	var r hostArrival
	executed := 0
	for {
		c := -1 // the client whose request arrives first
		for i := range clients {
			if left[i] > 0 && (c < 0 || next[i] < next[c]) {
				c = i
			}
		}
		if c < 0 {
			return tally
		}
		at := next[c]
		left[c]--
		tally.arrived++
		j := 0
		for i := range free {
			if free[i] < free[j] {
				j = i
			}
		}
		// The stream is drawn as executions start; a refused request's
		// draw goes to the next request admitted, as on the host.
		for len(draws) <= executed {
			draws = append(draws, noisyHost(rng))
		}
		start, deadline := max(at, free[j]), at+slo
		finish := start + draws[executed]
		runs = slices.DeleteFunc(runs, func(x hostRun) bool { return x.end <= at })
		r = hostArrival{at: at, deadline: deadline, finish: finish, late: tally.late, running: r.running[:0], idle: slots, ahead: r.ahead[:0]}
		for _, x := range runs {
			if x.start <= at && !x.dropped {
				r.running = append(r.running, x.start)
				r.idle--
			} else {
				r.ahead = append(r.ahead, x.deadline)
			}
		}
		if !admit(&r) {
			tally.refused++
			if refusedAt[c] != at {
				tally.bursts++
			}
			refusedAt[c] = at
			continue
		}
		if hopeless := deadline - ms; start > hopeless {
			// The dispatcher drops it from the queue once it cannot
			// finish even started then (its prediction, 1 ms, before
			// the deadline): it never runs, and its client hears so.
			tally.late++
			next[c] = hopeless + 1
			runs = append(runs, hostRun{hopeless + 1, hopeless + 1, deadline, true})
			continue
		}
		executed++
		runs = append(runs, hostRun{start, finish, deadline, false})
		free[j], next[c] = finish, finish
		if finish > deadline {
			tally.late++
		}
		if finish-at > 40*ms {
			tally.slow++
		}
	}
}

// hostRun is a request simulateHost admitted: its execution, or, dropped,
// when it leaves the queue (start and end).
type hostRun struct {
	start, end, deadline time.Duration
	dropped              bool
}

// admitAll admits everything.
func admitAll(*hostArrival) bool { return true }

// admitOnTime is the oracle: it admits a request if and only if it
// finishes by its deadline. Nothing it admits is late.
func admitOnTime(r *hostArrival) bool { return r.finish <= r.deadline }

// admitLate is the oracle allowed budget late requests: it admits a
// request that finishes by its deadline, and one that will be late while
// fewer than budget were.
func admitLate(budget int) hostAdmission {
	return func(r *hostArrival) bool { return r.finish <= r.deadline || r.late < budget }
}

// oracleOnePercent plays the oracle allowed 1% of the admitted late:
// admitLate with the largest budget, from 1% of the requests down, that
// leaves at most 1% of the admitted late. (It spends its budget on the
// first late requests, so another oracle may refuse fewer still: this
// is what one that knows the executions' times can do, not the least.)
func oracleOnePercent(seed uint64, slots, clients, each int, slo time.Duration) hostTally {
	for budget := clients * each / 100; ; budget-- {
		t := simulateHost(seed, slots, clients, each, slo, admitLate(budget))
		if budget == 0 || 100*t.late <= t.arrived-t.refused {
			return t
		}
	}
}

// hostRisk is the chance, for an admission that knows the host's
// distribution but not its draws, that a request is late, given the
// slots' state at its arrival. It plays the request's future samples
// times: each running execution takes a time of the host's past what it
// ran already, the requests ahead and the request's own take the host's
// times in turn on the slot that frees first, a request that would start
// too late to finish by its deadline as predicted being dropped instead,
// and the request is late if it finishes after its deadline or is
// dropped. The host's times come from 65,536 of its draws (a
// stream of its own), sorted; the futures from another stream. The same
// state is read alike, as admission reads it: a client refused and asking
// again at once, nothing having changed, is refused again.
func hostRisk(samples int) func(*hostArrival) float64 {
	pool := make([]time.Duration, 1<<16)
	host := rand.New(rand.NewPCG(3, 4))
	for i := range pool {
		pool[i] = noisyHost(host)
	}
	slices.Sort(pool)
	rng := rand.New(rand.NewPCG(1, 2))
	draw := func() time.Duration { return pool[rng.IntN(len(pool))] }
	var free []time.Duration
	var last hostArrival // the state last read, and its chance
	var chance float64
	return func(r *hostArrival) float64 {
		if r.at == last.at && slices.Equal(r.ahead, last.ahead) && slices.Equal(r.running, last.running) {
			return chance
		}
		last = *r
		last.running, last.ahead = slices.Clone(r.running), slices.Clone(r.ahead)
		late := 0
		for range samples {
			free = free[:0]
			for range r.idle {
				free = append(free, r.at)
			}
			for _, start := range r.running {
				past, _ := slices.BinarySearch(pool, r.at-start+1)
				if past == len(pool) { // longer than the host ever takes
					past--
				}
				free = append(free, start+pool[past+rng.IntN(len(pool)-past)])
			}
			for i := 0; ; i++ {
				j := 0
				for k := range free {
					if free[k] < free[j] {
						j = k
					}
				}
				if i == len(r.ahead) {
					if free[j] > r.deadline-ms || free[j]+draw() > r.deadline {
						late++
					}
					break
				}
				if free[j] <= r.ahead[i]-ms { // else dropped, as the request's own
					free[j] += draw()
				}
			}
		}
		chance = float64(late) / float64(samples)
		return chance
	}
}

// admitLikely admits a request if its chance to be late (hostRisk) is at
// most risk.
func admitLikely(risk float64, samples int) hostAdmission {
	chance := hostRisk(samples)
	return func(r *hostArrival) bool { return chance(r) <= risk }
}

// admitShare admits a request if the chances to be late (hostRisk) of the
// last n requests admitted and its own sum to at most share times n: a
// criterion on the admitted requests' expected late share, not on each
// request's risk.
func admitShare(share float64, n, samples int) hostAdmission {
	chance := hostRisk(samples)
	risks := make([]float64, 0, n)
	next, sum := 0, 0.0
	return func(r *hostArrival) bool {
		p := chance(r)
		if (sum+p)/float64(n) > share { // fewer than n yet: the rest count as none
			return false
		}
		if len(risks) < n {
			risks = append(risks, p)
		} else {
			sum -= risks[next]
			risks[next] = p
			next = (next + 1) % n
		}
		sum += p
		return true
	}
}

// What the best possible admission could do on the noisy host of
// TestNoisyHostSlotsReadAsOne (two slots and thirty-two closed-loop
// clients, one slot and sixteen, six of the host's random streams),
// against today's. simulateHost plays the harness; that it does is
// checked against the harness itself, exactly: with an SLO that admits
// everything, as many requests take longer than 40 ms in both.
//
// Measured (go test -run 'TestNoisyHostAdmissionBound$' -v ./qos), of
// 9,600 requests on two slots and 4,800 on one:
//   - Nothing refused, the dispatcher dropping what can no longer finish
//     in time: 20-47 late on two slots (at most 0.49%), 27-86 on one
//     (0.56-1.8%, over 1% on four of the six). With 1% of the admitted
//     allowed late, the bound on two slots is no refusal at all; on one
//     slot the oracle allowed 1% refuses none on two hosts, 70-2,466 on
//     the others (it spends its budget on the first late requests, so
//     the least is lower still).
//   - The oracle that admits only what finishes on time refuses more than
//     admission does (543-4,320): a client refused at an instant asks
//     again at that instant, in a state that has not changed, and is
//     refused again, so one refusal costs a client the rest of its 300
//     requests. Refusals here count such bursts, not requests at risk.
//   - Admission that knows the host's distribution (not its draws) and
//     refuses a request whose chance to be late is over 2% (admission's
//     room is about the 98th percentile of the delay): 1,145-1,592
//     refused on two slots (five to eight bursts; 8,650 in all), 8-29
//     late; 1,102-1,387 on one (7,435 in all), 0-25 late. Today: 0-1,068
//     on two slots (0-4 bursts; 2,200 in all), 12-34 late; 0-888 on one
//     (3,756 in all), 11-39 late. Today's admission refuses less than a
//     per-request 2% risk read with perfect knowledge of the host (its
//     room, mean plus two standard deviations of runs that hold a rare
//     stall or none, is short of that risk's): the refusals left are the
//     criterion's, not the estimate's noise.
//   - The same knowledge with a criterion on the admitted requests' late
//     share instead (the chances of the last 1,000 admitted, its own
//     with them, averaging at most 0.8%): no refusal on two slots, which
//     is the bound, with 20-47 late; on one slot, whose requests carry
//     about 1.1% of risk on average, 3,309-3,674 refused (13-15 bursts),
//     2-31 late.
//
// The test fails if the simulation stops playing the harness, or if
// admission refuses more than a fifth beyond what the admission that
// knows the host refuses at 2% risk.
func TestNoisyHostAdmissionBound(t *testing.T) {
	const each = 300
	seeds := []uint64{429, 430, 431, 7, 8, 9}
	if raceEnabled {
		t.Skip("a measurement, mostly of simulations: the race detector slows it tenfold and finds nothing in them (run it without -race)")
	}
	var table strings.Builder
	fmt.Fprintf(&table, "%-5s %-5s | %-31s | %-31s | %-31s | %-31s | %-31s | %-31s | %s\n", "host", "slots",
		"today", "none refused", "oracle: on time", "oracle: 1% late", "knows the host: 2% risk", "knows the host: 0.8% share", "none refused, no drops: over 40 ms (sim / harness)")
	today, likely := map[int]int{}, map[int]int{}
	for _, seed := range seeds {
		for _, slots := range []int{2, 1} {
			clients := 16 * slots
			var now, all hostTally
			synctest.Test(t, func(t *testing.T) {
				now = closedLoopTally(t, noisySlots(t, seed, slots, noisyHost), clients, each, 40*ms)
			})
			synctest.Test(t, func(t *testing.T) {
				all = closedLoopTally(t, noisySlotsSLO(t, seed, slots, time.Hour, noisyHost), clients, each, 40*ms)
			})
			simAll := simulateHost(seed, slots, clients, each, time.Hour, admitAll)
			none := simulateHost(seed, slots, clients, each, 40*ms, admitAll)
			onTime := simulateHost(seed, slots, clients, each, 40*ms, admitOnTime)
			onePercent := oracleOnePercent(seed, slots, clients, each, 40*ms)
			risk := simulateHost(seed, slots, clients, each, 40*ms, admitLikely(0.02, 200))
			share := simulateHost(seed, slots, clients, each, 40*ms, admitShare(0.008, 1000, 200))
			fmt.Fprintf(&table, "%-5d %-5d | %-31v | %-31v | %-31v | %-31v | %-31v | %-31v | %d / %d\n",
				seed, slots, now, none, onTime, onePercent, risk, share, simAll.slow, all.slow)
			if simAll.slow != all.slow {
				t.Errorf("host %d, %d slots: all admitted, %d answered after 40 ms in the simulation, %d in the harness: the simulation does not play the harness",
					seed, slots, simAll.slow, all.slow)
			}
			today[slots] += now.refused
			likely[slots] += risk.refused
		}
	}
	t.Logf("of %d requests a client (late: admitted, and answered after 40 ms or dropped; bursts: see hostTally)\n%s", each, table.String())
	for _, slots := range []int{2, 1} {
		if 5*today[slots] > 6*likely[slots] {
			t.Errorf("%d slots: %d refused, want at most a fifth more than the %d of an admission that knows the host's distribution and refuses at 2%% risk",
				slots, today[slots], likely[slots])
		}
	}
}

// The noisy host past capacity: Poisson arrivals at four times what the
// model serves (its mean execution, about 1.43 ms, on each slot) for 3 s.
// Admission refuses most, and the model serves about its capacity. What
// it admits is not all on time: at the margin an overloaded queue sits
// at, runs of twenty or thirty executions hold a stall one time in six
// or so, and their mean plus two standard deviations is a little short
// of one stall, so a request admitted at the margin is late when one
// falls in its queue. With the room at two deviations, over the six
// hosts 2.2-4.1% of the admitted were late or dropped on two slots,
// 4.1-6.1% on one (0.66% on the busy host of
// TestBusyHostOverloadAdmittedOnTime, a stall one in ten, 4-10 ms).
// Read as a chance, the room's reading at the margin is about 2%: a
// normal tail is short of a host's rare, long stalls. The outcomes of the
// requests admitted at the margin now raise the room's deviations until
// 0.5% of them are late (tail.learn; 2.7-4.7 after 1 s of overload): late
// or dropped 1.2-2.2% on two slots (mean 1.68%, was 3.13%), 2.7-4.0% on
// one (3.41%, was 4.92%), with as many answers on time (25,237 against
// 25,113 on two slots, 12,639 against 12,586 on one). What is left is
// mostly dropped (one slot: 12-21 late, 45-76 dropped a host): a stall
// in front of a queue at the margin, longer than the room, which is at
// most twice the queue (maxTailRatio). A bound of a quantile of rare
// stalls refuses more in the closed loop (TestNoisyHostAdmissionBound);
// learning at the margin does not: a closed loop's queue is not there.
//
// The test fails if the mean share late or dropped over the hosts
// exceeds 2.4% on two slots or 4.2% on one.
func TestNoisyHostOverloadRefused(t *testing.T) {
	seeds := []uint64{429, 430, 431, 7, 8, 9}
	if raceEnabled {
		seeds = seeds[:1]
	}
	lateShare := map[int]float64{}
	for _, seed := range seeds {
		for _, slots := range []int{2, 1} {
			synctest.Test(t, func(t *testing.T) {
				h := noisySlots(t, seed, slots, noisyHost)
				const dur = 3 * time.Second
				capacity := float64(slots) / 1.43e-3
				submitPoisson(t, h, rand.New(rand.NewPCG(seed, 36)), 4*capacity, dur)
				st, _ := h.s.Stats("a")
				admitted := st.Good + st.Late + st.Dropped
				good := float64(st.Good) / dur.Seconds() / capacity
				t.Logf("host %d, %d slots: arrived %d good %d late %d rejected %d dropped %d; good/capacity %.2f, late or dropped %.2f%% of admitted",
					seed, slots, st.Arrived, st.Good, st.Late, st.Rejected, st.Dropped, good, 100*float64(st.Late+st.Dropped)/float64(admitted))
				if st.Rejected == 0 {
					t.Error("nothing refused at 4x capacity")
				}
				if good < 0.8 {
					t.Errorf("goodput %.2f of capacity, want at least 0.8", good)
				}
				lateShare[slots] += float64(st.Late+st.Dropped) / float64(admitted) / float64(len(seeds))
			})
		}
	}
	for slots, bound := range map[int]float64{2: 0.024, 1: 0.042} {
		if lateShare[slots] > bound {
			t.Errorf("%d slots: %.2f%% of the admitted late or dropped over the hosts, want at most %.1f%%", slots, 100*lateShare[slots], 100*bound)
		}
	}
}

// The deviations learned in overload (TestNoisyHostOverloadRefused) are
// the overload's: once the queue has emptied, the next request finds the
// model idle and the room is back at tailZ. Kept, they refused a closed
// loop of clients that began right after 1 s at 4x capacity 3,600 times
// on two slots (six bursts over the six hosts; none forgotten) and 3,883
// times on one (2,958), against 0 and 2,958 with no lesson learned.
func TestMarginLessonForgottenWhenIdle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := noisySlots(t, 429, 2, noisyHost)
		z := func() float64 {
			h.s.mu.Lock()
			defer h.s.mu.Unlock()
			return h.s.models["a"].tail.z()
		}
		submitPoisson(t, h, rand.New(rand.NewPCG(429, 36)), 4*2/1.43e-3, time.Second)
		learned := z()
		if learned <= tailZ {
			t.Fatalf("z %v after 1 s at 4x capacity, want it raised past %v", learned, float64(tailZ))
		}
		time.Sleep(100 * ms)
		if _, err := h.s.Submit(t.Context(), "a", idRequest(1<<40), RequestOptions{}); err != nil {
			t.Fatal(err)
		}
		if got := z(); got != tailZ {
			t.Errorf("z %v after a request found the model idle (%v learned), want %v", got, learned, float64(tailZ))
		}
	})
}
