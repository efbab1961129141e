package api

import (
	"context"
	"errors"
	"io"
	"runtime/debug"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/sloserve/sloserve/api/inference"
)

// DefaultStreamInflight is how many requests of one ModelStreamInfer stream
// may be in flight (read and not yet answered) when Limits.StreamInflight
// is 0.
const DefaultStreamInflight = 16

// ModelStreamInfer serves a bidirectional inference stream. Requests run
// concurrently, each as ModelInfer would run it, and each answer carries
// its request's model, version and id; a request that fails is answered
// with error_message and ends only itself, as Triton does. The stream
// ends when the client closes its side and every answer is sent, or at
// the first error of the stream itself (cancellation, a message over the
// size limit).
//
// Flow control: a request holds one of the stream's in-flight slots from
// when it is read until its answer is handed to gRPC. With every slot taken
// the handler stops reading, so a client that does not read its answers
// stalls its own stream (gRPC's flow control then stops its sends) instead
// of growing the server's memory: at most the slots' requests and answers
// are held.
func (s *grpcService) ModelStreamInfer(stream grpc.BidiStreamingServer[inference.ModelInferRequest, inference.ModelStreamInferResponse]) error {
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	n := s.lim.StreamInflight
	if n <= 0 {
		n = DefaultStreamInflight
	}
	slots := make(chan struct{}, n)
	// Never blocks: a worker holds a slot until its answer is taken from
	// here, so at most n answers wait.
	answers := make(chan streamAnswer, n)

	var sendErr error
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		for a := range answers {
			if sendErr == nil {
				if sendErr = stream.Send(a.msg); sendErr != nil {
					cancel() // the client is gone: stop the running requests
				}
			}
			a.mem.Release()
			<-slots
		}
	}()

	var (
		workers sync.WaitGroup
		recvErr error
	)
	for recvErr == nil {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			recvErr = ctx.Err()
			continue
		}
		req, err := stream.Recv()
		if err != nil {
			<-slots
			recvErr = err
			continue
		}
		// The stream's own reservation (the tap's) covers its buffers
		// (and, where its connection does not count its messages as they
		// arrive, the next message); each request read holds its own
		// until answered.
		mem, err := s.codec.takeDecoded(ctx, req)
		workers.Add(1)
		go func() {
			defer workers.Done()
			if err != nil {
				answers <- streamAnswer{msg: s.streamFailed(req, err)}
				return
			}
			a := s.streamInfer(ctx, req)
			if err := mem.Grow(int64(proto.Size(a)), "the response"); err != nil {
				a = s.streamFailed(req, err)
			}
			answers <- streamAnswer{msg: a, mem: mem}
		}()
	}
	workers.Wait()
	close(answers)
	<-sent
	switch {
	case sendErr != nil:
		return sendErr
	case errors.Is(recvErr, io.EOF):
		return nil
	case errors.Is(recvErr, context.Canceled) || errors.Is(recvErr, context.DeadlineExceeded):
		return s.grpcError("ModelStreamInfer", recvErr)
	}
	return recvErr
}

// streamAnswer is an answer of a stream and the memory it and its request
// hold until it is sent.
type streamAnswer struct {
	msg *inference.ModelStreamInferResponse
	mem *Reservation
}

// streamFailed is the answer to a request of a stream that failed with err.
func (s *grpcService) streamFailed(req *inference.ModelInferRequest, err error) *inference.ModelStreamInferResponse {
	_, code := statusOf(err)
	if code == codes.Internal {
		s.logger.Error("stream request failed", "method", "ModelStreamInfer", "err", err)
	}
	return &inference.ModelStreamInferResponse{
		ErrorMessage:  clipMessage(err.Error()),
		InferResponse: &inference.ModelInferResponse{ModelName: req.GetModelName(), ModelVersion: req.GetModelVersion(), Id: req.GetId()},
	}
}

// streamInfer runs one request of a stream and returns its answer: the
// response, or the error with the request's identity.
func (s *grpcService) streamInfer(ctx context.Context, req *inference.ModelInferRequest) (answer *inference.ModelStreamInferResponse) {
	failed := func(err error) *inference.ModelStreamInferResponse { return s.streamFailed(req, err) }
	defer func() {
		if r := recover(); r != nil {
			s.logger.Error("handler panic", "method", "ModelStreamInfer", "panic", r, "stack", string(debug.Stack()))
			answer = failed(errors.New("internal error"))
		}
	}()
	in, err := decodeGRPCInfer(req, s.lim, time.Now())
	if err != nil {
		return failed(err)
	}
	out, version, err := s.b.Infer(ctx, req.GetModelName(), req.GetModelVersion(), in)
	if err != nil {
		return failed(err)
	}
	return &inference.ModelStreamInferResponse{InferResponse: encodeGRPCInferResponse(req.GetModelName(), version, req.GetId(), out)}
}
