package qos_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/sloserve/sloserve/qos"
	"github.com/sloserve/sloserve/runtime"
)

// The composition root builds one Scheduler per device, runs it, adds each
// loaded model with an Executor over its instances, and sends requests
// through Submit; api maps the errors to statuses.
func ExampleScheduler() {
	s, err := qos.NewScheduler(qos.Options{DeviceSlots: 2})
	if err != nil {
		panic(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- s.Run(ctx) }()
	defer func() { stop(); <-done }()

	echo := qos.ExecutorFunc(func(ctx context.Context, req *runtime.InferRequest) (*runtime.InferResponse, error) {
		return &runtime.InferResponse{Outputs: req.Inputs}, nil
	})
	err = s.AddModel(qos.ModelSpec{
		Name: "echo/1", Class: qos.ClassLatencyCritical, SLO: time.Second,
		MaxBatchSize: 8, Executor: echo,
	})
	if err != nil {
		panic(err)
	}
	req := &runtime.InferRequest{Inputs: []runtime.Tensor{{Name: "x", DataType: runtime.Uint8, Shape: []int64{1, 2}, Data: []byte{4, 2}}}}
	resp, err := s.Submit(ctx, "echo/1", req, qos.RequestOptions{})
	switch {
	case errors.Is(err, qos.ErrRejected), errors.Is(err, qos.ErrQueueFull):
		fmt.Println("429:", err)
	case errors.Is(err, qos.ErrDropped):
		fmt.Println("504:", err)
	case err != nil:
		fmt.Println("error:", err)
	default:
		fmt.Println(resp.Outputs[0].Data)
	}
	st, _ := s.Stats("echo/1")
	fmt.Println(st.Arrived, st.Good)
	// Output:
	// [4 2]
	// 1 1
}
