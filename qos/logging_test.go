package qos

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
)

// lockProbe is a debug log handler that records, for every line, whether
// the scheduler's lock was free while the line was written.
type lockProbe struct {
	mu    sync.Mutex
	s     *Scheduler
	lines []string // message, and " (under the lock)" when it was held
}

func (p *lockProbe) Enabled(context.Context, slog.Level) bool { return true }
func (p *lockProbe) WithAttrs([]slog.Attr) slog.Handler       { return p }
func (p *lockProbe) WithGroup(string) slog.Handler            { return p }
func (p *lockProbe) Handle(_ context.Context, r slog.Record) error {
	line := r.Message
	if s := p.s; s != nil {
		if s.mu.TryLock() {
			s.mu.Unlock()
		} else {
			line += " (under the lock)"
		}
	}
	p.mu.Lock()
	p.lines = append(p.lines, line)
	p.mu.Unlock()
	return nil
}

func (p *lockProbe) logged(msg string) (n, locked int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.lines {
		if strings.HasPrefix(l, msg) {
			n++
			if strings.HasSuffix(l, "(under the lock)") {
				locked++
			}
		}
	}
	return n, locked
}

// The per-request log lines (a refusal, a drop) are written after the
// scheduler's lock is released: a log handler takes a lock of its own and
// writes to a file or a pipe, and under overload, with thousands of
// refusals a second, every arrival and the dispatcher queued behind the
// one writing (measured: the detector's runner idle at 10x overload while
// four thousand requests waited for the lock).
func TestRequestLogsOutsideTheLock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		probe := &lockProbe{}
		h := newHarness(t, Options{Logger: slog.New(probe)})
		probe.s = h.s
		took := linear(5*ms, 10*ms)
		h.model(ModelSpec{Name: "m", Class: lc, SLO: 50 * ms, MaxBatchSize: 8, QueueCapacity: 8}, took)
		ctx := t.Context()
		var ps []*pending
		for id := range int64(8) {
			ps = append(ps, h.submit(ctx, "m", RequestOptions{}, id+1))
		}
		synctest.Wait()
		// The queue is full: refused by Preadmit and by Submit.
		if err := h.s.Preadmit(ctx, "m", RequestOptions{}); !errors.Is(err, ErrQueueFull) {
			t.Fatalf("Preadmit on a full queue: %v, want ErrQueueFull", err)
		}
		if err := h.submit(ctx, "m", RequestOptions{}, 9).wait(t); !errors.Is(err, ErrQueueFull) {
			t.Fatalf("Submit on a full queue: %v, want ErrQueueFull", err)
		}
		// Admitted before the estimates: a batch of 4 meets the deadline,
		// the other four are dropped by the dispatcher.
		h.seed("m", 8, took)
		h.run()
		mustSucceed(t, ps[:4]...)
		for _, p := range ps[4:] {
			if err := p.wait(t); !errors.Is(err, ErrDropped) {
				t.Errorf("request %v: %v, want ErrDropped", p.ids, err)
			}
		}
		synctest.Wait()
		if n, locked := probe.logged("request rejected"); n != 2 || locked != 0 {
			t.Errorf(`"request rejected": %d lines, %d written under the scheduler's lock; want 2, 0`, n, locked)
		}
		if n, locked := probe.logged("request dropped"); n != 4 || locked != 0 {
			t.Errorf(`"request dropped": %d lines, %d written under the scheduler's lock; want 4, 0`, n, locked)
		}
	})
}

// idLines is a debug log handler that keeps the id of every "request
// finished" line ("" when the line has none).
type idLines struct {
	mu  sync.Mutex
	ids []string
}

func (h *idLines) Enabled(context.Context, slog.Level) bool { return true }
func (h *idLines) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *idLines) WithGroup(string) slog.Handler            { return h }
func (h *idLines) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "request finished" {
		return nil
	}
	id := ""
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "id" {
			id = a.Value.String()
		}
		return true
	})
	h.mu.Lock()
	h.ids = append(h.ids, id)
	h.mu.Unlock()
	return nil
}

// A finished request's debug line names it by the client's id, so that a
// client's record of a request can be joined to the server's line for it
// exactly (scripts/late-causes.py); a request without one gets no id, and
// a long id is cut at a character's start, not at any byte.
func TestFinishLineCarriesTheRequestID(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lines := &idLines{}
		h := newHarness(t, Options{Logger: slog.New(lines)})
		took := linear(5*ms, 10*ms)
		h.model(ModelSpec{Name: "m", Class: lc, SLO: 50 * ms}, took)
		h.seed("m", 1, took)
		h.run()
		long := strings.Repeat("x", maxLoggedID-1) + "é" + strings.Repeat("y", 10) // é straddles the cut
		for i, id := range []string{"req-1", "", long} {
			req := idRequest(int64(i + 1))
			req.ID = id
			mustSucceed(t, h.submitRequest(t.Context(), "m", RequestOptions{}, req))
		}
		synctest.Wait()
		lines.mu.Lock()
		defer lines.mu.Unlock()
		want := []string{"req-1", "", strings.Repeat("x", maxLoggedID-1) + "..."}
		if !slices.Equal(lines.ids, want) {
			t.Errorf("ids of the finish lines: %q, want %q", lines.ids, want)
		}
	})
}
