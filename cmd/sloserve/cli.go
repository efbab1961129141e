package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/runtime"
	"github.com/sloserve/sloserve/server"
)

const usage = `sloserve: a latency-aware multi-model ONNX inference server

Usage:
  sloserve serve [flags]     serve the models of the configured repositories
  sloserve profile [flags] MODEL
                             time a model over batch sizes x compute shares and
                             print the latency curve the predictor fits
  sloserve loadtest [flags] SCENARIO.yaml
                             drive models with a scenario's load and report
                             goodput, attainment and latency; --compare runs
                             it under each share policy side by side
  sloserve check [flags]     validate the server config and every model
                             folder of its repositories (config.yaml or
                             config.pbtxt) without serving; exit 1 on errors
  sloserve cleanup           remove what servers killed without cleaning up
                             (SIGKILL, a crash) left: their cgroups and their
                             runners' socket folders
  sloserve version           print the version
  sloserve help              this text

Run "sloserve serve -h", "sloserve check -h", "sloserve profile -h" or
"sloserve loadtest -h" for their flags.
`

// run dispatches a subcommand and returns the process exit code.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	switch args[0] {
	case "serve":
		err = serve(ctx, args[1:], stderr)
	case "profile":
		err = profile(ctx, args[1:], stdout, stderr)
	case "loadtest":
		err = loadtestCmd(ctx, args[1:], stdout, stderr)
	case "runner":
		// Hidden: the child process that hosts one ONNX Runtime session.
		logger := newLogger(stderr, "text", slog.LevelInfo).With("pid", os.Getpid())
		stopProfiles := profileRunner(logger)
		err = runtime.RunnerMain(ctx, args[1:], logger)
		stopProfiles()
	case "check":
		err = check(args[1:], stdout, stderr)
		if errors.Is(err, errCheckFailed) {
			return 1 // the problems are printed
		}
	case "cleanup":
		err = cleanup(args[1:], stdout, stderr)
	case "version", "--version", "-version":
		fmt.Fprintf(stdout, "sloserve %s\n", server.Version)
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
	default:
		fmt.Fprintf(stderr, "sloserve: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "sloserve %s: %v\n", args[0], err)
		return 1
	}
	return 0
}

// cleanup removes the cgroups and socket folders of dead servers and says
// what it removed.
func cleanup(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("cleanup", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, "Usage: sloserve cleanup\n\nRemoves the cgroups (killing any process left in them) and the runner socket\nfolders of sloserve servers that are no longer running. A running server's\nare never touched; every server also does this when it starts.\n")
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	c, err := server.CleanupStale(newLogger(stderr, "text", slog.LevelInfo))
	fmt.Fprintf(stdout, "removed %d cgroup folders and %d socket folders of servers that are gone\n", c.Cgroups, len(c.SocketDirs))
	return err
}

// setFlags collects repeated --set key=value overrides.
type setFlags []string

func (s *setFlags) String() string     { return strings.Join(*s, ",") }
func (s *setFlags) Set(v string) error { *s = append(*s, v); return nil }

func serve(ctx context.Context, args []string, stderr io.Writer) error {
	// SIGHUP rereads the config. It is caught from the first moment, so one
	// that comes while the server starts does not kill it (the default
	// action); the server reads it once it runs.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	pprofAddr := fs.String("pprof-addr", "", "serve Go's /debug/pprof/ profiles on this address (off when empty; for diagnosis, not production)")
	cfg, reload, err := loadConfig(fs, args, 0)
	if err != nil {
		return err
	}
	level := new(slog.LevelVar)
	level.Set(cfg.Log.SlogLevel())
	logger := newLogger(stderr, cfg.Log.Format, level)
	if *pprofAddr != "" {
		stop, err := servePprof(*pprofAddr, logger)
		if err != nil {
			return err
		}
		defer stop()
	}
	return server.Run(ctx, cfg, logger, server.Reloading{Load: reload, Signals: hup, LogLevel: level})
}

func profile(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("profile", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fresh := fs.Bool("fresh", false, "profile again even when the cache has this model's curve")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: sloserve profile [flags] MODEL\n\nProfiles MODEL of the configured repositories as the server does at load\n(control.profile settings) and prints the points, the fitted curve and its error.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	cfg, _, err := loadConfig(fs, args, 1)
	if err != nil {
		return err
	}
	logger := newLogger(stderr, cfg.Log.Format, slog.LevelWarn)
	return server.Profile(ctx, cfg, fs.Arg(0), *fresh, stdout, logger)
}

// loadConfig parses the server flags into fs, loads the config and applies
// the environment and the flags; nargs is how many positional arguments
// the command takes. It also returns a function that does the same again,
// with the same file and flags, for config reloads.
func loadConfig(fs *flag.FlagSet, args []string, nargs int) (*configs.Server, func() (*configs.Server, error), error) {
	configPath := fs.String("config", "", "server config file (YAML); empty uses the embedded default")
	var sets setFlags
	fs.Var(&sets, "set", "override a config key, as key=value (repeatable); keys: "+strings.Join(configs.Keys(), ", "))
	shorthands := map[string]*string{
		"listen.http":    fs.String("http-addr", "", "REST listen address (listen.http)"),
		"listen.grpc":    fs.String("grpc-addr", "", "gRPC listen address (listen.grpc)"),
		"listen.metrics": fs.String("metrics-addr", "", "metrics listen address (listen.metrics)"),
		"repositories":   fs.String("repository", "", "model repository paths, comma-separated (repositories)"),
		"model_control":  fs.String("model-control", "", "none | explicit | poll (model_control)"),
		"model_dir":      fs.String("model-dir", "", "serve the one model in this folder instead of the repositories, as KServe mounts it (model_dir)"),
		"model_name":     fs.String("model-name", "", "the name the --model-dir model is served by (model_name)"),
		"log.format":     fs.String("log-format", "", "text | json (log.format)"),
		"log.level":      fs.String("log-level", "", "debug | info | warn | error (log.level)"),
	}
	if err := fs.Parse(args); err != nil {
		return nil, nil, err
	}
	if fs.NArg() != nargs {
		if nargs == 0 {
			return nil, nil, fmt.Errorf("unexpected arguments %q", fs.Args())
		}
		return nil, nil, fmt.Errorf("want %d argument(s), got %q", nargs, fs.Args())
	}
	load := func() (*configs.Server, error) { return readConfig(*configPath, shorthands, sets) }
	cfg, err := load()
	if err != nil {
		return nil, nil, err
	}
	return cfg, load, nil
}

// readConfig loads the config file (the embedded default for "") and
// applies the environment, then the flag shorthands, then --set, and
// validates the result.
func readConfig(path string, shorthands map[string]*string, sets setFlags) (*configs.Server, error) {
	cfg, err := configs.LoadServer(path)
	if err != nil {
		return nil, err
	}
	// Precedence: file (or embedded default) < environment < flags.
	if err := cfg.ApplyEnv(os.Environ()); err != nil {
		return nil, err
	}
	for key, v := range shorthands {
		if *v != "" {
			if err := cfg.Set(key, *v); err != nil {
				return nil, err
			}
		}
	}
	for _, kv := range sets {
		key, value, ok := strings.Cut(kv, "=")
		if !ok {
			return nil, fmt.Errorf("--set %q: want key=value", kv)
		}
		if err := cfg.Set(key, value); err != nil {
			return nil, err
		}
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return cfg, nil
}

func newLogger(w io.Writer, format string, level slog.Leveler) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level}
	if format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}
