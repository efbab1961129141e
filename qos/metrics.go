package qos

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are a scheduler's Prometheus series. Counters and histograms are
// vectors whose per-model children are resolved at AddModel and deleted at
// RemoveModel; goodput, attainment and queue depth are computed from the
// scheduler's state when scraped.
type metrics struct {
	requests   *prometheus.CounterVec
	queueDelay *prometheus.HistogramVec
	latency    *prometheus.HistogramVec
	compute    *prometheus.HistogramVec
	batchSize  *prometheus.HistogramVec
	holds      *prometheus.CounterVec

	goodputDesc, attainmentDesc, depthDesc, inflightDesc, sloDesc, rejectedDesc *prometheus.Desc
	s                                                                           *Scheduler
}

// modelMetrics are one model's series, resolved once.
type modelMetrics struct {
	outcomes   [numOutcomes]prometheus.Counter
	queueDelay prometheus.Observer
	latency    prometheus.Observer
	compute    prometheus.Observer
	batchSize  prometheus.Observer
	holds      prometheus.Counter
}

// latencySecondsBuckets span 0.5 ms to 30 s, 25% apart, so that
// histogram_quantile's p99 is within about 12% wherever the SLO lies.
var latencySecondsBuckets = prometheus.ExponentialBucketsRange(0.0005, 30, 50)

func newMetrics(reg prometheus.Registerer, device string, s *Scheduler) (*metrics, error) {
	var constLabels prometheus.Labels
	if device != "" {
		constLabels = prometheus.Labels{"device": device}
	}
	labels := []string{"model", "class"}
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "sloserve_qos_requests_total",
			Help:        "Requests by outcome: good (within SLO), late, rejected, dropped, failed, canceled, invalid. Every request is counted here once.",
			ConstLabels: constLabels,
		}, append(labels, "outcome")),
		queueDelay: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:        "sloserve_qos_queue_delay_seconds",
			Help:        "Time from a request's arrival to the start of its execution.",
			Buckets:     prometheus.ExponentialBuckets(0.0001, 2, 18),
			ConstLabels: constLabels,
		}, labels),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:        "sloserve_qos_request_duration_seconds",
			Help:        "Time from a request's arrival to its answer, of the requests answered (good and late): what the SLO judges.",
			Buckets:     latencySecondsBuckets,
			ConstLabels: constLabels,
		}, labels),
		compute: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:        "sloserve_qos_compute_duration_seconds",
			Help:        "Time the execution of an answered request (good or late) took in its instance: input copy, session run and output copy.",
			Buckets:     prometheus.ExponentialBuckets(0.0001, 2, 18),
			ConstLabels: constLabels,
		}, labels),
		batchSize: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:        "sloserve_qos_batch_size",
			Help:        "Batch size of each execution.",
			Buckets:     prometheus.ExponentialBuckets(1, 2, 10),
			ConstLabels: constLabels,
		}, []string{"model"}),
		holds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "sloserve_qos_overlap_holds_total",
			Help:        "Batches of a latency-critical model held back instead of started beside a running latency-critical execution that the overlap would have made late (qos.overlap_slowdown).",
			ConstLabels: constLabels,
		}, []string{"model"}),
		goodputDesc: prometheus.NewDesc("sloserve_qos_goodput",
			"Requests finished within their SLO per second, over the sliding window.", labels, constLabels),
		attainmentDesc: prometheus.NewDesc("sloserve_qos_slo_attainment",
			"Good requests over requests that ended, over the sliding window.", labels, constLabels),
		depthDesc: prometheus.NewDesc("sloserve_qos_queue_depth",
			"Requests waiting in the model's queue.", labels, constLabels),
		inflightDesc: prometheus.NewDesc("sloserve_qos_inflight_requests",
			"Requests waiting in the model's queue or in an execution.", labels, constLabels),
		sloDesc: prometheus.NewDesc("sloserve_qos_slo_seconds",
			"The model's latency SLO (absent when it has none).", labels, constLabels),
		rejectedDesc: prometheus.NewDesc("sloserve_qos_rejected_total",
			"Requests rejected at admission, by reason: deadline (predicted to miss it), queue_full, or overloaded (the server's limits on requests in flight).",
			append(labels, "reason"), constLabels),
		s: s,
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.requests, m.queueDelay, m.latency, m.compute, m.batchSize, m.holds, m} {
		if err := reg.Register(c); err != nil {
			return nil, errors.Join(errors.New("qos: registering metrics"), err)
		}
	}
	return m, nil
}

func (m *metrics) forModel(name string, class Class) *modelMetrics {
	mm := &modelMetrics{
		queueDelay: m.queueDelay.WithLabelValues(name, string(class)),
		latency:    m.latency.WithLabelValues(name, string(class)),
		compute:    m.compute.WithLabelValues(name, string(class)),
		batchSize:  m.batchSize.WithLabelValues(name),
		holds:      m.holds.WithLabelValues(name),
	}
	for o := range numOutcomes {
		mm.outcomes[o] = m.requests.WithLabelValues(name, string(class), o.String())
	}
	return mm
}

func (m *metrics) forget(name string) {
	l := prometheus.Labels{"model": name}
	m.requests.DeletePartialMatch(l)
	m.queueDelay.DeletePartialMatch(l)
	m.latency.DeletePartialMatch(l)
	m.compute.DeletePartialMatch(l)
	m.batchSize.DeletePartialMatch(l)
	m.holds.DeletePartialMatch(l)
}

// Describe implements prometheus.Collector for the computed gauges.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	ch <- m.goodputDesc
	ch <- m.attainmentDesc
	ch <- m.depthDesc
	ch <- m.inflightDesc
	ch <- m.sloDesc
	ch <- m.rejectedDesc
}

// Collect implements prometheus.Collector for the computed gauges.
func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	for _, st := range m.s.AllStats() {
		class := string(st.Class)
		ch <- prometheus.MustNewConstMetric(m.goodputDesc, prometheus.GaugeValue, st.Goodput, st.Model, class)
		ch <- prometheus.MustNewConstMetric(m.attainmentDesc, prometheus.GaugeValue, st.Attainment, st.Model, class)
		ch <- prometheus.MustNewConstMetric(m.depthDesc, prometheus.GaugeValue, float64(st.QueueDepth), st.Model, class)
		ch <- prometheus.MustNewConstMetric(m.inflightDesc, prometheus.GaugeValue, float64(st.InFlight), st.Model, class)
		if st.SLO > 0 {
			ch <- prometheus.MustNewConstMetric(m.sloDesc, prometheus.GaugeValue, st.SLO.Seconds(), st.Model, class)
		}
		ch <- prometheus.MustNewConstMetric(m.rejectedDesc, prometheus.CounterValue, float64(st.Rejected-st.QueueFull-st.Overloaded), st.Model, class, "deadline")
		ch <- prometheus.MustNewConstMetric(m.rejectedDesc, prometheus.CounterValue, float64(st.QueueFull), st.Model, class, "queue_full")
		ch <- prometheus.MustNewConstMetric(m.rejectedDesc, prometheus.CounterValue, float64(st.Overloaded), st.Model, class, "overloaded")
	}
}
