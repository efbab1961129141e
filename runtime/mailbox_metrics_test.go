package runtime

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// gatherMailbox reads the mailbox metrics from a registry, by series
// (name{label="value"}).
func gatherMailbox(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	series := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			name := mf.GetName()
			for _, l := range m.GetLabel() {
				name += "{" + l.GetName() + "=" + l.GetValue() + "}"
			}
			if mf.GetType() == dto.MetricType_COUNTER {
				series[name] = m.GetCounter().GetValue()
			}
		}
	}
	return series
}

// A real runner's calls through its mailbox are counted on both sides,
// the runner's counts read by the server from the shared memory, and the
// metrics say what the counters say. Calls spaced by a millisecond find
// the worker asleep (its poll is for calls within 40 µs), so that each
// wakes it: the runner's side sleeps about once a call and the server's
// wakes it about once a call.
func TestMailboxMetricsCountBothSides(t *testing.T) {
	cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
	cfg.HealthInterval = time.Hour
	r := startTestRunner(t, cfg)
	reg := prometheus.NewRegistry()
	if err := NewMailboxMetrics(reg); err != nil {
		t.Fatal(err)
	}
	req, _ := rowSumsRequest(rand.New(rand.NewPCG(1, 1)), 1)
	for range 5 {
		if _, err := r.Infer(t.Context(), req); err != nil {
			t.Fatal(err)
		}
	}
	before, m0 := allMailboxTotals(), gatherMailbox(t, reg)
	const calls = 40
	for range calls {
		time.Sleep(time.Millisecond)
		if _, err := r.Infer(t.Context(), req); err != nil {
			t.Fatal(err)
		}
	}
	after, m1 := allMailboxTotals(), gatherMailbox(t, reg)
	t.Logf("server %+v\nrunner %+v", after.caller, after.worker)
	if n := after.caller.calls - before.caller.calls; n != calls {
		t.Errorf("%d calls answered in their slot counted, want %d", n, calls)
	}
	if n := after.worker.sleeps - before.worker.sleeps; n < calls/2 {
		t.Errorf("the runner's workers slept %d times in %d spaced calls (read from the shared memory), want about once a call", n, calls)
	}
	if n := after.caller.wakes - before.caller.wakes; n < calls/2 {
		t.Errorf("the server woke a worker %d times in %d spaced calls, want about once a call", n, calls)
	}
	for series, want := range map[string]float64{
		"sloserve_runner_mailbox_calls_total":                  float64(calls),
		"sloserve_runner_mailbox_wakes_total{side=server}":     float64(after.caller.wakes - before.caller.wakes),
		"sloserve_runner_mailbox_polls_total{side=server}":     float64(after.caller.polls - before.caller.polls),
		"sloserve_runner_mailbox_call_seconds_total{part=run}": float64(after.caller.toAnswer-before.caller.toAnswer) / 1e9,
	} {
		if got := m1[series] - m0[series]; math.Abs(got-want) > 1e-6 {
			t.Errorf("%s went up by %v, want %v", series, got, want)
		}
	}
	// A worker goes to sleep after its answer, so between two reads of
	// the runner's counts one more sleep may come.
	if got, want := m1["sloserve_runner_mailbox_sleeps_total{side=runner}"]-m0["sloserve_runner_mailbox_sleeps_total{side=runner}"], float64(after.worker.sleeps-before.worker.sleeps); math.Abs(got-want) > 1 {
		t.Errorf("the runner's sleeps went up by %v in the metrics, %v in the counters", got, want)
	}
}

// A mailbox's counts stay in the totals after its runner's arena is
// unmapped: the counters never fall.
func TestMailboxMetricsKeepAClosedMailbox(t *testing.T) {
	ar, err := newArena("test", 4096, 2)
	if err != nil {
		t.Fatal(err)
	}
	ar.box.stats.spins.Add(1e9)
	ar.box.workerStats().sleeps.Add(2e9)
	open := allMailboxTotals()
	ar.close()
	closed := allMailboxTotals()
	if closed.caller.polls != open.caller.polls || closed.worker.sleeps != open.worker.sleeps {
		t.Errorf("closing a mailbox moved the totals: server polls %d -> %d, runner sleeps %d -> %d",
			open.caller.polls, closed.caller.polls, open.worker.sleeps, closed.worker.sleeps)
	}
	if open.caller.polls < 1e9 || open.worker.sleeps < 2e9 {
		t.Errorf("an open mailbox's counts missing from the totals: %+v", open)
	}
}

// A real runner whose model allows spinning: the server's calls to it
// poll for their answers even while polling is off in the server's
// process (another poll lost its CPU), where a default runner's callers
// sleep. 40 calls back to back each, every one polled for the spinning
// runner and none for the default one.
//
// Before each call the caller's learnt answer time is set to 50 µs, what
// an idle machine learns (30-60 µs): a caller polls only for answers that
// come within its cap, and beside two CPU burners in make test the
// runner's answers took over the spinning cap of 1 ms, so that no caller
// polled, rightly, and the test failed. The polls counted are those
// begun; how many caught their answer is timing, logged only.
func TestMailboxSpinningRunnerCallersPoll(t *testing.T) {
	defer spinQuietUntil.Store(0)
	req, _ := rowSumsRequest(rand.New(rand.NewPCG(1, 1)), 1)
	for _, allow := range []bool{false, true} {
		cfg := testRunnerConfig(t, testModel(t, "example_dynamic_axes.onnx"))
		cfg.HealthInterval = time.Hour
		cfg.Provider.AllowSpinning = allow
		r := startTestRunner(t, cfg)
		for range 5 { // the answer time learnt
			if _, err := r.Infer(t.Context(), req); err != nil {
				t.Fatal(err)
			}
		}
		box := r.serving.Load().arena.box
		spinQuietUntil.Store(monoNanos() + int64(time.Hour))
		before := allMailboxTotals()
		const calls = 40
		for range calls {
			box.answerNs.Store(int64(50 * time.Microsecond))
			if _, err := r.Infer(t.Context(), req); err != nil {
				t.Fatal(err)
			}
		}
		after := allMailboxTotals()
		polls, n := after.caller.polls-before.caller.polls, after.caller.calls-before.caller.calls
		t.Logf("allow_spinning %v: %d calls in their slot, the server polled %d times (caught %d), slept %d",
			allow, n, polls, after.caller.caught-before.caller.caught, after.caller.sleeps-before.caller.sleeps)
		if n != calls {
			t.Fatalf("allow_spinning %v: %d calls answered in their slot, want %d", allow, n, calls)
		}
		want := int64(0)
		if allow {
			want = calls
		}
		if polls != want {
			t.Errorf("allow_spinning %v: the server's callers polled %d times in %d calls while polling was off, want %d", allow, polls, calls, want)
		}
		spinQuietUntil.Store(0)
	}
}
