package device

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/limiter"
)

// fakeDomain is a device that a test faults and a fake daemon brings back.
type fakeDomain struct {
	i  int
	mu sync.Mutex
	f  *DeviceFault
}

func (d *fakeDomain) Index() int { return d.i }

func (d *fakeDomain) Fault() (DeviceFault, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.f == nil {
		return DeviceFault{}, false
	}
	return *d.f, true
}

func (d *fakeDomain) RestartDaemon(ctx context.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.f = nil
	return nil
}

// fakeInstance is an instance the fault took down; Recover records the
// order of restarts.
type fakeInstance struct {
	name  string
	dev   int
	gone  bool
	order *[]string
	mu    *sync.Mutex
}

func (f *fakeInstance) Name() string  { return f.name }
func (f *fakeInstance) Device() int   { return f.dev }
func (f *fakeInstance) Gone() bool    { return f.gone }
func (f *fakeInstance) Failed() int64 { return 0 }

func (f *fakeInstance) Recover(ctx context.Context, device int, reason string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	*f.order = append(*f.order, f.name)
	f.gone, f.dev = false, device
	return nil
}

// The recovery needs no simulator: a device that says it faulted, a
// daemon handle (limiter.DaemonRestarter) and instances that can recover
// are enough. It restarts the daemon, then the instances the fault took
// down, latency-critical first and then by priority, and records the fault
// (naming its culprit) and each recovery.
func TestRecoveryOfAnyFaultDomain(t *testing.T) {
	dev := &fakeDomain{i: 0}
	restarts := 0
	daemon := func(i int) limiter.DaemonRestarter {
		restarts++
		return dev
	}
	rec := NewRecovery(t.Context(), []FaultDomain{dev}, daemon, false, slog.New(slog.DiscardHandler))
	var (
		mu    sync.Mutex
		order []string
	)
	mk := func(name string) *fakeInstance {
		return &fakeInstance{name: name, dev: 0, gone: true, order: &order, mu: &mu}
	}
	be, lc2, lc1 := mk("be/1#0"), mk("lc2/1#0"), mk("lc1/1#0")
	rec.Track(be, &configs.Model{Name: "be", SLO: configs.SLO{Class: configs.ClassBestEffort}})
	rec.Track(lc2, &configs.Model{Name: "lc2", SLO: configs.SLO{Class: configs.ClassLatencyCritical, Priority: 2}})
	rec.Track(lc1, &configs.Model{Name: "lc1", SLO: configs.SLO{Class: configs.ClassLatencyCritical, Priority: 1}})
	at := time.Now().Add(-time.Second)
	dev.f = &DeviceFault{Err: errors.New("an illegal memory access"), At: at, Client: "be/1#0"}

	rec.Exited(0)
	rec.Exited(7) // no such device: ignored
	rec.Stop()

	if want := []string{"lc1/1#0", "lc2/1#0", "be/1#0"}; !slices.Equal(order, want) {
		t.Errorf("restarted %v, want %v (latency-critical first, then by priority)", order, want)
	}
	if restarts != 1 {
		t.Errorf("%d daemon restarts, want 1", restarts)
	}
	if _, down := dev.Fault(); down {
		t.Error("the device is still down")
	}
	recs := rec.Recoveries()
	if len(recs) != 1 || recs[0].Culprit != "be" || !recs[0].At.Equal(at) || len(recs[0].Models) != 3 {
		t.Fatalf("recoveries %+v, want one of 3 models with culprit be at the fault's time", recs)
	}
	var kinds []string
	for _, e := range rec.Events(time.Time{}, 0) {
		kinds = append(kinds, e.Kind)
	}
	want := []string{control.EventFault, control.EventRecovered, control.EventRecovered, control.EventRecovered}
	if !slices.Equal(kinds, want) {
		t.Errorf("events %v, want %v", kinds, want)
	}
}

// A device without a daemon handle is not recovered: the recovery says so
// as an event instead of restarting its instances on a dead daemon.
func TestRecoveryWithoutDaemonHandle(t *testing.T) {
	dev := &fakeDomain{i: 0, f: &DeviceFault{Err: errors.New("an uncorrectable ECC error")}}
	rec := NewRecovery(t.Context(), []FaultDomain{dev}, func(int) limiter.DaemonRestarter { return nil }, false, slog.New(slog.DiscardHandler))
	var (
		mu    sync.Mutex
		order []string
	)
	rec.Track(&fakeInstance{name: "lc/1#0", gone: true, order: &order, mu: &mu}, &configs.Model{Name: "lc", SLO: configs.SLO{Class: configs.ClassLatencyCritical}})
	rec.Exited(0)
	rec.Stop()
	if len(order) != 0 {
		t.Errorf("instances restarted without a daemon: %v", order)
	}
	evs := rec.Events(time.Time{}, 0)
	if len(evs) != 2 || evs[1].Kind != control.EventError {
		t.Errorf("events %+v, want the fault and an error", evs)
	}
}
