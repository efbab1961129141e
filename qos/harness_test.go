package qos

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

// The scheduler tests run inside synctest bubbles: the fake executor sleeps
// its scripted durations in fake time, and synctest.Wait lets the dispatcher
// settle before a test looks.

// call is one execution the fake executor saw.
type call struct {
	model string
	ids   []int64
	at    time.Duration // since the test's start
}

func (c call) String() string { return fmt.Sprintf("%s%v@%s", c.model, c.ids, c.at) }

// recorder collects the executions of every fake model of a test in order.
type recorder struct {
	start time.Time
	mu    sync.Mutex
	calls []call
}

func (r *recorder) record(c call) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, c)
}

func (r *recorder) snapshot() []call {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

// order lists the executions as "model:id,id" strings.
func (r *recorder) order() []string {
	var out []string
	for _, c := range r.snapshot() {
		ids := make([]string, len(c.ids))
		for i, id := range c.ids {
			ids[i] = fmt.Sprint(id)
		}
		out = append(out, c.model+":"+strings.Join(ids, ","))
	}
	return out
}

// saw reports whether any execution included request id.
func (r *recorder) saw(id int64) bool {
	for _, c := range r.snapshot() {
		if slices.Contains(c.ids, id) {
			return true
		}
	}
	return false
}

// fakeModel is an Executor whose requests carry ids in an INT64 input "id"
// (one per batch row); it sleeps as scripted and answers with output "y"
// holding each id times 10.
type fakeModel struct {
	name string
	rec  *recorder
	took func(ids []int64) time.Duration // nil: 10 ms
	fail error
}

var _ Executor = (*fakeModel)(nil)

func (f *fakeModel) Execute(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
	ids := decodeIDs(req.Inputs[0])
	f.rec.record(call{model: f.name, ids: ids, at: time.Since(f.rec.start)})
	d := 10 * time.Millisecond
	if f.took != nil {
		d = f.took(ids)
	}
	select {
	case <-time.After(d):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if f.fail != nil {
		return nil, f.fail
	}
	out := idTensor(ids...)
	out.Name = "y"
	for i := range out.Data[:len(out.Data)/8] {
		binary.LittleEndian.PutUint64(out.Data[8*i:], uint64(ids[i]*10))
	}
	return &runtime.InferResponse{Outputs: []runtime.Tensor{out}}, nil
}

func idTensor(ids ...int64) runtime.Tensor {
	data := make([]byte, 0, 8*len(ids))
	for _, id := range ids {
		data = binary.LittleEndian.AppendUint64(data, uint64(id))
	}
	return runtime.Tensor{Name: "id", DataType: runtime.Int64, Shape: []int64{int64(len(ids))}, Data: data}
}

func decodeIDs(t runtime.Tensor) []int64 {
	ids := make([]int64, len(t.Data)/8)
	for i := range ids {
		ids[i] = int64(binary.LittleEndian.Uint64(t.Data[8*i:]))
	}
	return ids
}

// idRequest is a request with one batch row per id.
func idRequest(ids ...int64) *runtime.InferRequest {
	return &runtime.InferRequest{Inputs: []runtime.Tensor{idTensor(ids...)}}
}

// harness is one test's scheduler, run until the test ends.
type harness struct {
	t   *testing.T
	s   *Scheduler
	rec *recorder
	est *EWMAEstimator
}

// newHarness must be called inside a synctest bubble.
func newHarness(t *testing.T, opts Options) *harness {
	t.Helper()
	h := &harness{t: t, rec: &recorder{start: time.Now()}, est: NewEWMAEstimator(1)}
	if opts.Estimator == nil {
		opts.Estimator = h.est
	}
	if opts.Logger == nil {
		opts.Logger = testLogger(t)
	}
	s, err := NewScheduler(opts)
	if err != nil {
		t.Fatal(err)
	}
	h.s = s
	return h
}

// run starts the dispatch loop; it stops when the test ends.
func (h *harness) run() {
	ctx, cancel := context.WithCancel(h.t.Context())
	done := make(chan error, 1)
	go func() { done <- h.s.Run(ctx) }()
	h.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			h.t.Errorf("Run: %v", err)
		}
	})
	synctest.Wait()
}

// model adds a fake model; spec.Executor is filled in.
func (h *harness) model(spec ModelSpec, took func(ids []int64) time.Duration) *fakeModel {
	h.t.Helper()
	f := &fakeModel{name: spec.Name, rec: h.rec, took: took}
	spec.Executor = f
	if err := h.s.AddModel(spec); err != nil {
		h.t.Fatal(err)
	}
	return f
}

// warm fills the read window of model's room with minTail executions a
// slot as predicted, so that admission leaves the room they read (none)
// instead of the cold prior's (coldRoom): for tests of what admission
// plans on the mean.
func (h *harness) warm(model string) {
	h.t.Helper()
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	m, ok := h.s.models[model]
	if !ok {
		h.t.Fatalf("warm: no model %q", model)
	}
	m.tail.setSlots(h.s.parallelLocked(m))
	for range minTail * max(m.tail.slots, 1) {
		m.tail.observe(1e-3, 1e-3)
	}
}

// pending is a Submit in flight.
type pending struct {
	ids  []int64
	done chan struct{}
	resp *runtime.InferResponse
	err  error
	at   time.Duration // when Submit returned, since the test's start
}

// submit calls Submit in a goroutine and lets the scheduler settle, so that
// consecutive submits arrive in order.
func (h *harness) submit(ctx context.Context, model string, o RequestOptions, ids ...int64) *pending {
	return h.submitRequest(ctx, model, o, idRequest(ids...))
}

// submitRequest is submit for a request built by the test.
func (h *harness) submitRequest(ctx context.Context, model string, o RequestOptions, req *runtime.InferRequest) *pending {
	p := &pending{ids: decodeIDs(req.Inputs[0]), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		p.resp, p.err = h.s.Submit(ctx, model, req, o)
		p.at = time.Since(h.rec.start)
	}()
	synctest.Wait()
	return p
}

// wait returns the Submit's result and checks that a response carries
// exactly the request's own rows.
func (p *pending) wait(t *testing.T) error {
	t.Helper()
	<-p.done
	if p.err != nil {
		return p.err
	}
	got := decodeIDs(p.resp.Outputs[0])
	want := make([]int64, len(p.ids))
	for i, id := range p.ids {
		want[i] = id * 10
	}
	if !slices.Equal(got, want) {
		t.Errorf("request %v got response %v, want %v", p.ids, got, want)
	}
	return nil
}

// mustSucceed waits for every pending Submit and fails on any error.
func mustSucceed(t *testing.T, ps ...*pending) {
	t.Helper()
	for _, p := range ps {
		if err := p.wait(t); err != nil {
			t.Errorf("request %v: %v", p.ids, err)
		}
	}
}

// linear returns a scripted duration of base + perRow per batch row.
func linear(base, perRow time.Duration) func([]int64) time.Duration {
	return func(ids []int64) time.Duration { return base + time.Duration(len(ids))*perRow }
}

// seed tells the estimator what took returns for batch sizes 1..n.
func (h *harness) seed(model string, n int, took func([]int64) time.Duration) {
	for b := 1; b <= n; b++ {
		h.est.Observe(model, b, took(make([]int64, b)))
	}
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}
