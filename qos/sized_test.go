package qos

import (
	"errors"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// sizedFake estimates 10 ms per element of a row times the batch, and
// records the sizes it is told about; without a size it knows only the
// 1-element row it has seen (10 ms a row), as a size-blind estimator would.
type sizedFake struct {
	mu       sync.Mutex
	observed []int64
}

func (f *sizedFake) Estimate(_ string, batch int) (time.Duration, bool) {
	return time.Duration(batch) * 10 * time.Millisecond, true
}
func (f *sizedFake) Observe(string, int, time.Duration) {}
func (f *sizedFake) EstimateSize(_ string, batch int, elements int64) (time.Duration, bool) {
	return time.Duration(int64(batch)*max(elements, 1)) * 10 * time.Millisecond, true
}
func (f *sizedFake) ObserveSize(_ string, _ int, elements int64, _ time.Duration) {
	f.mu.Lock()
	f.observed = append(f.observed, elements)
	f.mu.Unlock()
}

// Admission estimates a request at its own size: of two requests to a
// model that does not batch, one of 1 element (10 ms) and one of 8 (80
// ms), under a 50 ms SLO, the large one is refused at arrival with its
// own execution time in the message, and the small one runs; the
// estimator is told the size of what ran.
func TestAdmissionAtRequestSize(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		est := &sizedFake{}
		h := newHarness(t, Options{Estimator: est})
		h.model(ModelSpec{Name: "m", Class: ClassLatencyCritical, SLO: 50 * time.Millisecond}, func(ids []int64) time.Duration {
			return time.Duration(len(ids)) * 10 * time.Millisecond
		})
		h.run()
		large := h.submit(t.Context(), "m", RequestOptions{}, 1, 2, 3, 4, 5, 6, 7, 8)
		<-large.done
		if !errors.Is(large.err, ErrRejected) || !strings.Contains(large.err.Error(), "execution 80.0ms") {
			t.Errorf("8 elements: %v, want rejected, execution 80.0ms", large.err)
		}
		small := h.submit(t.Context(), "m", RequestOptions{}, 9)
		<-small.done
		if small.err != nil {
			t.Errorf("1 element: %v", small.err)
		}
		est.mu.Lock()
		defer est.mu.Unlock()
		if len(est.observed) != 1 || est.observed[0] != 1 {
			t.Errorf("observed sizes %v, want [1]", est.observed)
		}
	})
}

// RowElements counts one row of a batched request, or the whole request.
func TestRowElements(t *testing.T) {
	req := idRequest(1, 2, 3, 4)
	req.Inputs = append(req.Inputs, idTensor(5, 6, 7, 8))
	req.Inputs[1].Shape = []int64{4, 1}
	req.Inputs[0].Shape = []int64{4}
	if got := RowElements(req, true); got != 2 {
		t.Errorf("batched: %d, want 2 (1 + 1 a row)", got)
	}
	if got := RowElements(req, false); got != 8 {
		t.Errorf("unbatched: %d, want 8", got)
	}
}
