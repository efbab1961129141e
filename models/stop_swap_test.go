package models

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/limiter"
)

// liftingLimiter is a fakeLimiter that can lift a unit's compute cap
// (limiter.ComputeLifter) and says when it did.
type liftingLimiter struct {
	*fakeLimiter
	liftMu sync.Mutex
	lifted map[string]chan struct{}
	// backgroundLifts counts LiftBackground calls.
	backgroundLifts int
}

var (
	_ limiter.ComputeLifter    = (*liftingLimiter)(nil)
	_ limiter.BackgroundLifter = (*liftingLimiter)(nil)
)

func (l *liftingLimiter) LiftBackground() error {
	l.liftMu.Lock()
	defer l.liftMu.Unlock()
	l.backgroundLifts++
	return nil
}

func (l *liftingLimiter) backgroundLifted() int {
	l.liftMu.Lock()
	defer l.liftMu.Unlock()
	return l.backgroundLifts
}

func newLiftingLimiter() *liftingLimiter {
	l := &liftingLimiter{fakeLimiter: newFakeLimiter(2), lifted: map[string]chan struct{}{}}
	l.restart = true // every resize needs a replacement
	return l
}

func (l *liftingLimiter) liftedCh(id string) chan struct{} {
	l.liftMu.Lock()
	defer l.liftMu.Unlock()
	ch, ok := l.lifted[id]
	if !ok {
		ch = make(chan struct{})
		l.lifted[id] = ch
	}
	return ch
}

func (l *liftingLimiter) LiftCompute(id string) error {
	l.fakeLimiter.mu.Lock()
	_, ok := l.units[id]
	l.fakeLimiter.mu.Unlock()
	if !ok {
		return limiter.ErrUnknownInstance
	}
	ch := l.liftedCh(id)
	select {
	case <-ch:
	default:
		close(ch)
	}
	return nil
}

// unitOfSpec is the limiter unit a fake instance was placed in.
func unitOfSpec(spec InstanceSpec) string {
	return strings.TrimPrefix(spec.Placement.JoinCgroups[0], "/fake/")
}

// A replacement still loading when its model is unloaded (the server
// stopping) is given up at once, and its unit is uncapped when the start
// is abandoned: a runner killed while loading in a capped, idle-class unit
// behind busy processes otherwise waits for the CPU to exit, and held the
// server's stop for seconds. The fake start stands for such a process:
// once abandoned it ends at once if its unit has no cap (a start runs
// uncapped, startInstance), else only when its cap is lifted, or after an
// hour (simulated time).
func TestAbandonedReplacementLiftsItsCap(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		repo := t.TempDir()
		writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
		lim := newLiftingLimiter()
		r, f := newShareRegistry(t, repo, lim, nil)

		entered := make(chan struct{})
		var uncapped bool
		f.mu.Lock()
		f.onStartCtx = func(ctx context.Context, spec InstanceSpec) error {
			close(entered)
			<-ctx.Done()
			id := unitOfSpec(spec)
			lim.fakeLimiter.mu.Lock()
			at := lim.units[id]
			lim.fakeLimiter.mu.Unlock()
			if unlimited(at.Compute) && at.Mode != limiter.ModeBackground {
				uncapped = true // nothing to lift
				return ctx.Err()
			}
			select {
			case <-lim.liftedCh(id):
				uncapped = true
			case <-time.After(time.Hour):
			}
			return ctx.Err()
		}
		f.mu.Unlock()
		if err := r.RequestShare("sum/1", limiter.Share{Compute: 0.3}); err != nil {
			t.Fatal(err)
		}
		<-entered
		start := time.Now()
		if err := r.Unload(context.Background(), "sum"); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); !uncapped || took >= time.Hour {
			t.Errorf("unload took %v (simulated) with a replacement loading; uncapped: %v; want at once, uncapped", took, uncapped)
		}
		if got := lim.shares(); len(got) != 0 {
			t.Errorf("units left after the unload: %+v", got)
		}
	})
}

// A synchronous share change (SetShare, which holds the version's share
// lock while its replacement loads) is abandoned when the version is
// unloaded: the unload does not wait for the replacement to be ready. The
// fake start ends when its start is abandoned, or after an hour.
func TestUnloadAbandonsSynchronousSwap(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		repo := t.TempDir()
		writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1), 1)
		lim := newLiftingLimiter()
		r, f := newShareRegistry(t, repo, lim, nil)

		entered := make(chan struct{})
		var abandoned bool
		f.mu.Lock()
		f.onStartCtx = func(ctx context.Context, spec InstanceSpec) error {
			close(entered)
			select {
			case <-ctx.Done():
				abandoned = true
				return ctx.Err()
			case <-time.After(time.Hour): // ready at last
				return nil
			}
		}
		f.mu.Unlock()
		setErr := make(chan error, 1)
		go func() { setErr <- r.SetShare(context.Background(), "sum/1", limiter.Share{Compute: 0.3}) }()
		<-entered
		start := time.Now()
		if err := r.Unload(context.Background(), "sum"); err != nil {
			t.Fatal(err)
		}
		took := time.Since(start)
		if !abandoned || took >= time.Hour {
			t.Errorf("unload took %v (simulated) behind a share change starting a replacement; start abandoned: %v; want at once, abandoned", took, abandoned)
		}
		if err := <-setErr; err == nil {
			t.Error("the abandoned share change reported success")
		}
		if got := lim.shares(); len(got) != 0 {
			t.Errorf("units left after the unload: %+v", got)
		}
	})
}
