package main

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"path/filepath"
	goruntime "runtime"
	rpprof "runtime/pprof"
	"time"
)

// Profiling, off unless asked for: `serve --pprof-addr ADDR` serves Go's
// /debug/pprof/ handlers on a listener of their own (never on the API or
// metrics ports: the profiles show request contents' sizes and the code's
// layout to whoever reaches them), and a runner started with
// SLOSERVE_RUNNER_PROFILE_DIR in its environment (the server's runners
// inherit it) writes its CPU, block and mutex profiles there when it
// stops. Both record blocking and lock contention, which costs a little on
// every channel operation and lock, so neither belongs in production.

// runnerProfileEnv names the folder runners write their profiles to.
const runnerProfileEnv = "SLOSERVE_RUNNER_PROFILE_DIR"

// profileRates turns on the block and mutex profiles: every blocking event
// of a microsecond or more, a fifth of lock contentions.
func profileRates() {
	goruntime.SetBlockProfileRate(int(time.Microsecond))
	goruntime.SetMutexProfileFraction(5)
}

// servePprof serves /debug/pprof/ on addr until ctx ends.
func servePprof(addr string, logger *slog.Logger) (stop func(), err error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--pprof-addr: %w", err)
	}
	profileRates()
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("pprof listener", "err", err)
		}
	}()
	logger.Warn("serving Go profiles; not for production", "addr", lis.Addr().String())
	return func() {
		_ = srv.Close()
		<-done
	}, nil
}

// profileRunner starts a runner's profiles when SLOSERVE_RUNNER_PROFILE_DIR
// is set; the returned function writes them as
// runner-PID.{cpu,block,mutex}.pprof.
func profileRunner(logger *slog.Logger) func() {
	dir := os.Getenv(runnerProfileEnv)
	if dir == "" {
		return func() {}
	}
	base := filepath.Join(dir, fmt.Sprintf("runner-%d", os.Getpid()))
	cpu, err := os.Create(base + ".cpu.pprof")
	if err != nil {
		logger.Error("runner profile", "err", err)
		return func() {}
	}
	if err := rpprof.StartCPUProfile(cpu); err != nil {
		logger.Error("runner profile", "err", err)
		cpu.Close()
		return func() {}
	}
	profileRates()
	return func() {
		rpprof.StopCPUProfile()
		cpu.Close()
		for _, name := range []string{"block", "mutex"} {
			f, err := os.Create(base + "." + name + ".pprof")
			if err != nil {
				logger.Error("runner profile", "err", err)
				continue
			}
			if err := rpprof.Lookup(name).WriteTo(f, 0); err != nil {
				logger.Error("runner profile", "err", err)
			}
			f.Close()
		}
	}
}
