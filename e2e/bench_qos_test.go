package e2e

// BenchmarkQoSvsFIFO: sloserve's QoS scheduler against plain FIFO on two
// real models sharing the machine. Run with
//
//	make bench BENCH=QoSvsFIFO PKGS=./e2e BENCHTIME=1x
//
// The latency-critical model is the PP-OCR text-direction classifier (fast,
// batches up to 8), the best-effort one the PP-OCRv4 detector on 320x320
// images (tens of ms a call). The detector is kept saturated by closed-loop
// clients while the classifier gets open-loop Poisson arrivals at 50%, then
// 120%, of its measured capacity; the same arrival schedule goes to a server
// with `qos: {policy: qos}` and one with `qos: {policy: fifo}`. It runs for
// two SLOs (see BenchmarkQoSvsFIFO) and prints a table per SLO to standard
// output; a run takes about 3.5 minutes.

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
)

// Names of the two models in the benchmark's repository.
const (
	lcName = "cls" // latency-critical: ocr-cls
	beName = "det" // best-effort: ocr-det
)

// Parameters of BenchmarkQoSvsFIFO.
const (
	qbSoloCalls   = 300              // sequential calls for the solo latency
	qbLCClients   = 8                // closed-loop clients that saturate the classifier
	qbBEClients   = 3                // closed-loop clients that saturate the detector
	qbWarm        = time.Second      // load before a measurement window
	qbWindow      = 4 * time.Second  // capacity and best-effort-alone windows
	qbPhase       = 20 * time.Second // each open-loop phase
	qbBEImageSize = 320
	qbLagWarn     = 5 * time.Millisecond // generator lag p99 above this is reported
	qbSeed        = 42
)

// qbLoads are the open-loop phases, as fractions of the classifier's capacity.
var qbLoads = []float64{0.5, 1.2}

// lcInfer is a classifier request of batch rows of 3x48x192, raw contents.
func lcInfer(batch int) *inference.ModelInferRequest {
	img := make([]float32, batch*3*48*192)
	for i := range img {
		img[i] = float32(i%251) / 251
	}
	return &inference.ModelInferRequest{
		ModelName:        lcName,
		Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{int64(batch), 3, 48, 192}}},
		RawInputContents: [][]byte{f32bytes(img)},
	}
}

// beInfer is a detector request on one qbBEImageSize x qbBEImageSize image,
// raw contents.
func beInfer() *inference.ModelInferRequest {
	const n = qbBEImageSize
	img := make([]float32, 3*n*n)
	for i := range img {
		img[i] = float32(i%255) / 255
	}
	return &inference.ModelInferRequest{
		ModelName:        beName,
		Inputs:           []*inference.ModelInferRequest_InferInputTensor{{Name: "x", Datatype: "FP32", Shape: []int64{1, 3, n, n}}},
		RawInputContents: [][]byte{f32bytes(img)},
	}
}

// qosRepo writes the benchmark's repository with the classifier's SLO. Both
// inputs are declared with fixed image sizes so that the warm-up at load
// seeds the scheduler's latency estimates.
func qosRepo(b *testing.B, sloMS float64) string {
	repo := b.TempDir()
	writeRepo(b, repo,
		repoModel{lcName, demoModel(b, "ocr-cls"), fmt.Sprintf(`max_batch_size: 8
inputs: [{name: x, datatype: FP32, shape: [-1, 3, 48, 192]}]
execution: {intra_op_threads: 1}
slo: {latency_ms: %g, class: latency-critical, priority: 1}
`, sloMS)},
		repoModel{beName, demoModel(b, "ocr-det"), fmt.Sprintf(`max_batch_size: 1
inputs: [{name: x, datatype: FP32, shape: [-1, 3, %d, %d]}]
execution: {intra_op_threads: 1}
slo: {latency_ms: 60000, class: best-effort}
`, qbBEImageSize, qbBEImageSize)},
	)
	return repo
}

// serverCounters are the classifier's series compared across a phase.
type serverCounters struct {
	good, late, batchSum, batchCount float64
}

func (c serverCounters) sub(d serverCounters) serverCounters {
	return serverCounters{c.good - d.good, c.late - d.late, c.batchSum - d.batchSum, c.batchCount - d.batchCount}
}

// lcCounters reads the classifier's scheduler counters (0 before any).
func lcCounters(b *testing.B, s *testServer) serverCounters {
	m := s.scrape(b)
	const model = `model="` + lcName + `/1"`
	requests := `sloserve_qos_requests_total{class="latency-critical",device="cpu",` + model + `,outcome=`
	return serverCounters{
		good:       m[requests+`"good"}`],
		late:       m[requests+`"late"}`],
		batchSum:   m[`sloserve_qos_batch_size_sum{device="cpu",`+model+`}`],
		batchCount: m[`sloserve_qos_batch_size_count{device="cpu",`+model+`}`],
	}
}

// closedLoop keeps clients callers each sending one request after another
// and records when each successful one completed.
type closedLoop struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	done    []time.Time
	errs    int
	lastErr error
}

func startClosedLoop(s *testServer, req *inference.ModelInferRequest, clients int) *closedLoop {
	ctx, cancel := context.WithCancel(context.Background())
	l := &closedLoop{cancel: cancel}
	for range clients {
		l.wg.Go(func() {
			for ctx.Err() == nil {
				_, err := s.grpc.ModelInfer(ctx, req)
				now := time.Now()
				l.mu.Lock()
				switch {
				case err == nil:
					l.done = append(l.done, now)
				case ctx.Err() == nil:
					l.errs++
					l.lastErr = err
				}
				l.mu.Unlock()
			}
		})
	}
	return l
}

// rate is the completions per second in [from, to).
func (l *closedLoop) rate(from, to time.Time) float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, t := range l.done {
		if !t.Before(from) && t.Before(to) {
			n++
		}
	}
	return float64(n) / to.Sub(from).Seconds()
}

// stop ends the load and returns the number of failed requests and the last
// failure.
func (l *closedLoop) stop() (int, error) {
	l.cancel()
	l.wg.Wait()
	return l.errs, l.lastErr
}

// measureRate runs a closed loop, lets it settle for qbWarm and returns its
// completion rate over the next qbWindow.
func measureRate(b *testing.B, s *testServer, req *inference.ModelInferRequest, clients int) float64 {
	return measureRateOver(b, s, req, clients, qbWarm, qbWindow)
}

// measureRateOver runs a closed loop, lets it settle for warm and returns
// its completion rate over the next window.
func measureRateOver(b *testing.B, s *testServer, req *inference.ModelInferRequest, clients int, warm, window time.Duration) float64 {
	b.Helper()
	l := startClosedLoop(s, req, clients)
	time.Sleep(warm)
	from := time.Now()
	time.Sleep(window)
	r := l.rate(from, time.Now())
	if n, err := l.stop(); n > 0 {
		b.Logf("%s closed loop: %d failed requests, last: %v", req.ModelName, n, err)
	}
	return r
}

// lcOutcome is how a latency-critical request ended, seen by the client.
type lcOutcome int

const (
	lcGood     lcOutcome = iota // success within the SLO
	lcLate                      // success after the SLO
	lcRejected                  // RESOURCE_EXHAUSTED: admission or a full queue
	lcDropped                   // DEADLINE_EXCEEDED: dropped while queued
	lcFailed                    // anything else
	numLCOutcomes
)

var lcOutcomeNames = [numLCOutcomes]string{"good", "late", "rejected", "dropped", "failed"}

// classify names the outcome of a request that took latency at the client.
func classify(err error, latency, slo time.Duration) lcOutcome {
	switch status.Code(err) {
	case codes.OK:
		if latency <= slo {
			return lcGood
		}
		return lcLate
	case codes.ResourceExhausted:
		return lcRejected
	case codes.DeadlineExceeded:
		return lcDropped
	default:
		return lcFailed
	}
}

// lcRecord is one open-loop request. The generator creates it; the request's
// goroutine fills in the rest.
type lcRecord struct {
	lag     time.Duration // how late it was sent against the schedule
	latency time.Duration // from send to the response, at the client
	outcome lcOutcome
	err     error // nil for a success
}

// openLoop sends latency-critical requests at Poisson arrivals of rate per
// second for d, each from its own goroutine at its scheduled time without
// waiting for earlier ones, and returns when every response is in. Latency
// counts from the actual send; the lag before it is recorded apart.
func openLoop(client inference.GRPCInferenceServiceClient, req *inference.ModelInferRequest, rate float64, d, slo time.Duration, rng *rand.Rand) []*lcRecord {
	return openLoopWith(func(ctx context.Context) error {
		_, err := client.ModelInfer(ctx, req)
		return err
	}, rate, d, slo, rng)
}

// openLoopWith is openLoop for any protocol: send makes one request and
// returns its error as a gRPC status (codes.ResourceExhausted for a
// refusal, codes.DeadlineExceeded for a drop).
func openLoopWith(send func(context.Context) error, rate float64, d, slo time.Duration, rng *rand.Rand) []*lcRecord {
	var recs []*lcRecord
	var wg sync.WaitGroup
	start := time.Now()
	var at time.Duration
	for {
		at += time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
		if at >= d {
			break
		}
		due := start.Add(at)
		if wait := time.Until(due); wait > 0 {
			time.Sleep(wait)
		}
		sent := time.Now()
		rec := &lcRecord{lag: sent.Sub(due)}
		recs = append(recs, rec)
		wg.Go(func() {
			// A safety net only: far longer than any queue here lasts.
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			err := send(ctx)
			rec.latency = time.Since(sent)
			rec.outcome, rec.err = classify(err, rec.latency, slo), err
		})
	}
	wg.Wait()
	return recs
}

// phaseResult is one policy's measurements at one load.
type phaseResult struct {
	policy    string
	load      float64 // fraction of the classifier's capacity
	rate      float64 // scheduled arrivals per second
	dur       time.Duration
	sent      int
	counts    [numLCOutcomes]int
	latencies []time.Duration // of successful requests
	lags      []time.Duration
	examples  [numLCOutcomes]error // an error of each kind that had one
	beRate    float64
	beAlone   float64        // the detector's rate with the classifier idle
	server    serverCounters // the server's counts over the phase
}

// add counts the records of the phase.
func (p *phaseResult) add(recs []*lcRecord) {
	p.sent += len(recs)
	for _, r := range recs {
		p.counts[r.outcome]++
		p.lags = append(p.lags, r.lag)
		if r.err == nil {
			p.latencies = append(p.latencies, r.latency)
		} else if p.examples[r.outcome] == nil {
			p.examples[r.outcome] = r.err
		}
	}
}

func (p *phaseResult) goodput() float64 { return float64(p.counts[lcGood]) / p.dur.Seconds() }
func (p *phaseResult) attainment() float64 {
	return float64(p.counts[lcGood]) / float64(max(p.sent, 1))
}

// gapRate is what the detector would get from the classifier's idle gaps
// alone: its solo rate times the fraction of time the classifier leaves.
func (p *phaseResult) gapRate() float64 { return p.beAlone * max(0, 1-p.load) }

func (p *phaseResult) meanBatch() float64 {
	if p.server.batchCount == 0 {
		return 0
	}
	return p.server.batchSum / p.server.batchCount
}

func pctMS(ds []time.Duration, p float64) float64 {
	if len(ds) == 0 {
		return math.NaN()
	}
	return float64(percentile(ds, p)) / float64(time.Millisecond)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// calibration is what one server with a loose SLO measures of the
// classifier alone (the detector idle).
type calibration struct {
	solo     []time.Duration // sequential batch-1 calls
	batch8   []time.Duration // sequential batch-8 calls
	capacity float64         // req/s with qbLCClients closed-loop clients
	// busyCapacity is the same with the detector saturated: what is left
	// of the classifier when both models compete for the two cores.
	busyCapacity float64
}

// calibrate measures the classifier under qos with an SLO of a second, loose
// enough that admission never refuses: the capacity is then what the model
// serves, not what a tight SLO lets through (under a tight SLO closed-loop
// clients answered with 429 come straight back, and the storm of refused
// requests eats the CPU being measured).
func calibrate(b *testing.B) calibration {
	s := startServer(b, qosRepo(b, 1000), benchShared)
	solo := lcInfer(1)
	for range 50 {
		if _, err := s.grpc.ModelInfer(b.Context(), solo); err != nil {
			b.Fatal(err)
		}
	}
	timeCalls := func(req *inference.ModelInferRequest, n int) []time.Duration {
		ds := make([]time.Duration, n)
		for i := range ds {
			t0 := time.Now()
			if _, err := s.grpc.ModelInfer(b.Context(), req); err != nil {
				b.Fatal(err)
			}
			ds[i] = time.Since(t0)
		}
		return ds
	}
	c := calibration{solo: timeCalls(solo, qbSoloCalls), batch8: timeCalls(lcInfer(8), 50)}
	c.capacity = measureRate(b, s, solo, qbLCClients)
	be := startClosedLoop(s, beInfer(), qbBEClients)
	c.busyCapacity = measureRate(b, s, solo, qbLCClients)
	if n, err := be.stop(); n > 0 {
		b.Logf("calibration: %d detector requests failed, last: %v", n, err)
	}
	if err := s.stop(); err != nil {
		b.Fatal(err)
	}
	return c
}

// BenchmarkQoSvsFIFO measures, for the qos and the fifo policy in the same
// run, the latency-critical classifier's goodput and SLO attainment and the
// best-effort detector's throughput while the detector is saturated and the
// classifier gets 50% and then 120% of its capacity. It does so for two SLOs
// derived from the calibration: 5x the solo p50 (tight: about the time of
// one full batch of 8), and 2.5x the p50 of a batch of 8 (a full batch can
// wait ahead of a request's own batch).
func BenchmarkQoSvsFIFO(b *testing.B) {
	cal := calibrate(b)
	soloP50, batchP50 := percentile(cal.solo, 0.5), percentile(cal.batch8, 0.5)
	fmt.Printf("classifier alone: batch 1 p50 %.2f ms, p99 %.2f ms; batch 8 p50 %.2f ms; "+
		"capacity (%d closed-loop clients) %.0f req/s, %.0f req/s with the detector saturated\n",
		ms(soloP50), pctMS(cal.solo, 0.99), ms(batchP50), qbLCClients, cal.capacity, cal.busyCapacity)
	for _, v := range []struct {
		name  string
		sloMS float64
	}{
		{"slo=5xsolo", math.Round(5 * ms(soloP50))},
		{"slo=2.5xbatch8", math.Round(2.5 * ms(batchP50))},
	} {
		b.Run(v.name, func(b *testing.B) { benchQoSvsFIFO(b, cal, max(v.sloMS, 1)) })
	}
}

func benchQoSvsFIFO(b *testing.B, cal calibration, sloMS float64) {
	slo := time.Duration(sloMS * float64(time.Millisecond))
	repo := qosRepo(b, sloMS)
	lcReq, beReq := lcInfer(1), beInfer()
	var results []*phaseResult
	for b.Loop() {
		results = results[:0]
		// qos and fifo schedule on one device with no limits; qos+adaptive
		// adds the control loop, which runs the best-effort detector in
		// the background (cgroup idle class) and lets the scheduler give
		// each class its own slots.
		for _, run := range []struct{ policy, config string }{
			{"qos", "qos: {policy: qos}\n" + benchShared},
			{"fifo", "qos: {policy: fifo}\n" + benchShared},
			{"qos+adaptive", "qos: {policy: qos}\ncontrol: {policy: adaptive}\n"},
		} {
			policy := run.policy
			s := startServer(b, repo, run.config)
			beAlone := measureRate(b, s, beReq, qbBEClients)
			be := startClosedLoop(s, beReq, qbBEClients)
			time.Sleep(qbWarm)
			rng := rand.New(rand.NewPCG(qbSeed, 0)) // the same arrivals for both policies
			for _, load := range qbLoads {
				p := &phaseResult{policy: policy, load: load, rate: load * cal.capacity, dur: qbPhase, beAlone: beAlone}
				before := lcCounters(b, s)
				start := time.Now()
				recs := openLoop(s.grpc, lcReq, p.rate, qbPhase, slo, rng)
				p.beRate = be.rate(start, start.Add(qbPhase))
				p.server = lcCounters(b, s).sub(before)
				p.add(recs)
				results = append(results, p)
			}
			if n, err := be.stop(); n > 0 {
				b.Logf("%s: %d detector requests failed, last: %v", policy, n, err)
			}
			if err := s.stop(); err != nil {
				b.Fatal(err)
			}
		}
	}

	b.ReportMetric(sloMS, "slo-ms")
	b.ReportMetric(cal.capacity, "lc-capacity-req/s")
	b.ReportMetric(cal.busyCapacity, "lc-busy-capacity-req/s")
	for _, p := range results {
		prefix := fmt.Sprintf("%s-%.0f%%-", p.policy, 100*p.load)
		b.ReportMetric(p.goodput(), prefix+"lc-good/s")
		b.ReportMetric(p.goodput()/cal.capacity, prefix+"lc-good/capacity")
		b.ReportMetric(p.attainment(), prefix+"lc-attainment")
		b.ReportMetric(pctMS(p.latencies, 0.99), prefix+"lc-p99-ms")
		b.ReportMetric(p.beRate, prefix+"be-infer/s")
		if g := p.gapRate(); g > 0 {
			b.ReportMetric(p.beRate/g, prefix+"be/gaps")
		}
	}
	// The testing package keeps only ten lines of a benchmark's log: the
	// report goes to standard output.
	fmt.Printf("\n%s: SLO %g ms, classifier capacity %.0f req/s, phases of %v\n%s", b.Name(), sloMS, cal.capacity, qbPhase, qosTable(results, cal))
	for _, p := range results {
		if lag := pctMS(p.lags, 0.99); lag > ms(qbLagWarn) {
			fmt.Printf("WARNING: %s at %.0f%%: the generator's p99 lag is %.1f ms (> %v): the client, not the server, shaped these arrivals\n",
				p.policy, 100*p.load, lag, qbLagWarn)
		}
		for o, err := range p.examples {
			if err != nil {
				fmt.Printf("%s at %.0f%%, %s: e.g. %v\n", p.policy, 100*p.load, lcOutcomeNames[o], err)
			}
		}
	}
}

// qosTable formats the results, one row per policy and load.
func qosTable(results []*phaseResult, cal calibration) string {
	var sb strings.Builder
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\tload\toffered/s\tsent\tgood\tlate\trejected\tdropped\tfailed\t"+
		"goodput/s\tgood/cap\tgood/busy cap\tattain\tp50 ms\tp99 ms\tbatch\tserver good\tserver late\t"+
		"BE/s\tBE alone/s\tBE/gaps\tlag p50 ms\tlag p99 ms\t")
	for _, p := range results {
		gaps := "-"
		if g := p.gapRate(); g > 0 {
			gaps = fmt.Sprintf("%.2f", p.beRate/g)
		}
		fmt.Fprintf(tw, "%s\t%.0f%%\t%.0f\t%d\t%d\t%d\t%d\t%d\t%d\t%.0f\t%.3f\t%.3f\t%.4f\t%.1f\t%.1f\t%.2f\t%.0f\t%.0f\t%.1f\t%.1f\t%s\t%.2f\t%.2f\t\n",
			p.policy, 100*p.load, float64(p.sent)/p.dur.Seconds(), p.sent,
			p.counts[lcGood], p.counts[lcLate], p.counts[lcRejected], p.counts[lcDropped], p.counts[lcFailed],
			p.goodput(), p.goodput()/cal.capacity, p.goodput()/cal.busyCapacity, p.attainment(),
			pctMS(p.latencies, 0.5), pctMS(p.latencies, 0.99), p.meanBatch(), p.server.good, p.server.late,
			p.beRate, p.beAlone, gaps, pctMS(p.lags, 0.5), pctMS(p.lags, 0.99))
	}
	tw.Flush()
	return sb.String()
}
