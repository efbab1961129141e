// Package predictor holds the latency and load models of sloserve's control
// loop.
//
// Latency: Sweep profiles a model over batch sizes, compute shares and
// input shapes, Fit fits the curve t(b, s, n) = (K1*w^2 + K2*w + K6*b +
// K3)/(s + K4) + K5, w = b*n/Elements, to the points (n is a row's size in
// elements; one shape gives w = b),
// and Cache keeps the resulting Profile on disk under a Key made of the model
// file's hash, the machine and the runtime settings, so that a restart does
// not profile again. A point is the median of windows taken in rounds over
// its batch's shapes, so that the machine's drift during a sweep moves
// every shape alike. Sweep measures again a point slower than the same
// batch at a smaller share, or more than OutlierRatio slower than the
// curve fitted to all points (it was disturbed). Where the profile shows a
// knee, a share past which a batch ran no faster (a GPU model whose kernels
// cannot fill the device), predictions clamp the share at it: the smooth
// curve would otherwise promise speed-ups no share gives; for the same
// reason no prediction goes past the largest profiled share (a sweep
// stops short of the whole device where no more share is of use: one
// intra-op thread on two CPUs). Where the sweep
// reads the instance's peak memory after each point, the profile also holds
// each batch size's working set (Predictor.WorkingSet), from which the
// control loop sizes memory shares.
//
// A Predictor holds each loaded model's curve and scales it by an online
// correction (an EWMA of observed/predicted execution time, per row size
// times an offset per batch class at that size; per (size, batch, share)
// bucket for drift alarms) and an interference
// factor: how oversubscribed the device is (SetInterference, on CPUs), or,
// on a shared GPU, the slowdown the co-running work causes, learned online
// per model as exp(slope x u) from the others' measured use u of the
// device each control period (SetCoRunning; see corun.go). It answers the QoS scheduler
// as its SizedEstimator at the model's current share and each request's
// size, and the adjuster through Latency at any share and the model's
// typical size. Until a model has a curve it falls back to an EWMA of the
// observed time per row size and batch size.
//
// Load: from samples of each model's cumulative arrival counter the
// Predictor forecasts the arrival rate with Holt's linear smoothing, adding
// a seasonal (by default daily) component once two full seasons of history
// exist.
//
// It imports no other sloserve package and must not act on what it
// predicts: choosing and applying shares belongs to the qos adjuster and the
// limiter.
package predictor
