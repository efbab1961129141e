// Package qos schedules inference requests onto a device so that as many as
// possible finish within their model's SLO.
//
// A Scheduler serves one execution device (a GPU, or the CPU cores). Each
// model added to it has a queue, an SLO (latency target, class, priority)
// and an Executor that runs one possibly batched request on the model's
// instances. One goroutine, Run, owns dispatch: whenever a device slot and a
// model slot are free it picks the next batch.
//
// Under the default "qos" policy latency-critical requests go
// earliest-deadline-first; best-effort requests use the capacity
// latency-critical work leaves, apart from a small floor that keeps them from
// starving. A batch grows only while its predicted execution time still lets
// it finish before its most urgent member's deadline. Submit rejects a
// request whose predicted completion already misses its deadline
// (ErrRejected), and the dispatcher drops a queued request once it can no
// longer finish in time (ErrDropped): a request known to be late is never
// executed. The "fifo" policy is the plain baseline for benchmarks.
//
// Execution times come from an Estimator (EWMAEstimator by default, seeded
// with Warmup); every execution feeds it. Outcomes (good, late, rejected,
// dropped, failed, canceled) are counted per model, with goodput and SLO
// attainment over a sliding window (Stats) and as Prometheus metrics.
//
// An Adjuster sits beside each Scheduler and chooses every model's share of
// the device, once a period, under one of three policies: "adaptive" (the
// smallest share a Predictor says meets each latency-critical model's SLO
// at its forecast rate, the rest to best-effort models by priority, growth
// at once and shrinking after sustained slack), "static" (equal shares) and
// "shared" (no limits). An Actuator (the model registry) applies the
// shares; pins override the policy; idle models are evicted when memory is
// over budget. Every decision is an Event.
//
// It must not touch processes, cgroups or the wire: requests run through
// the Executor it is given, shares are applied through the Actuator, and
// errors leave as sentinel errors that api maps to status codes.
package qos
