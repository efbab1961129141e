package e2e

// BenchmarkRESTTinyRefusals: are the 429s that sixteen closed-loop REST
// JSON clients of the wake-word model get on a busy host needless (issue
// 33)? Run beside other work, for example
//
//	/work/burn.sh 2 go test -run '^$' -bench RESTTinyRefusals -benchtime 1x ./e2e
//
// Two servers serve the same model, latency-critical: one with its 40 ms
// SLO, one with an SLO so loose (10 s) that admission refuses nothing, the
// counterfactual. Rounds alternate between them, SLOSERVE_REST_BENCH_WINDOW
// (4s) each. For the 40 ms server: the 429s, the admitted requests'
// latency at the client (p50, p99, max, how many over 40 ms), how many
// requests those 429s refused (a client sends a refused request again at
// once, so one request refused while a long queue drains gets a run of
// them: 7-12 a request beside burners and other work), and what
// admission predicted for the refused ones (queue ahead, execution, room,
// from the 429's text). For the loose one: the same latencies, which are
// what the refused requests would have taken had they been admitted (a
// closed loop sends a refused request again at once, so the queue is about
// the same either way), and, from the loose server's log (a line per
// finished request with admission's plan, qos/finishlog.go), how many of
// the requests whose plan a 40 ms SLO would have refused ended late at the
// server, against the others.

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"
)

// refusalText reads the milliseconds of an admission refusal's text: room
// (0 when refused on the mean), queue ahead and execution.
var refusalText = regexp.MustCompile(`(?:with ([0-9.]+)ms of room.*)?queue ahead ([0-9.]+)ms, execution ([0-9.]+)ms`)

// finishLine reads a finished request's line (qos/finishlog.go): admission's
// plan (wait, execution, room) and, for one that ran, its wait and
// execution, in milliseconds.
var finishLine = regexp.MustCompile(`msg="request finished".* plan_wait_ms=([0-9.]+) plan_exec_ms=([0-9.]+) plan_room_ms=([0-9.]+) wait_ms=([0-9.]+) ran_ms=([0-9.]+)`)

// counterfactual reads the finish lines of a server that refused nothing:
// of the requests whose plan would have been refused at slo (wait,
// execution and room past it), how many ended late at the server, and of
// the others.
func counterfactual(log string, slo time.Duration) string {
	limit := float64(slo) / 1e6
	var refused, refusedLate, admitted, admittedLate int
	for _, m := range finishLine.FindAllStringSubmatch(log, -1) {
		var v [5]float64
		for i := range v {
			v[i], _ = strconv.ParseFloat(m[i+1], 64)
		}
		late := v[3]+v[4] > limit
		if v[0]+v[1]+v[2] > limit {
			refused++
			if late {
				refusedLate++
			}
		} else {
			admitted++
			if late {
				admittedLate++
			}
		}
	}
	return fmt.Sprintf("at %v admission would have refused %d requests, %d of them ended late at the server (%.0f%%); of the %d it would have admitted, %d (%.0f%%)",
		slo, refused, refusedLate, 100*float64(refusedLate)/float64(max(refused, 1)), admitted, admittedLate, 100*float64(admittedLate)/float64(max(admitted, 1)))
}

// planLine reads admission's plan from a finish line: wait, execution and
// room, in milliseconds.
var planLine = regexp.MustCompile(`msg="request finished".* plan_wait_ms=([0-9.]+) plan_exec_ms=([0-9.]+) plan_room_ms=([0-9.]+)`)

// roomAtCap counts the finish lines whose room was asked for and how many
// of those got the room's cap, (maxTailRatio-1) = 2 times the queue
// predicted (to the lines' 0.01 ms).
func roomAtCap(log string) string {
	var asked, capped int
	for _, m := range planLine.FindAllStringSubmatch(log, -1) {
		var v [3]float64
		for i := range v {
			v[i], _ = strconv.ParseFloat(m[i+1], 64)
		}
		if v[2] > 0 {
			asked++
			if v[2] >= 2*(v[0]+v[1])-0.03 {
				capped++
			}
		}
	}
	return fmt.Sprintf("room asked for %d admissions, at its cap (twice the queue) in %d (%.0f%%)", asked, capped, 100*float64(capped)/float64(max(asked, 1)))
}

func BenchmarkRESTTinyRefusals(b *testing.B) {
	const slo = 40 * time.Millisecond
	strict := startServer(b, wakeRepo(b), "")
	loose := startServer(b, wakeRepoSLO(b, 10000), "")
	rounds := envInt(b, "SLOSERVE_REST_BENCH_ROUNDS", 3)
	window := envDuration(b, "SLOSERVE_REST_BENCH_WINDOW", 4*time.Second)
	body := wakeJSON(wakeValues(), false)

	type run struct {
		ok, refused, dropped int
		// refusedReqs counts the requests refused: a closed-loop client
		// sends a refused request again at once, so one request held
		// past a long queue gets a run of 429s.
		refusedReqs int
		lat         []time.Duration
		texts       []string
	}
	loop := func(s *testServer, d time.Duration) run {
		req := rawRequest(b, s.http, "/v2/models/"+wakeModel+"/infer", body, "Content-Type", "application/json")
		var mu sync.Mutex
		var out run
		var wg sync.WaitGroup
		end := time.Now().Add(d)
		for range 16 {
			c := newRawHTTP(s, req)
			wg.Go(func() {
				defer c.close()
				var mine run
				again := false // the last answer was a 429: this is the same request sent again
				for time.Now().Before(end) {
					t0 := time.Now()
					code, text, err := c.do()
					took := time.Since(t0)
					switch {
					case err != nil:
						b.Errorf("REST: %v", err)
						return
					case code == http.StatusOK:
						mine.ok++
						mine.lat = append(mine.lat, took)
					case code == http.StatusTooManyRequests:
						mine.refused++
						if !again {
							mine.refusedReqs++
						}
						mine.texts = append(mine.texts, string(text))
					case code == http.StatusGatewayTimeout:
						mine.dropped++
					default:
						b.Errorf("REST: status %d %s", code, text)
						return
					}
					again = code == http.StatusTooManyRequests
				}
				mu.Lock()
				out.ok, out.refused, out.dropped = out.ok+mine.ok, out.refused+mine.refused, out.dropped+mine.dropped
				out.refusedReqs += mine.refusedReqs
				out.lat = append(out.lat, mine.lat...)
				out.texts = append(out.texts, mine.texts...)
				mu.Unlock()
			})
		}
		wg.Wait()
		return out
	}
	describe := func(r run) string {
		if len(r.lat) == 0 {
			return "nothing answered"
		}
		slices.Sort(r.lat)
		over := len(r.lat) - func() int { i, _ := slices.BinarySearch(r.lat, slo); return i }()
		ms := func(d time.Duration) string { return fmt.Sprintf("%.1fms", float64(d)/1e6) }
		return fmt.Sprintf("%d answered, %d 429 (%d requests, each sent again at once until admitted), %d 504; latency p50 %s p99 %s max %s, %d over %v",
			r.ok, r.refused, r.refusedReqs, r.dropped, ms(percentile(r.lat, 0.5)), ms(percentile(r.lat, 0.99)), ms(r.lat[len(r.lat)-1]), over, slo)
	}
	// predicted sums up the refusals' texts: medians and maxima of room,
	// queue ahead and execution, and how many were refused on the mean.
	predicted := func(texts []string) string {
		if len(texts) == 0 {
			return ""
		}
		var room, queue, exec []float64
		onMean := 0
		for _, t := range texts {
			m := refusalText.FindStringSubmatch(t)
			if m == nil {
				b.Logf("a 429 not from admission's prediction: %s", t)
				continue
			}
			if m[1] == "" {
				onMean++
				m[1] = "0"
			}
			for i, xs := range []*[]float64{&room, &queue, &exec} {
				v, _ := strconv.ParseFloat(m[i+1], 64)
				*xs = append(*xs, v)
			}
		}
		med := func(xs []float64) string {
			if len(xs) == 0 {
				return "-"
			}
			slices.Sort(xs)
			return fmt.Sprintf("%.1f/%.1f", xs[len(xs)/2], xs[len(xs)-1])
		}
		return fmt.Sprintf("refused (median/max ms): room %s, queue ahead %s, execution %s; %d on the mean; first: %s",
			med(room), med(queue), med(exec), onMean, texts[0])
	}
	for b.Loop() {
		loop(strict, window/4) // warm both
		loop(loose, window/4)
		for i := range rounds {
			sFrom := len(strict.log.String())
			s := loop(strict, window)
			b.Logf("round %d, 40ms SLO: %s", i, roomAtCap(strict.log.String()[sFrom:]))
			from := len(loose.log.String())
			l := loop(loose, window)
			b.Logf("round %d, 40ms SLO: %s", i, describe(s))
			if p := predicted(s.texts); p != "" {
				b.Logf("round %d, 40ms SLO: %s", i, p)
			}
			b.Logf("round %d, 10s SLO (nothing refused): %s", i, describe(l))
			b.Logf("round %d, 10s SLO: %s", i, counterfactual(loose.log.String()[from:], slo))
		}
	}
	// The servers' logs (debug: a line per finished request, with
	// admission's plan, qos/finishlog.go), for scripts/late-causes.py or
	// a closer look.
	if dir := os.Getenv("SLOSERVE_REFUSALS_LOG_DIR"); dir != "" {
		for name, s := range map[string]*testServer{"strict": strict, "loose": loose} {
			if err := os.WriteFile(filepath.Join(dir, name+".log"), []byte(s.log.String()), 0o644); err != nil {
				b.Error(err)
			}
		}
	}
}
