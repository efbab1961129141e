package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os/exec"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/sloserve/sloserve/loadtest"
)

// Admission on a busy host (issue 33): two CPU burners share the machine's
// cores with the server, its runner and the clients. Sixteen closed-loop
// REST JSON clients of the wake-word model (latency-critical, executions
// of about a millisecond) keep at most sixteen requests in the server:
// when the SLO leaves room for what they take, none is refused however
// often the host stalls the runner. Then an open loop at several times
// the capacity those clients measured is a real overload: admission
// refuses, the requests it admits and runs finish on time (the
// scheduler's own count), and the model keeps serving.
//
// The SLO is 40 ms, as the issue measured it, or four times the 99th
// percentile latency the same sixteen clients see beside the burners under
// a loose SLO (a baseline server first), whichever is longer: on a machine
// busier than two burners make it, sixteen requests take longer than a
// quarter of 40 ms, and refusing them would be right. Four, not three:
// admission's room for error may be twice the queue (maxTailRatio), so an
// SLO of three times the queue's p99 leaves nothing for the queue's own
// prediction, and a queue predicted at the baseline's p99 is refused by
// the rule (2026-11-29, `make test` beside two burners: 1 of 1,975
// refused, "queue ahead 167.7ms ... misses the deadline by 0.0ms" under an
// SLO of 509 ms, three times a p99 of 170 ms).
//
// Before the room for error was counted in time (a stall delays the
// queue once), the ratios of a busy host's executions held it at its 3x
// cap, and 16 requests of about 1 ms each at 3x missed 40 ms: tens to
// hundreds of 429s a run.
func TestE2EAdmissionBusyHost(t *testing.T) {
	startBurners(t, 2)
	vs := wakeValues()
	body := wakeJSON(vs, false)
	closedLoop := func(s *testServer, clients int, window time.Duration) (ok, refused, dropped int64, latencies []time.Duration, first string) {
		rest := rawRequest(t, s.http, "/v2/models/"+wakeModel+"/infer", body, "Content-Type", "application/json")
		var nOK, nRefused, nDropped atomic.Int64
		var mu sync.Mutex
		var once sync.Once
		var wg sync.WaitGroup
		end := time.Now().Add(window)
		for range clients {
			c := newRawHTTP(s, rest)
			wg.Go(func() {
				defer c.close()
				var mine []time.Duration
				for time.Now().Before(end) {
					start := time.Now()
					code, b, err := c.do()
					switch {
					case err != nil:
						t.Errorf("REST: %v", err)
						return
					case code == http.StatusOK:
						nOK.Add(1)
						mine = append(mine, time.Since(start))
					case code == http.StatusTooManyRequests:
						nRefused.Add(1)
						once.Do(func() { first = string(b) })
					case code == http.StatusGatewayTimeout:
						nDropped.Add(1)
					default:
						t.Errorf("REST: status %d %s", code, b)
						return
					}
				}
				mu.Lock()
				latencies = append(latencies, mine...)
				mu.Unlock()
			})
		}
		wg.Wait()
		return nOK.Load(), nRefused.Load(), nDropped.Load(), latencies, first
	}

	// The baseline: what sixteen clients take here, under a loose SLO.
	base := startServer(t, wakeRepoSLO(t, 10000), "")
	closedLoop(base, 16, time.Second)
	_, _, _, lat, _ := closedLoop(base, 16, 3*time.Second)
	if len(lat) == 0 {
		t.Fatal("the baseline answered nothing")
	}
	slices.Sort(lat)
	p99 := lat[len(lat)*99/100]
	if err := base.stop(); err != nil {
		t.Fatalf("stopping the baseline server: %v", err)
	}
	slo := max(40*time.Millisecond, 4*p99).Round(time.Millisecond)
	t.Logf("baseline: 16 clients beside 2 burners, p50 %v p99 %v; SLO %v", lat[len(lat)/2], p99, slo)

	s := startServer(t, wakeRepoSLO(t, slo.Milliseconds()), "")
	// Warm up beside the burners: the predictor's correction and the
	// room for error learn the busy host.
	closedLoop(s, 16, 2*time.Second)
	outcomes := func() (good, late, rejected, dropped float64) {
		get := func(o string) float64 {
			v, _ := s.modelMetric(t, "sloserve_qos_requests_total", wakeModel+"/1", `outcome="`+o+`"`)
			return v
		}
		return get("good"), get("late"), get("rejected"), get("dropped")
	}

	const window = 5 * time.Second
	g0, l0, r0, d0 := outcomes()
	ok, refused, dropped, _, first := closedLoop(s, 16, window)
	g1, l1, r1, d1 := outcomes()
	capacity := float64(ok) / window.Seconds()
	t.Logf("16 closed-loop clients beside 2 burners: %d answered (%.0f/s), %d refused, %d dropped; scheduler: %.0f good %.0f late %.0f rejected %.0f dropped",
		ok, capacity, refused, dropped, g1-g0, l1-l0, r1-r0, d1-d0)
	if refused != 0 {
		t.Errorf("%d of %d requests of 16 closed-loop clients refused, want none (first: %s)", refused, ok+refused+dropped, first)
	}
	if ok == 0 {
		t.Fatal("nothing answered")
	}

	// A real overload: Poisson arrivals at several times that capacity,
	// over gRPC (the cheaper client, so that the generator keeps up on
	// the busy machine).
	const factor = 4
	client, err := loadtest.NewClient(loadtest.ClientOptions{
		Protocol: loadtest.ProtoGRPC, GRPCAddr: s.grpcAddr, Model: wakeModel,
		Inputs:        []loadtest.Tensor{{Name: wakeInput, DataType: "FP32", Shape: wakeShape, Raw: f32bytes(vs)}},
		ServerTimeout: -1, GRPCDialOptions: []grpc.DialOption{grpc.WithTransportCredentials(s.creds)},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	rate := factor * capacity
	rng := rand.New(rand.NewPCG(33, 2))
	var arrivals []time.Duration
	for at := time.Duration(0); ; {
		at += time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
		if at >= window {
			break
		}
		arrivals = append(arrivals, at)
	}
	var sent, notSent atomic.Int64
	var failed atomic.Int64
	p := loadtest.Pacer{Start: time.Now(), MaxInFlight: 1024, MaxLag: time.Second,
		Send: func(int, time.Duration) {
			sent.Add(1)
			if o, _ := client.Infer(context.Background()); o == loadtest.Failed {
				failed.Add(1)
			}
		},
		Drop: func(int, time.Duration, string) { notSent.Add(1) },
	}
	g0, l0, r0, d0 = outcomes()
	start := time.Now()
	p.Run(context.Background(), arrivals)
	took := time.Since(start)
	g1, l1, r1, d1 = outcomes()
	good, late, rejected, drops := g1-g0, l1-l0, r1-r0, d1-d0
	admitted := good + late + drops
	t.Logf("open loop at %.0f/s (%dx) for %v: %d sent, %d not sent by the generator; scheduler: %.0f good %.0f late %.0f rejected %.0f dropped; goodput %.0f/s (%.2f of the closed loop's)",
		rate, factor, took.Round(time.Millisecond), sent.Load(), notSent.Load(), good, late, rejected, drops, good/took.Seconds(), good/took.Seconds()/capacity)
	if failed.Load() > 0 {
		t.Errorf("%d requests failed", failed.Load())
	}
	// The generator is this process: under the race detector, or beside
	// other packages' tests, it may not offer an overload at all
	// (measured in make test with -race: 2,297 of 18,214 arrivals sent,
	// 0.42 of the capacity), and what the server does below capacity is
	// not what the checks below are about.
	if offered := float64(sent.Load()) / took.Seconds() / capacity; offered < 2 {
		t.Logf("the generator offered %.2f of the closed loop's rate, not an overload: the overload checks are not made", offered)
		return
	}
	if rejected == 0 {
		t.Errorf("nothing refused at %dx capacity: admission did not see the overload", factor)
	}
	// Admitted requests that ran finished on time. Those the dispatcher
	// dropped at their deadline (never run late) are logged, not
	// bounded: on a machine busier than the burners make it the runner's
	// share swings within a second, faster than the room's window of
	// executions follows (measured at load averages of 10 to 17 on two
	// cores: 0 to 43% of the admitted dropped).
	if admitted == 0 || late/admitted > 0.02 {
		t.Errorf("%.0f of %.0f admitted finished late, want at most 2%%", late, admitted)
	}
	if g := good / took.Seconds() / capacity; g < 0.1 {
		t.Errorf("goodput under overload %.2f of the closed loop's, want at least 0.1", g)
	}
}

// wakeRepoSLO is wakeRepo with an SLO of sloMS milliseconds.
func wakeRepoSLO(tb testing.TB, sloMS int64) string {
	repo := tb.TempDir()
	writeRepo(tb, repo, repoModel{wakeModel, demoModel(tb, wakeModel), fmt.Sprintf(`max_batch_size: 0
instances: 1
execution: {provider: cpu, intra_op_threads: 1}
slo: {latency_ms: %d, class: latency-critical}
resources: {memory_limit: 128MiB, min_compute_share: 0.05, max_compute_share: 1.0}
`, sloMS)})
	return repo
}

// startBurners runs n busy-loop processes beside the test until it ends,
// as another tenant's work on the same cores would.
func startBurners(t *testing.T, n int) {
	for range n {
		cmd := exec.Command("sh", "-c", "while :; do :; done")
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			t.Fatalf("starting a burner: %v", err)
		}
		t.Cleanup(func() {
			cmd.Process.Kill()
			cmd.Wait()
		})
	}
}
