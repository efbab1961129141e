package api

import (
	"encoding/json"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/limiter"
)

// The control API (sloserve's own, beside the OIP routes) shows what the
// control loop does and lets an operator pin a model's share:
//
//	GET    /v2/control                  policy, limiters, every model's share and predictions
//	GET    /v2/control/events           the adjuster's decisions (?since=RFC 3339 time, ?limit=N)
//	PUT    /v2/models/{m}/share         pin {"compute": 0.3, "memory": "256MiB"}
//	DELETE /v2/models/{m}/share         unpin: the policy decides again

// ControlStatus is the control loop's state.
type ControlStatus struct {
	Policy  string          `json:"policy"`
	Period  string          `json:"period"`
	Devices []DeviceControl `json:"devices"`
}

// DeviceControl is one execution device's limiter and models.
type DeviceControl struct {
	Device        string         `json:"device"`
	Limiter       string         `json:"limiter"`        // cgroup-v2, cgroup-v1, mps or none
	LimiterDetail string         `json:"limiter_detail"` // what is enforced where, and why
	CPUs          int            `json:"cpus"`           // compute units a share is a fraction of
	Models        []ModelControl `json:"models"`
}

// ModelControl is one model version's share and what the predictor
// believes about it. Durations are in milliseconds.
type ModelControl struct {
	Model        string  `json:"model"` // model/version
	Class        string  `json:"class"`
	SLOms        float64 `json:"slo_ms"`
	ComputeShare float64 `json:"compute_share"` // 0 = no limit
	MemoryShare  int64   `json:"memory_share_bytes"`
	TargetShare  float64 `json:"target_compute_share"`
	// PendingShare is a compute share asked for whose replacement
	// TargetMemory is the memory share the adjuster wanted, from the
	// model's working set (0: not sized); MemoryReason why it last moved.
	TargetMemory int64  `json:"target_memory_bytes"`
	MemoryReason string `json:"memory_reason,omitempty"`
	// instances are still starting; absent when none.
	PendingShare      *float64 `json:"pending_compute_share,omitempty"`
	Source            string   `json:"source"` // adaptive, static, shared, pinned, config
	Pinned            bool     `json:"pinned"`
	ForecastRate      float64  `json:"forecast_rate"` // requests/s
	ObservedRate      float64  `json:"observed_rate"`
	Attainment        float64  `json:"attainment"`
	PredictedMs       float64  `json:"predicted_latency_ms"` // mean prediction of recent executions
	ObservedMs        float64  `json:"observed_latency_ms"`  // mean observed execution time
	MAPE              float64  `json:"mape"`                 // of recent executions
	MAPEFloor         float64  `json:"mape_floor"`           // least MAPE of one time per bucket in hindsight: jitter
	ProfileMAPE       float64  `json:"profile_mape"`         // of the fitted curve on its profile
	Correction        float64  `json:"correction"`           // online correction factor
	Interference      float64  `json:"interference"`
	PlannedLatencyMs  float64  `json:"planned_latency_ms"` // what the adjuster predicted at the chosen share
	PredictionSamples int      `json:"prediction_samples"`
	MemoryUsedBytes   int64    `json:"memory_used_bytes"`
	ThrottledSeconds  float64  `json:"throttled_seconds"`
	CPUSeconds        float64  `json:"cpu_seconds"`
	// Risky says why the model must be kept apart from latency-critical
	// models (control.Isolation: its client faulted its GPU repeatedly);
	// empty when it need not.
	Risky string `json:"risky,omitempty"`
}

// eventJSON is one adjuster decision.
type eventJSON struct {
	Time         time.Time `json:"time"`
	Device       string    `json:"device"`
	Model        string    `json:"model"`
	Kind         string    `json:"kind"`
	Old          shareJSON `json:"old"`
	New          shareJSON `json:"new"`
	Reason       string    `json:"reason"`
	PredictedMs  float64   `json:"predicted_latency_ms"`
	ForecastRate float64   `json:"forecast_rate"`
}

type shareJSON struct {
	Compute float64 `json:"compute"`
	Memory  int64   `json:"memory_bytes"`
}

func toShareJSON(s limiter.Share) shareJSON { return shareJSON{Compute: s.Compute, Memory: s.Memory} }

// toEventsJSON converts adjuster events for the wire.
func toEventsJSON(events []control.Event) []eventJSON {
	out := make([]eventJSON, len(events))
	for i, e := range events {
		out[i] = eventJSON{
			Time: e.Time, Device: e.Device, Model: e.Model, Kind: e.Kind,
			Old: toShareJSON(e.Old), New: toShareJSON(e.New), Reason: e.Reason,
			PredictedMs: Milliseconds(e.Predicted), ForecastRate: e.ForecastRate,
		}
	}
	return out
}

// Milliseconds converts a duration for the control API.
func Milliseconds(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// maxEvents bounds one events answer.
const maxEvents = 10000

func (s *restServer) control(c *gin.Context) {
	s.writeValue(c, http.StatusOK, s.b.Control())
}

func (s *restServer) controlEvents(c *gin.Context) {
	var since time.Time
	if v := c.Query("since"); v != "" {
		t, err := time.Parse(time.RFC3339Nano, v)
		if err != nil {
			s.writeError(c, restBadRequest("since: want an RFC 3339 time such as 2026-11-21T10:00:00Z, got %q", v))
			return
		}
		since = t
	}
	limit := 100
	if v := c.Query("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxEvents {
			s.writeError(c, restBadRequest("limit: want a number from 1 to %d, got %q", maxEvents, v))
			return
		}
		limit = n
	}
	out := toEventsJSON(s.b.ControlEvents(since, limit))
	s.writeValue(c, http.StatusOK, map[string]any{"events": out})
}

// pinShare serves PUT /v2/models/{m}/share.
func (s *restServer) pinShare(c *gin.Context) {
	body, err := s.readJSONBody(c)
	if err != nil {
		s.writeError(c, err)
		return
	}
	var req struct {
		Compute *float64         `json:"compute"`
		Memory  *json.RawMessage `json:"memory"`
	}
	if len(body) == 0 {
		s.writeError(c, restBadRequest("empty body: want a JSON object"))
		return
	}
	if err := decodeJSONBody(body, &req, true); err != nil {
		s.writeError(c, err)
		return
	}
	if req.Compute == nil {
		s.writeError(c, restBadRequest(`"compute" is required: a fraction of the device in (0, 1]`))
		return
	}
	if v := *req.Compute; math.IsNaN(v) || v <= 0 || v > 1 {
		s.writeError(c, restBadRequest("compute: want a fraction of the device in (0, 1], got %v", v))
		return
	}
	pin := limiter.Share{Compute: *req.Compute}
	if req.Memory != nil {
		m, err := parseMemory(*req.Memory)
		if err != nil {
			s.writeError(c, err)
			return
		}
		pin.Memory = m
	}
	if err := s.b.PinShare(c.Request.Context(), c.Param("model"), &pin); err != nil {
		s.writeError(c, err)
		return
	}
	s.writeValue(c, http.StatusOK, toShareJSON(pin))
}

// unpinShare serves DELETE /v2/models/{m}/share.
func (s *restServer) unpinShare(c *gin.Context) {
	if err := s.b.PinShare(c.Request.Context(), c.Param("model"), nil); err != nil {
		s.writeError(c, err)
		return
	}
	writeRESTBody(c, http.StatusOK, "application/json", []byte("{}"))
}

// parseMemory reads a memory size: bytes as a JSON number, or a string with
// a unit as in config files ("256MiB").
func parseMemory(raw json.RawMessage) (int64, error) {
	var n int64
	if err := json.Unmarshal(raw, &n); err == nil {
		if n < 0 {
			return 0, restBadRequest("memory: must be >= 0, got %d", n)
		}
		return n, nil
	}
	var text string
	if err := json.Unmarshal(raw, &text); err != nil {
		return 0, restBadRequest(`memory: want bytes or a size such as "256MiB", got %s`, raw)
	}
	b, err := configs.ParseByteSize(text)
	if err != nil {
		return 0, restBadRequest("memory: %v", err)
	}
	return int64(b), nil
}
