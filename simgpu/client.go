package simgpu

import (
	"context"
	"fmt"
	"time"
)

// ClientSpec is an MPS client as it starts: the limits are fixed for its
// life, as the environment of a real client is read once when its context
// is created.
type ClientSpec struct {
	Name string // for errors and readings
	// Percentage is CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, 1..100; 0 is 100.
	Percentage int
	// PinnedMemory is CUDA_MPS_PINNED_DEVICE_MEM_LIMIT in bytes; 0 is none.
	PinnedMemory int64
	// Priority is CUDA_MPS_CLIENT_PRIORITY: PriorityNormal (0, the
	// default) or PriorityBelowNormal (1).
	Priority Priority
	Model    Model
}

// Priority is an MPS client's priority, as CUDA_MPS_CLIENT_PRIORITY sets
// it when the client starts (NVIDIA's MPS documentation, environment
// variables: 0 is NORMAL, 1 BELOW NORMAL).
//
// The simulator models it as CUDA documents stream priorities: pending
// thread blocks of normal work are dispatched before those of
// below-normal work, and blocks already running are not preempted. So a
// below-normal client's kernels run on the SMs normal kernels leave, and
// when a normal kernel wants SMs a below-normal kernel holds, it gets them
// as that kernel's running blocks end: at its next block boundary, at most
// one Model.Block later. Between clients of one priority nothing changes:
// oversubscribed SMs are split in proportion. Without a daemon there is no
// MPS server to read it and it is ignored.
type Priority int

const (
	PriorityNormal      Priority = 0
	PriorityBelowNormal Priority = 1
)

func (p Priority) String() string {
	switch p {
	case PriorityNormal:
		return "normal"
	case PriorityBelowNormal:
		return "below-normal"
	}
	return fmt.Sprintf("priority(%d)", int(p))
}

// Client is one MPS client: a process with a CUDA context on a device and
// its model loaded.
type Client struct {
	d    *Device
	spec ClientSpec
	pid  int
	mps  bool // started under a daemon: its limits hold

	// Guarded by d.mu.
	mem    int64        // context + weights + arena
	arena  int64        // the arena's high-water mark
	warm   map[int]bool // batch sizes executed once
	hung   bool
	dead   error // set when the client is gone
	closed bool
	gone   chan struct{} // closed when the client is gone (closed or faulted)
}

// StartClient creates a client on the device: its context (ContextCreate,
// ContextMemory), then its weights (copied at LoadBandwidth). It fails with
// ErrOutOfMemory when the context or the weights do not fit, with
// ErrDaemonDown while the device recovers from a fault, and with ctx's
// error when canceled; the memory it took is freed on failure.
func (d *Device) StartClient(ctx context.Context, spec ClientSpec) (*Client, error) {
	if err := spec.Model.Check(); err != nil {
		return nil, err
	}
	if spec.Percentage < 0 || spec.Percentage > 100 || spec.PinnedMemory < 0 {
		return nil, fmt.Errorf("simgpu: client %s: percentage %d or pinned memory %d out of range", spec.Name, spec.Percentage, spec.PinnedMemory)
	}
	if spec.Priority != PriorityNormal && spec.Priority != PriorityBelowNormal {
		return nil, fmt.Errorf("simgpu: client %s: priority %d, want 0 (normal) or 1 (below normal)", spec.Name, spec.Priority)
	}
	d.mu.Lock()
	if d.faulted != nil {
		err := fmt.Errorf("%w (device %d: %v)", ErrDaemonDown, d.index, d.faulted)
		d.mu.Unlock()
		return nil, err
	}
	c := &Client{d: d, spec: spec, pid: d.sim.pid(), mps: d.daemon, warm: map[int]bool{}, gone: make(chan struct{})}
	d.clients[c] = true
	err := d.allocLocked(c, ContextMemory, "its CUDA context")
	d.mu.Unlock()
	if err == nil {
		err = sleep(ctx, ContextCreate)
	}
	if err == nil {
		d.mu.Lock()
		if err = c.usableLocked(); err == nil {
			err = d.allocLocked(c, spec.Model.Weights, "its weights")
		}
		d.mu.Unlock()
	}
	if err == nil {
		err = sleep(ctx, time.Duration(float64(spec.Model.Weights)/LoadBandwidth*float64(time.Second)))
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// sleep waits d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// limited reports whether the client's limits hold: it started under an
// MPS daemon.
func (c *Client) limited() bool { return c.mps }

// Limited reports whether the client's limits hold: it started under an
// MPS daemon, which enforces its percentage and pinned memory.
func (c *Client) Limited() bool { return c.mps }

// background reports whether the client's kernels run below normal: it
// asked to and an MPS server read it.
func (c *Client) background() bool { return c.mps && c.spec.Priority == PriorityBelowNormal }

func (c *Client) percentage() int {
	if c.spec.Percentage == 0 {
		return 100
	}
	return c.spec.Percentage
}

// usableLocked is why c cannot run, nil when it can.
func (c *Client) usableLocked() error {
	switch {
	case c.dead != nil:
		return c.dead
	case c.closed:
		return ErrClientClosed
	}
	return nil
}

// PID is the client's simulated process id, as NVML reports it.
func (c *Client) PID() int { return c.pid }

// Device is the client's device.
func (c *Client) Device() *Device { return c.d }

// Spec is what the client started with.
func (c *Client) Spec() ClientSpec { return c.spec }

// Memory is the device memory the client holds.
func (c *Client) Memory() int64 {
	c.d.mu.Lock()
	defer c.d.mu.Unlock()
	return c.mem
}

// SMSeconds is the integral over time of the fraction of the device's SMs
// the client's running kernels have held since it started: its share of
// Device.SMSeconds, what NVML's per-process utilisation samples. A hung
// kernel holds its SMs, so this grows; a below-normal client that normal
// work leaves no SM holds none, so it stands still.
func (c *Client) SMSeconds() float64 {
	c.d.mu.Lock()
	defer c.d.mu.Unlock()
	c.d.advanceLocked(time.Now())
	return c.d.smSeconds[c.pid]
}

// Err is why the client is gone (ErrDeviceFault, ErrClientClosed), nil
// while it serves.
func (c *Client) Err() error {
	c.d.mu.Lock()
	defer c.d.mu.Unlock()
	return c.usableLocked()
}

// Execute runs one execution at batch b and returns how long it took. The
// arena grows to the batch's activations first (ErrOutOfMemory when that
// does not fit; the client lives on), the first execution at a batch size
// adds the model's Warmup, then Launch, then the kernels share the device
// with whatever else runs. A fault on the device fails it with
// ErrDeviceFault; a hung client's executions return only when ctx ends.
func (c *Client) Execute(ctx context.Context, b int) (time.Duration, error) {
	start := time.Now()
	m := c.spec.Model
	d := c.d
	d.mu.Lock()
	err := c.usableLocked()
	if err == nil && m.Arena(b) > c.arena {
		if err = d.allocLocked(c, m.Arena(b)-c.arena, fmt.Sprintf("the arena at batch %d", b)); err == nil {
			c.arena = m.Arena(b)
		}
	}
	first := !c.warm[b]
	c.warm[b] = true
	d.mu.Unlock()
	if err != nil {
		return 0, err
	}
	pause := m.Launch
	if first {
		pause += m.Warmup
	}
	if err := d.run(c, b, pause, ctx.Done()); err != nil {
		if err == errCanceled {
			return 0, ctx.Err()
		}
		return 0, err
	}
	return time.Since(start), nil
}

// Hang makes the client hang: its executions, running and future, hold
// their SMs and never end (a kernel in an endless loop).
func (c *Client) Hang() {
	d := c.d
	d.mu.Lock()
	defer d.mu.Unlock()
	c.hung = true
	d.advanceLocked(time.Now())
	for _, j := range d.jobs {
		if j.c == c {
			j.work = inf
		}
	}
	d.rescheduleLocked()
}

// Fault raises a fatal fault in the client: see Device.Fault.
func (c *Client) Fault(cause string) { c.d.Fault(c, cause) }

// Close ends the client (its process exits): executions in flight fail with
// ErrClientClosed and its memory is freed.
func (c *Client) Close() {
	d := c.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if c.closed {
		return
	}
	c.closed = true
	d.advanceLocked(time.Now())
	kept := d.jobs[:0]
	for _, j := range d.jobs {
		if j.c != c {
			kept = append(kept, j)
			continue
		}
		j.done <- ErrClientClosed
	}
	clear(d.jobs[len(kept):])
	d.jobs = kept
	delete(d.clients, c)
	c.endLocked(nil)
	d.rescheduleLocked()
}

// endLocked frees the client's memory and tells Done's readers, once; err
// is why it is gone when that is not Close.
func (c *Client) endLocked(err error) {
	if err != nil && c.dead == nil {
		c.dead = err
	}
	c.mem = 0
	select {
	case <-c.gone:
	default:
		close(c.gone)
	}
}

// Done is closed when the client is gone: closed, or taken down by a fault
// on its device (Err says which), as a process's exit is seen by its
// parent.
func (c *Client) Done() <-chan struct{} { return c.gone }
