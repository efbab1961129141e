package models

import (
	"context"
	"slices"
	"testing"

	"github.com/sloserve/sloserve/runtime"
)

// boundedInstance is an instance whose memory holds batches up to bound.
type boundedInstance struct {
	runtime.Member
	bound   int
	bounded bool
}

func (b boundedInstance) MaxBatch() (int, bool) { return b.bound, b.bounded }

type plainInstance struct{ runtime.Member }

func (plainInstance) Stop(context.Context) error { return nil }

// A replacement is warmed only at batch sizes its memory holds: the
// largest is cut to its bound (a shrunk MPS client would fail the
// model's maximum, and the scheduler sends it no larger batch).
func TestWarmUpWithinMemory(t *testing.T) {
	for _, tc := range []struct {
		name  string
		m     runtime.Member
		sizes []int
		want  []int
	}{
		{"unbounded", boundedInstance{bound: 0, bounded: false}, []int{1, 8}, []int{1, 8}},
		{"bound under the maximum", boundedInstance{bound: 5, bounded: true}, []int{1, 8}, []int{1, 5}},
		{"bound at one", boundedInstance{bound: 1, bounded: true}, []int{1, 8}, []int{1}},
		{"nothing fits", boundedInstance{bound: 0, bounded: true}, []int{1, 8}, nil},
		{"not a bounded kind", plainInstance{}, []int{1, 8}, []int{1, 8}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := withinMemory(tc.m, tc.sizes); !slices.Equal(got, tc.want) {
				t.Errorf("withinMemory = %v, want %v", got, tc.want)
			}
		})
	}
}
