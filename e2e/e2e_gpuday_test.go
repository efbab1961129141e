package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The GPU day (loadtest/scenarios/gpu-day.yaml) compressed to seconds: the
// real binary serves its twelve models on four simulated GPUs with
// placement on, and the real loadtest command drives the scenario's load
// (its 6-minute daily curves squeezed into 20 s) against it. Every model
// serves and nothing fails; the eleven models that name no device were
// placed at load across the four devices, each placement an event with
// its reason, and the pinned one stays on the device its config names.
func TestE2EGPUDayServes(t *testing.T) {
	root, err := filepath.Abs(filepath.Join("..", "loadtest", "scenarios"))
	if err != nil {
		t.Fatal(err)
	}
	text, err := os.ReadFile(filepath.Join(root, "gpu-day.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	scenario := strings.ReplaceAll(string(text), "period: 6m", "period: 20s")
	if scenario == string(text) {
		t.Fatal("gpu-day.yaml has no 'period: 6m' curve to compress")
	}
	s := startServer(t, filepath.Join(root, "gpu-day-repository"), `gpu:
  simulator: {devices: 4, memory: 40GiB}
  placement: {enabled: true, period: 5s, min_residence: 10s}
control:
  profile: {runs: 2}
`)
	out, stdout := runLoadtest(t, scenario, "--http", s.http, "--grpc", s.grpcAddr, "--duration", "20s", "--warmup", "2s", "--quiet")
	sum := readSummary(t, filepath.Join(out, "summary.json"))
	if len(sum.Models) != 12 {
		t.Fatalf("summary has %d models, want 12:\n%s", len(sum.Models), stdout)
	}
	for _, m := range sum.Models {
		served := m.Outcomes["good"] + m.Outcomes["late"]
		if served == 0 || m.Outcomes["failed"] > 0 {
			t.Errorf("%s (%s): %d served, outcomes %v: want served and none failed", m.Name, m.Class, served, m.Outcomes)
		}
	}

	// Where each model runs now, from the control status. A device's
	// part of it is as old as its adjuster's last pass, which a swap in
	// progress holds up (a moved model shows on its new device after
	// that device's next pass): wait for all twelve.
	at := map[string]string{}
	waitFor(t, "the control status to show the twelve models", 30*time.Second, func() bool {
		clear(at)
		for _, d := range s.control(t).Devices {
			for _, m := range d.Models {
				name, _, _ := strings.Cut(m.Model, "/")
				at[name] = d.Device
			}
		}
		return len(at) == 12
	})
	if at["lc-resnet-c"] != "cuda:0" {
		t.Errorf("lc-resnet-c (device_id: 0) runs on %s", at["lc-resnet-c"])
	}

	// Where each was placed at load, from the events. Moves may follow
	// (the compressed curves drift fast); they are logged.
	var ev struct {
		Events []struct {
			Device, Model, Kind, Reason string
		} `json:"events"`
	}
	if code := s.json(t, "GET", "/v2/control/events", nil, &ev); code != 200 {
		t.Fatalf("GET /v2/control/events: %d", code)
	}
	placed := map[string]string{}
	atLoad := map[string]int{"cuda:0": 1} // lc-resnet-c, pinned
	for _, e := range ev.Events {
		switch e.Kind {
		case "place":
			placed[e.Model] = e.Device
			atLoad[e.Device]++
			if !strings.Contains(e.Reason, "placed at load") {
				t.Errorf("place event of %s without its reason: %q", e.Model, e.Reason)
			}
		case "move":
			t.Logf("move of %s to %s: %s", e.Model, e.Device, e.Reason)
		}
	}
	if _, ok := placed["lc-resnet-c"]; len(placed) != 11 || ok {
		t.Errorf("place events for %d models (%v), want the 11 that name no device", len(placed), placed)
	}
	// With the prior demands (0.25 a latency-critical model, 0.1 a
	// best-effort one), greedy placement leaves no device more than 0.25
	// above another: every device gets two models at least.
	for _, d := range []string{"cuda:0", "cuda:1", "cuda:2", "cuda:3"} {
		if atLoad[d] < 2 {
			t.Errorf("%s got %d models at load, want the twelve spread (%v)", d, atLoad[d], placed)
		}
	}
}
