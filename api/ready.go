package api

import (
	"errors"

	"github.com/sloserve/sloserve/models"
)

// modelReady is b.ModelReady with Triton's readiness semantics: a model or
// version the server does not know is not ready, not an error.
func modelReady(b Backend, name, version string) (bool, error) {
	ready, err := b.ModelReady(name, version)
	if errors.Is(err, models.ErrModelNotFound) || errors.Is(err, models.ErrVersionNotFound) {
		return false, nil
	}
	return ready, err
}
