// Package runtime runs model instances. By default each instance is a
// runner process (the hidden `sloserve runner` subcommand, RunnerMain) that
// hosts one ONNX Runtime session. The server side, Runner, starts that
// process, supervises it (restarts with backoff, kills it when it hangs)
// and carries requests to it: tensors through a shared-memory arena the
// process inherits, descriptors (runnerpb messages) framed on a Unix socket
// pair it inherits too; Describe and health checks are gRPC on a Unix
// socket. A model that opts in runs instead as an InProcess instance, an
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
// It must not schedule requests or know about SLOs and shares beyond the
// limiter settings a runner is started with: admission, ordering and
// batching belong to qos, and which instance serves a request to models.
package runtime
