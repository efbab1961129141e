package models

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sloserve/sloserve/runtime"
)

// faultyInstance is a fake instance that can hang (answer nothing until
// its call is abandoned) or die of memory, and that takes itself out of
// service when told a call got no answer, as a runner does.
type faultyInstance struct {
	*fakeInstance
	hang     atomic.Bool
	oom      atomic.Bool
	suspects atomic.Int64
	checking atomic.Bool
}

func (fi *faultyInstance) Infer(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
	switch {
	case fi.hang.Load():
		fi.calls.Add(1)
		<-ctx.Done()
		return nil, ctx.Err()
	case fi.oom.Load():
		fi.calls.Add(1)
		return nil, fmt.Errorf("%w: killed", runtime.ErrOutOfMemory)
	}
	return fi.fakeInstance.Infer(ctx, req)
}

func (fi *faultyInstance) Status() (bool, string) {
	if fi.checking.Load() {
		return false, "checking"
	}
	return fi.fakeInstance.Status()
}

func (fi *faultyInstance) Suspect(string) {
	fi.suspects.Add(1)
	fi.checking.Store(true)
}

var _ Suspecter = (*faultyInstance)(nil)

// newFaultyRegistry serves model "sum" with two faulty instances.
func newFaultyRegistry(t *testing.T, callTimeout time.Duration) (*Registry, []*faultyInstance, *prometheus.Registry) {
	t.Helper()
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 2, 1), 1)
	f := &fakeFactory{fail: map[string]error{}}
	insts := make([]*faultyInstance, 2)
	preg := prometheus.NewRegistry()
	r, err := New(Options{
		Repositories:      []string{repo},
		MaxTensorElements: 1 << 20,
		CallTimeout:       callTimeout,
		NewInstance: func(ctx context.Context, spec InstanceSpec) (Instance, error) {
			inst, err := f.start(ctx, spec)
			if err != nil {
				return nil, err
			}
			fi := &faultyInstance{fakeInstance: inst.(*fakeInstance)}
			insts[spec.Index] = fi // each start writes its own element
			return fi, nil
		},
		Registerer: preg,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	if insts[0] == nil || insts[1] == nil {
		t.Fatalf("instances started: %v, want 2", insts)
	}
	return r, insts, preg
}

// A hung instance holds one call for the call timeout; the call is tried
// again on the other instance, the hung one is told, leaves the rotation,
// and no later request goes to it.
func TestHungInstanceLeavesRotation(t *testing.T) {
	const callTimeout = 50 * time.Millisecond
	r, insts, _ := newFaultyRegistry(t, callTimeout)
	insts[0].hang.Store(true)
	insts[1].hang.Store(false)
	var slowest time.Duration
	for range 20 {
		start := time.Now()
		if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 2, 3, 4})); err != nil {
			t.Fatalf("request failed although instance 1 was healthy: %v", err)
		}
		slowest = max(slowest, time.Since(start))
	}
	if got := insts[0].calls.Load(); got != 1 {
		t.Errorf("the hung instance got %d calls, want 1: it should leave the rotation after the first", got)
	}
	if got := insts[0].suspects.Load(); got != 1 {
		t.Errorf("the hung instance was told %d times, want 1", got)
	}
	if got := insts[1].calls.Load(); got != 20 {
		t.Errorf("the healthy instance got %d calls, want 20", got)
	}
	v, _ := r.serving("sum", "")
	if got := testutil.ToFloat64(v.obs.retries); got != 1 {
		t.Errorf("retries = %v, want 1", got)
	}
	if slowest > callTimeout+time.Second {
		t.Errorf("slowest request took %v, want about the call timeout %v", slowest, callTimeout)
	}
	// Back in service once it checks out: its slot returns to the pool.
	insts[0].hang.Store(false)
	insts[0].checking.Store(false)
	deadline := time.Now().Add(5 * time.Second)
	for insts[0].calls.Load() == 1 && time.Now().Before(deadline) {
		if _, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 2, 3, 4})); err != nil {
			t.Fatal(err)
		}
	}
	if insts[0].calls.Load() == 1 {
		t.Error("the instance did not come back into rotation")
	}
}

// A request's own deadline bounds a call on a hung instance even when the
// call timeout is long.
func TestDeadlineBoundsHungCall(t *testing.T) {
	r, insts, _ := newFaultyRegistry(t, time.Minute)
	insts[0].hang.Store(true)
	insts[1].hang.Store(true)
	req := sumRequest([4]float32{1, 2, 3, 4})
	req.Deadline = time.Now().Add(100 * time.Millisecond)
	start := time.Now()
	_, _, err := r.Infer(t.Context(), "sum", "", req)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v, want the deadline exceeded", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("the request returned after %v, want about its 100ms deadline", took)
	}
}

// A runner killed for memory is not retried: the request would likely do
// the same to the other instance.
func TestOutOfMemoryNotRetried(t *testing.T) {
	r, insts, _ := newFaultyRegistry(t, time.Minute)
	insts[0].oom.Store(true)
	insts[1].oom.Store(true)
	_, _, err := r.Infer(t.Context(), "sum", "", sumRequest([4]float32{1, 2, 3, 4}))
	if !errors.Is(err, runtime.ErrOutOfMemory) || !errors.Is(err, runtime.ErrUnavailable) {
		t.Errorf("err = %v, want ErrOutOfMemory (an ErrUnavailable)", err)
	}
	if got := insts[0].calls.Load() + insts[1].calls.Load(); got != 1 {
		t.Errorf("%d calls for one request, want 1", got)
	}
}
