package api

// Triton's logging extension over REST: GET /v2/logging reads the server's
// log settings and POST /v2/logging changes them while the server runs, as
// tritonclient's get_log_settings and update_log_settings call them
// (http/_client.py). sloserve has one log level; Triton's switches map onto
// it: log_verbose_level > 0 is debug, else log_info is info, else
// log_warning is warn, else log_error is error, and all off logs nothing.
// The log goes to standard error in the format log.format set at start, so
// log_file and log_format cannot change.

import (
	"log/slog"
	"net/http"

	"github.com/gin-gonic/gin"
)

// levelOff is a level above every record the server writes.
const levelOff = slog.LevelError + 4

// logSettingsJSON is the body of GET /v2/logging, in Triton's names.
type logSettingsJSON struct {
	LogFile         string `json:"log_file"`
	LogInfo         bool   `json:"log_info"`
	LogWarning      bool   `json:"log_warning"`
	LogError        bool   `json:"log_error"`
	LogVerboseLevel uint32 `json:"log_verbose_level"`
	LogFormat       string `json:"log_format"`
}

// logSettingsOf reads Triton's switches off a level.
func logSettingsOf(l slog.Level) logSettingsJSON {
	st := logSettingsJSON{LogFormat: "default", LogInfo: l <= slog.LevelInfo, LogWarning: l <= slog.LevelWarn, LogError: l <= slog.LevelError}
	if l <= slog.LevelDebug {
		st.LogVerboseLevel = 1
	}
	return st
}

// level is the level the switches of st ask for.
func (st logSettingsJSON) level() slog.Level {
	switch {
	case st.LogVerboseLevel > 0:
		return slog.LevelDebug
	case st.LogInfo:
		return slog.LevelInfo
	case st.LogWarning:
		return slog.LevelWarn
	case st.LogError:
		return slog.LevelError
	}
	return levelOff
}

func (s *restServer) logSettings(c *gin.Context) {
	s.writeValue(c, http.StatusOK, logSettingsOf(s.lim.LogLevel.Level()))
}

// updateLogSettings serves POST /v2/logging: only the settings given
// change, and the answer is the settings after the change.
func (s *restServer) updateLogSettings(c *gin.Context) {
	body, err := s.readJSONBody(c)
	if err != nil {
		s.writeError(c, err)
		return
	}
	var req struct {
		LogFile         *string `json:"log_file"`
		LogInfo         *bool   `json:"log_info"`
		LogWarning      *bool   `json:"log_warning"`
		LogError        *bool   `json:"log_error"`
		LogVerboseLevel *uint32 `json:"log_verbose_level"`
		LogFormat       *string `json:"log_format"`
	}
	if err := decodeJSONBody(body, &req, true); err != nil {
		s.writeError(c, err)
		return
	}
	switch {
	case req.LogFile != nil && *req.LogFile != "":
		s.writeError(c, restBadRequest("log_file cannot be set: the server logs to standard error, and writes to no path a request names"))
		return
	case req.LogFormat != nil && *req.LogFormat != "default":
		s.writeError(c, restBadRequest("log_format cannot change while the server runs (log.format is set at start), got %q", clipValue(*req.LogFormat)))
		return
	}
	st := logSettingsOf(s.lim.LogLevel.Level())
	set := func(dst *bool, v *bool) {
		if v != nil {
			*dst = *v
		}
	}
	set(&st.LogInfo, req.LogInfo)
	set(&st.LogWarning, req.LogWarning)
	set(&st.LogError, req.LogError)
	if req.LogVerboseLevel != nil {
		st.LogVerboseLevel = *req.LogVerboseLevel
	}
	next := st.level()
	s.lim.LogLevel.Set(next)
	s.logger.Info("log settings changed", "log_level", next.String())
	s.writeValue(c, http.StatusOK, logSettingsOf(next))
}
