package runtime

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/runtime/runnerpb"
)

// This file carries calls to a runner over one long-lived gRPC stream per
// process instead of a unary call each: requests carry ids, run
// concurrently in the runner and are answered in any order.

// callStream is the server's end of a runner process's stream. One
// goroutine receives the answers and hands each to its caller.
type callStream struct {
	stream runnerpb.Runner_StreamClient
	cancel context.CancelFunc
	// onAbandoned is called from the receiving goroutine for an answer
	// whose caller has gone (its context ended), to free what the call
	// held.
	onAbandoned func(*pendingCall)
	// onBroken is called once when the stream ends, with why, before the
	// callers waiting on it are failed. io.EOF means the runner ended it
	// (it is stopping).
	onBroken func(error)

	sendMu sync.Mutex // grpc streams allow one sender at a time

	mu      sync.Mutex
	next    uint64
	pending map[uint64]*pendingCall
	err     error // why the stream ended; nil while it is open
	done    chan struct{}
}

// pendingCall is a call sent and not yet answered.
type pendingCall struct {
	reply chan *runnerpb.InferResponse // buffered; nil is sent when the stream ends
	// abandoned: the caller's context ended before the answer; the
	// receiving goroutine disposes of the answer.
	abandoned bool
	// slot is the arena slot the call holds, for onAbandoned.
	slot    uint64
	hasSlot bool
}

// openStream opens the stream on a ready runner connection. ctx bounds
// the stream's whole life.
func openStream(ctx context.Context, client runnerpb.RunnerClient, onAbandoned func(*pendingCall), onBroken func(error)) (*callStream, error) {
	ctx, cancel := context.WithCancel(ctx)
	st, err := client.Stream(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	c := &callStream{
		stream:      st,
		cancel:      cancel,
		onAbandoned: onAbandoned,
		onBroken:    onBroken,
		pending:     make(map[uint64]*pendingCall),
		done:        make(chan struct{}),
	}
	go c.receive()
	return c, nil
}

func (c *callStream) receive() {
	defer close(c.done)
	for {
		resp, err := c.stream.Recv()
		if err != nil {
			c.broken(err)
			return
		}
		c.mu.Lock()
		call, ok := c.pending[resp.GetId()]
		delete(c.pending, resp.GetId())
		c.mu.Unlock()
		switch {
		case !ok:
			// An id the server never sent or already answered: a runner
			// that breaks the protocol is not trusted with more calls.
			c.broken(fmt.Errorf("runner answered unknown call %d", resp.GetId()))
			c.cancel()
			return
		case call.abandoned:
			if c.onAbandoned != nil {
				c.onAbandoned(call)
			}
		default:
			call.reply <- resp
		}
	}
}

// broken fails every pending call after the stream ended.
func (c *callStream) broken(err error) {
	if c.onBroken != nil {
		c.onBroken(err)
	}
	if errors.Is(err, io.EOF) {
		err = errors.New("the runner closed its stream")
	}
	c.mu.Lock()
	if c.err == nil {
		c.err = err
	}
	calls := c.pending
	c.pending = map[uint64]*pendingCall{}
	c.mu.Unlock()
	for _, call := range calls {
		if !call.abandoned {
			call.reply <- nil
		}
	}
}

// brokenError is the error a call sees when the stream is gone, in the
// status shape inferError decodes.
func (c *callStream) brokenError() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s, ok := status.FromError(c.err); ok && s.Code() != codes.Unknown {
		return status.Error(codes.Unavailable, s.Message())
	}
	return status.Error(codes.Unavailable, fmt.Sprint(c.err))
}

// call sends req and waits for its answer or for ctx to end. call.hasSlot
// and call.slot say what the request holds in the arena: when ctx ends
// first, the answer is left to onAbandoned. The request's id is set here.
func (c *callStream) call(ctx context.Context, req *runnerpb.InferRequest, call *pendingCall) (*runnerpb.InferResponse, error) {
	call.reply = make(chan *runnerpb.InferResponse, 1)
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return nil, c.brokenError()
	}
	c.next++
	req.Id = c.next
	c.pending[req.Id] = call
	c.mu.Unlock()

	c.sendMu.Lock()
	err := c.stream.Send(req)
	c.sendMu.Unlock()
	if err != nil {
		// A failed Send has ended the stream; Recv then reports why.
		c.cancel()
		<-c.done
		if resp := <-call.reply; resp != nil {
			return resp, nil
		}
		return nil, c.brokenError()
	}

	select {
	case resp := <-call.reply:
		if resp == nil {
			return nil, c.brokenError()
		}
		return resp, nil
	case <-ctx.Done():
	}
	c.mu.Lock()
	if _, ok := c.pending[req.Id]; ok {
		call.abandoned = true
		c.mu.Unlock()
		return nil, ctx.Err()
	}
	c.mu.Unlock()
	// The answer came as the context ended: take it, so that the caller
	// frees what the call held.
	resp := <-call.reply
	if resp == nil {
		return nil, c.brokenError()
	}
	return resp, nil
}

// close ends the stream; calls in flight fail with codes.Unavailable.
func (c *callStream) close() {
	c.cancel()
	<-c.done
}

// replyStatus turns a failed answer into the status error inferError
// decodes; nil when the call succeeded.
func replyStatus(resp *runnerpb.InferResponse) error {
	if resp.GetCode() == 0 {
		return nil
	}
	return status.Error(codes.Code(resp.GetCode()), resp.GetMessage())
}
