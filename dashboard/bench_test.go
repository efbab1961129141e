package dashboard

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/sloserve/sloserve/qos"
)

// recorderWith returns a recorder holding an hour of history at 1 s for n
// models, all of them answering 10 requests a second.
func recorderWith(n int) (*Recorder, []ModelSample, time.Time) {
	r := New(Options{Retention: time.Hour})
	samples := make([]ModelSample, n)
	for i := range samples {
		samples[i] = sample(fmt.Sprintf("m%d/1", i), qos.Stats{Class: qos.ClassLatencyCritical, SLO: 100 * time.Millisecond})
	}
	now := t0
	for range 3600 {
		step(samples)
		r.Record(Snapshot{Time: now, Models: samples})
		now = now.Add(time.Second)
	}
	return r, samples, now
}

func step(samples []ModelSample) {
	for i := range samples {
		st := &samples[i].Stats
		st.Arrived += 10
		st.Good += 10
		for j := range 10 {
			st.Latency.Observe(time.Duration(5+j) * time.Millisecond)
		}
	}
}

// One sample of 20 models: what the server pays once a second.
func BenchmarkRecord20Models(b *testing.B) {
	r, samples, now := recorderWith(20)
	b.ReportAllocs()
	for b.Loop() {
		step(samples)
		r.Record(Snapshot{Time: now, Models: samples})
		now = now.Add(time.Second)
	}
}

// The overview of 20 models as JSON: what a dashboard poll costs.
func BenchmarkOverviewJSON20Models(b *testing.B) {
	r, _, _ := recorderWith(20)
	b.ReportAllocs()
	var size int
	for b.Loop() {
		out, err := json.Marshal(r.Overview())
		if err != nil {
			b.Fatal(err)
		}
		size = len(out)
	}
	b.ReportMetric(float64(size), "bytes/response")
}

// 15 minutes of one model's history as JSON: a model page's first load.
func BenchmarkHistoryJSON15m(b *testing.B) {
	r, _, _ := recorderWith(1)
	b.ReportAllocs()
	var size int
	for b.Loop() {
		h, err := r.History("m0", "", time.Time{}, 15*time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		out, err := json.Marshal(h)
		if err != nil {
			b.Fatal(err)
		}
		size = len(out)
	}
	b.ReportMetric(float64(size), "bytes/response")
}
