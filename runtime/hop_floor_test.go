package runtime

import (
	"fmt"
	"os"
	"os/exec"
	goruntime "runtime"
	"slices"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// BenchmarkHopFloor measures what one round trip between two processes
// costs on this machine, with nothing of ours in it: the floor under the
// runner hop. The peer is this test binary run again (hopPeerEnv); the
// two share one page (a memfd) or a Unix socket pair, and each round trip
// carries one counter there and back:
//   - "futex": each side sleeps on a futex word until the other writes it
//     and wakes it, as the mailbox does when neither side polls (one
//     cross-process wake-up each way);
//   - "spin": each side reads the other's word until it changes, as the
//     mailbox does when both sides poll (no system call; a CPU each);
//   - "socket": a byte each way on a blocking Unix socket pair, as the
//     runner's socket does under Go's poller, without the poller.
//
// "futex/gap=300µs" waits 300 µs (polling) before each round trip, so that
// the peer has slept that long before it is woken, as a runner's worker
// between the calls of ServerOverhead; back to back, a woken thread's CPU
// has not gone idle yet.
//
// It reports the median round trip (p50-µs) and the 90th percentile; run
// it with -count and take the median of the runs.
func BenchmarkHopFloor(b *testing.B) {
	for _, tt := range []struct {
		mode string
		gap  time.Duration
	}{{"futex", 0}, {"spin", 0}, {"socket", 0}, {"futex", 300 * time.Microsecond}} {
		name := tt.mode
		if tt.gap > 0 {
			name += fmt.Sprintf("/gap=%v", tt.gap)
		}
		b.Run(name, func(b *testing.B) {
			ping := startHopPeer(b, tt.mode)
			for range 2000 { // warm both sides up
				ping()
			}
			ds := make([]time.Duration, 0, 1<<16)
			for b.Loop() {
				if tt.gap > 0 {
					// This side busy, the peer asleep for the gap, as a
					// runner between a server's calls.
					for t0 := time.Now(); time.Since(t0) < tt.gap; {
					}
				}
				t0 := time.Now()
				ping()
				ds = append(ds, time.Since(t0))
			}
			b.StopTimer()
			slices.Sort(ds)
			b.ReportMetric(float64(ds[len(ds)/2].Nanoseconds())/1e3, "p50-µs")
			b.ReportMetric(float64(ds[len(ds)*9/10].Nanoseconds())/1e3, "p90-µs")
		})
	}
}

// hopPeerEnv makes the test binary the peer of BenchmarkHopFloor, in the
// mode it names, on the file it inherits as descriptor 3.
const hopPeerEnv = "SLOSERVE_HOP_PEER"

func init() {
	if mode := os.Getenv(hopPeerEnv); mode != "" {
		os.Exit(runHopPeer(mode))
	}
}

// The hop's shared page: the caller's word and the peer's, a cache line
// apart so that neither side's writes move the line the other polls.
const (
	hopPingOff = 0
	hopPongOff = 64
	hopPage    = 4096
)

// startHopPeer starts the peer process in mode and returns one round
// trip to it; the peer is killed when the benchmark ends.
func startHopPeer(b *testing.B, mode string) (ping func()) {
	b.Helper()
	var file *os.File
	var mem []byte
	switch mode {
	case "futex", "spin":
		fd, err := unix.MemfdCreate("sloserve-hop-floor", 0)
		if err != nil {
			b.Fatal(err)
		}
		file = os.NewFile(uintptr(fd), "hop-floor")
		if err := file.Truncate(hopPage); err != nil {
			b.Fatal(err)
		}
		if mem, err = syscall.Mmap(fd, 0, hopPage, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = syscall.Munmap(mem) })
	case "socket":
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
		if err != nil {
			b.Fatal(err)
		}
		file = os.NewFile(uintptr(fds[1]), "hop-floor-peer")
		mine := fds[0]
		b.Cleanup(func() { _ = unix.Close(mine) })
		buf := make([]byte, 1)
		ping = func() {
			if _, err := unix.Write(mine, buf); err != nil {
				b.Fatal(err)
			}
			if n, err := unix.Read(mine, buf); err != nil || n != 1 {
				b.Fatalf("read from the peer: %d, %v", n, err)
			}
		}
	}
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), hopPeerEnv+"="+mode)
	cmd.ExtraFiles = []*os.File{file}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	file.Close()
	b.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	if ping != nil {
		return ping
	}
	pingW := (*uint32)(unsafe.Pointer(&mem[hopPingOff]))
	pongW := (*uint32)(unsafe.Pointer(&mem[hopPongOff]))
	var k uint32
	if mode == "futex" {
		return func() {
			k++
			atomic.StoreUint32(pingW, k)
			futexWake(pingW, 1)
			for atomic.LoadUint32(pongW) != k {
				futexWait(pongW, k-1, time.Second)
			}
		}
	}
	// The benchmark's goroutine polls on a thread of its own (it ends
	// with the benchmark, and the thread with it).
	goruntime.LockOSThread()
	return func() {
		k++
		atomic.StoreUint32(pingW, k)
		for atomic.LoadUint32(pongW) != k {
		}
	}
}

// runHopPeer answers the round trips of BenchmarkHopFloor in mode until
// it is killed.
func runHopPeer(mode string) int {
	if mode == "socket" {
		buf := make([]byte, 1)
		for {
			if n, err := unix.Read(3, buf); err != nil || n != 1 {
				return 1
			}
			if _, err := unix.Write(3, buf); err != nil {
				return 1
			}
		}
	}
	mem, err := syscall.Mmap(3, 0, hopPage, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		fmt.Fprintln(os.Stderr, "hop peer:", err)
		return 2
	}
	pingW := (*uint32)(unsafe.Pointer(&mem[hopPingOff]))
	pongW := (*uint32)(unsafe.Pointer(&mem[hopPongOff]))
	goruntime.LockOSThread()
	var k uint32
	for {
		if mode == "futex" {
			for atomic.LoadUint32(pingW) == k {
				futexWait(pingW, k, time.Second)
			}
		} else {
			for atomic.LoadUint32(pingW) == k {
			}
		}
		k = atomic.LoadUint32(pingW)
		atomic.StoreUint32(pongW, k)
		if mode == "futex" {
			futexWake(pongW, 1)
		}
	}
}
