//go:build !race

package loadtest

// raceEnabled: see race_on_test.go.
const raceEnabled = false
