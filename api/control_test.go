package api

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/limiter"
)

func TestControlStatus(t *testing.T) {
	h, _ := newRESTTest(restLimits)
	rec := restCall{method: http.MethodGet, path: "/v2/control"}.do(t, t.Context(), h)
	if rec.Code != http.StatusOK {
		t.Fatalf("GET /v2/control: %d %s", rec.Code, rec.Body)
	}
	var st ControlStatus
	if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil {
		t.Fatal(err)
	}
	if st.Policy != "adaptive" || len(st.Devices) != 1 || st.Devices[0].Limiter != "cgroup-v1" ||
		len(st.Devices[0].Models) != 1 || st.Devices[0].Models[0].ComputeShare != 0.25 {
		t.Errorf("control status = %+v", st)
	}
	// GET /v2 names the limiter of each device.
	rec = restCall{method: http.MethodGet, path: "/v2"}.do(t, t.Context(), h)
	var md struct {
		Extensions []string          `json:"extensions"`
		Limiters   map[string]string `json:"sloserve_limiters"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &md); err != nil {
		t.Fatal(err)
	}
	if md.Limiters["cpu"] != "cgroup-v1" || !strings.Contains(strings.Join(md.Extensions, ","), "sloserve_control") {
		t.Errorf("GET /v2 = %s", rec.Body)
	}
}

func TestControlEvents(t *testing.T) {
	h, fb := newRESTTest(restLimits)
	t0 := time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC)
	for i := range 5 {
		fb.events = append(fb.events, control.Event{
			Time: t0.Add(time.Duration(i) * time.Second), Device: "cpu", Model: "sum/1", Kind: "resize",
			Old: limiter.Share{Compute: 0.1 * float64(i)}, New: limiter.Share{Compute: 0.1 * float64(i+1)},
			Reason: "test", Predicted: 42 * time.Millisecond, ForecastRate: 10,
		})
	}
	rec := restCall{method: http.MethodGet, path: "/v2/control/events?since=2026-11-21T10:00:01Z&limit=2"}.do(t, t.Context(), h)
	if rec.Code != http.StatusOK {
		t.Fatalf("events: %d %s", rec.Code, rec.Body)
	}
	var body struct {
		Events []eventJSON `json:"events"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatal(err)
	}
	if len(body.Events) != 2 || !body.Events[1].Time.Equal(t0.Add(4*time.Second)) ||
		body.Events[1].PredictedMs != 42 || body.Events[1].New.Compute != 0.5 {
		t.Errorf("events = %+v", body.Events)
	}
	for _, bad := range []string{"?since=yesterday", "?limit=0", "?limit=x", "?limit=100000"} {
		rec := restCall{method: http.MethodGet, path: "/v2/control/events" + bad}.do(t, t.Context(), h)
		if rec.Code != http.StatusBadRequest {
			t.Errorf("events%s: status %d, want 400", bad, rec.Code)
		}
		restErrorBody(t, rec)
	}
}

func TestPinShare(t *testing.T) {
	h, fb := newRESTTest(restLimits)
	rec := restCall{method: http.MethodPut, path: "/v2/models/sum/share", body: `{"compute": 0.3, "memory": "256MiB"}`}.do(t, t.Context(), h)
	if rec.Code != http.StatusOK {
		t.Fatalf("pin: %d %s", rec.Code, rec.Body)
	}
	if p := fb.pins["sum"]; p == nil || p.Compute != 0.3 || p.Memory != 256<<20 {
		t.Errorf("pinned %+v", p)
	}
	rec = restCall{method: http.MethodPut, path: "/v2/models/sum/share", body: `{"compute": 1, "memory": 1024}`}.do(t, t.Context(), h)
	if p := fb.pins["sum"]; rec.Code != http.StatusOK || p.Memory != 1024 {
		t.Errorf("pin with bytes: %d %+v", rec.Code, p)
	}
	rec = restCall{method: http.MethodDelete, path: "/v2/models/sum/share"}.do(t, t.Context(), h)
	if p, ok := fb.pins["sum"]; rec.Code != http.StatusOK || !ok || p != nil {
		t.Errorf("unpin: %d %+v", rec.Code, p)
	}
	for _, tc := range []struct {
		path, body string
		status     int
		msg        string
	}{
		{"/v2/models/sum/share", ``, 400, "empty body"},
		{"/v2/models/sum/share", `{}`, 400, `"compute" is required`},
		{"/v2/models/sum/share", `{"compute": 0}`, 400, "(0, 1]"},
		{"/v2/models/sum/share", `{"compute": 1.5}`, 400, "(0, 1]"},
		{"/v2/models/sum/share", `{"compute": "half"}`, 400, ""},
		{"/v2/models/sum/share", `{"compute": 0.5, "memory": -1}`, 400, "must be >= 0"},
		{"/v2/models/sum/share", `{"compute": 0.5, "memory": "lots"}`, 400, "memory"},
		{"/v2/models/sum/share", `{"compute": 0.5, "cpu": 1}`, 400, `unknown field "cpu"`},
		{"/v2/models/sum/share", `[0.5]`, 400, ""},
		{"/v2/models/sum/share", `{"compute": 0.5} {}`, 400, "after the request object"},
		{"/v2/models/nope/share", `{"compute": 0.5}`, 404, "nope"},
	} {
		rec := restCall{method: http.MethodPut, path: tc.path, body: tc.body}.do(t, t.Context(), h)
		if rec.Code != tc.status {
			t.Errorf("PUT %s %s: status %d, want %d (%s)", tc.path, tc.body, rec.Code, tc.status, rec.Body)
			continue
		}
		if msg := restErrorBody(t, rec); !strings.Contains(msg, tc.msg) {
			t.Errorf("PUT %s %s: error %q lacks %q", tc.path, tc.body, msg, tc.msg)
		}
	}
}
