package qos

import (
	"math"
	"slices"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/sloserve/sloserve/runtime"
)

// request is one submitted request while the scheduler holds it.
type request struct {
	m        *model
	req      *runtime.InferRequest
	batch    int    // rows it adds to a batch; 1 for models that do not batch
	key      string // requests with equal keys can be merged
	elements int64  // elements of one row (RowElements); 0 unknown (Preadmit)
	arrival  time.Time
	started  time.Time // when its execution started; zero: not yet
	deadline time.Time // effective deadline; zero: none
	rank     int       // priority rank; lower runs first
	seq      uint64    // arrival order across the scheduler
	// probe: admitted although predicted to miss, to measure the model
	// again (see probeDueLocked); it is never dropped for its deadline.
	probe bool
	// plan is what admission predicted for it (zero: nothing known), for
	// the debug line at its finish (logFinishLocked).
	plan plan

	state requestState
	exec  *execution  // while running
	leave func()      // takes it out of the Gate; nil: not in it
	done  chan result // capacity 1; receives exactly one result

	// span is the caller's span when it is recording (trace.go), and
	// batchSpan the span of its execution while it runs; nil: not traced.
	span, batchSpan trace.Span
}

type requestState int

const (
	stateQueued requestState = iota
	stateRunning
	stateDone
)

type result struct {
	resp *runtime.InferResponse
	err  error
}

// priorityRank orders priorities: 1 is highest, then 2, 3...; 0, the
// default, ranks after every explicit priority.
func priorityRank(p int) int {
	if p <= 0 {
		return math.MaxInt
	}
	return p
}

// before is the queue order of the qos policy: earliest deadline first
// (requests without one last), then priority, then arrival.
func before(a, b *request) bool {
	switch {
	case !a.deadline.Equal(b.deadline):
		if a.deadline.IsZero() || b.deadline.IsZero() {
			return b.deadline.IsZero()
		}
		return a.deadline.Before(b.deadline)
	case a.rank != b.rank:
		return a.rank < b.rank
	default:
		return a.seq < b.seq
	}
}

// queue holds a model's waiting requests in dispatch order: by before under
// the qos policy, by arrival under fifo.
type queue struct {
	fifo  bool
	items []*request
}

func (q *queue) less(a, b *request) bool {
	if q.fifo {
		return a.seq < b.seq
	}
	return before(a, b)
}

// position is the index at which r belongs.
func (q *queue) position(r *request) int {
	i, _ := slices.BinarySearchFunc(q.items, r, func(x, r *request) int {
		if q.less(x, r) {
			return -1
		}
		return 1
	})
	return i
}

func (q *queue) push(r *request) {
	q.items = slices.Insert(q.items, q.position(r), r)
}

// remove takes r out of the queue; false if it was not there.
func (q *queue) remove(r *request) bool {
	i := slices.Index(q.items, r)
	if i < 0 {
		return false
	}
	q.items = slices.Delete(q.items, i, i+1)
	return true
}

// removeDispatched takes out the requests that are no longer queued.
func (q *queue) removeDispatched() {
	q.items = slices.DeleteFunc(q.items, func(r *request) bool { return r.state != stateQueued })
}

func (q *queue) len() int { return len(q.items) }

func (q *queue) head() *request { return q.items[0] }
