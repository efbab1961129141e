package models

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/sloserve/sloserve/qos"
)

// gatherSeries reads every series of the given families as name{label=value,...}
// in the registry's label order.
func gatherSeries(t *testing.T, g prometheus.Gatherer, prefix string) (map[string]float64, map[string]dto.MetricType) {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out, types := map[string]float64{}, map[string]dto.MetricType{}
	for _, mf := range mfs {
		if !strings.HasPrefix(mf.GetName(), prefix) {
			continue
		}
		types[mf.GetName()] = mf.GetType()
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			key := mf.GetName() + "{" + strings.Join(ls, ",") + "}"
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				out[key] = m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				out[key] = m.GetGauge().GetValue()
			}
		}
	}
	return out, types
}

// Triton's nv_inference_* series read the statistics extension's numbers:
// successes, failures by Triton's reason, inferences, executions and the
// microsecond totals, and a version's series leave with it.
func TestTritonMetrics(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
	r, f, preg := newTestRegistry(t, ControlExplicit, repo)
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	if err := r.Load(t.Context(), "sum"); err != nil {
		t.Fatal(err)
	}

	// Two answered requests of 2 and 1 rows, each 1 ms of compute.
	for _, rows := range [][][4]float32{{{1, 2, 3, 4}, {5, 6, 7, 8}}, {{1, 1, 1, 1}}} {
		if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest(rows...)); err != nil {
			t.Fatal(err)
		}
	}
	// Three invalid requests (OTHER).
	for range 3 {
		q := sumRequest([4]float32{})
		q.Inputs[0].Shape = []int64{4}
		if _, _, err := r.Infer(t.Context(), "sum", "", q); !errors.Is(err, ErrInvalidInput) {
			t.Fatalf("invalid request: %v", err)
		}
	}
	// One past its deadline at arrival (REJECTED).
	q := sumRequest([4]float32{})
	q.Deadline = time.Now().Add(-time.Millisecond)
	if _, _, err := r.Infer(t.Context(), "sum", "", q); !errors.Is(err, qos.ErrRejected) {
		t.Fatalf("late request: %v, want qos.ErrRejected", err)
	}
	// One the client gives up on while it runs (CANCELED).
	gate := make(chan struct{})
	f.mu.Lock()
	f.g = gate
	f.mu.Unlock()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { _, _, err := r.Infer(ctx, "sum", "", sumRequest([4]float32{})); done <- err }()
	inst := f.of("sum", 1)[0]
	for inst.calls.Load() < 3 { // the two answered, then this one
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled request: %v", err)
	}
	f.mu.Lock()
	f.g = nil
	f.mu.Unlock()
	close(gate)
	// Two whose instance is down (BACKEND).
	inst.down.Store(true)
	for range 2 {
		if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{})); err == nil {
			t.Fatal("a request on a down instance succeeded")
		}
	}

	st, err := r.Statistics("sum", "1")
	if err != nil {
		t.Fatal(err)
	}
	got, types := gatherSeries(t, preg, "nv_inference_")
	const l = "{model=sum,version=1}"
	want := map[string]float64{
		"nv_inference_request_success" + l:                                  2,
		"nv_inference_request_failure{model=sum,reason=OTHER,version=1}":    3,
		"nv_inference_request_failure{model=sum,reason=REJECTED,version=1}": 1,
		"nv_inference_request_failure{model=sum,reason=CANCELED,version=1}": 1,
		"nv_inference_request_failure{model=sum,reason=BACKEND,version=1}":  2,
		"nv_inference_count" + l:                                            3,
		"nv_inference_exec_count" + l:                                       2,
		"nv_inference_pending_request_count" + l:                            0,
		"nv_inference_compute_infer_duration_us" + l:                        2000,
		"nv_inference_compute_input_duration_us" + l:                        0,
		"nv_inference_compute_output_duration_us" + l:                       0,
		"nv_inference_request_duration_us" + l:                              float64(st[0].Success.Total.Microseconds()),
		"nv_inference_queue_duration_us" + l:                                float64(st[0].Queue.Total.Microseconds()),
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("%s = %v (present %v), want %v", k, g, ok, v)
		}
	}
	if len(got) != len(want) {
		t.Errorf("%d series, want %d: %v", len(got), len(want), got)
	}
	// The statistics extension's numbers, the same.
	if st[0].Success.Count != 2 || st[0].Fail.Count != 7 || st[0].InferenceCount != 3 || st[0].ExecutionCount != 2 {
		t.Errorf("statistics %+v", st[0])
	}
	if st[0].Success.Total <= 0 || st[0].Queue.Count != 2 {
		t.Errorf("success %+v, queue %+v", st[0].Success, st[0].Queue)
	}
	for name, typ := range types {
		want := dto.MetricType_COUNTER
		if name == "nv_inference_pending_request_count" {
			want = dto.MetricType_GAUGE
		}
		if typ != want {
			t.Errorf("%s is a %v, want a %v", name, typ, want)
		}
	}

	if err := r.Unload(t.Context(), "sum"); err != nil {
		t.Fatal(err)
	}
	if got, _ := gatherSeries(t, preg, "nv_inference_"); len(got) != 0 {
		t.Errorf("series of an unloaded model: %v", got)
	}
}
