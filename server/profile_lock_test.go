package server

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"
)

// One profile sweep runs on a device at a time, the CPU as a GPU (two
// models profiled together measured each other); other devices' sweeps do
// not wait.
func TestProfilerSerialisesSweepsPerDevice(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := &profiler{}
		unlock, err := p.lockDevice(t.Context(), "cuda:0")
		if err != nil {
			t.Fatal(err)
		}
		cpu, err := p.lockDevice(t.Context(), "cpu")
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan string, 4)
		for _, dev := range []string{"cuda:0", "cuda:1", "cpu", "cpu"} {
			go func() {
				u, err := p.lockDevice(t.Context(), dev)
				if err != nil {
					t.Error(err)
					return
				}
				got <- dev
				time.Sleep(time.Second) // the sweep
				u()
			}()
		}
		synctest.Wait()
		if n := len(got); n != 1 {
			t.Fatalf("%d sweeps went ahead while cuda:0 and cpu were held, want 1 (cuda:1)", n)
		}
		if dev := <-got; dev != "cuda:1" {
			t.Fatalf("%s went while cuda:0 and cpu were held, want cuda:1", dev)
		}
		time.Sleep(time.Second)
		unlock()
		synctest.Wait()
		if dev := <-got; dev != "cuda:0" || len(got) != 0 {
			t.Errorf("after cuda:0's release %s went (%d more), want cuda:0 alone", dev, len(got))
		}
		// The CPU's two waiting sweeps go one after the other: the
		// second once the first's second is over.
		cpu()
		synctest.Wait()
		if n := len(got); n != 1 {
			t.Fatalf("%d cpu sweeps went at once after the cpu's release, want 1", n)
		}
		<-got
		time.Sleep(time.Second)
		synctest.Wait()
		if dev := <-got; dev != "cpu" {
			t.Errorf("after the first cpu sweep %s went, want the second", dev)
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
