package api

import (
	"context"
	"fmt"
	"net/http"
	"testing"

	"github.com/sloserve/sloserve/configs"
)

func TestRESTConfigReload(t *testing.T) {
	for _, tc := range []struct {
		name     string
		result   ReloadResult
		err      error
		wantCode int
		wantBody string // JSON, or the error text
	}{
		{
			name:     "applied and restart needed",
			result:   ReloadResult{Applied: []string{"poll_interval"}, RestartNeeded: []string{"listen.http"}},
			wantCode: http.StatusOK,
			wantBody: `{"reloaded":true,"applied":["poll_interval"],"restart_needed":["listen.http"]}`,
		},
		{
			name:     "nothing changed",
			wantCode: http.StatusOK,
			wantBody: `{"reloaded":true,"applied":[],"restart_needed":[]}`,
		},
		{
			name:     "invalid config",
			err:      fmt.Errorf("%w: server.yaml: poll_interval: must be > 0, got 0s", configs.ErrInvalid),
			wantCode: http.StatusBadRequest,
			wantBody: "invalid config: server.yaml: poll_interval: must be > 0, got 0s",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, fb := newRESTTest(restLimits)
			fb.reloadResult, fb.reloadErr = tc.result, tc.err
			rec := restCall{path: "/v2/config/reload"}.do(t, context.Background(), h)
			if rec.Code != tc.wantCode {
				t.Fatalf("status %d, want %d: %s", rec.Code, tc.wantCode, rec.Body)
			}
			if tc.err != nil {
				if got := restErrorBody(t, rec); got != tc.wantBody {
					t.Errorf("error %q, want %q", got, tc.wantBody)
				}
			} else if !jsonEqual(t, rec.Body.Bytes(), []byte(tc.wantBody)) {
				t.Errorf("body %s, want %s", rec.Body, tc.wantBody)
			}
			if fb.reloads != 1 {
				t.Errorf("%d reloads, want 1", fb.reloads)
			}
		})
	}
	h, _ := newRESTTest(restLimits)
	if rec := (restCall{method: http.MethodGet, path: "/v2/config/reload"}).do(t, context.Background(), h); rec.Code != http.StatusMethodNotAllowed {
		t.Errorf("GET: status %d, want 405", rec.Code)
	}
}
