package server

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/internal/syncbuf"
)

// A server with a REST listener but no models or a signal channel for reloads
// builds its devices at start, serves until its context ends (nothing
// that ends by itself, such as the reloads without signals, ends it), and
// then stops in its phases, in order, and returns nil.
func TestRunServesUntilCancelledThenStopsInPhases(t *testing.T) {
	cfg := configs.DefaultServer()
	cfg.Listen = configs.Listen{HTTP: "127.0.0.1:0"}
	cfg.Repositories = []string{t.TempDir()}
	cfg.Control.Limiter = "none"
	cfg.Control.Profile.CacheDir = t.TempDir()
	lib := filepath.Join(t.TempDir(), "libonnxruntime.so")
	os.WriteFile(lib, nil, 0o644)
	cfg.Runtime.ONNXRuntimeLibrary, cfg.Runtime.SocketDir = lib, t.TempDir()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	var logs syncbuf.Buffer
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg, slog.New(slog.NewTextHandler(&logs, nil)), Reloading{}) }()
	for !strings.Contains(logs.String(), `msg="server ready"`) {
		select {
		case err := <-done:
			t.Fatalf("Run returned %v before it was cancelled; log:\n%s", err, logs.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	log := logs.String()
	if strings.Contains(log, "stopping:") {
		t.Errorf("a component ended the run by itself:\n%s", log)
	}
	order := []string{`msg="device started" device=cpu`, `msg="server ready"`, `msg="shutting down"`, `msg="adjuster stopped"`, `msg=stopped`}
	at := -1
	for _, want := range order {
		i := strings.Index(log, want)
		if i < 0 || i < at {
			t.Fatalf("log lacks %q after the lines before it (%q); log:\n%s", want, order, log)
		}
		at = i
	}
}
