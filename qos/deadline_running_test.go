package qos

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"
)

// A request whose own deadline passes while it runs, and whose instance
// gives up at that deadline (the runtime pool bounds a call by it), is
// counted dropped, as its client is told (504 / DEADLINE_EXCEEDED), not
// failed; an execution that fails otherwise, or with a deadline error
// before the request's deadline, is still failed.
func TestDeadlinePassedWhileRunningIsDropped(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		at := h.model(ModelSpec{Name: "at", Class: lc, SLO: time.Second}, constant(50*ms))
		at.fail = context.DeadlineExceeded
		early := h.model(ModelSpec{Name: "early", Class: lc, SLO: time.Second}, constant(10*ms))
		early.fail = context.DeadlineExceeded
		broken := h.model(ModelSpec{Name: "broken", Class: lc, SLO: time.Second}, constant(50*ms))
		broken.fail = errors.New("runner died")
		h.run()
		ctx := t.Context()
		// No estimate yet, so all are admitted and run, one after the
		// other: only the first ends past its deadline.
		ps := []*pending{
			h.submit(ctx, "at", RequestOptions{Deadline: time.Now().Add(20 * ms)}, 1),
			h.submit(ctx, "early", RequestOptions{Deadline: time.Now().Add(200 * ms)}, 2),
			h.submit(ctx, "broken", RequestOptions{Deadline: time.Now().Add(500 * ms)}, 3),
		}
		for i, want := range []error{context.DeadlineExceeded, context.DeadlineExceeded, broken.fail} {
			if err := ps[i].wait(t); !errors.Is(err, want) {
				t.Errorf("request %d: %v, want %v", i+1, err, want)
			}
		}
		for _, c := range []struct {
			model           string
			dropped, failed uint64
		}{{"at", 1, 0}, {"early", 0, 1}, {"broken", 0, 1}} {
			st, _ := h.s.Stats(c.model)
			if st.Dropped != c.dropped || st.Failed != c.failed {
				t.Errorf("%s: dropped %d, failed %d; want %d, %d", c.model, st.Dropped, st.Failed, c.dropped, c.failed)
			}
		}
	})
}
