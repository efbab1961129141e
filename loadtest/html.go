package loadtest

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"html/template"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// htmlMaxEvents caps the adjuster events listed per run: the last ones are
// kept.
const htmlMaxEvents = 200

// WriteHTML writes one HTML page for one or more runs of the same scenario
// (several: a policy comparison, with the ratio table on top). The page is
// self-contained: its style sheet and its plots (inline SVG) are in the
// file, and it loads nothing. It is rendered in memory first, so w gets
// either the whole page or nothing.
func WriteHTML(w io.Writer, runs []*Run) error {
	if len(runs) == 0 {
		return errors.New("loadtest: no runs to report")
	}
	if slices.Contains(runs, nil) {
		return errors.New("loadtest: nil run")
	}
	page := htmlBuildPage(runs)
	var buf bytes.Buffer
	if err := htmlReport.Execute(&buf, page); err != nil {
		return fmt.Errorf("loadtest: rendering the report: %w", err)
	}
	_, err := w.Write(buf.Bytes())
	return err
}

// htmlPage is what the report template renders.
type htmlPage struct {
	Title      string
	Date       string
	Comparison *htmlComparison // nil for a single run
	Runs       []htmlRun
}

type htmlComparison struct {
	Ratios    []htmlRatio
	Headlines []htmlHeadline
}

type htmlRatio struct {
	Of, Over string
	Cells    []htmlCell // LC goodput, total goodput, BE throughput
}

type htmlCell struct {
	Text string
	Win  bool
}

// htmlHeadline is one policy's row of the comparison.
type htmlHeadline struct {
	Label                                               string
	LCGoodput, LCAttainment, BEThroughput, TotalGoodput string
	LagP99, LagMax                                      string
	Behind                                              bool
}

type htmlRun struct {
	ID, Label string
	Summary   *Summary
	Models    []htmlModel
	Errors    []htmlError
	Events    []htmlEvent
	// EventsHidden counts the earlier events left out of Events.
	EventsHidden int
}

type htmlModel struct {
	Name, Class, SLO string
	Charts           []svgView
}

type htmlError struct {
	Detail string
	Count  int
}

type htmlEvent struct {
	At, Model, Kind, Change, Reason string
}

func htmlBuildPage(runs []*Run) *htmlPage {
	first := runs[0]
	page := &htmlPage{Title: "sloserve load test: " + first.Scenario}
	if first.Scenario == "" {
		page.Title = "sloserve load test"
	}
	if !first.Started.IsZero() {
		page.Date = first.Started.Format("2006-01-02 15:04:05 MST")
	}

	sums := make([]*Summary, len(runs))
	for i, r := range runs {
		sums[i] = Summarize(r)
		page.Runs = append(page.Runs, htmlBuildRun(i, r, sums[i]))
	}
	if len(runs) > 1 {
		page.Comparison = htmlBuildComparison(Compare(sums), page.Runs)
	}
	return page
}

// htmlRunLabel names a run by its policy, or by its place when the policy
// is unknown.
func htmlRunLabel(i int, policy string) string {
	if policy == "" {
		return "run " + strconv.Itoa(i+1)
	}
	return policy
}

func htmlBuildComparison(c *Comparison, runs []htmlRun) *htmlComparison {
	hc := &htmlComparison{}
	for _, r := range c.Ratios {
		cell := func(name string, v float64) htmlCell {
			if slices.Contains(r.Undefined, name) {
				return htmlCell{Text: "n/a"}
			}
			return htmlCell{Text: htmlFloat(v, 2) + "×", Win: v >= 1}
		}
		hc.Ratios = append(hc.Ratios, htmlRatio{
			Of:   cmp.Or(r.Of, "(unknown)"),
			Over: cmp.Or(r.Over, "(unknown)"),
			Cells: []htmlCell{
				cell("lc_goodput", r.LCGoodput),
				cell("total_goodput", r.TotalGoodput),
				cell("be_throughput", r.BEThroughput),
			},
		})
	}
	for i, s := range c.Runs {
		h := htmlHeadline{
			Label:        runs[i].Label,
			LCGoodput:    "–",
			LCAttainment: "–",
			BEThroughput: "–",
			TotalGoodput: htmlFloat(s.Total.Goodput, 2),
			LagP99:       htmlFloat(s.Generator.LagP99ms, 1),
			LagMax:       htmlFloat(s.Generator.LagMaxms, 1),
			Behind:       s.Generator.Behind,
		}
		for _, cs := range s.Classes {
			switch cs.Class {
			case LatencyCritical:
				h.LCGoodput = htmlFloat(cs.Goodput, 2)
				h.LCAttainment = htmlPercent(cs.Attainment)
			case BestEffort:
				h.BEThroughput = htmlFloat(cs.Throughput, 2)
			}
		}
		hc.Headlines = append(hc.Headlines, h)
	}
	return hc
}

func htmlBuildRun(i int, r *Run, s *Summary) htmlRun {
	hr := htmlRun{
		ID:      "run-" + strconv.Itoa(i+1),
		Label:   htmlRunLabel(i, r.Policy),
		Summary: s,
	}

	rows := Timeline(r)
	samples := summarySharesByModel(r)
	for m, info := range r.Models {
		hr.Models = append(hr.Models, htmlModel{
			Name:   info.Name,
			Class:  info.Class,
			SLO:    htmlShort(summaryMs(info.SLO)) + " ms",
			Charts: htmlModelCharts(r, m, rows, samples[m]),
		})
	}

	for d, n := range s.Total.Errors {
		hr.Errors = append(hr.Errors, htmlError{Detail: d, Count: n})
	}
	slices.SortFunc(hr.Errors, func(a, b htmlError) int {
		return cmp.Or(cmp.Compare(b.Count, a.Count), cmp.Compare(a.Detail, b.Detail))
	})

	events := slices.Clone(r.Events)
	slices.SortStableFunc(events, func(a, b Event) int { return cmp.Compare(a.At, b.At) })
	if len(events) > htmlMaxEvents {
		hr.EventsHidden = len(events) - htmlMaxEvents
		events = events[hr.EventsHidden:]
	}
	for _, e := range events {
		model := "(not driven)"
		if e.Model >= 0 && e.Model < len(r.Models) {
			model = r.Models[e.Model].Name
		} else if e.Model >= 0 {
			model = "model " + strconv.Itoa(e.Model)
		}
		hr.Events = append(hr.Events, htmlEvent{
			At:     htmlFloat(e.At.Seconds(), 1),
			Model:  model,
			Kind:   e.Kind,
			Change: htmlShare(e.Old) + " → " + htmlShare(e.New),
			Reason: e.Reason,
		})
	}
	return hr
}

// Colours of the plots (Okabe and Ito's palette, which colour-blind readers
// can tell apart).
const (
	htmlBlue      = "#0072B2"
	htmlOrange    = "#E69F00"
	htmlGreen     = "#009E73"
	htmlVermilion = "#D55E00"
	htmlSky       = "#56B4E9"
	htmlGrey      = "#555555"
)

// htmlModelCharts draws model m's four plots: arrivals and goodput, latency
// against the SLO, compute share, predicted and observed latency.
func htmlModelCharts(r *Run, m int, rows []TimelineRow, samples []ShareSample) []svgView {
	nm := len(r.Models)
	xMax := float64(max(timelineSeconds(r.Duration), 1))

	var arrivals, goodput, p50, p99 svgSeries
	arrivals = svgSeries{Name: "arrivals/s", Color: htmlBlue}
	goodput = svgSeries{Name: "goodput/s", Color: htmlGreen}
	p50 = svgSeries{Name: "p50", Color: htmlSky}
	p99 = svgSeries{Name: "p99", Color: htmlVermilion}
	for i := m; i < len(rows); i += nm {
		row := rows[i]
		x := float64(row.Second) + 0.5
		arrivals.Points = append(arrivals.Points, svgPoint{x, float64(row.Arrivals) / timelineSecondLength(row.Second, r.Duration)})
		goodput.Points = append(goodput.Points, svgPoint{x, row.Goodput})
		y50, y99 := math.NaN(), math.NaN()
		if row.Good+row.Late > 0 {
			y50, y99 = row.P50ms, row.P99ms
		}
		p50.Points = append(p50.Points, svgPoint{x, y50})
		p99.Points = append(p99.Points, svgPoint{x, y99})
	}

	compute := svgSeries{Name: "compute share", Color: htmlBlue, Step: true}
	target := svgSeries{Name: "target", Color: htmlOrange, Step: true, Dashed: true}
	predicted := svgSeries{Name: "predicted", Color: htmlOrange, Dashed: true}
	observed := svgSeries{Name: "observed", Color: htmlBlue}
	unlimited := false
	positive := func(v float64) float64 {
		if v > 0 {
			return v
		}
		return math.NaN()
	}
	for _, s := range samples {
		if s.At > r.Duration {
			continue
		}
		x := max(s.At.Seconds(), 0)
		if s.Compute == 0 {
			unlimited = true
		}
		compute.Points = append(compute.Points, svgPoint{x, positive(s.Compute)})
		target.Points = append(target.Points, svgPoint{x, positive(s.Target)})
		predicted.Points = append(predicted.Points, svgPoint{x, positive(s.PredictedMs)})
		observed.Points = append(observed.Points, svgPoint{x, positive(s.ObservedMs)})
	}
	shareNote, latencyNote := "", ""
	switch {
	case len(compute.Points) == 0:
		shareNote, latencyNote = "no shares reported", "no predictions reported"
	case unlimited:
		shareNote = "blank: unlimited"
	}

	latency := svgChart{Title: "latency per second (ms)", XMax: xMax, Series: []svgSeries{p50, p99}}
	if slo := summaryMs(r.Models[m].SLO); slo > 0 {
		latency.Ref = &svgRef{Y: slo, Label: "SLO " + htmlShort(slo) + " ms"}
	}
	charts := []svgChart{
		{Title: "arrivals and goodput (req/s)", XMax: xMax, Series: []svgSeries{arrivals, goodput}},
		latency,
		{Title: "compute share", XMax: xMax, Series: []svgSeries{compute, target}, Note: shareNote},
		{Title: "execution latency (ms)", XMax: xMax, Series: []svgSeries{predicted, observed}, Note: latencyNote},
	}
	views := make([]svgView, len(charts))
	for i, c := range charts {
		views[i] = svgLayout(c)
	}
	return views
}

// htmlFloat formats a number for the page; "–" for NaN and infinities.
func htmlFloat(v float64, decimals int) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "–"
	}
	s := strconv.FormatFloat(v, 'f', decimals, 64)
	if s[0] == '-' && htmlAllZero(s[1:]) {
		s = s[1:]
	}
	return s
}

// htmlAllZero reports whether a formatted number is all zeros ("0.00").
func htmlAllZero(s string) bool {
	for _, c := range s {
		if c != '0' && c != '.' {
			return false
		}
	}
	return true
}

// htmlShort formats a number to a tenth at most, without trailing zeros.
func htmlShort(v float64) string {
	s := htmlFloat(v, 1)
	return strings.TrimSuffix(s, ".0")
}

func htmlPercent(v float64) string { return htmlFloat(100*v, 1) + "%" }

// htmlShare formats a compute share: 0 is unlimited.
func htmlShare(v float64) string {
	if v == 0 {
		return "unlimited"
	}
	return htmlFloat(v, 3)
}

// htmlFuncs are the template's formatting functions.
var htmlFuncs = template.FuncMap{
	"ms":   func(v float64) string { return htmlFloat(v, 1) },
	"rate": func(v float64) string { return htmlFloat(v, 2) },
	"pct":  htmlPercent,
	// A summary's share of 0 means never limited (or never sampled).
	"share": func(v float64) string {
		if v == 0 {
			return "–"
		}
		return htmlFloat(v, 3)
	},
	"outcome": func(st Stats, o string) int { return st.Outcomes[o] },
}

var htmlReport = template.Must(template.New("report").Funcs(htmlFuncs).Parse(htmlReportText))

const htmlReportText = `<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8"/>
<meta name="viewport" content="width=device-width, initial-scale=1"/>
<title>{{.Title}}{{with .Date}}, {{.}}{{end}}</title>
<style>
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em; color: #222; max-width: 1400px; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; }
h3 { font-size: 1.05em; margin: 1.2em 0 0.3em; }
h3 small { font-weight: normal; color: #666; }
p.meta, p.note { color: #555; }
p.warn { color: #a33; font-weight: bold; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
caption { text-align: left; color: #555; padding-bottom: 0.3em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.5em; text-align: left; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.win { background: #d9f2d9; font-weight: bold; }
tr.total td { font-weight: bold; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(340px, 1fr)); gap: 0.5em; }
svg.chart { width: 100%; height: auto; background: #fff; border: 1px solid #eee; }
</style>
</head>
<body>
<h1>{{.Title}}</h1>
<p class="meta">{{with .Date}}Started {{.}}. {{end}}{{len .Runs}} run{{if gt (len .Runs) 1}}s: {{range $i, $r := .Runs}}{{if $i}}, {{end}}<a href="#{{$r.ID}}">{{$r.Label}}</a>{{end}}{{end}}.</p>
{{with .Comparison}}
<h2>Policy comparison</h2>
<table class="ratios">
<caption>Ratios of the policies' numbers (highlighted: at least 1, the first policy did as well or better; n/a: the second had none)</caption>
<thead><tr><th>policy</th><th>over</th><th>LC goodput</th><th>total goodput</th><th>BE throughput</th></tr></thead>
<tbody>
{{range .Ratios}}<tr><td>{{.Of}}</td><td>{{.Over}}</td>{{range .Cells}}<td class="num{{if .Win}} win{{end}}">{{.Text}}</td>{{end}}</tr>
{{else}}<tr><td colspan="5">no ratios</td></tr>
{{end}}</tbody>
</table>
<table class="headlines">
<caption>Headline numbers per policy (goodput and throughput in requests/s, lag in ms)</caption>
<thead><tr><th>policy</th><th>LC goodput</th><th>LC attainment</th><th>BE throughput</th><th>total goodput</th><th>generator lag p99</th><th>lag max</th></tr></thead>
<tbody>
{{range .Headlines}}<tr><td>{{.Label}}</td><td class="num">{{.LCGoodput}}</td><td class="num">{{.LCAttainment}}</td><td class="num">{{.BEThroughput}}</td><td class="num">{{.TotalGoodput}}</td><td class="num">{{.LagP99}}{{if .Behind}} (behind){{end}}</td><td class="num">{{.LagMax}}</td></tr>
{{end}}</tbody>
</table>
{{end}}
{{range .Runs}}
<section id="{{.ID}}">
<h2>{{.Label}}</h2>
{{with .Summary}}{{$models := len .Models}}<p class="meta">Policy {{or .Policy "unknown"}}, {{ms .DurationS}} s measured, {{.Total.Requests}} requests, goodput {{rate .Total.Goodput}}/s, attainment {{pct .Total.Attainment}}.</p>
{{if .Unfilled}}<p class="note">Not filled, the server has no GET /v2/control (it is not sloserve): {{range $i, $u := .Unfilled}}{{if $i}}; {{end}}{{$u}}{{end}}. Those columns show – or 0.</p>{{end}}
{{if .Generator.Behind}}<p class="warn">The generator fell behind its schedule (lag p99 {{ms .Generator.LagP99ms}} ms): the load generator, not the server, may have limited this run.</p>{{end}}
<table class="models">
<caption>Per model (latency in ms of answered requests; goodput in requests/s; shares: mean, min and max of the limited samples, – when never limited)</caption>
<thead><tr><th>model</th><th>class</th><th>SLO ms</th><th>protocol</th><th>load</th><th>requests</th><th>good</th><th>late</th><th>rejected</th><th>dropped</th><th>failed</th><th>goodput</th><th>attainment</th><th>p50</th><th>p99</th><th>p99.9</th><th>share mean</th><th>min</th><th>max</th><th>changes</th></tr></thead>
<tbody>
{{range .Models}}<tr><td>{{.Name}}</td><td>{{.Class}}</td><td class="num">{{ms .SLOms}}</td><td>{{.Protocol}}</td><td>{{.Load}}</td><td class="num">{{.Requests}}</td><td class="num">{{outcome .Stats "good"}}</td><td class="num">{{outcome .Stats "late"}}</td><td class="num">{{outcome .Stats "rejected"}}</td><td class="num">{{outcome .Stats "dropped"}}</td><td class="num">{{outcome .Stats "failed"}}</td><td class="num">{{rate .Goodput}}</td><td class="num">{{pct .Attainment}}</td><td class="num">{{ms .P50ms}}</td><td class="num">{{ms .P99ms}}</td><td class="num">{{ms .P999ms}}</td><td class="num">{{share .ShareMean}}</td><td class="num">{{share .ShareMin}}</td><td class="num">{{share .ShareMax}}</td><td class="num">{{.ShareChanges}}</td></tr>
{{end}}</tbody>
</table>
<table class="classes">
<caption>Per class and in total</caption>
<thead><tr><th>class</th><th>models</th><th>requests</th><th>good</th><th>late</th><th>rejected</th><th>dropped</th><th>failed</th><th>goodput</th><th>throughput</th><th>attainment</th><th>p50</th><th>p99</th><th>p99.9</th></tr></thead>
<tbody>
{{range .Classes}}<tr><td>{{.Class}}</td><td class="num">{{.Models}}</td><td class="num">{{.Requests}}</td><td class="num">{{outcome .Stats "good"}}</td><td class="num">{{outcome .Stats "late"}}</td><td class="num">{{outcome .Stats "rejected"}}</td><td class="num">{{outcome .Stats "dropped"}}</td><td class="num">{{outcome .Stats "failed"}}</td><td class="num">{{rate .Goodput}}</td><td class="num">{{rate .Throughput}}</td><td class="num">{{pct .Attainment}}</td><td class="num">{{ms .P50ms}}</td><td class="num">{{ms .P99ms}}</td><td class="num">{{ms .P999ms}}</td></tr>
{{end}}{{with .Total}}<tr class="total"><td>total</td><td class="num">{{$models}}</td><td class="num">{{.Requests}}</td><td class="num">{{outcome . "good"}}</td><td class="num">{{outcome . "late"}}</td><td class="num">{{outcome . "rejected"}}</td><td class="num">{{outcome . "dropped"}}</td><td class="num">{{outcome . "failed"}}</td><td class="num">{{rate .Goodput}}</td><td class="num">{{rate .Throughput}}</td><td class="num">{{pct .Attainment}}</td><td class="num">{{ms .P50ms}}</td><td class="num">{{ms .P99ms}}</td><td class="num">{{ms .P999ms}}</td></tr>
{{end}}</tbody>
</table>
<p class="meta">Generator lag: p50 {{ms .Generator.LagP50ms}} ms, p99 {{ms .Generator.LagP99ms}} ms, max {{ms .Generator.LagMaxms}} ms; {{.Generator.Late}} requests sent more than 10 ms late.</p>
{{end}}
{{if .Errors}}<table class="errors">
<caption>Errors of the requests not answered</caption>
<thead><tr><th>detail</th><th>count</th></tr></thead>
<tbody>
{{range .Errors}}<tr><td>{{.Detail}}</td><td class="num">{{.Count}}</td></tr>
{{end}}</tbody>
</table>{{end}}
{{range .Models}}<h3>{{.Name}} <small>{{.Class}}, SLO {{.SLO}}</small></h3>
<div class="charts">
{{range .Charts}}{{template "chart" .}}
{{end}}</div>
{{end}}
<h3>Adjuster events</h3>
{{if .EventsHidden}}<p class="note">{{.EventsHidden}} earlier events left out; the last {{len .Events}} are listed.</p>{{end}}
{{if .Events}}<table class="events">
<thead><tr><th>time s</th><th>model</th><th>kind</th><th>compute share</th><th>reason</th></tr></thead>
<tbody>
{{range .Events}}<tr><td class="num">{{.At}}</td><td>{{.Model}}</td><td>{{.Kind}}</td><td>{{.Change}}</td><td>{{.Reason}}</td></tr>
{{end}}</tbody>
</table>{{else}}<p class="note">No adjuster events.</p>{{end}}
</section>
{{end}}
</body>
</html>
{{define "chart"}}<svg class="chart" viewBox="0 0 {{.Width}} {{.Height}}" xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{{.Title}}" font-family="sans-serif" font-size="10" fill="#444">
<text x="{{.Left}}" y="14" font-size="12" font-weight="bold" fill="#222">{{.Title}}</text>{{with .Note}}<text x="{{$.Right}}" y="14" text-anchor="end" fill="#888">{{.}}</text>{{end}}
{{range .Legend}}<line x1="{{.X1}}" y1="28" x2="{{.X2}}" y2="28" stroke="{{.Color}}" stroke-width="2"{{with .Dash}} stroke-dasharray="{{.}}"{{end}}/><text x="{{.TextX}}" y="32">{{.Name}}</text>
{{end}}{{range .YTicks}}<line stroke="#e8e8e8" x1="{{$.Left}}" y1="{{.Pos}}" x2="{{$.Right}}" y2="{{.Pos}}"/><text x="{{.LabelX}}" y="{{.LabelY}}" text-anchor="end">{{.Label}}</text>
{{end}}{{range .XTicks}}<line stroke="#999" x1="{{.Pos}}" y1="{{$.Bottom}}" x2="{{.Pos}}" y2="{{.TickEnd}}"/><text x="{{.Pos}}" y="{{.LabelY}}" text-anchor="middle">{{.Label}}</text>
{{end}}<rect fill="none" stroke="#999" x="{{.Left}}" y="{{.Top}}" width="{{.PlotWidth}}" height="{{.PlotHeight}}"/>
{{with .Ref}}<line class="slo" x1="{{$.Left}}" y1="{{.Y}}" x2="{{$.Right}}" y2="{{.Y}}" stroke="{{.Color}}" stroke-width="1.5" stroke-dasharray="6 4"/>
{{end}}{{range .Lines}}<polyline points="{{.Points}}" fill="none" stroke="{{.Color}}" stroke-width="1.5" stroke-linejoin="round"{{with .Dash}} stroke-dasharray="{{.}}"{{end}}><title>{{.Name}}</title></polyline>
{{end}}{{range .Dots}}<circle cx="{{.X}}" cy="{{.Y}}" r="1.8" fill="{{.Color}}"><title>{{.Name}}</title></circle>
{{end}}{{with .Ref}}<text x="{{.LabelX}}" y="{{.LabelY}}" text-anchor="end" stroke="#fff" stroke-width="3" paint-order="stroke">{{.Label}}</text>
{{end}}<text x="{{.XLabelX}}" y="{{.XLabelY}}" text-anchor="middle">time (s)</text>
</svg>{{end}}`

// svgChart is a line chart in data units: time in seconds along x, from 0
// to XMax; y ranges over the data, 0 and the reference line.
type svgChart struct {
	Title  string
	XMax   float64
	Series []svgSeries
	Ref    *svgRef // a horizontal reference line, if any
	Note   string  // a short remark at the top right
}

// svgSeries is one line of a chart.
type svgSeries struct {
	Name   string
	Color  string
	Dashed bool
	// Step holds each value until the next point, and the last one until
	// the end of the x axis, instead of joining points with slopes.
	Step bool
	// Points in x order; a point whose Y is NaN (or infinite) breaks the
	// line there.
	Points []svgPoint
}

type svgPoint struct{ X, Y float64 }

// svgRef is a dashed horizontal line across the plot, at Y.
type svgRef struct {
	Y     float64
	Label string
}

// svgView is a chart laid out in the pixels of its viewBox, every number
// already formatted: what the "chart" template draws.
type svgView struct {
	Title, Note              string
	Width, Height            int
	Left, Right, Top, Bottom string
	PlotWidth, PlotHeight    string
	XLabelX, XLabelY         string
	Legend                   []svgLegendEntry
	XTicks, YTicks           []svgTick
	Ref                      *svgRefView
	Lines                    []svgLine
	Dots                     []svgDot
}

type svgLegendEntry struct{ X1, X2, TextX, Color, Dash, Name string }

// svgTick is a tick of either axis: Pos is its x (x axis) or y (y axis).
type svgTick struct{ Pos, Label, LabelX, LabelY, TickEnd string }

type svgRefView struct{ Y, Color, Label, LabelX, LabelY string }

type svgLine struct{ Points, Color, Dash, Name string }

type svgDot struct{ X, Y, Color, Name string }

// The chart's geometry, in viewBox units.
const (
	svgWidth      = 480
	svgHeight     = 226
	svgPlotLeft   = 54.0
	svgPlotRight  = 470.0
	svgPlotTop    = 42.0
	svgPlotBottom = 192.0
	svgDash       = "5 3"
)

// svgLayout lays a chart out: nice ticks on both axes, lines cut at gaps,
// isolated points as dots, the legend in one row under the title.
func svgLayout(c svgChart) svgView {
	v := svgView{
		Title:      c.Title,
		Note:       c.Note,
		Width:      svgWidth,
		Height:     svgHeight,
		Left:       svgNum(svgPlotLeft),
		Right:      svgNum(svgPlotRight),
		Top:        svgNum(svgPlotTop),
		Bottom:     svgNum(svgPlotBottom),
		PlotWidth:  svgNum(svgPlotRight - svgPlotLeft),
		PlotHeight: svgNum(svgPlotBottom - svgPlotTop),
		XLabelX:    svgNum((svgPlotLeft + svgPlotRight) / 2),
		XLabelY:    svgNum(svgHeight - 4),
	}

	xMax := c.XMax
	if !svgFinite(xMax) || xMax <= 0 {
		xMax = 1
	}
	yLo, yHi := 0.0, 0.0
	for _, s := range c.Series {
		for _, p := range s.Points {
			if svgFinite(p.Y) {
				yLo, yHi = min(yLo, p.Y), max(yHi, p.Y)
			}
		}
	}
	if c.Ref != nil && svgFinite(c.Ref.Y) {
		yLo, yHi = min(yLo, c.Ref.Y), max(yHi, c.Ref.Y)
	}
	yLo, yHi, yTicks, yDec := svgAxis(yLo, yHi, 5, true)
	_, _, xTicks, xDec := svgAxis(0, xMax, 6, false)

	px := func(x float64) float64 {
		return svgPlotLeft + svgUnit(x/xMax)*(svgPlotRight-svgPlotLeft)
	}
	py := func(y float64) float64 {
		return svgPlotBottom - svgUnit((y-yLo)/(yHi-yLo))*(svgPlotBottom-svgPlotTop)
	}

	for _, t := range yTicks {
		y := py(t)
		v.YTicks = append(v.YTicks, svgTick{
			Pos: svgNum(y), Label: svgLabel(t, yDec),
			LabelX: svgNum(svgPlotLeft - 5), LabelY: svgNum(y + 3.5),
		})
	}
	for _, t := range xTicks {
		v.XTicks = append(v.XTicks, svgTick{
			Pos: svgNum(px(t)), Label: svgLabel(t, xDec),
			TickEnd: svgNum(svgPlotBottom + 4), LabelY: svgNum(svgPlotBottom + 15),
		})
	}

	legendX := svgPlotLeft
	for _, s := range c.Series {
		e := svgLegendEntry{
			X1: svgNum(legendX), X2: svgNum(legendX + 18), TextX: svgNum(legendX + 22),
			Color: s.Color, Name: s.Name,
		}
		if s.Dashed {
			e.Dash = svgDash
		}
		v.Legend = append(v.Legend, e)
		legendX += 22 + 5.5*float64(utf8.RuneCountInString(s.Name)) + 14
	}

	if c.Ref != nil && svgFinite(c.Ref.Y) {
		y := py(c.Ref.Y)
		v.Ref = &svgRefView{
			Y: svgNum(y), Color: htmlGrey, Label: c.Ref.Label,
			LabelX: svgNum(svgPlotRight - 4), LabelY: svgNum(y - 4),
		}
	}

	for _, s := range c.Series {
		dash := ""
		if s.Dashed {
			dash = svgDash
		}
		for _, seg := range svgSegments(s, xMax) {
			if len(seg) == 1 {
				v.Dots = append(v.Dots, svgDot{X: svgNum(px(seg[0].X)), Y: svgNum(py(seg[0].Y)), Color: s.Color, Name: s.Name})
				continue
			}
			var b []byte
			for i, p := range seg {
				if i > 0 {
					b = append(b, ' ')
				}
				b = append(b, svgNum(px(p.X))...)
				b = append(b, ',')
				b = append(b, svgNum(py(p.Y))...)
			}
			v.Lines = append(v.Lines, svgLine{Points: string(b), Color: s.Color, Dash: dash, Name: s.Name})
		}
	}
	return v
}

// svgSegments cuts a series into runs of finite points, the vertices of
// one polyline each; a step series gets its corners, and holds its last
// value until the next point (even one that breaks the line) or xMax.
func svgSegments(s svgSeries, xMax float64) [][]svgPoint {
	var segs [][]svgPoint
	var cur []svgPoint
	for _, p := range s.Points {
		if !svgFinite(p.X) {
			continue
		}
		if !svgFinite(p.Y) {
			if len(cur) > 0 {
				if s.Step {
					cur = append(cur, svgPoint{p.X, cur[len(cur)-1].Y})
				}
				segs = append(segs, cur)
				cur = nil
			}
			continue
		}
		if s.Step && len(cur) > 0 {
			cur = append(cur, svgPoint{p.X, cur[len(cur)-1].Y})
		}
		cur = append(cur, p)
	}
	if len(cur) > 0 {
		if s.Step && cur[len(cur)-1].X < xMax {
			cur = append(cur, svgPoint{xMax, cur[len(cur)-1].Y})
		}
		segs = append(segs, cur)
	}
	return segs
}

// svgAxis picks ticks for [lo, hi] at a step of 1, 2 or 5 times a power of
// ten, giving about want intervals. With extend, the range grows to the
// ticks just outside it; without, the ticks stay inside it. It returns the
// range, the ticks and the decimals their labels need. An empty range
// becomes [lo, lo+1].
func svgAxis(lo, hi float64, want int, extend bool) (float64, float64, []float64, int) {
	if !svgFinite(lo) {
		lo = 0
	}
	if !svgFinite(hi) || hi <= lo {
		hi = lo + 1
	}
	step := svgNiceStep((hi - lo) / float64(want))
	const eps = 1e-9
	k0, k1 := math.Ceil(lo/step-eps), math.Floor(hi/step+eps)
	if extend {
		k0, k1 = math.Floor(lo/step+eps), math.Ceil(hi/step-eps)
		lo, hi = k0*step, k1*step
	}
	var ticks []float64
	for k := k0; k <= k1 && len(ticks) <= 4*want; k++ {
		ticks = append(ticks, k*step)
	}
	decimals := max(0, int(-math.Floor(math.Log10(step)+eps)))
	return lo, hi, ticks, decimals
}

// svgNiceStep rounds a positive step up to 1, 2 or 5 times a power of ten.
func svgNiceStep(raw float64) float64 {
	if !svgFinite(raw) || raw <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	switch f := raw / p; {
	case f <= 1+1e-9:
		return p
	case f <= 2+1e-9:
		return 2 * p
	case f <= 5+1e-9:
		return 5 * p
	}
	return 10 * p
}

// svgUnit clamps a fraction of an axis to [0, 1], NaN to 0, so that no
// point leaves the plot, whatever the data.
func svgUnit(f float64) float64 {
	if math.IsNaN(f) {
		return 0
	}
	return min(max(f, 0), 1)
}

func svgFinite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

// svgNum formats a coordinate to a tenth of a unit.
func svgNum(v float64) string { return htmlFloat(v, 1) }

// svgLabel formats a tick label with the axis's decimals.
func svgLabel(v float64, decimals int) string { return htmlFloat(v, decimals) }
