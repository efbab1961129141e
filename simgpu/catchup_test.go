package simgpu

import (
	"math"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// The device's timer runs on the host and fires late when the host's CPU
// is busy (the real binary on two shared cores: a Go timer of 1-5 ms
// fired 0.3 ms late at the median, 8.7 ms at p99 on the development
// machine at load 9). A GPU does not wait for its host: the SMs a
// below-normal kernel holds go to normal work at the kernel's block
// boundary, and a kernel that ends gives its SMs to the others then,
// however late the host hears of it. So a late timer delays only the
// news of an end, once, not each event on the way to it: a service that
// arrives during a batch kernel's block, after a launch, is late by the
// timer's slack once (not once for its launch, once for the batch's
// yield and once for its end), the batch kernel too, and what each client
// held of the device is the same as with a timer on time.
func TestLateTimerDelaysOnlyTheNews(t *testing.T) {
	launched := service
	launched.Launch = 500 * time.Microsecond
	type run struct {
		svc, job   time.Duration
		svcSM, jSM float64
	}
	day := func(t *testing.T, slack time.Duration) (r run) {
		synctest.Test(t, func(t *testing.T) {
			d := newSim(t, Spec{Devices: 1, SMs: 100, Memory: 16 << 30}).Devices()[0]
			job := start(t, d, ClientSpec{Name: "batch", Priority: PriorityBelowNormal, Model: batchJob})
			svc := start(t, d, ClientSpec{Name: "service", Model: launched})
			warm(t, job, svc)
			d.SetHostLateness(func() time.Duration { return slack })
			sm0, jsm0 := svc.SMSeconds(), job.SMSeconds()
			var wg sync.WaitGroup
			wg.Go(func() { r.job = execute(t, job, 1) })
			time.Sleep(2400 * time.Microsecond)
			r.svc = execute(t, svc, 1)
			wg.Wait()
			time.Sleep(50 * time.Millisecond)
			r.svcSM, r.jSM = svc.SMSeconds()-sm0, job.SMSeconds()-jsm0
		})
		return r
	}
	onTime := day(t, 0)
	// On time: the launch (0.5 ms) ends at 2.9 ms, the batch's blocks at
	// 3 ms, then 10 ms on half the SMs; the batch does 5 ms of its work on
	// the other half meanwhile.
	if want := 10600 * time.Microsecond; !near(onTime.svc, want) {
		t.Fatalf("service on time took %v, want %v", onTime.svc, want)
	}
	if want := 105 * time.Millisecond; !near(onTime.job, want) {
		t.Fatalf("batch on time took %v, want %v", onTime.job, want)
	}
	for _, slack := range []time.Duration{time.Millisecond, 3 * time.Millisecond, 20 * time.Millisecond} {
		t.Run(slack.String(), func(t *testing.T) {
			late := day(t, slack)
			if late.svc < onTime.svc || late.svc > onTime.svc+slack+time.Microsecond {
				t.Errorf("service took %v with the timer %v late, want %v to %v (the news of its end late once)",
					late.svc, slack, onTime.svc, onTime.svc+slack)
			}
			if late.job < onTime.job || late.job > onTime.job+slack+time.Microsecond {
				t.Errorf("batch took %v with the timer %v late, want %v to %v", late.job, slack, onTime.job, onTime.job+slack)
			}
			if math.Abs(late.svcSM-onTime.svcSM) > 1e-6 || math.Abs(late.jSM-onTime.jSM) > 1e-6 {
				t.Errorf("SM-seconds service %.6f, batch %.6f with the timer late; %.6f, %.6f on time: the device must not wait for its host",
					late.svcSM, late.jSM, onTime.svcSM, onTime.jSM)
			}
		})
	}
}
