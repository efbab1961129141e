// Package predictor holds the latency and load models of sloserve's control
// loop.
//
// Latency: Sweep profiles a model over batch sizes and compute shares, Fit
// fits the curve t(b, s) = (K1*b^2 + K2*b + K3)/(s + K4) + K5 to the points,
// and Cache keeps the resulting Profile on disk under a Key made of the model
// file's hash, the machine and the runtime settings, so that a restart does
// not profile again. Sweep measures again a point slower than the same
// batch at a smaller share (it was disturbed). Where the profile shows a
// knee, a share past which a batch ran no faster (a GPU model whose kernels
// cannot fill the device), predictions clamp the share at it: the smooth
// curve would otherwise promise speed-ups no share gives.
//
// A Predictor holds each loaded model's curve and scales it by an online
// correction (an EWMA of observed/predicted execution time) and an
// interference factor (how oversubscribed the device is). It answers the
// QoS scheduler as its Estimator at the model's current share, and the
// adjuster through Latency at any share. Until a model has a curve it falls
// back to an EWMA of the observed time per batch size.
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
