package qos

import (
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestMetrics(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		reg := prometheus.NewPedanticRegistry()
		h := newHarness(t, Options{Registerer: reg, Device: "cpu"})
		h.model(ModelSpec{Name: "m", Class: lc, SLO: 100 * ms, MaxBatchSize: 4}, nil)
		// A second device's scheduler shares the registry.
		if _, err := NewScheduler(Options{Registerer: reg, Device: "cuda:0"}); err != nil {
			t.Fatalf("second scheduler: %v", err)
		}
		if _, err := NewScheduler(Options{Registerer: reg, Device: "cpu"}); err == nil {
			t.Error("two schedulers registered the same device")
		}
		ctx := t.Context()
		ps := []*pending{h.submit(ctx, "m", RequestOptions{}, 1), h.submit(ctx, "m", RequestOptions{}, 2), h.submit(ctx, "m", RequestOptions{}, 3)}
		h.run()
		mustSucceed(t, ps...)
		time.Sleep(time.Second - time.Since(h.rec.start))

		want := `
# HELP sloserve_qos_goodput Requests finished within their SLO per second, over the sliding window.
# TYPE sloserve_qos_goodput gauge
sloserve_qos_goodput{class="latency-critical",device="cpu",model="m"} 3
# HELP sloserve_qos_queue_depth Requests waiting in the model's queue.
# TYPE sloserve_qos_queue_depth gauge
sloserve_qos_queue_depth{class="latency-critical",device="cpu",model="m"} 0
# HELP sloserve_qos_inflight_requests Requests waiting in the model's queue or in an execution.
# TYPE sloserve_qos_inflight_requests gauge
sloserve_qos_inflight_requests{class="latency-critical",device="cpu",model="m"} 0
# HELP sloserve_qos_requests_total Requests by outcome: good (within SLO), late, rejected, dropped, failed, canceled, invalid. Every request is counted here once.
# TYPE sloserve_qos_requests_total counter
sloserve_qos_requests_total{class="latency-critical",device="cpu",model="m",outcome="canceled"} 0
sloserve_qos_requests_total{class="latency-critical",device="cpu",model="m",outcome="dropped"} 0
sloserve_qos_requests_total{class="latency-critical",device="cpu",model="m",outcome="failed"} 0
sloserve_qos_requests_total{class="latency-critical",device="cpu",model="m",outcome="good"} 3
sloserve_qos_requests_total{class="latency-critical",device="cpu",model="m",outcome="invalid"} 0
sloserve_qos_requests_total{class="latency-critical",device="cpu",model="m",outcome="late"} 0
sloserve_qos_requests_total{class="latency-critical",device="cpu",model="m",outcome="rejected"} 0
# HELP sloserve_qos_slo_attainment Good requests over requests that ended, over the sliding window.
# TYPE sloserve_qos_slo_attainment gauge
sloserve_qos_slo_attainment{class="latency-critical",device="cpu",model="m"} 1
`
		names := []string{"sloserve_qos_goodput", "sloserve_qos_queue_depth", "sloserve_qos_inflight_requests", "sloserve_qos_requests_total", "sloserve_qos_slo_attainment"}
		if err := testutil.GatherAndCompare(reg, strings.NewReader(want), names...); err != nil {
			t.Error(err)
		}
		// One batch of 3, all dispatched at once.
		if n, err := testutil.GatherAndCount(reg, "sloserve_qos_batch_size", "sloserve_qos_queue_delay_seconds", "sloserve_qos_compute_duration_seconds"); err != nil || n != 3 {
			t.Errorf("histogram series = %d, %v; want 3", n, err)
		}

		if err := h.s.RemoveModel(ctx, "m"); err != nil {
			t.Fatal(err)
		}
		names = append(names, "sloserve_qos_batch_size", "sloserve_qos_queue_delay_seconds", "sloserve_qos_compute_duration_seconds", "sloserve_qos_overlap_holds_total")
		if n, err := testutil.GatherAndCount(reg, names...); err != nil || n != 0 {
			t.Errorf("series after RemoveModel = %d, %v; want 0", n, err)
		}
	})
}
