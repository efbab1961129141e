package limiter

import (
	"errors"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
)

// Each backend says what it can do, and the optional capabilities
// (ProcessTracker, UsageReader, DaemonRestarter) are found by asking for
// them: the callers that adapt to a backend read these, never Kind.
func TestCapabilities(t *testing.T) {
	tel, err := newNVMLTelemetry(dgxa100.New(), testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer tel.Close()
	for _, tc := range []struct {
		name string
		open func(t *testing.T) (Limiter, error)
		want Capabilities
		// The optional capabilities it has.
		tracker, usage, daemon bool
	}{
		{
			name: "none",
			open: func(t *testing.T) (Limiter, error) {
				f := newFakeV1(t)
				return newLimiter(Options{Backend: BackendNone, Logger: testLogger(t)}, f.env())
			},
			want: Capabilities{},
		},
		{
			name: "none on a GPU",
			open: func(t *testing.T) (Limiter, error) {
				f := newFakeV1(t)
				return newLimiter(Options{Backend: BackendNone, Device: "cuda:0", Logger: testLogger(t)}, f.env())
			},
			want: Capabilities{},
		},
		{
			name: "cgroup v1",
			open: func(t *testing.T) (Limiter, error) {
				f := newFakeV1(t)
				return newLimiter(Options{Backend: BackendCgroup, Root: f.root, Logger: testLogger(t)}, f.env())
			},
			want: Capabilities{Enforces: true, Background: true, Metering: MeterCPUTime},
		},
		{
			name: "cgroup v2",
			open: func(t *testing.T) (Limiter, error) {
				f := newFakeV2(t)
				return newLimiter(Options{Backend: BackendAuto, Root: f.root, Logger: testLogger(t)}, f.env())
			},
			want: Capabilities{Enforces: true, Background: true, Metering: MeterCPUTime},
		},
		{
			name: "mps",
			open: func(t *testing.T) (Limiter, error) {
				return New(Options{Device: "cuda:1", Telemetry: tel, Logger: testLogger(t), MPSDaemon: func(int) error { return nil }})
			},
			want:    Capabilities{Enforces: true, CapsOnly: true, Background: true, MinMemory: MPSMinMemory, Clients: MPSClients, Metering: MeterDeviceTime},
			tracker: true, usage: true, daemon: true,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := tc.open(t)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			if got := l.Capabilities(); got != tc.want {
				t.Errorf("%s: capabilities %+v, want %+v", l.Kind(), got, tc.want)
			}
			if _, ok := l.(ProcessTracker); ok != tc.tracker {
				t.Errorf("%s: ProcessTracker %v, want %v", l.Kind(), ok, tc.tracker)
			}
			if _, ok := l.(UsageReader); ok != tc.usage {
				t.Errorf("%s: UsageReader %v, want %v", l.Kind(), ok, tc.usage)
			}
			if _, ok := l.(DaemonRestarter); ok != tc.daemon {
				t.Errorf("%s: DaemonRestarter %v, want %v", l.Kind(), ok, tc.daemon)
			}
		})
	}
}

// A unit's least memory share is the backend's floor: under MPS the
// context, workspaces and least arena, which Place refuses to go below.
func TestMinMemoryIsEnforced(t *testing.T) {
	tel, err := newNVMLTelemetry(dgxa100.New(), testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer tel.Close()
	l, err := New(Options{Device: "cuda:1", Telemetry: tel, Logger: testLogger(t), MPSDaemon: func(int) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	least := l.Capabilities().MinMemory
	if _, err := l.Place("below", Share{Compute: 0.5, Memory: least - 1}); !errors.Is(err, ErrMemoryShareTooSmall) {
		t.Errorf("a memory share of %d, 1 byte under the least %d: %v, want ErrMemoryShareTooSmall", least-1, least, err)
	}
	if _, err := l.Place("at", Share{Compute: 0.5, Memory: least}); err != nil {
		t.Errorf("a memory share at the least %d: %v", least, err)
	}
}
