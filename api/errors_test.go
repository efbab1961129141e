package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

func TestStatusOf(t *testing.T) {
	tests := []struct {
		err      error
		wantHTTP int
		wantCode codes.Code
	}{
		{qos.ErrRejected, http.StatusTooManyRequests, codes.ResourceExhausted},
		{qos.ErrQueueFull, http.StatusTooManyRequests, codes.ResourceExhausted},
		{qos.ErrDropped, http.StatusGatewayTimeout, codes.DeadlineExceeded},
		{qos.ErrInvalidRequest, http.StatusBadRequest, codes.InvalidArgument},
		{qos.ErrUnknownModel, http.StatusServiceUnavailable, codes.Unavailable},
		{qos.ErrModelRemoved, http.StatusServiceUnavailable, codes.Unavailable},
		{qos.ErrStopped, http.StatusServiceUnavailable, codes.Unavailable},
		{fmt.Errorf("%w: a batch of 8 waited 10s, the instances hold 4", qos.ErrNoMemory), http.StatusServiceUnavailable, codes.ResourceExhausted},
		{runtime.ErrBatchOverMemory, http.StatusServiceUnavailable, codes.Unavailable},
		// Mappings that were there before the scheduler.
		{errTooLarge, http.StatusRequestEntityTooLarge, codes.ResourceExhausted},
		{models.ErrTooLarge, http.StatusRequestEntityTooLarge, codes.ResourceExhausted},
		{errBadRequest, http.StatusBadRequest, codes.InvalidArgument},
		{models.ErrModelNotFound, http.StatusNotFound, codes.NotFound},
		{qos.ErrOverloaded, http.StatusTooManyRequests, codes.ResourceExhausted},
		{context.DeadlineExceeded, http.StatusGatewayTimeout, codes.DeadlineExceeded},
		{context.Canceled, 499, codes.Canceled},
		// Faults of a model, not of the server.
		{runtime.ErrModelLoad, http.StatusBadRequest, codes.InvalidArgument},
		{models.ErrBadConfig, http.StatusBadRequest, codes.InvalidArgument},
		{runtime.ErrOutOfMemory, http.StatusServiceUnavailable, codes.Unavailable},
		{errors.New("boom"), http.StatusInternalServerError, codes.Internal},
	}
	for _, tc := range tests {
		t.Run(tc.err.Error(), func(t *testing.T) {
			for _, err := range []error{tc.err, fmt.Errorf("model %q: %w: more detail", "m", tc.err)} {
				status, code := statusOf(err)
				if status != tc.wantHTTP || code != tc.wantCode {
					t.Errorf("statusOf(%q) = %d, %s; want %d, %s", err, status, code, tc.wantHTTP, tc.wantCode)
				}
			}
		})
	}
}
