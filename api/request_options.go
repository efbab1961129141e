package api

import (
	"math"
	"strconv"
	"time"
)

// A request's own scheduling options, read by both protocols:
//   - "timeout" (request parameter): an integer number of microseconds > 0,
//     as in Triton;
//   - "priority" (request parameter): an integer >= 0, as in Triton: 0 is the
//     model's default, 1 the highest, 2 the next;
//   - Inference-Timeout-Ms (REST header): a decimal number of milliseconds
//     > 0, fractions allowed, for clients that cannot set parameters.
//
// The request's deadline is its arrival plus the shortest timeout given; a
// gRPC client's own deadline reaches the scheduler through the context.

// Names of the request parameters and header that carry the options.
const (
	paramTimeout        = "timeout"
	paramPriority       = "priority"
	headerTimeoutMillis = "Inference-Timeout-Ms"
)

// maxRequestTimeout is the longest timeout a request may ask for. Longer ones
// are refused rather than capped: they are almost certainly a unit mistake
// (nanoseconds sent as microseconds), and a deadline an hour away schedules
// like none.
const maxRequestTimeout = time.Hour

// maxTimeoutMicros is maxRequestTimeout in the unit of the timeout parameter.
const maxTimeoutMicros = uint64(maxRequestTimeout / time.Microsecond)

// timeoutFromMicros converts a timeout parameter of us microseconds (neg:
// the value is negative). problem says what is wrong, or is "" when the
// timeout is valid.
func timeoutFromMicros(neg bool, us uint64) (d time.Duration, problem string) {
	switch {
	case neg || us == 0:
		return 0, "must be an integer number of microseconds greater than 0"
	case us > maxTimeoutMicros:
		return 0, "must be at most " + strconv.FormatUint(maxTimeoutMicros, 10) +
			" microseconds (" + maxRequestTimeout.String() + ")"
	}
	return time.Duration(us) * time.Microsecond, ""
}

// priorityFromUint converts a priority parameter of magnitude p (neg: the
// value is negative). problem says what is wrong, or is "" when the priority
// is valid.
func priorityFromUint(neg bool, p uint64) (v int, problem string) {
	switch {
	case neg && p != 0:
		return 0, "must be an integer >= 0"
	case p > math.MaxInt:
		return 0, "must be at most " + strconv.Itoa(math.MaxInt)
	}
	return int(p), ""
}

// parseTimeoutMillis parses the Inference-Timeout-Ms header: digits with at
// most one decimal point, greater than 0 and at most maxRequestTimeout.
// Exponents, signs, "Inf" and "NaN" are refused; the value is rounded to
// the nanosecond. problem says what is wrong, or is "" when s is valid.
func parseTimeoutMillis(s string) (d time.Duration, problem string) {
	const notPositive = "must be a decimal number of milliseconds greater than 0"
	digits, dot := 0, false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c >= '0' && c <= '9':
			digits++
		case c == '.' && !dot:
			dot = true
		default:
			return 0, notPositive
		}
	}
	if digits == 0 {
		return 0, notPositive
	}
	// The syntax is checked, so ParseFloat can only fail on range.
	ms, err := strconv.ParseFloat(s, 64)
	if err != nil || ms > float64(maxRequestTimeout/time.Millisecond) {
		return 0, "must be at most " + strconv.FormatInt(int64(maxRequestTimeout/time.Millisecond), 10) +
			" milliseconds (" + maxRequestTimeout.String() + ")"
	}
	d = time.Duration(math.Round(ms * float64(time.Millisecond)))
	if d <= 0 {
		return 0, notPositive
	}
	return d, ""
}

// requestDeadline is arrival plus the shortest of the timeouts that are set
// (> 0), or the zero time when none is.
func requestDeadline(arrival time.Time, a, b time.Duration) time.Time {
	switch {
	case a <= 0 && b <= 0:
		return time.Time{}
	case a <= 0:
		return arrival.Add(b)
	case b <= 0:
		return arrival.Add(a)
	}
	return arrival.Add(min(a, b))
}
