//go:build race

package qos

// raceEnabled: the test binary runs with the race detector, which slows
// the pure simulations of the bound tests several times over.
const raceEnabled = true
