package api

import (
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/sloserve/sloserve/dashboard"
)

// The dashboard (sloserve's own, beside the OIP routes): the page and the
// JSON it reads.
//
//	GET /dashboard/                  the page (embedded files)
//	GET /v2/dashboard                every model's current state, the devices' shares, recent events
//	GET /v2/dashboard/models/{m}     one model's history (?last=seconds, ?since=unix seconds, ?version=N)

// dashboardJSON is the overview: the recorder's models and device split
// with the server's state and the adjusters' recent decisions.
type dashboardJSON struct {
	dashboard.Overview
	Version string      `json:"version"`
	Ready   bool        `json:"ready"`
	Events  []eventJSON `json:"events"`
}

// historyJSON is one model's history with its events.
type historyJSON struct {
	dashboard.History
	Events []eventJSON `json:"events"`
}

// dashboardEvents is how many recent events the overview carries.
const dashboardEvents = 50

func (s *restServer) dashboardPage(c *gin.Context) {
	c.Redirect(http.StatusFound, "/dashboard/")
}

// dashboardFiles serves the page's embedded files. The page loads nothing
// from other origins, and the policy says so to the browser.
func dashboardFiles() gin.HandlerFunc {
	files := http.StripPrefix("/dashboard", http.FileServerFS(dashboard.Assets()))
	return func(c *gin.Context) {
		h := c.Writer.Header()
		h.Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'")
		h.Set("Cache-Control", "no-cache")
		h.Set("X-Content-Type-Options", "nosniff")
		files.ServeHTTP(c.Writer, c.Request)
	}
}

func (s *restServer) dashboardOverview(c *gin.Context) {
	rec := s.b.Dashboard()
	if rec == nil {
		s.writeErrorStatus(c, http.StatusNotFound, "the dashboard is disabled (dashboard.enabled: false)")
		return
	}
	out := dashboardJSON{
		Overview: rec.Overview(), Version: s.b.ServerVersion(), Ready: s.b.Ready(),
		Events: toEventsJSON(s.b.ControlEvents(time.Time{}, dashboardEvents)),
	}
	s.writeValue(c, http.StatusOK, out)
}

func (s *restServer) dashboardHistory(c *gin.Context) {
	rec := s.b.Dashboard()
	if rec == nil {
		s.writeErrorStatus(c, http.StatusNotFound, "the dashboard is disabled (dashboard.enabled: false)")
		return
	}
	retention := time.Duration(rec.Options().Retention)
	last := 15 * time.Minute
	if v := c.Query("last"); v != "" {
		n, err := strconv.ParseFloat(v, 64)
		if err != nil || !(n > 0) || n > retention.Seconds() {
			s.writeError(c, restBadRequest("last: want seconds of history from 1 to %.0f (the retention), got %q", retention.Seconds(), v))
			return
		}
		last = time.Duration(n * float64(time.Second))
	}
	var since time.Time
	if v := c.Query("since"); v != "" {
		n, err := strconv.ParseFloat(v, 64)
		if err != nil || !(n >= 0 && n <= 1e11) {
			s.writeError(c, restBadRequest("since: want unix seconds such as 1763719200.5, got %q", v))
			return
		}
		since = time.UnixMilli(int64(n * 1000))
	}
	h, err := rec.History(c.Param("model"), c.Query("version"), since, last)
	if errors.Is(err, dashboard.ErrUnknownModel) {
		s.writeErrorStatus(c, http.StatusNotFound, err.Error())
		return
	}
	if err != nil {
		s.writeError(c, err)
		return
	}
	// The model's events since the poll before (when polling), else within
	// the span of the points.
	out := historyJSON{History: h, Events: []eventJSON{}}
	from := since
	if from.IsZero() && len(h.Series.T) > 0 {
		from = time.UnixMilli(int64(h.Series.T[0] * 1000))
	}
	if !from.IsZero() {
		// Share events name the version ("model/N"); placement events
		// name the model.
		name, _, _ := strings.Cut(h.Key, "/")
		for _, e := range toEventsJSON(s.b.ControlEvents(from, maxEvents)) {
			if e.Model == h.Key || e.Model == name {
				out.Events = append(out.Events, e)
			}
		}
	}
	s.writeValue(c, http.StatusOK, out)
}
