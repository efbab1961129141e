package e2e

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/api/modelmesh"
)

// TestE2EModelMesh drives the ModelMesh model-runtime SPI over real gRPC as
// the ModelMesh container of a pod would: status and capacity, loads from
// folders its puller filled, sizes, inference through the v2 gRPC service
// with the model id in ModelMesh's header, unloads, and the purge of a
// restarted ModelMesh.
func TestE2EModelMesh(t *testing.T) {
	meshAddr := freePort(t)
	s := startServer(t, t.TempDir(), "model_control: explicit\ncontrol: {memory_budget: 1GiB}\n", withSet("listen.modelmesh="+meshAddr))
	conn, err := grpc.NewClient(meshAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	mm := modelmesh.NewModelRuntimeClient(conn)
	ctx := t.Context()

	st, err := mm.RuntimeStatus(ctx, &modelmesh.RuntimeStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st.Status != modelmesh.RuntimeStatusResponse_READY || st.CapacityInBytes != 1<<30 || st.ModelLoadingTimeoutMs == 0 || st.RuntimeVersion == "" {
		t.Errorf("runtimeStatus %v: want READY with the memory budget, 1 GiB, as capacity", st)
	}
	if mi := st.MethodInfos["inference.GRPCInferenceService/ModelInfer"]; mi == nil || !slices.Equal(mi.IdInjectionPath, []uint32{1}) {
		t.Errorf("methodInfos %v: want ModelInfer with the model id in field 1 (model_name)", st.MethodInfos)
	}

	// Two folders as ModelMesh's puller leaves them: one with a sloserve
	// config that sets the model's memory limit, one with the file alone.
	model := testModel(t, "example_dynamic_axes.onnx")
	withLimit, bare := t.TempDir(), t.TempDir()
	for _, d := range []string{withLimit, bare} {
		if err := os.Symlink(model, filepath.Join(d, "model.onnx")); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(withLimit, "config.yaml"), []byte("resources: {memory_limit: 128MiB}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(model)
	if err != nil {
		t.Fatal(err)
	}

	pred, err := mm.PredictModelSize(ctx, &modelmesh.PredictModelSizeRequest{ModelId: "b__isvc-2", ModelPath: bare})
	if err != nil || pred.SizeInBytes < 2*uint64(fi.Size()) {
		t.Fatalf("predictModelSize %v, %v: want at least twice the model file's %d bytes", pred, err, fi.Size())
	}
	a, err := mm.LoadModel(ctx, &modelmesh.LoadModelRequest{ModelId: "a__isvc-1", ModelType: "onnx", ModelPath: withLimit})
	if err != nil {
		t.Fatal(err)
	}
	if a.SizeInBytes != 128<<20 {
		t.Errorf("a's size %d, want its memory limit, 128 MiB", a.SizeInBytes)
	}
	b, err := mm.LoadModel(ctx, &modelmesh.LoadModelRequest{ModelId: "b__isvc-2", ModelType: "onnx", ModelPath: bare})
	if err != nil {
		t.Fatal(err)
	}
	if b.SizeInBytes < pred.SizeInBytes || a.SizeInBytes+b.SizeInBytes > st.CapacityInBytes {
		t.Errorf("b's size %d: want at least the prediction %d, and both within the capacity %d", b.SizeInBytes, pred.SizeInBytes, st.CapacityInBytes)
	}
	again, err := mm.LoadModel(ctx, &modelmesh.LoadModelRequest{ModelId: "b__isvc-2", ModelPath: bare})
	if err != nil || again.SizeInBytes != b.SizeInBytes {
		t.Errorf("loading b again: %v, %v; want the same size %d", again, err, b.SizeInBytes)
	}
	for id, want := range map[string]uint64{"a__isvc-1": a.SizeInBytes, "b__isvc-2": b.SizeInBytes} {
		if got, err := mm.ModelSize(ctx, &modelmesh.ModelSizeRequest{ModelId: id}); err != nil || got.SizeInBytes != want {
			t.Errorf("modelSize %s = %v, %v; want %d", id, got, err, want)
		}
	}

	// Inference as ModelMesh forwards it: the model named by its header.
	infer := func(id string) (*inference.ModelInferResponse, error) {
		req := grpcDynRequest()
		req.ModelName = "placeholder"
		return s.grpc.ModelInfer(metadata.AppendToOutgoingContext(ctx, "mm-model-id", id), req)
	}
	for _, id := range []string{"a__isvc-1", "b__isvc-2"} {
		resp, err := infer(id)
		if err != nil || resp.ModelName != id || len(resp.RawOutputContents) != 1 {
			t.Fatalf("infer %s: %v, %v", id, resp, err)
		}
	}
	if r, err := s.grpc.ModelReady(metadata.AppendToOutgoingContext(ctx, "mm-model-id", "a__isvc-1"), &inference.ModelReadyRequest{Name: "placeholder"}); err != nil || !r.Ready {
		t.Errorf("ModelReady by header: %v, %v", r, err)
	}

	// Unload: the model stops serving and its size is no longer known.
	if _, err := mm.UnloadModel(ctx, &modelmesh.UnloadModelRequest{ModelId: "a__isvc-1"}); err != nil {
		t.Fatal(err)
	}
	// An unloaded model answers as explicit mode's unloaded models do.
	if _, err := infer("a__isvc-1"); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "unloaded") {
		t.Errorf("infer after unload: %v, want Unavailable: unloaded", err)
	}
	if _, err := mm.ModelSize(ctx, &modelmesh.ModelSizeRequest{ModelId: "a__isvc-1"}); status.Code(err) != codes.NotFound {
		t.Errorf("modelSize after unload: %v, want NotFound", err)
	}
	if _, err := mm.UnloadModel(ctx, &modelmesh.UnloadModelRequest{ModelId: "never-loaded"}); err != nil {
		t.Errorf("unloading a model never loaded: %v, want no error", err)
	}

	// Loads that cannot start hold nothing and say so with INVALID_ARGUMENT.
	for _, bad := range []*modelmesh.LoadModelRequest{
		{ModelId: "c__isvc-3", ModelPath: filepath.Join(bare, "missing")},
		{ModelId: "../escape", ModelPath: bare},
		{ModelId: "d__isvc-4"},
	} {
		if _, err := mm.LoadModel(ctx, bad); status.Code(err) != codes.InvalidArgument {
			t.Errorf("loadModel %v: %v, want InvalidArgument", bad, err)
		}
	}
	if _, err := mm.ModelSize(ctx, &modelmesh.ModelSizeRequest{ModelId: "c__isvc-3"}); status.Code(err) != codes.NotFound {
		t.Errorf("a failed load is held: modelSize %v", err)
	}

	// A restarted ModelMesh asks for the status again: what it loaded
	// before is unloaded.
	if _, err := mm.RuntimeStatus(ctx, &modelmesh.RuntimeStatusRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := infer("b__isvc-2"); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "unloaded") {
		t.Errorf("infer after the purge: %v, want Unavailable: unloaded", err)
	}
	var index []struct{ Name, State string }
	if code := s.json(t, "POST", "/v2/repository/index", map[string]any{"ready": true}, &index); code != 200 || len(index) != 0 {
		t.Errorf("ready models after the purge: %d %+v, want none", code, index)
	}
}
