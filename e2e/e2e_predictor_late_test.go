package e2e

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// sloCounts is a model's SLO accounting from GET /v2/models/{m}/stats.
type sloCounts struct {
	Arrived, Good, Late, Rejected, Dropped, Failed, Canceled uint64
}

func (s *testServer) sloCounts(t *testing.T, model string) sloCounts {
	t.Helper()
	var st struct {
		ModelStats []struct {
			SLO *sloCounts `json:"slo"`
		} `json:"model_stats"`
	}
	if code := s.json(t, "GET", "/v2/models/"+model+"/stats", nil, &st); code != 200 || len(st.ModelStats) != 1 || st.ModelStats[0].SLO == nil {
		t.Fatalf("GET /v2/models/%s/stats: %d %+v", model, code, st)
	}
	return *st.ModelStats[0].SLO
}

// mixedLoad is one phase of closed-loop load: clients each send each
// requests, client c's i-th at widths[(c+i) % len(widths)], and the
// server's SLO counts of the phase.
type mixedLoad struct {
	server                         sloCounts // the phase's difference
	ok, refused, dropped, slowSeen uint64    // as the clients saw them (slowSeen: answered after the SLO)
}

func (l mixedLoad) lateShare() float64 {
	return float64(l.server.Late) / float64(max(l.server.Good+l.server.Late, 1))
}

func (s *testServer) closedLoop(t *testing.T, model string, slo time.Duration, clients, each int, widths ...int) mixedLoad {
	t.Helper()
	before := s.sloCounts(t, model)
	var (
		mu    sync.Mutex
		l     mixedLoad
		other []error
	)
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			for i := range each {
				start := time.Now()
				_, err := s.grpc.ModelInfer(t.Context(), clsInfer(model, widths[(c+i)%len(widths)]))
				took := time.Since(start)
				mu.Lock()
				switch status.Code(err) {
				case codes.OK:
					l.ok++
					if took > slo {
						l.slowSeen++
					}
				case codes.ResourceExhausted:
					l.refused++
				case codes.DeadlineExceeded:
					l.dropped++
				default:
					other = append(other, err)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(other) > 0 {
		t.Fatalf("%d requests failed otherwise, first: %v", len(other), other[0])
	}
	after := s.sloCounts(t, model)
	l.server = sloCounts{
		Arrived: after.Arrived - before.Arrived, Good: after.Good - before.Good, Late: after.Late - before.Late,
		Rejected: after.Rejected - before.Rejected, Dropped: after.Dropped - before.Dropped,
		Failed: after.Failed - before.Failed, Canceled: after.Canceled - before.Canceled,
	}
	d := l.server
	t.Logf("widths %v, %d clients x %d: server counted good %d late %d rejected %d dropped %d failed %d: late %.2f%% of executed; "+
		"clients saw %d answered (%d after %v), %d refused, %d dropped",
		widths, clients, each, d.Good, d.Late, d.Rejected, d.Dropped, d.Failed, 100*l.lateShare(), l.ok, l.slowSeen, slo, l.refused, l.dropped)
	n := uint64(clients * each)
	if d.Arrived != n || d.Good+d.Late+d.Rejected+d.Dropped+d.Failed+d.Canceled != d.Arrived {
		t.Errorf("server counted %+v for %d requests: they do not add up", d, n)
	}
	if d.Good+d.Late != l.ok || d.Rejected != l.refused || d.Dropped != l.dropped {
		t.Errorf("server: %d executed, %d rejected, %d dropped; clients: %d answered, %d refused, %d dropped",
			d.Good+d.Late, d.Rejected, d.Dropped, l.ok, l.refused, l.dropped)
	}
	// The server counts its own time, the clients theirs, which is
	// longer: the server cannot count more late.
	if d.Late > l.slowSeen {
		t.Errorf("server counted %d late, more than the %d answers the clients saw after %v", d.Late, l.slowSeen, slo)
	}
	return l
}

// TestE2EPredictorMixedShapesLate is issue 29's second aim under mixed
// shapes, read from the server's own counters: the share of admitted
// requests that finished late. The classifier, latency-critical at a 100
// ms SLO and profiled at widths 192 and 960, is driven by closed-loop
// clients, enough that requests queue and batch: first all at width 960,
// then alternating 320 and 1600 (neither profiled; the same mean work,
// 5x apart). It logs the share of executed requests that finished late
// in each phase (issue 29 aims at 0.5% of admitted). Admission and
// batching predict each request at its own size, so the mix is served
// about as well as the one shape; a predictor blind to size predicts
// both widths as the mean of the two, and refused half of the mix. The
// MAPE /v2/control reports after each phase must be about the same (see
// below for the bounds and why they are wide).
func TestE2EPredictorMixedShapesLate(t *testing.T) {
	const model = "cls"
	const slo = 100 * time.Millisecond
	repo := t.TempDir()
	writeRepo(t, repo, repoModel{model, demoModel(t, "ocr-cls"), `max_batch_size: 8
inputs: [{name: x, datatype: FP32, shape: [-1, 3, 48, -1]}]
execution: {intra_op_threads: 1}
slo: {latency_ms: 100, class: latency-critical}
resources: {compute_share: 1}
profile:
  shapes: [{x: [1, 3, 48, 192]}, {x: [1, 3, 48, 960]}]
`})
	dir := t.TempDir()
	s := startServer(t, repo, fmt.Sprintf("control: {profile: {budget: 120s, cache_dir: %q}}\n", dir),
		withCommand("", nil, "SLOSERVE_CONTROL_PROFILE_CACHE_DIR="+dir))
	requireCgroups(t, s.control(t))
	if !s.logHas("profiled", model+"/1") {
		t.Fatalf("the model was not profiled:\n%s", s.log.String())
	}
	// Warm the online correction at each size, one request at a time. A
	// busy machine may hold a request long enough before the server reads
	// it that it is refused or dropped: that is no error here.
	for i := range 60 {
		_, err := s.grpc.ModelInfer(t.Context(), clsInfer(model, []int{960, 320, 1600}[i%3]))
		if c := status.Code(err); c != codes.OK && c != codes.ResourceExhausted && c != codes.DeadlineExceeded {
			t.Fatalf("warm-up: %v", err)
		}
	}
	const clients, each = 8, 60
	one := s.closedLoop(t, model, slo, clients, each, 960)
	pOne := s.prediction(t, model+"/1")
	mixed := s.closedLoop(t, model, slo, clients, each, 320, 1600)
	pMixed := s.prediction(t, model+"/1")
	oneMAPE, nOne, mape, n := pOne.MAPE, pOne.Samples, pMixed.MAPE, pMixed.Samples
	t.Logf("late: %.2f%% of executed at one shape, %.2f%% at two; /v2/control MAPE %.1f%% over %d executions at one shape (jitter floor %.1f%%), %.1f%% over %d at two (floor %.1f%%)",
		100*one.lateShare(), 100*mixed.lateShare(), 100*oneMAPE, nOne, 100*pOne.Floor, 100*mape, n, 100*pMixed.Floor)
	// The same mean work is served about as well mixed as at one shape.
	// A predictor blind to size executed half as many of the mix
	// (measured once: 109 against 209 at one shape); sized, 0.57 to 1.76
	// times the one shape's in 28 runs of one phase each on a machine
	// shared with four builds (load average 10-31 on 2 cores): the load
	// drifting between the two phases, not the predictor. So the count
	// runs over two more phases in the opposite order (one, mixed,
	// mixed, one), which cancels a drift that is steady over the four.
	mixed2 := s.closedLoop(t, model, slo, clients, each, 320, 1600)
	one2 := s.closedLoop(t, model, slo, clients, each, 960)
	executed := func(l mixedLoad) uint64 { return l.server.Good + l.server.Late }
	if exOne, exMixed := executed(one)+executed(one2), executed(mixed)+executed(mixed2); float64(exMixed) < 0.6*float64(exOne) {
		t.Errorf("%d mixed-shape requests executed over two phases, under 0.6 times the %d at one shape: admission mispredicts the mix", exMixed, exOne)
	} else {
		t.Logf("executed: %d and %d at one shape, %d and %d mixed", executed(one), executed(one2), executed(mixed), executed(mixed2))
	}
	// The MAPE of recent executions /v2/control reports: each batch's
	// execution in the runner (the pool call: no queueing in it),
	// against what was predicted for its size, batch and share. Under
	// this load on a machine shared with four builds (load average 10
	// to 31 on 2 cores) it measured 36 to 123% at one shape and 37 to
	// 170% mixed in 30 runs, while the predicted and observed means of
	// the same executions agreed within 35% in every phase (within 15%
	// in most): a batch's time there is the other processes'
	// preemptions as much as the model's, and the MAPE is that jitter
	// (the 90.9% this test once logged). The online correction after
	// the one shape, 1.1 to 2.7 in those runs, is that load too; until
	// predictions stopped at the largest profiled share it carried
	// another 2x besides (3.0 in one run), the model (one intra-op
	// thread, pinned at the whole device) being predicted twice as fast
	// as it can run (predictor's TestPredictorClampsAtTheLargestProfiledShare).
	// The mix is predicted about as well as the one shape, within twice
	// its MAPE plus 30 points (the mixed MAPE was up to 2.6 times the one
	// shape's: the one shape's is as noisy), and both under 300%, a
	// sanity ceiling: predictions 4x the observed time read 300%.
	const maxMAPE = 3.0
	if n < 50 || nOne < 50 {
		t.Fatalf("the MAPE covers %d and %d executions, want 50 or more", nOne, n)
	}
	if bound := 2*oneMAPE + 0.3; mape > bound {
		t.Errorf("/v2/control MAPE under two shapes %.1f%%, over twice the one shape's %.1f%% plus 30 points", 100*mape, 100*oneMAPE)
	}
	if max(mape, oneMAPE) > maxMAPE {
		t.Errorf("/v2/control MAPE %.1f%% at one shape, %.1f%% at two: over %.0f%%", 100*oneMAPE, 100*mape, 100*maxMAPE)
	}
	// Beside the MAPE, /v2/control reports its jitter floor: the least
	// MAPE one time per (size, batch, share) bucket could have had over
	// the same executions, in hindsight. Executions on a loaded machine
	// vary (a floor over 0), and a predictor that gives a bucket about
	// one time cannot be much below it: only by following the load
	// over time, as the online correction does. Measured on a machine
	// shared with four helpers: MAPE 33.7% over a floor of 21.5% at one
	// shape, 45.6% over 26.3% mixed; 72.4% over 32.5%, 100.3% over
	// 39.8%; in 10 more runs 38.8-100% over floors of 24.4-45.3% at one
	// shape, 38.6-183% over 24.6-46.5% mixed (the floor steadier than
	// the MAPE). Most of the difference is each bucket's own bias (with it
	// removed in hindsight, 47.8% and 58.8% in the second run): the
	// size's correction is shared by the batch sizes, and a batch of one
	// is slowed by the machine more than a batch of eight.
	for _, p := range []struct {
		name string
		p    prediction
	}{{"one shape", pOne}, {"two shapes", pMixed}} {
		if !(p.p.Floor > 0) || p.p.Floor > 1.1*p.p.MAPE+0.05 {
			t.Errorf("%s: jitter floor %.1f%%, want above 0 and not over 1.1 times the MAPE %.1f%% plus 5 points", p.name, 100*p.p.Floor, 100*p.p.MAPE)
		}
	}
	// The late shares are reported, not bounded: on a machine shared with
	// other work, stalls decide them (in 10 runs 3.2 to 11.2% at one
	// shape, 2.0 to 7.7% mixed), and a size-blind predictor measured no
	// worse (6.7% and 8.3%): it refused the requests it mispredicted.
}
