package server

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/runtime"
	"github.com/sloserve/sloserve/simgpu"
)

// Models of the recovery tests: a latency-critical model and a
// best-effort one that batches.
const (
	recoveryLC = `execution: {provider: cuda, device_id: 0, simulated: {preset: resnet50, fixed: 4ms}}
slo: {latency_ms: 50, class: latency-critical}
`
	recoveryBE = `max_batch_size: 8
execution: {provider: cuda, device_id: 0, simulated: {preset: bert-base}}
`
)

// recoveryServer starts a simulated server with the recovery tests'
// models under the static policy, without profiling.
func recoveryServer(t *testing.T, devices int, set func(*configs.Server), modelConfigs map[string]string) (*models.Registry, *house) {
	t.Helper()
	cfg := configs.DefaultServer()
	cfg.GPU.Simulator.Devices = devices
	cfg.Control.Policy = control.SharePolicyStatic
	cfg.Control.Period = time.Second
	cfg.Control.Profile.Enabled = false
	if set != nil {
		set(cfg)
	}
	return simulatedServer(t, cfg, modelConfigs)
}

// simInstanceOf finds the live simulated instance of a model, waiting
// (up to 10 simulated seconds) for a swap in progress to end.
func simInstanceOf(t *testing.T, devs *house, model string) *runtime.Simulated {
	t.Helper()
	var found []*runtime.Simulated
	for range 100 {
		found = found[:0]
		for _, inst := range devs.rec.Instances(model) {
			found = append(found, inst.(simulatedInstance).s)
		}
		if len(found) == 1 {
			return found[0]
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("model %s has %d instances", model, len(found))
	return nil
}

// traffic sends requests to the recovery tests' models until stopped: the
// latency-critical model one every 10ms, the best-effort one from two
// closed loops.
type traffic struct {
	stop context.CancelFunc
	wg   sync.WaitGroup

	lcOK, lcUnavailable, lcOther atomic.Int64
	beOK, beFailed               atomic.Int64
	slowestFailure               atomic.Int64 // ns
	otherErr                     atomic.Pointer[error]
}

func startTraffic(t *testing.T, reg *models.Registry, withBE bool) *traffic {
	ctx, stop := context.WithCancel(context.Background())
	tr := &traffic{stop: stop}
	one := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{1, 16}, Data: make([]byte, 64)}}}
	tr.wg.Go(func() {
		for ctx.Err() == nil {
			rctx, cancel := context.WithTimeout(ctx, time.Second)
			t0 := time.Now()
			_, _, err := reg.Infer(rctx, "lc", "", one)
			cancel()
			switch {
			case err == nil:
				tr.lcOK.Add(1)
			case ctx.Err() != nil:
			case errors.Is(err, runtime.ErrUnavailable):
				tr.lcUnavailable.Add(1)
				if d := int64(time.Since(t0)); d > tr.slowestFailure.Load() {
					tr.slowestFailure.Store(d)
				}
			default:
				tr.lcOther.Add(1)
				tr.otherErr.CompareAndSwap(nil, &err)
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
	if withBE {
		batch := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.FP32, Shape: []int64{8, 16}, Data: make([]byte, 8*64)}}}
		for range 2 {
			tr.wg.Go(func() {
				for ctx.Err() == nil {
					if _, _, err := reg.Infer(ctx, "be", "", batch); err == nil {
						tr.beOK.Add(1)
					} else if ctx.Err() == nil {
						tr.beFailed.Add(1)
						time.Sleep(10 * time.Millisecond)
					}
				}
			})
		}
	}
	t.Cleanup(tr.finish)
	return tr
}

func (tr *traffic) finish() {
	tr.stop()
	tr.wg.Wait()
}

func eventsOf(devs *house, kind string) []control.Event {
	var out []control.Event
	for _, e := range devs.rec.Events(time.Time{}, 0) {
		if e.Kind == kind {
			out = append(out, e)
		}
	}
	return out
}

// A fault raised by the best-effort model's client takes the whole device
// down (MPS); the server restarts the device's daemon and then its
// instances, the latency-critical model first. Its requests fail with
// ErrUnavailable at once while it is down, only until it is ready again,
// and the recovery's event counts them. Before, the device stayed down.
func TestSimulatedDeviceFaultRecovers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		reg, devs := recoveryServer(t, 1, nil, map[string]string{"lc": recoveryLC, "be": recoveryBE})
		dev := devs.sim.Devices()[0]
		tr := startTraffic(t, reg, true)
		time.Sleep(3 * time.Second)
		okBefore := tr.lcOK.Load()
		lcPid := simInstanceOf(t, devs, "lc").Pid()
		// The daemon restarts through the MPS limiter's handle.
		var handles []limiter.DaemonRestarter
		daemon := devs.rec.DaemonOf
		devs.rec.DaemonOf = func(i int) limiter.DaemonRestarter {
			h := daemon(i)
			handles = append(handles, h)
			return h
		}
		simInstanceOf(t, devs, "be").Client().Fault("an illegal memory access")
		time.Sleep(5 * time.Second)
		tr.finish()
		if len(handles) != 1 {
			t.Fatalf("%d daemon restarts, want 1", len(handles))
		}
		if _, sim := handles[0].(simDaemon); sim {
			t.Error("the daemon restarted through the simulator, not the MPS limiter")
		}

		if err := dev.Faulted(); err != nil {
			t.Fatalf("device still down 5s after the fault: %v", err)
		}
		for _, m := range []string{"lc", "be"} {
			if ready, _ := reg.ModelReady(m, ""); !ready {
				t.Errorf("model %s not ready after the recovery", m)
			}
		}
		if simInstanceOf(t, devs, "lc").Pid() == lcPid {
			t.Error("the latency-critical model kept its client: the fault did not take the device down")
		}
		recs := devs.rec.Recoveries()
		if len(recs) != 1 {
			t.Fatalf("recoveries %+v, want one", recs)
		}
		rec := recs[0]
		if rec.Culprit != "be" || len(rec.Models) != 2 || rec.Models[0].Model != "lc" || rec.Models[1].Model != "be" {
			t.Fatalf("recovery %+v: want culprit be, lc restarted before be", rec)
		}
		lc, be := rec.Models[0], rec.Models[1]
		t.Logf("daemon back after %v; lc ready after %v (%d failed), be after %v (%d failed)", rec.Daemon, lc.Ready, lc.Failed, be.Ready, be.Failed)
		if lc.Err != nil || be.Err != nil || lc.Ready <= rec.Daemon || be.Ready <= lc.Ready {
			t.Errorf("daemon back after %v, lc ready after %v (%v), be after %v (%v): want lc ready first", rec.Daemon, lc.Ready, lc.Err, be.Ready, be.Err)
		}
		// Bounded: the LC requests failed while LC was down, no longer
		// (one every ~10ms), and counted: the client saw what the event
		// says.
		failed := tr.lcUnavailable.Load()
		if bound := int64(lc.Ready/(10*time.Millisecond)) + 2; failed == 0 || failed > bound {
			t.Errorf("%d LC requests failed, want 1..%d (LC down for %v)", failed, bound, lc.Ready)
		}
		if lc.Failed != failed {
			t.Errorf("the recovery counted %d failed LC requests, the client saw %d", lc.Failed, failed)
		}
		// Simulated time (synctest): 10ms is the fake clock's, the same on
		// any machine however busy.
		if d := time.Duration(tr.slowestFailure.Load()); d > 10*time.Millisecond {
			t.Errorf("a failed LC request took %v: it should fail at once, not hang", d)
		}
		if n := tr.lcOther.Load(); n != 0 {
			t.Errorf("%d LC requests failed otherwise than unavailable, the first: %v", n, *tr.otherErr.Load())
		}
		if tr.lcOK.Load() <= okBefore {
			t.Error("LC served nothing after the recovery")
		}
		// The events reach the control API's list beside the adjuster's.
		kinds := map[string][]string{}
		for _, e := range (&backend{Registry: reg, ctl: devs.cfg.Control, devs: devs.devs, loops: devs.loops, pred: devs.pred, rec: devs.rec, place: devs.place}).ControlEvents(time.Time{}, 1000) {
			kinds[e.Kind] = append(kinds[e.Kind], e.Model)
		}
		if f, r := kinds[control.EventFault], kinds[control.EventRecovered]; len(f) != 1 || f[0] != "be/1" || len(r) != 2 || r[0] != "lc/1" || r[1] != "be/1" {
			t.Errorf("control events: faults %v, recoveries %v; want be/1's fault, lc/1 then be/1 recovered", f, r)
		}
		if _, risky := devs.rec.Isolation().Risky("be"); risky {
			t.Error("one fault made be risky")
		}
	})
}

// A hung client (a kernel that never ends) is found by the call timeout
// and the probe Suspect runs, and only its client is replaced: the device
// is not faulted and the other model keeps its client and its requests.
func TestSimulatedHungClientIsReplaced(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		reg, devs := recoveryServer(t, 1, func(c *configs.Server) { c.Runtime.CallTimeout = 2 * time.Second },
			map[string]string{"lc": recoveryLC, "be": recoveryBE})
		dev := devs.sim.Devices()[0]
		tr := startTraffic(t, reg, true)
		time.Sleep(3 * time.Second)
		lcPid := simInstanceOf(t, devs, "lc").Pid()
		be := simInstanceOf(t, devs, "be")
		bePid := be.Pid()
		be.Client().Hang()
		time.Sleep(3 * time.Second)
		okAfterHang := tr.beOK.Load()
		time.Sleep(10 * time.Second) // the call timeout, the probe's, a new client
		tr.finish()

		if err := dev.Faulted(); err != nil {
			t.Fatalf("a hang faulted the device: %v", err)
		}
		if got := simInstanceOf(t, devs, "be"); got.Pid() == bePid {
			t.Fatal("the hung client was not replaced")
		}
		if simInstanceOf(t, devs, "lc").Pid() != lcPid {
			t.Error("the latency-critical model's client was replaced for another's hang")
		}
		if n := tr.lcUnavailable.Load() + tr.lcOther.Load(); n != 0 {
			t.Errorf("%d LC requests failed for the best-effort model's hang", n)
		}
		if tr.beOK.Load() <= okAfterHang {
			t.Error("the best-effort model serves nothing after its client was replaced")
		}
		hung := eventsOf(devs, control.EventHung)
		if len(hung) == 1 {
			t.Logf("hung event: %s", hung[0].Reason)
		}
		if len(hung) != 1 || hung[0].Model != "be/1" || !strings.Contains(hung[0].Reason, "serving again") {
			t.Errorf("hung events %+v, want one for be", hung)
		}
	})
}

// Device memory that runs out: a model whose client does not fit is not
// ready and says why, the others serve; after a fault, a client that no
// longer fits (something took the memory meanwhile) leaves its model not
// ready with the reason while the rest recovers.
func TestSimulatedDeviceMemoryExhaustion(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		big := "execution: {provider: cuda, device_id: 0, simulated: {preset: bert-base, weights: 3GiB}}\n"
		reg, devs := recoveryServer(t, 1, func(c *configs.Server) { c.GPU.Simulator.Memory = 2 << 30 },
			map[string]string{"lc": recoveryLC, "be": recoveryBE, "big": big})
		reason := func(model string) string {
			for _, e := range reg.Index(false) {
				if e.Name == model {
					return e.Reason
				}
			}
			return ""
		}
		if ready, _ := reg.ModelReady("big", ""); ready || !strings.Contains(reason("big"), "out of device memory") {
			t.Errorf("big: ready %v, %q; want not ready for want of device memory", ready, reason("big"))
		}
		for _, m := range []string{"lc", "be"} {
			if ready, _ := reg.ModelReady(m, ""); !ready {
				t.Errorf("%s not ready beside a model that did not fit: %s", m, reason(m))
			}
		}
		dev := devs.sim.Devices()[0]
		be := simInstanceOf(t, devs, "be")
		be.Client().Fault("an uncorrectable ECC error")
		// Another tenant takes what the best-effort model needs.
		if err := dev.InjectMemory(dev.MemoryTotal() - 600<<20); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Second)
		if ready, _ := reg.ModelReady("lc", ""); !ready {
			t.Errorf("lc not ready after the fault: %s", reason("lc"))
		}
		if ready, _ := reg.ModelReady("be", ""); ready || !strings.Contains(reason("be"), "out of device memory") {
			t.Errorf("be: ready %v, %q; want not ready for want of device memory", ready, reason("be"))
		}
		infer(t, reg, "lc")
		recs := devs.rec.Recoveries()
		if len(recs) != 1 || len(recs[0].Models) != 2 || recs[0].Models[1].Err == nil || !errors.Is(recs[0].Models[1].Err, simgpu.ErrOutOfMemory) {
			t.Errorf("recoveries %+v: want be's restart to fail for want of memory", recs)
		}
	})
}

// A best-effort model whose client faults its device twice within the
// window is risky: with a second device it restarts there, apart from the
// latency-critical model, and its next fault no longer takes that model
// down.
func TestSimulatedRiskyBestEffortKeptApart(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		reg, devs := recoveryServer(t, 2, nil, map[string]string{"lc": recoveryLC, "be": recoveryBE})
		d0, d1 := devs.sim.Devices()[0], devs.sim.Devices()[1]
		tr := startTraffic(t, reg, true)
		time.Sleep(2 * time.Second)
		limits := simInstanceOf(t, devs, "be").Client().Spec()
		for i := range 2 {
			simInstanceOf(t, devs, "be").Client().Fault("an illegal memory access")
			time.Sleep(5 * time.Second)
			if i == 0 && simInstanceOf(t, devs, "be").Device() != d0 {
				t.Error("one fault moved be")
			}
		}
		if why, risky := devs.rec.Isolation().Risky("be"); !risky || !strings.Contains(why, "2 times") {
			t.Fatalf("be after two faults: risky %v (%q)", risky, why)
		}
		if got := simInstanceOf(t, devs, "be").Device(); got != d1 {
			t.Fatalf("risky be on device %d, want 1 (apart from lc)", got.Index())
		}
		// It keeps the limits its limiter placed it with on device 0.
		if got := simInstanceOf(t, devs, "be").Client().Spec(); got.Percentage != limits.Percentage || got.PinnedMemory != limits.PinnedMemory {
			t.Errorf("moved be's client: %d%%, pinned %d; was %d%%, pinned %d", got.Percentage, got.PinnedMemory, limits.Percentage, limits.PinnedMemory)
		}
		if got := simInstanceOf(t, devs, "lc").Device(); got != d0 {
			t.Fatalf("lc on device %d, want 0", got.Index())
		}
		lcPid := simInstanceOf(t, devs, "lc").Pid()
		failedBefore := tr.lcUnavailable.Load()
		okBefore := tr.beOK.Load()
		simInstanceOf(t, devs, "be").Client().Fault("an illegal memory access")
		time.Sleep(5 * time.Second)
		tr.finish()
		if simInstanceOf(t, devs, "lc").Pid() != lcPid || tr.lcUnavailable.Load() != failedBefore || d0.Faulted() != nil {
			t.Errorf("the risky model's third fault reached lc: pid %d (was %d), %d LC failures (were %d)",
				simInstanceOf(t, devs, "lc").Pid(), lcPid, tr.lcUnavailable.Load(), failedBefore)
		}
		if ready, _ := reg.ModelReady("be", ""); !ready || tr.beOK.Load() <= okBefore {
			t.Error("be does not serve after its third fault")
		}
		if n := len(eventsOf(devs, control.EventRisky)); n != 1 {
			t.Errorf("%d risky events, want 1", n)
		}
		// The control status says so.
		for _, d := range (&backend{Registry: reg, ctl: devs.cfg.Control, devs: devs.devs, loops: devs.loops, pred: devs.pred, rec: devs.rec, place: devs.place}).Control().Devices {
			for _, m := range d.Models {
				if (m.Risky != "") != (m.Model == "be/1") {
					t.Errorf("control status of %s: risky %q", m.Model, m.Risky)
				}
			}
		}
	})
}

// The device's instances restart latency-critical first, then by
// priority (1 highest, unset last), whatever their names.
func TestSimulatedRecoveryOrder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lc := func(priority string) string {
			return "execution: {provider: cuda, device_id: 0, simulated: {preset: mobilenet}}\nslo: {latency_ms: 50, class: latency-critical" + priority + "}\n"
		}
		_, devs := recoveryServer(t, 1, nil, map[string]string{
			"a-be": "execution: {provider: cuda, device_id: 0, simulated: {preset: mobilenet}}\n",
			"b-lc": lc(""), "c-lc": lc(", priority: 2"), "d-lc": lc(", priority: 1"),
		})
		simInstanceOf(t, devs, "a-be").Client().Fault("an illegal memory access")
		time.Sleep(10 * time.Second)
		recs := devs.rec.Recoveries()
		if len(recs) != 1 {
			t.Fatalf("recoveries %+v", recs)
		}
		var order []string
		for _, m := range recs[0].Models {
			order = append(order, m.Model)
		}
		if strings.Join(order, " ") != "d-lc c-lc b-lc a-be" {
			t.Errorf("restart order %v, want d-lc c-lc b-lc a-be", order)
		}
	})
}

// A second fault while the device recovers from the first (the
// latency-critical client restarting) is recovered from in turn.
func TestSimulatedFaultDuringRecovery(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		reg, devs := recoveryServer(t, 1, nil, map[string]string{"lc": recoveryLC, "be": recoveryBE})
		dev := devs.sim.Devices()[0]
		simInstanceOf(t, devs, "be").Client().Fault("an illegal memory access")
		// The daemon is back after a second; the latency-critical client
		// then takes half a second to start.
		time.Sleep(simgpu.DaemonRestart + simgpu.ContextCreate/2)
		dev.Fault(nil, "an uncorrectable ECC error")
		time.Sleep(15 * time.Second)
		if err := dev.Faulted(); err != nil {
			t.Fatalf("device down after two faults: %v", err)
		}
		for _, m := range []string{"lc", "be"} {
			if ready, _ := reg.ModelReady(m, ""); !ready {
				t.Errorf("%s not ready after the second recovery", m)
			}
		}
		if recs := devs.rec.Recoveries(); len(recs) != 2 {
			t.Errorf("%d recoveries, want 2: %+v", len(recs), recs)
		}
		if n := len(eventsOf(devs, control.EventFault)); n != 2 {
			t.Errorf("%d fault events, want 2", n)
		}
	})
}
