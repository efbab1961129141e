package simgpu

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// flat is a model with no launch cost, saturation 0.5 at every batch size
// and no bandwidth, so expected times are easy to write down.
var flat = Model{Name: "flat", Fixed: 10 * time.Millisecond, PerItem: 0, Saturation: 0.5, Weights: 100 * mib, ActivationPerItem: 10 * mib}

func newSim(t *testing.T, spec Spec) *Sim {
	t.Helper()
	s, err := New(spec)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func start(t *testing.T, d *Device, spec ClientSpec) *Client {
	t.Helper()
	c, err := d.StartClient(t.Context(), spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

func near(got, want time.Duration) bool {
	diff := got - want
	return diff < time.Microsecond && diff > -time.Microsecond
}

// execute runs one warm execution (a warm-up first when needed).
func execute(t *testing.T, c *Client, b int) time.Duration {
	t.Helper()
	took, err := c.Execute(t.Context(), b)
	if err != nil {
		t.Fatal(err)
	}
	return took
}

func TestCurveAlone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := Presets["resnet50"]
		d := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30}).Devices()[0]
		var prev time.Duration
		for _, pct := range []int{10, 20, 40, 60, 100} {
			c := start(t, d, ClientSpec{Name: "r", Percentage: pct, Model: m})
			execute(t, c, 4) // warm-up
			got := execute(t, c, 4)
			if want := m.Time(4, float64(pct)/100); !near(got, want) {
				t.Errorf("%d%%: %v, want the curve's %v", pct, got, want)
			}
			// Faster with more SMs up to saturation (0.3*sqrt(4) = 0.6),
			// flat beyond.
			switch {
			case pct <= 60 && prev != 0 && got >= prev:
				t.Errorf("%d%%: %v is not faster than %v below saturation", pct, got, prev)
			case pct > 60 && got != prev:
				t.Errorf("%d%%: %v, want %v (saturated)", pct, got, prev)
			}
			prev = got
			c.Close()
		}
		// A larger batch saturates later: at 30% it is slowed, a batch of
		// 1 is not.
		if m.Time(1, 0.3) != m.Time(1, 1) || m.Time(8, 0.3) <= m.Time(8, 1) {
			t.Errorf("saturation: t(1,.3)=%v t(1,1)=%v t(8,.3)=%v t(8,1)=%v", m.Time(1, 0.3), m.Time(1, 1), m.Time(8, 0.3), m.Time(8, 1))
		}
	})
}

// concurrent starts one execution per client at the same instant and
// returns how long each took.
func concurrent(t *testing.T, b int, clients ...*Client) []time.Duration {
	t.Helper()
	out := make([]time.Duration, len(clients))
	var wg sync.WaitGroup
	for i, c := range clients {
		wg.Go(func() {
			took, err := c.Execute(t.Context(), b)
			if err != nil {
				t.Error(err)
			}
			out[i] = took
		})
	}
	wg.Wait()
	return out
}

func TestOversubscription(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30}).Devices()[0]
		m := flat
		m.Saturation = 0.8
		a := start(t, d, ClientSpec{Name: "a", Percentage: 40, Model: m})
		b := start(t, d, ClientSpec{Name: "b", Percentage: 40, Model: m})
		execute(t, a, 1)
		execute(t, b, 1)
		alone := execute(t, a, 1)
		if want := m.Time(1, 0.4); !near(alone, want) {
			t.Fatalf("alone at 40%%: %v, want %v", alone, want)
		}
		// 40+40 fits: concurrent clients run as fast as alone.
		for _, took := range concurrent(t, 1, a, b) {
			if !near(took, alone) {
				t.Errorf("40%%+40%%: %v, want %v (no oversubscription)", took, alone)
			}
		}
		// Unlimited clients (shared) each want 80%: 160% of the device,
		// so each runs at 1/1.6 of its speed alone.
		u1 := start(t, d, ClientSpec{Name: "u1", Model: m})
		u2 := start(t, d, ClientSpec{Name: "u2", Model: m})
		execute(t, u1, 1)
		execute(t, u2, 1)
		full := execute(t, u1, 1)
		for _, took := range concurrent(t, 1, u1, u2) {
			if want := time.Duration(float64(full) * 1.6); !near(took, want) {
				t.Errorf("unlimited pair: %v, want %v", took, want)
			}
		}
	})
}

func TestInterference(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30}).Devices()[0]
		m := flat
		m.Saturation = 0.25
		m.Bandwidth = 0.4
		a := start(t, d, ClientSpec{Name: "a", Percentage: 50, Model: m})
		b := start(t, d, ClientSpec{Name: "b", Percentage: 50, Model: m})
		execute(t, a, 1)
		execute(t, b, 1)
		alone := execute(t, a, 1)
		// SMs fit (25%+25%), but each slows by 1 + 0.5*0.4.
		for _, took := range concurrent(t, 1, a, b) {
			if want := time.Duration(float64(alone) * (1 + Interference*0.4)); !near(took, want) {
				t.Errorf("co-running: %v, want %v", took, want)
			}
		}
		// An execution that starts when another is half done: the
		// overlap is slowed, the rest is not.
		var second time.Duration
		var wg sync.WaitGroup
		wg.Go(func() { execute(t, a, 1) })
		time.Sleep(alone / 2)
		wg.Go(func() { second = execute(t, b, 1) })
		wg.Wait()
		if second <= alone || second >= time.Duration(float64(alone)*1.2) {
			t.Errorf("partly overlapped: %v, want between %v and %v", second, alone, time.Duration(float64(alone)*1.2))
		}
	})
}

// A kernel's memory traffic follows the SMs it runs on: a co-runner on a
// fifth of the SMs its batch could use slows its neighbour a fifth as much
// as one at its saturation.
func TestInterferenceFollowsSMs(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30}).Devices()[0]
		m := flat
		m.Saturation = 0.5
		m.Bandwidth = 0.4
		a := start(t, d, ClientSpec{Name: "a", Percentage: 50, Model: m})
		wide := start(t, d, ClientSpec{Name: "wide", Percentage: 50, Model: m})
		narrow := start(t, d, ClientSpec{Name: "narrow", Percentage: 10, Model: m})
		execute(t, a, 1)
		execute(t, wide, 1)
		execute(t, narrow, 1)
		alone := execute(t, a, 1)
		// Beside a co-runner at its saturation (50% of 0.5): 1 + 0.5*0.4.
		if took := concurrent(t, 1, a, wide)[0]; !near(took, time.Duration(float64(alone)*(1+Interference*0.4))) {
			t.Errorf("beside a co-runner at saturation: %v, want %v", took, time.Duration(float64(alone)*(1+Interference*0.4)))
		}
		// Beside one at 10% of the SMs (a fifth of its 0.5, so it runs
		// five times longer and overlaps all of a's execution):
		// 1 + 0.5*0.4/5.
		want := time.Duration(float64(alone) * (1 + Interference*0.4*0.2))
		if took := concurrent(t, 1, a, narrow)[0]; !near(took, want) {
			t.Errorf("beside a co-runner on a fifth of its SMs: %v, want %v", took, want)
		}
	})
}

func TestContextAndWarmupCosts(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := newSim(t, Spec{Devices: 1, SMs: 80, Memory: 16 << 30}).Devices()[0]
		m := Presets["bert-base"]
		t0 := time.Now()
		c := start(t, d, ClientSpec{Name: "bert", Percentage: 50, Model: m})
		load := time.Duration(float64(m.Weights) / LoadBandwidth * float64(time.Second))
		if got := time.Since(t0); !near(got, ContextCreate+load) {
			t.Errorf("client start took %v, want context %v + load %v", got, ContextCreate, load)
		}
		if got, want := c.Memory(), int64(ContextMemory)+m.Weights; got != want {
			t.Errorf("memory after start %d, want context + weights %d", got, want)
		}
		cold := execute(t, c, 8)
		warm := execute(t, c, 8)
		if !near(cold-warm, m.Warmup) {
			t.Errorf("first execution %v, second %v: want the warm-up %v between", cold, warm, m.Warmup)
		}
		if other := execute(t, c, 2); other < m.Warmup {
			t.Errorf("first execution at a new batch size %v, want a warm-up again", other)
		}
		if got, want := c.Memory(), int64(ContextMemory)+m.Weights+m.Arena(8); got != want {
			t.Errorf("memory after batch 8 then 2: %d, want the arena's high-water mark (%d)", got, want)
		}
	})
}

func TestFaultTakesDownTheDevice(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sim := newSim(t, Spec{Devices: 2, SMs: 80, Memory: 16 << 30})
		d, other := sim.Devices()[0], sim.Devices()[1]
		lc := start(t, d, ClientSpec{Name: "lc", Percentage: 50, Model: flat})
		be := start(t, d, ClientSpec{Name: "be", Percentage: 50, Model: flat})
		safe := start(t, other, ClientSpec{Name: "safe", Percentage: 50, Model: flat})
		execute(t, lc, 1)

		errc := make(chan error, 1)
		go func() {
			_, err := lc.Execute(t.Context(), 1)
			errc <- err
		}()
		time.Sleep(time.Millisecond)
		be.Fault("an illegal memory access")
		if err := <-errc; !errors.Is(err, ErrDeviceFault) {
			t.Errorf("in-flight execution of another client: %v, want ErrDeviceFault", err)
		}
		for _, c := range []*Client{lc, be} {
			if _, err := c.Execute(t.Context(), 1); !errors.Is(err, ErrDeviceFault) {
				t.Errorf("client %s after the fault: %v, want ErrDeviceFault", c.Spec().Name, err)
			}
			// Each client's end is seen, as a process's exit, with the
			// client that raised the fault.
			select {
			case <-c.Done():
			default:
				t.Errorf("client %s: Done not closed after the fault", c.Spec().Name)
			}
			var fe *FaultError
			if !errors.As(c.Err(), &fe) || fe.Client != "be" || fe.Device != 0 {
				t.Errorf("client %s: %v, want a FaultError raised by be on device 0", c.Spec().Name, c.Err())
			}
		}
		select {
		case <-safe.Done():
			t.Error("a client on the other device is gone")
		default:
		}
		if n, used := d.Clients(), d.MemoryUsed(); n != 0 || used != 0 {
			t.Errorf("after the fault: %d clients, %d bytes used; want none", n, used)
		}
		if _, err := d.StartClient(t.Context(), ClientSpec{Name: "new", Model: flat}); !errors.Is(err, ErrDaemonDown) {
			t.Errorf("new client before the daemon restarts: %v, want ErrDaemonDown", err)
		}
		if _, err := safe.Execute(t.Context(), 1); err != nil {
			t.Errorf("a client on the other device: %v", err)
		}
		t0 := time.Now()
		d.RestartDaemon()
		if took := time.Since(t0); took != DaemonRestart {
			t.Errorf("restart took %v, want %v", took, DaemonRestart)
		}
		again := start(t, d, ClientSpec{Name: "lc2", Percentage: 50, Model: flat})
		execute(t, again, 1)
	})
}

func TestHungClientHoldsItsSMs(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30}).Devices()[0]
		m := flat
		m.Saturation = 1
		a := start(t, d, ClientSpec{Name: "a", Model: m})
		h := start(t, d, ClientSpec{Name: "hung", Model: m})
		execute(t, a, 1)
		execute(t, h, 1)
		alone := execute(t, a, 1)
		h.Hang()
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		hungErr := make(chan error, 1)
		go func() {
			_, err := h.Execute(ctx, 1)
			hungErr <- err
		}()
		time.Sleep(time.Millisecond)
		// The hung kernel holds the SMs it wants: a halves.
		if got := execute(t, a, 1); !near(got, 2*alone) {
			t.Errorf("beside a hung client: %v, want %v", got, 2*alone)
		}
		if err := <-hungErr; !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("hung execution: %v, want the caller's deadline", err)
		}
		if got := execute(t, a, 1); !near(got, alone) {
			t.Errorf("after the hung execution gave up: %v, want %v", got, alone)
		}
	})
}

func TestOutOfMemory(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := flat // 100 MiB weights, 10 MiB per item
		// Room for one client (300+100+arena) and not for its shadow.
		d := newSim(t, Spec{Devices: 1, SMs: 80, Memory: 700 * mib}).Devices()[0]
		c := start(t, d, ClientSpec{Name: "serving", Percentage: 50, PinnedMemory: 450 * mib, Model: m})
		execute(t, c, 4)
		if _, err := c.Execute(t.Context(), 8); !errors.Is(err, ErrOutOfMemory) {
			t.Errorf("batch 8 beyond the pinned limit: %v, want ErrOutOfMemory", err)
		}
		execute(t, c, 4) // the client lives on
		before := d.MemoryUsed()
		_, err := d.StartClient(t.Context(), ClientSpec{Name: "shadow", Percentage: 60, Model: m})
		if !errors.Is(err, ErrOutOfMemory) {
			t.Fatalf("shadow beside the serving client: %v, want ErrOutOfMemory", err)
		}
		if after := d.MemoryUsed(); after != before {
			t.Errorf("a failed start left %d bytes behind", after-before)
		}
		c.Close()
		shadow := start(t, d, ClientSpec{Name: "shadow", Percentage: 60, Model: m})
		execute(t, shadow, 8)
		if err := d.InjectMemory(d.MemoryTotal()); !errors.Is(err, ErrOutOfMemory) {
			t.Errorf("injecting more than is free: %v", err)
		}
	})
}

func TestNoDaemonIgnoresPercentages(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30, NoDaemon: true}).Devices()[0]
		m := flat
		m.Saturation = 0.3
		a := start(t, d, ClientSpec{Name: "a", Percentage: 10, Model: m})
		b := start(t, d, ClientSpec{Name: "b", Percentage: 10, Model: m})
		execute(t, a, 1)
		execute(t, b, 1)
		if got, want := execute(t, a, 1), m.Time(1, 1); !near(got, want) {
			t.Errorf("10%% without a daemon: %v, want the unlimited %v", got, want)
		}
		for _, took := range concurrent(t, 1, a, b) {
			if want := 2 * m.Time(1, 1); !near(took, want) {
				t.Errorf("time-sliced pair: %v, want %v", took, want)
			}
		}
	})
}

func TestUtilizationAndProcessMemory(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30}).Devices()[0]
		m := flat
		m.Bandwidth = 0.5
		c := start(t, d, ClientSpec{Name: "a", Percentage: 50, Model: m})
		execute(t, c, 1)
		d.Utilization() // reset the window
		execute(t, c, 1)
		time.Sleep(m.Time(1, 0.5)) // as long idle as busy
		gpu, mem := d.Utilization()
		if gpu < 0.49 || gpu > 0.51 || mem < 0.24 || mem > 0.26 {
			t.Errorf("utilisation %.3f gpu, %.3f memory; want 0.5 and 0.25", gpu, mem)
		}
		pm := d.ProcessMemory()
		if pm[c.PID()] != c.Memory() || len(pm) != 1 {
			t.Errorf("process memory %v, want {%d: %d}", pm, c.PID(), c.Memory())
		}
	})
}

func TestBadSpecs(t *testing.T) {
	for _, s := range []Spec{{}, {Devices: 1, SMs: 0, Memory: 1 << 30}, {Devices: 1, SMs: 80, Memory: 1 << 20}} {
		if _, err := New(s); err == nil {
			t.Errorf("New(%+v) accepted", s)
		}
	}
	for name, m := range Presets {
		if err := m.Check(); err != nil {
			t.Errorf("preset %s: %v", name, err)
		}
	}
}
