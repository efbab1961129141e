package control

import (
	"maps"
	"sync"
)

// Kinds of the events a device's recovery records (server/recovery.go),
// listed beside the adjuster's.
const (
	// EventFault is a fatal fault that took a GPU's MPS clients down.
	EventFault = "fault"
	// EventRecovered is a model serving again after a fault, with its
	// cost (time since the fault, requests failed meanwhile).
	EventRecovered = "recovered"
	// EventHung is a hung client found and replaced.
	EventHung = "hung"
	// EventRisky is a best-effort model marked risky (see Isolation).
	EventRisky = "risky"
)

// Isolation is the set of models that must not share a device with
// latency-critical models: best-effort models whose client faulted its
// device more than once within a window (under MPS a fault in one client
// takes every client of its device down). The server's recovery marks
// them; placement across devices reads it (Risky) and keeps such a model
// on a device without latency-critical models when another device exists.
// Without gpu.placement, the recovery itself restarts a risky model's
// instances on such a device. Safe for concurrent use; the zero value is empty.
type Isolation struct {
	mu    sync.Mutex
	risky map[string]string // model name -> why
}

// Mark records model as risky, with why; it reports whether it was not
// already.
func (i *Isolation) Mark(model, why string) bool {
	i.mu.Lock()
	defer i.mu.Unlock()
	if _, ok := i.risky[model]; ok {
		return false
	}
	if i.risky == nil {
		i.risky = map[string]string{}
	}
	i.risky[model] = why
	return true
}

// Risky reports whether a model (by name, not version) must be kept apart
// from latency-critical models, and why.
func (i *Isolation) Risky(model string) (why string, ok bool) {
	if i == nil {
		return "", false
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	why, ok = i.risky[model]
	return why, ok
}

// Models are the risky models with why.
func (i *Isolation) Models() map[string]string {
	if i == nil {
		return nil
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	return maps.Clone(i.risky)
}
