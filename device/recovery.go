package device

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/limiter"
)

// Defaults of a recovery.
const (
	// riskyWindow and riskyFaults: a best-effort model whose client
	// raised riskyFaults faults within riskyWindow is risky.
	riskyWindow = 10 * time.Minute
	riskyFaults = 2
)

// Recovery brings GPUs back after faults, the way MuxFlow
// handles MPS errors: a fatal fault in one MPS client takes every client of
// its device down, so when an instance reports its client gone by a fault
// (its OnExit) the recovery restarts the device's control daemon, through
// the limiter's handle (limiter.DaemonRestarter) or, when no MPS limiter
// runs on the device, the simulator's, and then the device's instances one
// by one, latency-critical models first (then by priority, 1 highest). In
// the meantime the instances answer runtime.ErrUnavailable at once. A
// best-effort model whose client faulted its device riskyFaults times
// within riskyWindow is marked in the Isolation, and its instances restart
// on a device without latency-critical models when there is one. Each
// fault, recovery, hung client and risky model is a control.Event with its
// measured cost; the backend lists them with the adjusters'.
//
// It knows devices and instances by what it needs of them (FaultDomain,
// Recoverable), and restarts daemons through limiter.DaemonRestarter. Only
// the simulator reports faults so today (simgpu.go): a real runner
// restarts its own process, and a real GPU's daemon has no automated
// restart yet.
type Recovery struct {
	devices   []FaultDomain // by index
	log       *slog.Logger
	ctx       context.Context // ends the recoveries under way
	isolation *control.Isolation
	// DaemonOf is the MPS daemon handle of a device: the limiter's when it
	// has one; nil when the device has none. A seam for tests: set it
	// before a fault.
	DaemonOf func(device int) limiter.DaemonRestarter
	// placed: gpu.placement keeps risky models apart (it moves them, and
	// the registry knows where they run); instances start where the
	// registry says.
	placed bool

	wg     sync.WaitGroup // the recoveries under way
	events *control.EventLog

	mu         sync.Mutex
	stopped    bool                        // stop was called: no new recovery
	instances  map[Recoverable]simInstance // live ones
	recovering map[int]bool                // devices being recovered
	again      map[int]bool                // devices whose recovery must make another pass
	faults     map[string][]time.Time      // model -> faults its client raised
	done       []DeviceRecovery
}

// FaultDomain is a device whose clients a fatal fault takes down together
// (a GPU under MPS), as the recovery sees it.
type FaultDomain interface {
	Index() int
	// Fault is the fault that took the device's clients down; down is
	// false while the device serves.
	Fault() (f DeviceFault, down bool)
}

// DeviceFault is a fault that took a device's clients down.
type DeviceFault struct {
	Err    error
	At     time.Time // when it happened; zero: unknown
	Client string    // the instance whose client raised it ("model/version#index"); "" unknown
}

// Recoverable is a live instance on a fault domain. Its value is its
// identity: track, untrack and the callbacks pass the same value.
type Recoverable interface {
	Name() string // "model/version#index"
	Device() int  // the index of the device it runs on
	// Gone reports its client taken down by a fault.
	Gone() bool
	// Failed counts the calls it has failed so far.
	Failed() int64
	// Recover starts it again on a device, once that device serves.
	Recover(ctx context.Context, device int, reason string) error
}

// simInstance is what the recovery knows of a live instance.
type simInstance struct {
	model    string
	key      string // "model/version", as events name it
	lc       bool
	priority int // 1 highest; 0 (the default) after every explicit one
}

// rank orders instances for restarting: latency-critical first, then by
// priority, then by name.
func (a simInstance) rank() (int, int) {
	class := 1
	if a.lc {
		class = 0
	}
	p := a.priority
	if p == 0 {
		p = math.MaxInt
	}
	return class, p
}

// DeviceRecovery is what one device's recovery cost.
type DeviceRecovery struct {
	Device  int
	Fault   error
	At      time.Time     // of the fault
	Daemon  time.Duration // from the fault to the daemon serving again
	Culprit string        // the model whose client raised the fault ("" unknown)
	culprit string        // its version's key, as events name it
	Models  []ModelRecovery
}

// ModelRecovery is one model's part of a device's recovery.
type ModelRecovery struct {
	Model  string
	key    string
	Device int           // where its instances run again
	Ready  time.Duration // from the fault to its first instance serving again
	Failed int64         // calls its instances failed from the fault to then
	Err    error         // why it is not serving again
}

// NewRecovery makes the recovery of devices (by index); ctx ends the
// recoveries under way, and stop waits for them. placed: gpu.placement
// keeps risky models apart (recovery.placed).
func NewRecovery(ctx context.Context, devices []FaultDomain, daemon func(device int) limiter.DaemonRestarter, placed bool, log *slog.Logger) *Recovery {
	return &Recovery{
		devices: devices, log: log, ctx: ctx, isolation: &control.Isolation{}, DaemonOf: daemon, placed: placed, events: control.NewEventLog(control.DefaultEventCapacity),
		instances: map[Recoverable]simInstance{}, recovering: map[int]bool{}, again: map[int]bool{}, faults: map[string][]time.Time{},
	}
}

// stop starts no more recoveries and waits for those under way (cancel
// their ctx first). Safe on a nil recovery.
func (r *Recovery) Stop() {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.stopped = true
	r.mu.Unlock()
	r.wg.Wait()
}

// risky is why a model version ("model/version") is kept apart from
// latency-critical models, "" when it is not. Safe on a nil recovery.
func (r *Recovery) Risky(key string) string {
	if r == nil {
		return ""
	}
	why, _ := r.isolation.Risky(modelOf(key))
	return why
}

// track makes inst known to the recovery until it stops.
func (r *Recovery) Track(inst Recoverable, cfg *configs.Model) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.instances[inst] = simInstance{model: cfg.Name, key: keyOf(inst.Name()), lc: cfg.SLO.Class == configs.ClassLatencyCritical, priority: cfg.SLO.Priority}
}

// untrack forgets a stopped instance.
func (r *Recovery) Untrack(inst Recoverable) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.instances, inst)
}

// deviceFor is the device a model's instance starts on: dev, unless the
// model is risky and another device has no latency-critical instance (the
// one with the fewest instances). Without gpu.placement this is where
// Isolation acts; with it, placement does (recovery.placed).
func (r *Recovery) DeviceFor(model string, dev int) int {
	if _, risky := r.isolation.Risky(model); !risky || r.placed {
		return dev
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	lc := map[int]bool{}
	count := map[int]int{}
	for inst, in := range r.instances {
		if in.model == model {
			continue
		}
		d := inst.Device()
		count[d]++
		lc[d] = lc[d] || in.lc
	}
	if !lc[dev] {
		return dev
	}
	best := -1
	for _, d := range r.devices {
		if i := d.Index(); !lc[i] && (best < 0 || count[i] < count[best]) {
			best = i
		}
	}
	if best < 0 {
		r.log.Warn("a risky best-effort model shares a device with latency-critical models: no device is free of them", "model", model, "device", dev)
		return dev
	}
	return best
}

// exited is an instance's OnExit: its client is gone by a fault. It starts
// the device's recovery, or, when one is under way, asks it for another
// pass (a fault during the recovery; an instance that started just before
// the fault and was not yet known to the pass).
func (r *Recovery) Exited(i int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if i < 0 || i >= len(r.devices) || r.stopped || r.ctx.Err() != nil {
		return
	}
	if r.recovering[i] {
		r.again[i] = true
		return
	}
	r.recovering[i] = true
	dev := r.devices[i]
	r.wg.Go(func() {
		for {
			r.recoverDevice(dev)
			r.mu.Lock()
			again := r.again[i] && !r.stopped && r.ctx.Err() == nil
			r.again[i] = false
			if !again {
				r.recovering[i] = false
			}
			r.mu.Unlock()
			if !again {
				return
			}
		}
	})
}

// recoverDevice is one pass of a device's recovery: when the device is
// down, it records the fault and restarts the daemon; then it restarts the
// instances a fault took down, latency-critical models first, and records
// what it cost.
func (r *Recovery) recoverDevice(dev FaultDomain) {
	i := dev.Index()
	name := fmt.Sprintf("cuda:%d", i)
	f, faulted := dev.Fault()
	var fault error
	rec := DeviceRecovery{Device: i, At: time.Now()}
	if faulted {
		fault, rec.Fault = f.Err, f.Err
		if !f.At.IsZero() {
			rec.At = f.At
		}
		if f.Client != "" {
			rec.Culprit, rec.culprit = modelOf(f.Client), keyOf(f.Client)
		}
	}

	// The instances a fault took down, in the order they restart, and
	// what they had failed before.
	type down struct {
		inst   Recoverable
		info   simInstance
		failed int64
	}
	var gone []down
	r.mu.Lock()
	for inst, in := range r.instances {
		if inst.Device() == i && inst.Gone() {
			gone = append(gone, down{inst, in, inst.Failed()})
		}
	}
	r.mu.Unlock()
	if fault == nil && len(gone) == 0 {
		return // nothing left to do
	}
	slices.SortFunc(gone, func(a, b down) int {
		ac, ap := a.info.rank()
		bc, bp := b.info.rank()
		return cmp.Or(cmp.Compare(ac, bc), cmp.Compare(ap, bp), strings.Compare(a.inst.Name(), b.inst.Name()))
	})
	if fault != nil {
		names := make([]string, len(gone))
		for i, g := range gone {
			names[i] = g.inst.Name()
		}
		r.record(control.Event{Time: rec.At, Device: name, Model: rec.culprit, Kind: control.EventFault,
			Reason: fmt.Sprintf("%v; %d instance(s) down: %s", fault, len(gone), strings.Join(names, ", "))})
		r.noteFault(rec.Culprit, rec.culprit, rec.At, name)

		handle := r.DaemonOf(i)
		if handle == nil {
			r.record(control.Event{Device: name, Kind: control.EventError, Reason: "restarting the MPS control daemon after a fault: the device has no daemon handle"})
			return
		}
		if err := handle.RestartDaemon(r.ctx); err != nil {
			r.record(control.Event{Device: name, Kind: control.EventError, Reason: "restarting the MPS control daemon after a fault: " + err.Error()})
			return
		}
		rec.Daemon = time.Since(rec.At)
	} else {
		fault = errors.New("a fault on the device")
	}

	byModel := map[string]*ModelRecovery{}
	var order []string
	for _, g := range gone {
		mr := byModel[g.info.model]
		if mr == nil {
			mr = &ModelRecovery{Model: g.info.model, key: g.info.key}
			byModel[g.info.model] = mr
			order = append(order, g.info.model)
		}
		target := r.DeviceFor(g.info.model, i)
		err := g.inst.Recover(r.ctx, target, fmt.Sprintf("the device's MPS clients were taken down by a fault (%v)", fault))
		mr.Failed += g.inst.Failed() - g.failed
		switch {
		case err == nil && mr.Ready == 0:
			mr.Ready, mr.Device, mr.Err = time.Since(rec.At), target, nil
		case err != nil && mr.Ready == 0:
			mr.Err = err
		}
		if r.ctx.Err() != nil {
			return
		}
	}
	for _, m := range order {
		mr := byModel[m]
		rec.Models = append(rec.Models, *mr)
		if mr.Err != nil {
			r.record(control.Event{Device: name, Model: mr.key, Kind: control.EventError,
				Reason: fmt.Sprintf("not serving again after the fault: %v (%d requests failed since)", mr.Err, mr.Failed)})
			continue
		}
		where := ""
		if mr.Device != i {
			where = fmt.Sprintf(" on cuda:%d, apart from latency-critical models", mr.Device)
		}
		since := fmt.Sprintf("after the fault (daemon back after %s)", rec.Daemon.Round(time.Millisecond))
		if rec.Fault == nil {
			since = "after its recovery began (a later pass: the daemon was back)"
		}
		r.record(control.Event{Device: name, Model: mr.key, Kind: control.EventRecovered,
			Reason: fmt.Sprintf("serving again%s %s %s; %d requests failed meanwhile",
				where, mr.Ready.Round(time.Millisecond), since, mr.Failed)})
	}
	if rec.Fault != nil {
		r.mu.Lock()
		r.done = append(r.done, rec)
		r.mu.Unlock()
	}
}

// noteFault counts a fault against the model whose client raised it, and
// marks a best-effort model risky at riskyFaults within riskyWindow.
func (r *Recovery) noteFault(model, key string, at time.Time, device string) {
	if model == "" {
		return
	}
	r.mu.Lock()
	lc := false
	for _, in := range r.instances {
		lc = lc || (in.model == model && in.lc)
	}
	recent := slices.DeleteFunc(append(r.faults[model], at), func(t time.Time) bool { return at.Sub(t) > riskyWindow })
	r.faults[model] = recent
	r.mu.Unlock()
	if lc || len(recent) < riskyFaults {
		return
	}
	why := fmt.Sprintf("its client faulted its GPU %d times within %s", len(recent), riskyWindow)
	if r.isolation.Mark(model, why) {
		r.record(control.Event{Device: device, Model: key, Kind: control.EventRisky,
			Reason: why + ": kept on a device without latency-critical models when there is one"})
	}
}

// restarted is an instance's OnRestart: a hung client replaced is an event.
func (r *Recovery) Restarted(inst Recoverable, reason string) {
	if !strings.HasPrefix(reason, "hung") {
		return // a recovery's restart: recoverDevice records it
	}
	r.record(control.Event{Device: fmt.Sprintf("cuda:%d", inst.Device()), Model: keyOf(inst.Name()), Kind: control.EventHung,
		Reason: fmt.Sprintf("%s; the device's other clients were left alone", reason)})
}

// startFailed records an instance that could not start for want of device
// memory.
func (r *Recovery) StartFailed(instance string, dev int, err error) {
	r.record(control.Event{Device: fmt.Sprintf("cuda:%d", dev), Model: keyOf(instance), Kind: control.EventError,
		Reason: "not started: " + err.Error()})
}

// modelOf and keyOf read an instance's name ("model/version#index").
func modelOf(instance string) string {
	m, _, _ := strings.Cut(instance, "/")
	return m
}

func keyOf(instance string) string {
	k, _, _ := strings.Cut(instance, "#")
	return k
}

// record keeps an event and logs it.
func (r *Recovery) record(e control.Event) {
	e = r.events.Add(e)
	level := slog.LevelInfo
	if e.Kind != control.EventRecovered {
		level = slog.LevelWarn
	}
	r.log.Log(context.Background(), level, "device "+e.Kind, "device", e.Device, "model", e.Model, "reason", e.Reason)
}

// Events returns the kept events at or after since, oldest first; with
// limit > 0 only the newest limit.
func (r *Recovery) Events(since time.Time, limit int) []control.Event {
	return r.events.Since(since, limit)
}

// recoveries are the finished device recoveries, oldest first.
func (r *Recovery) Recoveries() []DeviceRecovery {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.done)
}

// Isolation marks the risky best-effort models (placement keeps them
// apart).
func (r *Recovery) Isolation() *control.Isolation { return r.isolation }

// Instances are the live instances of a model the recovery knows.
func (r *Recovery) Instances(model string) []Recoverable {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Recoverable
	for inst, in := range r.instances {
		if in.model == model {
			out = append(out, inst)
		}
	}
	return out
}
