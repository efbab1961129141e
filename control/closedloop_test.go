package control

import (
	"context"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/runtime"

	"github.com/sloserve/sloserve/internal/randdist"
	"github.com/sloserve/sloserve/qos"
)

// The closed loop: the real scheduler and adjuster on a synthetic
// workload in fake time. The device runs a model at the speed of its
// compute share (a quota's semantics, where the share is all it gets), so
// the share the adjuster picks decides the latency, and a queueing model
// that sizes for the mean under bursty arrivals fails the attainment
// assertion.

// shareDevice is an Actuator and an qos.Executor factory: executions take
// base(batch) / share of the model's applied share (1 when unlimited).
type shareDevice struct {
	mu     sync.Mutex
	shares map[string]limiter.Share
}

func (d *shareDevice) SetShare(_ context.Context, model string, s limiter.Share) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.shares[model] = s
	return nil
}

func (d *shareDevice) Evict(context.Context, string) error { return nil }
func (d *shareDevice) MemoryUsage(string) int64            { return 0 }

func (d *shareDevice) share(model string) float64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	c := d.shares[model].Compute
	if c <= 0 || c > 1 {
		return 1
	}
	return c
}

// executor runs a model's batches at its share's speed.
func (d *shareDevice) executor(model string, base time.Duration) qos.Executor {
	return qos.ExecutorFunc(func(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
		rows := len(req.Inputs[0].Data) / 8
		took := time.Duration(float64(base) * float64(rows) / d.share(model))
		select {
		case <-time.After(took):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return &runtime.InferResponse{Outputs: []runtime.Tensor{idTensor(make([]int64, rows)...)}}, nil
	})
}

// oracle is a Predictor that knows the device's curve and the true rate.
type oracle struct {
	base time.Duration
	rate float64
}

func (o *oracle) Latency(_ string, batch int, share float64) (time.Duration, bool) {
	if share <= 0 || share > 1 {
		share = 1
	}
	return time.Duration(float64(o.base) * float64(batch) / share), true
}
func (o *oracle) ObserveArrivals(string, time.Time, uint64)  {}
func (o *oracle) ForecastRate(string, time.Duration) float64 { return o.rate }
func (o *oracle) SetShare(string, float64)                   {}

// gammaGap draws an inter-arrival time with mean 1/rate and coefficient of
// variation cv (Marsaglia and Tsang, with the boost for shape < 1).
func gammaGap(rng *rand.Rand, rate, cv float64) time.Duration {
	k := 1 / (cv * cv)
	g := randdist.Gamma(rng, k+1) * math.Pow(rng.Float64(), 1/k)
	return time.Duration(g / (k * rate) * float64(time.Second))
}

// The example: 10 req/s of gamma CV 1.5 arrivals and 10.6 ms of
// work at the whole device (53 ms at a share of 0.2), SLO 200 ms. Sized
// for the M/D/1 mean with 20% headroom the adjuster chose 0.15, where the
// p99 is several times the SLO; sized for the p99 from the measured
// arrival variability it must keep 99% of the requests within the SLO
// once it has measured the arrivals.
func TestClosedLoopMeetsTheTail(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const (
			rate = 10.0
			cv   = 1.5
			slo  = 200 * ms
		)
		base := 10600 * time.Microsecond
		dev := &shareDevice{shares: map[string]limiter.Share{}}
		s, err := qos.NewScheduler(qos.Options{DeviceSlots: 2, SeparateClasses: true, Logger: testLogger(t), Estimator: qos.NewEWMAEstimator(0.2)})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.AddModel(qos.ModelSpec{Name: "lc", Class: qos.ClassLatencyCritical, SLO: slo, QueueCapacity: 1000, Executor: dev.executor("lc", base)}); err != nil {
			t.Fatal(err)
		}
		a, err := NewAdjuster(s, AdjusterOptions{Predictor: &oracle{base: base, rate: rate}, Actuator: dev, Logger: testLogger(t)})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		var loops sync.WaitGroup
		loops.Go(func() { _ = s.Run(ctx) })
		loops.Go(func() { _ = a.Run(ctx) })
		defer func() { cancel(); loops.Wait() }()

		rng := rand.New(rand.NewPCG(1, 2))
		var reqs sync.WaitGroup
		var mu sync.Mutex
		var good, total int
		send := func(measured bool) {
			reqs.Go(func() {
				_, err := s.Submit(t.Context(), "lc", idRequest(1), qos.RequestOptions{})
				if measured {
					mu.Lock()
					total++
					if err == nil {
						good++
					}
					mu.Unlock()
				}
			})
		}
		// A minute to measure the arrivals and settle, then ten measured.
		start := time.Now()
		for time.Since(start) < 11*time.Minute {
			time.Sleep(gammaGap(rng, rate, cv))
			send(time.Since(start) > time.Minute)
		}
		reqs.Wait()

		st, _ := s.Stats("lc")
		share := dev.share("lc")
		att := float64(good) / float64(total)
		t.Logf("share %.2f, attainment %.4f over %d requests (latency p99 %s)", share, att, total, st.Latency.Quantile(0.99))
		if att < 0.99 {
			t.Errorf("attainment %.2f%% at share %.2f, want >= 99%%", 100*att, share)
		}
		if share > 0.6 {
			t.Errorf("share %.2f: more than twice what the tail needs (about 0.3); the model is not sizing, it is hoarding", share)
		}
	})
}
