// Package server is the composition root: it takes the server config,
// assembles the parts once (assemble.go: the simulator, the devices, the
// runner factory, the predictor, the registry, the devices' control loops,
// the protocol servers), each built with every part it needs, and runs them
// as one run group until the context ends, then stops them in named phases
// (lifecycle.go).
//
// It owns the lifecycle: the config is reloaded on SIGHUP or request, and
// shutdown drains in stages. It adapts the simulated GPUs and their
// instances to the device-fault recovery (simgpu.go; the recovery itself
// is device.Recovery). It must not implement serving, scheduling or
// control itself: those belong to the packages it wires, and only
// cmd/sloserve may import server.
package server

import (
	"context"
	"log/slog"

	"github.com/sloserve/sloserve/configs"
)

// Run serves until ctx is cancelled, then shuts down gracefully: readiness
// turns false, listeners stop accepting, admitted requests finish within the
// grace period, and the runners stop. It rereads the config as rl says.
// The server is assembled once (assemble) and run as a group whose phases
// are the staged shutdown (house.group, lifecycle.go).
func Run(ctx context.Context, cfg *configs.Server, logger *slog.Logger, rl Reloading) error {
	setCollector(cfg.Limits, logger)
	h, err := assemble(cfg, logger, assembly{serve: true, rl: rl})
	if err != nil {
		return err
	}
	return h.group(ctx).Run(ctx)
}
