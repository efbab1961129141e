package qos

import (
	"errors"
	"os"
	"testing"
	"testing/synctest"

	"golang.org/x/sys/unix"

	"github.com/sloserve/sloserve/runtime"
)

// TestMergeFaultFailsOneRequest: a request of a batch whose input lies in a
// client's shared memory, truncated while it was queued, fails alone with
// runtime.ErrMappedFault; the batch runs for the others (its row zero) and
// they get their answers. Without the guarded copy in mergeRequests the
// test process dies of SIGBUS.
func TestMergeFaultFailsOneRequest(t *testing.T) {
	fd, err := unix.MemfdCreate("sloserve-qos-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Skipf("no memfd: %v", err)
	}
	f := os.NewFile(uintptr(fd), "qos-test")
	defer f.Close()
	page := os.Getpagesize()
	if err := f.Truncate(int64(page)); err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(fd, 0, page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)

	synctest.Test(t, func(t *testing.T) {
		h := newHarness(t, Options{})
		h.model(ModelSpec{Name: "m", MaxBatchSize: 4}, nil)
		mapped := idRequest(2)
		copy(mem, mapped.Inputs[0].Data)
		mapped.Inputs[0].Data, mapped.Inputs[0].Mapped = mem[:8], true
		ps := []*pending{
			h.submit(t.Context(), "m", RequestOptions{}, 1),
			h.submitRequest(t.Context(), "m", RequestOptions{}, mapped),
			h.submit(t.Context(), "m", RequestOptions{}, 3),
		}
		if err := f.Truncate(0); err != nil {
			t.Fatal(err)
		}
		h.run()
		mustSucceed(t, ps[0], ps[2])
		if err := ps[1].wait(t); !errors.Is(err, runtime.ErrMappedFault) {
			t.Errorf("the truncated request: %v, want ErrMappedFault", err)
		}
		checkOrder(t, h, "m:1,0,3")
		if st, _ := h.s.Stats("m"); st.Good != 2 || st.Failed != 1 {
			t.Errorf("stats = %+v, want 2 good and 1 failed", st)
		}
	})
}
