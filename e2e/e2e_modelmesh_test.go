package e2e

import (
	"fmt"
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
	root := t.TempDir() // where ModelMesh's puller writes
	s := startServer(t, t.TempDir(), fmt.Sprintf("model_control: explicit\ncontrol: {memory_budget: 1GiB}\nmodelmesh_dir: %q\n", root), withSet("listen.modelmesh="+meshAddr))
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
	withLimit, bare := filepath.Join(root, "a__isvc-1"), filepath.Join(root, "b__isvc-2")
	for _, d := range []string{withLimit, bare} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
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
	// The binary header, which ModelMesh sends for ids that are not plain
	// ASCII (gRPC base64-encodes it on the wire).
	binReq := grpcDynRequest()
	binReq.ModelName = "placeholder"
	if resp, err := s.grpc.ModelInfer(metadata.AppendToOutgoingContext(ctx, "mm-model-id-bin", "b__isvc-2"), binReq); err != nil || resp.ModelName != "b__isvc-2" {
		t.Errorf("infer by the binary header: %v, %v; want b__isvc-2", resp, err)
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

// meshServer starts a server with the ModelMesh SPI, its modelmesh_dir a
// fresh folder, and returns it with an SPI client and the folder.
func meshServer(t *testing.T, budget string) (*testServer, modelmesh.ModelRuntimeClient, string) {
	t.Helper()
	meshAddr := freePort(t)
	root := t.TempDir()
	s := startServer(t, t.TempDir(), fmt.Sprintf("model_control: explicit\ncontrol: {memory_budget: %s}\nmodelmesh_dir: %q\n", budget, root), withSet("listen.modelmesh="+meshAddr))
	conn, err := grpc.NewClient(meshAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return s, modelmesh.NewModelRuntimeClient(conn), root
}

// meshFolder makes folder root/name as ModelMesh's puller would: the test
// model linked as each version's model.onnx (or as model.onnx when
// versions is 0), and config when not empty.
func meshFolder(t *testing.T, root, name, config string, versions int) string {
	t.Helper()
	dir := filepath.Join(root, name)
	link := func(d string) {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(testModel(t, "example_dynamic_axes.onnx"), filepath.Join(d, "model.onnx")); err != nil {
			t.Fatal(err)
		}
	}
	if versions == 0 {
		link(dir)
	}
	for v := 1; v <= versions; v++ {
		link(filepath.Join(dir, fmt.Sprint(v)))
	}
	if config != "" {
		if err := os.WriteFile(filepath.Join(dir, "config.yaml"), []byte(config), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// TestE2EModelMeshPaths: the SPI reads only folders inside modelmesh_dir:
// a path outside it, one with "..", a link out of it or a relative one is
// refused with INVALID_ARGUMENT by predictModelSize and loadModel alike,
// before anything is read or staged.
func TestE2EModelMeshPaths(t *testing.T) {
	_, mm, root := meshServer(t, "1GiB")
	ctx := t.Context()
	outside := t.TempDir()
	meshFolder(t, outside, "m", "", 0)
	inside := meshFolder(t, root, "m", "", 0)
	if err := os.Symlink(outside, filepath.Join(root, "out")); err != nil {
		t.Fatal(err)
	}
	home, _ := os.UserHomeDir()
	for _, path := range []string{
		filepath.Join(outside, "m"), // a model, but not ModelMesh's
		home,                        // what predictModelSize once summed
		"/",
		root, // the folder itself is no model folder
		filepath.Join(root, "..", filepath.Base(outside), "m"), // ".." out of it
		root + "/m/../m",                // ".." even when it stays inside
		filepath.Join(root, "out", "m"), // a link out of it
		"m",                             // relative
	} {
		if _, err := mm.PredictModelSize(ctx, &modelmesh.PredictModelSizeRequest{ModelId: "x", ModelPath: path}); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "modelPath") {
			t.Errorf("predictModelSize %q: %v, want InvalidArgument naming modelPath", path, err)
		}
		if _, err := mm.LoadModel(ctx, &modelmesh.LoadModelRequest{ModelId: "x", ModelPath: path}); status.Code(err) != codes.InvalidArgument {
			t.Errorf("loadModel %q: %v, want InvalidArgument", path, err)
		}
	}
	fi, err := os.Stat(testModel(t, "example_dynamic_axes.onnx"))
	if err != nil {
		t.Fatal(err)
	}
	pred, err := mm.PredictModelSize(ctx, &modelmesh.PredictModelSizeRequest{ModelId: "x", ModelPath: inside})
	if err != nil || pred.SizeInBytes != 2*uint64(fi.Size())+64<<20 {
		t.Errorf("predictModelSize inside: %v, %v; want twice the file's %d bytes and 64 MiB", pred, err, fi.Size())
	}
}

// TestE2EModelMeshVersionSizes: a model that serves several versions is
// sized for all of them: three versions with a 128 MiB memory limit each
// are 384 MiB, not 128.
func TestE2EModelMeshVersionSizes(t *testing.T) {
	_, mm, root := meshServer(t, "2GiB")
	dir := meshFolder(t, root, "v", "version_policy: {all: {}}\nresources: {memory_limit: 128MiB}\n", 3)
	resp, err := mm.LoadModel(t.Context(), &modelmesh.LoadModelRequest{ModelId: "v__isvc", ModelPath: dir})
	if err != nil {
		t.Fatal(err)
	}
	if resp.SizeInBytes != 3*128<<20 {
		t.Errorf("size %d MiB, want 3 versions × 128 MiB = 384 MiB", resp.SizeInBytes>>20)
	}
	if got, err := mm.ModelSize(t.Context(), &modelmesh.ModelSizeRequest{ModelId: "v__isvc"}); err != nil || got.SizeInBytes != resp.SizeInBytes {
		t.Errorf("modelSize %v, %v; want %d", got, err, resp.SizeInBytes)
	}
}

// TestE2EModelMeshConcurrentLoads: two loadModel calls for one id at once,
// one from a good folder and one from a folder that cannot load, take
// turns: the good one loads and serves from its staged folder, the bad one
// fails alone or finds the id loaded. Before, the failing call's clean-up
// removed the folder the other was loading from.
func TestE2EModelMeshConcurrentLoads(t *testing.T) {
	s, mm, root := meshServer(t, "2GiB")
	good := meshFolder(t, root, "good", "", 0)
	bad := filepath.Join(root, "bad") // two models, neither model.onnx
	if err := os.Mkdir(bad, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"a.onnx", "b.onnx"} {
		if err := os.Symlink(testModel(t, "example_dynamic_axes.onnx"), filepath.Join(bad, f)); err != nil {
			t.Fatal(err)
		}
	}
	ctx := t.Context()
	const rounds = 6
	for i := range rounds {
		id := fmt.Sprintf("m%d__isvc", i)
		type result struct {
			resp *modelmesh.LoadModelResponse
			err  error
		}
		goodDone, badDone := make(chan result, 1), make(chan result, 1)
		start := make(chan struct{})
		go func() {
			<-start
			r, err := mm.LoadModel(ctx, &modelmesh.LoadModelRequest{ModelId: id, ModelPath: good})
			goodDone <- result{r, err}
		}()
		go func() {
			<-start
			r, err := mm.LoadModel(ctx, &modelmesh.LoadModelRequest{ModelId: id, ModelPath: bad})
			badDone <- result{r, err}
		}()
		close(start)
		g, b := <-goodDone, <-badDone
		if g.err != nil {
			t.Fatalf("round %d: the good load failed: %v", i, g.err)
		}
		if b.err != nil && status.Code(b.err) != codes.InvalidArgument {
			t.Errorf("round %d: the bad load: %v, want InvalidArgument or the loaded model", i, b.err)
		}
		if b.err == nil && b.resp.SizeInBytes != g.resp.SizeInBytes {
			t.Errorf("round %d: the bad load succeeded with size %d, the loaded model is %d", i, b.resp.SizeInBytes, g.resp.SizeInBytes)
		}
		staged, _ := filepath.Glob(filepath.Join(os.TempDir(), fmt.Sprintf("sloserve-%d-models-*", s.cmd.Process.Pid), id, "1", "model.onnx"))
		if len(staged) != 1 {
			t.Errorf("round %d: the loaded model's staged file: %v, want one", i, staged)
		}
		req := grpcDynRequest()
		resp, err := s.grpc.ModelInfer(metadata.AppendToOutgoingContext(ctx, "mm-model-id", id), req)
		if err != nil || len(resp.RawOutputContents) != 1 {
			t.Fatalf("round %d: infer: %v, %v", i, resp, err)
		}
		closeTo(t, "row sum", bytesF32(resp.RawOutputContents[0]), []float64{55}, 1e-6)
		// One runner at a time on a busy machine.
		if _, err := mm.UnloadModel(ctx, &modelmesh.UnloadModelRequest{ModelId: id}); err != nil {
			t.Fatalf("round %d: unload: %v", i, err)
		}
	}
}
