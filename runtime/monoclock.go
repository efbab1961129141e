package runtime

import _ "unsafe" // go:linkname

// monoNanos is the host's monotonic clock (CLOCK_MONOTONIC) in
// nanoseconds: one clock for every process of the host, which no one
// steps or slews. The mailbox's stamps cross from the server to its
// runners and back, and were Unix nanoseconds: the wall clock, which the
// time service may step (by 15.4 s during one colocation run on this
// project's test machines, then slewed 5 ms a second: BENCHMARKS.md), and
// a step between two stamps made a call's parts in
// sloserve_runner_mailbox_seconds_total jump by it, or go backwards.
func monoNanos() int64 { return nanotime() }

// nanotime is the Go runtime's reading of CLOCK_MONOTONIC (through the
// vDSO on Linux, as cheap as time.Now), not shifted by the process's start:
// two processes read the same value at the same instant.
//
//go:linkname nanotime runtime.nanotime
func nanotime() int64
