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
// Admission happens in one place, at a request's arrival: a Gate shared by
// the schedulers of every device bounds the requests and input bytes in
// flight (ErrOverloaded), then the queue's capacity (ErrQueueFull) and the
// deadline (ErrRejected); Preadmit asks the same questions before a
// request's body is read.
//
// Execution times come from an Estimator (EWMAEstimator by default, seeded
// with Warmup); every execution feeds it. Every request's outcome (good,
// late, rejected, dropped, failed, canceled, and invalid for requests the
// caller refused before submitting them, CountInvalid) is counted here once,
// per model, with goodput and SLO attainment over a sliding window, Triton's
// statistics (Stats) and as Prometheus metrics.
//
// Scheduler.Snapshot and Scheduler.ModelState give the control loop
// (package control) what it reads of each model: arrivals, queue, window
// attainment, the variability of arrivals and executions.
//
// It must not touch processes, cgroups or the wire, nor choose shares:
// requests run through the Executor it is given, and
// errors leave as sentinel errors that api maps to status codes.
package qos
