package limiter

import (
	"errors"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"

	"github.com/sloserve/sloserve/runtime"
)

func TestThreadsFor(t *testing.T) {
	for _, tc := range []struct {
		name    string
		share   Share
		cpus    int
		threads int
	}{
		{"no limit", Share{}, 2, 2},
		{"whole device", Share{Compute: 1}, 8, 8},
		{"more than the device", Share{Compute: 1.5}, 4, 4},
		{"half a core of two", Share{Compute: 0.25}, 2, 1},
		{"one core of two", Share{Compute: 0.5}, 2, 1},
		{"just over one core", Share{Compute: 0.5001}, 2, 2},
		{"2.4 cores of 8", Share{Compute: 0.3}, 8, 3},
		{"tiny", Share{Compute: 0.001}, 8, 1},
		{"almost all", Share{Compute: 0.999}, 4, 4},
		{"no CPUs reported", Share{Compute: 0.5}, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := ThreadsFor(tc.share, tc.cpus); got != tc.threads {
				t.Errorf("ThreadsFor(%v, %d) = %d, want %d", tc.share.Compute, tc.cpus, got, tc.threads)
			}
		})
	}
}

func TestUnitName(t *testing.T) {
	seen := map[string]string{}
	for _, id := range []string{"plain-1.x_2", "ocr-det/1#0", "ocr-det_1_0", "..", ".hidden", "cgroup.procs", "sloserve-12", strings.Repeat("a", 300), "ü"} {
		name, err := unitName(id)
		if err != nil {
			t.Fatalf("unitName(%q): %v", id, err)
		}
		if len(name) > 80 || strings.ContainsAny(name, "/#\x00") || strings.HasPrefix(name, ".") ||
			strings.HasPrefix(name, "cgroup.") || strings.HasPrefix(name, "sloserve-") {
			t.Errorf("unitName(%q) = %q is not a safe unit directory name", id, name)
		}
		if other, ok := seen[name]; ok {
			t.Errorf("ids %q and %q share the directory %q", id, other, name)
		}
		seen[name] = id
	}
	if name, _ := unitName("plain-1.x_2"); name != "plain-1.x_2" {
		t.Errorf("a safe id became %q", name)
	}
	if _, err := unitName(""); err == nil {
		t.Error("empty id accepted")
	}
}

func TestNewOptions(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts Options
		want string // error substring
	}{
		{"unknown backend", Options{Backend: "quota"}, `unknown backend "quota"`},
		{"bad device", Options{Device: "gpu0"}, `device "gpu0"`},
		{"bad cuda index", Options{Device: "cuda:x"}, "cuda:N"},
		{"mps on cpu", Options{Backend: BackendMPS}, "needs a cuda:N device"},
		{"cgroup on gpu", Options{Backend: BackendCgroup, Device: "cuda:0"}, "needs mps or none"},
		{"period too long", Options{Period: 2e9}, "outside 1ms..1s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.opts.Logger = testLogger(t)
			if l, err := New(tc.opts); err == nil || !strings.Contains(err.Error(), tc.want) {
				if l != nil {
					l.Close()
				}
				t.Errorf("New(%+v) = %v, want an error with %q", tc.opts, err, tc.want)
			}
		})
	}
}

func TestNone(t *testing.T) {
	f := newFakeV1(t)
	l, err := newLimiter(Options{Backend: BackendNone, Logger: testLogger(t)}, f.env())
	if err != nil {
		t.Fatal(err)
	}
	if l.Kind() != KindNone || l.CPUs() != 4 || l.Describe() != "none: backend none requested; compute shares set intra-op threads of 4 CPUs only" {
		t.Errorf("kind %s, %d CPUs, %q", l.Kind(), l.CPUs(), l.Describe())
	}
	pl, err := l.Place("a", Share{Compute: 0.25, Memory: 1 << 20})
	if err != nil || pl.IntraOpThreads != 1 || pl.JoinCgroups != nil || pl.Env != nil || pl.GPUMemLimit != 0 {
		t.Errorf("Place = %+v, %v; want only 1 intra-op thread", pl, err)
	}
	if pl, _ := l.Place("b", Share{}); pl.IntraOpThreads != 4 {
		t.Errorf("unlimited placement has %d threads, want 4", pl.IntraOpThreads)
	}
	if err := l.Resize("a", Share{Compute: 0.75}); err != nil {
		t.Errorf("Resize = %v", err)
	}
	if st, err := l.Stats("a"); err != nil || st != (Stats{}) {
		t.Errorf("Stats = %+v, %v; want zeros", st, err)
	}
	if err := l.Release("a"); err != nil {
		t.Error(err)
	}
	for _, err := range []error{l.Release("a"), l.Resize("a", Share{})} {
		if !errors.Is(err, ErrUnknownInstance) {
			t.Errorf("after Release: %v, want ErrUnknownInstance", err)
		}
	}
	if err := l.Close(); err != nil {
		t.Error(err)
	}
}

func TestMPS(t *testing.T) {
	server := dgxa100.New()
	dev1 := server.Devices[1].(*dgxa100.Device)
	dev1.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
		return []nvml.ProcessInfo{{Pid: 4100, UsedGpuMemory: 700 << 20}, {Pid: 4200, UsedGpuMemory: 3 << 30}}, nvml.SUCCESS
	}
	tel, err := newNVMLTelemetry(server, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer tel.Close()

	l, err := New(Options{Device: "cuda:1", Telemetry: tel, Logger: testLogger(t), MPSDaemon: func(int) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if l.Kind() != KindMPS || l.CPUs() != 1 || !strings.Contains(l.Describe(), "cuda:1") {
		t.Errorf("kind %s, %d CPUs, %q", l.Kind(), l.CPUs(), l.Describe())
	}
	// The arena (gpu_mem_limit) is the pinned limit less the context and
	// the workspaces (G4 of issue 18: it used to be the whole limit).
	overhead := int64(MPSContextReserve + MPSWorkspaceReserve)
	for _, tc := range []struct {
		name  string
		share Share
		env   []string
		arena int64
	}{
		{"share and memory", Share{Compute: 0.3, Memory: 1536 << 20}, []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=1536M", "CUDA_MPS_CLIENT_PRIORITY=0"}, 1536<<20 - overhead},
		{"rounds up to a MiB", Share{Compute: 0.666, Memory: 1<<30 + 1}, []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=67", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=1025M", "CUDA_MPS_CLIENT_PRIORITY=0"}, 1<<30 + 1 - overhead},
		{"at least one percent", Share{Compute: 0.001}, []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1", "CUDA_MPS_CLIENT_PRIORITY=0"}, 0},
		{"no limit", Share{}, []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100", "CUDA_MPS_CLIENT_PRIORITY=0"}, 0},
		{"whole GPU", Share{Compute: 1}, []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100", "CUDA_MPS_CLIENT_PRIORITY=0"}, 0},
		// Best-effort work below normal priority, with a cap that lets it
		// fill the device; a floor is a normal client at its cap.
		{"background", Share{Compute: 1, Memory: 1536 << 20, Mode: ModeBackground}, []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=1536M", "CUDA_MPS_CLIENT_PRIORITY=1"}, 1536<<20 - overhead},
		{"floor", Share{Compute: 0.3, Mode: ModeFloor}, []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30", "CUDA_MPS_CLIENT_PRIORITY=0"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pl, err := l.Place(tc.name, tc.share)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(pl.Env, tc.env) || pl.GPUMemLimit != tc.arena || pl.CudnnConvAlgoSearch != "" ||
				pl.ArenaExtendStrategy != runtime.ArenaSameAsRequested || pl.IntraOpThreads != 0 || pl.JoinCgroups != nil {
				t.Errorf("placement %+v, want env %q and gpu_mem_limit %d", pl, tc.env, tc.arena)
			}
			// The arena strategy is one the runner's provider options accept.
			if err := (runtime.ProviderOptions{Kind: runtime.ProviderCUDA, GPUMemLimit: pl.GPUMemLimit, ArenaExtendStrategy: pl.ArenaExtendStrategy}).Validate(); err != nil {
				t.Error(err)
			}
		})
	}

	id := "share and memory"
	if err := l.Resize(id, Share{Compute: 0.3, Memory: 1536 << 20}); err != nil {
		t.Errorf("Resize to the same share = %v, want nil", err)
	}
	if err := l.Resize(id, Share{Compute: 0.5, Memory: 1536 << 20}); !errors.Is(err, ErrRestartRequired) {
		t.Errorf("Resize to a new share = %v, want ErrRestartRequired", err)
	}
	st, err := l.Stats(id)
	if err != nil || st != (Stats{MemoryLimit: 1536 << 20}) {
		t.Errorf("Stats before Track = %+v, %v", st, err)
	}
	if err := l.(ProcessTracker).Track(id, 4200); err != nil {
		t.Fatal(err)
	}
	if st, err := l.Stats(id); err != nil || st.MemoryBytes != 3<<30 || st.MemoryLimit != 1536<<20 {
		t.Errorf("Stats = %+v, %v; want 3 GiB used of a 1.5 GiB limit (from the mock)", st, err)
	}
	if err := l.Release(id); err != nil {
		t.Error(err)
	}
	if _, err := l.Stats(id); !errors.Is(err, ErrUnknownInstance) {
		t.Errorf("Stats after Release = %v", err)
	}
}

// The mps backend refuses a GPU whose shares nothing would enforce, with
// an error that says why and what to do (G5 of issue 18: before, it
// placed runners whose percentages CUDA silently ignored).
func TestMPSRefusesWhatItCannotEnforce(t *testing.T) {
	running := func(int) error { return nil }
	stopped := func(int) error { return errors.New("no control pipe") }
	withMode := func(mig bool, mode nvml.ComputeMode) Telemetry {
		server := dgxa100.New()
		for _, d := range server.Devices {
			d := d.(*dgxa100.Device)
			if mig {
				d.MigMode = nvml.DEVICE_MIG_ENABLE
			}
			d.GetComputeModeFunc = func() (nvml.ComputeMode, nvml.Return) { return mode, nvml.SUCCESS }
		}
		tel, err := newNVMLTelemetry(server, testLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tel.Close() })
		return tel
	}
	for _, tc := range []struct {
		name   string
		device string
		tel    Telemetry
		daemon func(int) error
		want   string // "" = accepted
	}{
		{"no driver", "cuda:0", nullTelemetry{}, running, "no GPU found"},
		{"no daemon", "cuda:0", withMode(false, nvml.COMPUTEMODE_DEFAULT), stopped, "no MPS control daemon: no control pipe; start one (nvidia-cuda-mps-control -d)"},
		{"MIG", "cuda:1", withMode(true, nvml.COMPUTEMODE_DEFAULT), running, "cuda:1 is in MIG mode"},
		{"prohibited", "cuda:2", withMode(false, nvml.COMPUTEMODE_PROHIBITED), running, "compute mode prohibited"},
		{"no such GPU", "cuda:8", withMode(false, nvml.COMPUTEMODE_DEFAULT), running, "the machine has 8 GPU(s)"},
		{"exclusive process and a daemon", "cuda:3", withMode(false, nvml.COMPUTEMODE_EXCLUSIVE_PROCESS), running, ""},
		{"default mode and a daemon", "cuda:0", withMode(false, nvml.COMPUTEMODE_DEFAULT), running, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := New(Options{Device: tc.device, Telemetry: tc.tel, MPSDaemon: tc.daemon, Logger: testLogger(t)})
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				l.Close()
				return
			}
			if !errors.Is(err, ErrMPSUnavailable) || !strings.Contains(err.Error(), tc.want) || l != nil {
				t.Fatalf("New = %v, %v; want ErrMPSUnavailable saying %q", l, err, tc.want)
			}
			if !strings.Contains(err.Error(), "control.limiter: none") {
				t.Errorf("%v does not say how to run without shares", err)
			}
		})
	}
}

// G4 of issue 18: a memory share too small for a context is refused; a
// shadow (a second unit of one instance, during a swap) searches cuDNN's
// algorithms by heuristic and its memory must fit beside the runner it
// replaces, or the swap is refused; the provider options it produces are
// what ONNX Runtime's CUDA provider parses.
func TestMPSMemoryAndShadows(t *testing.T) {
	server := dgxa100.New() // 40 GiB devices
	tel, err := newNVMLTelemetry(server, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer tel.Close()
	l, err := New(Options{Device: "cuda:0", Telemetry: tel, Logger: testLogger(t), MPSDaemon: func(int) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := l.Place("tiny-1-0-1", Share{Compute: 0.5, Memory: 256 << 20}); !errors.Is(err, ErrMemoryShareTooSmall) {
		t.Errorf("a 256 MiB share: %v, want ErrMemoryShareTooSmall", err)
	}
	first, err := l.Place("bert-1-0-1", Share{Compute: 0.5, Memory: 16 << 30})
	if err != nil || first.CudnnConvAlgoSearch != "" {
		t.Fatalf("first runner %+v, %v: want the configured cuDNN search", first, err)
	}
	if _, err := l.Place("other-1-0-2", Share{Compute: 0.25, Memory: 8 << 30}); err != nil {
		t.Fatal(err)
	}
	// A swap of bert to 20 GiB would pin 44 GiB of 40 while the old
	// runner serves: refused.
	if _, err := l.Place("bert-1-0-3", Share{Compute: 0.75, Memory: 20 << 30}); !errors.Is(err, ErrDeviceMemoryFull) || !strings.Contains(err.Error(), "24576 MiB pinned") {
		t.Errorf("an oversized shadow: %v, want ErrDeviceMemoryFull naming 24576 MiB pinned", err)
	}
	shadow, err := l.Place("bert-1-0-3", Share{Compute: 0.75, Memory: 12 << 30})
	if err != nil {
		t.Fatal(err)
	}
	if shadow.CudnnConvAlgoSearch != runtime.ConvAlgoHeuristic || shadow.GPUMemLimit != 12<<30-MPSContextReserve-MPSWorkspaceReserve {
		t.Errorf("shadow placement %+v: want heuristic search and the arena below the pinned limit", shadow)
	}
	opts, err := runtime.ProviderOptions{Kind: runtime.ProviderCUDA, GPUMemLimit: shadow.GPUMemLimit,
		ArenaExtendStrategy: shadow.ArenaExtendStrategy, CudnnConvAlgoSearch: shadow.CudnnConvAlgoSearch}.CUDAOptions()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"device_id": "0", "arena_extend_strategy": "kSameAsRequested", "cudnn_conv_algo_search": "HEURISTIC",
		"gpu_mem_limit": strconv.FormatInt(12<<30-MPSContextReserve-MPSWorkspaceReserve, 10)}
	if !maps.Equal(opts, want) {
		t.Errorf("CUDA options %v, want %v", opts, want)
	}
	// Once the old runner is gone the next swap is not a shadow of it.
	if err := l.Release("bert-1-0-1"); err != nil {
		t.Fatal(err)
	}
	if err := l.Release("bert-1-0-3"); err != nil {
		t.Fatal(err)
	}
	if pl, err := l.Place("bert-1-0-4", Share{Compute: 0.75, Memory: 20 << 30}); err != nil || pl.CudnnConvAlgoSearch != "" {
		t.Errorf("a runner with no other of its instance: %+v, %v", pl, err)
	}
}

// A runner whose pid NVML does not list (another pid namespace, as in a
// container) has unknown device memory, never another process's.
func TestMPSStatsWhenPIDsDoNotMatch(t *testing.T) {
	server := dgxa100.New()
	dev := server.Devices[0].(*dgxa100.Device)
	dev.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
		return []nvml.ProcessInfo{{Pid: 90001, UsedGpuMemory: 5 << 30}}, nvml.SUCCESS
	}
	tel, err := newNVMLTelemetry(server, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer tel.Close()
	l, err := New(Options{Device: "cuda:0", Telemetry: tel, Logger: testLogger(t), MPSDaemon: func(int) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := l.Place("m-1-0-1", Share{Compute: 0.5, Memory: 8 << 30}); err != nil {
		t.Fatal(err)
	}
	if err := l.(ProcessTracker).Track("m-1-0-1", 17); err != nil { // the pid in the runner's namespace
		t.Fatal(err)
	}
	for range 2 {
		if st, err := l.Stats("m-1-0-1"); err != nil || st.MemoryBytes != 0 || st.MemoryLimit != 8<<30 {
			t.Errorf("Stats = %+v, %v; want memory unknown (0) of an 8 GiB limit", st, err)
		}
	}
}
