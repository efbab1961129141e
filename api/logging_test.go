package api

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// logCall sends one request to h from remote, as tritonclient.http does:
// no Content-Type.
func logCall(h http.Handler, method, body, remote string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, "/v2/logging", strings.NewReader(body))
	req.RemoteAddr, req.Host = remote, "127.0.0.1:8000"
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// TestRESTLogging: tritonclient's get_log_settings and update_log_settings
// (http/_client.py: GET, and POST of json.dumps(settings) with no
// Content-Type) read and change the server's log level; only the given
// settings change; a log file or another format is refused; the change is
// an admin call.
func TestRESTLogging(t *testing.T) {
	level := new(slog.LevelVar)
	lim := restLimits
	lim.LogLevel = level
	auth, _ := newTestAuth(t, AuthOptions{})
	h := NewREST(newFakeBackend(), lim, nil, auth.REST())
	get := func() string {
		rec := logCall(h, "GET", "", "192.0.2.1:1234")
		if rec.Code != 200 {
			t.Fatalf("GET: %d %s", rec.Code, rec.Body)
		}
		return rec.Body.String()
	}
	if got, want := get(), `{"log_file":"","log_info":true,"log_warning":true,"log_error":true,"log_verbose_level":0,"log_format":"default"}`; got != want {
		t.Fatalf("settings %s, want %s", got, want)
	}
	for _, tc := range []struct {
		body  string
		level slog.Level
	}{
		{`{"log_verbose_level": 1}`, slog.LevelDebug},
		{`{"log_verbose_level": 0, "log_info": false}`, slog.LevelWarn},
		{`{"log_warning": false}`, slog.LevelError},
		{`{"log_error": false}`, levelOff},
		{`{"log_info": true}`, slog.LevelInfo},
	} {
		rec := logCall(h, "POST", tc.body, loopbackPeer)
		if rec.Code != 200 || level.Level() != tc.level {
			t.Fatalf("POST %s: %d %s, level %v, want %v", tc.body, rec.Code, rec.Body, level.Level(), tc.level)
		}
		if rec.Body.String() != get() {
			t.Fatalf("POST answered %s, GET %s", rec.Body, get())
		}
	}
	for _, tc := range []struct{ body, msg string }{
		{`{"log_file": "/etc/passwd"}`, "log_file cannot be set"},
		{`{"log_format": "ISO8601"}`, "log_format cannot change"},
		{`{"log_info": "yes"}`, "log_info"},
		{`{"log_level": 3}`, "log_level"},
	} {
		wantREST(t, logCall(h, "POST", tc.body, loopbackPeer), 400, tc.msg)
	}
	// An admin call: from the network it is refused without an admin token.
	rec := logCall(h, "POST", `{"log_info": false}`, "10.0.0.1:5000")
	if rec.Code != 403 || level.Level() != slog.LevelInfo {
		t.Fatalf("POST from the network: %d %s", rec.Code, rec.Body)
	}
	if rec := logCall(NewREST(newFakeBackend(), restLimits, nil), "GET", "", loopbackPeer); rec.Code != 404 {
		t.Fatalf("without a level the extension is off: %d", rec.Code)
	}
}
