package e2e

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
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
// protocols with the real loadtest command and checks its summary against
// the server's own counters, request by request.
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
	byModel := map[string]map[string]int{}
	requests := map[string]int{}
	for _, m := range sum.Models {
		if byModel[m.Name] == nil {
			byModel[m.Name] = map[string]int{}
		}
		for o, n := range m.Outcomes {
			byModel[m.Name][o] += n
		}
		requests[m.Name] += m.Requests
	}
	// Expected arrivals: cls 20 x 6 + 5 x 3 + 15 x 3 = 180, wake 180.
	for name, want := range map[string]float64{"cls": 180, "wake": 180} {
		got := float64(requests[name])
		if got < want*0.75 || got > want*1.25 {
			t.Errorf("%s: %v requests, want about %v", name, got, want)
		}
	}
	for _, name := range []string{"cls", "wake"} {
		client, server := byModel[name], qosOutcomes(series, name)
		t.Logf("%s: client %v, server %v", name, client, server)
		if client["failed"] != 0 || client["dropped"] != 0 {
			t.Errorf("%s: client saw failures or drops: %v", name, client)
		}
		// Every request the client sent reached the server and ended there
		// as the client saw it: answered = good + late, and the server's
		// rejections are the client's.
		if c, s := client["good"]+client["late"], server["good"]+server["late"]; c != s {
			t.Errorf("%s: client answered %d, server answered %d", name, c, s)
		}
		if client["rejected"] != server["rejected"] {
			t.Errorf("%s: client rejected %d, server rejected %d", name, client["rejected"], server["rejected"])
		}
		// Latency seen by the client includes the network, so it can only
		// call fewer requests good than the server did.
		if client["good"] > server["good"] {
			t.Errorf("%s: client good %d > server good %d", name, client["good"], server["good"])
		}
	}
	for _, m := range sum.Models {
		if m.Name == "cls" && m.Attainment < 0.9 {
			t.Errorf("cls over %s: attainment %.3f at a light load", m.Protocol, m.Attainment)
		}
	}

	// The timeline has a row per model and second; the records one per
	// request; the report names every model and draws its plots.
	rows, err := csv.NewReader(bytes.NewReader(mustRead(t, filepath.Join(out, "timeline.csv")))).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 1+3*6 {
		t.Errorf("timeline has %d rows, want a header and 3 models x 6 s", len(rows))
	}
	recs, err := csv.NewReader(bytes.NewReader(mustRead(t, filepath.Join(out, "records.csv")))).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for _, m := range sum.Models {
		total += m.Requests
	}
	if len(recs)-1 != total {
		t.Errorf("records.csv has %d rows, summary counts %d requests", len(recs)-1, total)
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
