// Package server is the composition root: it takes the server config, wires
// the model registry, the runner processes and the protocol handlers
// together, and runs them until the context ends, then stops them in reverse
// order.
//
// It owns the lifecycle: components start in order and stop in reverse,
// the config is reloaded on SIGHUP or request, and shutdown drains in
// stages; on simulated GPUs it brings a device back after a fault (its
// daemon, then its instances, latency-critical first: recovery.go), which is
// lifecycle too. It must not implement serving, scheduling or control
// itself: those belong to the packages it wires, and only cmd/sloserve may
// import server.
package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/dashboard"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/predictor"
)

// Version is the sloserve version, set at build time with -ldflags.
var Version = "dev"

// Run serves until ctx is cancelled, then shuts down gracefully: readiness
// turns false, listeners stop accepting, admitted requests finish within the
// grace period, and the runners stop. It rereads the config as rl says.
func Run(ctx context.Context, cfg *configs.Server, logger *slog.Logger, rl Reloading) error {
	cfg, keepStaged, unstage, staged, err := singleModel(cfg)
	if err != nil {
		return err
	}
	defer unstage()
	if load := rl.Load; load != nil {
		rl.Load = func() (*configs.Server, error) {
			next, err := load()
			if err == nil {
				keepStaged(next)
			}
			return next, err
		}
	}
	runners, cleanup, err := newRunnerFactory(cfg.Runtime, logger)
	if err != nil {
		return err
	}
	defer cleanup()
	sim, err := newSimulator(cfg.GPU, logger)
	if err != nil {
		return err
	}
	runners.sim = sim

	promReg := prometheus.NewRegistry()
	if err := promReg.Register(collectors.NewGoCollector()); err != nil {
		return err
	}
	if err := promReg.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})); err != nil {
		return err
	}

	// The schedulers' loops outlive ctx: they stop (and are waited for)
	// only after the registry has drained, when Run returns.
	loopCtx, stopLoops := context.WithCancel(context.WithoutCancel(ctx))
	devs, err := newDevices(loopCtx, cfg, promReg, logger)
	if err != nil {
		stopLoops()
		return err
	}
	devs.sim = sim
	if sim != nil {
		devs.rec = newRecovery(loopCtx, simulatedDomains(sim), devs.daemonOf, logger.With("component", "recovery"))
		runners.rec = devs.rec
	}
	defer devs.wait()
	defer devs.rec.stop() // after stopLoops has ended loopCtx
	defer stopLoops()
	prof := &profiler{
		cfg:   cfg.Control.Profile,
		cache: predictor.Cache{Dir: profileCacheDir(cfg.Control.Profile.CacheDir)},
		pred:  devs.pred,
		lib:   runners.library,
		log:   logger.With("component", "predictor"),
		sim:   sim,
	}
	opts := models.Options{
		Repositories:      cfg.Repositories,
		Control:           cfg.ModelControl,
		PollInterval:      cfg.PollInterval,
		StartupModels:     cfg.StartupModels,
		MaxTensorElements: cfg.Limits.MaxTensorElements,
		MaxBatchSize:      cfg.Limits.MaxBatchSize,
		DrainTimeout:      cfg.Limits.GracePeriod,
		CallTimeout:       cfg.Runtime.CallTimeout,
		NewInstance:       runners.start,
		Logger:            logger.With("component", "models"),
		Registerer:        promReg,
		Scheduler:         devs.scheduler,
		Estimator:         devs.pred,
		Limiter:           devs.limiter,
		Forget:            devs.pred.Forget,
	}
	if cfg.Control.Profile.Enabled {
		opts.Profile = prof.run
	}
	place, err := newPlacement(cfg.GPU.Placement, devs, logger)
	if err != nil {
		return err
	}
	if place != nil {
		opts.Place = place.place
		if devs.rec != nil {
			// Placement keeps risky best-effort models apart, in place of
			// the recovery.
			place.setRisky(devs.rec.isolation)
			devs.rec.placed = true
		}
	}
	reg, err := models.New(opts)
	if err != nil {
		return err
	}
	devs.registry = reg
	if place != nil {
		// Placement stops with the server's ctx (no move starts while
		// models unload) or with the loops, whichever ends first.
		placeCtx, stopPlace := context.WithCancel(loopCtx)
		stopOnDone := context.AfterFunc(ctx, stopPlace)
		devs.loops.Go(func() { defer stopOnDone(); defer stopPlace(); place.run(placeCtx) })
	}
	reloads, err := newReloader(rl, cfg, reg, devs.gate, promReg, logger.With("component", "config"))
	if err != nil {
		return err
	}
	sec, err := newSecurity(cfg, promReg, logger)
	if err != nil {
		return err
	}
	reloads.security = sec
	be := &backend{Registry: reg, devs: devs, reloads: reloads}
	if d := cfg.Dashboard; d.Enabled {
		be.dash = dashboard.New(dashboard.Options{
			Resolution: d.Resolution, Retention: d.Retention, Window: d.Window, AttainmentTarget: d.AttainmentTarget,
		})
		devs.loops.Go(func() { be.dash.Run(loopCtx, be.dashboardSnapshot) })
	}
	reloadCtx, stopReloads := context.WithCancel(ctx)
	reloadDone := make(chan struct{})
	go func() { defer close(reloadDone); reloads.watch(reloadCtx) }()
	defer func() { stopReloads(); <-reloadDone }()
	// Client shared-memory regions outlive the listeners: they are unmapped
	// once every request has ended.
	shm, err := api.NewSharedMemory(api.SharedMemoryOptions{
		MaxRegions: cfg.Limits.MaxSharedMemoryRegions,
		MaxBytes:   int64(cfg.Limits.MaxSharedMemoryBytes),
		Auth:       sec.auth,
		Registerer: promReg,
	})
	if err != nil {
		return err
	}
	defer shm.Close()
	mem, err := newMemoryBudget(cfg.Limits, promReg)
	if err != nil {
		return err
	}
	lim := api.Limits{
		MaxRequestBytes:   int64(cfg.Limits.MaxRequestBytes),
		MaxTensorElements: cfg.Limits.MaxTensorElements,
		BodyTimeout:       cfg.Limits.BodyTimeout,
		StreamInflight:    cfg.Limits.GRPCStreamInflight,
		SharedMemory:      shm,
		RefuseUnread:      devs.gate.RefuseUnread,
		Memory:            mem,
		WriteTimeout:      cfg.Limits.WriteTimeout,
		LogLevel:          rl.LogLevel,
	}

	// Listen on every port before loading models, so a busy port fails the
	// start at once and health answers while models load.
	var (
		httpSrv, metricsSrv *http.Server
		restLn              *api.DrainingListener
		grpcSrv             *grpc.Server
		meshSrv             *grpc.Server
		serveErr            = make(chan error, 4)
	)
	if addr := cfg.Listen.HTTP; addr != "" {
		ln, err := listenLimited("rest", addr, cfg.Limits, restOverflowConnections, promReg)
		if err != nil {
			return fmt.Errorf("listen.http: %w", err)
		}
		restLog := logger.With("component", "rest")
		httpSrv = newRESTServer(api.NewREST(be, lim, restLog, sec.auth.REST()), cfg.Limits, ln, restLog)
		// Closed by the drain, the socket answers 503 until restLn.Stop.
		restLn = api.NewDrainingListener(sec.listener(ln, "h2", "http/1.1"), restLog)
		httpSrv.ConnState = restLn.ConnState
		defer restLn.Stop(context.Background(), 0) // a failed start too
		go func() { serveErr <- ignoreClosed(httpSrv.Serve(restLn)) }()
		logger.Info("REST listening", "addr", ln.Addr().String(), "tls", cfg.TLS.Enabled())
	}
	if addr := cfg.Listen.GRPC; addr != "" {
		ln, err := listenLimited("grpc", addr, cfg.Limits, 0, promReg)
		if err != nil {
			closeAll(httpSrv)
			return fmt.Errorf("listen.grpc: %w", err)
		}
		// Flow-control windows sized for tensors of megabytes, so a large
		// request is not paced by window updates.
		grpcSrv = api.NewGRPC(be, lim, logger /* api adds its component */, append(append(sec.grpcOptions(), grpcLimitOptions(cfg.Limits)...),
			grpc.InitialWindowSize(16<<20), grpc.InitialConnWindowSize(64<<20))...)
		go func() { serveErr <- grpcSrv.Serve(ln) }()
		logger.Info("gRPC listening", "addr", ln.Addr().String(), "tls", cfg.TLS.Enabled())
	}
	if addr := cfg.Listen.Metrics; addr != "" {
		ln, err := listenLimited("metrics", addr, configs.Limits{MaxConnections: metricsMaxConnections}, 0, promReg)
		if err != nil {
			closeAll(httpSrv)
			if grpcSrv != nil {
				grpcSrv.Stop()
			}
			return fmt.Errorf("listen.metrics: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", sec.auth.Metrics(promhttp.HandlerFor(promReg, promhttp.HandlerOpts{Registry: promReg})))
		metricsSrv = newMetricsServer(mux, cfg.Limits)
		go func() { serveErr <- ignoreClosed(metricsSrv.Serve(sec.metricsListener(ln))) }()
		logger.Info("metrics listening", "addr", ln.Addr().String(), "tls", cfg.TLS.Metrics)
	}

	if addr := cfg.Listen.ModelMesh; addr != "" {
		ln, err := listenLimited("modelmesh", addr, cfg.Limits, 0, promReg)
		if err != nil {
			closeAll(httpSrv, metricsSrv)
			if grpcSrv != nil {
				grpcSrv.Stop()
			}
			return fmt.Errorf("listen.modelmesh: %w", err)
		}
		meshSrv = api.NewModelMesh(newMesh(reg, staged, cfg), logger)
		go func() { serveErr <- meshSrv.Serve(ln) }()
		logger.Info("ModelMesh runtime SPI listening", "addr", ln.Addr().String(), "capacity", int64(cfg.Control.MemoryBudget))
	}

	loadCtx, stopLoads := context.WithCancel(ctx)
	defer stopLoads()
	var startErr error
	started := make(chan struct{})
	go func() { startErr = reg.Start(loadCtx); close(started) }()

	var runErr error
	select {
	case <-started:
		if startErr != nil {
			runErr = startErr
			break
		}
		be.ready.Store(true)
		logger.Info("server ready", "version", Version, "model_control", cfg.ModelControl)
		select {
		case <-ctx.Done():
		case err := <-serveErr:
			runErr = err
		}
	case <-ctx.Done():
	case err := <-serveErr:
		runErr = err
	}

	// Stop in reverse: not ready, stop accepting, drain, stop loops, stop runners.
	gracePeriod := reloads.current().Limits.GracePeriod
	delay := cfg.Limits.ShutdownDelay
	logger.Info("shutting down", "grace_period", gracePeriod, "shutdown_delay", delay)
	be.ready.Store(false)
	if delay > 0 && runErr == nil {
		// Readiness says false while requests are still served, so that
		// load balancers stop sending before the listeners close.
		time.Sleep(delay)
		logger.Info("shutdown delay over; closing the listeners")
	}
	grace, cancel := context.WithTimeout(context.WithoutCancel(ctx), gracePeriod)
	defer cancel()
	// Both listeners close at once; each server then waits for its
	// admitted requests, within the one grace period.
	var drain sync.WaitGroup
	if httpSrv != nil {
		drain.Go(func() {
			// New connections are refused first, and those accepted
			// have their requests read, before Shutdown.
			restLn.Refuse(grace)
			if err := httpSrv.Shutdown(grace); err != nil {
				logger.Warn("REST shutdown", "err", err)
			}
		})
	}
	if grpcSrv != nil {
		drain.Go(func() {
			stopped := make(chan struct{})
			go func() { grpcSrv.GracefulStop(); close(stopped) }()
			select {
			case <-stopped:
			case <-grace.Done():
				grpcSrv.Stop()
			}
		})
	}
	if meshSrv != nil {
		// A load or unload in progress ends with the registry below.
		drain.Go(meshSrv.Stop)
	}
	drain.Wait()
	if restLn != nil {
		// REST clients still sending are answered 503 for as long as the
		// delay, then new connections are refused.
		restLn.Stop(grace, delay)
	}
	be.stopping.Store(true)
	stopLoads()
	<-started
	stopCtx, cancelStop := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancelStop()
	reg.Stop(stopCtx)
	closeAll(metricsSrv)
	logger.Info("stopped")
	return runErr
}

func ignoreClosed(err error) error {
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

func closeAll(srvs ...*http.Server) {
	for _, s := range srvs {
		if s != nil {
			s.Close()
		}
	}
}

// FindONNXRuntime returns the ONNX Runtime library runners should load:
// the configured path, or the first that exists of the places the project's
// set-up and the container image put it.
func FindONNXRuntime(configured string) (string, error) {
	if configured != "" {
		if _, err := os.Stat(configured); err != nil {
			return "", fmt.Errorf("runtime.onnxruntime_library: %w", err)
		}
		return configured, nil
	}
	var candidates []string
	const rel = "deps/onnxruntime/libonnxruntime.so.1.30.0"
	candidates = append(candidates, rel)
	if exe, err := os.Executable(); err == nil {
		candidates = append(candidates, filepath.Join(filepath.Dir(exe), "..", rel))
	}
	candidates = append(candidates,
		"/opt/sloserve/lib/libonnxruntime.so.1.30.0",
		"/usr/local/lib/libonnxruntime.so",
		"/usr/lib/libonnxruntime.so",
	)
	for _, c := range candidates {
		if _, err := os.Stat(c); err == nil {
			return filepath.Abs(c)
		}
	}
	return "", fmt.Errorf("ONNX Runtime library not found (looked in %v); run `make setup` or set SLOSERVE_ONNXRUNTIME_LIBRARY", candidates)
}
