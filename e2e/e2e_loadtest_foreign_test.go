package e2e

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
)

// The binary's loadtest drives an Open Inference Protocol v2 server that
// is not sloserve (here a minimal one: readiness, metadata, inference
// with a fixed answer, 404 elsewhere): it takes SLO and class from the
// scenario, and its output names what it could not fill.
func TestE2ELoadtestOtherServer(t *testing.T) {
	var infers, control atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/v2/health/ready":
		case r.Method == http.MethodGet && r.URL.Path == "/v2/models/echo":
			io.WriteString(w, `{"name":"echo","versions":["1"],"platform":"x","inputs":[{"name":"in","datatype":"INT32","shape":[2]}],"outputs":[{"name":"out","datatype":"INT32","shape":[2]}]}`)
		case r.Method == http.MethodPost && r.URL.Path == "/v2/models/echo/infer":
			infers.Add(1)
			io.WriteString(w, `{"model_name":"echo","outputs":[{"name":"out","datatype":"INT32","shape":[2],"data":[1,2]}]}`)
		default:
			if r.URL.Path == "/v2/control" {
				control.Add(1)
			}
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)

	out, stdout := runLoadtest(t, `name: other
duration: 2s
warmup: 0s
models:
  - model: echo
    protocol: rest
    slo: 100ms
    timeout: 1m
    class: latency-critical
    rate: {constant: 25}
`, "--http", srv.URL, "--quiet")
	if !strings.Contains(stdout, "not filled (the server has no GET /v2/control: not sloserve): policy; share (share_mean, share_min, share_max); share_changes;") {
		t.Errorf("stdout does not name what was not filled:\n%s", stdout)
	}
	var row string
	for _, l := range strings.Split(stdout, "\n") {
		if strings.HasPrefix(l, "echo ") {
			row = l
		}
	}
	if f := strings.Fields(row); len(f) < 9 || f[1] != "latency-critical" || f[len(f)-1] != "-" {
		t.Errorf("model row %q: want the scenario's class and - for the share", row)
	}
	var sum struct {
		Policy   string   `json:"policy"`
		Unfilled []string `json:"unfilled"`
		Models   []struct {
			Requests int            `json:"requests"`
			Outcomes map[string]int `json:"outcomes"`
			SLOms    float64        `json:"slo_ms"`
		} `json:"models"`
	}
	if err := json.Unmarshal(mustRead(t, filepath.Join(out, "summary.json")), &sum); err != nil {
		t.Fatal(err)
	}
	m := sum.Models[0]
	// 25/s for 2 s: 50 requests, each answered. Whether an answer was in
	// time is the machine's, not the load generator's: beside `make test`
	// and two CPU burners 31 of 51 of this echo's answers took over 100 ms.
	// Every request must be counted good or late, none failed.
	o := m.Outcomes
	if m.Requests < 40 || m.Requests > 60 || o["good"]+o["late"] != m.Requests || o["failed"]+o["dropped"]+o["rejected"] != 0 || int64(m.Requests) > infers.Load() || m.SLOms != 100 {
		t.Errorf("model %+v, server answered %d", m, infers.Load())
	}
	if sum.Policy != "" || len(sum.Unfilled) != 5 || !slices.Contains(sum.Unfilled, "adjuster events") || control.Load() != 1 {
		t.Errorf("policy %q unfilled %q, /v2/control asked %d times", sum.Policy, sum.Unfilled, control.Load())
	}
}
