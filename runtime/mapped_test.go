package runtime

import (
	"errors"
	"math/rand/v2"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// mappedFile maps size bytes of a fresh memfd, as a client's shared-memory
// object is mapped, and returns the mapping and the file to truncate.
func mappedFile(t *testing.T, size int) ([]byte, *os.File) {
	t.Helper()
	fd, err := unix.MemfdCreate("sloserve-mapped-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Skipf("no memfd: %v", err)
	}
	f := os.NewFile(uintptr(fd), "mapped-test")
	t.Cleanup(func() { f.Close() })
	if err := f.Truncate(int64(size)); err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	return mem, f
}

// A fault in a client's mapping is an error on the goroutine that read or
// wrote it; other panics are not taken for one.
func TestCopyMapped(t *testing.T) {
	mem, f := mappedFile(t, 3*os.Getpagesize())
	for i := range mem {
		mem[i] = byte(i)
	}
	dst := make([]byte, len(mem))
	if n, err := CopyMapped(dst, mem); err != nil || n != len(mem) || dst[len(dst)-1] != mem[len(mem)-1] {
		t.Fatalf("copy of an intact mapping: %d, %v", n, err)
	}
	if err := f.Truncate(int64(os.Getpagesize())); err != nil {
		t.Fatal(err)
	}
	if _, err := CopyMapped(dst, mem); !errors.Is(err, ErrMappedFault) || !errors.Is(err, ErrInvalidTensor) {
		t.Errorf("read past the truncated end: %v, want ErrMappedFault", err)
	}
	if _, err := CopyMapped(mem, dst); !errors.Is(err, ErrMappedFault) {
		t.Errorf("write past the truncated end: %v, want ErrMappedFault", err)
	}
	// The first page is still there, and still readable.
	if n, err := CopyMapped(dst[:100], mem[:100]); err != nil || n != 100 || dst[99] != 99 {
		t.Errorf("copy within the object: %d, %v", n, err)
	}
	defer func() {
		if p := recover(); p != "not a fault" {
			t.Errorf("recovered %v, want the panic to go on", p)
		}
	}()
	_ = GuardMapped(func() { panic("not a fault") })
}

// TestMappedInputTruncated: an input whose bytes lie in a client's mapping
// that was truncated under it fails that request with ErrMappedFault on
// every request path (the arena copy, inline on the stream, in the server
// process), and the instance answers the next request correctly. Without
// the guard the test process dies of SIGBUS: in the arena copy, in the
// stream's encoder, or inside ONNX Runtime.
func TestMappedInputTruncated(t *testing.T) {
	model := testModel(t, "example_dynamic_axes.onnx")
	rng := rand.New(rand.NewPCG(5, 5))
	const batch = 2000 // 80 000 bytes: more than the small arena holds
	for _, pc := range pathCases {
		t.Run(pc.name, func(t *testing.T) {
			inst := pc.start(t, model)
			req, want := rowSumsRequest(rng, batch)
			mem, f := mappedFile(t, len(req.Inputs[0].Data))
			copy(mem, req.Inputs[0].Data)
			mapped := &InferRequest{Inputs: []Tensor{req.Inputs[0]}}
			mapped.Inputs[0].Data, mapped.Inputs[0].Mapped = mem, true

			resp, err := inst.Infer(t.Context(), mapped)
			if err != nil {
				t.Fatalf("intact mapping: %v", err)
			}
			checkRowSums(t, resp, want)

			if err := f.Truncate(0); err != nil {
				t.Fatal(err)
			}
			if _, err := inst.Infer(t.Context(), mapped); !errors.Is(err, ErrMappedFault) || !errors.Is(err, ErrInvalidTensor) {
				t.Fatalf("truncated mapping: %v, want ErrMappedFault", err)
			}
			// The instance is unharmed, and a slot the failed call took
			// was given back.
			resp, err = inst.Infer(t.Context(), req)
			if err != nil {
				t.Fatalf("after the fault: %v", err)
			}
			checkRowSums(t, resp, want)
			if r, ok := inst.(*Runner); ok {
				if p := r.live.Load(); p != nil && p.arena != nil {
					if used := p.arena.alloc.bytesInUse(); used != 0 {
						t.Errorf("%d arena bytes still in use after the calls", used)
					}
				}
			}
		})
	}
}
