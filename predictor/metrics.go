package predictor

import (
	"errors"
	"slices"

	"github.com/prometheus/client_golang/prometheus"
)

// collector exports every model's Accuracy, read from the predictor's state
// at scrape time, so a forgotten model's series go with it.
type collector struct {
	p *Predictor

	predicted, observed, mape, mapeFloor, profileMAPE, correction, drift, driftBuckets, driftAlarms, interference, forecastRate, observedRate *prometheus.Desc
}

var _ prometheus.Collector = (*collector)(nil)

func newCollector(p *Predictor, device string) *collector {
	var constLabels prometheus.Labels
	if device != "" {
		constLabels = prometheus.Labels{"device": device}
	}
	desc := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc("sloserve_predictor_"+name, help, []string{"model"}, constLabels)
	}
	return &collector{
		p:            p,
		predicted:    desc("latency_predicted_seconds", "Mean predicted execution time over the recent executions."),
		observed:     desc("latency_observed_seconds", "Mean observed execution time over the recent executions."),
		mape:         desc("mape", "Mean absolute percentage error of the recent executions' predictions (0.07 is 7%)."),
		mapeFloor:    desc("mape_floor", "Least MAPE the recent executions could have had with one time per bucket (input size, batch size, share), chosen in hindsight: their jitter; the MAPE above it is the predictor's error."),
		profileMAPE:  desc("profile_mape", "Mean absolute percentage error of the fitted curve on its profile points."),
		correction:   desc("correction", "Online correction factor: observed/predicted execution time, smoothed as a geometric mean."),
		drift:        desc("drift", "1 when the online correction is over 2x either way: the profile does not describe what the model serves (profile it at the served input shapes)."),
		driftBuckets: desc("drift_buckets", "Buckets (input size, batch size, share) whose online correction is over 2x either way now."),
		driftAlarms:  desc("drift_alarms_total", "Times a bucket's online correction moved over 2x either way: the profile does not describe executions of that input size, batch and share."),
		interference: desc("interference", "Interference factor from co-located models' utilisation (1 is none)."),
		forecastRate: desc("forecast_rate", "Forecast arrival rate one second ahead, requests/s."),
		observedRate: desc("observed_rate", "Arrival rate over the latest counter interval, requests/s."),
	}
}

func registerCollector(reg prometheus.Registerer, c *collector) error {
	if err := reg.Register(c); err != nil {
		return errors.Join(errors.New("predictor: registering metrics"), err)
	}
	return nil
}

// Describe implements prometheus.Collector.
func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.predicted, c.observed, c.mape, c.mapeFloor, c.profileMAPE, c.correction, c.drift, c.driftBuckets, c.driftAlarms, c.interference, c.forecastRate, c.observedRate} {
		ch <- d
	}
}

// Collect implements prometheus.Collector. Latency and MAPE series appear
// once a model has executions in its window, the profile MAPE once it has a
// curve.
func (c *collector) Collect(ch chan<- prometheus.Metric) {
	c.p.mu.RLock()
	names := make([]string, 0, len(c.p.models))
	for name := range c.p.models {
		names = append(names, name)
	}
	c.p.mu.RUnlock()
	slices.Sort(names)
	gauge := func(d *prometheus.Desc, v float64, name string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, name)
	}
	for _, name := range names {
		m := c.p.get(name)
		if m == nil {
			continue // forgotten meanwhile
		}
		m.mu.Lock()
		a := m.accuracy()
		m.mu.Unlock()
		if a.Samples > 0 {
			gauge(c.predicted, a.Predicted.Seconds(), name)
			gauge(c.observed, a.Observed.Seconds(), name)
			gauge(c.mape, a.MAPE, name)
			gauge(c.mapeFloor, a.MAPEFloor, name)
		}
		if a.HasCurve {
			gauge(c.profileMAPE, a.ProfileMAPE, name)
		}
		gauge(c.correction, a.Correction, name)
		drift := 0.0
		if a.Drift {
			drift = 1
		}
		gauge(c.drift, drift, name)
		gauge(c.driftBuckets, float64(a.DriftBuckets), name)
		ch <- prometheus.MustNewConstMetric(c.driftAlarms, prometheus.CounterValue, float64(a.DriftAlarms), name)
		gauge(c.interference, a.Interference, name)
		gauge(c.forecastRate, a.ForecastRate, name)
		gauge(c.observedRate, a.ObservedRate, name)
	}
}
