package qos

// calibration scales admission's room for the predictions' error (tail)
// by what became of the requests admitted with it, for one model: the
// room is a forecast that a request admitted behind a backlog finishes by
// its deadline, and the outcomes check it. A refusal for room is only
// worth its 429 when admitted requests would otherwise end late, and
// that is what the gain learns.
//
// The gain starts at 1 (the room as the window reads it, at least the
// queue predicted). It moves up a
// step of 1-calibrationTarget for each miss it counts (below) and down a
// step of calibrationTarget for each request of the model served by its
// deadline, between 0 and maxCalibrationGain: it settles where about
// calibrationTarget of the requests miss, or at 0 (the mean alone
// decides) where fewer miss without any room. Both failures of the
// window's room come from the window standing for the wrong time:
//   - beside two CPU burners under a 4x overload the executions took 5
//     to 12 times their predictions, swinging within a second, and the
//     room, at most twice the queue, let admission fill the SLO with
//     queues that took several times as long to run: about as many of
//     the admitted were dropped at their deadline as were served
//     (TestE2EAdmissionBusyHost). The gain rises until they are not
//     (TestSlowHostOverloadAdmittedServed).
//   - a closed loop of sixteen clients sees its requests through while
//     the window's stalls, or a drift the window still remembers, ask for
//     more room than the queue will take: the room refused requests the
//     model then had the capacity to serve (429s below capacity). Served
//     on time, they bring the gain down (TestStalledClosedLoopNotRefused).
//
// Not every miss is admission's: a miss counts only when the request was
// admitted near the limit the room set, so near that a gain of at most
// twice the current one, and half the window's room more, would have
// refused it. A request admitted with far more slack than that missed
// for something no refusal would have avoided: a stall of the runner as
// long as the SLO drops a closed loop's whole queue, and refusing the
// next request only sends its client back at once. And misses count
// once for each execution that overran (blameLocked): the requests
// dropped while it ran, and its own batch ending late, share one cause.
type calibration struct {
	offset float64 // the gain minus 1: the zero value is a gain of 1
}

const (
	// calibrationTarget is the share of the requests served or missed
	// that the gain lets miss (counted once an execution: more miss,
	// 0.94% under overload on the busy host of
	// TestBusyHostOverloadAdmittedOnTime, 1.46% at a target of 0.5%).
	calibrationTarget = 0.002
	// calibrationStep sets how fast the gain moves: up about 0.1 a miss
	// counted, down 0.0002 a request served (from 1 to 0 in 5,000).
	calibrationStep = 0.1
	// maxCalibrationGain bounds the gain: admission then leaves room
	// for executions at least 17 times their predictions (the room it
	// scales is at least the queue).
	maxCalibrationGain = 16
	// nearGain is the room, in the window's, beyond twice the current
	// gain's within which a missed request counts as admitted near the
	// limit: from a gain of 0, a miss counts when half the window's room
	// would have refused it.
	nearGain = 0.5
)

// gain is the factor admission multiplies the window's room by.
func (c *calibration) gain() float64 { return 1 + c.offset }

// near reports whether a request admitted with slack for need times the
// window's room counts when it misses.
func (c *calibration) near(need float64) bool { return need < 2*c.gain()+nearGain }

// missed moves the gain up for one cause of misses counted.
func (c *calibration) missed() { c.move(calibrationStep * (1 - calibrationTarget)) }

// served moves the gain down for a request served by its deadline.
func (c *calibration) served() { c.move(-calibrationStep * calibrationTarget) }

func (c *calibration) move(step float64) {
	c.offset = min(max(c.offset+step, -1), maxCalibrationGain-1)
}
