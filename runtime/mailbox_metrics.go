package runtime

import (
	"fmt"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// The server's mailboxes, for the metrics: how the calls through every
// runner's mailbox waited, on the server's side and on the runners'
// (mailboxStats, both in the mailbox's shared header).
var mailboxes = struct {
	mu   sync.Mutex
	live map[*mailbox]struct{}
	// gone sums the counts of the mailboxes unmapped so far, so that the
	// totals never fall when a runner is replaced.
	gone mailboxTotals
}{live: map[*mailbox]struct{}{}}

// mailboxTotals is a snapshot of both sides' counts.
type mailboxTotals struct {
	caller, worker mailboxCounts
}

// mailboxCounts is a snapshot of one mailboxStats.
type mailboxCounts struct {
	polls, caught, sleeps, wakes    int64
	calls, toTake, toAnswer, toSeen int64
}

func (s *mailboxStats) snapshot() mailboxCounts {
	return mailboxCounts{s.spins.Load(), s.caught.Load(), s.sleeps.Load(), s.wakes.Load(),
		s.calls.Load(), s.toTake.Load(), s.toAnswer.Load(), s.toSeen.Load()}
}

func (c mailboxCounts) add(o mailboxCounts) mailboxCounts {
	return mailboxCounts{c.polls + o.polls, c.caught + o.caught, c.sleeps + o.sleeps, c.wakes + o.wakes,
		c.calls + o.calls, c.toTake + o.toTake, c.toAnswer + o.toAnswer, c.toSeen + o.toSeen}
}

func (m *mailbox) totals() mailboxTotals {
	return mailboxTotals{caller: m.stats.snapshot(), worker: m.workerStats().snapshot()}
}

// track counts m in the metrics until forget.
func (m *mailbox) track() {
	mailboxes.mu.Lock()
	mailboxes.live[m] = struct{}{}
	mailboxes.mu.Unlock()
}

// forget folds m's counts into the totals of the mailboxes gone; call it
// before its memory is unmapped.
func (m *mailbox) forget() {
	mailboxes.mu.Lock()
	defer mailboxes.mu.Unlock()
	if _, ok := mailboxes.live[m]; !ok {
		return
	}
	delete(mailboxes.live, m)
	t := m.totals()
	mailboxes.gone.caller = mailboxes.gone.caller.add(t.caller)
	mailboxes.gone.worker = mailboxes.gone.worker.add(t.worker)
}

// allMailboxTotals sums the counts of every mailbox this process has had.
func allMailboxTotals() mailboxTotals {
	mailboxes.mu.Lock()
	defer mailboxes.mu.Unlock()
	sum := mailboxes.gone
	for m := range mailboxes.live {
		t := m.totals()
		sum.caller = sum.caller.add(t.caller)
		sum.worker = sum.worker.add(t.worker)
	}
	return sum
}

// mailboxCollector exports allMailboxTotals.
type mailboxCollector struct {
	polls, caught, sleeps, wakes, calls, seconds *prometheus.Desc
}

var _ prometheus.Collector = (*mailboxCollector)(nil)

// NewMailboxMetrics registers on reg the counts of how the calls through
// this process's runner mailboxes waited: polls, polls that caught what
// they waited for, futex sleeps and wake-ups, on the server's side
// (side="server": callers waiting for answers) and the runners'
// (side="runner": workers waiting for calls; as the runners report them
// in the shared memory), and where a call's time went.
func NewMailboxMetrics(reg prometheus.Registerer) error {
	side := []string{"side"}
	c := &mailboxCollector{
		polls:  prometheus.NewDesc("sloserve_runner_mailbox_polls_total", "Waits in a runner's call mailbox that polled before sleeping.", side, nil),
		caught: prometheus.NewDesc("sloserve_runner_mailbox_polls_caught_total", "Polls in a runner's call mailbox that saw what they waited for (no sleep).", side, nil),
		sleeps: prometheus.NewDesc("sloserve_runner_mailbox_sleeps_total", "Futex sleeps in a runner's call mailbox.", side, nil),
		wakes:  prometheus.NewDesc("sloserve_runner_mailbox_wakes_total", "Futex wake-ups sent to the other side of a runner's call mailbox.", side, nil),
		calls:  prometheus.NewDesc("sloserve_runner_mailbox_calls_total", "Runner calls answered in their mailbox slot.", nil, nil),
		seconds: prometheus.NewDesc("sloserve_runner_mailbox_call_seconds_total",
			"Time of the calls answered in their mailbox slot, by part: to_take (post to a worker taking it), run (take to answer), to_seen (answer to the caller having read it).",
			[]string{"part"}, nil),
	}
	if err := reg.Register(c); err != nil {
		return fmt.Errorf("registering the mailbox metrics: %w", err)
	}
	return nil
}

func (c *mailboxCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.polls, c.caught, c.sleeps, c.wakes, c.calls, c.seconds} {
		ch <- d
	}
}

func (c *mailboxCollector) Collect(ch chan<- prometheus.Metric) {
	t := allMailboxTotals()
	for _, s := range []struct {
		side string
		n    mailboxCounts
	}{{"server", t.caller}, {"runner", t.worker}} {
		ch <- prometheus.MustNewConstMetric(c.polls, prometheus.CounterValue, float64(s.n.polls), s.side)
		ch <- prometheus.MustNewConstMetric(c.caught, prometheus.CounterValue, float64(s.n.caught), s.side)
		ch <- prometheus.MustNewConstMetric(c.sleeps, prometheus.CounterValue, float64(s.n.sleeps), s.side)
		ch <- prometheus.MustNewConstMetric(c.wakes, prometheus.CounterValue, float64(s.n.wakes), s.side)
	}
	ch <- prometheus.MustNewConstMetric(c.calls, prometheus.CounterValue, float64(t.caller.calls))
	for _, p := range []struct {
		part string
		ns   int64
	}{{"to_take", t.caller.toTake}, {"run", t.caller.toAnswer}, {"to_seen", t.caller.toSeen}} {
		ch <- prometheus.MustNewConstMetric(c.seconds, prometheus.CounterValue, float64(p.ns)/1e9, p.part)
	}
}
