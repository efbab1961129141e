package runtime

import (
	"errors"
	"fmt"
	"runtime/debug"
)

// This file guards the reads and writes of memory the server does not own:
// a client's shared-memory mapping (api's system shared-memory regions). The
// client can truncate the object under the mapping at any time, and a read
// or write of a page past the object's new end raises SIGBUS. Go turns such
// a fault into a panic on the goroutine that faulted when that goroutine has
// asked for it (runtime/debug.SetPanicOnFault); without that it kills the
// process. So every access to such memory is one call here, on the calling
// goroutine, and nothing else touches it: the copy into a runner's arena,
// the concatenation of a batch, the copy an inline or in-process call makes
// first. Code outside Go (ONNX Runtime) never sees a client mapping: a fault
// there cannot be caught.

// ErrMappedFault means a client's shared memory faulted while the server
// read or wrote it: the object was truncated under its mapping. It is the
// client's doing, so it is an ErrInvalidTensor (400 / INVALID_ARGUMENT).
var ErrMappedFault = fmt.Errorf("%w: the shared memory object was truncated under its mapping while the server used it", ErrInvalidTensor)

// GuardMapped runs f, which reads or writes a client's mapping, on the
// calling goroutine, and turns a memory fault in it into an ErrMappedFault
// error. Other panics go on. f must not start goroutines that touch the
// mapping, nor hold locks it would leave held when it stops at a fault.
func GuardMapped(f func()) (err error) {
	old := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(old)
		if p := recover(); p != nil {
			var fault interface{ Addr() uintptr }
			if e, ok := p.(error); ok && errors.As(e, &fault) {
				err = ErrMappedFault
				return
			}
			panic(p)
		}
	}()
	f()
	return nil
}

// CopyMapped copies src to dst like copy, where either may be a client's
// mapping, and fails with ErrMappedFault when it faults.
func CopyMapped(dst, src []byte) (n int, err error) {
	err = GuardMapped(func() { n = copy(dst, src) })
	return n, err
}

// ownInputs returns req with every Mapped input copied into memory of the
// server's own, or req itself when none is mapped: for the paths that hand
// input bytes to code that cannot be guarded (ONNX Runtime in this process,
// a protobuf encoder).
func ownInputs(req *InferRequest) (*InferRequest, error) {
	mapped := false
	for _, t := range req.Inputs {
		mapped = mapped || t.Mapped
	}
	if !mapped {
		return req, nil
	}
	own := *req
	own.Inputs = make([]Tensor, len(req.Inputs))
	for i, t := range req.Inputs {
		own.Inputs[i] = t
		if !t.Mapped {
			continue
		}
		data := make([]byte, len(t.Data))
		if _, err := CopyMapped(data, t.Data); err != nil {
			return nil, fmt.Errorf("input %q: %w", t.Name, err)
		}
		own.Inputs[i].Data, own.Inputs[i].Mapped = data, false
	}
	return &own, nil
}
