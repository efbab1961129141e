package loadtest

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// oipServer is a minimal Open Inference Protocol v2 server that is not
// sloserve: readiness, one model's metadata and inference with a fixed
// output, and 404 for every other path (GET /v2/control among them), as
// another server answers.
type oipServer struct {
	infers  atomic.Int64
	control atomic.Int64 // GET /v2/control calls
	// controlStatus, when not 0, is what /v2/control answers instead of
	// 404.
	controlStatus int
}

func (o *oipServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.Method == http.MethodGet && r.URL.Path == "/v2/health/ready":
		w.WriteHeader(http.StatusOK)
	case r.Method == http.MethodGet && r.URL.Path == "/v2/models/adder":
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"name":"adder","versions":["1"],"platform":"other","inputs":[{"name":"a","datatype":"FP32","shape":[-1,4]}],"outputs":[{"name":"sum","datatype":"FP32","shape":[-1]}]}`)
	case r.Method == http.MethodPost && r.URL.Path == "/v2/models/adder/infer":
		var req struct {
			Inputs []struct {
				Name  string  `json:"name"`
				Shape []int64 `json:"shape"`
			} `json:"inputs"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || len(req.Inputs) != 1 || req.Inputs[0].Name != "a" || !slices.Equal(req.Inputs[0].Shape, []int64{1, 4}) {
			w.WriteHeader(http.StatusBadRequest)
			io.WriteString(w, `{"error":"bad request"}`)
			return
		}
		o.infers.Add(1)
		time.Sleep(time.Millisecond)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"model_name":"adder","model_version":"1","outputs":[{"name":"sum","datatype":"FP32","shape":[1],"data":[10]}]}`)
	case r.URL.Path == "/v2/control":
		o.control.Add(1)
		if o.controlStatus != 0 {
			w.WriteHeader(o.controlStatus)
			io.WriteString(w, `{"error":"no"}`)
			return
		}
		http.NotFound(w, r)
	default:
		http.NotFound(w, r)
	}
}

func foreignScenario(t *testing.T, slo string) *Scenario {
	t.Helper()
	sc, err := ParseScenario([]byte(`name: foreign
duration: 2s
warmup: 0s
seed: 1
models:
  - model: adder
    protocol: rest
    rate: {constant: 40}
    inputs: {a: {shape: [1, 4]}}
`+slo), ".")
	if err != nil {
		t.Fatal(err)
	}
	return sc
}

// Against an OIP v2 server without GET /v2/control the run goes on with
// the scenario's SLO and class, and the report says which parts it could
// not fill.
func TestExecuteOtherServer(t *testing.T) {
	fake := &oipServer{}
	srv := httptest.NewServer(fake)
	t.Cleanup(srv.Close)

	run, err := Execute(t.Context(), foreignScenario(t, "    slo: 30s\n    class: best-effort\n"), Options{HTTPBase: srv.URL, SharePeriod: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if run.Policy != "" || !slices.Equal(run.Unfilled, UnfilledWithoutControl) || len(run.Shares) != 0 || len(run.Events) != 0 {
		t.Errorf("policy %q unfilled %q shares %d events %d", run.Policy, run.Unfilled, len(run.Shares), len(run.Events))
	}
	if got := fake.control.Load(); got != 1 {
		t.Errorf("GET /v2/control asked %d times, want once (then never polled)", got)
	}
	m := run.Models[0]
	if m.SLO != 30*time.Second || m.Class != BestEffort {
		t.Errorf("model info %+v, want the scenario's SLO and class", m)
	}
	sum := Summarize(run)
	ms := sum.Models[0]
	// 40/s for 2 s: 80 arrivals; every one answered within the SLO, long
	// enough for a loaded machine (a 250 ms SLO missed 2 of 82 under -race
	// at load average 40).
	if ms.Requests < 70 || ms.Requests > 90 || ms.Outcomes["good"] != ms.Requests || int64(ms.Requests) > fake.infers.Load() {
		t.Errorf("requests %d, good %d, server saw %d", ms.Requests, ms.Outcomes["good"], fake.infers.Load())
	}
	if !slices.Equal(sum.Unfilled, UnfilledWithoutControl) || ms.ShareMean != 0 || ms.ShareChanges != 0 {
		t.Errorf("summary unfilled %q share %v changes %d", sum.Unfilled, ms.ShareMean, ms.ShareChanges)
	}
	var js bytes.Buffer
	if err := sum.WriteJSON(&js); err != nil || !strings.Contains(js.String(), `"unfilled": [`) {
		t.Errorf("summary JSON lacks unfilled: %v\n%s", err, js.String())
	}
	var html bytes.Buffer
	if err := WriteHTML(&html, []*Run{run}); err != nil || !strings.Contains(html.String(), "Not filled, the server has no GET /v2/control") {
		t.Errorf("report lacks the note: %v", err)
	}

	t.Run("without an SLO in the scenario", func(t *testing.T) {
		_, err := Execute(t.Context(), foreignScenario(t, ""), Options{HTTPBase: srv.URL})
		if err == nil || !strings.Contains(err.Error(), "the server has no GET /v2/control (not sloserve), so the scenario must give slo") {
			t.Errorf("err %v", err)
		}
	})
	t.Run("a refusal is not an absence", func(t *testing.T) {
		// A sloserve that refuses the token has the endpoint: the run
		// stops, as before.
		refusing := httptest.NewServer(&oipServer{controlStatus: http.StatusUnauthorized})
		t.Cleanup(refusing.Close)
		_, err := Execute(t.Context(), foreignScenario(t, "    slo: 250ms\n"), Options{HTTPBase: refusing.URL})
		if err == nil || !strings.Contains(err.Error(), "401") {
			t.Errorf("err %v, want the 401", err)
		}
	})
}
