package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/loadtest"
)

const loadtestUsage = `Usage: sloserve loadtest [flags] SCENARIO.yaml

Drives the models of a scenario file (see loadtest/scenarios/) with open- or
closed-loop load and writes a report: summary.json (per model and class:
goodput, attainment, percentiles, throughput), timeline.csv (per second),
records.csv (every request) and report.html (plots, shares, events).

Modes:
  (default)   against a running server (--http, --grpc)
  --serve     start a server for the run (the scenario's server section),
              with --policy if given
  --compare   start one server per policy (--policies, or the scenario's
              server.policies) and write one combined report with ratios
  --search    find the highest multiple of the scenario's rates at which
              every latency-critical model keeps --search-target attainment

Flags:
`

func loadtestCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("loadtest", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, loadtestUsage)
		fs.PrintDefaults()
	}
	httpBase := fs.String("http", "http://127.0.0.1:8000", "the server's REST base URL")
	grpcAddr := fs.String("grpc", "127.0.0.1:8001", "the server's gRPC address")
	out := fs.String("out", "", "report folder (default loadtest-results/<scenario>-<time>)")
	duration := fs.Duration("duration", 0, "measured window, overriding the scenario's")
	warmup := fs.Duration("warmup", -1, "warmup before the window, overriding the scenario's")
	serveFlag := fs.Bool("serve", false, "start a server for the run")
	policy := fs.String("policy", "", "with --serve: the server's share policy (static, shared or adaptive)")
	compare := fs.Bool("compare", false, "run once per policy, each with a server of its own, and compare")
	policies := fs.String("policies", "", "with --compare: comma-separated policies (default: the scenario's server.policies)")
	search := fs.Bool("search", false, "search the highest rate multiple that keeps the target attainment")
	searchTarget := fs.Float64("search-target", 0.99, "with --search: the SLO attainment to keep")
	searchProbe := fs.Duration("search-probe", 20*time.Second, "with --search: the measured length of each probe")
	serverConfig := fs.String("server-config", "", "with --serve/--compare: the server's config file (default: the embedded one)")
	var serverSets setFlags
	fs.Var(&serverSets, "server-set", "with --serve/--compare: a server config override key=value (repeatable)")
	clientDefaultWeight := fs.Bool("client-default-weight", false, "with --serve/--compare: leave the load generator at the default CPU weight (by default it joins a cgroup beside the server's own at the server's weight, as a client on another machine would not wait behind the server's runners)")
	maxInFlight := fs.Int("max-inflight", 0, "requests in flight per model before arrivals are dropped by the generator (default 2048)")
	connections := fs.Int("connections", 0, fmt.Sprintf("gRPC connections per gRPC model, for models whose scenario does not give connections (default %d)", loadtest.DefaultConnections))
	quiet := fs.Bool("quiet", false, "no progress line")
	var sec clientSecurity
	fs.StringVar(&sec.tokenFile, "token-file", "", "a file holding the bearer token to send (default: $"+tokenEnv+" when set)")
	fs.StringVar(&sec.caFile, "ca-file", "", "PEM CA certificates to verify the server's TLS certificate with (default: the system's)")
	fs.StringVar(&sec.certFile, "cert-file", "", "PEM client certificate for mutual TLS (with --key-file)")
	fs.StringVar(&sec.keyFile, "key-file", "", "PEM key of --cert-file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return fmt.Errorf("want one scenario file, got %q", fs.Args())
	}
	if *serveFlag && *compare {
		return errors.New("--serve and --compare are exclusive (--compare starts its own servers)")
	}
	if *search && *compare {
		return errors.New("--search and --compare are exclusive")
	}
	if *policy != "" && !*serveFlag {
		return errors.New("--policy needs --serve (or use --compare)")
	}
	sc, err := loadtest.LoadScenario(fs.Arg(0))
	if err != nil {
		return err
	}
	opts := loadtest.Options{
		HTTPBase: strings.TrimSuffix(*httpBase, "/"), GRPCAddr: *grpcAddr,
		Duration: *duration, MaxInFlight: *maxInFlight, Connections: *connections,
	}
	if *connections < 0 {
		return fmt.Errorf("--connections %d: want 1 or more (0: %d)", *connections, loadtest.DefaultConnections)
	}
	if err := sec.apply(&opts, os.Getenv); err != nil {
		return err
	}
	if opts.TLS != nil && (*serveFlag || *compare) {
		return errors.New("--serve and --compare start plain servers; the TLS flags are for a running server")
	}
	if *warmup >= 0 {
		opts.Warmup, opts.WarmupSet = *warmup, true
	}
	if !*quiet {
		opts.Progress = stderr
		opts.ProgressLines = !isTerminal(stderr)
	}
	dir := *out
	if dir == "" {
		dir = filepath.Join("loadtest-results", sc.Name+"-"+time.Now().Format("20060102-150405"))
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	logf := func(format string, args ...any) { fmt.Fprintf(stderr, "loadtest: "+format+"\n", args...) }
	so := loadtest.ServerOptions{Config: *serverConfig, Set: serverSets, DefaultWeight: *clientDefaultWeight}

	switch {
	case *compare:
		ps := sc.Server.Policies
		if *policies != "" {
			ps = strings.Split(*policies, ",")
		}
		if len(ps) == 0 {
			return errors.New("--compare: no policies (give --policies or server.policies in the scenario)")
		}
		var logs []*os.File
		defer func() {
			for _, f := range logs {
				f.Close()
			}
		}()
		var runs []*loadtest.Run
		var sums []*loadtest.Summary
		for _, p := range ps {
			f, err := os.Create(filepath.Join(dir, "server-"+p+".log"))
			if err != nil {
				return err
			}
			logs = append(logs, f)
			so.Log = f
			run, err := loadtest.RunPolicy(ctx, sc, p, so, opts, logf)
			if err != nil {
				return err
			}
			sum, err := writeRun(filepath.Join(dir, p), run)
			if err != nil {
				return err
			}
			runs, sums = append(runs, run), append(sums, sum)
		}
		return writeComparison(dir, runs, sums, stdout)

	case *search:
		if *serveFlag {
			stop, err := startOwnServer(ctx, dir, sc, *policy, so, &opts)
			if err != nil {
				return err
			}
			defer stop()
		}
		opts.Progress = nil // one line per probe is enough
		res, err := loadtest.Search(ctx, sc, opts, loadtest.SearchOptions{Target: *searchTarget, Probe: *searchProbe}, logf)
		if res != nil {
			if werr := writeJSONFile(filepath.Join(dir, "search.json"), res); werr != nil && err == nil {
				err = werr
			}
			fmt.Fprintf(stdout, "highest scale keeping %.2f%% attainment: %.3g x the scenario's rates (%d probes); report in %s\n",
				100*res.Target, res.Scale, len(res.Probes), dir)
		}
		return err

	default:
		if *serveFlag {
			stop, err := startOwnServer(ctx, dir, sc, *policy, so, &opts)
			if err != nil {
				return err
			}
			defer stop()
		}
		run, err := loadtest.Execute(ctx, sc, opts)
		if run == nil {
			return err
		}
		sum, werr := writeRun(dir, run)
		if werr != nil {
			return werr
		}
		if werr := writeHTML(filepath.Join(dir, "report.html"), []*loadtest.Run{run}); werr != nil {
			return werr
		}
		printSummary(stdout, sum)
		fmt.Fprintf(stdout, "report: %s\n", filepath.Join(dir, "report.html"))
		return err
	}
}

// startOwnServer starts a server for the run (--serve) with its log in
// dir/server.log and points opts at it; stop stops it and closes the log.
func startOwnServer(ctx context.Context, dir string, sc *loadtest.Scenario, policy string, so loadtest.ServerOptions, opts *loadtest.Options) (stop func(), err error) {
	f, err := os.Create(filepath.Join(dir, "server.log"))
	if err != nil {
		return nil, err
	}
	so.Log = f
	srv, err := loadtest.StartServer(ctx, sc, policy, so)
	if err != nil {
		f.Close()
		return nil, err
	}
	opts.HTTPBase, opts.GRPCAddr = srv.HTTPBase, srv.GRPCAddr
	return func() { srv.Stop(time.Minute); f.Close() }, nil
}

// writeRun writes one run's summary, timeline and records into dir and
// returns the summary.
func writeRun(dir string, run *loadtest.Run) (*loadtest.Summary, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	sum := loadtest.Summarize(run)
	if err := writeFile(filepath.Join(dir, "summary.json"), sum.WriteJSON); err != nil {
		return nil, err
	}
	rows := loadtest.Timeline(run)
	if err := writeFile(filepath.Join(dir, "timeline.csv"), func(w io.Writer) error { return loadtest.WriteTimelineCSV(w, rows) }); err != nil {
		return nil, err
	}
	return sum, writeFile(filepath.Join(dir, "records.csv"), func(w io.Writer) error { return loadtest.WriteRecordsCSV(w, run) })
}

func writeComparison(dir string, runs []*loadtest.Run, sums []*loadtest.Summary, stdout io.Writer) error {
	cmp := loadtest.Compare(sums)
	if err := writeFile(filepath.Join(dir, "comparison.json"), cmp.WriteJSON); err != nil {
		return err
	}
	if err := writeHTML(filepath.Join(dir, "report.html"), runs); err != nil {
		return err
	}
	for _, s := range sums {
		fmt.Fprintf(stdout, "== policy %s\n", s.Policy)
		printSummary(stdout, s)
	}
	for _, r := range cmp.Ratios {
		fmt.Fprintf(stdout, "%s / %s: latency-critical goodput %.2fx, total goodput %.2fx, best-effort throughput %.2fx\n",
			r.Of, r.Over, r.LCGoodput, r.TotalGoodput, r.BEThroughput)
	}
	fmt.Fprintf(stdout, "report: %s\n", filepath.Join(dir, "report.html"))
	return nil
}

func printSummary(w io.Writer, s *loadtest.Summary) {
	fmt.Fprintf(w, "%-18s %-16s %8s %8s %9s %8s %8s %8s %7s\n", "model", "class", "requests", "goodput", "attain", "p50ms", "p99ms", "rejected", "share")
	for _, m := range s.Models {
		share := fmt.Sprintf("%7.2f", m.ShareMean)
		if len(s.Unfilled) > 0 {
			share = fmt.Sprintf("%7s", "-")
		}
		fmt.Fprintf(w, "%-18s %-16s %8d %8.2f %8.2f%% %8.1f %8.1f %8d %s\n", m.Name, m.Class, m.Requests, m.Goodput,
			100*m.Attainment, m.P50ms, m.P99ms, m.Outcomes["rejected"], share)
	}
	if len(s.Unfilled) > 0 {
		fmt.Fprintf(w, "not filled (the server has no GET /v2/control: not sloserve): %s\n", strings.Join(s.Unfilled, "; "))
	}
	if s.Generator.Behind {
		fmt.Fprintf(w, "warning: the generator fell behind (p99 lag %.1f ms, max %.1f ms): the client limited this run\n", s.Generator.LagP99ms, s.Generator.LagMaxms)
	}
}

func writeHTML(path string, runs []*loadtest.Run) error {
	return writeFile(path, func(w io.Writer) error { return loadtest.WriteHTML(w, runs) })
}

func writeJSONFile(path string, v any) error {
	return writeFile(path, func(w io.Writer) error {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	})
}

func writeFile(path string, write func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		f.Close()
		return fmt.Errorf("%s: %w", path, err)
	}
	return f.Close()
}

// isTerminal reports whether w is a character device (a progress line can
// be rewritten in place).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// tokenEnv is the environment variable loadtest takes a bearer token from
// when --token-file is not given.
const tokenEnv = "SLOSERVE_TOKEN"

// clientSecurity is how loadtest reaches a secured server: a bearer token
// (from a file or the environment, never a flag, which shows in ps) and
// TLS.
type clientSecurity struct {
	tokenFile, caFile, certFile, keyFile string
}

// apply sets opts.Token and opts.TLS. TLS is on when the REST base URL is
// https:// or a CA or client certificate is given; it then applies to
// gRPC too.
func (c clientSecurity) apply(opts *loadtest.Options, getenv func(string) string) error {
	switch {
	case c.tokenFile != "":
		b, err := os.ReadFile(c.tokenFile)
		if err != nil {
			return fmt.Errorf("--token-file: %w", err)
		}
		if opts.Token = strings.TrimSpace(string(b)); opts.Token == "" {
			return fmt.Errorf("--token-file: %s is empty", c.tokenFile)
		}
	default:
		opts.Token = strings.TrimSpace(getenv(tokenEnv))
	}
	if (c.certFile == "") != (c.keyFile == "") {
		return errors.New("--cert-file and --key-file go together")
	}
	if !strings.HasPrefix(opts.HTTPBase, "https://") && c.caFile == "" && c.certFile == "" {
		return nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if c.caFile != "" {
		pool, err := configs.LoadCertPool(c.caFile)
		if err != nil {
			return fmt.Errorf("--ca-file: %w", err)
		}
		cfg.RootCAs = pool
	}
	if c.certFile != "" {
		cert, err := configs.LoadKeyPair(c.certFile, c.keyFile)
		if err != nil {
			return fmt.Errorf("--cert-file: %w", err)
		}
		cfg.Certificates = []tls.Certificate{*cert}
	}
	if strings.HasPrefix(opts.HTTPBase, "http://") {
		return errors.New("TLS flags given but --http is http://; use https://")
	}
	opts.TLS = cfg
	return nil
}
