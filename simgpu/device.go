package simgpu

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"
)

// Costs of the device's lifecycle. Each is a published figure or says it is
// an assumption.
const (
	// ContextCreate is the time to create an MPS client's CUDA context.
	// PipeSwitch (Bai et al., OSDI 2020, section 2) measured seconds for
	// a cold process; a client of an MPS server that already holds the
	// device skips driver initialisation, so we assume 500 ms.
	ContextCreate = 500 * time.Millisecond
	// ContextMemory is the device memory of one client's context:
	// an assumption of 300 MiB (a CUDA context with cuDNN and cuBLAS
	// handles takes a few hundred MiB on recent drivers; since Volta
	// every MPS client has a context of its own).
	ContextMemory = 300 * mib
	// LoadBandwidth is host-to-device copy speed for weights: PCIe 3.0
	// x16 is 15.75 GB/s by the specification; we assume 12 GB/s in
	// practice.
	LoadBandwidth = 12e9
	// Interference is how much a kernel slows per unit of memory
	// bandwidth its co-runners use: rate /= 1 + Interference*Σ bw of the
	// others, each bw following the SMs its kernel runs on (bandwidth).
	// Gpulet (ATC 2022, section 4.3) fits interference as a linear
	// function of co-runners' memory bandwidth and L2 use; the
	// coefficient 0.5 is an assumption that gives the 10-40% slowdowns
	// such papers report for two co-located inference models.
	Interference = 0.5
	// DaemonRestart is the time to bring a device's MPS clients back
	// after a fatal fault: an assumption of 1 s, within the 73-1359 ms
	// that "Characterization-Guided GPU Fault Resilience in NVIDIA MPS"
	// (arXiv 2605.26461, 2026) reports for recovering from an SM fault by
	// restarting the processes.
	DaemonRestart = time.Second
)

// Errors of the simulator.
var (
	// ErrOutOfMemory is a device memory allocation that does not fit the
	// device or the client's pinned limit (cudaErrorMemoryAllocation).
	ErrOutOfMemory = errors.New("simgpu: out of device memory")
	// ErrDeviceFault means a fatal fault on the device took the client
	// down: under MPS a fault in one client can terminate every client
	// on the device (NVIDIA's MPS documentation on error containment;
	// MuxFlow, Zhao et al. 2023, on MPS's shared error handling; arXiv
	// 2605.26461 characterises it on L40 and H100).
	ErrDeviceFault = errors.New("simgpu: fatal fault on the device (MPS clients of the device are gone)")
	// ErrClientClosed is an execution on a closed client.
	ErrClientClosed = errors.New("simgpu: client closed")
	// ErrDaemonDown means the device is waiting for its MPS control
	// daemon to restart after a fault.
	ErrDaemonDown = errors.New("simgpu: the MPS control daemon is not running on the device")
)

// Spec is a simulated machine.
type Spec struct {
	Devices int   // number of devices, >= 1
	SMs     int   // streaming multiprocessors per device, >= 1 (A100: 108)
	Memory  int64 // device memory in bytes
	// NoDaemon starts the devices without an MPS control daemon:
	// percentages and pinned limits are ignored and clients time-slice.
	NoDaemon bool
	// MIG starts the devices in MIG mode.
	MIG bool
	// Name is the devices' product name; default "simgpu".
	Name string
}

// Check reports a spec the simulator cannot run.
func (s Spec) Check() error {
	switch {
	case s.Devices < 1 || s.Devices > 64:
		return fmt.Errorf("simgpu: %d devices, want 1..64", s.Devices)
	case s.SMs < 1 || s.SMs > 1024:
		return fmt.Errorf("simgpu: %d SMs, want 1..1024", s.SMs)
	case s.Memory < ContextMemory+mib:
		return fmt.Errorf("simgpu: device memory %d bytes is below one context (%d)", s.Memory, ContextMemory)
	}
	return nil
}

// Sim is a simulated machine: its devices.
type Sim struct {
	spec    Spec
	devices []*Device

	mu      sync.Mutex
	nextPID int
}

// New starts a simulated machine.
func New(spec Spec) (*Sim, error) {
	if err := spec.Check(); err != nil {
		return nil, err
	}
	if spec.Name == "" {
		spec.Name = "simgpu"
	}
	s := &Sim{spec: spec, nextPID: 40000}
	for i := range spec.Devices {
		s.devices = append(s.devices, &Device{
			sim: s, index: i, sms: spec.SMs, memory: spec.Memory,
			daemon: !spec.NoDaemon, mig: spec.MIG,
			clients: map[*Client]bool{}, last: time.Now(), readAt: time.Now(),
			start: time.Now(), smSeconds: map[int]float64{},
		})
	}
	return s, nil
}

// Spec is the machine's spec.
func (s *Sim) Spec() Spec { return s.spec }

// Devices are the machine's devices, by index.
func (s *Sim) Devices() []*Device { return s.devices }

// Device is device i, or an error naming the range.
func (s *Sim) Device(i int) (*Device, error) {
	if i < 0 || i >= len(s.devices) {
		return nil, fmt.Errorf("simgpu: no device %d (the machine has %d)", i, len(s.devices))
	}
	return s.devices[i], nil
}

func (s *Sim) pid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nextPID++
	return s.nextPID
}

// Device is one simulated GPU. Its kernels share the SMs as processor
// sharing: each running execution progresses at a rate its share, the
// other running executions and interference set, recomputed whenever one
// starts or ends.
type Device struct {
	sim    *Sim
	index  int
	sms    int
	memory int64

	mu       sync.Mutex
	daemon   bool // an MPS control daemon runs
	mig      bool
	faulted  error // set by a fatal fault until the daemon restarts
	clients  map[*Client]bool
	external int64 // memory held outside sloserve (InjectMemory)
	jobs     []*job
	timer    *time.Timer // fires at the earliest end of a job (tick)
	last     time.Time   // when the jobs' work was last advanced
	// next is the device's next event (a job's end, a host phase's end,
	// a below-normal job's yield) as the rates were last set; zero when
	// none is due. advanceLocked plays the events that passed before the
	// timer told it, in order.
	next time.Time
	// late, when set, delays every firing of the timer by what it
	// returns (SetHostLateness).
	late     func() time.Duration
	busy     time.Duration
	bwBusy   float64 // seconds × bandwidth in use
	smBusy   float64 // seconds × the fraction of the SMs kernels held
	start    time.Time
	readAt   time.Time
	readBusy time.Duration
	readBW   float64
	// smSeconds is, by pid, the integral over time of the fraction of
	// the device's SMs the pid's running kernels held: what per-process
	// utilisation (ProcessUtilization) reads. It outlives the client so
	// that a read after a client closes still sees what it used.
	smSeconds map[int]float64
	// samples are the per-process readings taken so far, oldest first,
	// at most maxSamples: a reading's window starts at the newest one a
	// caller has seen.
	samples []smSnapshot
}

// smSnapshot is smSeconds at one moment.
type smSnapshot struct {
	at time.Time
	sm map[int]float64
}

// maxSamples bounds a device's per-process readings: NVML keeps a
// fixed-size buffer of samples per device too.
const maxSamples = 32

// job is one execution's kernel work in flight.
type job struct {
	c *Client
	b int
	// host is the seconds of host time (launch, warm-up) left before
	// the kernels start: it passes at rate 1 whatever else runs, and the
	// job takes no SMs meanwhile. One timer per device covers it too, so
	// an execution costs no timer of its own.
	host float64
	work float64 // seconds of kernel time at saturation left; +Inf when hung
	rate float64
	// sm is the fraction of the device's SMs the job's kernels hold
	// while they run, set with rate.
	sm float64
	// kstart is when the kernels started (the host phase ended): a
	// below-normal job's block boundaries are Block apart from it.
	kstart time.Time
	// yieldAt is, for a below-normal job that must give SMs back to
	// normal work, the block boundary at which it does; zero when it
	// keeps what it holds.
	yieldAt time.Time
	done    chan error // buffered; receives once
}

// SetHostLateness makes every firing of the device's timer late by what
// late returns (nil: on time): a busy host, whose timers fire late, for
// tests and what-if runs of the real binary on a few shared cores. The
// device does not wait for its host (advanceLocked): only the news of an
// end comes late. late is called with the device's lock held.
func (d *Device) SetHostLateness(late func() time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.late = late
}

// Index is the device's index.
func (d *Device) Index() int { return d.index }

// SMs is the device's SM count.
func (d *Device) SMs() int { return d.sms }

// MemoryTotal is the device memory in bytes.
func (d *Device) MemoryTotal() int64 { return d.memory }

// DaemonRunning reports whether an MPS control daemon serves the device.
func (d *Device) DaemonRunning() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.daemon && d.faulted == nil
}

// MIG reports whether the device is in MIG mode.
func (d *Device) MIG() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mig
}

// SetDaemon starts or stops the device's MPS control daemon (as
// nvidia-cuda-mps-control -d and quit do). Clients started while it is
// stopped ignore their limits.
func (d *Device) SetDaemon(running bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.daemon = running
}

// usedLocked is the device memory in use.
func (d *Device) usedLocked() int64 {
	n := d.external
	for c := range d.clients {
		n += c.mem
	}
	return n
}

// MemoryUsed is the device memory in use, by every client and outside
// holders.
func (d *Device) MemoryUsed() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.usedLocked()
}

// MemoryPinned is the sum of the pinned memory limits of the clients on
// the device (what MPS holds for them whatever they use), and the memory
// of the clients without a limit.
func (d *Device) MemoryPinned() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	var n int64
	for c := range d.clients {
		if c.limited() && c.spec.PinnedMemory > 0 {
			n += max(c.spec.PinnedMemory, c.mem)
		} else {
			n += c.mem
		}
	}
	return n
}

// InjectMemory makes bytes of device memory used (negative frees them) by
// something outside the simulated clients: another tenant, a leak.
func (d *Device) InjectMemory(bytes int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if bytes > 0 && d.usedLocked()+bytes > d.memory {
		return fmt.Errorf("%w: device %d: %d bytes asked, %d free", ErrOutOfMemory, d.index, bytes, d.memory-d.usedLocked())
	}
	d.external = max(0, d.external+bytes)
	return nil
}

// allocLocked grows c's memory by n bytes, within its pinned limit and the
// device.
func (d *Device) allocLocked(c *Client, n int64, what string) error {
	if c.limited() && c.spec.PinnedMemory > 0 && c.mem+n > c.spec.PinnedMemory {
		return fmt.Errorf("%w: device %d, client %s: %s needs %d bytes, %d left of its pinned limit %d",
			ErrOutOfMemory, d.index, c.spec.Name, what, n, c.spec.PinnedMemory-c.mem, c.spec.PinnedMemory)
	}
	if free := d.memory - d.usedLocked(); n > free {
		return fmt.Errorf("%w: device %d, client %s: %s needs %d bytes, %d free of %d",
			ErrOutOfMemory, d.index, c.spec.Name, what, n, free, d.memory)
	}
	c.mem += n
	return nil
}

// advanceLocked moves the device on to now, event by event: where its
// next event (a job's end, a host phase's end, a below-normal job's block
// boundary) passed before now, the device reaches it at its own time,
// ends what ended there and sets the rates anew, then goes on. The timer
// that wakes the device runs on the host's CPU and fires late when the
// host is busy; a GPU does not wait for the host to hand SMs over at a
// block boundary or to give a finished kernel's SMs to the others, so
// the simulated device must not either. Only the news of an end reaches
// its caller late, as a completion does on a real host.
func (d *Device) advanceLocked(now time.Time) {
	played := false
	for range catchUpEvents + 4*len(d.jobs) {
		if len(d.jobs) == 0 || d.next.IsZero() || !d.next.Before(now) {
			break
		}
		at := d.next
		d.stepLocked(at)
		d.settleLocked(at)
		d.setRatesLocked(at)
		played = true
	}
	d.stepLocked(now)
	if played {
		d.armLocked(now)
	}
}

// catchUpEvents bounds the events advanceLocked plays in one call (more
// per job running): past it the rest of the interval runs at the rates
// as they stand, as before events were played.
const catchUpEvents = 64

// stepLocked moves every job's work on to now at the rates as they stand.
// A job's host phase ends at an event, so no interval spans both phases
// beyond the timer's nanosecond.
func (d *Device) stepLocked(now time.Time) {
	dt := now.Sub(d.last)
	if dt <= 0 {
		return
	}
	d.last = now
	if len(d.jobs) == 0 {
		return
	}
	bw, sm := 0.0, 0.0
	for _, j := range d.jobs {
		if j.host > 0 {
			if j.host <= dt.Seconds() {
				j.kstart = now.Add(-dt + time.Duration(j.host*float64(time.Second)))
			}
			j.host = max(0, j.host-dt.Seconds())
			continue
		}
		if j.sm <= 0 {
			continue // a below-normal job normal work left no SM
		}
		j.work -= j.rate * dt.Seconds()
		d.smSeconds[j.c.pid] += j.sm * dt.Seconds()
		bw += d.bandwidth(j)
		sm += j.sm
	}
	if sm > 0 {
		d.busy += dt
		d.bwBusy += min(1, bw) * dt.Seconds()
		d.smBusy += min(1, sm) * dt.Seconds()
	}
}

// settleLocked starts the kernels of the jobs whose host phase ended by
// now and answers the jobs whose work is done, taking them off.
func (d *Device) settleLocked(now time.Time) {
	kept := d.jobs[:0]
	for _, j := range d.jobs {
		if j.host > 0 {
			if j.host <= doneWork {
				j.host = 0 // the kernels start
				j.kstart = now
			}
			kept = append(kept, j)
			continue
		}
		if j.work <= doneWork*max(1, j.rate) {
			j.done <- nil
			continue
		}
		kept = append(kept, j)
	}
	clear(d.jobs[len(kept):])
	d.jobs = kept
}

// demand is the share of the device a job's kernels take when nothing
// else runs: its client's percentage as whole SMs, up to what its batch
// can use.
func (d *Device) demand(j *job) float64 {
	s := 1.0
	if j.c.limited() {
		// MPS hands out whole SMs: the percentage of the SM count,
		// rounded up.
		s = math.Ceil(float64(j.c.percentage())*float64(d.sms)/100) / float64(d.sms)
	}
	return min(s, j.c.spec.Model.sat(j.b))
}

// bandwidth is the part of the device's memory bandwidth a running job's
// kernels use: the model's Bandwidth (at its saturation, alone) times the
// part of its saturation its SMs are under MPS. A kernel's memory traffic
// per second is its work per second times the bytes per unit of work, and
// its work per second follows the SMs its blocks run on (the curve's
// s/sat), so a kernel on a fifth of the SMs it could use moves a fifth of
// the bytes per second. Time-sliced (no daemon) a kernel holds the SMs it
// uses while its slice runs, so it uses its Bandwidth then.
func (d *Device) bandwidth(j *job) float64 {
	bw := j.c.spec.Model.Bandwidth
	if !d.daemon || j.sm <= 0 {
		return bw
	}
	return bw * min(1, j.sm/j.c.spec.Model.sat(j.b))
}

// rescheduleLocked sets each job's SMs and rate and arms the device's one
// timer for the earliest event: a job's end, or a below-normal job's
// block boundary at which it gives SMs back. One timer per device, reset,
// rather than one per job made afresh at every start and end: that cost
// most of a simulated request (timer heap churn).
func (d *Device) rescheduleLocked() {
	now := time.Now()
	d.setRatesLocked(now)
	d.armLocked(now)
}

// armLocked arms the timer for the next event (stops it when none is
// due).
func (d *Device) armLocked(now time.Time) {
	if d.next.IsZero() {
		if d.timer != nil {
			d.timer.Stop()
		}
		return
	}
	wait := max(0, d.next.Sub(now))
	if d.late != nil {
		wait += max(0, d.late())
	}
	if d.timer == nil {
		d.timer = time.AfterFunc(wait, d.tick)
	} else {
		d.timer.Reset(wait)
	}
}

// setRatesLocked sets each job's SMs and rate as the device stands at now
// and its next event (d.next; zero when nothing will end: no job, or
// only hung or stalled ones).
func (d *Device) setRatesLocked(now time.Time) {
	d.next = time.Time{}
	if len(d.jobs) == 0 {
		return
	}
	next := inf
	if d.daemon {
		next = d.shareSMsLocked(now)
	} else {
		// Without MPS the device time-slices between contexts: each
		// runs alone, 1/n of the time.
		contexts := d.contextsLocked()
		for _, j := range d.jobs {
			if j.host <= 0 {
				j.sm = d.demand(j) / float64(contexts)
			}
		}
	}
	bw := 0.0
	for _, j := range d.jobs {
		if j.host <= 0 && j.sm > 0 {
			bw += d.bandwidth(j)
		}
	}
	for _, j := range d.jobs {
		if j.host > 0 {
			next = min(next, j.host)
			continue
		}
		if j.sm <= 0 {
			j.rate = 0
			continue
		}
		var rate float64
		if d.daemon {
			rate = j.sm / j.c.spec.Model.sat(j.b)
		} else {
			rate = 1 / float64(d.contextsLocked())
		}
		rate /= 1 + Interference*(bw-d.bandwidth(j))
		j.rate = rate
		next = min(next, j.work/rate)
	}
	if math.IsInf(next, 1) {
		return // only hung or stalled jobs: nothing ends
	}
	d.next = now.Add(time.Duration(math.Ceil(max(0, next) * float64(time.Second)))) // never early
}

// shareSMsLocked sets each running job's SMs under MPS and returns the
// seconds until the next block boundary at which a below-normal job gives
// SMs back (+Inf when none must). Normal jobs split the device in
// proportion to their demand when they ask for more than it has;
// below-normal jobs split, in proportion too, what normal jobs leave. A
// below-normal job that holds SMs normal work now wants keeps them until
// its running blocks end (its next block boundary), and the normal jobs
// run meanwhile on what is free; a below-normal job grows only onto SMs
// the normal jobs leave free, since their pending blocks go first.
func (d *Device) shareSMsLocked(now time.Time) float64 {
	var normal, below float64
	for _, j := range d.jobs {
		if j.host > 0 {
			continue
		}
		if j.c.background() {
			below += d.demand(j)
		} else {
			normal += d.demand(j)
		}
	}
	left := max(0, 1-normal)
	next, held := inf, 0.0
	type growth struct {
		j    *job
		want float64
	}
	var grows []growth
	var deficit float64
	for _, j := range d.jobs {
		if j.host > 0 || !j.c.background() {
			continue
		}
		want := d.demand(j)
		if below > left {
			want *= left / below
		}
		switch {
		case want >= j.sm-shareEpsilon:
			j.yieldAt = time.Time{}
			if want > j.sm {
				grows = append(grows, growth{j, want})
				deficit += want - j.sm
			}
		case math.IsInf(j.work, 1):
			// A hung kernel's blocks never end: it keeps its SMs.
		default:
			if j.yieldAt.IsZero() {
				j.yieldAt = d.blockBoundary(j, now)
			}
			if now.Before(j.yieldAt) {
				next = min(next, j.yieldAt.Sub(now).Seconds())
			} else {
				j.sm, j.yieldAt = want, time.Time{}
			}
		}
		held += j.sm
	}
	free := max(0, 1-held)
	scale := 1 / max(1, normal)
	if used := min(1, normal); used > free {
		scale *= free / used
	}
	for _, j := range d.jobs {
		if j.host > 0 || j.c.background() {
			continue
		}
		j.sm = d.demand(j) * scale
	}
	free = max(0, free-min(1, normal))
	// What normal work leaves free goes to the below-normal jobs that may
	// grow, in proportion to what each lacks.
	if deficit > 0 {
		f := min(1, free/deficit)
		for _, g := range grows {
			g.j.sm += (g.want - g.j.sm) * f
		}
	}
	return next
}

// shareEpsilon is how close two SM fractions count as equal.
const shareEpsilon = 1e-9

// blockBoundary is the first end of j's running blocks at or after now:
// its kernels' blocks run Model.Block each, back to back from kstart.
func (d *Device) blockBoundary(j *job, now time.Time) time.Time {
	tau := j.c.spec.Model.block()
	ran := now.Sub(j.kstart).Seconds()
	k := math.Ceil(ran/tau - 1e-9)
	return j.kstart.Add(time.Duration(math.Ceil(k * tau * float64(time.Second))))
}

// contextsLocked is how many clients have kernels on the device.
func (d *Device) contextsLocked() int {
	n := 0
	for i, j := range d.jobs {
		if j.host > 0 {
			continue
		}
		if !slices.ContainsFunc(d.jobs[:i], func(o *job) bool { return o.c == j.c && o.host <= 0 }) {
			n++
		}
	}
	return n
}

// doneWork is how little work left counts as done: a nanosecond of the
// timer's rounding at any rate.
const doneWork = 1e-9

// tick ends the jobs whose work is done and sets the others' rates again.
func (d *Device) tick() {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now()
	d.advanceLocked(now)
	d.settleLocked(now)
	d.rescheduleLocked()
}

// removeLocked takes j off the device, after advancing the others.
func (d *Device) removeLocked(j *job) bool {
	d.advanceLocked(time.Now()) // j may end meanwhile
	i := slices.Index(d.jobs, j)
	if i < 0 {
		return false
	}
	d.jobs = slices.Delete(d.jobs, i, i+1)
	return true
}

// run puts an execution on the device, host time first, then its kernels,
// and waits for them.
func (d *Device) run(c *Client, b int, host time.Duration, done <-chan struct{}) error {
	j := &job{c: c, b: b, host: host.Seconds(), work: c.spec.Model.kernel(b), kstart: time.Now(), done: make(chan error, 1)}
	d.mu.Lock()
	if err := c.usableLocked(); err != nil {
		d.mu.Unlock()
		return err
	}
	if c.hung {
		j.work = math.Inf(1)
	}
	d.advanceLocked(time.Now())
	d.jobs = append(d.jobs, j)
	d.rescheduleLocked()
	d.mu.Unlock()
	select {
	case err := <-j.done:
		return err
	case <-done:
		d.mu.Lock()
		if d.removeLocked(j) {
			d.rescheduleLocked()
		}
		d.mu.Unlock()
		return errCanceled
	}
}

var (
	errCanceled = errors.New("simgpu: execution canceled")
	inf         = math.Inf(1)
)

// FaultError is a fatal fault on a device: it is ErrDeviceFault, and
// says which client raised it ("" for the device itself).
type FaultError struct {
	Device int
	Client string // the name of the client that raised it
	Cause  string
	At     time.Time // when it happened
}

func (e *FaultError) Error() string {
	name := "the device"
	if e.Client != "" {
		name = "client " + e.Client
	}
	return fmt.Sprintf("%v: device %d: %s raised %s", ErrDeviceFault, e.Device, name, e.Cause)
}

// Is makes a FaultError ErrDeviceFault.
func (e *FaultError) Is(target error) bool { return target == ErrDeviceFault }

// Fault is a fatal fault raised by client c (an illegal address, an
// uncorrectable ECC error), nil for the device itself: as under MPS,
// every client on the device is gone, executions in flight fail, their
// memory is freed, and the device takes no new client until
// RestartDaemon. The error is a *FaultError.
func (d *Device) Fault(c *Client, cause string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	fe := &FaultError{Device: d.index, Cause: cause, At: time.Now()}
	if c != nil {
		fe.Client = c.spec.Name
	}
	d.faulted = fe
	d.advanceLocked(time.Now())
	for _, j := range d.jobs {
		j.done <- fe
	}
	d.jobs = nil
	d.rescheduleLocked()
	for cl := range d.clients {
		cl.endLocked(fe)
	}
	clear(d.clients)
}

// Faulted is the fault that stopped the device, nil while it serves.
func (d *Device) Faulted() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.faulted
}

// RestartDaemon brings a faulted device back: it waits DaemonRestart and
// then accepts clients again.
func (d *Device) RestartDaemon() {
	time.Sleep(DaemonRestart)
	d.mu.Lock()
	defer d.mu.Unlock()
	d.faulted = nil
	d.daemon = true
}

// Utilization is what NVML reports since the previous call: the fraction
// of the time a kernel ran (gpu), and the memory bandwidth in use over it
// (memory), each 0..1.
func (d *Device) Utilization() (gpu, memory float64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now()
	d.advanceLocked(now)
	span := now.Sub(d.readAt)
	busy, bw := d.busy-d.readBusy, d.bwBusy-d.readBW
	d.readAt, d.readBusy, d.readBW = now, d.busy, d.bwBusy
	if span <= 0 {
		return 0, 0
	}
	return min(1, busy.Seconds()/span.Seconds()), min(1, bw/span.Seconds())
}

// ProcessUtilization is per-process SM utilisation as NVML's
// nvmlDeviceGetProcessUtilization reports it: for each process whose
// kernels ran on the device, or that is still a client of it, the fraction
// of the device's SMs its kernels held on average over a window (0..1),
// and the window's end. The window runs from the newest earlier reading
// taken at or before since (from the device's start when there is none)
// to now; each call takes a reading. Nil when now is not after since.
func (d *Device) ProcessUtilization(since time.Time) (map[int]float64, time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now()
	d.advanceLocked(now)
	if !now.After(since) {
		return nil, now
	}
	from, base := d.start, map[int]float64(nil)
	for _, s := range d.samples {
		if s.at.After(since) {
			break
		}
		from, base = s.at, s.sm
	}
	span := now.Sub(from).Seconds()
	out := map[int]float64{}
	live := map[int]bool{}
	for c := range d.clients {
		live[c.pid] = true
	}
	snap := make(map[int]float64, len(d.smSeconds))
	for pid, sm := range d.smSeconds {
		used := sm - base[pid]
		if used > 0 || live[pid] {
			out[pid] = 0
			if span > 0 {
				out[pid] = min(1, max(0, used/span))
			}
		}
		// A pid gone from the device whose use no kept reading can
		// still see change is forgotten.
		if !live[pid] && len(d.samples) > 0 && d.samples[0].sm[pid] == sm {
			delete(d.smSeconds, pid)
			continue
		}
		snap[pid] = sm
	}
	for pid := range live {
		if _, ok := out[pid]; !ok {
			out[pid] = 0
		}
	}
	d.samples = append(d.samples, smSnapshot{at: now, sm: snap})
	if n := len(d.samples) - maxSamples; n > 0 {
		d.samples = slices.Delete(d.samples, 0, n)
	}
	return out, now
}

// SMSeconds is the integral over time of the fraction of the device's SMs
// that running kernels held, in seconds since the device started: over an
// interval, its growth divided by the interval is the mean SM
// utilisation (what NVML's per-process readings add up to).
func (d *Device) SMSeconds() float64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.advanceLocked(time.Now())
	return d.smBusy
}

// ProcessMemory is the device memory of each client, by its pid.
func (d *Device) ProcessMemory() map[int]int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	m := make(map[int]int64, len(d.clients))
	for c := range d.clients {
		m[c.pid] += c.mem
	}
	return m
}

// Clients is the number of live clients on the device.
func (d *Device) Clients() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.clients)
}
