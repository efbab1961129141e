//go:build race

package qos

// raceEnabled: the test binary runs with the race detector, which slows
// the measurements of the bound tests (bound_test.go) tenfold.
const raceEnabled = true
