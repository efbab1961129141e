package simgpu

import (
	"fmt"
	"sync"
	"testing"
	"time"
)

// BenchmarkExecute is the simulator's own cost per execution (the
// processor-sharing bookkeeping, timers, locks) with clients executing at
// once on one device: kernels of a microsecond, so the cost is what shows.
// It says how many simulated executions per second two cores can carry.
func BenchmarkExecute(b *testing.B) {
	m := Model{Name: "tiny", Fixed: time.Microsecond, Saturation: 0.5, Bandwidth: 0.1, Weights: mib, ActivationPerItem: mib}
	for _, clients := range []int{1, 8, 32} {
		b.Run(fmt.Sprintf("clients=%d", clients), func(b *testing.B) {
			sim, err := New(Spec{Devices: 1, SMs: 108, Memory: 64 << 30})
			if err != nil {
				b.Fatal(err)
			}
			d := sim.Devices()[0]
			cs := make([]*Client, clients)
			for i := range cs {
				// Starting a client waits its context creation: do it once.
				c := &Client{d: d, spec: ClientSpec{Name: fmt.Sprint(i), Percentage: 10, Model: m}, pid: sim.pid(), mps: true, warm: map[int]bool{1: true}, gone: make(chan struct{})}
				d.mu.Lock()
				d.clients[c] = true
				d.mu.Unlock()
				cs[i] = c
			}
			b.ReportAllocs()
			b.ResetTimer()
			var wg sync.WaitGroup
			per := b.N/clients + 1
			for _, c := range cs {
				wg.Go(func() {
					for range per {
						if _, err := c.Execute(b.Context(), 1); err != nil {
							b.Error(err)
							return
						}
					}
				})
			}
			wg.Wait()
		})
	}
}
