//go:build race

package limiter

// raceEnabled: the runners the tests start are this race-instrumented
// binary, whose ThreadSanitizer maps far more data than a runner does.
const raceEnabled = true
