package configs

// Checks of the monitoring files beside the config examples: the Grafana
// dashboard's structure, the Prometheus scrape config and rules (with
// promtool when installed). That every metric they name is one the server
// exports is checked against a running server in cmd/sloserve
// (TestE2EPrometheus).

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

const (
	dashboardFile   = "grafana/sloserve-dashboard.json"
	promConfigFile  = "prometheus/prometheus.yml"
	promRulesFile   = "prometheus/rules.yml"
	promRulesTested = "prometheus/rules_test.yml"
)

// grafanaDashboard is the part of the dashboard JSON the tests read.
type grafanaDashboard struct {
	UID           string `json:"uid"`
	Title         string `json:"title"`
	SchemaVersion int    `json:"schemaVersion"`
	Templating    struct {
		List []grafanaVariable `json:"list"`
	} `json:"templating"`
	Panels []grafanaPanel `json:"panels"`
}

type grafanaVariable struct {
	Name       string             `json:"name"`
	Type       string             `json:"type"`
	Query      json.RawMessage    `json:"query"`
	Definition string             `json:"definition"`
	Datasource *grafanaDatasource `json:"datasource"`
	Multi      bool               `json:"multi"`
	IncludeAll bool               `json:"includeAll"`
	AllValue   string             `json:"allValue"`
}

type grafanaDatasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type grafanaPanel struct {
	ID         int                       `json:"id"`
	Type       string                    `json:"type"`
	Title      string                    `json:"title"`
	Datasource *grafanaDatasource        `json:"datasource"`
	GridPos    *struct{ X, Y, W, H int } `json:"gridPos"`
	Repeat     string                    `json:"repeat"`
	Targets    []struct {
		RefID      string             `json:"refId"`
		Expr       string             `json:"expr"`
		Datasource *grafanaDatasource `json:"datasource"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"` // a collapsed row's
}

func readDashboard(t *testing.T) grafanaDashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d grafanaDashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d
}

// allPanels flattens rows, collapsed or not.
func allPanels(ps []grafanaPanel) []grafanaPanel {
	var out []grafanaPanel
	for _, p := range ps {
		out = append(out, p)
		out = append(out, allPanels(p.Panels)...)
	}
	return out
}

// promRules is the part of a Prometheus rule file the tests read.
type promRules struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Record      string            `yaml:"record"`
			Alert       string            `yaml:"alert"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

func readRules(t *testing.T) promRules {
	t.Helper()
	b, err := os.ReadFile(promRulesFile)
	if err != nil {
		t.Fatal(err)
	}
	var r promRules
	if err := yaml.Unmarshal(b, &r); err != nil {
		t.Fatalf("%s: %v", promRulesFile, err)
	}
	return r
}

var (
	promqlString = regexp.MustCompile("\"(?:[^\"\\\\]|\\\\.)*\"|`[^`]*`|'(?:[^'\\\\]|\\\\.)*'")
	promqlName   = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*`)
)

// seriesNames lists the metric and recording-rule names an expression
// uses: sloserve_* and names with a colon (quoted strings skipped).
func seriesNames(expr string) []string {
	var names []string
	for _, n := range promqlName.FindAllString(promqlString.ReplaceAllString(expr, `""`), -1) {
		if strings.HasPrefix(n, "sloserve_") || strings.Contains(n, ":") {
			names = append(names, n)
		}
	}
	return names
}

func TestGrafanaDashboard(t *testing.T) {
	d := readDashboard(t)
	if d.UID == "" || d.Title == "" {
		t.Errorf("uid %q, title %q: both must be set (the uid keeps links stable across imports)", d.UID, d.Title)
	}
	if d.SchemaVersion < 36 {
		t.Errorf("schemaVersion %d: want >= 36 (Grafana 9+ datasource references by uid)", d.SchemaVersion)
	}

	vars := map[string]grafanaVariable{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v
	}
	if ds := vars["datasource"]; ds.Type != "datasource" || string(ds.Query) != `"prometheus"` {
		t.Errorf("templating: want a datasource variable named datasource of type prometheus, got %+v", ds)
	}
	for _, name := range []string{"instance", "model"} {
		v := vars[name]
		if v.Type != "query" || !strings.Contains(v.Definition, "label_values(sloserve_qos_requests_total") ||
			!strings.HasSuffix(v.Definition, ", "+name+")") || !v.Multi || !v.IncludeAll || v.AllValue != ".*" {
			t.Errorf("templating: want a multi-value query variable %s from label_values(sloserve_qos_requests_total, %s) with All = .*, got %+v", name, name, v)
		}
		if v.Datasource == nil || v.Datasource.UID != "${datasource}" {
			t.Errorf("variable %s: datasource %+v, want uid ${datasource}", name, v.Datasource)
		}
	}

	ids := map[int]string{}
	type rect struct{ x, y, w, h int }
	var placed []struct {
		title string
		r     rect
	}
	titles := map[string]bool{}
	variable := regexp.MustCompile(`\$\{?([a-zA-Z_][a-zA-Z0-9_]*)`)
	recorded := map[string]bool{}
	for _, g := range readRules(t).Groups {
		for _, r := range g.Rules {
			recorded[r.Record] = r.Record != ""
		}
	}
	for _, p := range allPanels(d.Panels) {
		if prev, dup := ids[p.ID]; dup || p.ID <= 0 {
			t.Errorf("panel %q: id %d is not positive or also used by %q", p.Title, p.ID, prev)
		}
		ids[p.ID] = p.Title
		titles[p.Title] = true
		if p.GridPos == nil || p.GridPos.W <= 0 || p.GridPos.H <= 0 || p.GridPos.X < 0 || p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("panel %q: gridPos %+v must be within the 24 columns", p.Title, p.GridPos)
			continue
		}
		r := rect{p.GridPos.X, p.GridPos.Y, p.GridPos.W, p.GridPos.H}
		for _, q := range placed {
			if r.x < q.r.x+q.r.w && q.r.x < r.x+r.w && r.y < q.r.y+q.r.h && q.r.y < r.y+r.h {
				t.Errorf("panel %q at %+v overlaps %q at %+v", p.Title, r, q.title, q.r)
			}
		}
		placed = append(placed, struct {
			title string
			r     rect
		}{p.Title, r})
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" || p.Datasource.Type != "prometheus" {
			t.Errorf("panel %q: datasource %+v, want the ${datasource} variable", p.Title, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no queries", p.Title)
		}
		if p.Repeat != "" && vars[p.Repeat].Name == "" {
			t.Errorf("panel %q repeats over undefined variable %q", p.Title, p.Repeat)
		}
		refs := map[string]bool{}
		for _, tg := range p.Targets {
			if tg.RefID == "" || refs[tg.RefID] {
				t.Errorf("panel %q: refId %q empty or repeated", p.Title, tg.RefID)
			}
			refs[tg.RefID] = true
			if strings.TrimSpace(tg.Expr) == "" {
				t.Errorf("panel %q query %s: no expr", p.Title, tg.RefID)
			}
			if tg.Datasource == nil || tg.Datasource.UID != "${datasource}" {
				t.Errorf("panel %q query %s: datasource %+v, want ${datasource}", p.Title, tg.RefID, tg.Datasource)
			}
			for _, m := range variable.FindAllStringSubmatch(tg.Expr, -1) {
				if _, ok := vars[m[1]]; !ok && !strings.HasPrefix(m[1], "__") {
					t.Errorf("panel %q query %s uses undefined variable $%s", p.Title, tg.RefID, m[1])
				}
			}
			if strings.Contains(tg.Expr, "sloserve_") && !strings.Contains(tg.Expr, `instance=~"$instance"`) {
				t.Errorf("panel %q query %s does not filter by $instance: %s", p.Title, tg.RefID, tg.Expr)
			}
			for _, n := range seriesNames(tg.Expr) {
				if strings.Contains(n, ":") && !recorded[n] {
					t.Errorf("panel %q query %s uses %s, which %s does not record", p.Title, tg.RefID, n, promRulesFile)
				}
			}
		}
	}

	// What the issue asks to see at once: whether each model meets its SLO,
	// what share it has, and why.
	for _, want := range []string{
		"Latency-critical models missing their SLO", "Models missing their SLO",
		"Goodput", "Arrival rate and forecast", "p99 latency vs SLO: $model", "SLO attainment",
		"Why requests miss their SLO", "Rejections by reason", "Queue depth",
		"Compute share", "Memory: share and resident",
		"Predicted vs observed execution time", "Adjuster events",
	} {
		if !titles[want] {
			t.Errorf("no panel titled %q", want)
		}
	}
}

func TestPrometheusConfig(t *testing.T) {
	b, err := os.ReadFile(promConfigFile)
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Global struct {
			ScrapeInterval     string `yaml:"scrape_interval"`
			EvaluationInterval string `yaml:"evaluation_interval"`
		} `yaml:"global"`
		RuleFiles     []string `yaml:"rule_files"`
		ScrapeConfigs []struct {
			JobName       string `yaml:"job_name"`
			MetricsPath   string `yaml:"metrics_path"`
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	if err := yaml.Unmarshal(b, &cfg); err != nil {
		t.Fatalf("%s: %v", promConfigFile, err)
	}
	if !slices.Contains(cfg.RuleFiles, filepath.Base(promRulesFile)) {
		t.Errorf("rule_files %v: want %s", cfg.RuleFiles, filepath.Base(promRulesFile))
	}
	_, defaultPort, err := net.SplitHostPort(DefaultServer().Listen.Metrics)
	if err != nil {
		t.Fatal(err)
	}
	var found bool
	for _, sc := range cfg.ScrapeConfigs {
		if sc.JobName != "sloserve" {
			continue
		}
		found = true
		if sc.MetricsPath != "/metrics" {
			t.Errorf("metrics_path %q, want /metrics", sc.MetricsPath)
		}
		if len(sc.StaticConfigs) != 1 || len(sc.StaticConfigs[0].Targets) != 1 {
			t.Fatalf("job sloserve: want one static target, got %+v", sc.StaticConfigs)
		}
		if _, port, _ := net.SplitHostPort(sc.StaticConfigs[0].Targets[0]); port != defaultPort {
			t.Errorf("target %s: want the default metrics port %s (listen.metrics in default.yaml)", sc.StaticConfigs[0].Targets[0], defaultPort)
		}
	}
	if !found {
		t.Error("no scrape config with job_name sloserve (the rules' SloserveDown alert selects it)")
	}

	promtool := requirePromtool(t)
	for _, args := range [][]string{
		{"check", "config", promConfigFile},
		{"check", "rules", promRulesFile},
		{"test", "rules", promRulesTested},
	} {
		t.Run(strings.Join(args[:2], "_"), func(t *testing.T) {
			out, err := exec.Command(promtool, args...).CombinedOutput()
			if err != nil {
				t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
			}
		})
	}
}

func TestPrometheusRules(t *testing.T) {
	record := regexp.MustCompile(`^[a-z_]+:sloserve_[a-z0-9_]+:[a-z0-9_]+$`)
	names := map[string]bool{}
	alerts := 0
	for _, g := range readRules(t).Groups {
		for _, r := range g.Rules {
			name := r.Record + r.Alert
			if names[name] {
				t.Errorf("rule %s defined twice", name)
			}
			names[name] = true
			if r.Record != "" {
				if !record.MatchString(r.Record) {
					t.Errorf("recording rule %s: want level:metric:operations, e.g. model:sloserve_qos_goodput:rate1m", r.Record)
				}
				continue
			}
			alerts++
			if r.Labels["severity"] == "" {
				t.Errorf("alert %s: no severity label", r.Alert)
			}
			if r.Annotations["summary"] == "" || len(r.Annotations["description"]) < 80 {
				t.Errorf("alert %s: want a summary and a description that says why it fires and where to look", r.Alert)
			}
			if r.For == "" {
				t.Errorf("alert %s: no for: (a single bad evaluation should not page)", r.Alert)
			}
		}
	}
	for _, want := range []string{"SLOAttainmentLow", "P99OverSLO", "ModelRejectingRequests", "AdjusterErrors"} {
		if !names[want] {
			t.Errorf("no alert %s", want)
		}
	}
	// Rules that use recorded series must come after the rule recording them
	// (a group evaluates in order).
	seen := map[string]bool{}
	for _, g := range readRules(t).Groups {
		for _, r := range g.Rules {
			for _, n := range seriesNames(r.Expr) {
				if strings.Contains(n, ":") && !seen[n] {
					t.Errorf("rule %s%s uses %s before it is recorded", r.Record, r.Alert, n)
				}
			}
			if r.Record != "" {
				seen[r.Record] = true
			}
		}
	}
	t.Logf("%d rules, %d alerts", len(names), alerts)
}

// requirePromtool finds promtool (make test-tools installs it), or skips;
// SLOSERVE_REQUIRE_PROMETHEUS=1, as `make test` sets, turns the skip into
// a failure.
func requirePromtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		msg := fmt.Sprintf("promtool not found (%v); `make test-tools` installs it", err)
		if os.Getenv("SLOSERVE_REQUIRE_PROMETHEUS") == "1" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return p
}
