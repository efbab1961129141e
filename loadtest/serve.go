package loadtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// ServerOptions say how a run starts its own server (--serve, --compare).
type ServerOptions struct {
	Binary string // the sloserve binary; empty: this process's own executable
	Config string // server config file; empty: the embedded default
	Set    []string
	// Log receives the server's output; nil discards it.
	Log io.Writer
	// StartTimeout bounds the wait for the server and the scenario's
	// models to be ready (first starts profile models); 0: 5 minutes.
	StartTimeout time.Duration
	// DefaultWeight leaves this process (the load generator) at the
	// default CPU weight instead of beside the server's own cgroup at its
	// weight (joinPeerCgroup).
	DefaultWeight bool
}

// Server is a sloserve process a run started.
type Server struct {
	HTTPBase string
	GRPCAddr string
	cmd      *exec.Cmd
	done     chan error
}

// StartServer starts `sloserve serve` on free loopback ports with the
// scenario's repository and overrides and the given share policy, and
// waits until it and every model of the scenario are ready.
func StartServer(ctx context.Context, sc *Scenario, policy string, o ServerOptions) (*Server, error) {
	bin := o.Binary
	if bin == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		bin = exe
	}
	ports, err := freePorts(3)
	if err != nil {
		return nil, err
	}
	args := []string{"serve", "--http-addr", ports[0], "--grpc-addr", ports[1], "--metrics-addr", ports[2]}
	if o.Config != "" {
		args = append(args, "--config", o.Config)
	}
	if sc.Server.Repository != "" {
		args = append(args, "--repository", sc.Path(sc.Server.Repository))
	}
	if policy != "" {
		args = append(args, "--set", "control.policy="+policy)
	}
	for _, kv := range sc.Server.Set {
		args = append(args, "--set", kv)
	}
	for _, kv := range o.Set {
		args = append(args, "--set", kv)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = o.Log, o.Log
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	s := &Server{HTTPBase: "http://" + ports[0], GRPCAddr: ports[1], cmd: cmd, done: make(chan error, 1)}
	go func() { s.done <- cmd.Wait() }()

	timeout := o.StartTimeout
	if timeout == 0 {
		timeout = 5 * time.Minute
	}
	wait, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	paths := []string{"/v2/health/ready"}
	for _, m := range sc.Models {
		p := "/v2/models/" + m.Model
		if m.Version != "" {
			p += "/versions/" + m.Version
		}
		paths = append(paths, p+"/ready")
	}
	for _, p := range paths {
		if err := s.waitOK(wait, p); err != nil {
			s.Stop(10 * time.Second)
			return nil, fmt.Errorf("server (%s %v): %w", bin, args, err)
		}
	}
	return s, nil
}

// waitOK polls a path until it answers 200.
func (s *Server) waitOK(ctx context.Context, path string) error {
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.HTTPBase+path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case err := <-s.done:
			s.done <- err
			return fmt.Errorf("exited before %s answered 200: %v", path, err)
		case <-ctx.Done():
			return fmt.Errorf("%s did not answer 200: %w", path, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Stop sends SIGTERM and waits for the server to exit, killing it after
// grace.
func (s *Server) Stop(grace time.Duration) error {
	if err := s.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return err
	}
	select {
	case err := <-s.done:
		s.done <- err
		return err
	case <-time.After(grace):
		s.cmd.Process.Kill()
		err := <-s.done
		s.done <- err
		return fmt.Errorf("server did not stop within %s: killed", grace)
	}
}

// freePorts asks the kernel for n unused loopback ports.
func freePorts(n int) ([]string, error) {
	var out []string
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		lns = append(lns, ln)
		out = append(out, ln.Addr().String())
	}
	return out, nil
}

// RunPolicy runs the scenario against a server of its own, started with
// the given policy for it and stopped after it.
func RunPolicy(ctx context.Context, sc *Scenario, policy string, so ServerOptions, opts Options, logf func(format string, args ...any)) (*Run, error) {
	logf("policy %s: starting the server", policy)
	srv, err := StartServer(ctx, sc, policy, so)
	if err != nil {
		return nil, fmt.Errorf("policy %s: %w", policy, err)
	}
	opts.HTTPBase, opts.GRPCAddr = srv.HTTPBase, srv.GRPCAddr
	leave, weight := func() error { return nil }, "default weight: --client-default-weight"
	if !so.DefaultWeight {
		leave, weight = joinPeerCgroup(srv.cmd.Process.Pid)
	}
	logf("policy %s: the load generator's CPU: %s", policy, weight)
	logf("policy %s: running %s (%s warmup, %s measured)", policy, sc.Name, warmupOf(sc, opts), durationOf(sc, opts))
	run, err := Execute(ctx, sc, opts)
	if lerr := leave(); lerr != nil {
		logf("policy %s: leaving the load generator's cgroup: %v", policy, lerr)
	}
	if run != nil {
		run.ClientCPU = weight
	}
	if serr := srv.Stop(time.Minute); serr != nil {
		logf("policy %s: server exit: %v", policy, serr)
	}
	if err != nil {
		return nil, fmt.Errorf("policy %s: %w", policy, err)
	}
	if run.Policy == "" {
		run.Policy = policy
	}
	return run, nil
}

func durationOf(sc *Scenario, o Options) time.Duration {
	if o.Duration > 0 {
		return o.Duration
	}
	return sc.Duration
}

func warmupOf(sc *Scenario, o Options) time.Duration {
	if o.WarmupSet {
		return o.Warmup
	}
	return sc.Warmup
}
