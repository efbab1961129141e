package api

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"unicode/utf8"

	"google.golang.org/grpc/codes"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// Errors of the wire itself: requests that cannot be decoded.
var (
	// errBadRequest marks a request the protocol layer could not decode.
	errBadRequest = errors.New("bad request")
	// errTooLarge marks a body, message or tensor over a configured limit.
	errTooLarge = errors.New("request too large")
	// errUnsupportedEncoding marks a REST body in a Content-Encoding the
	// server does not decode.
	errUnsupportedEncoding = errors.New("unsupported content encoding")
	// errBodyTimeout marks a REST body that did not arrive in time.
	errBodyTimeout = errors.New("request timeout")
)

// statusOf maps an error from decoding or from the Backend to the HTTP status
// and gRPC code it is reported with. The scheduler's refusals: a request that
// would miss its deadline, finds its model's queue full or the server at its
// limit of requests in flight is 429 (the client may retry later or with a
// longer timeout), one dropped from the queue when its deadline passed is
// 504, one larger than its model's instance memory holds after waiting for
// it to grow is 503 (RESOURCE_EXHAUSTED), and a scheduler that cannot take the request (model unknown to it,
// being removed, or stopped) is 503.
func statusOf(err error) (int, codes.Code) {
	switch {
	case errors.Is(err, errUnsupportedEncoding):
		return http.StatusUnsupportedMediaType, codes.InvalidArgument
	case errors.Is(err, errBodyTimeout):
		return http.StatusRequestTimeout, codes.DeadlineExceeded
	case errors.Is(err, errTooManyConnections):
		return http.StatusServiceUnavailable, codes.Unavailable
	case errors.Is(err, errTooLarge), errors.Is(err, models.ErrTooLarge):
		return http.StatusRequestEntityTooLarge, codes.ResourceExhausted
	case errors.Is(err, qos.ErrNoMemory): // the instances' memory may grow: retry later
		return http.StatusServiceUnavailable, codes.ResourceExhausted
	case errors.Is(err, qos.ErrRejected), errors.Is(err, qos.ErrQueueFull), errors.Is(err, qos.ErrOverloaded),
		errors.Is(err, errMemory):
		return http.StatusTooManyRequests, codes.ResourceExhausted
	case errors.Is(err, qos.ErrDropped):
		return http.StatusGatewayTimeout, codes.DeadlineExceeded
	case errors.Is(err, qos.ErrUnknownModel), errors.Is(err, qos.ErrModelRemoved), errors.Is(err, qos.ErrStopped):
		return http.StatusServiceUnavailable, codes.Unavailable
	case errors.Is(err, errBadRequest), errors.Is(err, models.ErrInvalidInput),
		errors.Is(err, runtime.ErrShape), errors.Is(err, runtime.ErrInvalidTensor),
		errors.Is(err, qos.ErrInvalidRequest):
		return http.StatusBadRequest, codes.InvalidArgument
	case errors.Is(err, errForbidden):
		return http.StatusForbidden, codes.PermissionDenied
	case errors.Is(err, errSharedMemoryUnknown):
		return http.StatusBadRequest, codes.NotFound
	case errors.Is(err, errSharedMemoryLimit):
		return http.StatusBadRequest, codes.ResourceExhausted
	case errors.Is(err, models.ErrModelNotFound), errors.Is(err, models.ErrVersionNotFound):
		return http.StatusNotFound, codes.NotFound
	case errors.Is(err, models.ErrModelControl):
		return http.StatusBadRequest, codes.FailedPrecondition
	case errors.Is(err, models.ErrBadConfig), errors.Is(err, configs.ErrInvalid),
		errors.Is(err, runtime.ErrModelLoad): // a load the model is at fault for, as Triton answers it
		return http.StatusBadRequest, codes.InvalidArgument
	case errors.Is(err, models.ErrNotReady), errors.Is(err, runtime.ErrUnavailable):
		return http.StatusServiceUnavailable, codes.Unavailable
	case errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout, codes.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		return 499, codes.Canceled
	default:
		return http.StatusInternalServerError, codes.Internal
	}
}

// maxErrorMessage caps an error message sent to a client. Messages quote
// what the client sent (names, shapes), and a hostile request can make those
// megabytes long; a gRPC status message that large would even exceed the
// client's header limit and turn into a reset stream.
const maxErrorMessage = 4 << 10

// clipMessage shortens msg to at most maxErrorMessage bytes, cutting at a
// UTF-8 boundary and saying how much was cut.
func clipMessage(msg string) string {
	if len(msg) <= maxErrorMessage {
		return msg
	}
	const room = maxErrorMessage - 40 // for the note
	cut := room
	for cut > 0 && !utf8.RuneStart(msg[cut]) {
		cut--
	}
	return msg[:cut] + "... (" + strconv.Itoa(len(msg)-cut) + " more bytes)"
}
