package simgpu

import (
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// batchJob is a below-normal-sized kernel that fills the device: 100 ms of
// kernels at saturation 1, blocks of 1 ms, no launch, no bandwidth.
var batchJob = Model{Name: "batch", Fixed: 100 * time.Millisecond, Saturation: 1, Weights: 100 * mib, ActivationPerItem: mib, Block: time.Millisecond}

// service is a latency-critical kernel: 10 ms at saturation 0.5.
var service = Model{Name: "service", Fixed: 10 * time.Millisecond, Saturation: 0.5, Weights: 100 * mib, ActivationPerItem: mib}

// warm runs one execution of each client so that later ones pay no
// warm-up (the models have none, but the arena grows once).
func warm(t *testing.T, cs ...*Client) {
	t.Helper()
	for _, c := range cs {
		execute(t, c, 1)
	}
}

// A normal kernel arriving while a below-normal kernel's blocks fill the
// device waits for them to end (its next block boundary: at most one
// Block), then runs on the SMs it wants as if alone, while the
// below-normal kernel goes on with what it leaves. Without priority the two
// split the oversubscribed SMs in proportion and the service runs at a
// third of the device.
func TestPriorityNormalWaitsAtMostOneBlock(t *testing.T) {
	for _, tc := range []struct {
		name         string
		be           Priority
		offset       time.Duration // when the service's execution arrives
		service, job time.Duration
	}{
		// 2.4 ms into the batch kernel: the blocks running end at 3 ms,
		// 0.6 ms later. The service then runs 10 ms on half the SMs;
		// the batch kernel does 5 ms of its work on the other half.
		{"below-normal, mid-block", PriorityBelowNormal, 2400 * time.Microsecond, 10600 * time.Microsecond, 105 * time.Millisecond},
		// On a boundary: no wait at all.
		{"below-normal, on a boundary", PriorityBelowNormal, 3 * time.Millisecond, 10 * time.Millisecond, 105 * time.Millisecond},
		// Both normal: demands 0.5 + 1 share the device in proportion,
		// the service at 1/3 (15 ms), the batch at 2/3 meanwhile.
		{"both normal", PriorityNormal, 2400 * time.Microsecond, 15 * time.Millisecond, 105 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				d := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30}).Devices()[0]
				job := start(t, d, ClientSpec{Name: "batch", Priority: tc.be, Model: batchJob})
				svc := start(t, d, ClientSpec{Name: "service", Model: service})
				warm(t, job, svc)
				var wg sync.WaitGroup
				var jobTook time.Duration
				wg.Go(func() { jobTook = execute(t, job, 1) })
				time.Sleep(tc.offset)
				svcTook := execute(t, svc, 1)
				wg.Wait()
				if !near(svcTook, tc.service) {
					t.Errorf("service took %v, want %v", svcTook, tc.service)
				}
				if tc.be == PriorityBelowNormal && svcTook > service.Time(1, 1)+batchJob.Block {
					t.Errorf("service took %v: more than one block (%v) over its time alone (%v)", svcTook, batchJob.Block, service.Time(1, 1))
				}
				if !near(jobTook, tc.job) {
					t.Errorf("batch took %v, want %v", jobTook, tc.job)
				}
			})
		})
	}
}

// A below-normal client takes every SM normal work leaves: alone it runs
// as fast as a normal client, and beside a service that uses 0.3 of the
// device it gets the other 0.7, so the device stays full.
func TestPriorityBelowNormalFillsIdleSMs(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30}).Devices()[0]
		job := start(t, d, ClientSpec{Name: "batch", Priority: PriorityBelowNormal, Model: batchJob})
		small := service
		small.Saturation = 0.3
		small.Fixed = 200 * time.Millisecond
		svc := start(t, d, ClientSpec{Name: "service", Percentage: 30, Model: small})
		warm(t, job, svc)
		if got := execute(t, job, 1); !near(got, batchJob.Time(1, 1)) {
			t.Errorf("alone below normal: %v, want %v as a normal client", got, batchJob.Time(1, 1))
		}
		var wg sync.WaitGroup
		var svcTook time.Duration
		sm0, t0 := d.SMSeconds(), time.Now()
		wg.Go(func() { svcTook = execute(t, svc, 1) })
		jobTook := execute(t, job, 1) // on 0.7 of the device: 100/0.7 ms
		if want := time.Duration(float64(batchJob.Fixed) / 0.7); !near(jobTook, want) {
			t.Errorf("beside a 0.3 service: %v, want %v (the 0.7 it leaves)", jobTook, want)
		}
		if util := (d.SMSeconds() - sm0) / time.Since(t0).Seconds(); util < 0.999 {
			t.Errorf("SM utilisation %.3f while both ran, want 1", util)
		}
		wg.Wait()
		if !near(svcTook, small.Time(1, 0.3)) {
			t.Errorf("service %v, want %v: below-normal work does not slow it", svcTook, small.Time(1, 0.3))
		}
	})
}

// Below-normal clients split what normal work leaves among themselves in
// proportion, as normal ones split the device; a hung below-normal kernel
// never reaches a block boundary and keeps its SMs.
func TestPriorityHungBelowNormalKeepsItsSMs(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30}).Devices()[0]
		half := batchJob
		half.Saturation = 0.5
		job := start(t, d, ClientSpec{Name: "batch", Priority: PriorityBelowNormal, Model: half})
		svc := start(t, d, ClientSpec{Name: "service", Model: service})
		warm(t, job, svc)
		job.Hang()
		go job.Execute(t.Context(), 1)
		time.Sleep(time.Millisecond)
		// Half the device is free: the service (demand 0.5) runs alone.
		if got := execute(t, svc, 1); !near(got, 10*time.Millisecond) {
			t.Errorf("service beside a hung half: %v, want 10ms", got)
		}
		full := service
		full.Saturation = 1
		big := start(t, d, ClientSpec{Name: "big", Model: full})
		warm(t, big)
		// It wants the whole device; the hung kernel keeps its half.
		if got := execute(t, big, 1); !near(got, 20*time.Millisecond) {
			t.Errorf("whole-device service beside a hung half: %v, want 20ms", got)
		}
		job.Close()
	})
}

// Without a daemon nothing reads the priority: the clients time-slice.
func TestPriorityIgnoredWithoutDaemon(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30, NoDaemon: true}).Devices()[0]
		job := start(t, d, ClientSpec{Name: "batch", Priority: PriorityBelowNormal, Model: batchJob})
		svc := start(t, d, ClientSpec{Name: "service", Model: service})
		warm(t, job, svc)
		go job.Execute(t.Context(), 1)
		time.Sleep(2400 * time.Microsecond)
		if got := execute(t, svc, 1); !near(got, 20*time.Millisecond) {
			t.Errorf("service time-sliced with the batch: %v, want 20ms (half the time)", got)
		}
	})
}

func TestPriorityOutOfRange(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30}).Devices()[0]
		if _, err := d.StartClient(t.Context(), ClientSpec{Name: "x", Priority: 2, Model: service}); err == nil {
			t.Error("priority 2 started")
		}
	})
}
