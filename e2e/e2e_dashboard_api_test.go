package e2e

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// dashboardModel is the part of a /v2/dashboard model the tests read.
type dashboardModel struct {
	Key, Name, Status, Why, Class string
	SLOms                         *float64 `json:"slo_ms"`
	P50ms                         *float64 `json:"p50_ms"`
	P99ms                         *float64 `json:"p99_ms"`
	Attainment                    *float64
	Goodput                       *float64
	RejectedDeadline              *float64 `json:"rejected_deadline"`
	Totals                        *struct{ Arrived, Good, Late, Rejected, Dropped, Failed int }
}

type dashboardOverview struct {
	Time    time.Time
	Policy  string
	Models  []dashboardModel
	Devices []struct {
		Device string
		Shares []struct {
			Key     string
			Compute float64
		}
	}
}

func (o dashboardOverview) model(name string) *dashboardModel {
	for i := range o.Models {
		if o.Models[i].Name == name {
			return &o.Models[i]
		}
	}
	return nil
}

// The dashboard's JSON against the server's own counters, on the real
// binary: totals equal the Prometheus counters, the model that cannot meet
// its SLO is reported missing with a cause, the history's points are one a
// second and bounded by what clients saw.
func TestE2EDashboardAPI(t *testing.T) {
	repo := t.TempDir()
	dyn := testModel(t, "example_dynamic_axes.onnx")
	writeRepo(t, repo,
		repoModel{"fast", dyn, "max_batch_size: 8\nslo: {latency_ms: 500, class: latency-critical}\n"},
		// 10µs: no request can make it.
		repoModel{"tight", dyn, "max_batch_size: 8\nslo: {latency_ms: 0.01, class: latency-critical}\n"},
		repoModel{"quiet", dyn, "max_batch_size: 8\nslo: {latency_ms: 100, class: best-effort}\n"},
	)
	s := startServer(t, repo, "dashboard: {window: 30s}\n")

	const n = 40
	start := time.Now()
	var clientMax time.Duration
	for range n {
		sent := time.Now()
		if code, b, _ := s.do(t, "POST", "/v2/models/fast/infer", dynBody); code != 200 {
			t.Fatalf("fast: %d %s", code, b)
		}
		clientMax = max(clientMax, time.Since(sent))
		s.do(t, "POST", "/v2/models/tight/infer", dynBody) // refused or late: the SLO is 10µs
		time.Sleep(40 * time.Millisecond)
	}

	var ov dashboardOverview
	waitFor(t, "the dashboard to count every request", 10*time.Second, func() bool {
		ov = dashboardOverview{}
		if code := s.json(t, "GET", "/v2/dashboard", nil, &ov); code != 200 {
			t.Fatalf("GET /v2/dashboard: %d", code)
		}
		f, tg := ov.model("fast"), ov.model("tight")
		if f == nil || tg == nil || f.Totals == nil || tg.Totals == nil || f.Totals.Arrived != n || tg.Totals.Arrived != n {
			return false
		}
		// and at least five points of history.
		return ov.Time.Sub(start) >= 4*time.Second
	})
	// Counters settle with the last request: the next sample equals the
	// Prometheus counters exactly.
	series := s.scrape(t)
	for _, name := range []string{"fast", "tight"} {
		m := ov.model(name)
		prom := qosOutcomes(series, name)
		got := map[string]int{"good": m.Totals.Good, "late": m.Totals.Late, "rejected": m.Totals.Rejected, "dropped": m.Totals.Dropped, "failed": m.Totals.Failed}
		for o, v := range got {
			if prom[o] != v {
				t.Errorf("%s: dashboard %s = %d, Prometheus %d", name, o, v, prom[o])
			}
		}
	}

	fast, tight, quiet := ov.model("fast"), ov.model("tight"), ov.model("quiet")
	if fast.Totals.Good != n || fast.Class != "latency-critical" || fast.SLOms == nil || *fast.SLOms != 500 {
		t.Errorf("fast: %+v totals %+v", fast, fast.Totals)
	}
	if tight.Status != "missing" || tight.Totals.Good != 0 || !strings.Contains(tight.Why, "is over the 0.0 ms SLO") && !strings.Contains(tight.Why, "attainment 0.0%") {
		t.Errorf("tight: status %q, why %q, totals %+v: want missing, with why", tight.Status, tight.Why, tight.Totals)
	}
	if tight.Totals.Rejected > 0 && !strings.Contains(tight.Why, "rejected at admission") && *tight.RejectedDeadline > 0 {
		t.Errorf("tight: %d rejected, but why %q does not say so", tight.Totals.Rejected, tight.Why)
	}
	if quiet == nil || quiet.Status != "idle" || quiet.Why != "" {
		t.Errorf("quiet: %+v, want idle", quiet)
	}
	if len(ov.Devices) != 1 || len(ov.Devices[0].Shares) != 3 {
		t.Errorf("devices = %+v, want cpu with 3 shares", ov.Devices)
	}

	var hist struct {
		Key    string
		Series map[string][]*float64
	}
	if code := s.json(t, "GET", "/v2/dashboard/models/fast?last=600", nil, &hist); code != 200 {
		t.Fatalf("history: %d", code)
	}
	ts := hist.Series["t"]
	if hist.Key != "fast/1" || len(ts) < 4 {
		t.Fatalf("history: key %q, %d points", hist.Key, len(ts))
	}
	for name, col := range hist.Series {
		if len(col) != len(ts) {
			t.Errorf("column %s: %d values for %d times", name, len(col), len(ts))
		}
	}
	var withTraffic int
	for i := range ts {
		if i > 0 {
			if d := *ts[i] - *ts[i-1]; d < 0.5 || d > 3 {
				t.Errorf("points %d and %d are %.2fs apart, want about the 1s resolution", i-1, i, d)
			}
		}
		if p := hist.Series["p50_ms"][i]; p != nil {
			withTraffic++
			// The server's latency is part of what the client measured.
			if client := float64(clientMax) / float64(time.Millisecond); *p > client*1.05+0.5 {
				t.Errorf("point %d: p50 %.2f ms above the slowest client round trip %.2f ms", i, *p, client)
			}
		}
		if g := hist.Series["goodput"][i]; g != nil && (*g < 0 || *g > 30) {
			t.Errorf("point %d: goodput %.1f/s; the client sent at most 25/s", i, *g)
		}
	}
	if withTraffic == 0 {
		t.Error("no point of the history has latencies")
	}
	last := *ts[len(ts)-1]
	var inc struct{ Series map[string][]*float64 }
	s.json(t, "GET", fmt.Sprintf("/v2/dashboard/models/fast?since=%.3f", last), nil, &inc)
	if len(inc.Series["t"]) > 2 {
		t.Errorf("since the last point: %d points, want at most the ones sampled since", len(inc.Series["t"]))
	}
	if code, b, _ := s.do(t, "GET", "/v2/dashboard/models/nope", nil); code != http.StatusNotFound || !strings.Contains(string(b), `"error"`) {
		t.Errorf("unknown model: %d %s", code, b)
	}
	code, b, h := s.do(t, "GET", "/dashboard/", nil)
	if code != 200 || !strings.Contains(string(b), "<html") || !strings.Contains(h.Get("Content-Security-Policy"), "default-src 'self'") {
		t.Errorf("GET /dashboard/: %d, CSP %q", code, h.Get("Content-Security-Policy"))
	}
}
