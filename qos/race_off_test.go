//go:build !race

package qos

// raceEnabled: see race_on_test.go.
const raceEnabled = false
