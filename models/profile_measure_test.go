package models

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"testing/synctest"
	"time"
)

// quotaExec is a batch of cpu CPU time that runs under a CFS quota of
// quota per period, as a runner at a share under cgroups: it runs at full
// speed while the period's quota lasts and waits for the next period when
// it is spent.
type quotaExec struct {
	cpu, quota, period time.Duration
	periodStart        time.Time
	used               time.Duration
}

func (q *quotaExec) run() error {
	for left := q.cpu; left > 0; {
		now := time.Now()
		if start := now.Truncate(q.period); !start.Equal(q.periodStart) {
			q.periodStart, q.used = start, 0
		}
		end := q.periodStart.Add(q.period)
		if q.used >= q.quota {
			time.Sleep(end.Sub(now))
			continue
		}
		d := min(left, q.quota-q.used, end.Sub(now))
		time.Sleep(d)
		q.used += d
		left -= d
	}
	return nil
}

// A batch shorter than the quota's period is measured at the speed its
// share gives: 1 ms of CPU at a quota of a quarter of the period takes 4
// ms a run, back to back. Single runs take 1 ms until the period's quota
// is spent and then wait up to 7.5 ms; the median of three of them (the
// profile before) measured 1 ms, four times too fast, and the next point
// 8.5 ms.
func TestMeasurePointUnderQuota(t *testing.T) {
	for _, tc := range []struct {
		name             string
		cpu, quota, want time.Duration
	}{
		{"short batch, quarter share", time.Millisecond, 2500 * time.Microsecond, 4 * time.Millisecond},
		{"short batch, half share", 1500 * time.Microsecond, 5 * time.Millisecond, 3 * time.Millisecond},
		{"long batch, quarter share", 30 * time.Millisecond, 2500 * time.Microsecond, 120 * time.Millisecond},
		{"whole period", time.Millisecond, 10 * time.Millisecond, time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := &quotaExec{cpu: tc.cpu, quota: tc.quota, period: 10 * time.Millisecond}
				got, err := measurePoint(3, warmRun, q.run)
				if err != nil {
					t.Fatal(err)
				}
				if r := float64(got) / float64(tc.want); r < 0.9 || r > 1.1 {
					t.Errorf("measured %v, want %v within 10%%", got, tc.want)
				}
			})
		})
	}
}

// Whatever the phase of the batches against the quota's periods, a point
// is measured within 3% of the speed its share gives. Over 50 ms windows
// a window's first and last periods, part throttled, were up to 7.1% of
// it (2.3 ms of CPU at a quarter of the period: 9.2 ms a run) and 5.4%
// (7 ms at a quarter or a half), errors of the size of the predictor's
// own aim in the points it is fitted to.
func TestMeasurePointUnderQuotaAnyPhase(t *testing.T) {
	const period = 10 * time.Millisecond
	for _, quota := range []time.Duration{2500 * time.Microsecond, 5 * time.Millisecond} {
		for _, cpu := range []time.Duration{time.Millisecond, 2300 * time.Microsecond, 7 * time.Millisecond, 13 * time.Millisecond, 30 * time.Millisecond} {
			want := cpu * period / quota
			worst := 0.0
			for phase := time.Duration(0); phase < period; phase += period / 8 {
				synctest.Test(t, func(t *testing.T) {
					time.Sleep(phase)
					q := &quotaExec{cpu: cpu, quota: quota, period: period}
					got, err := measurePoint(3, warmRun, q.run)
					if err != nil {
						t.Fatal(err)
					}
					worst = max(worst, math.Abs(float64(got)/float64(want)-1))
				})
			}
			t.Logf("%v of CPU at a quota of %v per %v: up to %.1f%% off %v", cpu, quota, period, 100*worst, want)
			if worst > 0.03 {
				t.Errorf("%v of CPU at a quota of %v per %v: measured up to %.1f%% off %v, want within 3%%", cpu, quota, period, 100*worst, want)
			}
		}
	}
}

// A failing run fails the measurement, whichever run it is.
func TestMeasurePointError(t *testing.T) {
	boom := errors.New("boom")
	for fail := range 4 {
		n := 0
		_, err := measurePoint(3, warmRun, func() error {
			n++
			if n > fail {
				return boom
			}
			return nil
		})
		if !errors.Is(err, boom) {
			t.Errorf("failing from run %d: %v, want boom", fail+1, err)
		}
	}
}

// A point measured warm (the sweep ran it at this share in an earlier
// round) has no unmeasured run before its windows; one measured again at
// another share has one; one never run has a window of them: its first
// runs are slower (here the first 10 take 3 ms, then 1 ms), and with one
// unmeasured run its window measured 1.10 ms, 10% slow.
func TestMeasurePointWarm(t *testing.T) {
	for _, tc := range []struct {
		warm int
		want time.Duration
		runs int
	}{
		{warmNone, 300 * time.Millisecond, 1},
		{warmRun, 300 * time.Millisecond, 2},
	} {
		synctest.Test(t, func(t *testing.T) {
			n := 0
			got, err := measurePoint(1, tc.warm, func() error {
				n++
				time.Sleep(300 * time.Millisecond) // longer than a window: one run a window
				return nil
			})
			if err != nil || n != tc.runs || got != tc.want {
				t.Errorf("warm %d: %d runs, measured %v, err %v; want %d runs, %v", tc.warm, n, got, err, tc.runs, tc.want)
			}
		})
	}
	// A long batch, slow for its first two runs: three unmeasured runs.
	synctest.Test(t, func(t *testing.T) {
		n := 0
		got, err := measurePoint(1, warmWindow, func() error {
			n++
			if n <= 2 {
				time.Sleep(900 * time.Millisecond)
			} else {
				time.Sleep(300 * time.Millisecond)
			}
			return nil
		})
		if err != nil || got != 300*time.Millisecond || n != warmRuns+1 {
			t.Errorf("cold long point measured %v in %d runs (err %v), want 300ms in %d", got, n, err, warmRuns+1)
		}
	})
	synctest.Test(t, func(t *testing.T) {
		n := 0
		got, err := measurePoint(1, warmWindow, func() error {
			n++
			if n <= 10 {
				time.Sleep(3 * time.Millisecond)
			} else {
				time.Sleep(time.Millisecond)
			}
			return nil
		})
		if err != nil || got != time.Millisecond {
			t.Errorf("cold point measured %v (err %v), want 1ms: its slow first runs in the warm-up window", got, err)
		}
	})
}

// The sweep measures a batch's shapes in rounds, a window a call: the
// share is set when it changes, not at each call (each write of a CPU
// quota refills it, and the window after would measure that as speed).
func TestProfileSetsAShareOncePerChange(t *testing.T) {
	repo := t.TempDir()
	writeModel(t, repo, "sum", fmt.Sprintf(sumConfig, "sum", 1, 1)+
		"execution: {intra_op_threads: 1}\nresources: {memory_limit: 1MiB}\nprofile: {batch_sizes: [1, 4]}\n", 1)
	lim := newFakeLimiter(2)
	resizes := func() int {
		lim.mu.Lock()
		defer lim.mu.Unlock()
		return lim.resizes
	}
	var got int
	newShareRegistry(t, repo, lim, func(ctx context.Context, run ProfileRun) error {
		before := resizes()
		for _, m := range []struct {
			batch int
			share float64
		}{{1, 0.5}, {4, 0.5}, {4, 0.5}, {1, 0.5}, {1, 0.125}, {1, 0.125}} {
			if _, err := run.MeasureAt(ctx, 0, m.batch, m.share, 1); err != nil {
				return err
			}
		}
		got = resizes() - before
		return nil
	})
	if got != 2 {
		t.Errorf("%d resizes for 6 windows at two shares, want 2", got)
	}
}
