package e2e

// The dashboard in a real browser: headless Chromium (Debian's chromium,
// driven over the DevTools protocol) loads /dashboard/ from a running server
// under load, and the test reads what the page rendered and compares it with
// the API.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
)

// tensorRequest is a REST binary request with one FP32 input of the given
// shape, asking for one output as binary.
func tensorRequest(t testing.TB, input string, shape []int64, output string) ([]byte, string) {
	t.Helper()
	n := int64(1)
	for _, d := range shape {
		n *= d
	}
	data := make([]float32, n)
	for i := range data {
		data[i] = float32(i%255) / 255
	}
	header, err := json.Marshal(jsonInferRequest{
		Inputs:  []jsonTensor{{Name: input, Datatype: "FP32", Shape: shape, Parameters: map[string]any{"binary_data_size": 4 * n}}},
		Outputs: []jsonTensor{{Name: output, Parameters: map[string]any{"binary_data": true}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return append(header, f32bytes(data)...), strconv.Itoa(len(header))
}

// dashboardLoad keeps closed-loop clients sending requests until the test
// ends (or stop is called), counting answers by status code.
type dashboardLoad struct {
	s     *testServer
	done  chan struct{}
	once  sync.Once
	wg    sync.WaitGroup
	mu    sync.Mutex
	codes map[string]map[int]int
}

func newDashboardLoad(t *testing.T, s *testServer) *dashboardLoad {
	l := &dashboardLoad{s: s, done: make(chan struct{}), codes: map[string]map[int]int{}}
	t.Cleanup(func() {
		l.stop()
		t.Logf("load answered: %v", l.counts())
	})
	return l
}

// clients starts n clients for model, each waiting think between requests
// (and at least 20 ms after a refusal, so refused clients do not spin).
func (l *dashboardLoad) clients(model string, n int, body []byte, hlen string, think time.Duration) {
	client := &http.Client{Timeout: 10 * time.Second}
	for range n {
		l.wg.Go(func() {
			for {
				select {
				case <-l.done:
					return
				default:
				}
				req, err := http.NewRequest("POST", l.s.http+"/v2/models/"+model+"/infer", bytes.NewReader(body))
				if err != nil {
					panic(err)
				}
				req.Header.Set("Inference-Header-Content-Length", hlen)
				req.Header.Set("Content-Type", "application/octet-stream")
				code := 0
				if resp, err := client.Do(req); err == nil {
					resp.Body.Close()
					code = resp.StatusCode
				}
				l.mu.Lock()
				if l.codes[model] == nil {
					l.codes[model] = map[int]int{}
				}
				l.codes[model][code]++
				l.mu.Unlock()
				wait := think
				if code != 200 {
					wait = max(wait, 20*time.Millisecond)
				}
				select {
				case <-l.done:
					return
				case <-time.After(wait):
				}
			}
		})
	}
}

func (l *dashboardLoad) stop() {
	l.once.Do(func() { close(l.done) })
	l.wg.Wait()
}

func (l *dashboardLoad) counts() map[string]map[int]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string]map[int]int{}
	for m, c := range l.codes {
		out[m] = map[int]int{}
		for k, v := range c {
			out[m][k] = v
		}
	}
	return out
}

// browserTab is one Chromium tab with a record of its network traffic and
// of the page's uncaught exceptions.
type browserTab struct {
	ctx     context.Context
	origin  string
	shotDir string

	mu         sync.Mutex
	urls       map[network.RequestID]string
	requests   []string
	overviews  []network.RequestID // finished GET /v2/dashboard, oldest first
	exceptions []string
}

// newBrowser starts headless Chromium with a fresh profile and opens a tab.
func newBrowser(t *testing.T, origin string, width, height int) *browserTab {
	t.Helper()
	exe := requireChromium(t)
	profile, err := os.MkdirTemp("", "sloserve-chromium-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Chromium's helpers can write into the profile shortly after the
		// browser stops; try again for a while.
		for range 50 {
			if os.RemoveAll(profile) == nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(exe),
		chromedp.Headless,
		chromedp.NoSandbox, // root in the sandbox the tests run in
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.UserDataDir(profile),
		chromedp.WindowSize(width, height),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("disable-default-apps", true),
		chromedp.Flag("disable-breakpad", true),
		chromedp.Flag("disable-background-timer-throttling", true),
		chromedp.Flag("disable-renderer-backgrounding", true),
		chromedp.Flag("hide-scrollbars", true),
		chromedp.Flag("mute-audio", true),
	}
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelTab := chromedp.NewContext(allocCtx)
	t.Cleanup(func() {
		cancelTab()
		cancelAlloc()
	})
	b := &browserTab{ctx: ctx, origin: origin, shotDir: t.TempDir(), urls: map[network.RequestID]string{}}
	err = chromedp.Listen(ctx, func(ev any) {
		b.mu.Lock()
		defer b.mu.Unlock()
		switch e := ev.(type) {
		case *network.EventRequestWillBeSent:
			b.urls[e.RequestID] = e.Request.URL
			b.requests = append(b.requests, e.Request.URL)
		case *network.EventLoadingFinished:
			if u := b.urls[e.RequestID]; strings.HasPrefix(u, origin+"/v2/dashboard") && !strings.HasPrefix(u, origin+"/v2/dashboard/") {
				b.overviews = append(b.overviews, e.RequestID)
			}
		case *runtime.EventExceptionThrown:
			d := e.ExceptionDetails
			msg := d.Text
			if d.Exception != nil {
				msg += " " + d.Exception.Description
			}
			b.exceptions = append(b.exceptions, fmt.Sprintf("%s (%s:%d:%d)", msg, d.URL, d.LineNumber+1, d.ColumnNumber+1))
		}
	})
	if err != nil {
		t.Fatalf("starting chromium: %v", err)
	}
	if _, err := chromedp.Call(ctx, network.Enable, network.EnableParams{}); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.Call(ctx, network.SetCacheDisabled, network.SetCacheDisabledParams{CacheDisabled: true}); err != nil {
		t.Fatal(err)
	}
	return b
}

func (b *browserTab) do(t *testing.T, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 60*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		t.Fatal(err)
	}
}

// eval runs a script in the page and decodes its JSON result into out.
func (b *browserTab) eval(t *testing.T, script string, out any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	raw, err := chromedp.Run(ctx, chromedp.Evaluate[[]byte](script))
	if err != nil {
		t.Fatalf("evaluating %.60q: %v", script, err)
	}
	if err := json.Unmarshal(raw, out); err != nil {
		t.Fatalf("decoding %s: %v", raw, err)
	}
}

// waitJS waits until the script evaluates to true.
func (b *browserTab) waitJS(t *testing.T, what string, timeout time.Duration, script string) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		var ok bool
		b.eval(t, "!!("+script+")", &ok)
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// overviewAt finds, among the overview responses the page received, the
// one whose time is time, and returns its body.
func (b *browserTab) overviewAt(t *testing.T, when string) []byte {
	t.Helper()
	b.mu.Lock()
	ids := append([]network.RequestID(nil), b.overviews...)
	b.mu.Unlock()
	for i := len(ids) - 1; i >= 0 && i >= len(ids)-20; i-- {
		res, err := chromedp.Call(b.ctx, network.GetResponseBody, network.GetResponseBodyParams{RequestID: ids[i]})
		if err != nil {
			continue // evicted
		}
		var head struct{ Time string }
		if json.Unmarshal(res.Body, &head) == nil && head.Time == when {
			return res.Body
		}
	}
	t.Fatalf("none of the last %d overview responses the page received has time %s", min(len(ids), 20), when)
	return nil
}

// screenshot saves a PNG of the viewport (or the whole page) to the test's
// temporary directory and, for the pictures the README shows (publish),
// to SLOSERVE_DASHBOARD_SCREENSHOT_DIR when that is set.
func (b *browserTab) screenshot(t *testing.T, name string, fullPage, publish bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 60*time.Second)
	defer cancel()
	shot := chromedp.CaptureScreenshot()
	if fullPage {
		shot = chromedp.FullScreenshot(100)
	}
	png, err := chromedp.Run(ctx, shot)
	if err != nil {
		t.Fatal(err)
	}
	dirs := []string{b.shotDir}
	if d := os.Getenv("SLOSERVE_DASHBOARD_SCREENSHOT_DIR"); d != "" && publish {
		dirs = append(dirs, d)
	}
	for _, d := range dirs {
		p := filepath.Join(d, name)
		if err := os.WriteFile(p, png, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("screenshot: %s", p)
	}
}

// checkNetwork fails the test if the page requested anything outside the
// server's origin or threw an exception.
func (b *browserTab) checkNetwork(t *testing.T) {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, u := range b.requests {
		if !strings.HasPrefix(u, b.origin+"/") && !strings.HasPrefix(u, "data:") {
			t.Errorf("the page requested %s, outside the server's origin %s", u, b.origin)
		}
	}
	for _, e := range b.exceptions {
		t.Errorf("the page threw: %s", e)
	}
	if len(b.requests) == 0 {
		t.Error("no network request was recorded")
	}
}

// What the overview page shows, read in one go so that it all comes from
// one render.
type shownOverview struct {
	Time         string     `json:"time"`
	Renders      int        `json:"renders"`
	Rows         []shownRow `json:"rows"`
	Headline     string     `json:"headline"`
	MissingCount string     `json:"missingCount"`
	Devices      []struct {
		Device   string `json:"device"`
		BarWidth float64
		Compute  []struct {
			Segment string  `json:"segment"`
			Share   string  `json:"share"`
			Models  string  `json:"models"`
			Width   float64 `json:"width"`
		} `json:"compute"`
	} `json:"devices"`
	Events      int    `json:"events"`
	Live        string `json:"live"`
	ScrollWidth int    `json:"scrollWidth"`
}

type shownRow struct {
	Model  string                `json:"model"`
	Key    string                `json:"key"`
	Status string                `json:"status"`
	Fields map[string]shownField `json:"fields"`
}

type shownField struct {
	Value string `json:"value"` // the API's value, as JSON
	Text  string `json:"text"`  // what a person reads
}

const readOverviewJS = `(() => {
  const own = (el) => { const c = el.cloneNode(true); c.querySelectorAll('.sub, .ratio, .slobar').forEach((x) => x.remove()); return c.textContent.trim(); };
  const rows = [...document.querySelectorAll('table.models tbody tr')].map((tr) => {
    const fields = {};
    tr.querySelectorAll('[data-field]').forEach((el) => { fields[el.dataset.field] = { value: el.dataset.value, text: own(el) }; });
    return { model: tr.dataset.model, key: tr.dataset.key, status: tr.dataset.status, fields };
  });
  const devices = [...document.querySelectorAll('.device')].map((d) => {
    const bar = d.querySelector('.bar.compute');
    return { device: d.dataset.device, BarWidth: bar ? bar.getBoundingClientRect().width : 0,
      compute: [...d.querySelectorAll('.bar.compute .seg')].map((s) => ({ segment: s.dataset.segment || '', share: s.dataset.share || '', models: s.dataset.models || '', width: s.getBoundingClientRect().width })) };
  });
  const hl = document.getElementById('headline');
  return { time: document.body.dataset.time || '', renders: +document.body.dataset.renders || 0, rows, devices,
    headline: hl ? hl.innerText : '', missingCount: hl ? hl.dataset.missingCount || '' : '',
    events: document.querySelectorAll('table.events tbody tr').length,
    live: document.getElementById('live').dataset.live, scrollWidth: document.documentElement.scrollWidth };
})()`

// What the model page shows.
type shownModelPage struct {
	Page    string                `json:"page"`
	Renders int                   `json:"renders"`
	Status  string                `json:"status"`
	Why     string                `json:"why"`
	KPIs    map[string]shownField `json:"kpis"`
	Charts  map[string]shownChart `json:"charts"`
	Events  int                   `json:"events"`
}

type shownChart struct {
	Points int     `json:"points"`
	LastT  float64 `json:"lastT"`
	Width  float64 `json:"width"`
	Lines  []struct {
		Series   string `json:"series"`
		Vertices int    `json:"vertices"`
	} `json:"lines"`
	Series []struct {
		Series string `json:"series"`
		Points int    `json:"points"`
		Rects  int    `json:"rects"`
	} `json:"series"`
	Refs []struct {
		Ref   string  `json:"ref"`
		Value float64 `json:"value"`
	} `json:"refs"`
	Events int `json:"events"` // event marks on the time axis; -1: the chart has none
}

const readModelPageJS = `(() => {
  const charts = {};
  document.querySelectorAll('svg[data-chart]').forEach((svg) => {
    const ev = svg.querySelector('g[data-events]');
    charts[svg.dataset.chart] = {
      points: +svg.dataset.points || 0, lastT: +svg.dataset.lastT || 0, width: svg.getBoundingClientRect().width,
      lines: [...svg.querySelectorAll('path.line')].map((p) => ({ series: p.dataset.series, vertices: +p.dataset.vertices || 0 })),
      series: [...svg.querySelectorAll('g[data-series]')].map((g) => ({ series: g.dataset.series, points: +g.dataset.points || 0, rects: g.querySelectorAll('rect').length })),
      refs: [...svg.querySelectorAll('line[data-ref]')].map((l) => ({ ref: l.dataset.ref, value: +l.dataset.value })),
      events: ev ? +ev.dataset.events : -1,
    };
  });
  const head = document.querySelector('.model-head');
  const kpis = {};
  document.querySelectorAll('.kpis [data-field]').forEach((el) => { kpis[el.dataset.field] = { value: el.dataset.value, text: el.textContent.trim() }; });
  const why = document.querySelector('.why-box [data-field="why"]');
  return { page: document.body.dataset.page || '', renders: +document.body.dataset.renders || 0,
    status: head ? head.dataset.status || '' : '', why: why ? JSON.parse(why.dataset.value) : '', kpis, charts,
    events: document.querySelectorAll('table.events tbody tr').length };
})()`

// shownNumber reads a displayed number back in the API's unit: "182 ms"
// (ms), "93.2%" (a fraction), "3.4/s", "512 MiB" (bytes), "no limit" (0),
// "—" (null). tol is one unit of the last digit shown.
func shownNumber(text string) (v, tol float64, null bool, err error) {
	text = strings.TrimSpace(text)
	switch {
	case strings.HasPrefix(text, "—"):
		return 0, 0, true, nil
	case strings.HasPrefix(text, "no limit"):
		return 0, 0, false, nil
	}
	m := regexp.MustCompile(`^(-?[0-9]+(?:\.([0-9]+))?)\s*(ms|%|/s|B|KiB|MiB|GiB|TiB)?`).FindStringSubmatch(text)
	if m == nil {
		return 0, 0, false, fmt.Errorf("no number in %q", text)
	}
	v, err = strconv.ParseFloat(m[1], 64)
	if err != nil {
		return 0, 0, false, err
	}
	tol = math.Pow(10, -float64(len(m[2])))
	scale := 1.0
	switch m[3] {
	case "%":
		scale = 0.01
	case "KiB":
		scale = 1 << 10
	case "MiB":
		scale = 1 << 20
	case "GiB":
		scale = 1 << 30
	case "TiB":
		scale = 1 << 40
	}
	return v * scale, tol * scale, false, nil
}

// statusLabels are the badge texts of the statuses.
var statusLabels = map[string]string{"ok": "ok", "missing": "missing SLO", "idle": "idle", "no-slo": "no SLO", "unavailable": "unavailable"}

// TestE2EDashboard loads the dashboard in Chromium from a server with three
// models under load: ocr-det gets more requests than it can answer within
// its 25 ms SLO (missing), ocr-cls a light stream well within 500 ms (ok),
// and a wake-word model without an SLO (best effort) a steady stream.
func TestE2EDashboard(t *testing.T) {
	requireChromium(t)
	repo := t.TempDir()
	writeRepo(t, repo,
		repoModel{"ocr-det", demoModel(t, "ocr-det"), `max_batch_size: 4
slo: {latency_ms: 25, class: latency-critical}
execution: {intra_op_threads: 1}
resources: {memory_limit: 512MiB, min_compute_share: 0.1}
profile: {shapes: {x: [1, 3, 128, 128]}, batch_sizes: [1, 4]}
`},
		repoModel{"ocr-cls", demoModel(t, "ocr-cls"), `max_batch_size: 8
slo: {latency_ms: 500, class: latency-critical}
execution: {intra_op_threads: 1}
resources: {memory_limit: 256MiB, min_compute_share: 0.25}
profile: {shapes: {x: [1, 3, 48, 192]}}
`},
		repoModel{"wakeword", demoModel(t, "wakeword-hello"), `max_batch_size: 0
execution: {intra_op_threads: 1}
resources: {memory_limit: 128MiB, min_compute_share: 0.05}
`},
	)
	s := startServer(t, repo, "")

	load := newDashboardLoad(t, s)
	det, detLen := detRequest(t, 128, nil)
	load.clients("ocr-det", 5, det, detLen, 10*time.Millisecond)
	cls, clsLen := tensorRequest(t, "x", []int64{1, 3, 48, 192}, "softmax_0.tmp_0")
	load.clients("ocr-cls", 1, cls, clsLen, 300*time.Millisecond)
	ww, wwLen := tensorRequest(t, "onnx::Flatten_0", []int64{1, 25, 96}, "39")
	load.clients("wakeword", 1, ww, wwLen, 50*time.Millisecond)

	b := newBrowser(t, s.http, 1600, 1000)
	b.do(t, chromedp.EmulateViewport(1600, 1000), chromedp.Navigate(s.http+"/dashboard"))

	// The redirect lands on the page, which lists every model and, once
	// the load has had its effect, shows ocr-det missing its SLO and
	// ocr-cls meeting it.
	b.waitJS(t, "the models table", 30*time.Second, `document.querySelectorAll('table.models tbody tr').length === 3`)
	b.waitJS(t, "ocr-det missing and ocr-cls ok", 45*time.Second,
		`document.querySelector('tr[data-model="ocr-det"][data-status="missing"]') && document.querySelector('tr[data-model="ocr-cls"][data-status="ok"]')`)
	// Some history first: the charts need points, and the forecasts a
	// few seconds of arrivals.
	const minPoints = 15
	waitFor(t, "15 s of ocr-det's history", 60*time.Second, func() bool {
		var h struct {
			Series struct {
				T []float64 `json:"t"`
			} `json:"series"`
		}
		return s.json(t, "GET", "/v2/dashboard/models/ocr-det?last=900", nil, &h) == 200 && len(h.Series.T) >= minPoints
	})
	b.waitJS(t, "ocr-det missing and ocr-cls ok", 30*time.Second,
		`document.querySelector('tr[data-model="ocr-det"][data-status="missing"]') && document.querySelector('tr[data-model="ocr-cls"][data-status="ok"]')`)
	var url string
	b.eval(t, `location.pathname`, &url)
	if url != "/dashboard/" {
		t.Errorf("/dashboard led to %s, want /dashboard/", url)
	}

	t.Run("overview matches the API", func(t *testing.T) {
		var shown shownOverview
		readAt := time.Now()
		b.eval(t, readOverviewJS, &shown)
		if shown.Time == "" || shown.Renders == 0 {
			t.Fatalf("the page says nothing about what it rendered: %+v", shown)
		}
		if shown.Live != "live" {
			t.Errorf("live indicator = %q, want live", shown.Live)
		}
		// The response the page rendered, as the browser received it.
		var api struct {
			Time             string           `json:"time"`
			AttainmentTarget float64          `json:"attainment_target"`
			Models           []map[string]any `json:"models"`
			Devices          []struct {
				Device string `json:"device"`
				Shares []struct {
					Key     string  `json:"key"`
					Compute float64 `json:"compute"`
				} `json:"shares"`
			} `json:"devices"`
			Events []map[string]any `json:"events"`
		}
		if err := json.Unmarshal(b.overviewAt(t, shown.Time), &api); err != nil {
			t.Fatal(err)
		}
		if len(shown.Rows) != len(api.Models) {
			t.Fatalf("the page lists %d models, the API %d", len(shown.Rows), len(api.Models))
		}
		rows := map[string]shownRow{}
		for _, r := range shown.Rows {
			rows[r.Model] = r
		}
		missing := 0
		for _, m := range api.Models {
			name := m["name"].(string)
			r, ok := rows[name]
			if !ok {
				t.Errorf("model %s is not listed", name)
				continue
			}
			if m["status"] == "missing" {
				missing++
				if !strings.Contains(shown.Headline, name) {
					t.Errorf("the headline %q does not name %s, which misses its SLO", shown.Headline, name)
				}
			}
			if r.Status != m["status"] || r.Key != m["key"] {
				t.Errorf("%s: row status %q key %q, API %q %q", name, r.Status, r.Key, m["status"], m["key"])
			}
			if got, want := r.Fields["status"].Text, statusLabels[m["status"].(string)]; !strings.Contains(got, want) {
				t.Errorf("%s: status badge reads %q, want %q", name, got, want)
			}
			// Every value the row shows is the API's, and its text says
			// the same number.
			for f, sf := range r.Fields {
				var shownV any
				if err := json.Unmarshal([]byte(sf.Value), &shownV); err != nil {
					t.Errorf("%s.%s: data-value %q: %v", name, f, sf.Value, err)
					continue
				}
				apiV, ok := m[f]
				if !ok {
					t.Errorf("%s: the page shows a field %q the API does not have", name, f)
					continue
				}
				if !reflect.DeepEqual(shownV, apiV) {
					t.Errorf("%s.%s: the page has %v, the API %v", name, f, shownV, apiV)
					continue
				}
				switch f {
				case "slo_ms", "p99_ms", "attainment", "goodput", "arrival_rate", "forecast_rate",
					"compute_share", "target_compute_share", "memory_share_bytes", "memory_used_bytes":
					v, tol, null, err := shownNumber(sf.Text)
					switch {
					case err != nil:
						t.Errorf("%s.%s: %v", name, f, err)
					case null != (apiV == nil):
						t.Errorf("%s.%s: shows %q for %v", name, f, sf.Text, apiV)
					case !null && math.Abs(v-apiV.(float64)) > tol*1.0001:
						t.Errorf("%s.%s: shows %q for %v", name, f, sf.Text, apiV)
					}
				case "name", "class", "why":
					if apiV != "" && sf.Text != apiV {
						t.Errorf("%s.%s: shows %q, want %q", name, f, sf.Text, apiV)
					}
				case "version":
					if sf.Text != "v"+apiV.(string) {
						t.Errorf("%s.version: shows %q, want v%s", name, sf.Text, apiV)
					}
				}
			}
			for _, f := range []string{"name", "slo_ms", "p99_ms", "attainment", "goodput", "arrival_rate", "compute_share", "memory_share_bytes", "why"} {
				if _, ok := r.Fields[f]; !ok {
					t.Errorf("%s: the row has no %s", name, f)
				}
			}
		}
		if shown.MissingCount != strconv.Itoa(missing) {
			t.Errorf("the headline counts %s models missing their SLO, the API %d", shown.MissingCount, missing)
		}
		if first := shown.Rows[0]; first.Status != "missing" {
			t.Errorf("the first row is %s (%s); models missing their SLO come first", first.Model, first.Status)
		}
		det, ok := rows["ocr-det"]
		if !ok || det.Status != "missing" || det.Fields["why"].Text == "" {
			t.Errorf("ocr-det: status %q why %q; want missing with a reason", det.Status, det.Fields["why"].Text)
		}
		if r := rows["ocr-cls"]; r.Status != "ok" {
			t.Errorf("ocr-cls: status %q, want ok", r.Status)
		}
		if r := rows["wakeword"]; r.Status != "no-slo" {
			t.Errorf("wakeword: status %q, want no-slo", r.Status)
		}

		// The capacity bar: a segment per model with a limit, sized by
		// its share; models without one in the hatched "shared" segment.
		if len(shown.Devices) != len(api.Devices) {
			t.Fatalf("the page shows %d devices, the API %d", len(shown.Devices), len(api.Devices))
		}
		for i, d := range api.Devices {
			sd := shown.Devices[i]
			segs := map[string]float64{}
			var shared string
			for _, sg := range sd.Compute {
				segs[sg.Segment] = sg.Width
				if sg.Segment == "shared" {
					shared = sg.Models
				}
			}
			var limited []string
			for _, sh := range d.Shares {
				if sh.Compute == 0 {
					if !strings.Contains(" "+shared+" ", " "+sh.Key+" ") {
						t.Errorf("device %s: %s has no limit but is not in the shared segment (%q)", d.Device, sh.Key, shared)
					}
					continue
				}
				w, ok := segs[sh.Key]
				if !ok {
					t.Errorf("device %s: no capacity segment for %s", d.Device, sh.Key)
					continue
				}
				limited = append(limited, sh.Key)
				if sd.BarWidth > 0 && math.Abs(w/sd.BarWidth-sh.Compute) > 0.02 && sh.Compute <= 1 {
					t.Errorf("device %s: %s's segment is %.0f of %.0f px, its share %v", d.Device, sh.Key, w, sd.BarWidth, sh.Compute)
				}
			}
			if len(limited) == 0 && len(d.Shares) > 0 && shared == "" {
				t.Errorf("device %s: the bar shows no model", d.Device)
			}
		}
		if want := min(len(api.Events), 50); shown.Events != want {
			t.Errorf("the page lists %d events, the API has %d", shown.Events, want)
		}

		// And the server, asked now, agrees on what does not move.
		var now struct {
			Time   string `json:"time"`
			Models []struct {
				Name   string   `json:"name"`
				Key    string   `json:"key"`
				SLO    *float64 `json:"slo_ms"`
				Class  string   `json:"class"`
				Status string   `json:"status"`
			} `json:"models"`
		}
		if code := s.json(t, "GET", "/v2/dashboard", nil, &now); code != 200 {
			t.Fatalf("GET /v2/dashboard: %d", code)
		}
		shownAt, _ := time.Parse(time.RFC3339Nano, shown.Time)
		nowAt, _ := time.Parse(time.RFC3339Nano, now.Time)
		// The page calls its data live (checked above) only while it is
		// under STALE_AFTER_MS old (app.js: 3.5s), repainting the label each
		// second; the server's clock has moved on since by at most the time
		// the test took from reading the page until the answer came.
		const liveFor = 3500*time.Millisecond + time.Second
		if d, limit := nowAt.Sub(shownAt), time.Since(readAt)+liveFor; d < 0 || d > limit {
			t.Errorf("the page shows data from %s, the server is at %s: %v apart, want at most %v", shown.Time, now.Time, d, limit)
		}
		for _, m := range now.Models {
			r := rows[m.Name]
			if r.Key != m.Key || (m.SLO == nil) != (r.Fields["slo_ms"].Value == "null") ||
				(m.SLO != nil && r.Fields["slo_ms"].Value != strconv.FormatFloat(*m.SLO, 'f', -1, 64)) ||
				r.Fields["class"].Value != strconv.Quote(m.Class) {
				t.Errorf("%s: the page shows key %q slo %s class %s; the API now %q %v %q", m.Name, r.Key, r.Fields["slo_ms"].Value, r.Fields["class"].Value, m.Key, m.SLO, m.Class)
			}
		}
		t.Logf("rendered %s; headline: %s", shown.Time, strings.Join(strings.Fields(shown.Headline), " "))
	})

	b.screenshot(t, "dashboard.png", false, true)

	t.Run("fits 1280x800", func(t *testing.T) {
		b.do(t, chromedp.EmulateViewport(1280, 800))
		time.Sleep(300 * time.Millisecond)
		var width int
		b.eval(t, `document.documentElement.scrollWidth`, &width)
		if width > 1280 {
			t.Errorf("at 1280 px wide the page is %d px wide: it scrolls sideways", width)
		}
		b.screenshot(t, "dashboard-1280.png", false, false)
		b.do(t, chromedp.EmulateViewport(1600, 1000))
	})

	t.Run("model page", func(t *testing.T) {
		// A real click on the link (retried: a busy page may re-render the
		// row between finding the link and clicking it).
		for try := 0; ; try++ {
			ctx, cancel := context.WithTimeout(b.ctx, 20*time.Second)
			err := chromedp.Do(ctx, chromedp.Click(chromedp.CSS(`tr[data-model="ocr-det"] a[data-field="name"]`)))
			cancel()
			if err == nil {
				break
			}
			if try == 4 {
				t.Fatalf("clicking ocr-det's link: %v", err)
			}
			time.Sleep(200 * time.Millisecond)
		}
		b.waitJS(t, "the model page's charts", 30*time.Second, fmt.Sprintf(
			`document.body.dataset.page === 'model' && document.querySelector('svg[data-chart="latency"]') && +document.querySelector('svg[data-chart="latency"]').dataset.points >= %d`, minPoints))
		var hash string
		b.eval(t, `location.hash`, &hash)
		if !strings.HasPrefix(hash, "#/models/ocr-det") {
			t.Errorf("the model link led to %q", hash)
		}
		b.waitJS(t, "ocr-det's page to say it misses its SLO", 20*time.Second,
			`(document.querySelector('.model-head[data-status="missing"] .why-box [data-field="why"]')?.dataset.value || '').length > 2`)
		var shown shownModelPage
		b.eval(t, readModelPageJS, &shown)
		if shown.Why == "" {
			t.Errorf("model page status %q why %q; want missing and why", shown.Status, shown.Why)
		}
		if v := shown.KPIs["p99_ms"].Value; v == "null" || v == "" {
			t.Errorf("p99 tile: %+v", shown.KPIs["p99_ms"])
		}
		lines := map[string][]string{
			"latency":    {"p99_ms", "p90_ms", "p50_ms"},
			"attainment": {"attainment"},
			"goodput":    {"goodput"},
			"arrivals":   {"arrival_rate", "forecast_rate"},
			"compute":    {"compute_share"},
			"memory":     {"memory_used_bytes"},
			"prediction": {"observed_ms", "predicted_ms"},
			"queue":      {"queue_depth"},
		}
		for chart, series := range lines {
			c, ok := shown.Charts[chart]
			if !ok {
				t.Errorf("no %s chart", chart)
				continue
			}
			if c.Points < minPoints || c.Width < 200 {
				t.Errorf("%s chart: %d points, %.0f px wide", chart, c.Points, c.Width)
			}
			for _, sr := range series {
				drawn := 0
				for _, l := range c.Lines {
					if l.Series == sr {
						drawn = l.Vertices
					}
				}
				// A series may start a few points late (a forecast needs
				// arrivals first).
				if drawn < minPoints-5 {
					t.Errorf("%s chart: the %s line has %d points drawn, want >= %d", chart, sr, drawn, minPoints-5)
				}
			}
		}
		refs := func(chart, ref string) []float64 {
			var vs []float64
			for _, r := range shown.Charts[chart].Refs {
				if r.Ref == ref {
					vs = append(vs, r.Value)
				}
			}
			return vs
		}
		if got := refs("latency", "slo"); len(got) != 1 || got[0] != 25 {
			t.Errorf("latency chart SLO line: %v, want one at 25 ms", got)
		}
		if got := refs("attainment", "target"); len(got) != 1 || got[0] != 0.99 {
			t.Errorf("attainment chart target line: %v, want one at 0.99", got)
		}
		rej := shown.Charts["rejections"]
		if len(rej.Series) != 4 {
			t.Errorf("rejections chart series: %+v, want deadline, queue_full, dropped, failed", rej.Series)
		}
		rects := 0
		for _, sr := range rej.Series {
			if sr.Points < minPoints {
				t.Errorf("rejections chart: %s has %d points", sr.Series, sr.Points)
			}
			rects += sr.Rects
		}

		// Live: the next polls add points.
		before := shown.Charts["latency"]
		b.waitJS(t, "new points on the latency chart", 20*time.Second, fmt.Sprintf(
			`(() => { const s = document.querySelector('svg[data-chart="latency"]'); return s && +s.dataset.lastT > %v && +s.dataset.points > %d; })()`,
			before.LastT, before.Points))
		// A few more polls, so the history below went through ?since= merges.
		b.waitJS(t, "three more polls", 20*time.Second, fmt.Sprintf(
			`+document.querySelector('svg[data-chart="latency"]')?.dataset.lastT >= %v`, before.LastT+3))

		// The page's history, built from a full fetch and then ?since=
		// polls, holds the same points as the API's.
		var page struct {
			T      []float64             `json:"t"`
			Series map[string][]*float64 `json:"series"`
		}
		b.eval(t, `(() => { const h = window.sloserveDashboard.history; return { t: h.t, series: { p99_ms: h.series.p99_ms, attainment: h.series.attainment, compute_share: h.series.compute_share, rejected_deadline: h.series.rejected_deadline } }; })()`, &page)
		var hist struct {
			Series map[string]json.RawMessage `json:"series"`
			Events []struct {
				Time time.Time `json:"time"`
			} `json:"events"`
		}
		if code := s.json(t, "GET", "/v2/dashboard/models/ocr-det?last=900", nil, &hist); code != 200 {
			t.Fatalf("history: %d", code)
		}
		var apiT []float64
		if err := json.Unmarshal(hist.Series["t"], &apiT); err != nil {
			t.Fatal(err)
		}
		index := map[float64]int{}
		for i, x := range apiT {
			index[x] = i
		}
		common := 0
		for _, name := range []string{"p99_ms", "attainment", "compute_share", "rejected_deadline"} {
			var col []*float64
			if err := json.Unmarshal(hist.Series[name], &col); err != nil {
				t.Fatal(err)
			}
			common = 0
			for i, x := range page.T {
				j, ok := index[x]
				if !ok {
					continue
				}
				common++
				a, p := col[j], page.Series[name][i]
				if (a == nil) != (p == nil) || (a != nil && *a != *p) {
					t.Errorf("%s at %v: the page has %v, the API %v", name, x, ptrText(p), ptrText(a))
					break
				}
			}
		}
		if len(page.T) > 0 {
			// No point lost between polls: every API point in the page's
			// span is in the page.
			inSpan := 0
			for _, x := range apiT {
				if x >= page.T[0] && x <= page.T[len(page.T)-1] {
					inSpan++
				}
			}
			if inSpan != common || common < minPoints {
				t.Errorf("the page has %d of the API's %d points in its span (%d in common)", len(page.T), inSpan, common)
			}
		}
		if len(hist.Events) > 0 && shown.Charts["latency"].Events < 1 {
			t.Errorf("the API has %d events for ocr-det, the latency chart marks none", len(hist.Events))
		}
		if shown.Events > len(hist.Events) {
			t.Errorf("the page lists %d events, the API has %d", shown.Events, len(hist.Events))
		}
		t.Logf("model page: %d points, %d rejection bars, %d events marked", shown.Charts["latency"].Points, rects, shown.Charts["latency"].Events)

		// Hover shows a readout.
		b.eval(t, `(() => {
		  const o = document.querySelector('svg[data-chart="latency"] rect.overlay'); const r = o.getBoundingClientRect();
		  o.dispatchEvent(new MouseEvent('mousemove', { clientX: r.left + r.width * 0.8, clientY: r.top + 20, bubbles: true }));
		  return true;
		})()`, new(bool))
		var tip string
		b.eval(t, `(() => { const t = document.querySelector('[data-card="latency"] .tip'); return t && !t.hidden ? t.textContent : ''; })()`, &tip)
		if !strings.Contains(tip, "p99") || !strings.Contains(tip, "ms") {
			t.Errorf("hovering the latency chart shows %q, want the values at that time", tip)
		}
		b.eval(t, `(() => { document.querySelector('svg[data-chart="latency"] rect.overlay').dispatchEvent(new MouseEvent('mouseleave')); return true; })()`, new(bool))

		b.screenshot(t, "dashboard-model.png", true, true)
	})

	t.Run("unknown model", func(t *testing.T) {
		b.eval(t, `(location.hash = '#/models/no-such-model', true)`, new(bool))
		b.waitJS(t, "the not-found message", 15*time.Second, `document.querySelector('[data-not-found="no-such-model"]')`)
	})

	b.checkNetwork(t)

	t.Run("server gone", func(t *testing.T) {
		b.eval(t, `(location.hash = '#/', true)`, new(bool))
		b.waitJS(t, "the overview", 15*time.Second, `document.body.dataset.page === 'overview' && +document.body.dataset.renders > 0`)
		load.stop()
		if err := s.stop(); err != nil {
			t.Fatalf("stopping the server: %v", err)
		}
		b.waitJS(t, "the disconnected indicator", 15*time.Second, `document.getElementById('live').dataset.live === 'down'`)
		b.screenshot(t, "dashboard-disconnected.png", false, false)
		var rows int
		b.eval(t, `document.querySelectorAll('table.models tbody tr').length`, &rows)
		if rows != 3 {
			t.Errorf("after the server went away the page shows %d models; want the last data kept", rows)
		}
	})
}

func ptrText(p *float64) string {
	if p == nil {
		return "null"
	}
	return strconv.FormatFloat(*p, 'g', -1, 64)
}
