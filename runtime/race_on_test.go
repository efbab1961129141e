//go:build race

package runtime

// raceEnabled: the test binary, and so a runner it starts as its child,
// runs under the race detector.
const raceEnabled = true
