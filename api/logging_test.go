package api

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
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

// grpcLogRequest builds a LogSettings request as tritonclient.grpc's
// update_log_settings does: log_file and log_format as string_param,
// log_verbose_level as uint32_param, the others as bool_param, and a
// setting given as None with no value.
func grpcLogRequest(settings map[string]any) *inference.LogSettingsRequest {
	req := &inference.LogSettingsRequest{Settings: map[string]*inference.LogSettingsRequest_SettingValue{}}
	for k, v := range settings {
		sv := &inference.LogSettingsRequest_SettingValue{}
		switch v := v.(type) {
		case string:
			sv.ParameterChoice = &inference.LogSettingsRequest_SettingValue_StringParam{StringParam: v}
		case uint32:
			sv.ParameterChoice = &inference.LogSettingsRequest_SettingValue_Uint32Param{Uint32Param: v}
		case bool:
			sv.ParameterChoice = &inference.LogSettingsRequest_SettingValue_BoolParam{BoolParam: v}
		}
		req.Settings[k] = sv
	}
	return req
}

// grpcLogSettingsText writes a LogSettings response as the REST body's
// JSON would be, to compare the two protocols' answers.
func grpcLogSettingsText(t *testing.T, resp *inference.LogSettingsResponse) string {
	t.Helper()
	st := resp.GetSettings()
	if len(st) != 6 {
		t.Fatalf("%d settings, want Triton's 6: %v", len(st), st)
	}
	b, err := json.Marshal(logSettingsJSON{
		LogFile: st["log_file"].GetStringParam(), LogInfo: st["log_info"].GetBoolParam(),
		LogWarning: st["log_warning"].GetBoolParam(), LogError: st["log_error"].GetBoolParam(),
		LogVerboseLevel: st["log_verbose_level"].GetUint32Param(), LogFormat: st["log_format"].GetStringParam(),
	})
	if err != nil {
		t.Fatal(err)
	}
	for k, typ := range logSettingTypes {
		var ok bool
		switch typ {
		case "string_param":
			_, ok = st[k].GetParameterChoice().(*inference.LogSettingsResponse_SettingValue_StringParam)
		case "uint32_param":
			_, ok = st[k].GetParameterChoice().(*inference.LogSettingsResponse_SettingValue_Uint32Param)
		case "bool_param":
			_, ok = st[k].GetParameterChoice().(*inference.LogSettingsResponse_SettingValue_BoolParam)
		}
		if !ok {
			t.Errorf("%s is %T, want a %s", k, st[k].GetParameterChoice(), typ)
		}
	}
	return string(b)
}

// TestGRPCLogging: tritonclient.grpc's get_log_settings and
// update_log_settings read and change the level REST's /v2/logging reads
// and changes; only the given settings change; wrong types, unknown
// settings, a log file or another format are INVALID_ARGUMENT and change
// nothing.
func TestGRPCLogging(t *testing.T) {
	level := new(slog.LevelVar)
	lim := restLimits
	lim.LogLevel = level
	var log bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: level}))
	client := inference.NewGRPCInferenceServiceClient(serveGRPC(t, NewGRPC(newFakeBackend(), lim, logger)))
	rest := NewREST(newFakeBackend(), lim, nil)
	restGet := func() string {
		rec := logCall(rest, "GET", "", loopbackPeer)
		if rec.Code != 200 {
			t.Fatalf("GET: %d %s", rec.Code, rec.Body)
		}
		return rec.Body.String()
	}
	call := func(settings map[string]any) (string, error) {
		resp, err := client.LogSettings(t.Context(), grpcLogRequest(settings))
		if err != nil {
			return "", err
		}
		return grpcLogSettingsText(t, resp), nil
	}
	got, err := call(nil)
	if want := `{"log_file":"","log_info":true,"log_warning":true,"log_error":true,"log_verbose_level":0,"log_format":"default"}`; err != nil || got != want {
		t.Fatalf("settings %s (%v), want %s", got, err, want)
	}
	for _, tc := range []struct {
		settings map[string]any
		level    slog.Level
	}{
		{map[string]any{"log_verbose_level": uint32(1)}, slog.LevelDebug},
		{map[string]any{"log_verbose_level": uint32(0), "log_info": false}, slog.LevelWarn},
		{map[string]any{"log_warning": false, "log_file": nil}, slog.LevelError}, // None: unchanged
		{map[string]any{"log_error": false}, levelOff},
		{map[string]any{"log_info": true, "log_file": "", "log_format": "default"}, slog.LevelInfo},
	} {
		got, err := call(tc.settings)
		if err != nil || level.Level() != tc.level {
			t.Fatalf("%v: %v, level %v, want %v", tc.settings, err, level.Level(), tc.level)
		}
		if rest := restGet(); got != rest {
			t.Fatalf("%v: gRPC answered %s, REST reads %s", tc.settings, got, rest)
		}
		if read, _ := call(nil); read != got {
			t.Fatalf("%v: answered %s, then read %s", tc.settings, got, read)
		}
	}
	if n := strings.Count(log.String(), `msg="log settings changed" component=grpc`); n != 2 {
		t.Errorf("%d changes logged, want 2 (to debug, then to info; the others were above info):\n%s", n, log.String())
	}
	for _, tc := range []struct {
		settings map[string]any
		msg      string
	}{
		{map[string]any{"log_file": "/etc/passwd"}, "log_file cannot be set"},
		{map[string]any{"log_format": "ISO8601", "log_info": false}, "log_format cannot change"},
		{map[string]any{"log_info": "yes"}, `log setting "log_info" must be a bool_param`},
		{map[string]any{"log_verbose_level": true}, `"log_verbose_level" must be a uint32_param`},
		{map[string]any{"log_file": uint32(1)}, `"log_file" must be a string_param`},
		{map[string]any{"log_level": uint32(3), "log_info": false}, `unknown log setting "log_level"`},
	} {
		_, err := call(tc.settings)
		wantGRPCCode(t, err, codes.InvalidArgument, tc.msg)
		if level.Level() != slog.LevelInfo {
			t.Fatalf("%v changed the level to %v", tc.settings, level.Level())
		}
	}

	off := inference.NewGRPCInferenceServiceClient(startGRPC(t, newFakeBackend(), restLimits))
	_, err = off.LogSettings(t.Context(), &inference.LogSettingsRequest{})
	wantGRPCCode(t, err, codes.Unimplemented, "logging extension is off")
}

// A LogSettings call that changes a setting is an admin call, as POST
// /v2/logging is; one that reads them needs what GET /v2/logging needs.
func TestGRPCLoggingAuth(t *testing.T) {
	a, _ := newTestAuth(t, AuthOptions{InferenceToken: testInferenceToken})
	remote := &net.TCPAddr{IP: net.ParseIP("192.0.2.7"), Port: 40000}
	local := &net.TCPAddr{IP: net.ParseIP("127.0.0.1"), Port: 40000}
	for _, tc := range []struct {
		name string
		req  *inference.LogSettingsRequest
		addr net.Addr
		code codes.Code
	}{
		{"read, remote", grpcLogRequest(nil), remote, codes.OK},
		{"change, remote", grpcLogRequest(map[string]any{"log_info": false}), remote, codes.PermissionDenied},
		{"change to nothing, remote", grpcLogRequest(map[string]any{"log_info": nil}), remote, codes.PermissionDenied},
		{"change, local", grpcLogRequest(map[string]any{"log_info": false}), local, codes.OK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := peer.NewContext(t.Context(), &peer.Peer{Addr: tc.addr})
			ctx = metadata.NewIncomingContext(ctx, metadata.Pairs("authorization", "Bearer "+testInferenceToken))
			_, err := a.UnaryInterceptor()(ctx, tc.req, &grpc.UnaryServerInfo{FullMethod: inference.GRPCInferenceService_LogSettings_FullMethodName},
				func(context.Context, any) (any, error) { return "ok", nil })
			if got := status.Code(err); got != tc.code {
				t.Fatalf("code %v (%v), want %v", got, err, tc.code)
			}
		})
	}
}
