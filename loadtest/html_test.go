package loadtest

import (
	"bytes"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"math"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"
)

// htmlTestNode is an element of a parsed page.
type htmlTestNode struct {
	name     string
	attr     map[string]string
	children []*htmlTestNode
	text     strings.Builder // all the text inside, children's included
}

// htmlTestParse parses a page with encoding/xml in its lenient HTML mode,
// failing the test if the markup is broken.
func htmlTestParse(t *testing.T, page string) *htmlTestNode {
	t.Helper()
	d := xml.NewDecoder(strings.NewReader(page))
	d.Strict = false
	d.AutoClose = xml.HTMLAutoClose
	d.Entity = xml.HTMLEntity
	root := &htmlTestNode{name: "#root"}
	stack := []*htmlTestNode{root}
	for {
		tok, err := d.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("parsing the page: %v", err)
		}
		switch tok := tok.(type) {
		case xml.StartElement:
			n := &htmlTestNode{name: tok.Name.Local, attr: map[string]string{}}
			for _, a := range tok.Attr {
				n.attr[a.Name.Local] = a.Value
			}
			top := stack[len(stack)-1]
			top.children = append(top.children, n)
			stack = append(stack, n)
		case xml.EndElement:
			if len(stack) == 1 {
				t.Fatalf("unbalanced </%s>", tok.Name.Local)
			}
			stack = stack[:len(stack)-1]
		case xml.CharData:
			for _, n := range stack {
				n.text.Write(tok)
			}
		}
	}
	if len(stack) != 1 {
		t.Fatalf("unclosed <%s>", stack[len(stack)-1].name)
	}
	return root
}

// all returns the elements under n (n included) that match.
func (n *htmlTestNode) all(match func(*htmlTestNode) bool) []*htmlTestNode {
	var out []*htmlTestNode
	if match(n) {
		out = append(out, n)
	}
	for _, c := range n.children {
		out = append(out, c.all(match)...)
	}
	return out
}

func (n *htmlTestNode) byName(name string) []*htmlTestNode {
	return n.all(func(e *htmlTestNode) bool { return e.name == name })
}

func (n *htmlTestNode) byClass(class string) []*htmlTestNode {
	return n.all(func(e *htmlTestNode) bool { return htmlTestHasWord(e.attr["class"], class) })
}

func htmlTestHasWord(list, word string) bool {
	for _, f := range strings.Fields(list) {
		if f == word {
			return true
		}
	}
	return false
}

// cells returns the text of a table's body cells, row by row.
func (n *htmlTestNode) cells() [][]string {
	var rows [][]string
	for _, tb := range n.byName("tbody") {
		for _, tr := range tb.byName("tr") {
			var row []string
			for _, td := range tr.byName("td") {
				row = append(row, strings.TrimSpace(td.text.String()))
			}
			rows = append(rows, row)
		}
	}
	return rows
}

// htmlTestRun builds a run of two models over 10 s: det (latency-critical)
// gets lcGood good requests, bert (best-effort) beAnswered good ones, all
// spread over the run.
func htmlTestRun(policy string, lcGood, beAnswered int) *Run {
	r := &Run{
		Scenario: "diurnal",
		Policy:   policy,
		Started:  time.Date(2025, 6, 1, 9, 30, 0, 0, time.UTC),
		Duration: 10 * time.Second,
		Models: []ModelInfo{
			{Name: "det", Class: LatencyCritical, SLO: 80 * time.Millisecond, Protocol: "grpc", Load: "diurnal 1-12 req/s"},
			{Name: "bert", Class: BestEffort, SLO: 2 * time.Second, Protocol: "rest", Load: "closed loop, 2 clients"},
		},
	}
	add := func(model, n int, lat time.Duration) {
		for i := range n {
			at := time.Duration(i) * r.Duration / time.Duration(n)
			r.Records = append(r.Records, Record{Model: model, Scheduled: at, Sent: at + time.Millisecond, Latency: lat, Outcome: Good})
		}
	}
	add(0, lcGood, 40*time.Millisecond)
	add(1, beAnswered, 900*time.Millisecond)
	r.Records = append(r.Records, Record{Model: 0, Scheduled: time.Second, Sent: time.Second, Latency: time.Millisecond, Outcome: Rejected, Detail: "429: queue full"})
	for s := range 10 {
		at := time.Duration(s) * time.Second
		r.Shares = append(r.Shares,
			ShareSample{At: at, Model: 0, Compute: 0.2 + 0.05*float64(s%3), Target: 0.25, ForecastRate: 3, PredictedMs: 20, ObservedMs: 22},
			ShareSample{At: at, Model: 1, Compute: 0}, // unlimited
		)
	}
	r.Events = []Event{{At: 3 * time.Second, Model: 0, Kind: "resize", Old: 0.2, New: 0.25, Reason: "forecast 3 req/s"}}
	return r
}

// htmlTestRender renders runs and checks what every page must satisfy.
func htmlTestRender(t *testing.T, runs ...*Run) (string, *htmlTestNode) {
	t.Helper()
	var buf bytes.Buffer
	if err := WriteHTML(&buf, runs); err != nil {
		t.Fatalf("WriteHTML: %v", err)
	}
	page := buf.String()
	for _, bad := range []string{"NaN", "Inf", "<script", "<link", "@import", "url(", "ZgotmplZ"} {
		if strings.Contains(page, bad) {
			t.Errorf("page contains %q", bad)
		}
	}
	htmlTestNoExternal(t, page)
	return page, htmlTestParse(t, page)
}

var htmlTestURLAttr = regexp.MustCompile(`(?i)\b(?:src|href)\s*=\s*["']?\s*(?:[a-z][a-z0-9+.-]*:|//)`)

// htmlTestNoExternal checks that a page loads nothing: no src or href with
// a scheme or a host, and no URL anywhere but the SVG namespace.
func htmlTestNoExternal(t *testing.T, page string) {
	t.Helper()
	if m := htmlTestURLAttr.FindString(page); m != "" {
		t.Errorf("page references an external resource: %q", m)
	}
	rest := strings.ReplaceAll(page, `xmlns="http://www.w3.org/2000/svg"`, "")
	if strings.Contains(rest, "http://") || strings.Contains(rest, "https://") {
		t.Error("page contains a URL other than the SVG namespace")
	}
}

func TestWriteHTMLOneRun(t *testing.T) {
	page, doc := htmlTestRender(t, htmlTestRun("adaptive", 50, 30))

	head := doc.byName("head")
	if len(head) != 1 {
		t.Fatalf("%d heads", len(head))
	}
	if title := head[0].byName("title"); len(title) != 1 || !strings.Contains(title[0].text.String(), "diurnal") || !strings.Contains(title[0].text.String(), "2025-06-01") {
		t.Errorf("page title missing or without scenario and date")
	}
	if len(doc.byClass("ratios")) != 0 {
		t.Error("a single run has a ratio table")
	}
	svgs := doc.byName("svg")
	if len(svgs) != 4*2 {
		t.Errorf("%d svg plots, want 8 (4 for each of 2 models)", len(svgs))
	}
	for _, s := range svgs {
		if s.attr["viewBox"] != "0 0 480 226" {
			t.Errorf("svg viewBox = %q", s.attr["viewBox"])
		}
	}
	var headings []string
	for _, h := range doc.byName("h3") {
		headings = append(headings, strings.Fields(h.text.String())[0])
	}
	if want := []string{"det", "bert", "Adjuster"}; !reflect.DeepEqual(headings, want) {
		t.Errorf("h3 = %q, want %q", headings, want)
	}

	// One SLO line per model, at the SLO: det's is 80 ms, bert's 2000 ms.
	slo := doc.byClass("slo")
	if len(slo) != 2 {
		t.Fatalf("%d SLO lines, want 2", len(slo))
	}
	for _, want := range []string{"SLO 80 ms", "SLO 2000 ms"} {
		if !strings.Contains(page, want) {
			t.Errorf("no %q label", want)
		}
	}
	if slo[0].attr["stroke-dasharray"] == "" {
		t.Error("the SLO line is not dashed")
	}

	models := doc.byClass("models")
	if len(models) != 1 {
		t.Fatalf("%d model tables", len(models))
	}
	rows := models[0].cells()
	// det: 50 good and one rejected over 10 s.
	want := []string{"det", LatencyCritical, "80.0", "grpc", "diurnal 1-12 req/s", "51", "50", "0", "1", "0", "0", "5.00", "98.0%", "40.0", "40.0", "40.0", "0.245", "0.200", "0.300", "1"}
	if len(rows) != 2 || !reflect.DeepEqual(rows[0], want) {
		t.Errorf("model rows = %q\nwant first %q", rows, want)
	}
	if rows[1][16] != "–" {
		t.Errorf("bert's share mean = %q, want – (never limited)", rows[1][16])
	}

	events := doc.byClass("events")
	if len(events) != 1 {
		t.Fatalf("%d event tables", len(events))
	}
	if got, want := events[0].cells(), [][]string{{"3.0", "det", "resize", "0.200 → 0.250", "forecast 3 req/s"}}; !reflect.DeepEqual(got, want) {
		t.Errorf("events = %q, want %q", got, want)
	}
	if errs := doc.byClass("errors"); len(errs) != 1 || !reflect.DeepEqual(errs[0].cells(), [][]string{{"429: queue full", "1"}}) {
		t.Errorf("errors table = %v", errs)
	}
	if !strings.Contains(page, "blank: unlimited") {
		t.Error("bert's unlimited share is not explained")
	}
}

func TestWriteHTMLComparison(t *testing.T) {
	// Over 10 s: static 1 LC good/s and 2 BE/s, shared 0.5 and 4, adaptive
	// 2 and 3 (plus one rejected LC request each).
	runs := []*Run{
		htmlTestRun("static", 10, 20),
		htmlTestRun("shared", 5, 40),
		htmlTestRun("adaptive", 20, 30),
	}
	_, doc := htmlTestRender(t, runs...)

	ratios := doc.byClass("ratios")
	if len(ratios) != 1 {
		t.Fatalf("%d ratio tables, want 1", len(ratios))
	}
	// adaptive/static: LC 20/10, total 50/30, BE 30/20; adaptive/shared:
	// LC 20/5, total 50/45, BE 30/40.
	wantRatios := [][]string{
		{"adaptive", "static", "2.00×", "1.67×", "1.50×"},
		{"adaptive", "shared", "4.00×", "1.11×", "0.75×"},
	}
	if got := ratios[0].cells(); !reflect.DeepEqual(got, wantRatios) {
		t.Errorf("ratio table = %q, want %q", got, wantRatios)
	}
	var wins []string
	for _, td := range ratios[0].byClass("win") {
		wins = append(wins, td.text.String())
	}
	if want := []string{"2.00×", "1.67×", "1.50×", "4.00×", "1.11×"}; !reflect.DeepEqual(wins, want) {
		t.Errorf("highlighted = %q, want %q", wins, want)
	}

	headlines := doc.byClass("headlines")
	if len(headlines) != 1 {
		t.Fatalf("%d headline tables", len(headlines))
	}
	wantHead := [][]string{
		{"static", "1.00", "90.9%", "2.00", "3.00", "1.0", "1.0"},
		{"shared", "0.50", "83.3%", "4.00", "4.50", "1.0", "1.0"},
		{"adaptive", "2.00", "95.2%", "3.00", "5.00", "1.0", "1.0"},
	}
	if got := headlines[0].cells(); !reflect.DeepEqual(got, wantHead) {
		t.Errorf("headlines = %q\nwant %q", got, wantHead)
	}

	if n := len(doc.byName("svg")); n != 3*2*4 {
		t.Errorf("%d svg plots, want 24", n)
	}
	var sections []string
	for _, s := range doc.byName("section") {
		sections = append(sections, s.attr["id"]+":"+strings.TrimSpace(s.byName("h2")[0].text.String()))
	}
	if want := []string{"run-1:static", "run-2:shared", "run-3:adaptive"}; !reflect.DeepEqual(sections, want) {
		t.Errorf("sections = %q, want %q", sections, want)
	}
}

func TestWriteHTMLZeroRatios(t *testing.T) {
	// The second run answered nothing: its ratios are n/a, not Inf.
	_, doc := htmlTestRender(t, htmlTestRun("adaptive", 10, 10), htmlTestRun("static", 0, 0))
	got := doc.byClass("ratios")[0].cells()
	want := [][]string{{"adaptive", "static", "n/a", "n/a", "n/a"}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("ratios = %q, want %q", got, want)
	}
}

func TestWriteHTMLSparse(t *testing.T) {
	lc := ModelInfo{Name: "det", Class: LatencyCritical, SLO: 100 * time.Millisecond}
	tests := []struct {
		name string
		run  *Run
	}{
		{"nothing at all", &Run{}},
		{"models, no records, no duration", &Run{Scenario: "s", Models: []ModelInfo{lc}}},
		{"models, no records", &Run{Duration: 30 * time.Second, Models: []ModelInfo{lc, {Name: "bert", Class: BestEffort}}}},
		{"one second, one record", &Run{Duration: time.Second, Models: []ModelInfo{lc}, Records: []Record{{Latency: time.Millisecond}}}},
		{"only rejections", &Run{Duration: 3 * time.Second, Models: []ModelInfo{lc}, Records: []Record{{Outcome: Rejected}, {Sent: time.Second, Outcome: Rejected}}}},
		{"one share sample", &Run{Duration: 5 * time.Second, Models: []ModelInfo{lc}, Shares: []ShareSample{{At: 2 * time.Second, Compute: 0.5}}}},
		{"no SLO", &Run{Duration: 2 * time.Second, Models: []ModelInfo{{Name: "x"}}, Records: []Record{{Latency: time.Millisecond}}}},
		{"samples and events outside", &Run{Duration: time.Second, Models: []ModelInfo{lc},
			Shares: []ShareSample{{At: -time.Second, Compute: 0.1}, {At: time.Hour, Compute: 0.9}},
			Events: []Event{{At: time.Hour, Model: 3, Kind: "evict"}, {At: -time.Second, Model: -1, Kind: "error", Reason: "x"}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, doc := htmlTestRender(t, tt.run)
			if n, want := len(doc.byName("svg")), 4*len(tt.run.Models); n != want {
				t.Errorf("%d svg plots, want %d", n, want)
			}
			// Every polyline and dot lies inside the viewBox.
			for _, pl := range doc.byName("polyline") {
				for _, pt := range strings.Fields(pl.attr["points"]) {
					var x, y float64
					if _, err := fmt.Sscanf(pt, "%g,%g", &x, &y); err != nil || x < 0 || x > svgWidth || y < 0 || y > svgHeight {
						t.Errorf("point %q outside the chart (%v)", pt, err)
					}
				}
			}
		})
	}
}

func TestWriteHTMLEscapes(t *testing.T) {
	r := htmlTestRun("<b>policy</b>", 5, 5)
	r.Scenario = `"quoted" & <scenario>`
	r.Models[0].Name = "<script>alert(1)</script>"
	r.Models[1].Load = `<img src=x onerror=alert(1)>`
	r.Events[0].Reason = "<i>because</i>"
	r.Records = append(r.Records, Record{Model: 1, Outcome: Failed, Detail: "<b>500</b>"})
	page, doc := htmlTestRender(t, r)
	for _, want := range []string{
		"&lt;script&gt;alert(1)&lt;/script&gt;",
		"&lt;b&gt;policy&lt;/b&gt;",
		"&lt;i&gt;because&lt;/i&gt;",
		"&lt;b&gt;500&lt;/b&gt;",
		"&lt;scenario&gt;",
	} {
		if !strings.Contains(page, want) {
			t.Errorf("page lacks %q", want)
		}
	}
	for _, tag := range []string{"b", "i", "img"} {
		if n := len(doc.byName(tag)); n != 0 {
			t.Errorf("%d <%s> elements from the data", n, tag)
		}
	}
	if h := doc.byName("h3"); len(h) == 0 || !strings.HasPrefix(h[0].text.String(), "<script>alert(1)</script>") {
		t.Errorf("the model's heading does not read as its name")
	}
}

func TestWriteHTMLEventsCapped(t *testing.T) {
	r := htmlTestRun("adaptive", 5, 5)
	r.Events = nil
	for i := range htmlMaxEvents + 50 {
		// Given in reverse, so that the report must sort them.
		r.Events = append(r.Events, Event{At: time.Duration(htmlMaxEvents+50-i) * 10 * time.Millisecond, Model: i % 3, Kind: "resize", Reason: fmt.Sprint("e", htmlMaxEvents+50-i)})
	}
	page, doc := htmlTestRender(t, r)
	rows := doc.byClass("events")[0].cells()
	if len(rows) != htmlMaxEvents {
		t.Fatalf("%d event rows, want %d", len(rows), htmlMaxEvents)
	}
	if rows[0][4] != "e51" || rows[len(rows)-1][4] != "e250" {
		t.Errorf("events from %q to %q, want the last ones, e51 to e250", rows[0][4], rows[len(rows)-1][4])
	}
	// e51 is model 199%3, e248 model 2, which the run does not have.
	if rows[0][1] != "bert" || rows[len(rows)-3][1] != "model 2" || rows[len(rows)-1][1] != "det" {
		t.Errorf("event models = %q, %q, %q; want bert, model 2, det", rows[0][1], rows[len(rows)-3][1], rows[len(rows)-1][1])
	}
	if !strings.Contains(page, "50 earlier events left out") {
		t.Error("no note of the events left out")
	}
}

type htmlTestFailingWriter struct{}

var errHTMLTestWrite = errors.New("disk full")

func (htmlTestFailingWriter) Write([]byte) (int, error) { return 0, errHTMLTestWrite }

func TestWriteHTMLErrors(t *testing.T) {
	tests := []struct {
		name string
		w    io.Writer
		runs []*Run
	}{
		{"no runs", io.Discard, nil},
		{"a nil run", io.Discard, []*Run{htmlTestRun("static", 1, 1), nil}},
		{"the writer fails", htmlTestFailingWriter{}, []*Run{htmlTestRun("static", 1, 1)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := WriteHTML(tt.w, tt.runs); err == nil {
				t.Error("WriteHTML succeeded")
			}
		})
	}
}

func TestSVGAxis(t *testing.T) {
	tests := []struct {
		name           string
		lo, hi         float64
		want           int
		extend         bool
		wantLo, wantHi float64
		ticks          []float64
		decimals       int
	}{
		{"0..100", 0, 100, 5, true, 0, 100, []float64{0, 20, 40, 60, 80, 100}, 0},
		{"0..87 grows to 100", 0, 87, 5, true, 0, 100, []float64{0, 20, 40, 60, 80, 100}, 0},
		{"shares", 0, 0.37, 5, true, 0, 0.4, []float64{0, 0.1, 0.2, 0.30000000000000004, 0.4}, 1},
		{"empty range", 0, 0, 5, true, 0, 1, []float64{0, 0.2, 0.4, 0.6000000000000001, 0.8, 1}, 1},
		{"NaN", math.NaN(), math.NaN(), 5, true, 0, 1, []float64{0, 0.2, 0.4, 0.6000000000000001, 0.8, 1}, 1},
		{"negative", -30, 70, 5, true, -40, 80, []float64{-40, -20, 0, 20, 40, 60, 80}, 0},
		{"time axis stays inside", 0, 61, 6, false, 0, 61, []float64{0, 20, 40, 60}, 0},
		{"5000", 0, 4200, 5, true, 0, 5000, []float64{0, 1000, 2000, 3000, 4000, 5000}, 0},
		{"2 s", 0, 2, 6, false, 0, 2, []float64{0, 0.5, 1, 1.5, 2}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lo, hi, ticks, dec := svgAxis(tt.lo, tt.hi, tt.want, tt.extend)
			if lo != tt.wantLo || hi != tt.wantHi || !reflect.DeepEqual(ticks, tt.ticks) || dec != tt.decimals {
				t.Errorf("svgAxis = %v, %v, %v, %d; want %v, %v, %v, %d", lo, hi, ticks, dec, tt.wantLo, tt.wantHi, tt.ticks, tt.decimals)
			}
		})
	}
}

func TestSVGNiceStep(t *testing.T) {
	tests := []struct{ raw, want float64 }{
		{0.07, 0.1}, {0.1, 0.1}, {0.11, 0.2}, {0.3, 0.5}, {1, 1}, {1.5, 2}, {2, 2}, {2.1, 5}, {7, 10}, {17.4, 20}, {450, 500},
		{0, 1}, {-3, 1}, {math.Inf(1), 1},
	}
	for _, tt := range tests {
		if got := svgNiceStep(tt.raw); math.Abs(got-tt.want) > 1e-12 {
			t.Errorf("svgNiceStep(%v) = %v, want %v", tt.raw, got, tt.want)
		}
	}
}

func TestSVGSegments(t *testing.T) {
	n := math.NaN()
	p := func(xy ...float64) []svgPoint {
		var out []svgPoint
		for i := 0; i < len(xy); i += 2 {
			out = append(out, svgPoint{xy[i], xy[i+1]})
		}
		return out
	}
	tests := []struct {
		name string
		s    svgSeries
		want [][]svgPoint
	}{
		{"empty", svgSeries{}, nil},
		{"a line", svgSeries{Points: p(0, 1, 1, 2, 2, 3)}, [][]svgPoint{p(0, 1, 1, 2, 2, 3)}},
		{"a gap", svgSeries{Points: p(0, 1, 1, n, 2, 3, 3, 4)}, [][]svgPoint{p(0, 1), p(2, 3, 3, 4)}},
		{"all gaps", svgSeries{Points: p(0, n, 1, n)}, nil},
		{"steps held to the end", svgSeries{Step: true, Points: p(0, 1, 2, 3)}, [][]svgPoint{p(0, 1, 2, 1, 2, 3, 10, 3)}},
		{"a step held up to a gap", svgSeries{Step: true, Points: p(0, 1, 4, n, 6, 2)}, [][]svgPoint{p(0, 1, 4, 1), p(6, 2, 10, 2)}},
		{"a step at the very end", svgSeries{Step: true, Points: p(10, 5)}, [][]svgPoint{p(10, 5)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := svgSegments(tt.s, 10); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("svgSegments = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestWriteHTMLEqualRatiosHighlighted(t *testing.T) {
	_, doc := htmlTestRender(t, htmlTestRun("static", 10, 10), htmlTestRun("adaptive", 10, 10))
	ratios := doc.byClass("ratios")[0]
	if got, want := ratios.cells(), [][]string{{"adaptive", "static", "1.00×", "1.00×", "1.00×"}}; !reflect.DeepEqual(got, want) {
		t.Errorf("ratios = %q, want %q", got, want)
	}
	if n := len(ratios.byClass("win")); n != 3 {
		t.Errorf("%d ratios of 1 highlighted, want 3", n)
	}
}

func TestSVGLayoutExtremes(t *testing.T) {
	tests := []struct {
		name string
		c    svgChart
	}{
		{"nothing", svgChart{}},
		{"huge values", svgChart{XMax: 10, Series: []svgSeries{{Points: []svgPoint{{0, -math.MaxFloat64}, {1, math.MaxFloat64}}}}}},
		{"infinities and NaN", svgChart{XMax: math.Inf(1), Ref: &svgRef{Y: math.NaN()}, Series: []svgSeries{{Points: []svgPoint{{math.NaN(), 1}, {1, math.Inf(1)}, {2, 3}}}}}},
		{"points beyond the axis", svgChart{XMax: 1, Series: []svgSeries{{Step: true, Points: []svgPoint{{-5, 1}, {7, 2}}}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := svgLayout(tt.c)
			var buf bytes.Buffer
			if err := htmlReport.ExecuteTemplate(&buf, "chart", v); err != nil {
				t.Fatal(err)
			}
			out := buf.String()
			if strings.Contains(out, "NaN") || strings.Contains(out, "Inf") || strings.Contains(out, "–") {
				t.Errorf("chart has a number that is not one:\n%s", out)
			}
			if len(v.YTicks) == 0 || len(v.XTicks) == 0 {
				t.Errorf("no ticks: %d x, %d y", len(v.XTicks), len(v.YTicks))
			}
		})
	}
}
