package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	"github.com/sloserve/sloserve/api"
	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/dashboard"
	"github.com/sloserve/sloserve/device"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/predictor"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
	"github.com/sloserve/sloserve/simgpu"
)

// assembly says which parts of the server assemble builds.
type assembly struct {
	// serve builds what serves: the reloads, the dashboard, the client
	// shared memory and the listeners (Run). Off: the models and the
	// devices only (Profile, tests).
	serve bool
	rl    Reloading
	// profile, when set, loads one model to profile it (Profile): no
	// recovery, no placement, no control loops.
	profile *profileRequest
	// reg registers the metrics; nil: a registry of its own.
	reg *prometheus.Registry
}

// profileRequest is what `sloserve profile` asks for.
type profileRequest struct {
	model  string
	fresh  bool
	report func(run models.ProfileRun, p predictor.Profile, cached bool)
}

// house is the server, assembled once (assemble): each part built with
// every part it needs, in the order of their needs. Run starts and stops
// it as a run group (lifecycle.go).
type house struct {
	cfg     *configs.Server
	log     *slog.Logger
	prom    *prometheus.Registry
	sim     *simgpu.Sim // nil: no simulated GPUs
	runners *runnerFactory
	pred    *predictor.Predictor
	gate    *qos.Gate // the one admission limit on requests in flight
	use     *prometheus.GaugeVec
	devs    *device.Set
	gpus    int              // the GPUs the devices include, simulated or real
	rec     *device.Recovery // nil: no simulated GPUs to recover
	// stopRecovery ends the recoveries under way and waits for them;
	// safe to call again.
	stopRecovery func()
	prof         *profiler
	place        *device.Placement // nil: gpu.placement off
	reg          *models.Registry
	loops        *device.Loops // nil under Profile

	// Built when serving (assembly.serve).
	staged  string // the ModelMesh model folder
	reloads *reloader
	be      *backend
	shm     *api.SharedMemory
	servers []listening

	// closers undo what assemble made, the last first (close).
	closers []func()
}

// listening is one listener's server.
type listening struct {
	name      string
	serve     func() error
	interrupt func(ctx context.Context)
}

// assemble builds the server's parts from cfg. On an error it undoes what
// it built.
func assemble(cfg *configs.Server, logger *slog.Logger, a assembly) (h *house, err error) {
	// The deferred undo keeps its own reference: an error return names no
	// house.
	built := &house{log: logger, prom: a.reg, stopRecovery: func() {}}
	h = built
	defer func() {
		if err != nil {
			built.close()
		}
	}()
	cfg, keepStaged, unstage, staged, err := singleModel(cfg)
	if err != nil {
		return nil, err
	}
	h.cfg, h.staged = cfg, staged
	h.closers = append(h.closers, unstage)
	if h.sim, err = newSimulator(cfg.GPU, logger); err != nil {
		return nil, err
	}
	if h.prom == nil {
		if h.prom, err = newPromRegistry(); err != nil {
			return nil, err
		}
	}
	if err := h.buildDevices(); err != nil {
		return nil, err
	}
	if h.sim != nil && a.profile == nil {
		recCtx, stopRec := context.WithCancel(context.Background())
		h.rec = device.NewRecovery(recCtx, simulatedDomains(h.sim), daemonOf(h.devs, h.sim), cfg.GPU.Placement.Enabled,
			logger.With("component", "recovery"))
		h.stopRecovery = func() { stopRec(); h.rec.Stop() }
		h.closers = append(h.closers, h.stopRecovery)
	}
	runners, cleanup, err := newRunnerFactory(cfg.Runtime, h.sim, h.rec, logger)
	if err != nil {
		return nil, err
	}
	h.runners = runners
	h.closers = append(h.closers, cleanup)
	h.prof = &profiler{
		cfg:   cfg.Control.Profile,
		cache: predictor.Cache{Dir: profileCacheDir(cfg.Control.Profile.CacheDir)},
		pred:  h.pred,
		lib:   runners.library,
		log:   logger.With("component", "predictor"),
		sim:   h.sim,
	}
	if a.profile != nil {
		h.prof.fresh, h.prof.report, h.prof.log = a.profile.fresh, a.profile.report, logger
		h.reg, err = models.New(models.Options{
			Repositories:      cfg.Repositories,
			Control:           configs.ModelControlExplicit,
			StartupModels:     []string{a.profile.model},
			MaxTensorElements: cfg.Limits.MaxTensorElements,
			MaxBatchSize:      cfg.Limits.MaxBatchSize,
			NewInstance:       runners.start,
			Logger:            logger,
			Limiter:           h.devs.Limiter,
			Profile:           h.prof.run,
		})
		return h, err
	}
	if err := h.buildModels(); err != nil {
		return nil, err
	}
	if !a.serve {
		return h, nil
	}
	if load := a.rl.Load; load != nil {
		a.rl.Load = func() (*configs.Server, error) {
			next, err := load()
			if err == nil {
				keepStaged(next)
			}
			return next, err
		}
	}
	return h, h.buildServing(a.rl)
}

// newPromRegistry is a metrics registry with the Go and process
// collectors.
func newPromRegistry() (*prometheus.Registry, error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(collectors.NewGoCollector()); err != nil {
		return nil, err
	}
	if err := reg.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})); err != nil {
		return nil, err
	}
	return reg, nil
}

// buildDevices builds the predictor, the admission gate and every device:
// the CPU and each GPU, simulated or (without the simulator) as many as
// NVML sees.
func (h *house) buildDevices() error {
	var err error
	if h.pred, err = predictor.New(predictor.Options{Registerer: h.prom}); err != nil {
		return err
	}
	lim := h.cfg.Limits
	gate := qos.NewGate(lim.MaxInflightRequests, int64(lim.MaxInflightBytes))
	if err := h.prom.Register(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "sloserve_requests_refused_unread_total",
		Help: "gRPC inference calls refused at limits.max_inflight_requests before their message (and model) was read; no model's count has them.",
	}, func() float64 { return float64(gate.RefusedUnread()) })); err != nil {
		return fmt.Errorf("registering sloserve_requests_refused_unread_total: %w", err)
	}
	h.gate = gate
	if err := runtime.NewMailboxMetrics(h.prom); err != nil {
		return err
	}
	if h.use, err = device.NewUseGauge(h.prom); err != nil {
		return err
	}
	gpus := 0
	if h.sim == nil {
		tel := limiter.NewTelemetry(h.log)
		infos, _ := tel.Devices()
		tel.Close()
		gpus = len(infos)
	}
	names := device.Names(h.sim, gpus)
	h.gpus = len(names) - 1 // all but the CPU
	h.devs = device.NewSet(names, device.Options{
		QoS: h.cfg.QoS, Control: h.cfg.Control, Predictor: h.pred, Gate: h.gate, Sim: h.sim,
		Registerer: h.prom, UseGauge: h.use, Logger: h.log,
	})
	h.closers = append(h.closers, func() {
		if err := h.devs.Close(); err != nil {
			h.log.Warn("closing the limiters", "err", err)
		}
	})
	return nil
}

// buildModels builds the placement, the registry on the devices, and the
// devices' control loops on the registry.
func (h *house) buildModels() error {
	cfg := h.cfg
	var risky interface{ Risky(string) (string, bool) }
	if h.rec != nil {
		risky = h.rec.Isolation()
	}
	place, err := device.NewPlacement(device.PlacementOptions{Config: cfg.GPU.Placement, Control: cfg.Control,
		Sim: h.sim, Predictor: h.pred, Risky: risky, Logger: h.log})
	if err != nil {
		return err
	}
	h.place = place
	opts := models.Options{
		Repositories:      cfg.Repositories,
		Control:           cfg.ModelControl,
		PollInterval:      cfg.PollInterval,
		StartupModels:     cfg.StartupModels,
		MaxTensorElements: cfg.Limits.MaxTensorElements,
		MaxBatchSize:      cfg.Limits.MaxBatchSize,
		DrainTimeout:      cfg.Limits.GracePeriod,
		CallTimeout:       cfg.Runtime.CallTimeout,
		NewInstance:       h.runners.start,
		Logger:            h.log.With("component", "models"),
		Registerer:        h.prom,
		Scheduler:         h.devs.Scheduler,
		Estimator:         h.pred,
		Limiter:           h.devs.Limiter,
		BestEffortMode:    h.devs.BestEffortMode,
		Forget:            h.pred.Forget,
		HasGPU:            h.gpus > 0,
	}
	if cfg.Control.Profile.Enabled {
		opts.Profile = h.prof.run
		// Where the loop sizes memory shares from working sets, a GPU
		// model whose file was profiled before starts at its working
		// set instead of its memory_limit (firstmemory.go).
		if p, err := control.PolicyNamed(cfg.Control.Policy); err == nil && p.Forecasts() && h.gpus > 0 {
			if lim := h.devs.Limiter("cuda:0"); lim != nil && lim.Capabilities().Enforces {
				opts.FirstMemory = h.prof.firstMemory(lim.Capabilities().MinMemory)
			}
		}
	}
	if place != nil {
		opts.Place = place.Place
	}
	if h.reg, err = models.New(opts); err != nil {
		return err
	}
	if h.loops, err = device.NewLoops(h.devs, h.reg); err != nil {
		return err
	}
	if place != nil {
		place.Bind(h.reg, h.loops)
	}
	return nil
}

// buildServing builds the reloads, the backend the protocols serve, the
// client shared memory, and a server on each configured listener. It
// listens on every port before any model loads, so that a busy port fails
// the start at once and health answers while models load.
func (h *house) buildServing(rl Reloading) error {
	cfg, logger, promReg := h.cfg, h.log, h.prom
	sec, err := newSecurity(cfg, promReg, logger)
	if err != nil {
		return err
	}
	if h.reloads, err = newReloader(rl, cfg, h.reg, h.gate, sec, promReg, logger.With("component", "config")); err != nil {
		return err
	}
	h.be = &backend{Registry: h.reg, ctl: cfg.Control, devs: h.devs, loops: h.loops, pred: h.pred, rec: h.rec, place: h.place, reloads: h.reloads}
	if d := cfg.Dashboard; d.Enabled {
		h.be.dash = dashboard.New(dashboard.Options{
			Resolution: d.Resolution, Retention: d.Retention, Window: d.Window, AttainmentTarget: d.AttainmentTarget,
		})
	}
	// Client shared-memory regions outlive the listeners: they are
	// unmapped once every request has ended.
	if h.shm, err = api.NewSharedMemory(api.SharedMemoryOptions{
		MaxRegions: cfg.Limits.MaxSharedMemoryRegions,
		MaxBytes:   int64(cfg.Limits.MaxSharedMemoryBytes),
		Auth:       sec.auth,
		Registerer: promReg,
	}); err != nil {
		return err
	}
	h.closers = append(h.closers, func() { h.shm.Close() })
	connMem, connTotal, connWarning, err := connMemoryPlan(cfg)
	if err != nil {
		return err
	}
	if connWarning != "" {
		logger.Warn(connWarning)
	}
	mem, err := newMemoryBudget(cfg.Limits, connTotal, promReg)
	if err != nil {
		return err
	}
	slow, err := newSlowClients(promReg)
	if err != nil {
		return err
	}
	// Spans still buffered are exported at clean-up, after the listeners
	// have drained.
	trace, err := startTracing(context.Background(), cfg.Tracing, h.be.ServerVersion(), logger)
	if err != nil {
		return err
	}
	h.closers = append(h.closers, func() { trace.stop(cfg.Limits.GracePeriod) })
	lim := api.Limits{
		Tracer:            trace.tracer(),
		Trace:             trace.settings,
		MaxRequestBytes:   int64(cfg.Limits.MaxRequestBytes),
		MaxTensorElements: cfg.Limits.MaxTensorElements,
		MaxHeaderBytes:    int64(cfg.Limits.MaxHeaderBytes),
		BodyTimeout:       cfg.Limits.BodyTimeout,
		StreamInflight:    cfg.Limits.GRPCStreamInflight,
		SharedMemory:      h.shm,
		RefuseUnread:      h.gate.RefuseUnread,
		Memory:            mem,
		WriteTimeout:      cfg.Limits.WriteTimeout,
		SlowClients:       slow,
		LogLevel:          rl.LogLevel,
	}
	listen := func(name, key, addr string, limits configs.Limits, overflow int) (*api.LimitedListener, error) {
		ln, err := listenLimited(name, addr, limits, overflow, connMem[name], promReg, logger.With("listener", name))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", key, err)
		}
		h.closers = append(h.closers, func() { ln.Close() }) // undone on a failed start; closed already after Run
		return ln, nil
	}
	if addr := cfg.Listen.HTTP; addr != "" {
		ln, err := listen("rest", "listen.http", addr, cfg.Limits, restOverflowConnections)
		if err != nil {
			return err
		}
		restLog := logger.With("component", "rest")
		srv := newRESTServer(api.NewREST(h.be, lim, restLog, sec.auth.REST()), cfg.Limits, ln, restLog)
		// Closed by the drain, the socket answers 503 until restLn.Stop.
		restLn := api.NewDrainingListener(sec.listener(ln, "h2", "http/1.1"), restLog)
		ln.CountSlowHeaders(slow, cfg.Limits.HeaderTimeout, restLog)
		srv.ConnState = ln.ConnState
		restLn.Wire(srv)
		h.closers = append(h.closers, func() { restLn.Stop(context.Background(), 0) }) // a failed start too
		delay := cfg.Limits.ShutdownDelay
		h.servers = append(h.servers, listening{name: "REST",
			serve: func() error { return ignoreClosed(srv.Serve(restLn)) },
			interrupt: func(ctx context.Context) {
				// New connections are refused first, and those accepted
				// have their requests read, before Shutdown.
				restLn.Refuse(ctx)
				if err := srv.Shutdown(ctx); err != nil {
					logger.Warn("REST shutdown", "err", err)
				}
				// Clients still sending are answered 503 for as long as
				// the delay, then new connections are refused.
				restLn.Stop(ctx, delay)
			}})
		logger.Info("REST listening", "addr", ln.Addr().String(), "tls", cfg.TLS.Enabled())
	}
	if addr := cfg.Listen.GRPC; addr != "" {
		ln, err := listen("grpc", "listen.grpc", addr, cfg.Limits, 0)
		if err != nil {
			return err
		}
		ln.CountSlowHandshakes(slow, cfg.Limits.GRPCConnectionTimeout, logger.With("component", "grpc"))
		srv := api.NewGRPC(h.be, lim, logger /* api adds its component */, append(append(sec.grpcOptions(), grpcLimitOptions(cfg.Limits)...),
			api.GRPCTransportOptions()...)...)
		h.servers = append(h.servers, listening{name: "gRPC", serve: func() error { return srv.Serve(ln) },
			interrupt: func(ctx context.Context) { stopGRPC(ctx, srv) }})
		logger.Info("gRPC listening", "addr", ln.Addr().String(), "tls", cfg.TLS.Enabled())
	}
	if addr := cfg.Listen.Metrics; addr != "" {
		ln, err := listen("metrics", "listen.metrics", addr, configs.Limits{MaxConnections: metricsMaxConnections}, 0)
		if err != nil {
			return err
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", sec.auth.Metrics(promhttp.HandlerFor(promReg, promhttp.HandlerOpts{Registry: promReg})))
		srv := newMetricsServer(mux, cfg.Limits)
		h.servers = append(h.servers, listening{name: "metrics",
			serve:     func() error { return ignoreClosed(srv.Serve(sec.metricsListener(ln))) },
			interrupt: func(context.Context) { srv.Close() }})
		logger.Info("metrics listening", "addr", ln.Addr().String(), "tls", cfg.TLS.Metrics)
	}
	if addr := cfg.Listen.ModelMesh; addr != "" {
		ln, err := listen("modelmesh", "listen.modelmesh", addr, cfg.Limits, 0)
		if err != nil {
			return err
		}
		srv := api.NewModelMesh(newMesh(h.reg, h.staged, cfg), logger)
		// A load or unload in progress ends with the registry.
		h.servers = append(h.servers, listening{name: "ModelMesh", serve: func() error { return srv.Serve(ln) },
			interrupt: func(context.Context) { srv.Stop() }})
		logger.Info("ModelMesh runtime SPI listening", "addr", ln.Addr().String(), "capacity", int64(cfg.Control.MemoryBudget))
	}
	return nil
}

// stopGRPC stops a gRPC server gracefully: it stops accepting and waits
// for the calls under way, until ctx ends, then closes what is left.
func stopGRPC(ctx context.Context, srv *grpc.Server) {
	stopped := make(chan struct{})
	go func() { srv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-ctx.Done():
		srv.Stop()
	}
}

// close undoes what assemble made, the last first.
func (h *house) close() {
	for _, c := range slices.Backward(h.closers) {
		c()
	}
	h.closers = nil
}

func ignoreClosed(err error) error {
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}
