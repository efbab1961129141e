//go:build !race

package limiter

// raceEnabled: see race_test.go.
const raceEnabled = false
