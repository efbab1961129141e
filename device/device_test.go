package device

import (
	"context"
	"errors"
	"fmt"
	"math"
	goruntime "runtime"
	"testing"

	"github.com/sloserve/sloserve/control"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/simgpu"
)

// capsLimiter is a limiter that only says what it can do.
type capsLimiter struct {
	limiter.Limiter
	caps limiter.Capabilities
}

func (l capsLimiter) Capabilities() limiter.Capabilities { return l.caps }

// A device's slots come from what its limiter can run at once, not from
// its kind: a CPU takes qos.device_slots or a slot per core, a GPU the
// clients its limiter runs at once, or those of a running simulated MPS
// daemon, else one.
func TestSlots(t *testing.T) {
	sim, err := simgpu.New(simgpu.Spec{Devices: 1, SMs: 108, Memory: 40 << 30})
	if err != nil {
		t.Fatal(err)
	}
	noDaemon, err := simgpu.New(simgpu.Spec{Devices: 1, SMs: 108, Memory: 40 << 30, NoDaemon: true})
	if err != nil {
		t.Fatal(err)
	}
	none := capsLimiter{}
	clients := capsLimiter{caps: limiter.Capabilities{Enforces: true, CapsOnly: true, Clients: 7}}
	for _, tc := range []struct {
		name       string
		device     string
		configured int
		lim        limiter.Limiter
		sim        *simgpu.Sim
		want       int
	}{
		{"cpu, configured", "cpu", 3, none, nil, 3},
		{"cpu, one per core", "cpu", 0, clients, nil, goruntime.NumCPU()},
		{"gpu, the limiter's clients", "cuda:0", 0, clients, nil, 7},
		{"gpu, no limiter, simulated daemon", "cuda:0", 0, none, sim, limiter.MPSClients},
		{"gpu, no limiter, no daemon", "cuda:0", 0, none, noDaemon, 1},
		{"gpu, no limiter, real", "cuda:0", 0, none, nil, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Slots(tc.device, tc.configured, tc.lim, tc.sim); got != tc.want {
				t.Errorf("Slots = %d, want %d", got, tc.want)
			}
		})
	}
}

// Best-effort work runs behind latency-critical work only under the
// adaptive policy and where the limiter has a background class.
func TestBackgroundsBestEffort(t *testing.T) {
	bg := capsLimiter{caps: limiter.Capabilities{Enforces: true, Background: true}}
	caps := capsLimiter{caps: limiter.Capabilities{Enforces: true, CapsOnly: true}}
	for _, tc := range []struct {
		policy string
		lim    limiter.Limiter
		want   bool
	}{
		{control.SharePolicyAdaptive, bg, true},
		{control.SharePolicyStatic, bg, false},
		{control.SharePolicyAdaptive, caps, false},
	} {
		if got := backgroundsBestEffort(tc.policy, tc.lim); got != tc.want {
			t.Errorf("%s, %+v: %v, want %v", tc.policy, tc.lim.Capabilities(), got, tc.want)
		}
	}
}

// The usage board smooths each period's sample and forgets models that
// were not seen.
func TestUsageBoard(t *testing.T) {
	var b usageBoard
	b.record(map[string]float64{"a/1": 0.5, "b/1": 0.2})
	b.record(map[string]float64{"a/1": 1.5})
	if u, ok := b.get("a/1"); !ok || math.Abs(u-(0.5+usageWeight*1.0)) > 1e-9 {
		t.Errorf("a/1: %v %v, want %v", u, ok, 0.5+usageWeight)
	}
	if _, ok := b.get("b/1"); ok {
		t.Error("b/1 was not seen in the last period but is still on the board")
	}
}

// fakeModels is the models on a device as the actuator reaches them.
type fakeModels struct {
	Models
	device string // where every version runs
	moving bool   // SetShare and RequestShare answer models.ErrMoving
	set    []string
}

func (m *fakeModels) VersionKey(name, ver string) (string, string, error) {
	return name + "/" + ver, m.device, nil
}

func (m *fakeModels) SetShare(ctx context.Context, key string, s limiter.Share) error {
	if m.moving {
		return fmt.Errorf("resizing %s: %w", key, models.ErrMoving)
	}
	m.set = append(m.set, key)
	return nil
}

func (m *fakeModels) RequestShare(key string, s limiter.Share) error {
	return m.SetShare(context.Background(), key, s)
}

func (m *fakeModels) Evict(ctx context.Context, key string) error {
	m.set = append(m.set, "evict "+key)
	return nil
}

func (m *fakeModels) MemoryUsage(key string) int64    { return 100 }
func (m *fakeModels) InstanceMemory(key string) int64 { return 10 }

// The actuator acts on the versions on its device only: one that moved
// away, or is moving, is control.ErrElsewhere to the adjuster, and reads
// no memory.
func TestActuatorActsOnItsDeviceOnly(t *testing.T) {
	here := &fakeModels{device: "cuda:0"}
	a := actuator{models: here, device: "cuda:0"}
	if err := a.SetShare(t.Context(), "m/1", limiter.Share{Compute: 0.5}); err != nil {
		t.Fatal(err)
	}
	if err := a.Evict(t.Context(), "m/1"); err != nil {
		t.Fatal(err)
	}
	if a.MemoryUsage("m/1") != 100 || a.InstanceMemory("m/1") != 10 {
		t.Error("memory of a version on the device not read")
	}

	away := &fakeModels{device: "cuda:1"}
	a = actuator{models: away, device: "cuda:0"}
	for name, err := range map[string]error{
		"SetShare":     a.SetShare(t.Context(), "m/1", limiter.Share{Compute: 0.5}),
		"RequestShare": a.RequestShare("m/1", limiter.Share{Compute: 0.5}),
		"Evict":        a.Evict(t.Context(), "m/1"),
	} {
		if !errors.Is(err, control.ErrElsewhere) {
			t.Errorf("%s of a version on another device: %v, want ErrElsewhere", name, err)
		}
	}
	if len(away.set) != 0 || a.MemoryUsage("m/1") != 0 || a.InstanceMemory("m/1") != 0 {
		t.Errorf("acted on a version on another device: %v", away.set)
	}

	moving := &fakeModels{device: "cuda:0", moving: true}
	a = actuator{models: moving, device: "cuda:0"}
	if err := a.RequestShare("m/1", limiter.Share{Compute: 0.5}); !errors.Is(err, control.ErrElsewhere) || !errors.Is(err, models.ErrMoving) {
		t.Errorf("resizing a moving version: %v, want ErrElsewhere wrapping ErrMoving", err)
	}
}
