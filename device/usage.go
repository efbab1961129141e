package device

import (
	"fmt"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// Where a model's use of its device came from (the source label of
// sloserve_device_use).
const (
	useMeasured  = "measured"  // the limiter measured it: cgroup CPU time, NVML per-process utilisation
	useEstimated = "estimated" // execution time times cap: NVML had no reading for the model
)

// NewUseGauge registers sloserve_device_use, which every device of a
// server writes; nil reg registers nothing.
func NewUseGauge(reg prometheus.Registerer) (*prometheus.GaugeVec, error) {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "sloserve_device_use",
		Help: "Each model's use of its device over the last control period, fraction of the device, as the adjuster reads it (before smoothing); source says whether it was measured or estimated.",
	}, []string{"model", "device", "source"})
	if reg != nil {
		if err := reg.Register(g); err != nil {
			return nil, fmt.Errorf("registering sloserve_device_use: %w", err)
		}
	}
	return g, nil
}

// usageBoard holds each model's recent use of its device, smoothed: the
// telemetry the adjuster reads (AdjusterOptions.Usage).
type usageBoard struct {
	mu sync.Mutex
	m  map[string]float64
}

// usageWeight is the weight of each period's sample in the smoothed use.
const usageWeight = 0.3

func (b *usageBoard) record(seen map[string]float64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	next := make(map[string]float64, len(seen))
	for name, u := range seen {
		if old, ok := b.m[name]; ok {
			u = old + usageWeight*(u-old)
		}
		next[name] = u
	}
	b.m = next
}

func (b *usageBoard) get(model string) (float64, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	u, ok := b.m[model]
	return u, ok
}
