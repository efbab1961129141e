package qos

import (
	"errors"
	"strings"
	"testing"
	"testing/synctest"
	"time"
)

// The gate bounds the requests in flight across models: one over the limit
// is refused at once, counted as rejected (overloaded), also by Preadmit,
// and the limit follows SetLimits.
func TestGateRequests(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		gate := NewGate(1, 0)
		h := newHarness(t, Options{Gate: gate})
		h.model(ModelSpec{Name: "a"}, linear(100*ms, 0))
		h.model(ModelSpec{Name: "b"}, nil)
		h.run()
		ctx := t.Context()
		first := h.submit(ctx, "a", RequestOptions{}, 1)
		if n, _ := gate.InFlight(); n != 1 {
			t.Fatalf("in flight = %d, want 1", n)
		}
		if err := h.submit(ctx, "b", RequestOptions{}, 2).wait(t); !errors.Is(err, ErrOverloaded) || !strings.Contains(err.Error(), "limit 1") {
			t.Errorf("second request over a limit of 1: %v, want ErrOverloaded", err)
		}
		if err := h.s.Preadmit(ctx, "b", RequestOptions{}); !errors.Is(err, ErrOverloaded) {
			t.Errorf("Preadmit at the limit: %v, want ErrOverloaded", err)
		}
		// A request whose model is not known yet (a gRPC call not read)
		// is refused by the gate alone, counted there and by no model.
		if err := gate.RefuseUnread(); !errors.Is(err, ErrOverloaded) || gate.RefusedUnread() != 1 {
			t.Errorf("RefuseUnread at the limit: %v, counted %d; want ErrOverloaded, 1", err, gate.RefusedUnread())
		}
		gate.SetLimits(0, 0)
		mustSucceed(t, h.submit(ctx, "b", RequestOptions{}, 3))
		mustSucceed(t, first)
		if err := gate.RefuseUnread(); err != nil || gate.RefusedUnread() != 1 {
			t.Errorf("RefuseUnread without a limit: %v, counted %d; want nil, still 1", err, gate.RefusedUnread())
		}
		gate.SetLimits(1, 0)
		mustSucceed(t, h.submit(ctx, "b", RequestOptions{}, 4)) // the first has left
		st, _ := h.s.Stats("b")
		if st.Arrived != 4 || st.Rejected != 2 || st.Overloaded != 2 || st.Good != 2 || st.Fail.Count != 2 {
			t.Errorf("b's stats: arrived %d, rejected %d (overloaded %d), good %d, failed %d; want 4, 2 (2), 2, 2",
				st.Arrived, st.Rejected, st.Overloaded, st.Good, st.Fail.Count)
		}
		if n, b := gate.InFlight(); n != 0 || b != 0 {
			t.Errorf("in flight after every request ended: %d requests, %d bytes", n, b)
		}
	})
}

// The input bytes in flight are bounded: a request that would pass the
// bound is refused while another runs, one alone always passes, and the
// bytes are given back when a request ends.
func TestGateBytes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		gate := NewGate(0, 4) // smaller than one request of 8 bytes
		h := newHarness(t, Options{Gate: gate})
		h.model(ModelSpec{Name: "m", MaxBatchSize: 4, Slots: 2}, linear(100*ms, 0))
		h.run()
		ctx := t.Context()
		mustSucceed(t, h.submit(ctx, "m", RequestOptions{}, 1))
		gate.SetLimits(0, 15) // room for one 8-byte request, not two
		first := h.submit(ctx, "m", RequestOptions{}, 2)
		err := h.submit(ctx, "m", RequestOptions{}, 3).wait(t)
		if !errors.Is(err, ErrOverloaded) || !strings.Contains(err.Error(), "hold 8 of inputs, over limits.max_inflight_bytes (15)") {
			t.Errorf("second request past 15 bytes: %v, want ErrOverloaded naming limits.max_inflight_bytes", err)
		}
		gate.SetLimits(0, 16) // room for both
		second := h.submit(ctx, "m", RequestOptions{}, 4)
		if _, b := gate.InFlight(); b != 16 {
			t.Errorf("%d bytes in flight, want 16", b)
		}
		mustSucceed(t, first, second)
		if n, b := gate.InFlight(); n != 0 || b != 0 {
			t.Errorf("in flight after every request ended: %d requests, %d bytes", n, b)
		}
	})
}

// Invalid requests are counted once, apart from arrivals: the ones the
// scheduler cannot schedule and the ones refused before (CountInvalid).
func TestInvalidCounted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		h.model(ModelSpec{Name: "m", MaxBatchSize: 2}, nil)
		h.run()
		ctx := t.Context()
		if err := h.submit(ctx, "m", RequestOptions{}, 1, 2, 3).wait(t); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("batch of 3 over 2: %v, want ErrInvalidRequest", err)
		}
		h.s.CountInvalid("m", time.Now().Add(-5*ms))
		h.s.CountInvalid("nosuch", time.Now())
		st, _ := h.s.Stats("m")
		if st.Invalid != 2 || st.Arrived != 0 || st.Fail != (Duration{2, 5 * ms}) || st.WindowSettled != 0 {
			t.Errorf("stats = invalid %d, arrived %d, fail %+v, settled %d; want 2, 0, {2 5ms}, 0", st.Invalid, st.Arrived, st.Fail, st.WindowSettled)
		}
	})
}

func TestFormatBytes(t *testing.T) {
	for n, want := range map[int64]string{0: "0", 15: "15", 1024: "1KiB", 1536: "1536", 1 << 30: "1GiB", 3 << 20: "3MiB"} {
		if got := formatBytes(n); got != want {
			t.Errorf("formatBytes(%d) = %q, want %q", n, got, want)
		}
	}
}
