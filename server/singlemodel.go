package server

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/models"
)

// A serving runtime under KServe is handed one model folder (mounted at
// /mnt/models) and a name, not a repository. The registry only knows
// repositories, so the server stages one: a temporary folder holding
// <name>/config.yaml and version folders that link back into the model
// folder, which may be read-only. The registry then loads it as any other
// model, in model control mode none.

// singleModel stages cfg.ModelDir as a repository when it is set, or makes
// an empty staged repository for ModelMesh to fill when listen.modelmesh is
// set. It returns the config with repositories replaced by the staged one,
// a function that gives a reloaded config the same replacement (the staged
// folder is made once per start), the function that removes the staging,
// and the staged folder. With neither it returns cfg unchanged.
func singleModel(cfg *configs.Server) (*configs.Server, func(*configs.Server), func(), string, error) {
	if cfg.ModelDir == "" && cfg.Listen.ModelMesh == "" {
		return cfg, func(*configs.Server) {}, func() {}, "", nil
	}
	// Made like the runners' socket folders (sloserve-<pid>-*, with an
	// owner file), so a server killed before it could remove it has it
	// removed by the next start or `sloserve cleanup`, as those are.
	tmp, err := makeServerDir(dirModels, "models-")
	if err != nil {
		return nil, nil, nil, "", fmt.Errorf("a folder to stage models in: %w", err)
	}
	remove := func() { os.RemoveAll(tmp) }
	if cfg.ModelDir != "" {
		if err := stageModel(cfg.ModelDir, cfg.ModelName, tmp); err != nil {
			remove()
			return nil, nil, nil, "", fmt.Errorf("model_dir %s: %w", cfg.ModelDir, err)
		}
	}
	staged := *cfg
	staged.Repositories = []string{tmp}
	// A reload rereads the sources, which name the configured repositories
	// again; the staged one stays (a changed model_dir needs a restart, as
	// the reload reports).
	keep := func(next *configs.Server) { next.Repositories = []string{tmp} }
	return &staged, keep, remove, tmp, nil
}

// singleModelReady is the server's readiness with --model-dir: the one
// model it was given serves. KServe routes to a predictor once its probe
// says ready, and a server whose only model failed to load (or whose
// runners are all down) can answer nothing. In other modes it is true:
// readiness is the server's own.
func singleModelReady(cfg configs.Server, reg *models.Registry) bool {
	if cfg.ModelDir == "" {
		return true
	}
	ok, _ := reg.ModelReady(cfg.ModelName, "")
	return ok
}

// stageModel writes repo/<name>/ for the model in dir. dir holds, in the
// order they are looked for:
//   - version folders <N>/model.onnx (the repository layout of one model);
//   - <name>/<N>/model.onnx (a Triton-style repository holding the model);
//   - model.onnx, or else exactly one *.onnx file: served as version 1.
//
// A config.yaml (or config.yml) found beside the versions is used with its
// name set to name; else a Triton config.pbtxt, renamed the same way (a
// model migrated from Triton keeps its batching and instances); without
// either the model gets the default model config.
func stageModel(dir, name, repo string) error {
	st, err := os.Stat(dir)
	if err != nil {
		return err
	}
	if !st.IsDir() {
		return errors.New("not a folder")
	}
	src := dir
	versions, err := configs.ListVersions(src)
	if err != nil {
		return err
	}
	if len(versions) == 0 {
		if vs, err := configs.ListVersions(filepath.Join(dir, name)); err == nil && len(vs) > 0 {
			src, versions = filepath.Join(dir, name), vs
		}
	}
	out := filepath.Join(repo, name)
	if err := os.Mkdir(out, 0o755); err != nil {
		return err
	}
	if len(versions) > 0 {
		for _, v := range versions {
			n := strconv.FormatInt(v, 10)
			abs, err := filepath.Abs(filepath.Join(src, n))
			if err != nil {
				return err
			}
			if err := os.Symlink(abs, filepath.Join(out, n)); err != nil {
				return err
			}
		}
	} else if err := stageFlat(src, filepath.Join(out, "1")); err != nil {
		return err
	}
	cfg, file, err := modelConfig(src, name)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(out, file), cfg, 0o644)
}

// stageFlat makes version folder v for a model file lying directly in dir:
// a link to every entry of dir (so external-data files beside the model
// are found), with the model file linked as model.onnx.
func stageFlat(dir, v string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var onnx []string
	hasModel := false
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".onnx") {
			continue
		}
		if e.Name() == configs.ModelFile {
			hasModel = true
		}
		onnx = append(onnx, e.Name())
	}
	switch {
	case hasModel:
	case len(onnx) == 1:
	case len(onnx) == 0:
		return errors.New("no model found: want model.onnx, a single *.onnx file, version folders <N>/model.onnx or <model_name>/<N>/model.onnx")
	default:
		return fmt.Errorf("several .onnx files and none is model.onnx: %s", strings.Join(onnx, ", "))
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	if err := os.Mkdir(v, 0o755); err != nil {
		return err
	}
	for _, e := range entries {
		link := e.Name()
		if !hasModel && link == onnx[0] {
			link = configs.ModelFile
		}
		if slices.Contains([]string{configs.ModelConfigFile, configs.ModelConfigFileAlt, configs.ModelConfigPbtxt}, e.Name()) {
			continue
		}
		if err := os.Symlink(filepath.Join(abs, e.Name()), filepath.Join(v, link)); err != nil {
			return err
		}
	}
	return nil
}

// modelConfig returns the staged model's config and the file to write it
// to: dir's config.yaml, else its config.pbtxt, with the name replaced, or
// the least config.yaml there is.
func modelConfig(dir, name string) ([]byte, string, error) {
	var data []byte
	file := ""
	for _, f := range []string{configs.ModelConfigFile, configs.ModelConfigFileAlt} {
		b, err := configs.ReadFile(filepath.Join(dir, f))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, "", err
		}
		data, file = b, filepath.Join(dir, f)
		break
	}
	if file == "" {
		pbtxt := filepath.Join(dir, configs.ModelConfigPbtxt)
		b, err := configs.ReadFile(pbtxt)
		switch {
		case err == nil:
			out, err := configs.RenameTritonModel(pbtxt, b, name)
			return out, configs.ModelConfigPbtxt, err
		case !errors.Is(err, fs.ErrNotExist):
			return nil, "", err
		}
		return fmt.Appendf(nil, "# Staged by sloserve for model_dir: the default model config.\nname: %s\nplatform: onnx\n", name), configs.ModelConfigFile, nil
	}
	// Edit the document's tree rather than a decoded struct, so every
	// setting (and its comments) is written back as it was.
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, "", fmt.Errorf("%s: %w", file, err)
	}
	if doc.Kind != yaml.DocumentNode || len(doc.Content) != 1 || doc.Content[0].Kind != yaml.MappingNode {
		return nil, "", fmt.Errorf("%s: not a mapping", file)
	}
	m := doc.Content[0]
	found := false
	for i := 0; i+1 < len(m.Content); i += 2 {
		if m.Content[i].Value == "name" {
			m.Content[i+1] = &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: name}
			found = true
		}
	}
	if !found {
		m.Content = append([]*yaml.Node{
			{Kind: yaml.ScalarNode, Tag: "!!str", Value: "name"},
			{Kind: yaml.ScalarNode, Tag: "!!str", Value: name},
		}, m.Content...)
	}
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(&doc); err != nil {
		return nil, "", err
	}
	if err := enc.Close(); err != nil {
		return nil, "", err
	}
	return buf.Bytes(), configs.ModelConfigFile, nil
}
