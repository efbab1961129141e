// Package runtime runs model instances. By default each instance is a
// runner process (the hidden `sloserve runner` subcommand, RunnerMain) that
// hosts one ONNX Runtime session. The server side, Runner, starts that
// process, supervises it (restarts with backoff, kills it when it hangs)
// and carries requests to it: tensors through a shared-memory arena the
// process inherits, descriptors (runnerpb messages) in a mailbox of
// futex-woken slots after the arena (runner_mailbox.go) or, when they do
// not fit, framed on a Unix socket pair it inherits too, which also tells a
// dead runner; Describe and health checks are gRPC on a Unix socket. A model that opts in runs instead as an InProcess instance, an
// ONNX Runtime session inside the server; only those load ONNX Runtime in
// the server process, once for all of them.
//
// On a simulated GPU (package simgpu) an instance is a Simulated instead:
// an MPS client of the simulator, started with the limiter's placement,
// that waits for the simulated execution time and answers zeros of the
// model's output shapes (read from the model file by ReadSignature, without
// ONNX Runtime). Its outputs are not the model's.
//
// Tensors travel as flat little-endian buffers (Tensor). The runner checks
// them against the model before ONNX Runtime sees them and wraps fixed-size
// data in place; errors come back as ErrInvalidTensor, ErrInference or
// ErrUnavailable. The server trusts no descriptor a runner sends back: each
// is checked against the call's part of the arena.
//
// A Pool holds the instances of one model version and their execution
// slots: a scheduler executes on it directly (Pool.Execute picks an instance
// that can serve, calls it under the call timeout and retries once on
// another when it died or hung), and Pool.Replace swaps an instance for one
// the caller started elsewhere (another share, another device) without
// failing a request. The caller starts and stops instances; the pool only
// chooses among them.
//
// It must not schedule requests or know about SLOs and shares beyond the
// limiter settings a runner is started with: admission, ordering, batching
// and counting belong to qos, and starting instances in limiter units to
// models.
package runtime
