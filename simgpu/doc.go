// Package simgpu is a simulated GPU with CUDA MPS semantics, for tests,
// benchmarks and demos of the GPU control path on machines without a GPU.
//
// A Sim has N devices, each with a number of SMs and device memory. Work
// reaches a device through MPS clients (StartClient): a client's active
// thread percentage and pinned device memory limit are fixed when it
// starts, as CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and
// CUDA_MPS_PINNED_DEVICE_MEM_LIMIT are for a real client, so a resize is a
// new client. Starting a client costs context creation time and memory and
// loading the weights; the first execution at each batch size costs a
// warm-up. An execution takes the time of a calibrated curve of batch size
// and SM share with a per-model saturation point, slowed when the clients
// running at the same moment oversubscribe the device's SMs and by a
// memory-bandwidth interference term (a kernel's bandwidth follows the SMs
// it runs on, as its work per second does). Device memory runs out: context,
// weights and each client's arena count, shadows included. Faults behave as
// MPS's do: a fatal error in one client takes down every client on its
// device until the control daemon restarts; a client can hang while holding
// its SMs. Without a running control daemon percentages are ignored and
// clients time-slice the device, as on a real GPU.
//
// The simulator never computes: an execution waits (timers) for its
// simulated time, so many models on several simulated devices run on two
// cores, and under testing/synctest a simulated day passes in seconds.
// Readings come out through go-nvml's nvml.Interface (NVML), the interface
// the limiter reads real GPUs through.
//
// Its numbers are a model, not measurements: each constant says where it
// comes from or that it is an assumption. It must not import the server's
// packages; runtime and limiter adapt to it, not it to them.
package simgpu
