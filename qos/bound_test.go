package qos

import (
	"errors"
	"fmt"
	"math/rand/v2"
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
	return fmt.Sprintf("%4d refused (%2d bursts) %3d late", h.refused, h.bursts, h.late)
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

// hostAdmission decides at a request's arrival whether to admit it,
// knowing when it would finish and how many of the requests admitted so
// far were late.
type hostAdmission func(arrival, finish, deadline time.Duration, late, admitted int) bool

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
	admitted, executed := 0, 0
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
		if !admit(at, finish, deadline, tally.late, admitted) {
			tally.refused++
			if refusedAt[c] != at {
				tally.bursts++
			}
			refusedAt[c] = at
			continue
		}
		admitted++
		if hopeless := deadline - ms; start > hopeless {
			// The dispatcher drops it from the queue once it cannot
			// finish even started then (its prediction, 1 ms, before
			// the deadline): it never runs, and its client hears so.
			tally.late++
			next[c] = hopeless + 1
			continue
		}
		executed++
		free[j], next[c] = finish, finish
		if finish > deadline {
			tally.late++
		}
		if finish-at > 40*ms {
			tally.slow++
		}
	}
}

// admitAll admits everything.
func admitAll(_, _, _ time.Duration, _, _ int) bool { return true }

// admitOnTime is the oracle: it admits a request if and only if it
// finishes by its deadline. Nothing it admits is late.
func admitOnTime(_, finish, deadline time.Duration, _, _ int) bool { return finish <= deadline }

// admitLate is the oracle allowed budget late requests: it admits a
// request that finishes by its deadline, and one that will be late while
// fewer than budget were.
func admitLate(budget int) hostAdmission {
	return func(_, finish, deadline time.Duration, late, _ int) bool {
		return finish <= deadline || late < budget
	}
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

// What the best possible admission could do on the noisy host of
// TestNoisyHostSlotsReadAsOne, against today's: for each host's random
// stream, two slots and thirty-two clients, and one slot and sixteen,
// the requests an oracle that knows each execution's time refuses, and
// those admission refuses. The oracle is played by simulateHost; that
// it plays the harness is checked against the harness itself: a model
// whose SLO admits everything runs the same requests as simulateHost
// admitting everything, and as many of them take longer than 40 ms.
func TestNoisyHostAdmissionBound(t *testing.T) {
	const each = 300
	var table strings.Builder
	fmt.Fprintf(&table, "%-5s %-7s | %-30s | %-30s | %-30s | %-30s | %s\n", "host", "slots", "today", "none refused", "oracle on time", "oracle 1% late", "none refused, no drops: over 40 ms (sim / harness)")
	for _, seed := range []uint64{429, 430, 431, 7, 8, 9} {
		for _, slots := range []int{2, 1} {
			clients := 16 * slots
			var today, all hostTally
			synctest.Test(t, func(t *testing.T) {
				today = closedLoopTally(t, noisySlots(t, seed, slots, noisyHost), clients, each, 40*ms)
			})
			synctest.Test(t, func(t *testing.T) {
				all = closedLoopTally(t, noisySlotsSLO(t, seed, slots, time.Hour, noisyHost), clients, each, 40*ms)
			})
			simAll := simulateHost(seed, slots, clients, each, time.Hour, admitAll)
			none := simulateHost(seed, slots, clients, each, 40*ms, admitAll)
			onTime := simulateHost(seed, slots, clients, each, 40*ms, admitOnTime)
			onePercent := oracleOnePercent(seed, slots, clients, each, 40*ms)
			fmt.Fprintf(&table, "%-5d %d/%-5d | %-30v | %-30v | %-30v | %-30v | %d / %d\n",
				seed, slots, clients, today, none, onTime, onePercent, simAll.slow, all.slow)
			if simAll.slow != all.slow {
				t.Errorf("host %d, %d slots: all admitted, %d answered after 40 ms in the simulation, %d in the harness: the simulation does not play the harness",
					seed, slots, simAll.slow, all.slow)
			}
		}
	}
	t.Logf("of %d requests a client (late: admitted, and answered after 40 ms or dropped)\n%s", each, table.String())
}
