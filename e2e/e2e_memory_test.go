package e2e

import (
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
)

// widenModel writes an ONNX model (IR 7, opset 11) with input x [batch, 1]
// and output y [batch, 1] = the sum of x broadcast to width columns: an
// Expand to [batch, width] floats and a ReduceSum over axis 1. The
// intermediate takes 4·width bytes a row, so the model's working set grows
// with the batch by a known amount, and its shapes are fixed apart from
// the batch (the control loop sizes memory only for such models).
func widenModel(t *testing.T, width int64) string {
	t.Helper()
	bytesField := func(num protowire.Number, parts ...[]byte) []byte {
		var body []byte
		for _, p := range parts {
			body = append(body, p...)
		}
		return protowire.AppendBytes(protowire.AppendTag(nil, num, protowire.BytesType), body)
	}
	str := func(num protowire.Number, v string) []byte {
		return protowire.AppendString(protowire.AppendTag(nil, num, protowire.BytesType), v)
	}
	varint := func(num protowire.Number, v uint64) []byte {
		return protowire.AppendVarint(protowire.AppendTag(nil, num, protowire.VarintType), v)
	}
	// ValueInfoProto of a float tensor [batch, 1]: name, then TypeProto
	// {tensor_type {elem_type FLOAT, shape {dim {dim_param batch}, dim {dim_value 1}}}}.
	valueInfo := func(name string) []byte {
		dims := append(bytesField(1, str(2, "batch")), bytesField(1, varint(1, 1))...)
		tensor := append(varint(1, 1), bytesField(2, dims)...)
		return append(str(1, name), bytesField(2, bytesField(1, tensor))...)
	}
	shape := make([]byte, 16) // the Expand's target shape [1, width], int64 little-endian
	binary.LittleEndian.PutUint64(shape[0:], 1)
	binary.LittleEndian.PutUint64(shape[8:], uint64(width))
	init := append(append(varint(1, 2), varint(2, 7)...), str(8, "shape")...) // dims [2], INT64, name
	init = append(init, protowire.AppendBytes(protowire.AppendTag(nil, 9, protowire.BytesType), shape)...)
	expand := append(append(append(str(1, "x"), str(1, "shape")...), str(2, "wide")...), str(4, "Expand")...)
	axes := append(append(str(1, "axes"), varint(20, 7)...), varint(8, 1)...) // INTS [1]
	keep := append(append(str(1, "keepdims"), varint(20, 2)...), varint(3, 1)...)
	reduce := append(append(append(str(1, "wide"), str(2, "y")...), str(4, "ReduceSum")...), append(bytesField(5, axes), bytesField(5, keep)...)...)
	graph := append(bytesField(1, expand), bytesField(1, reduce)...)
	graph = append(graph, str(2, "widen")...)
	graph = append(graph, bytesField(5, init)...)
	graph = append(graph, bytesField(11, valueInfo("x"))...)
	graph = append(graph, bytesField(12, valueInfo("y"))...)
	model := append(varint(1, 7), bytesField(8, str(1, ""), varint(2, 11))...)
	model = append(model, bytesField(7, graph)...)
	path := filepath.Join(t.TempDir(), "widen.onnx")
	if err := os.WriteFile(path, model, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// widenBody is a REST request of one row for widenModel's model.
func widenBody() []byte {
	return []byte(`{"inputs":[{"name":"x","datatype":"FP32","shape":[1,1],"data":[` + strconvF(math.Pi) + `]}]}`)
}

func strconvF(f float64) string { return strconv.FormatFloat(f, 'f', 4, 64) }

// memoryControl is the memory part of a model's /v2/control entry.
type memoryControl struct {
	Devices []struct {
		Models []struct {
			Model        string `json:"model"`
			MemoryShare  int64  `json:"memory_share_bytes"`
			TargetMemory int64  `json:"target_memory_bytes"`
			MemoryReason string `json:"memory_reason"`
		} `json:"models"`
	} `json:"devices"`
}

// memoryShare is a model's memory share, the adjuster's target and why
// the share last moved; zeros before the adjuster's first pass.
func (s *testServer) memoryShare(t *testing.T, model string) (share, target int64, reason string) {
	t.Helper()
	var c memoryControl
	if code := s.json(t, "GET", "/v2/control", nil, &c); code != 200 {
		t.Fatalf("GET /v2/control: %d", code)
	}
	for _, d := range c.Devices {
		for _, m := range d.Models {
			if m.Model == model {
				return m.MemoryShare, m.TargetMemory, m.MemoryReason
			}
		}
	}
	return 0, 0, ""
}

// memDir is the directory of a process's cgroup that has the memory
// controller, and whether it is cgroup v2.
func memDir(t *testing.T, pid int) (string, bool) {
	t.Helper()
	return cgroupDir(t, pid, "memory")
}

// memLimit reads the memory limit of a process's cgroup in bytes (v1
// memory.limit_in_bytes, v2 memory.max); -1 when unlimited.
func memLimit(t *testing.T, pid int) int64 {
	t.Helper()
	dir, v2 := memDir(t, pid)
	file := "memory.limit_in_bytes"
	if v2 {
		file = "memory.max"
	}
	s := strings.TrimSpace(string(mustRead(t, filepath.Join(dir, file))))
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n >= 1<<62 {
		return -1
	}
	return n
}

// memUsage reads the memory a process's cgroup is charged now (v1
// memory.usage_in_bytes, v2 memory.current).
func memUsage(t *testing.T, pid int) int64 {
	t.Helper()
	dir, v2 := memDir(t, pid)
	file := "memory.usage_in_bytes"
	if v2 {
		file = "memory.current"
	}
	return readInt(t, filepath.Join(dir, file))
}

// oomKills reads the out-of-memory kills of a process's memory cgroup.
func oomKills(t *testing.T, pid int) int64 {
	t.Helper()
	dir, v2 := memDir(t, pid)
	file := "memory.oom_control"
	if v2 {
		file = "memory.events"
	}
	for line := range strings.SplitSeq(string(mustRead(t, filepath.Join(dir, file))), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "oom_kill" {
			n, _ := strconv.ParseInt(f[1], 10, 64)
			return n
		}
	}
	return 0
}

// TestE2EMemorySharesMove runs the control loop's memory sizing against a
// real runner in a real cgroup: a model whose working set grows by 8MiB a
// row (widenModel), profiled at load with its peak memory at batch sizes
// 1, 4 and 8, gets a memory limit far under its 2GiB memory_limit while
// idle; when a queue of requests builds up the runner's memory limit grows
// (to the largest batch's working set with headroom), and when the load
// stops it comes back down; nothing is killed for memory, no request
// fails, and the runner is the same process throughout.
func TestE2EMemorySharesMove(t *testing.T) {
	repo := t.TempDir()
	// 8MiB a row: batch 8 takes 56MiB more than batch 1.
	writeRepo(t, repo, repoModel{"widen", widenModel(t, 2<<20), `max_batch_size: 8
slo: {latency_ms: 5000, class: latency-critical}
execution: {intra_op_threads: 1}
resources: {min_compute_share: 0.1, memory_limit: 2GiB}
profile: {batch_sizes: [1, 4, 8]}
`})
	s := startServer(t, repo, fmt.Sprintf(`control:
  period: 200ms
  scale_down_after: 1s
  cooldown: 500ms
  profile: {cache_dir: %q, budget: 60s}
`, t.TempDir()))
	requireCgroups(t, s.control(t))
	pids := s.runnerPids(t, "widen/1/model.onnx")
	if len(pids) != 1 {
		t.Fatalf("runner pids %v", pids)
	}
	pid := pids[0]

	// Idle: sized from the working set (or what the runner holds), well
	// under the 2GiB limit, and the cgroup says the same.
	var idle int64
	waitFor(t, "an idle memory share under the limit in the runner's cgroup", 10*time.Second, func() bool {
		share, target, _ := s.memoryShare(t, "widen/1")
		idle = share
		return target > 0 && share > 0 && share < 2<<30 && memLimit(t, pid) == share
	})
	t.Logf("idle memory share %dMiB", idle>>20)

	// Load: twelve clients at once keep a queue of more than a full batch.
	body := widenBody()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	codes := map[int]int{}
	for range 12 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				code, _, _ := s.do(t, "POST", "/v2/models/widen/infer", body)
				mu.Lock()
				codes[code]++
				mu.Unlock()
			}
		})
	}
	var grown int64
	waitFor(t, "the runner's memory limit to grow under load", 20*time.Second, func() bool {
		grown = memLimit(t, pid)
		return grown > idle
	})
	// A second (the forecast catching up with the queue) for the largest
	// batch's share.
	time.Sleep(time.Second)
	_, _, reason := s.memoryShare(t, "widen/1")
	close(stop)
	wg.Wait()
	grown = max(grown, memLimit(t, pid))
	t.Logf("memory share under load %dMiB: %s", grown>>20, reason)

	var ev eventsJSON
	s.json(t, "GET", "/v2/control/events?limit=1000", nil, &ev)
	found := false
	for _, e := range ev.Events {
		if e.Model == "widen/1" && e.Kind == "resize" && strings.Contains(e.Reason, "memory") && strings.Contains(e.Reason, "needs") {
			found = true
		}
	}
	if !found {
		t.Errorf("no resize event giving the memory's reason among %+v", ev.Events)
	}

	// Idle again: after the hysteresis the limit comes down to the idle
	// sizing, what the runner holds now plus a sixteenth (its arena kept
	// what the load's batches took) or batch 1's working set with
	// headroom, never below what it holds.
	waitFor(t, "the runner's memory limit to come down when idle", 20*time.Second, func() bool {
		return memLimit(t, pid) < grown
	})
	if limit, used := memLimit(t, pid), memUsage(t, pid); limit < used {
		t.Errorf("memory limit %d under what the runner uses, %d", limit, used)
	}
	t.Logf("memory limit when idle again %dMiB, the runner uses %dMiB", memLimit(t, pid)>>20, memUsage(t, pid)>>20)

	mu.Lock()
	if codes[200] == 0 || len(codes) != 1 {
		t.Errorf("request outcomes under load %v; want all 200", codes)
	}
	mu.Unlock()
	if n := oomKills(t, pid); n != 0 {
		t.Errorf("%d out-of-memory kills in the runner's cgroup", n)
	}
	if got := s.runnerPids(t, "widen/1/model.onnx"); len(got) != 1 || got[0] != pid {
		t.Errorf("runner pids %v, want the same %d throughout", got, pid)
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err != nil {
		t.Errorf("the runner is gone: %v", err)
	}
}
