package models

import (
	"errors"
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the registry's Prometheus series, labelled by model and
// version: loads, instances and their processes. Requests are counted by
// the schedulers (package qos), once.
type metrics struct {
	loadDuration *prometheus.HistogramVec
	restarts     *prometheus.CounterVec
	oomKills     *prometheus.CounterVec
	retries      *prometheus.CounterVec
	evictions    *prometheus.CounterVec
	loads        *prometheus.CounterVec
	loadFailures *prometheus.CounterVec

	mu       sync.Mutex
	versions map[[2]string]*versionMetrics
}

// versionMetrics are the series of one version, resolved once at load so
// the request path does no label lookups.
type versionMetrics struct {
	restarts prometheus.Counter
	oomKills prometheus.Counter
	retries  prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, r *Registry) (*metrics, error) {
	labels := []string{"model", "version"}
	m := &metrics{
		loadDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "sloserve_model_load_duration_seconds",
			Help:    "Time to start a model version's instances and check them.",
			Buckets: prometheus.ExponentialBuckets(0.05, 2, 12),
		}, labels),
		restarts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sloserve_runner_restarts_total",
			Help: "Runner processes restarted after they died or hung.",
		}, labels),
		oomKills: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sloserve_runner_oom_kills_total",
			Help: "Runner processes killed by the kernel for exceeding their memory limit (cgroup OOM kills).",
		}, labels),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sloserve_inference_retries_total",
			Help: "Requests (or batches) tried again on another instance after theirs died or gave no answer in time.",
		}, labels),
		evictions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sloserve_model_evictions_total",
			Help: "Idle models unloaded to free memory (they load again on demand).",
		}, []string{"model"}),
		loads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sloserve_model_loads_total",
			Help: "Loads and reloads of a model that succeeded: the new versions serve.",
		}, []string{"model"}),
		loadFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sloserve_model_load_failures_total",
			Help: "Loads and reloads of a model that failed (bad config, bad model file, runner failure); a reload that fails leaves the previous version serving.",
		}, []string{"model"}),
		versions: map[[2]string]*versionMetrics{},
	}
	cs := []prometheus.Collector{m.loadDuration, m.restarts, m.oomKills, m.retries, m.evictions,
		m.loads, m.loadFailures, &usageCollector{r: r}, &stateCollector{r: r}, &tritonCollector{r: r}}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, errors.Join(errors.New("models: registering metrics"), err)
		}
	}
	return m, nil
}

func (m *metrics) forVersion(model, version string) *versionMetrics {
	m.mu.Lock()
	defer m.mu.Unlock()
	key := [2]string{model, version}
	if vm, ok := m.versions[key]; ok {
		return vm
	}
	vm := &versionMetrics{
		restarts: m.restarts.WithLabelValues(model, version),
		oomKills: m.oomKills.WithLabelValues(model, version),
		retries:  m.retries.WithLabelValues(model, version),
	}
	m.versions[key] = vm
	return vm
}

// forget deletes the series of a version that is no longer served, so an
// unloaded version does not linger in every scrape.
func (m *metrics) forget(model, version string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.versions, [2]string{model, version})
	l := prometheus.Labels{"model": model, "version": version}
	m.loadDuration.DeletePartialMatch(l)
	m.restarts.DeletePartialMatch(l)
	m.oomKills.DeletePartialMatch(l)
	m.retries.DeletePartialMatch(l)
}

// forgetModel deletes the model-level series of a model that has left the
// repositories.
func (m *metrics) forgetModel(model string) {
	l := prometheus.Labels{"model": model}
	m.loads.DeletePartialMatch(l)
	m.loadFailures.DeletePartialMatch(l)
	m.evictions.DeletePartialMatch(l)
}

// usageCollector reports each runner process's CPU time and resident memory
// at scrape time.
type usageCollector struct{ r *Registry }

var (
	cpuDesc = prometheus.NewDesc("sloserve_runner_cpu_seconds_total",
		"CPU time used by a runner process (user + system).", []string{"model", "version", "instance"}, nil)
	rssDesc = prometheus.NewDesc("sloserve_runner_resident_memory_bytes",
		"Resident memory of a runner process.", []string{"model", "version", "instance"}, nil)
)

// Usager is implemented by instances that can report their process usage.
type Usager interface {
	Usage() (cpuSeconds float64, rssBytes int64, err error)
}

func (c *usageCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- cpuDesc
	ch <- rssDesc
}

func (c *usageCollector) Collect(ch chan<- prometheus.Metric) {
	c.r.Instances(func(model, version string, index int, inst Instance) {
		u, ok := inst.(Usager)
		if !ok {
			return
		}
		cpu, rss, err := u.Usage()
		if err != nil {
			return
		}
		idx := strconv.Itoa(index)
		ch <- prometheus.MustNewConstMetric(cpuDesc, prometheus.CounterValue, cpu, model, version, idx)
		ch <- prometheus.MustNewConstMetric(rssDesc, prometheus.GaugeValue, float64(rss), model, version, idx)
	})
}

// stateCollector reports, at scrape time, each model version's state in
// the repository index and whether each model's last load failed. Models
// that have left the repositories have no series.
type stateCollector struct{ r *Registry }

var (
	stateDesc = prometheus.NewDesc("sloserve_model_state",
		"1 for the state a model version is in (READY, LOADING, UNLOADING, UNAVAILABLE), 0 for the others; version is empty for a model that has no version to show.",
		[]string{"model", "version", "state"}, nil)
	loadFailedDesc = prometheus.NewDesc("sloserve_model_load_failed",
		"1 while the last load or reload of a model has failed (the repository index has the reason; a version that served before keeps serving), else 0.",
		[]string{"model"}, nil)
)

var allStates = []State{StateReady, StateLoading, StateUnloading, StateUnavailable}

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- stateDesc
	ch <- loadFailedDesc
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	for _, e := range c.r.IndexKnown(false) {
		for _, st := range allStates {
			v := 0.0
			if e.State == st {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(stateDesc, prometheus.GaugeValue, v, e.Name, e.Version, string(st))
		}
	}
	for name, failed := range c.r.loadFailures() {
		v := 0.0
		if failed {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(loadFailedDesc, prometheus.GaugeValue, v, name)
	}
}
