package e2e

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// loadtestSummary is the part of summary.json the tests read.
type loadtestSummary struct {
	Scenario string `json:"scenario"`
	Policy   string `json:"policy"`
	Models   []struct {
		Name       string         `json:"name"`
		Class      string         `json:"class"`
		Protocol   string         `json:"protocol"`
		Requests   int            `json:"requests"`
		Outcomes   map[string]int `json:"outcomes"`
		Goodput    float64        `json:"goodput"`
		Attainment float64        `json:"attainment"`
		P99ms      float64        `json:"p99_ms"`
		Errors     map[string]int `json:"errors"`
	} `json:"models"`
}

// qosOutcomes sums the server's sloserve_qos_requests_total of one model
// (all its versions) by outcome.
func qosOutcomes(series map[string]float64, model string) map[string]int {
	out := map[string]int{}
	for k, v := range series {
		if !strings.HasPrefix(k, "sloserve_qos_requests_total{") || !strings.Contains(k, `model="`+model+`/`) {
			continue
		}
		i := strings.Index(k, `outcome="`)
		if i < 0 {
			continue
		}
		o := k[i+len(`outcome="`):]
		out[o[:strings.IndexByte(o, '"')]] += int(v)
	}
	return out
}

// runLoadtest runs the real binary's loadtest command and returns its
// output folder.
func runLoadtest(t *testing.T, scenario string, args ...string) (string, string) {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, "scenario.yaml")
	if err := os.WriteFile(path, []byte(scenario), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "out")
	stdout, stderr, err := runSloserve(append(append([]string{"loadtest", "--out", out}, args...), path)...)
	if err != nil {
		t.Fatalf("loadtest: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	return out, stdout
}

func readSummary(t *testing.T, path string) loadtestSummary {
	t.Helper()
	var s loadtestSummary
	if err := json.Unmarshal(mustRead(t, path), &s); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return s
}

// TestE2ELoadtestAgainstServerCounters drives two models over the three
// protocols with the real loadtest command and checks its records against
// the server's own counters, request by request, and its summary against
// its records. It checks agreement, not performance: on a busy machine the
// best-effort model (idle CPU class) is starved by design, and even the
// load generator and the latency-critical model may be late, so any
// outcome may come; what the client and the server say of each request
// must still agree.
func TestE2ELoadtestAgainstServerCounters(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo,
		repoModel{name: "cls", file: demoModel(t, "ocr-cls"), config: `max_batch_size: 8
execution: {intra_op_threads: 1}
slo: {latency_ms: 200, class: latency-critical}
resources: {min_compute_share: 0.5}
`},
		repoModel{name: "wake", file: demoModel(t, "wakeword-hello"), config: `max_batch_size: 0
execution: {intra_op_threads: 1}
slo: {latency_ms: 1000, class: best-effort}
`},
	)
	srv := startServer(t, repo, "control: {policy: adaptive, profile: {enabled: false}}\n")
	// cls over gRPC and REST binary (two entries, one model), wake over
	// REST JSON.
	scenario := `name: e2e
duration: 6s
seed: 7
models:
  - model: cls
    protocol: grpc
    rate: {constant: 20}
    inputs: {x: {shape: [1, 3, 48, 192]}}
  - model: cls
    protocol: rest-binary
    process: {kind: gamma, cv: 2}
    rate: {steps: [{at: 0s, rate: 5}, {at: 3s, rate: 15}]}
    inputs: {x: {shape: [1, 3, 48, 192]}}
  - model: wake
    protocol: rest
    rate: {constant: 30}
`
	out, stdout := runLoadtest(t, scenario, "--http", srv.http, "--grpc", srv.grpcAddr, "--warmup", "0s", "--quiet")
	sum := readSummary(t, filepath.Join(out, "summary.json"))
	if len(sum.Models) != 3 {
		t.Fatalf("summary has %d models, want 3:\n%s", len(sum.Models), stdout)
	}
	series := srv.scrape(t)
	recs, err := csv.NewReader(bytes.NewReader(mustRead(t, filepath.Join(out, "records.csv")))).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) == 0 || strings.Join(recs[0], ",") != "model,scheduled_ms,sent_ms,latency_ms,outcome,detail,id" {
		t.Fatalf("records.csv header %v", recs[:min(1, len(recs))])
	}
	// The client's view of every request, from its records: how each
	// ended; how many it gave up on at its own timeout (the server may
	// have ended those any way, or not seen them); how many the generator
	// never sent; and how many were sent within the measured window, which
	// is what the summary counts.
	type clientView struct {
		outcomes              map[string]int
		gaveUp, unsent, inWin int
	}
	client := map[string]*clientView{}
	ids := map[string]bool{} // model and id of every request sent: each once
	for _, r := range recs[1:] {
		if r[5] != "generator: too many requests in flight" {
			if r[6] == "" || ids[r[0]+"/"+r[6]] {
				t.Fatalf("records.csv: %s request with id %q: want an id of its own", r[0], r[6])
			}
			ids[r[0]+"/"+r[6]] = true
		}
		c := client[r[0]]
		if c == nil {
			c = &clientView{outcomes: map[string]int{}}
			client[r[0]] = c
		}
		switch r[5] {
		case "client timeout":
			c.gaveUp++
		case "generator: too many requests in flight":
			c.unsent++
		default:
			c.outcomes[r[4]]++
		}
		if sent, err := strconv.ParseFloat(r[2], 64); err != nil {
			t.Fatalf("records.csv: sent_ms %q: %v", r[2], err)
		} else if sent >= 0 && sent < 6000 {
			c.inWin++
		}
	}
	// Expected arrivals: cls 20 x 6 + 5 x 3 + 15 x 3 = 180, wake 180; the
	// generator records each, sent or not, however late.
	for name, want := range map[string]float64{"cls": 180, "wake": 180} {
		c := client[name]
		if c == nil {
			t.Fatalf("no records of %s", name)
		}
		got := float64(c.gaveUp + c.unsent)
		for _, n := range c.outcomes {
			got += float64(n)
		}
		if got < want*0.75 || got > want*1.25 {
			t.Errorf("%s: %v requests, want about %v", name, got, want)
		}
	}
	for _, name := range []string{"cls", "wake"} {
		c, server := client[name], qosOutcomes(series, name)
		t.Logf("%s: client %v, gave up on %d, %d not sent; server %v", name, c.outcomes, c.gaveUp, c.unsent, server)
		if c.outcomes["failed"] != 0 || server["failed"] != 0 {
			t.Errorf("%s: failures: client %v, server %v", name, c.outcomes, server)
		}
		// Every request the client sent reached the server and ended there
		// as the client saw it: answered = good + late, and the server's
		// rejections and drops (at the deadline the client sent, or
		// canceled when the client's timer fired first) are the client's.
		// A request the client gave up on the server may have ended any
		// way, or never seen: each such request may add one to one of the
		// server's counts, and nothing else may.
		pairs := []struct {
			what           string
			client, server int
		}{
			{"answered", c.outcomes["good"] + c.outcomes["late"], server["good"] + server["late"]},
			{"rejected", c.outcomes["rejected"], server["rejected"]},
			{"dropped", c.outcomes["dropped"], server["dropped"] + server["canceled"]},
		}
		extra := 0
		for _, p := range pairs {
			if p.server < p.client {
				t.Errorf("%s: client %s %d, server %d", name, p.what, p.client, p.server)
			}
			extra += max(0, p.server-p.client)
		}
		if extra > c.gaveUp {
			t.Errorf("%s: the server counted %d requests more than the client saw end (%v), but the client gave up on only %d", name, extra, pairs, c.gaveUp)
		}
		// Latency seen by the client includes the network, so it can only
		// call fewer requests good than the server did.
		if c.outcomes["good"] > server["good"] {
			t.Errorf("%s: client good %d > server good %d", name, c.outcomes["good"], server["good"])
		}
	}
	// The summary counts the records sent in the measured window, by model.
	byName := map[string]int{}
	for _, m := range sum.Models {
		byName[m.Name] += m.Requests
		t.Logf("%s over %s: attainment %.3f", m.Name, m.Protocol, m.Attainment)
	}
	for name, c := range client {
		if byName[name] != c.inWin {
			t.Errorf("%s: the summary counts %d requests, records.csv has %d sent in the window", name, byName[name], c.inWin)
		}
	}

	// The timeline has a row per model and second; the report names every
	// model and draws its plots.
	rows, err := csv.NewReader(bytes.NewReader(mustRead(t, filepath.Join(out, "timeline.csv")))).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 1+3*6 {
		t.Errorf("timeline has %d rows, want a header and 3 models x 6 s", len(rows))
	}
	html := string(mustRead(t, filepath.Join(out, "report.html")))
	for _, want := range []string{"cls", "wake", "<svg"} {
		if !strings.Contains(html, want) {
			t.Errorf("report.html lacks %q", want)
		}
	}
}

// TestE2ELoadtestCompare runs a short scenario under two policies, each with
// a server the command starts itself, and checks the combined report.
func TestE2ELoadtestCompare(t *testing.T) {
	repo := t.TempDir()
	writeRepo(t, repo,
		repoModel{name: "cls", file: demoModel(t, "ocr-cls"), config: `max_batch_size: 8
execution: {intra_op_threads: 1}
slo: {latency_ms: 200, class: latency-critical}
`},
		repoModel{name: "wake", file: demoModel(t, "wakeword-hello"), config: `max_batch_size: 0
execution: {intra_op_threads: 1}
slo: {latency_ms: 1000, class: best-effort}
`},
	)
	scenario := fmt.Sprintf(`name: e2e-compare
duration: 4s
warmup: 1s
server:
  repository: %q
  policies: [static, adaptive]
  set: ["control.profile.enabled=false", "log.level=debug"]
models:
  - model: cls
    rate: {diurnal: {period: 4s, min: 5, max: 25, peak_at: 0.5}}
    inputs: {x: {shape: [1, 3, 48, 192]}}
  - model: wake
    protocol: rest-binary
    concurrency: 2
`, repo)
	out, stdout := runLoadtest(t, scenario, "--compare", "--quiet")
	var cmp struct {
		Runs []struct {
			Policy string `json:"policy"`
		} `json:"runs"`
		Ratios []struct {
			Of, Over string
		} `json:"ratios"`
	}
	if err := json.Unmarshal(mustRead(t, filepath.Join(out, "comparison.json")), &cmp); err != nil {
		t.Fatal(err)
	}
	if len(cmp.Runs) != 2 || cmp.Runs[0].Policy != "static" || cmp.Runs[1].Policy != "adaptive" {
		t.Fatalf("comparison runs %+v, want static then adaptive\n%s", cmp.Runs, stdout)
	}
	for _, p := range []string{"static", "adaptive"} {
		s := readSummary(t, filepath.Join(out, p, "summary.json"))
		if s.Policy != p {
			t.Errorf("%s/summary.json: policy %q", p, s.Policy)
		}
		for _, m := range s.Models {
			if m.Requests == 0 || m.Outcomes["failed"] != 0 {
				t.Errorf("%s: model %s: %d requests, %d failed", p, m.Name, m.Requests, m.Outcomes["failed"])
			}
		}
		if log := string(mustRead(t, filepath.Join(out, "server-"+p+".log"))); !strings.Contains(log, "policy="+p) {
			t.Errorf("server-%s.log does not mention the policy", p)
		}
	}
	if !strings.Contains(stdout, "adaptive / static") {
		t.Errorf("stdout lacks the ratio line:\n%s", stdout)
	}
}
