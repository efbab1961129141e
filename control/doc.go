// Package control is the control loop: once a period, for each device, it
// reads every model's state from the device's qos.Scheduler, asks a
// Predictor for latency at a share and for the forecast arrival rate,
// chooses each model's share of the device's compute and memory, and has
// an Actuator (the model registry, which hands them to the limiter) apply
// them.
//
// An Adjuster serves one device under one of three policies (Policy,
// found by name with PolicyNamed; callers ask a policy what it does:
// Forecasts, Limits, Backgrounds): "adaptive"
// (each latency-critical model gets the smallest share a G/G/c model of its
// queue says meets its SLO quantile at the rate forecast one actuation
// ahead, overruled upward by observed misses; best-effort models share the
// rest), "static" (equal hard caps) and "shared" (no limits). Where the
// limiter has only caps (CapsOnly: MPS) latency-critical targets are held
// for a while, no share goes past the model's knee, the caps may add up to
// more than the device (MPS splits oversubscribed SMs), and best-effort
// growth waits, since every resize there starts a new client; where the
// caps-only limiter also has a background class (Background: MPS clients
// below normal priority) a busy best-effort model's cap is its largest
// share, a fill behind the latency-critical clients. The adaptive
// policy also sizes each model's memory share from the working set of the
// largest batch it is expected to run next (WorkingSetPredictor), never
// below what its instance holds (InstanceMemoryReader), growing at once and
// shrinking late; where shares are caps it follows the largest batch the
// model may run (a pinned limit is fixed for a client's life) and a shrink
// rides along with a compute resize.
// Pins override the policy; idle models are evicted when memory (use or
// memory shares) is over budget. Every decision is an Event, kept in an
// EventLog (the adjuster's, the placer's, and the server's device-fault
// recovery's are the same type). Isolation
// holds the models placement must keep apart from latency-critical ones
// (best-effort models that faulted their GPU repeatedly), which the
// server's device recovery marks.
//
// A Placer chooses which device (GPU) each model runs on: at load for a
// model whose config names none, and again when the mix drifts, weighing
// moves by how much they lower a placement cost (demand over capacity,
// memory with a shadow's headroom, risky best-effort models beside
// latency-critical ones, balance) and matching them so that a device takes
// part in one move per period; a Mover (the model registry) applies each
// move by a warm shadow.
//
// It must not run requests, order them or touch processes and cgroups: it
// reads the scheduler, predicts through the Predictor and acts through the
// Actuator and the Mover only.
package control
