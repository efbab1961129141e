package api

// Triton's logging extension over REST and gRPC: GET /v2/logging and a
// LogSettings call without settings read the server's log settings; POST
// /v2/logging and a LogSettings call with settings change them while the
// server runs, as tritonclient's get_log_settings and update_log_settings
// call them (http/_client.py, grpc/_client.py). Both protocols share one
// implementation (changeLogSettings). sloserve has one log level; Triton's switches map onto
// it: log_verbose_level > 0 is debug, else log_info is info, else
// log_warning is warn, else log_error is error, and all off logs nothing.
// The log goes to standard error in the format log.format set at start, so
// log_file and log_format cannot change.

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"slices"

	"github.com/gin-gonic/gin"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
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

// logSettingsChange names the settings a request changes; nil leaves one
// as it is. REST and gRPC both decode into it.
type logSettingsChange struct {
	File, Format         *string
	Info, Warning, Error *bool
	VerboseLevel         *uint32
}

// changeLogSettings applies ch to the level lv and returns the settings
// after it. A log file or a format other than "default" is refused
// (errBadRequest) and nothing changes. A change that names a setting is
// logged at info, at the new level.
func changeLogSettings(lv *slog.LevelVar, logger *slog.Logger, ch logSettingsChange) (logSettingsJSON, error) {
	switch {
	case ch.File != nil && *ch.File != "":
		return logSettingsJSON{}, fmt.Errorf("%w: log_file cannot be set: the server logs to standard error, and writes to no path a request names", errBadRequest)
	case ch.Format != nil && *ch.Format != "default":
		return logSettingsJSON{}, fmt.Errorf("%w: log_format cannot change while the server runs (log.format is set at start), got %q", errBadRequest, clipValue(*ch.Format))
	}
	st := logSettingsOf(lv.Level())
	if ch == (logSettingsChange{}) {
		return st, nil
	}
	set := func(dst *bool, v *bool) {
		if v != nil {
			*dst = *v
		}
	}
	set(&st.LogInfo, ch.Info)
	set(&st.LogWarning, ch.Warning)
	set(&st.LogError, ch.Error)
	if ch.VerboseLevel != nil {
		st.LogVerboseLevel = *ch.VerboseLevel
	}
	next := st.level()
	lv.Set(next)
	logger.Info("log settings changed", "log_level", next.String())
	return logSettingsOf(next), nil
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
	st, err := changeLogSettings(s.lim.LogLevel, s.logger, logSettingsChange{
		File: req.LogFile, Format: req.LogFormat,
		Info: req.LogInfo, Warning: req.LogWarning, Error: req.LogError,
		VerboseLevel: req.LogVerboseLevel,
	})
	if err != nil {
		s.writeError(c, err)
		return
	}
	s.writeValue(c, http.StatusOK, st)
}

// LogSettings serves Triton's logging extension over gRPC, as
// tritonclient.grpc's get_log_settings (no settings: a read) and
// update_log_settings (grpc/_client.py: log_file and log_format as
// string_param, log_verbose_level as uint32_param, the others as
// bool_param; a setting given as None has no value and stays as it is)
// call it. The answer holds every setting after the change, typed so.
func (s *grpcService) LogSettings(ctx context.Context, req *inference.LogSettingsRequest) (*inference.LogSettingsResponse, error) {
	if s.lim.LogLevel == nil {
		return nil, status.Error(codes.Unimplemented, "the logging extension is off")
	}
	ch, err := grpcLogSettingsChange(req.GetSettings())
	if err == nil {
		var st logSettingsJSON
		if st, err = changeLogSettings(s.lim.LogLevel, s.logger, ch); err == nil {
			return grpcLogSettings(st), nil
		}
	}
	return nil, s.grpcError("LogSettings", err)
}

// grpcLogSettingsChange reads a LogSettings request's settings; a setting
// sloserve does not know, or one of the wrong type, is errBadRequest.
func grpcLogSettingsChange(settings map[string]*inference.LogSettingsRequest_SettingValue) (logSettingsChange, error) {
	var ch logSettingsChange
	keys := slices.Sorted(maps.Keys(settings))
	for _, k := range keys {
		v := settings[k].GetParameterChoice()
		if v == nil {
			continue
		}
		var ok bool
		switch k {
		case "log_file", "log_format":
			var p *inference.LogSettingsRequest_SettingValue_StringParam
			if p, ok = v.(*inference.LogSettingsRequest_SettingValue_StringParam); ok {
				if k == "log_file" {
					ch.File = &p.StringParam
				} else {
					ch.Format = &p.StringParam
				}
			}
		case "log_verbose_level":
			var p *inference.LogSettingsRequest_SettingValue_Uint32Param
			if p, ok = v.(*inference.LogSettingsRequest_SettingValue_Uint32Param); ok {
				ch.VerboseLevel = &p.Uint32Param
			}
		case "log_info", "log_warning", "log_error":
			var p *inference.LogSettingsRequest_SettingValue_BoolParam
			if p, ok = v.(*inference.LogSettingsRequest_SettingValue_BoolParam); ok {
				dst := map[string]**bool{"log_info": &ch.Info, "log_warning": &ch.Warning, "log_error": &ch.Error}[k]
				*dst = &p.BoolParam
			}
		default:
			return ch, fmt.Errorf("%w: unknown log setting %q (Triton's are log_file, log_info, log_warning, log_error, log_verbose_level, log_format)",
				errBadRequest, clipValue(k))
		}
		if !ok {
			return ch, fmt.Errorf("%w: log setting %q must be a %s", errBadRequest, k, logSettingTypes[k])
		}
	}
	return ch, nil
}

// logSettingTypes is the parameter each setting is sent as.
var logSettingTypes = map[string]string{
	"log_file": "string_param", "log_format": "string_param", "log_verbose_level": "uint32_param",
	"log_info": "bool_param", "log_warning": "bool_param", "log_error": "bool_param",
}

// grpcLogSettings is st as a LogSettings response.
func grpcLogSettings(st logSettingsJSON) *inference.LogSettingsResponse {
	str := func(v string) *inference.LogSettingsResponse_SettingValue {
		return &inference.LogSettingsResponse_SettingValue{ParameterChoice: &inference.LogSettingsResponse_SettingValue_StringParam{StringParam: v}}
	}
	boolean := func(v bool) *inference.LogSettingsResponse_SettingValue {
		return &inference.LogSettingsResponse_SettingValue{ParameterChoice: &inference.LogSettingsResponse_SettingValue_BoolParam{BoolParam: v}}
	}
	return &inference.LogSettingsResponse{Settings: map[string]*inference.LogSettingsResponse_SettingValue{
		"log_file":    str(st.LogFile),
		"log_info":    boolean(st.LogInfo),
		"log_warning": boolean(st.LogWarning),
		"log_error":   boolean(st.LogError),
		"log_verbose_level": {ParameterChoice: &inference.LogSettingsResponse_SettingValue_Uint32Param{
			Uint32Param: st.LogVerboseLevel}},
		"log_format": str(st.LogFormat),
	}}
}
