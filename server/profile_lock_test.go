package server

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"
)

// One profile sweep runs on a GPU at a time (two models profiled together
// measured each other's kernels); CPU sweeps and other GPUs' do not wait.
func TestProfilerSerialisesSweepsPerGPU(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := &profiler{}
		unlock, err := p.lockDevice(t.Context(), "cuda:0")
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan string, 3)
		for _, dev := range []string{"cuda:0", "cuda:1", "cpu"} {
			go func() {
				u, err := p.lockDevice(t.Context(), dev)
				if err != nil {
					t.Error(err)
					return
				}
				got <- dev
				u()
			}()
		}
		synctest.Wait()
		if n := len(got); n != 2 {
			t.Fatalf("%d sweeps went ahead while cuda:0 was held, want 2 (cuda:1 and cpu)", n)
		}
		<-got
		<-got
		time.Sleep(time.Second)
		unlock()
		synctest.Wait()
		if dev := <-got; dev != "cuda:0" {
			t.Errorf("after the release %s went, want cuda:0", dev)
		}
		// A wait ends with its context.
		hold, _ := p.lockDevice(t.Context(), "cuda:0")
		defer hold()
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		if _, err := p.lockDevice(ctx, "cuda:0"); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("a wait past its context: %v", err)
		}
	})
}
