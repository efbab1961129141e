package qos

import "errors"

// Errors returned by Submit and the model management methods. The api
// package maps them to HTTP statuses and gRPC codes.
var (
	// ErrRejected: admission predicted that the request would miss its
	// deadline; the wrapping error says by how much (HTTP 429,
	// RESOURCE_EXHAUSTED).
	ErrRejected = errors.New("request rejected: deadline cannot be met")
	// ErrDropped: the request's deadline passed, or could no longer be met,
	// while it was queued; it was not executed (HTTP 504, DEADLINE_EXCEEDED).
	ErrDropped = errors.New("request dropped: deadline passed while queued")
	// ErrQueueFull: the model's queue is at capacity (HTTP 429,
	// RESOURCE_EXHAUSTED).
	ErrQueueFull = errors.New("model queue is full")
	// ErrOverloaded: the server has as many requests, or input bytes, in
	// flight as its Gate allows (HTTP 429, RESOURCE_EXHAUSTED).
	ErrOverloaded = errors.New("too many requests in flight")
	// ErrUnknownModel: no model of that name was added.
	ErrUnknownModel = errors.New("unknown model")
	// ErrModelRemoved: the model is being removed; it takes no new requests
	// and requests still queued when the removal gave up fail with it.
	ErrModelRemoved = errors.New("model removed")
	// ErrInvalidRequest: the request cannot be scheduled as it is, such as
	// inputs whose batch dimensions disagree or a batch over the model's
	// maximum (HTTP 400).
	ErrInvalidRequest = errors.New("invalid request")
	// ErrStopped: the scheduler's Run has ended.
	ErrStopped = errors.New("scheduler stopped")
)
