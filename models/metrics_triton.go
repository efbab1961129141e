package models

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Triton's per-model inference metrics (nv_inference_*), under Triton's
// names, types, units and labels (model, version), so that dashboards built
// for Triton show sloserve's models. Nothing is counted here: at each scrape
// they are read from the same statistics as the statistics extension
// (Registry.Statistics, from each version's scheduler), so the two always
// agree. Triton's counters carry no _total suffix and its durations are in
// microseconds; the names are kept as Triton exports them, which Prometheus's
// naming lint flags (docs/observability.md).

// Triton's failure reasons (the reason label of nv_inference_request_failure).
const (
	// tritonRejected: refused by the scheduler for time or room (sloserve:
	// rejected at admission, or dropped while queued).
	tritonRejected = "REJECTED"
	// tritonCanceled: the client gave up.
	tritonCanceled = "CANCELED"
	// tritonBackend: the execution failed (a runner died, hung or refused
	// it, or the model went away under it).
	tritonBackend = "BACKEND"
	// tritonOther: the rest; sloserve's invalid requests (inputs that do
	// not match the model).
	tritonOther = "OTHER"
)

var (
	tritonLabels = []string{"model", "version"}

	nvSuccessDesc = prometheus.NewDesc("nv_inference_request_success",
		"Number of successful inference requests, all batch sizes", tritonLabels, nil)
	nvFailureDesc = prometheus.NewDesc("nv_inference_request_failure",
		"Number of failed inference requests, all batch sizes, by reason: REJECTED (refused at admission or dropped while queued), CANCELED, BACKEND (the execution failed), OTHER (invalid inputs)",
		append(tritonLabels[:len(tritonLabels):len(tritonLabels)], "reason"), nil)
	nvCountDesc = prometheus.NewDesc("nv_inference_count",
		"Number of inferences performed (each batch element of a request counts)", tritonLabels, nil)
	nvExecDesc = prometheus.NewDesc("nv_inference_exec_count",
		"Number of model executions performed (a merged batch is one)", tritonLabels, nil)
	nvPendingDesc = prometheus.NewDesc("nv_inference_pending_request_count",
		"Instantaneous number of pending requests awaiting execution per-model", tritonLabels, nil)
	nvRequestDesc = prometheus.NewDesc("nv_inference_request_duration_us",
		"Cumulative inference request duration in microseconds, of the successful requests (arrival to answer)", tritonLabels, nil)
	nvQueueDesc = prometheus.NewDesc("nv_inference_queue_duration_us",
		"Cumulative inference queuing duration in microseconds, of the successful requests", tritonLabels, nil)
	nvInputDesc = prometheus.NewDesc("nv_inference_compute_input_duration_us",
		"Cumulative compute input duration in microseconds, of the successful requests", tritonLabels, nil)
	nvInferDesc = prometheus.NewDesc("nv_inference_compute_infer_duration_us",
		"Cumulative compute inference duration in microseconds, of the successful requests", tritonLabels, nil)
	nvOutputDesc = prometheus.NewDesc("nv_inference_compute_output_duration_us",
		"Cumulative inference compute output duration in microseconds, of the successful requests", tritonLabels, nil)
)

// tritonCollector reports the nv_inference_* series of every loaded version
// at scrape time.
type tritonCollector struct{ r *Registry }

var _ prometheus.Collector = (*tritonCollector)(nil)

func (c *tritonCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{nvSuccessDesc, nvFailureDesc, nvCountDesc, nvExecDesc, nvPendingDesc,
		nvRequestDesc, nvQueueDesc, nvInputDesc, nvInferDesc, nvOutputDesc} {
		ch <- d
	}
}

func (c *tritonCollector) Collect(ch chan<- prometheus.Metric) {
	stats, err := c.r.Statistics("", "")
	if err != nil {
		return
	}
	for _, st := range stats {
		counter := func(d *prometheus.Desc, v uint64, extra ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), append([]string{st.Name, st.Version}, extra...)...)
		}
		us := func(d *prometheus.Desc, v Duration) { counter(d, micros(v.Total)) }
		counter(nvSuccessDesc, st.Success.Count)
		for _, f := range tritonFailures(st) {
			counter(nvFailureDesc, f.count, f.reason)
		}
		counter(nvCountDesc, st.InferenceCount)
		counter(nvExecDesc, st.ExecutionCount)
		var pending int
		if st.SLO != nil {
			pending = st.SLO.QueueDepth
		}
		ch <- prometheus.MustNewConstMetric(nvPendingDesc, prometheus.GaugeValue, float64(pending), st.Name, st.Version)
		us(nvRequestDesc, st.Success)
		us(nvQueueDesc, st.Queue)
		us(nvInputDesc, st.ComputeInput)
		us(nvInferDesc, st.ComputeInfer)
		us(nvOutputDesc, st.ComputeOutput)
	}
}

// tritonFailure is one reason's count of failed requests.
type tritonFailure struct {
	reason string
	count  uint64
}

// tritonFailures splits a version's failed requests (st.Fail.Count) by
// Triton's reasons; the counts add up to st.Fail.Count.
func tritonFailures(st Statistics) []tritonFailure {
	var q SLOStatistics
	if st.SLO != nil {
		q = *st.SLO
	}
	return []tritonFailure{
		{tritonRejected, q.Rejected + q.Dropped},
		{tritonCanceled, q.Canceled},
		{tritonBackend, q.Failed},
		{tritonOther, q.Invalid},
	}
}

// micros is d in whole microseconds, never negative.
func micros(d time.Duration) uint64 { return uint64(max(d.Microseconds(), 0)) }
