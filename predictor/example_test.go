package predictor_test

import (
	"fmt"
	"time"

	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/predictor"
	"github.com/sloserve/sloserve/qos"
)

// The predictor is what the QoS scheduler estimates with and what the
// adjuster sizes shares with.
var (
	_ qos.Estimator     = (*predictor.Predictor)(nil)
	_ control.Predictor = (*predictor.Predictor)(nil)
	_ qos.Estimator     = (*qos.EWMAEstimator)(nil)
	// A qos.EWMAEstimator can serve as the fallback.
	_ predictor.Estimator = (*qos.EWMAEstimator)(nil)
)

func Example() {
	// Profile points, as Sweep would measure them: 2 ms + 1 ms per image at
	// the whole device, 80% of the work scaling with the share.
	var points []predictor.Point
	for _, s := range []float64{0.25, 0.5, 1} {
		for _, b := range []int{1, 4, 8} {
			t := (0.0008*float64(b) + 0.0016) / (s + 0.25)
			points = append(points, predictor.Point{Batch: b, Share: s, Latency: time.Duration(t * 1e9)})
		}
	}
	prof, err := predictor.NewProfile("example", points, time.Time{})
	if err != nil {
		panic(err)
	}
	p, err := predictor.New(predictor.Options{})
	if err != nil {
		panic(err)
	}
	p.SetProfile("ocr-det/1", prof)
	p.SetShare("ocr-det/1", 0.5)
	d, _ := p.Estimate("ocr-det/1", 4)
	fmt.Println("batch 4 at share 0.5:", d.Round(10*time.Microsecond))
	// Co-located models use 80% of the device: 1.3x oversubscribed.
	p.SetInterference("ocr-det/1", 0.8)
	d, _ = p.Estimate("ocr-det/1", 4)
	fmt.Println("with interference:", d.Round(10*time.Microsecond))
	// Output:
	// batch 4 at share 0.5: 6.4ms
	// with interference: 8.32ms
}

func ExampleFit() {
	points := []predictor.Point{
		{Batch: 1, Share: 1, Latency: 3 * time.Millisecond},
		{Batch: 8, Share: 1, Latency: 10 * time.Millisecond},
		{Batch: 1, Share: 0.5, Latency: 6 * time.Millisecond},
		{Batch: 8, Share: 0.5, Latency: 20 * time.Millisecond},
	}
	c, err := predictor.Fit(points)
	if err != nil {
		panic(err)
	}
	fmt.Printf("MAPE %.1f%%\n", 100*predictor.MAPE(c, points))
	fmt.Println("batch 4 at share 0.25:", c.Predict(4, 0.25).Round(100*time.Microsecond))
	// Output:
	// MAPE 0.0%
	// batch 4 at share 0.25: 24ms
}
