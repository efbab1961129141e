// Package device holds one execution device ("cpu", "cuda:N") and the
// parts that act on it alone: its limiter (chosen from the control config
// and what the backend can do), its QoS scheduler, its adjuster and the
// actuator through which the adjuster's shares reach the models on it, and
// the sampling of each model's use of the device (for the predictor's
// interference factor and the adjuster's view of what a model uses).
//
// A Device is built by New and runs its loops in Run until the context
// ends; Close then removes its limiter's units. It reads the models on it
// through Models (the registry implements it) and asks its limiter what
// it can do (limiter.Capabilities), never what it is.
//
// The devices of a server are built together at start (NewSet: the CPU
// and each GPU) and closed in reverse (Set.Close); their control loops
// (NewLoops) are built on the registry once it exists. Placement across
// GPUs (Placement, gpu.placement) reads the loops and the registry and
// moves models; the device-fault recovery (Recovery) restarts a faulted
// GPU's daemon through limiter.DaemonRestarter and its instances, known
// only through FaultDomain and Recoverable (no simulator type).
//
// It must not assemble the server, serve the wire, or load models: server
// builds the devices and models applies the shares they choose.
package device
