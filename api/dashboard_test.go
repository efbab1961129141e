package api

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/dashboard"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/qos"
)

// dashboardBackend has a recorder with 30 s of "sum/1" at 4 good requests a
// second, answered in 20ms, and one adjuster event.
func dashboardBackend(t *testing.T) (*fakeBackend, time.Time) {
	t.Helper()
	f := newFakeBackend()
	f.dash = dashboard.New(dashboard.Options{Retention: time.Hour, Window: 5 * time.Second})
	start := time.Now().Add(-30 * time.Second).Truncate(time.Second)
	st := qos.Stats{Model: "sum/1", Class: qos.ClassLatencyCritical, SLO: 100 * time.Millisecond}
	for i := range 30 {
		if i > 0 {
			st.Arrived += 4
			st.Good += 4
			for range 4 {
				st.Latency.Observe(20 * time.Millisecond)
			}
		}
		f.dash.Record(dashboard.Snapshot{
			Time:    start.Add(time.Duration(i) * time.Second),
			Policy:  "adaptive",
			Devices: []dashboard.Device{{Name: "cpu", Limiter: "cgroup-v1", CPUs: 2}},
			Models:  []dashboard.ModelSample{{Key: "sum/1", Name: "sum", Version: "1", Device: "cpu", Stats: st, ComputeShare: 0.25, TargetShare: 0.25, ShareSource: "adaptive"}},
			States:  []dashboard.ModelState{{Name: "sum", Version: "1", State: "READY"}, {Name: "broken", Version: "1", State: "UNAVAILABLE", Reason: "bad file"}},
		})
	}
	f.events = []control.Event{
		{Time: start.Add(10 * time.Second), Device: "cpu", Model: "sum/1", Kind: control.EventResize, Old: limiter.Share{Compute: 0.1}, New: limiter.Share{Compute: 0.25}, Reason: "forecast grew"},
		{Time: start.Add(11 * time.Second), Device: "cpu", Model: "echo/1", Kind: control.EventResize, Reason: "other model"},
	}
	return f, start
}

// getREST serves one GET on h.
func getREST(t *testing.T, h http.Handler, path string) *httptest.ResponseRecorder {
	t.Helper()
	return restCall{method: http.MethodGet, path: path}.do(t, t.Context(), h)
}

func TestDashboardOverview(t *testing.T) {
	f, _ := dashboardBackend(t)
	h := NewREST(f, Limits{}, nil)
	rec := getREST(t, h, "/v2/dashboard")
	code, body := rec.Code, rec.Body.Bytes()
	if code != http.StatusOK {
		t.Fatalf("GET /v2/dashboard: %d %s", code, body)
	}
	var ov struct {
		Version, Policy string
		Ready           bool
		WindowS         float64 `json:"window_s"`
		Devices         []dashboard.DeviceSplit
		Events          []eventJSON
		Models          []map[string]any
	}
	if err := json.Unmarshal(body, &ov); err != nil {
		t.Fatal(err)
	}
	if ov.Version != "test" || ov.Policy != "adaptive" || !ov.Ready || ov.WindowS != 5 {
		t.Errorf("header = %+v", ov)
	}
	if len(ov.Devices) != 1 || len(ov.Devices[0].Shares) != 1 || ov.Devices[0].Shares[0].Key != "sum/1" || ov.Devices[0].Shares[0].Compute != 0.25 {
		t.Errorf("devices = %+v", ov.Devices)
	}
	if len(ov.Events) != 2 || ov.Events[0].Reason != "forecast grew" {
		t.Errorf("events = %+v", ov.Events)
	}
	if len(ov.Models) != 2 {
		t.Fatalf("models = %v", ov.Models)
	}
	// The failed model sorts first among what is not ok; sum meets its SLO.
	if m := ov.Models[0]; m["name"] != "broken" || m["status"] != "unavailable" || m["p99_ms"] != nil {
		t.Errorf("broken = %v", m)
	}
	if m := ov.Models[1]; m["name"] != "sum" || m["status"] != "ok" || m["goodput"] != 4.0 || m["slo_ms"] != 100.0 {
		t.Errorf("sum = %v", m)
	}
}

func TestDashboardHistory(t *testing.T) {
	f, start := dashboardBackend(t)
	h := NewREST(f, Limits{}, nil)
	rec := getREST(t, h, "/v2/dashboard/models/sum?last=3600")
	code, body := rec.Code, rec.Body.Bytes()
	if code != http.StatusOK {
		t.Fatalf("history: %d %s", code, body)
	}
	var hist struct {
		Key    string
		Series map[string][]*float64
		Events []eventJSON
	}
	if err := json.Unmarshal(body, &hist); err != nil {
		t.Fatal(err)
	}
	if hist.Key != "sum/1" || len(hist.Series["t"]) != 30 || len(hist.Series["p99_ms"]) != 30 {
		t.Fatalf("history: key %q, %d points", hist.Key, len(hist.Series["t"]))
	}
	if p := hist.Series["p99_ms"]; p[0] != nil || *p[29] < 20 || *p[29] > 21 {
		t.Errorf("p99 column: first %v (want null), last %v (want 20ms +5%%)", p[0], *p[29])
	}
	if len(hist.Events) != 1 || hist.Events[0].Model != "sum/1" {
		t.Errorf("events = %+v, want sum's one", hist.Events)
	}

	since := float64(start.Add(27*time.Second).UnixMilli()) / 1000
	rec = getREST(t, h, "/v2/dashboard/models/sum?since="+strconv.FormatFloat(since, 'f', 3, 64))
	code, body = rec.Code, rec.Body.Bytes()
	if err := json.Unmarshal(body, &hist); code != 200 || err != nil || len(hist.Series["t"]) != 2 {
		t.Errorf("since: %d, %d points, %v", code, len(hist.Series["t"]), err)
	}

	// Polling: the events after since, even those older than the first
	// point returned.
	for _, c := range []struct {
		after  time.Duration
		events int
	}{{9500 * time.Millisecond, 1}, {10500 * time.Millisecond, 0}} {
		var got historyJSON
		rec = getREST(t, h, "/v2/dashboard/models/sum?last=5&since="+strconv.FormatFloat(float64(start.Add(c.after).UnixMilli())/1000, 'f', 3, 64))
		if err := json.Unmarshal(rec.Body.Bytes(), &struct{ Events *[]eventJSON }{&got.Events}); err != nil || len(got.Events) != c.events {
			t.Errorf("since start+%s: %d events, want %d (%v)", c.after, len(got.Events), c.events, err)
		}
	}

	for _, c := range []struct {
		path string
		code int
		msg  string
	}{
		{"/v2/dashboard/models/nope", 404, "no history"},
		{"/v2/dashboard/models/sum?version=7", 404, "no history"},
		{"/v2/dashboard/models/sum?last=0", 400, "last: want seconds"},
		{"/v2/dashboard/models/sum?last=99999999", 400, "the retention"},
		{"/v2/dashboard/models/sum?last=abc", 400, "last:"},
		{"/v2/dashboard/models/sum?since=-1", 400, "since: want unix seconds"},
		{"/v2/dashboard/models/sum?since=NaN", 400, "since:"},
	} {
		rec := getREST(t, h, c.path)
		code, body := rec.Code, rec.Body.Bytes()
		if code != c.code || !strings.Contains(string(body), c.msg) || !strings.HasPrefix(string(body), `{"error":`) {
			t.Errorf("GET %s: %d %s, want %d with %q", c.path, code, body, c.code, c.msg)
		}
	}
}

func TestDashboardPage(t *testing.T) {
	f, _ := dashboardBackend(t)
	h := NewREST(f, Limits{}, nil)
	w := getREST(t, h, "/dashboard")
	if w.Code != http.StatusFound || w.Header().Get("Location") != "/dashboard/" {
		t.Errorf("GET /dashboard: %d to %q", w.Code, w.Header().Get("Location"))
	}
	w = getREST(t, h, "/dashboard/")
	if w.Code != http.StatusOK || !strings.Contains(w.Body.String(), "<html") ||
		!strings.HasPrefix(w.Header().Get("Content-Type"), "text/html") ||
		!strings.Contains(w.Header().Get("Content-Security-Policy"), "default-src 'self'") {
		t.Errorf("GET /dashboard/: %d %q %v", w.Code, w.Body.String(), w.Header())
	}
	if w := getREST(t, h, "/dashboard/no-such-file.js"); w.Code != http.StatusNotFound {
		t.Errorf("missing asset: %d", w.Code)
	}
	if w := getREST(t, h, "/dashboard/../../etc/passwd"); w.Code == http.StatusOK && strings.Contains(w.Body.String(), "root:") {
		t.Errorf("path traversal served a file outside the assets")
	}

	// Disabled: the JSON says so, in the protocol's error shape.
	f.dash = nil
	for _, p := range []string{"/v2/dashboard", "/v2/dashboard/models/sum"} {
		rec := getREST(t, h, p)
		if rec.Code != 404 || !strings.Contains(rec.Body.String(), "dashboard.enabled") {
			t.Errorf("GET %s disabled: %d %s", p, rec.Code, rec.Body)
		}
	}
}
