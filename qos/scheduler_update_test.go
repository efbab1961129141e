package qos

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/runtime"
)

// A reload swaps the executor: queued requests stay and run on the new one.
func TestUpdateModelSwapsExecutor(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, err := NewScheduler(Options{DeviceSlots: 1})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- s.Run(ctx) }()

		var oldCalls, newCalls atomic.Int64
		slow := ExecutorFunc(func(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
			oldCalls.Add(1)
			time.Sleep(10 * time.Millisecond)
			return &runtime.InferResponse{}, nil
		})
		fresh := ExecutorFunc(func(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
			newCalls.Add(1)
			time.Sleep(10 * time.Millisecond)
			return &runtime.InferResponse{}, nil
		})
		if err := s.AddModel(ModelSpec{Name: "m/1", Executor: slow}); err != nil {
			t.Fatal(err)
		}
		results := make(chan error, 3)
		for range 3 {
			go func() {
				_, err := s.Submit(context.Background(), "m/1", &runtime.InferRequest{}, RequestOptions{})
				results <- err
			}()
		}
		synctest.Wait() // one running on the old executor, two queued
		if err := s.UpdateModel(ModelSpec{Name: "m/1", Executor: fresh, Class: ClassLatencyCritical, SLO: time.Second}); err != nil {
			t.Fatal(err)
		}
		for range 3 {
			if err := <-results; err != nil {
				t.Fatal(err)
			}
		}
		if oldCalls.Load() != 1 || newCalls.Load() != 2 {
			t.Errorf("old executor ran %d, new %d; want 1 and 2", oldCalls.Load(), newCalls.Load())
		}
		if err := s.UpdateModel(ModelSpec{Name: "nope", Executor: fresh}); !errors.Is(err, ErrUnknownModel) {
			t.Errorf("updating an unknown model: %v", err)
		}
		if !s.HasModel("m/1") || s.HasModel("nope") {
			t.Error("HasModel is wrong")
		}
		cancel()
		<-done
	})
}
