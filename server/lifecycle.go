package server

import (
	"context"
	"time"

	"github.com/sloserve/sloserve/internal/rungroup"
)

// registryStopTimeout bounds the registry's stop: its runners' drain and
// exit.
const registryStopTimeout = 10 * time.Second

// group is the server's run group: what runs, and the phases of its staged
// shutdown, in order. This list is the one place the shutdown order lives.
//
//  1. not ready: readiness says false;
//  2. delay: limits.shutdown_delay, while requests are still served, so
//     load balancers stop sending before the listeners close (skipped when
//     a component failed);
//  3. drain listeners: the background parent leaves the idle class and
//     every instance's compute cap is lifted (Registry.LiftCaps), then
//     REST, gRPC and ModelMesh stop accepting and finish their admitted
//     requests within limits.grace_period;
//  4. stop loads: the initial loads, the config reloads and placement;
//  5. stop the registry: every model unloads, its runners drain and exit
//     (within 10s, then they are killed; the phase waits for the stop);
//  6. close metrics: the metrics listener, open until the runners are gone;
//  7. stop the loops: the devices' schedulers and control loops, the
//     dashboard;
//  8. clean up: the device recovery, the limiters' units (the last device
//     first), the client shared memory, the runners' socket folder.
func (h *house) group(ctx context.Context) *rungroup.Group {
	g := rungroup.New(h.log)
	be := h.be
	delay := h.cfg.Limits.ShutdownDelay
	grace := func() time.Duration { return h.reloads.current().Limits.GracePeriod }

	g.Phase("not ready", nil).Do("readiness", func(context.Context, error) {
		h.log.Info("shutting down", "grace_period", grace(), "shutdown_delay", delay)
		be.shutdown()
	})
	delayed := g.Phase("delay", nil)
	delayed.Do("shutdown delay", func(_ context.Context, cause error) {
		if delay > 0 && cause == nil {
			time.Sleep(delay)
			h.log.Info("shutdown delay over; closing the listeners")
		}
	})
	// From here on no request is admitted: the ones admitted finish
	// uncapped, not behind a best-effort cap in the idle class.
	delayed.Do("lift compute caps", func(context.Context, error) {
		if n := h.reg.LiftCaps(); n > 0 {
			h.log.Info("compute caps lifted for the drain", "instances", n)
		}
	})
	// The listeners close at once; each server then waits for its
	// admitted requests, within the one grace period.
	drain := g.Phase("drain listeners", grace)
	var metricsServer *listening
	for _, s := range h.servers {
		if s.name == "metrics" {
			metricsServer = &s
			continue
		}
		drain.Add(s.name, s.serve, func(ctx context.Context, _ error) { s.interrupt(ctx) })
	}
	drain.Do("not live", func(context.Context, error) { be.stopping.Store(true) })

	loads := g.Phase("stop loads", nil)
	loadCtx, stopLoads := context.WithCancel(ctx)
	loads.Add("initial loads", func() error {
		if err := h.reg.Start(loadCtx); err != nil {
			return err
		}
		if be.markReady() {
			h.log.Info("server ready", "version", Version, "model_control", h.cfg.ModelControl)
		}
		<-loadCtx.Done()
		return nil
	}, func(context.Context, error) { stopLoads() })
	reloadCtx, stopReloads := context.WithCancel(ctx)
	// Neither the reloads (none without signals) nor placement (an
	// error is logged) ending early ends the server.
	loads.Add("config reloads", func() error { h.reloads.watch(reloadCtx); <-reloadCtx.Done(); return nil },
		func(context.Context, error) { stopReloads() })
	if h.place != nil {
		// Placement stops with the server's ctx: no move starts while
		// models unload.
		placeCtx, stopPlace := context.WithCancel(ctx)
		loads.Add("placement", func() error { h.place.Run(placeCtx); <-placeCtx.Done(); return nil },
			func(context.Context, error) { stopPlace() })
	}

	// The registry's stop has its own bound (its runners are stopped,
	// then killed, within it); the phase waits for it, as the runners
	// must be gone before the limiters' units are removed.
	g.Phase("stop the registry", nil).Do("registry", func(context.Context, error) {
		stopCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), registryStopTimeout)
		defer cancel()
		h.reg.Stop(stopCtx)
	})
	if metricsServer != nil {
		s := metricsServer
		g.Phase("close metrics", nil).Add(s.name, s.serve, func(ctx context.Context, _ error) { s.interrupt(ctx) })
	}

	// The devices' loops outlive ctx: they stop once the registry has
	// drained. A loop that ends early is logged by its device and the
	// server serves on, as the device would without its loop.
	loops := g.Phase("stop the loops", nil)
	loop := func(name string, run func(context.Context)) {
		c, stop := context.WithCancel(context.WithoutCancel(ctx))
		loops.Add(name, func() error { run(c); <-c.Done(); return nil }, func(context.Context, error) { stop() })
	}
	for _, d := range h.devs.Devices() {
		loop("scheduler "+d.Name(), d.Run)
	}
	for _, l := range h.loops.All() {
		loop("control loop "+l.Device().Name(), l.Run)
	}
	if be.dash != nil {
		loop("dashboard", func(c context.Context) { be.dash.Run(c, be.dashboardSnapshot) })
	}
	g.Phase("clean up", nil).Do("clean up", func(context.Context, error) {
		h.close()
		h.log.Info("stopped")
	})
	return g
}
