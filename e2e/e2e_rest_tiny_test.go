package e2e

import (
	"strings"
	"testing"
	"time"
)

// Sixteen closed-loop REST JSON clients on the demo wake-word model,
// latency-critical with a 40 ms SLO, are all served: sixteen requests of
// about a millisecond each queue far less than the SLO, so admission must
// refuse none of them (issue 33 saw 4-36 refusals with 429 in a few
// seconds), and the sixteen together get at least as many answers a second
// as one client alone, measured in the same test.
func TestE2ERESTTinySixteenClients(t *testing.T) {
	s := startServer(t, wakeRepo(t), "")
	paths := tinyPaths(t, s)
	json := paths[1]
	if json.name != "rest-json" {
		t.Fatalf("path %q", json.name)
	}
	if _, _, err := tinyLoop(json, 16, time.Second); err != nil { // warm
		t.Fatal(err)
	}
	before := s.scrape(t)
	const one, sixteen = 2 * time.Second, 4 * time.Second
	ok1, refused1, err := tinyLoop(json, 1, one)
	if err != nil {
		t.Fatal(err)
	}
	ok16, refused16, err := tinyLoop(json, 16, sixteen)
	if err != nil {
		t.Fatal(err)
	}
	after := s.scrape(t)
	rate1, rate16 := float64(ok1)/one.Seconds(), float64(ok16)/sixteen.Seconds()
	t.Logf("1 client: %.0f/s, %d refused; 16 clients: %.0f/s, %d refused", rate1, refused1, rate16, refused16)
	if refused1+refused16 > 0 {
		var why []string
		for _, line := range strings.Split(s.log.String(), "\n") {
			if strings.Contains(line, "request rejected") && len(why) < 5 {
				why = append(why, line)
			}
		}
		t.Errorf("%d requests refused with 429 below capacity; the server said:\n%s", refused1+refused16, strings.Join(why, "\n"))
	}
	// The server's own count agrees: every request good, none rejected.
	series := `sloserve_qos_requests_total{class="latency-critical",device="cpu",model="` + wakeModel + `/1",outcome="`
	if d := after[series+`rejected"}`] - before[series+`rejected"}`]; d != 0 {
		t.Errorf("the scheduler counted %.0f rejected", d)
	}
	if d := after[series+`good"}`] - before[series+`good"}`]; d != float64(ok1+ok16) {
		t.Errorf("the scheduler counted %.0f good, the clients %d", d, ok1+ok16)
	}
	if rate16 < rate1 {
		t.Errorf("16 clients got %.0f answers a second, fewer than one client's %.0f", rate16, rate1)
	}
}
