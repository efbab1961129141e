package runtime

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/simgpu"
)

// ReadSignature reads what ONNX Runtime reads.
func TestReadSignatureMatchesONNXRuntime(t *testing.T) {
	for _, name := range []string{"example_several_inputs_and_outputs.onnx", "example_dynamic_axes.onnx", "example_multitype.onnx"} {
		t.Run(name, func(t *testing.T) {
			path := testModel(t, name)
			ins, outs, err := ReadSignature(path)
			if err != nil {
				t.Fatal(err)
			}
			r := startTestRunner(t, testRunnerConfig(t, path))
			if !reflect.DeepEqual(ins, r.Inputs()) || !reflect.DeepEqual(outs, r.Outputs()) {
				t.Errorf("ReadSignature: %+v -> %+v\nONNX Runtime: %+v -> %+v", ins, outs, r.Inputs(), r.Outputs())
			}
		})
	}
	bad := filepath.Join(t.TempDir(), "bad.onnx")
	os.WriteFile(bad, []byte("not a model at all"), 0o600)
	if _, _, err := ReadSignature(bad); !errors.Is(err, ErrModelLoad) {
		t.Errorf("a text file: %v, want ErrModelLoad", err)
	}
}

func TestSimulatedInstance(t *testing.T) {
	path := testModel(t, "example_dynamic_axes.onnx")
	synctest.Test(t, func(t *testing.T) {
		sim, err := simgpu.New(simgpu.Spec{Devices: 1, SMs: 100, Memory: 8 << 30})
		if err != nil {
			t.Fatal(err)
		}
		m := simgpu.Presets["resnet50"]
		var exits []Exit
		s, err := StartSimulated(t.Context(), SimulatedConfig{
			Name: "dyn", ModelPath: path, Device: sim.Devices()[0], Model: m, Batched: true,
			Env:    []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1024M"},
			OnExit: func(e Exit) { exits = append(exits, e) }, Logger: testLogger(t),
		})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Stop(t.Context())
		in := s.Inputs()[0]
		req := &InferRequest{Inputs: []Tensor{{Name: in.Name, DataType: in.DataType, Shape: []int64{4, 10}, Data: make([]byte, 4*10*in.DataType.Size())}}}
		if _, err := s.Infer(t.Context(), req); err != nil { // warm-up
			t.Fatal(err)
		}
		resp, err := s.Infer(t.Context(), req)
		if err != nil {
			t.Fatal(err)
		}
		if want, d := m.Time(4, 0.2), resp.Timing.Infer; d < want-time.Microsecond || d > want+time.Microsecond {
			t.Errorf("took %v, want the curve's %v at 20%%", resp.Timing.Infer, want)
		}
		out := resp.Outputs[0]
		if len(resp.Outputs) != len(s.Outputs()) || out.Shape[0] != 4 || int64(len(out.Data)) != out.DataType.ByteSize(elements(out.Shape)) {
			t.Errorf("outputs %+v", resp.Outputs)
		}
		if _, err := s.Infer(t.Context(), &InferRequest{Inputs: []Tensor{{Name: "nope", DataType: in.DataType, Shape: []int64{1, 10}}}}); !errors.Is(err, ErrInvalidTensor) {
			t.Errorf("unknown input: %v", err)
		}
		// A batch whose arena passes the 1 GiB pinned limit.
		big := &InferRequest{Inputs: []Tensor{{Name: in.Name, DataType: in.DataType, Shape: []int64{40, 10}, Data: make([]byte, 40*10*in.DataType.Size())}}}
		if _, err := s.Infer(t.Context(), big); !errors.Is(err, ErrInference) || !errors.Is(err, simgpu.ErrOutOfMemory) {
			t.Errorf("batch over the pinned limit: %v", err)
		}
		dev := sim.Devices()[0]
		dev.Fault(nil, "an uncorrectable ECC error")
		if _, err := s.Infer(t.Context(), req); !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "fatal fault") {
			t.Errorf("after a device fault: %v", err)
		}
		synctest.Wait() // the client's end reaches OnExit
		if ready, why := s.Status(); ready || !strings.Contains(why, "fatal fault") || len(exits) != 1 || !s.Gone() || s.Failed() != 1 {
			t.Errorf("status %v %q, exits %v, gone %v, failed %d", ready, why, exits, s.Gone(), s.Failed())
		}
		// Before the daemon is back a new client cannot start; after, it
		// does and serves.
		if err := s.Recover(t.Context(), nil, "test"); !errors.Is(err, simgpu.ErrDaemonDown) {
			t.Errorf("recover before the daemon restarts: %v", err)
		}
		if ready, why := s.Status(); ready || !strings.Contains(why, "restarting its simulated client failed") {
			t.Errorf("status after a failed recovery: %v %q", ready, why)
		}
		dev.RestartDaemon()
		if err := s.Recover(t.Context(), nil, "test"); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Infer(t.Context(), req); err != nil {
			t.Errorf("after recovery: %v", err)
		}
		if len(exits) != 1 {
			t.Errorf("exits %v: a recovery is no exit", exits)
		}
	})
}

// A hung client is found by Suspect's probe and replaced, and the other
// client on the device keeps serving.
func TestSimulatedHungClientIsReplaced(t *testing.T) {
	path := testModel(t, "example_dynamic_axes.onnx")
	synctest.Test(t, func(t *testing.T) {
		sim, err := simgpu.New(simgpu.Spec{Devices: 1, SMs: 100, Memory: 8 << 30})
		if err != nil {
			t.Fatal(err)
		}
		dev := sim.Devices()[0]
		var mu sync.Mutex             // the restarts are appended by the instances' goroutines
		readied := map[string][]int{} // the pids each instance's Restarting hook was told, once ready
		start := func(name string, restarts *[]string) *Simulated {
			s, err := StartSimulated(t.Context(), SimulatedConfig{
				Name: name, ModelPath: path, Device: dev, Model: simgpu.Presets["mobilenet"], Batched: true,
				OnRestart: func(r string) {
					mu.Lock()
					defer mu.Unlock()
					*restarts = append(*restarts, r)
				},
				Restarting: func() func(int) error {
					return func(pid int) error {
						mu.Lock()
						defer mu.Unlock()
						readied[name] = append(readied[name], pid)
						return nil
					}
				},
				Logger: testLogger(t),
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Stop(context.Background()) })
			return s
		}
		var restarts, others []string
		s, other := start("hangs", &restarts), start("other", &others)
		read := func(l *[]string) []string {
			mu.Lock()
			defer mu.Unlock()
			return slices.Clone(*l)
		}
		in := s.Inputs()[0]
		req := &InferRequest{Inputs: []Tensor{{Name: in.Name, DataType: in.DataType, Shape: []int64{1, 10}, Data: make([]byte, 10*in.DataType.Size())}}}
		old := s.Pid()
		// A slow answer is no hang: the probe answers, the client stays.
		s.Suspect("a test")
		time.Sleep(time.Second) // the probe: a warm-up and one execution
		if ready, _ := s.Status(); !ready || s.Pid() != old || len(read(&restarts)) != 0 {
			t.Fatalf("after a probe that answered: ready %v, pid %d (was %d), restarts %v", ready, s.Pid(), old, read(&restarts))
		}
		s.client.Load().Hang()
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		_, err = s.Infer(ctx, req)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("a call on the hung client: %v, want its deadline", err)
		}
		s.Suspect("a call got no answer")
		if ready, why := s.Status(); ready || !strings.Contains(why, "checking") {
			t.Errorf("while checked: %v %q", ready, why)
		}
		if _, err := s.Infer(t.Context(), req); !errors.Is(err, ErrUnavailable) {
			t.Errorf("a call while checked: %v, want ErrUnavailable at once", err)
		}
		time.Sleep(DefaultProbeTimeout + simgpu.ContextCreate + time.Second)
		if ready, why := s.Status(); !ready || s.Pid() == old || len(read(&restarts)) != 1 || !strings.Contains(read(&restarts)[0], "hung") {
			t.Fatalf("after the probe: %v %q, pid %d (was %d), restarts %v", ready, why, s.Pid(), old, read(&restarts))
		}
		if _, err := s.Infer(t.Context(), req); err != nil {
			t.Errorf("the new client: %v", err)
		}
		mu.Lock()
		if got := readied["hangs"]; len(got) != 1 || got[0] != s.Pid() || len(readied["other"]) != 0 {
			t.Errorf("Restarting's ready was told %v (the other instance %v), want once, the new client's pid %d", got, readied["other"], s.Pid())
		}
		mu.Unlock()
		if _, err := other.Infer(t.Context(), req); err != nil || len(read(&others)) != 0 || dev.Faulted() != nil {
			t.Errorf("the other client: %v, restarts %v, device fault %v", err, read(&others), dev.Faulted())
		}
	})
}

func elements(shape []int64) int64 {
	n := int64(1)
	for _, d := range shape {
		n *= d
	}
	return n
}

func TestMPSLimits(t *testing.T) {
	for _, tc := range []struct {
		env    []string
		pct    int
		pinned int64
		bad    bool
	}{
		{nil, 0, 0, false},
		{[]string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=35", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=2G,0=512M"}, 35, 512 << 20, false},
		{[]string{"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=2G"}, 0, 0, false},
		{[]string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=0"}, 0, 0, true},
		{[]string{"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=lots"}, 0, 0, true},
	} {
		pct, pinned, err := mpsLimits(tc.env, 0)
		if (err != nil) != tc.bad || pct != tc.pct || pinned != tc.pinned {
			t.Errorf("mpsLimits(%q) = %d, %d, %v", tc.env, pct, pinned, err)
		}
	}
}

// The limiter's placement for a background share starts the simulated
// client below normal priority, as a real client reads
// CUDA_MPS_CLIENT_PRIORITY at context creation; a bad value does not start.
func TestSimulatedInstancePriority(t *testing.T) {
	path := testModel(t, "example_dynamic_axes.onnx")
	synctest.Test(t, func(t *testing.T) {
		sim, err := simgpu.New(simgpu.Spec{Devices: 1, SMs: 100, Memory: 8 << 30})
		if err != nil {
			t.Fatal(err)
		}
		for _, tc := range []struct {
			env  string
			want simgpu.Priority
			bad  bool
		}{
			{"CUDA_MPS_CLIENT_PRIORITY=1", simgpu.PriorityBelowNormal, false},
			{"CUDA_MPS_CLIENT_PRIORITY=0", simgpu.PriorityNormal, false},
			{"CUDA_MPS_CLIENT_PRIORITY=low", 0, true},
		} {
			s, err := StartSimulated(t.Context(), SimulatedConfig{
				Name: "p", ModelPath: path, Device: sim.Devices()[0], Model: simgpu.Presets["resnet50"], Batched: true,
				Env: []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100", tc.env}, Logger: testLogger(t),
			})
			if tc.bad {
				if err == nil {
					s.Stop(t.Context())
					t.Errorf("%s: started", tc.env)
				}
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := s.Client().Spec().Priority; got != tc.want {
				t.Errorf("%s: client priority %v, want %v", tc.env, got, tc.want)
			}
			s.Stop(t.Context())
		}
	})
}

func TestMPSPriority(t *testing.T) {
	for _, tc := range []struct {
		env  []string
		want simgpu.Priority
		bad  bool
	}{
		{nil, simgpu.PriorityNormal, false},
		{[]string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100", "CUDA_MPS_CLIENT_PRIORITY=1"}, simgpu.PriorityBelowNormal, false},
		{[]string{"CUDA_MPS_CLIENT_PRIORITY=0"}, simgpu.PriorityNormal, false},
		{[]string{"CUDA_MPS_CLIENT_PRIORITY=2"}, 0, true},
	} {
		got, err := mpsPriority(tc.env)
		if (err != nil) != tc.bad || got != tc.want {
			t.Errorf("mpsPriority(%q) = %v, %v; want %v", tc.env, got, err, tc.want)
		}
	}
}
