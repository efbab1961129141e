package loadtest

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/sloserve/sloserve/api"
)

// Options say where a run sends its requests and what it shows meanwhile.
type Options struct {
	HTTPBase string // the server's REST base URL, e.g. http://127.0.0.1:8000
	GRPCAddr string // the server's gRPC address, e.g. 127.0.0.1:8001
	// TLS, when set, is the client side of TLS for REST (an https://
	// HTTPBase) and gRPC: the CAs to trust, a client certificate.
	TLS *tls.Config
	// Token, when set, goes with every request as "Authorization: Bearer
	// <Token>" (gRPC metadata "authorization").
	Token string
	// Progress, when set, gets a live progress line once a second ("\r"-
	// rewritten when it is a terminal-like writer; one line per second in
	// logs otherwise).
	Progress io.Writer
	// ProgressLines writes a new line each second instead of rewriting one.
	ProgressLines bool
	// MaxInFlight bounds the requests in flight per model; an arrival that
	// finds the bound reached is recorded as dropped by the generator.
	// 0: 2048.
	MaxInFlight int
	// SharePeriod is how often the server's shares are read (GET
	// /v2/control); 0: 1 s; negative: never.
	SharePeriod time.Duration
	// Connections is how many gRPC connections each gRPC model's requests
	// take in turn, for models whose scenario does not say; 0:
	// DefaultConnections.
	Connections int
	// Scale multiplies every open-loop model's rate (the capacity
	// search); 0: 1.
	Scale float64
	// Duration, when set, overrides the scenario's measured window.
	Duration time.Duration
	// Warmup, when >= 0 and WarmupSet, overrides the scenario's.
	Warmup    time.Duration
	WarmupSet bool
}

// bearerTransport adds an Authorization header to every request.
type bearerTransport struct {
	base  http.RoundTripper
	value string
}

func (b bearerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", b.value)
	return b.base.RoundTrip(r)
}

func (b bearerTransport) CloseIdleConnections() {
	if c, ok := b.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// bearerCredentials sends the token with every gRPC call.
type bearerCredentials struct {
	token string
	tls   bool
}

func (b bearerCredentials) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

// RequireTransportSecurity is false without TLS so a token can be used
// against a plain server on a trusted network (or loopback); it then
// travels in clear text.
func (b bearerCredentials) RequireTransportSecurity() bool { return b.tls }

// grpcDialOptions are the transport credentials and token of opts.
func grpcDialOptions(opts Options) []grpc.DialOption {
	creds := insecure.NewCredentials()
	if opts.TLS != nil {
		creds = credentials.NewTLS(opts.TLS)
	}
	out := []grpc.DialOption{grpc.WithTransportCredentials(creds)}
	if opts.Token != "" {
		out = append(out, grpc.WithPerRPCCredentials(bearerCredentials{token: opts.Token, tls: opts.TLS != nil}))
	}
	return out
}

// Execute runs scenario sc against a running server and returns every
// request's record, the server's shares over the run and its adjuster's
// decisions. Cancelling ctx ends the run early; what was recorded so far is
// returned with ctx's error.
func Execute(ctx context.Context, sc *Scenario, opts Options) (*Run, error) {
	if opts.Scale == 0 {
		opts.Scale = 1
	}
	if opts.MaxInFlight == 0 {
		opts.MaxInFlight = 2048
	}
	if opts.SharePeriod == 0 {
		opts.SharePeriod = time.Second
	}
	sc2 := *sc
	if opts.Duration > 0 {
		sc2.Duration = opts.Duration
	}
	if opts.WarmupSet {
		sc2.Warmup = opts.Warmup
	}
	sc = &sc2

	tr := &http.Transport{
		MaxIdleConns:        4096,
		MaxIdleConnsPerHost: 4096,
		IdleConnTimeout:     90 * time.Second,
		TLSClientConfig:     opts.TLS,
	}
	hc := &http.Client{Transport: tr}
	if opts.Token != "" {
		hc.Transport = bearerTransport{base: tr, value: "Bearer " + opts.Token}
	}
	defer hc.CloseIdleConnections()
	ctl, err := awaitControl(ctx, hc, opts.HTTPBase, sc.Models, 15*time.Second)
	switch {
	case errors.Is(err, errNoControl):
		// Another OIP v2 server: SLO and class come from the scenario,
		// and what only sloserve reports stays empty, said so.
		ctl = nil
		opts.SharePeriod = -1
	case err != nil:
		return nil, err
	}
	for _, m := range sc.Models {
		if m.Protocol == ProtoGRPC && opts.GRPCAddr == "" {
			return nil, fmt.Errorf("model %s: protocol grpc needs the server's gRPC address", m.Model)
		}
	}

	run := &Run{Scenario: sc.Name, Duration: sc.Duration}
	if ctl != nil {
		run.Policy = ctl.Policy
	} else {
		run.Unfilled = slices.Clone(UnfilledWithoutControl)
	}
	drivers := make([]*driver, len(sc.Models))
	ids := map[string]*atomic.Int64{}
	for i := range sc.Models {
		d, err := newDriver(ctx, sc, i, opts, hc, ctl)
		if err != nil {
			for _, d := range drivers[:i] {
				d.client.Close()
			}
			return nil, fmt.Errorf("model %s: %w", sc.Models[i].Model, err)
		}
		if ids[d.info.Name] == nil {
			ids[d.info.Name] = new(atomic.Int64)
		}
		d.ids = ids[d.info.Name]
		drivers[i] = d
		run.Models = append(run.Models, d.info)
	}
	defer func() {
		for _, d := range drivers {
			d.client.Close()
		}
	}()

	// Offset 0 is the start of the measured window, Warmup from now.
	start := time.Now().Add(sc.Warmup)
	run.Started = start
	end := start.Add(sc.Duration)
	runCtx, cancel := context.WithDeadline(ctx, end)
	defer cancel()

	var wg sync.WaitGroup
	for _, d := range drivers {
		wg.Go(func() { d.drive(runCtx, start, end) })
	}
	var shares []ShareSample
	var sharesDone = make(chan struct{})
	go func() {
		defer close(sharesDone)
		if opts.SharePeriod > 0 {
			shares = pollShares(runCtx, hc, opts.HTTPBase, start, opts.SharePeriod, drivers)
		}
	}()
	progressDone := make(chan struct{})
	go func() {
		defer close(progressDone)
		if opts.Progress != nil {
			progress(runCtx, opts.Progress, !opts.ProgressLines, start, sc.Duration, drivers)
		}
	}()
	wg.Wait() // every driver waits for its requests in flight
	cancel()
	<-sharesDone
	<-progressDone

	run.Shares = shares
	for i, d := range drivers {
		for _, r := range d.records {
			r.Model = i
			run.Records = append(run.Records, r)
		}
	}
	// The adjuster's decisions over the run, by model (sloserve only).
	if ctl != nil {
		events, err := fetchEvents(context.WithoutCancel(ctx), hc, opts.HTTPBase, start.Add(-sc.Warmup))
		if err != nil {
			events = nil // a run without them is still a run
		}
		for _, e := range events {
			idx := -1
			for i, d := range drivers {
				if d.owns(e.Model) {
					idx = i
				}
			}
			run.Events = append(run.Events, Event{
				At: e.Time.Sub(start), Model: idx, Kind: e.Kind,
				Old: e.Old.Compute, New: e.New.Compute, Reason: e.Reason,
			})
		}
	}
	return run, ctx.Err()
}

// driver sends one model's requests.
type driver struct {
	info     ModelInfo
	client   *Client
	arrivals []time.Duration // open loop; nil for a closed loop
	clients  int             // closed loop
	timeout  time.Duration
	version  string
	// maxInFlight bounds an open loop's requests in flight (Pacer).
	maxInFlight int

	mu      sync.Mutex
	records []Record
	// Live counters for the progress line.
	sent, good, done atomic.Int64
	// ids numbers the requests to the model, shared by every entry of the
	// scenario that drives it (each request's id, Record.ID).
	ids    *atomic.Int64
	lagMax atomic.Int64 // ns, reset each progress tick
}

func newDriver(ctx context.Context, sc *Scenario, i int, opts Options, hc *http.Client, ctl *api.ControlStatus) (*driver, error) {
	m := &sc.Models[i]
	md, err := FetchMetadata(ctx, hc, opts.HTTPBase, m.Model, m.Version)
	if err != nil {
		return nil, err
	}
	specs := make(map[string]InputSpec, len(m.Inputs))
	for name, in := range m.Inputs {
		specs[name] = InputSpec{Shape: in.Shape, Data: in.Data, File: sc.Path(in.File)}
	}
	inputs, err := BuildInputs(md, specs, sc.Seed+uint64(i))
	if err != nil {
		return nil, err
	}
	info := ModelInfo{Name: m.Model, Class: m.Class, SLO: m.SLO, Protocol: m.Protocol}
	if ctl == nil {
		if info.SLO <= 0 {
			return nil, errors.New("no SLO: the server has no GET /v2/control (not sloserve), so the scenario must give slo")
		}
	} else if mc, ok := controlModel(ctl, m.Model, m.Version); ok {
		if info.Class == "" {
			info.Class = mc.Class
		}
		if info.SLO == 0 {
			info.SLO = time.Duration(mc.SLOms * float64(time.Millisecond))
		}
	}
	if info.SLO <= 0 {
		return nil, errors.New("no SLO: the server reports none for it (GET /v2/control); give slo in the scenario")
	}
	if info.Class == "" {
		info.Class = LatencyCritical
	}
	timeout := m.Timeout
	if timeout == 0 {
		timeout = max(4*info.SLO, time.Second)
	}
	var header http.Header
	if opts.Token != "" {
		header = http.Header{"Authorization": {"Bearer " + opts.Token}}
	}
	client, err := NewClient(ClientOptions{
		Protocol: m.Protocol, HTTPBase: opts.HTTPBase, GRPCAddr: opts.GRPCAddr,
		Model: m.Model, Version: m.Version, Inputs: inputs,
		Timeout: timeout, ServerTimeout: timeout,
		TLS: opts.TLS, Header: header, Connections: cmp.Or(m.Connections, opts.Connections),
		GRPCDialOptions: grpcDialOptions(opts),
	})
	if err != nil {
		return nil, err
	}
	d := &driver{info: info, client: client, timeout: timeout, version: m.Version,
		maxInFlight: opts.MaxInFlight}
	if m.Concurrency > 0 {
		d.clients = m.Concurrency
		d.info.Load = fmt.Sprintf("closed loop, %d clients", m.Concurrency)
		return d, nil
	}
	offs, desc, err := sc.arrivals(i, opts.Scale)
	if err != nil {
		client.Close()
		return nil, err
	}
	d.arrivals, d.info.Load = offs, desc
	return d, nil
}

// owns reports whether the server's "model/version" name is this driver's.
func (d *driver) owns(name string) bool {
	model, version, _ := strings.Cut(name, "/")
	return model == d.info.Name && (d.version == "" || version == d.version)
}

func (d *driver) drive(ctx context.Context, start, end time.Time) {
	var wg sync.WaitGroup
	defer wg.Wait()
	if d.arrivals == nil {
		for range d.clients {
			wg.Go(func() {
				for ctx.Err() == nil {
					d.send(ctx, start, time.Since(start))
				}
			})
		}
		return
	}
	pacer := Pacer{Start: start, MaxInFlight: d.maxInFlight, MaxLag: d.timeout,
		Send: func(_ int, at time.Duration) { d.send(ctx, start, at) },
		Drop: func(_ int, at time.Duration, detail string) {
			if at >= 0 {
				d.add(Record{Scheduled: at, Sent: at, Outcome: Dropped, Detail: detail})
			}
		},
	}
	pacer.Run(ctx, d.arrivals)
}

// send sends one request scheduled at offset at and records it when it
// belongs to the measured window. The request keeps its own timeout past
// the end of the window: a run waits for what it sent.
func (d *driver) send(ctx context.Context, start time.Time, at time.Duration) {
	sent := time.Since(start)
	if lag := int64(sent - at); lag > d.lagMax.Load() {
		d.lagMax.Store(lag)
	}
	d.sent.Add(1)
	id := d.ids.Add(1)
	o, detail := d.client.InferID(context.WithoutCancel(ctx), strconv.FormatInt(id, 10))
	lat := time.Since(start) - sent
	if o == Good && lat > d.info.SLO {
		o = Late
	}
	d.done.Add(1)
	if o == Good {
		d.good.Add(1)
	}
	if at < 0 {
		return // warmup
	}
	d.add(Record{Scheduled: at, Sent: sent, Latency: lat, Outcome: o, Detail: detail, ID: id})
}

func (d *driver) add(r Record) {
	d.mu.Lock()
	d.records = append(d.records, r)
	d.mu.Unlock()
}

// progress writes a progress line each second until ctx ends.
func progress(ctx context.Context, w io.Writer, rewrite bool, start time.Time, total time.Duration, drivers []*driver) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	type last struct{ sent, good, done int64 }
	prev := make([]last, len(drivers))
	for {
		select {
		case <-ctx.Done():
			if rewrite {
				fmt.Fprintln(w)
			}
			return
		case <-tick.C:
		}
		el := time.Since(start)
		phase := "warmup"
		if el >= 0 {
			phase = fmt.Sprintf("%s/%s", el.Truncate(time.Second), total)
		}
		var b strings.Builder
		fmt.Fprintf(&b, "[%s]", phase)
		var behind time.Duration
		for i, d := range drivers {
			cur := last{d.sent.Load(), d.good.Load(), d.done.Load()}
			done := cur.done - prev[i].done
			att := "-"
			if done > 0 {
				att = fmt.Sprintf("%.0f%%", 100*float64(cur.good-prev[i].good)/float64(done))
			}
			fmt.Fprintf(&b, " %s %d/s good %s, in flight %d;", d.info.Name, cur.sent-prev[i].sent, att, cur.sent-cur.done)
			prev[i] = cur
			behind = max(behind, time.Duration(d.lagMax.Swap(0)))
		}
		if behind > 10*time.Millisecond {
			fmt.Fprintf(&b, " GENERATOR BEHIND by %s", behind.Round(time.Millisecond))
		}
		line := strings.TrimSuffix(b.String(), ";")
		if rewrite {
			fmt.Fprintf(w, "\r\033[K%s", line)
		} else {
			fmt.Fprintln(w, line)
		}
	}
}

// controlModel finds a model's entry in the control status: the given
// version, or its highest one.
func controlModel(c *api.ControlStatus, name, version string) (api.ModelControl, bool) {
	var found api.ModelControl
	ok := false
	for _, dev := range c.Devices {
		for _, m := range dev.Models {
			mn, mv, _ := strings.Cut(m.Model, "/")
			if mn != name || (version != "" && mv != version) {
				continue
			}
			if !ok || versionLess(found.Model, m.Model) {
				found, ok = m, true
			}
		}
	}
	return found, ok
}

func versionLess(a, b string) bool {
	_, va, _ := strings.Cut(a, "/")
	_, vb, _ := strings.Cut(b, "/")
	if len(va) != len(vb) {
		return len(va) < len(vb)
	}
	return va < vb
}

// errNoControl is fetchControl's answer from a server that has no GET
// /v2/control: any Open Inference Protocol server but sloserve.
var errNoControl = errors.New("the server has no GET /v2/control")

// UnfilledWithoutControl are the parts of a run's report that only
// sloserve's GET /v2/control and /v2/control/events fill: against another
// server they stay empty, and the report says so.
var UnfilledWithoutControl = []string{
	"policy",
	"share (share_mean, share_min, share_max)",
	"share_changes",
	"timeline compute_share, target_share, forecast_rate, predicted_ms, observed_ms, events",
	"adjuster events",
}

// noControlStatuses are the answers of a server without the endpoint: not
// found as most servers say it, and the other refusals of a path a server
// does not route (Triton's HTTP frontend answers 400 for one).
var noControlStatuses = []int{http.StatusNotFound, http.StatusBadRequest, http.StatusMethodNotAllowed, http.StatusNotImplemented}

func fetchControl(ctx context.Context, hc *http.Client, base string) (*api.ControlStatus, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var c api.ControlStatus
	if err := getJSON(ctx, hc, base+"/v2/control", &c); err != nil {
		var se *httpStatusError
		if errors.As(err, &se) && slices.Contains(noControlStatuses, se.code) {
			return nil, fmt.Errorf("%w (%w)", errNoControl, err)
		}
		return nil, err
	}
	return &c, nil
}

// awaitControl reads the server's control status, again until it lists
// every model whose SLO the scenario does not give (a model just loaded
// appears at the adjuster's next pass) or wait has passed.
func awaitControl(ctx context.Context, hc *http.Client, base string, models []ModelLoad, wait time.Duration) (*api.ControlStatus, error) {
	deadline := time.Now().Add(wait)
	for {
		c, err := fetchControl(ctx, hc, base)
		if err != nil {
			return nil, err
		}
		missing := false
		for _, m := range models {
			if _, ok := controlModel(c, m.Model, m.Version); !ok && m.SLO == 0 {
				missing = true
			}
		}
		if !missing || time.Now().After(deadline) {
			return c, nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// pollShares reads the server's shares every period until ctx ends.
func pollShares(ctx context.Context, hc *http.Client, base string, start time.Time, period time.Duration, drivers []*driver) []ShareSample {
	var out []ShareSample
	tick := time.NewTicker(period)
	defer tick.Stop()
	for {
		if at := time.Since(start); at >= 0 {
			if c, err := fetchControl(ctx, hc, base); err == nil {
				for i, d := range drivers {
					if m, ok := controlModel(c, d.info.Name, d.version); ok {
						out = append(out, ShareSample{
							At: at, Model: i, Compute: m.ComputeShare, Target: m.TargetShare,
							ForecastRate: m.ForecastRate, PredictedMs: m.PredictedMs, ObservedMs: m.ObservedMs,
						})
					}
				}
			}
		}
		select {
		case <-ctx.Done():
			return out
		case <-tick.C:
		}
	}
}

type eventJSON struct {
	Time   time.Time `json:"time"`
	Model  string    `json:"model"`
	Kind   string    `json:"kind"`
	Reason string    `json:"reason"`
	Old    struct {
		Compute float64 `json:"compute"`
	} `json:"old"`
	New struct {
		Compute float64 `json:"compute"`
	} `json:"new"`
}

// fetchEvents reads the adjuster's decisions since a time.
func fetchEvents(ctx context.Context, hc *http.Client, base string, since time.Time) ([]eventJSON, error) {
	var out struct {
		Events []eventJSON `json:"events"`
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	u := base + "/v2/control/events?limit=10000&since=" + url.QueryEscape(since.UTC().Format(time.RFC3339Nano))
	if err := getJSON(ctx, hc, u, &out); err != nil {
		return nil, err
	}
	slices.SortFunc(out.Events, func(a, b eventJSON) int { return a.Time.Compare(b.Time) })
	return out.Events, nil
}
