package runtime

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"
)

// boundedMember is a fakeMember whose memory holds batches up to bound; a
// larger one fails as a simulated MPS client's arena would.
type boundedMember struct {
	*fakeMember
	bound int
}

var _ BatchCapacity = (*boundedMember)(nil)

func (b *boundedMember) MaxBatch() (int, bool) { return b.bound, true }

func (b *boundedMember) Infer(ctx context.Context, req *InferRequest) (*InferResponse, error) {
	if n := rows(req); n > b.bound {
		return nil, errors.New("out of device memory: arena over the pinned limit")
	}
	return b.fakeMember.Infer(ctx, req)
}

func rowsRequest(n int) *InferRequest {
	return &InferRequest{Inputs: []Tensor{{Name: "x", DataType: Int32, Shape: []int64{int64(n)}, Data: make([]byte, 4*n)}}}
}

// A pool's batch bound is its smallest member's; a batch no member holds is
// refused without a call; and a replacement that holds less than its
// predecessor (a shrunk memory share) switches in only once the larger
// batch in flight has ended, so that no batch formed for the old memory
// reaches the new member.
func TestPoolBatchesWithinMemory(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		big := &boundedMember{fakeMember: &fakeMember{id: 0, gate: make(chan struct{})}, bound: 8}
		p, err := NewPool([]Member{big}, PoolOptions{Slots: 2})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Stop(context.Background())
		if n, ok := p.MaxBatch(); n != 8 || !ok {
			t.Fatalf("MaxBatch %d %v, want 8", n, ok)
		}
		if _, err := p.Execute(t.Context(), rowsRequest(9)); !errors.Is(err, ErrBatchOverMemory) || big.calls.Load() != 0 {
			t.Fatalf("a batch of 9 over memory for 8: %v after %d calls, want ErrBatchOverMemory and none", err, big.calls.Load())
		}

		// A batch of 8 runs (held at the gate) while a smaller member
		// replaces the member.
		done := make(chan error, 1)
		go func() {
			_, err := p.Execute(t.Context(), rowsRequest(8))
			done <- err
		}()
		synctest.Wait()
		small := &boundedMember{fakeMember: &fakeMember{id: 1}, bound: 3}
		switched := make(chan error, 1)
		go func() {
			switched <- p.Replace(t.Context(), 0, func(context.Context) (Member, error) { return small, nil })
		}()
		time.Sleep(time.Second)
		synctest.Wait()
		if n, _ := p.MaxBatch(); n != 3 {
			t.Errorf("MaxBatch %d while the replacement waits, want its 3: no larger batch may form", n)
		}
		if p.Members()[0] != big {
			t.Fatal("the smaller member switched in while a batch of 8 ran")
		}
		close(big.gate) // the batch of 8 ends
		if err := <-done; err != nil {
			t.Errorf("the batch of 8: %v", err)
		}
		if err := <-switched; err != nil {
			t.Fatal(err)
		}
		if p.Members()[0] != small {
			t.Fatal("the smaller member did not switch in")
		}
		if n, ok := p.MaxBatch(); n != 3 || !ok {
			t.Errorf("MaxBatch %d %v after the switch, want 3", n, ok)
		}
		if _, err := p.Execute(t.Context(), rowsRequest(3)); err != nil {
			t.Errorf("a batch of 3 on the smaller member: %v", err)
		}
		if _, err := p.Execute(t.Context(), rowsRequest(4)); !errors.Is(err, ErrBatchOverMemory) || small.calls.Load() != 1 {
			t.Errorf("a batch of 4 over memory for 3: %v after %d calls, want ErrBatchOverMemory and 1 call", err, small.calls.Load())
		}
	})
}

// A pool whose members are of two sizes runs a batch only on a member that
// holds it.
func TestPoolPicksAMemberThatHoldsTheBatch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		small := &boundedMember{fakeMember: &fakeMember{id: 0}, bound: 2}
		big := &boundedMember{fakeMember: &fakeMember{id: 1}, bound: 8}
		p, err := NewPool([]Member{small, big}, PoolOptions{})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Stop(context.Background())
		if n, _ := p.MaxBatch(); n != 2 {
			t.Errorf("MaxBatch %d, want the smaller member's 2", n)
		}
		for range 4 {
			resp, err := p.Execute(t.Context(), rowsRequest(6))
			if err != nil {
				t.Fatalf("a batch of 6: %v", err)
			}
			if id := answeredBy(resp); id != 1 {
				t.Errorf("a batch of 6 answered by member %d, want 1 (memory for 8)", id)
			}
		}
	})
}
