//go:build race

package loadtest

// raceEnabled: the race detector is on, which allocates beside the code
// under test and drops a quarter of what goes back to a sync.Pool, so heap
// counts do not measure the code.
const raceEnabled = true
