package control

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// adjusterMetrics are an adjuster's Prometheus series: the shares are read
// from its last pass when scraped; events and pass durations are counted
// as they happen.
type adjusterMetrics struct {
	events *prometheus.CounterVec
	pass   prometheus.Histogram

	computeDesc, memoryDesc, targetDesc, targetMemoryDesc *prometheus.Desc
	a                                                     *Adjuster
}

func newAdjusterMetrics(reg prometheus.Registerer, device string, a *Adjuster) (*adjusterMetrics, error) {
	var constLabels prometheus.Labels
	if device != "" {
		constLabels = prometheus.Labels{"device": device}
	}
	m := &adjusterMetrics{
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "sloserve_adjuster_events_total",
			Help:        "Adjuster events by kind: resize, evict, pin, unpin, error.",
			ConstLabels: constLabels,
		}, []string{"kind"}),
		pass: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:        "sloserve_adjuster_pass_seconds",
			Help:        "Time one adjuster pass took, applying the shares included.",
			Buckets:     prometheus.ExponentialBuckets(0.0001, 4, 10),
			ConstLabels: constLabels,
		}),
		computeDesc: prometheus.NewDesc("sloserve_share_compute",
			"Compute share applied to the model, as a fraction of the device; 0 means no limit.", []string{"model"}, constLabels),
		memoryDesc: prometheus.NewDesc("sloserve_share_memory_bytes",
			"Memory share applied to the model; 0 means no limit.", []string{"model"}, constLabels),
		targetDesc: prometheus.NewDesc("sloserve_share_target_compute",
			"Compute share the adjuster's last pass wanted for the model.", []string{"model"}, constLabels),
		targetMemoryDesc: prometheus.NewDesc("sloserve_share_target_memory_bytes",
			"Memory share the adjuster's last pass wanted for the model, from its working set; 0 means not sized.", []string{"model"}, constLabels),
		a: a,
	}
	for _, k := range eventKinds {
		m.events.WithLabelValues(k)
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.events, m.pass, m} {
		if err := reg.Register(c); err != nil {
			return nil, errors.Join(errors.New("control: registering adjuster metrics"), err)
		}
	}
	return m, nil
}

// Describe implements prometheus.Collector for the share gauges.
func (m *adjusterMetrics) Describe(ch chan<- *prometheus.Desc) {
	ch <- m.computeDesc
	ch <- m.memoryDesc
	ch <- m.targetDesc
	ch <- m.targetMemoryDesc
}

// Collect implements prometheus.Collector for the share gauges.
func (m *adjusterMetrics) Collect(ch chan<- prometheus.Metric) {
	for _, s := range m.a.Shares() {
		ch <- prometheus.MustNewConstMetric(m.computeDesc, prometheus.GaugeValue, s.Share.Compute, s.Model)
		ch <- prometheus.MustNewConstMetric(m.memoryDesc, prometheus.GaugeValue, float64(s.Share.Memory), s.Model)
		ch <- prometheus.MustNewConstMetric(m.targetDesc, prometheus.GaugeValue, s.Target, s.Model)
		ch <- prometheus.MustNewConstMetric(m.targetMemoryDesc, prometheus.GaugeValue, float64(s.MemoryTarget), s.Model)
	}
}
