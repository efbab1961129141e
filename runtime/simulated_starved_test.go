package runtime

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/simgpu"
)

// A below-normal client that normal clients leave no SM for longer than
// the probe timeout is starved, not hung: the call abandoned at its
// deadline makes the instance probe its client, the probe gets no SM and
// no answer, and the client is kept (same pid, no restart). A request that
// comes meanwhile waits in the pool, out of service but not failed, and is
// answered once the normal clients stop; no call is answered
// ErrUnavailable. A hung client beside the same load is still replaced
// (TestSimulatedHungClientIsReplaced; here its last step).
func TestSimulatedStarvedClientIsNotHung(t *testing.T) {
	path := testModel(t, "example_dynamic_axes.onnx")
	synctest.Test(t, func(t *testing.T) {
		sim, err := simgpu.New(simgpu.Spec{Devices: 1, SMs: 100, Memory: 16 << 30})
		if err != nil {
			t.Fatal(err)
		}
		dev := sim.Devices()[0]
		var mu sync.Mutex
		var restarts []string
		be, err := StartSimulated(t.Context(), SimulatedConfig{
			Name: "batch", ModelPath: path, Device: dev, Model: simgpu.Presets["mobilenet"], Batched: true,
			Env: []string{"CUDA_MPS_CLIENT_PRIORITY=1"},
			OnRestart: func(r string) {
				mu.Lock()
				defer mu.Unlock()
				restarts = append(restarts, r)
			},
			Logger: testLogger(t),
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { be.Stop(context.Background()) })
		pool, err := NewPool([]Member{be}, PoolOptions{CallTimeout: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		in := be.Inputs()[0]
		req := func(deadline time.Duration) *InferRequest {
			return &InferRequest{
				Inputs:   []Tensor{{Name: in.Name, DataType: in.DataType, Shape: []int64{1, 10}, Data: make([]byte, 10*in.DataType.Size())}},
				Deadline: time.Now().Add(deadline),
			}
		}
		if _, err := pool.Execute(t.Context(), req(time.Minute)); err != nil {
			t.Fatal(err) // warm
		}
		alone := time.Now()
		if _, err := pool.Execute(t.Context(), req(time.Minute)); err != nil {
			t.Fatal(err)
		}
		took := time.Since(alone)

		// Two normal clients, each wanting the whole device, run back to
		// back and half an execution apart: one always holds every SM.
		hog := simgpu.Model{Name: "hog", Fixed: 50 * time.Millisecond, Saturation: 1, Weights: 100 << 20, ActivationPerItem: 1 << 20}
		starve := 3 * DefaultProbeTimeout
		var stop atomic.Bool
		var hogs sync.WaitGroup
		hogSMs(t, dev, hog, &stop, &hogs)
		t.Cleanup(func() { stop.Store(true); hogs.Wait() })
		began := time.Now()
		time.AfterFunc(starve, func() { stop.Store(true) })

		// A call abandoned at its deadline after more than a second: the
		// pool suspects the instance, which probes its starved client.
		if _, err := pool.Execute(t.Context(), req(2*time.Second)); err == nil {
			t.Fatal("a call on the starved client was answered before its deadline")
		}
		time.Sleep(time.Second)
		if !be.Checking() {
			ready, why := be.Status()
			t.Fatalf("after an abandoned call: not being checked (ready %v, %q)", ready, why)
		}
		pid := be.Pid()
		// Meanwhile a request waits for the check, and is answered once
		// the normal work leaves SMs.
		start := time.Now()
		if _, err := pool.Execute(t.Context(), req(time.Minute)); err != nil {
			t.Fatalf("a request while the client was starved: %v", err)
		}
		waited := time.Since(start)
		hogs.Wait()
		if answeredAt := start.Add(waited).Sub(began); answeredAt < starve {
			t.Errorf("answered %v after the normal work began, before it stopped (%v): it was not starved", answeredAt, starve)
		}
		if answeredAt := start.Add(waited).Sub(began); answeredAt > starve+DefaultProbeTimeout+10*took {
			t.Errorf("answered %v after the normal work began: more than a probe (%v) after it stopped (%v)", answeredAt, DefaultProbeTimeout, starve)
		}
		mu.Lock()
		got := restarts
		mu.Unlock()
		if len(got) != 0 || be.Pid() != pid {
			t.Errorf("a starved client was restarted: %v, pid %d (was %d)", got, be.Pid(), pid)
		}
		if n := be.Failed(); n != 0 {
			t.Errorf("%d calls answered ErrUnavailable", n)
		}
		synctest.Wait()
		if ready, why := be.Status(); !ready {
			t.Errorf("after the starvation: not ready (%q)", why)
		}
		for range 3 {
			if _, err := pool.Execute(t.Context(), req(time.Minute)); err != nil {
				t.Errorf("after the starvation: %v", err)
			}
		}

		// A hung client holds its SMs and finishes nothing: replaced.
		be.Client().Hang()
		if _, err := pool.Execute(t.Context(), req(2*time.Second)); err == nil {
			t.Fatal("a call on the hung client was answered")
		}
		time.Sleep(DefaultProbeTimeout + simgpu.ContextCreate + time.Second)
		mu.Lock()
		got = restarts
		mu.Unlock()
		if len(got) != 1 || be.Pid() == pid {
			t.Errorf("a hung client: restarts %v, pid %d (was %d)", got, be.Pid(), pid)
		}
	})
}

// A call on a below-normal client starved of SMs at the call timeout is
// not abandoned while the client stays starved: it is answered once the
// normal work stops, though that is several call timeouts later.
func TestSimulatedStarvedCallIsNotAbandoned(t *testing.T) {
	path := testModel(t, "example_dynamic_axes.onnx")
	synctest.Test(t, func(t *testing.T) {
		sim, err := simgpu.New(simgpu.Spec{Devices: 1, SMs: 100, Memory: 16 << 30})
		if err != nil {
			t.Fatal(err)
		}
		dev := sim.Devices()[0]
		be, err := StartSimulated(t.Context(), SimulatedConfig{
			Name: "batch", ModelPath: path, Device: dev, Model: simgpu.Presets["mobilenet"], Batched: true,
			Env:    []string{"CUDA_MPS_CLIENT_PRIORITY=1"},
			Logger: testLogger(t),
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { be.Stop(context.Background()) })
		const callTimeout = time.Second
		pool, err := NewPool([]Member{be}, PoolOptions{CallTimeout: callTimeout})
		if err != nil {
			t.Fatal(err)
		}
		in := be.Inputs()[0]
		req := &InferRequest{Inputs: []Tensor{{Name: in.Name, DataType: in.DataType, Shape: []int64{1, 10}, Data: make([]byte, 10*in.DataType.Size())}}}
		if _, err := pool.Execute(t.Context(), req); err != nil {
			t.Fatal(err) // warm
		}
		hog := simgpu.Model{Name: "hog", Fixed: 50 * time.Millisecond, Saturation: 1, Weights: 100 << 20, ActivationPerItem: 1 << 20}
		const starve = 5 * callTimeout
		var stop atomic.Bool
		var hogs sync.WaitGroup
		t.Cleanup(func() { stop.Store(true); hogs.Wait() })
		hogSMs(t, dev, hog, &stop, &hogs)
		time.AfterFunc(starve, func() { stop.Store(true) })
		start := time.Now()
		_, err = pool.Execute(t.Context(), req)
		took := time.Since(start)
		if err != nil {
			t.Fatalf("a call on the starved client, after %v: %v", took, err)
		}
		if took < starve {
			t.Errorf("answered after %v, before the normal work stopped (%v): it was not starved", took, starve)
		}
		if n := be.Failed(); n != 0 {
			t.Errorf("%d calls answered ErrUnavailable", n)
		}
	})
}

// hogSMs starts two normal-priority clients of hog on dev that run back to
// back, half an execution apart, until stop is set: with hog wanting the
// whole device, one of them always holds every SM.
func hogSMs(t *testing.T, dev *simgpu.Device, hog simgpu.Model, stop *atomic.Bool, hogs *sync.WaitGroup) {
	t.Helper()
	for i := range 2 {
		c, err := dev.StartClient(t.Context(), simgpu.ClientSpec{Name: "hog", Model: hog})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Close)
		hogs.Go(func() {
			time.Sleep(time.Duration(i) * hog.Fixed / 2)
			for !stop.Load() {
				if _, err := c.Execute(t.Context(), 1); err != nil {
					if !stop.Load() {
						t.Error(err)
					}
					return
				}
			}
		})
	}
}
