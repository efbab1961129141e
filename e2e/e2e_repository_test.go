package e2e

// Live model management: changes to model folders (poll mode) and repository
// API calls (explicit mode) applied under continuous load, invalid changes
// refused while the previous version serves, and the server config reread
// on SIGHUP.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// loadDriver sends the same REST inference request from several goroutines,
// back to back, until stopped, and records every answer.
type loadDriver struct {
	stopc chan struct{}
	wg    sync.WaitGroup

	mu      sync.Mutex
	answers []answer
}

// answer is one response the load driver got.
type answer struct {
	code    int    // 0: no response
	version string // model_version of a 200
	msg     string // the body or error of a failure
	at      time.Time
	took    time.Duration // from sending to the answer
}

// driveLoad starts workers goroutines posting body to the model's infer
// endpoint; header holds header name, value pairs.
func driveLoad(t *testing.T, s *testServer, model string, body []byte, workers int, header ...string) *loadDriver {
	t.Helper()
	d := &loadDriver{stopc: make(chan struct{})}
	client := &http.Client{Timeout: 60 * time.Second}
	url := s.http + "/v2/models/" + model + "/infer"
	for range workers {
		d.wg.Go(func() {
			for {
				select {
				case <-d.stopc:
					return
				default:
				}
				req, err := http.NewRequest("POST", url, bytes.NewReader(body))
				if err != nil {
					panic(err)
				}
				req.Header.Set("Content-Type", "application/json")
				for i := 0; i+1 < len(header); i += 2 {
					req.Header.Set(header[i], header[i+1])
				}
				start := time.Now()
				resp, err := client.Do(req)
				if err != nil {
					d.record(answer{msg: err.Error(), at: time.Now(), took: time.Since(start)})
					continue
				}
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				a := answer{code: resp.StatusCode, at: time.Now(), took: time.Since(start)}
				switch {
				case err != nil:
					a.code, a.msg = 0, err.Error()
				case resp.StatusCode == http.StatusOK:
					// Binary outputs follow a JSON header of the length the header field gives.
					if n, err := strconv.Atoi(resp.Header.Get("Inference-Header-Content-Length")); err == nil && n <= len(b) {
						b = b[:n]
					}
					var out jsonInferResponse
					if err := json.Unmarshal(b, &out); err != nil {
						a.code, a.msg = 0, fmt.Sprintf("200 with an undecodable body: %v", err)
					}
					a.version = out.ModelVersion
				default:
					a.msg = string(bytes.TrimSpace(b))
				}
				d.record(a)
			}
		})
	}
	t.Cleanup(d.stop)
	return d
}

func (d *loadDriver) record(a answer) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.answers = append(d.answers, a)
}

// snapshot returns the answers so far.
func (d *loadDriver) snapshot() []answer {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.answers)
}

// lastVersion is the model_version of the latest successful answer.
func (d *loadDriver) lastVersion() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	for i := len(d.answers) - 1; i >= 0; i-- {
		if d.answers[i].code == http.StatusOK {
			return d.answers[i].version
		}
	}
	return ""
}

// waitMore waits until n more answers have come: the load ran across
// whatever happened before the call.
func (d *loadDriver) waitMore(t *testing.T, n int) {
	t.Helper()
	base := len(d.snapshot())
	waitFor(t, fmt.Sprintf("%d more answers", n), 60*time.Second, func() bool { return len(d.snapshot()) >= base+n })
}

func (d *loadDriver) stop() {
	select {
	case <-d.stopc:
	default:
		close(d.stopc)
	}
	d.wg.Wait()
}

// requireOnly stops the load and fails the test if any answer had a
// status other than those allowed; it returns the answers.
func (d *loadDriver) requireOnly(t *testing.T, what string, allowed ...int) []answer {
	t.Helper()
	d.stop()
	all := d.snapshot()
	byCode, byVersion := map[int]int{}, map[string]int{}
	var bad []string
	for _, a := range all {
		byCode[a.code]++
		if a.code == http.StatusOK {
			byVersion[a.version]++
		}
		if !slices.Contains(allowed, a.code) && len(bad) < 10 {
			bad = append(bad, fmt.Sprintf("%d %s", a.code, a.msg))
		}
	}
	if len(bad) > 0 {
		t.Fatalf("%s: %d requests by status %v, want only %v; for example:\n%s", what, len(all), byCode, allowed, strings.Join(bad, "\n"))
	}
	t.Logf("%s: %d requests by status %v, 200s by version %v", what, len(all), byCode, byVersion)
	return all
}

// requireNoFailures is requireOnly(200).
func (d *loadDriver) requireNoFailures(t *testing.T, what string) {
	t.Helper()
	d.requireOnly(t, what, http.StatusOK)
}

// indexEntry is one row of POST /v2/repository/index.
type indexEntry struct {
	Name, Version, State, Reason string
}

func (s *testServer) index(t *testing.T) []indexEntry {
	t.Helper()
	var idx []indexEntry
	if code := s.json(t, "POST", "/v2/repository/index", nil, &idx); code != 200 {
		t.Fatalf("repository index: %d", code)
	}
	return idx
}

// entries returns the index rows of one model.
func (s *testServer) entries(t *testing.T, model string) []indexEntry {
	t.Helper()
	var out []indexEntry
	for _, e := range s.index(t) {
		if e.Name == model {
			out = append(out, e)
		}
	}
	return out
}

// replaceFile writes a file atomically (temp file, rename), as a deployment
// tool should, so a poll never reads half of it.
func replaceFile(t *testing.T, path string, data []byte) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), ".tmp-"+filepath.Base(path))
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// addVersion links a model file into a new version folder of a model,
// leaving its config alone.
func addVersion(t *testing.T, repo, model, version, file string) {
	t.Helper()
	dir := filepath.Join(repo, model, version)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(file, filepath.Join(dir, "model.onnx")); err != nil {
		t.Fatal(err)
	}
}

// batchBody is a dynamic-axes request of rows rows.
func batchBody(rows int) []byte {
	data := strings.TrimSuffix(strings.Repeat("1,", rows*10), ",")
	return fmt.Appendf(nil, `{"inputs":[{"name":"input_vectors","datatype":"FP32","shape":[%d,10],"data":[%s]}]}`, rows, data)
}

// Poll mode under continuous load: a changed config and an added version
// are reloaded with the new instances ready before the old ones drain, so
// not one request fails; the change takes effect and the old runners exit.
//
// The model is latency-critical under an SLO that admits everything: the
// test is about reloading, and a best-effort model would be moved to the
// background (idle-class) cgroup, which a test server started in the
// machine's root cgroup shares with everything else on the machine.
// Beside two CPU burners such a runner got 3 ms of CPU in 2 s and 300
// answers took over a minute (`make test` beside two burners, run 4 of
// 2026-11-30); in a container, the idle class yields to the container's
// own processes only.
func TestE2EPollReloadUnderLoad(t *testing.T) {
	repo := t.TempDir()
	dyn := testModel(t, "example_dynamic_axes.onnx")
	const critical = "slo: {latency_ms: 60000, class: latency-critical}\n"
	writeRepo(t, repo, repoModel{"dyn", dyn, "max_batch_size: 8\n" + critical})
	s := startServer(t, repo, "model_control: poll\npoll_interval: 200ms\n")
	dir := filepath.Join(repo, "dyn")
	before := s.runnerPids(t, dir)
	if len(before) != 1 {
		t.Fatalf("want 1 runner for dyn, found %v", before)
	}
	if code, b, _ := s.do(t, "POST", "/v2/models/dyn/infer", batchBody(6)); code != 200 {
		t.Fatalf("batch of 6 under max_batch_size 8: %d %s", code, b)
	}

	load := driveLoad(t, s, "dyn", dynBody, 4)
	load.waitMore(t, 300)

	// (a) A config change: two instances, a smaller batch limit.
	replaceFile(t, filepath.Join(dir, "config.yaml"), []byte("name: dyn\nmax_batch_size: 4\ninstances: 2\n"+critical))
	waitFor(t, "two new runners and the old one gone", 60*time.Second, func() bool {
		now := s.runnerPids(t, dir)
		return len(now) == 2 && !containsAny(now, before)
	})
	load.waitMore(t, 300)
	if code, b, _ := s.do(t, "POST", "/v2/models/dyn/infer", batchBody(6)); code != 400 {
		t.Errorf("batch of 6 after max_batch_size became 4: %d %s, want 400", code, b)
	}

	// (b) A new version folder: version 2 takes over from version 1.
	v1 := s.runnerPids(t, dir)
	addVersion(t, repo, "dyn", "2", dyn)
	waitFor(t, "requests to be served by version 2", 60*time.Second, func() bool { return load.lastVersion() == "2" })
	load.waitMore(t, 300)
	load.requireNoFailures(t, "config change and new version under load")

	waitFor(t, "version 1's runners to exit", 30*time.Second, func() bool {
		now := s.runnerPids(t, dir)
		return len(now) == 2 && !containsAny(now, v1)
	})
	idx := s.entries(t, "dyn")
	if len(idx) != 1 || idx[0].Version != "2" || idx[0].State != "READY" || idx[0].Reason != "" {
		t.Errorf("index after the new version = %+v, want only version 2 READY", idx)
	}
	// Its serving, QoS, share and predictor series go (the shares with the
	// adjuster's next pass).
	var series map[string]float64
	waitFor(t, "version 1's series to go", 30*time.Second, func() bool {
		series = s.scrape(t)
		for k := range series {
			if strings.Contains(k, `model="dyn",version="1"`) || strings.Contains(k, `model="dyn/1"`) {
				return false
			}
		}
		return true
	})
	if v := series[stateSeries("dyn", "2", "READY")]; v != 1 {
		t.Errorf("sloserve_model_state READY for version 2 = %v, want 1", v)
	}
	if v := series[`sloserve_model_loads_total{model="dyn"}`]; v != 3 {
		t.Errorf("sloserve_model_loads_total = %v, want 3 (start, config change, new version)", v)
	}
}

func containsAny(xs, ys []int) bool {
	for _, x := range xs {
		for _, y := range ys {
			if x == y {
				return true
			}
		}
	}
	return false
}

// hup sends the server SIGHUP.
func (s *testServer) hup(t *testing.T) {
	t.Helper()
	if err := s.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
}

// Poll mode: invalid changes are refused with the reason in the log, the
// metrics and the index while the previous version serves every request;
// the same files are not tried again every poll; fixing the folder reloads
// it and clears the failure.
func TestE2EPollInvalidChange(t *testing.T) {
	repo := t.TempDir()
	dyn := testModel(t, "example_dynamic_axes.onnx")
	good := "name: dyn\nmax_batch_size: 8\n"
	writeRepo(t, repo, repoModel{"dyn", dyn, "max_batch_size: 8\n"})
	s := startServer(t, repo, "model_control: poll\npoll_interval: 200ms\n")
	dir := filepath.Join(repo, "dyn")
	config := filepath.Join(dir, "config.yaml")
	metric := func(series string) float64 { return s.scrape(t)[series] }
	const (
		failures = `sloserve_model_load_failures_total{model="dyn"}`
		failed   = `sloserve_model_load_failed{model="dyn"}`
	)
	load := driveLoad(t, s, "dyn", dynBody, 2)

	for i, tc := range []struct{ name, config, cause string }{
		{"broken YAML", "name: dyn\nmax_batch_size: [8\n", "did not find expected"},
		{"an unknown field", "name: dyn\nmax_batch_size: 8\nmax_batch: 4\n", "max_batch: unknown field"},
		{"inputs the file does not have", "name: dyn\nmax_batch_size: 8\ninputs: [{name: input_vectors, datatype: INT32, shape: [-1, 10]}]\n",
			"config says datatype INT32, the model file has FP32"},
	} {
		replaceFile(t, config, []byte(tc.config))
		waitFor(t, tc.name+" to be refused", 30*time.Second, func() bool {
			e := s.entries(t, "dyn")
			return len(e) == 1 && strings.Contains(e[0].Reason, tc.cause)
		})
		e := s.entries(t, "dyn")[0]
		if e.Version != "1" || e.State != "READY" || !strings.HasPrefix(e.Reason, "reload failed, previous version serving: ") {
			t.Errorf("%s: index entry %+v, want version 1 READY and the reason", tc.name, e)
		}
		if got := metric(failures); got != float64(i+1) {
			t.Errorf("%s: %s = %v, want %d", tc.name, failures, got, i+1)
		}
		if got := metric(failed); got != 1 {
			t.Errorf("%s: %s = %v, want 1", tc.name, failed, got)
		}
		if !s.logHas("level=ERROR", "model reload failed; the previous version keeps serving", "model=dyn", tc.cause) {
			t.Errorf("%s: no error in the log naming the model and %q", tc.name, tc.cause)
		}
		load.waitMore(t, 20)
	}

	// The failed files are not tried again: a pass that loads another
	// model leaves dyn alone.
	addModel(t, repo, repoModel{"probe", dyn, "max_batch_size: 8\n"}, 1)
	waitFor(t, "probe to load", 30*time.Second, func() bool {
		code, _, _ := s.do(t, "POST", "/v2/models/probe/infer", dynBody)
		return code == 200
	})
	if got := metric(failures); got != 3 {
		t.Errorf("%s = %v after more polls, want 3: the same files were tried again", failures, got)
	}

	// Fixed: reloaded, the failure cleared.
	replaceFile(t, config, []byte(good))
	waitFor(t, "the fixed config to load", 30*time.Second, func() bool {
		e := s.entries(t, "dyn")
		return len(e) == 1 && e[0].State == "READY" && e[0].Reason == ""
	})
	if got := metric(failed); got != 0 {
		t.Errorf("after the fix: %s = %v, want 0", failed, got)
	}

	// A new version whose model file is not ONNX, staged and moved in
	// whole: version 1 keeps serving.
	staging := filepath.Join(dir, ".staging")
	if err := os.MkdirAll(staging, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(staging, "model.onnx"), []byte("this is not an ONNX model"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(staging, filepath.Join(dir, "2")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "version 2 to be refused", 60*time.Second, func() bool {
		e := s.entries(t, "dyn")
		return len(e) == 2 && e[1].State == "UNAVAILABLE" && e[1].Reason != ""
	})
	e := s.entries(t, "dyn")
	const cause = "Protobuf parsing failed" // ONNX Runtime's word for it
	if e[0].Version != "1" || e[0].State != "READY" || !strings.HasPrefix(e[0].Reason, "reload failed, previous version serving: version 2: ") ||
		!strings.Contains(e[1].Reason, cause) {
		t.Errorf("index with a broken version 2 = %+v, want version 1 READY and the cause %q", e, cause)
	}
	if !s.logHas("level=ERROR", "model reload failed; the previous version keeps serving", "model=dyn", "version 2: runner dyn/2#0 exited before it was ready") ||
		!strings.Contains(s.log.String(), cause) {
		t.Error("no error in the log naming the model, the version and the cause")
	}
	if got := metric(failures); got != 4 {
		t.Errorf("%s = %v, want 4", failures, got)
	}
	if got := metric(stateSeries("dyn", "2", "UNAVAILABLE")); got != 1 {
		t.Errorf("state of version 2 = %v, want UNAVAILABLE", got)
	}
	load.waitMore(t, 20)
	if v := load.lastVersion(); v != "1" {
		t.Errorf("requests served by version %q, want 1", v)
	}

	// The model file replaced by a good one (atomically): version 2 serves.
	tmp := filepath.Join(dir, "2", ".model.onnx.tmp")
	if err := os.Symlink(dyn, tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, "2", "model.onnx")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "version 2 to serve", 60*time.Second, func() bool { return load.lastVersion() == "2" })
	load.waitMore(t, 20)
	load.requireNoFailures(t, "invalid changes under load")
	if e := s.entries(t, "dyn"); len(e) != 1 || e[0].Version != "2" || e[0].Reason != "" {
		t.Errorf("index after the fix = %+v", e)
	}
	if got := metric(failed); got != 0 {
		t.Errorf("after the fix: %s = %v, want 0", failed, got)
	}
}

func stateSeries(model, version, state string) string {
	return fmt.Sprintf(`sloserve_model_state{model=%q,state=%q,version=%q}`, model, state, version)
}

// Poll mode: a model folder removed under load is unloaded after the
// requests it had admitted finish (every one 200); later requests get 404;
// its runner exits and its series go.
//
// The server reports how many requests its drain met in flight ("version
// drained ... requests=N"); the test needs N > 0 to show those answered
// 200, and removes the folder again (after putting it back) until the
// drain meets some. A client-side proxy (a 200 after the first 404) failed
// 1 in 17 runs on a busy host: closed-loop clients whose requests were
// still being read, not yet at the model's lookup, got their 404s only
// after the one or two in flight had finished. Under -race beside two CPU
// burners the test's own clients are the bottleneck, not the one-slot
// model: 9 of 19 removals in 10 runs met no request in flight (the most in
// a row: 3), hence up to 20 tries.
func TestE2EPollRemoveUnderLoad(t *testing.T) {
	repo, outside := t.TempDir(), t.TempDir()
	writeRepo(t, repo,
		// Latency-critical with an SLO nothing misses: a best-effort
		// runner gets no CPU beside other load (CI's), and admission
		// refuses nothing, so every answer is 200 or 404.
		repoModel{"det", demoModel(t, "ocr-det"), "max_batch_size: 1\nexecution: {intra_op_threads: 1}\nslo: {latency_ms: 600000, class: latency-critical}\n"},
		repoModel{"dyn", testModel(t, "example_dynamic_axes.onnx"), "max_batch_size: 8\n"},
	)
	s := startServer(t, repo, "model_control: poll\npoll_interval: 200ms\n")
	body, hlen := detRequest(t, 320, nil)
	// Eight closed-loop clients on a one-slot model keep requests queued
	// and running at most moments.
	load := driveLoad(t, s, "det", body, 8, "Inference-Header-Content-Length", hlen)
	load.waitMore(t, 12)

	drainedLine := regexp.MustCompile(`msg="version drained" .*model=det version=1 requests=(\d+) `)
	drains := func() []int {
		var n []int
		for _, m := range drainedLine.FindAllStringSubmatch(s.log.String(), -1) {
			v, _ := strconv.Atoi(m[1])
			n = append(n, v)
		}
		return n
	}
	const tries = 20
	met := 0
	for try := 1; met == 0; try++ {
		if try > tries {
			t.Fatalf("in %d removals under load of 8 clients the drain met no request in flight (drains: %v)", tries, drains())
		}
		from, removed := len(load.snapshot()), time.Now()
		// Moved out whole, as a deployment tool would.
		if err := os.Rename(filepath.Join(repo, "det"), filepath.Join(outside, "det")); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "requests for det to get 404", 30*time.Second, func() bool {
			return slices.ContainsFunc(load.snapshot()[from:], func(a answer) bool { return a.code == http.StatusNotFound })
		})
		waitFor(t, "the drain's report", 60*time.Second, func() bool { return len(drains()) == try })
		met = drains()[try-1]
		t.Logf("removal %d: the drain met %d requests in flight", try, met)
		if met > 0 {
			// Each ended with a 200 after the removal: the drain
			// ended after them, the client's answer soon after.
			waitFor(t, fmt.Sprintf("%d answers of 200 after the removal", met), 30*time.Second, func() bool {
				ok := 0
				for _, a := range load.snapshot() {
					if a.code == http.StatusOK && a.at.After(removed) {
						ok++
					}
				}
				return ok >= met
			})
			break
		}
		// None in flight: back in, serving again, and once more.
		if err := os.Rename(filepath.Join(outside, "det"), filepath.Join(repo, "det")); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "det to load again", 120*time.Second, func() bool {
			e := s.entries(t, "det")
			return len(e) == 1 && e[0].State == "READY"
		})
		back := len(load.snapshot())
		waitFor(t, "det to serve again", 60*time.Second, func() bool {
			return slices.ContainsFunc(load.snapshot()[back:], func(a answer) bool { return a.code == http.StatusOK })
		})
		load.waitMore(t, 12)
	}
	load.waitMore(t, 10)
	allowed := []int{http.StatusOK, http.StatusNotFound}
	if len(drains()) > 1 {
		// Put back, the model is found and loads: 503 until it is ready.
		allowed = append(allowed, http.StatusServiceUnavailable)
	}
	answers := load.requireOnly(t, "removal under load", allowed...)
	for _, a := range answers {
		if a.code == http.StatusNotFound && !strings.Contains(a.msg, "model not found") {
			t.Errorf("404 body %q", a.msg)
			break
		}
	}

	waitFor(t, "det's runner to exit", 30*time.Second, func() bool { return len(s.runnerPids(t, filepath.Join(repo, "det"))) == 0 })
	// Serving, load, QoS, share and predictor series alike (the shares
	// with the adjuster's next pass).
	waitFor(t, "the removed model's series to go", 30*time.Second, func() bool {
		for k := range s.scrape(t) {
			if strings.Contains(k, `model="det"`) || strings.Contains(k, `model="det/1"`) {
				return false
			}
		}
		return true
	})
	for _, e := range s.index(t) {
		if e.Name == "det" {
			t.Errorf("a removed model is still in the index: %+v", e)
		}
	}
	if code, b, _ := s.do(t, "POST", "/v2/models/dyn/infer", dynBody); code != 200 {
		t.Errorf("dyn after det was removed: %d %s", code, b)
	}
}

// Explicit mode does the same on demand: a load of a changed config under
// load drops nothing; a load of an invalid config is refused with 400 and
// the reason while the previous version serves; a new version loads; an
// unload drains and stops the runners.
func TestE2EExplicitReloadUnderLoad(t *testing.T) {
	repo := t.TempDir()
	dyn := testModel(t, "example_dynamic_axes.onnx")
	writeRepo(t, repo, repoModel{"dyn", dyn, "max_batch_size: 8\n"})
	s := startServer(t, repo, "model_control: explicit\n")
	dir := filepath.Join(repo, "dyn")
	config := filepath.Join(dir, "config.yaml")
	if code, b, _ := s.do(t, "POST", "/v2/repository/models/dyn/load", nil); code != 200 {
		t.Fatalf("load: %d %s", code, b)
	}
	before := s.runnerPids(t, dir)
	load := driveLoad(t, s, "dyn", dynBody, 3)
	load.waitMore(t, 50)

	replaceFile(t, config, []byte("name: dyn\nmax_batch_size: 8\ninstances: 2\n"))
	if code, b, _ := s.do(t, "POST", "/v2/repository/models/dyn/load", nil); code != 200 {
		t.Fatalf("reload: %d %s", code, b)
	}
	waitFor(t, "two new runners and the old one gone", 30*time.Second, func() bool {
		now := s.runnerPids(t, dir)
		return len(now) == 2 && !containsAny(now, before)
	})
	load.waitMore(t, 50)

	replaceFile(t, config, []byte("name: dyn\nmax_batch_size: 8\ninstances: 2\nslo: {latency_ms: -1}\n"))
	code, b, _ := s.do(t, "POST", "/v2/repository/models/dyn/load", nil)
	if code != 400 || !strings.Contains(string(b), "slo.latency_ms") {
		t.Errorf("load of an invalid config: %d %s, want 400 naming slo.latency_ms", code, b)
	}
	if e := s.entries(t, "dyn"); len(e) != 1 || e[0].State != "READY" || !strings.Contains(e[0].Reason, "slo.latency_ms") {
		t.Errorf("index after the refused load = %+v", e)
	}
	if v, _ := s.metricValue(t, `sloserve_model_load_failures_total{model="dyn"}`); v != 1 {
		t.Errorf("load failures = %v, want 1", v)
	}
	load.waitMore(t, 50)

	replaceFile(t, config, []byte("name: dyn\nmax_batch_size: 8\ninstances: 2\n"))
	addVersion(t, repo, "dyn", "2", dyn)
	if code, b, _ := s.do(t, "POST", "/v2/repository/models/dyn/load", nil); code != 200 {
		t.Fatalf("load of version 2: %d %s", code, b)
	}
	waitFor(t, "requests to be served by version 2", 30*time.Second, func() bool { return load.lastVersion() == "2" })
	load.waitMore(t, 50)

	// A version 3 that is not ONNX: refused with the cause, version 2 serves.
	if err := os.MkdirAll(filepath.Join(dir, "3"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "3", "model.onnx"), []byte("not ONNX"), 0o644); err != nil {
		t.Fatal(err)
	}
	code, b, _ = s.do(t, "POST", "/v2/repository/models/dyn/load", nil)
	if code < 400 || !strings.Contains(string(b), "Protobuf parsing failed") {
		t.Errorf("load of a broken version 3: %d %s, want an error with the cause", code, b)
	}
	load.waitMore(t, 50)
	if v := load.lastVersion(); v != "2" {
		t.Errorf("after a refused version 3, requests go to version %q, want 2", v)
	}
	load.requireNoFailures(t, "explicit reloads under load")
	if v, _ := s.metricValue(t, `sloserve_model_load_failed{model="dyn"}`); v != 1 {
		t.Errorf("load_failed after the refused version 3 = %v, want 1", v)
	}

	// Unload under load: requests before it succeed, after it get 503.
	load = driveLoad(t, s, "dyn", dynBody, 3)
	load.waitMore(t, 50)
	if code, b, _ := s.do(t, "POST", "/v2/repository/models/dyn/unload", nil); code != 200 {
		t.Fatalf("unload: %d %s", code, b)
	}
	load.waitMore(t, 10)
	load.requireOnly(t, "unload under load", http.StatusOK, http.StatusServiceUnavailable)
	waitFor(t, "dyn's runners to exit", 30*time.Second, func() bool { return len(s.runnerPids(t, dir)) == 0 })
	if v, _ := s.metricValue(t, stateSeries("dyn", "2", "UNAVAILABLE")); v != 1 {
		t.Errorf("state of an unloaded version: UNAVAILABLE = %v, want 1", v)
	}
}

// SIGHUP and POST /v2/config/reload reread the server config: a rescan at
// once, repositories added and removed live, an invalid config refused with
// the field in the log, the metrics and the API answer while nothing
// changes, and keys that need a restart named.
func TestE2EConfigReload(t *testing.T) {
	repoA, repoB := t.TempDir(), t.TempDir()
	dyn := testModel(t, "example_dynamic_axes.onnx")
	writeRepo(t, repoA, repoModel{"dyn", dyn, "max_batch_size: 8\n"})
	writeRepo(t, repoB, repoModel{"multi", testModel(t, "example_multitype.onnx"), ""})
	s := startServer(t, repoA, "model_control: poll\npoll_interval: 1h\n")
	rewrite := func(repos []string, old, new string) {
		t.Helper()
		quoted := make([]string, len(repos))
		for i, r := range repos {
			quoted[i] = strconv.Quote(r)
		}
		text := strings.Replace(s.config, fmt.Sprintf("repositories: [%q]", repoA), "repositories: ["+strings.Join(quoted, ", ")+"]", 1)
		if old != "" && !strings.Contains(text, old) {
			t.Fatalf("config has no %q", old)
		}
		replaceFile(t, s.configPath, []byte(strings.Replace(text, old, new, 1)))
	}
	served := func(model string, body []byte) bool {
		code, _, _ := s.do(t, "POST", "/v2/models/"+model+"/infer", body)
		return code == 200
	}
	metric := func(series string) float64 { return s.scrape(t)[series] }
	const (
		success = `sloserve_config_reloads_total{result="success"}`
		failure = `sloserve_config_reloads_total{result="failure"}`
		lastOK  = `sloserve_config_last_reload_successful`
		restart = `sloserve_config_restart_required`
	)

	// The config unchanged, a new folder: SIGHUP rescans at once (the
	// poll interval is an hour).
	addModel(t, repoA, repoModel{"late", dyn, "max_batch_size: 8\n"}, 1)
	s.hup(t)
	waitFor(t, "late to load after SIGHUP", 30*time.Second, func() bool { return served("late", dynBody) })

	// Another repository and a short poll interval, live.
	rewrite([]string{repoA, repoB}, "poll_interval: 1h", "poll_interval: 200ms")
	s.hup(t)
	waitFor(t, "multi from the added repository to load", 30*time.Second, func() bool { return served("multi", multiBody) })
	if !s.logHas(`msg="config reloaded"`, "applied=\"[repositories poll_interval]\"", "restart_needed=[]") {
		t.Error("no log line saying what the reload applied")
	}
	if metric(success) != 2 || metric(failure) != 0 || metric(lastOK) != 1 {
		t.Errorf("after good reloads: success %v failure %v last ok %v", metric(success), metric(failure), metric(lastOK))
	}
	addModel(t, repoB, repoModel{"polled", dyn, "max_batch_size: 8\n"}, 1)
	waitFor(t, "the new poll interval to load a new folder", 30*time.Second, func() bool { return served("polled", dynBody) })

	// Invalid: refused, nothing changes.
	rewrite([]string{repoA}, "poll_interval: 1h", "poll_interval: -1s")
	s.hup(t)
	waitFor(t, "the failed reload to be counted", 30*time.Second, func() bool { return metric(failure) == 1 })
	if metric(lastOK) != 0 {
		t.Errorf("%s = %v after a failure, want 0", lastOK, metric(lastOK))
	}
	if !s.logHas("level=ERROR", "config reload failed; nothing changed", "poll_interval: must be > 0") {
		t.Error("no error in the log naming the field")
	}
	var apiErr struct{ Error string }
	if code := s.json(t, "POST", "/v2/config/reload", nil, &apiErr); code != 400 || !strings.Contains(apiErr.Error, s.configPath+": poll_interval: must be > 0") {
		t.Errorf("POST /v2/config/reload with an invalid config: %d %q, want 400 naming the file and field", code, apiErr.Error)
	}
	if !served("multi", multiBody) || !served("dyn", dynBody) {
		t.Error("a model stopped serving after an invalid config")
	}

	// Repository B removed and a key that needs a restart changed, over the API.
	rewrite([]string{repoA}, "poll_interval: 1h", "poll_interval: 200ms\nqos: {window: 5s}")
	var res struct {
		Reloaded      bool     `json:"reloaded"`
		Applied       []string `json:"applied"`
		RestartNeeded []string `json:"restart_needed"`
	}
	if code := s.json(t, "POST", "/v2/config/reload", nil, &res); code != 200 || !res.Reloaded ||
		!slices.Equal(res.Applied, []string{"repositories"}) || !slices.Equal(res.RestartNeeded, []string{"qos.window"}) {
		t.Errorf("POST /v2/config/reload: %d %+v, want repositories applied and qos.window needing a restart", code, res)
	}
	waitFor(t, "multi to unload with its repository", 30*time.Second, func() bool {
		code, _, _ := s.do(t, "GET", "/v2/models/multi", nil)
		return code == 404
	})
	waitFor(t, "multi's runner to exit", 30*time.Second, func() bool { return len(s.runnerPids(t, filepath.Join(repoB, "multi"))) == 0 })
	if !s.logHas("level=WARN", "needs a restart", "key=qos.window") {
		t.Error("no warning naming the key that needs a restart")
	}
	if metric(restart) != 1 || metric(lastOK) != 1 || metric(success) != 3 || metric(failure) != 2 {
		t.Errorf("after the API reload: restart required %v, last ok %v, success %v, failure %v",
			metric(restart), metric(lastOK), metric(success), metric(failure))
	}
	if !served("dyn", dynBody) {
		t.Error("dyn stopped serving")
	}
}

// In none mode nothing follows the disk until SIGHUP, which loads new
// folders and reloads changed ones.
func TestE2ENoneModeReloadsOnSIGHUP(t *testing.T) {
	repo := t.TempDir()
	dyn := testModel(t, "example_dynamic_axes.onnx")
	writeRepo(t, repo, repoModel{"dyn", dyn, "max_batch_size: 8\n"})
	s := startServer(t, repo, "")
	dir := filepath.Join(repo, "dyn")
	before := s.runnerPids(t, dir)
	replaceFile(t, filepath.Join(dir, "config.yaml"), []byte("name: dyn\nmax_batch_size: 8\ninstances: 2\n"))
	addModel(t, repo, repoModel{"multi", testModel(t, "example_multitype.onnx"), ""}, 1)
	load := driveLoad(t, s, "dyn", dynBody, 2)
	load.waitMore(t, 20)
	if code, _, _ := s.do(t, "GET", "/v2/models/multi", nil); code != 404 {
		t.Errorf("none mode found a new folder before SIGHUP: %d", code)
	}
	s.hup(t)
	waitFor(t, "multi to load after SIGHUP", 30*time.Second, func() bool {
		code, _, _ := s.do(t, "POST", "/v2/models/multi/infer", multiBody)
		return code == 200
	})
	// The server's word that dyn serves two instances, and none of its
	// runners of before left. The processes are counted at least two, not
	// exactly: dyn is best-effort, and a resize's replacement runner may be
	// starting beside the two (on a full host, at a background share, for
	// seconds: three processes for all of 30 s beside two burners).
	waitFor(t, "dyn to reload with two instances", 30*time.Second, func() bool {
		now := s.runnerPids(t, dir)
		return s.logHas(`msg="model ready"`, "model=dyn ", "instances=2 ") && len(now) >= 2 && !containsAny(now, before)
	})
	load.waitMore(t, 20)
	load.requireNoFailures(t, "none-mode reload on SIGHUP")
}
