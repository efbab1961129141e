package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/models"
)

// errCheckFailed is check's answer when it found problems; they are
// printed already.
var errCheckFailed = errors.New("problems found")

// check validates the server config and every model folder of its
// repositories without serving, as promtool check config does: the same
// errors a server gives at start and at load, one block per file, and a
// non-zero exit on any.
func check(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("check", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, `Usage: sloserve check [flags]

Checks the server config (the --config file or the embedded default, the
environment, the flags, as serve reads them) and every model folder of its
repositories (config.yaml or Triton config.pbtxt, completed from the model
as a load does; the versions the policy selects; each model file's inputs
and outputs against the config), without serving. Prints each problem with
its file, field and line; exits 1 when there is any.

Flags:
`)
		fs.PrintDefaults()
	}
	cfg, _, err := loadConfig(fs, args, 0)
	if errors.Is(err, flag.ErrHelp) || (fs.Parsed() && fs.NArg() > 0) {
		return err // a usage error, not a finding
	}
	source := "the embedded default"
	if f := fs.Lookup("config"); f != nil && f.Value.String() != "" {
		source = f.Value.String()
	}
	fmt.Fprintf(stdout, "Checking server config %s\n", source)
	if err != nil {
		fmt.Fprintln(stdout, "  FAILED")
		printProblems(stdout, err)
		return errCheckFailed
	}
	fmt.Fprintln(stdout, "  SUCCESS")

	failed := false
	opts := models.CheckOptions{
		MaxBatchSize:      cfg.Limits.MaxBatchSize,
		MaxTensorElements: cfg.Limits.MaxTensorElements,
		HasGPU:            cfg.GPU.Simulator.Devices > 0,
	}
	if cfg.ModelDir != "" {
		fmt.Fprintf(stdout, "Checking model_dir %s (as model %s)\n", cfg.ModelDir, cfg.ModelName)
		fmt.Fprintln(stdout, "  not checked: the folder is staged under model_name when the server starts; check its repository form")
	}
	seen := map[string]string{}
	for _, repo := range cfg.Repositories {
		entries, err := os.ReadDir(repo)
		if err != nil {
			fmt.Fprintf(stdout, "Checking repository %s\n  FAILED\n", repo)
			printProblems(stdout, err)
			failed = true
			continue
		}
		fmt.Fprintf(stdout, "Checking repository %s\n", repo)
		n := 0
		for _, e := range entries {
			if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
				continue // as the server's scan
			}
			n++
			if prev, dup := seen[e.Name()]; dup {
				fmt.Fprintf(stdout, "  %s: WARNING: also in %s, which the server uses\n", e.Name(), prev)
				continue
			}
			seen[e.Name()] = repo
			dir := filepath.Join(repo, e.Name())
			m, versions, err := models.CheckFolder(dir, opts)
			if err != nil {
				fmt.Fprintf(stdout, "  %s: FAILED\n", e.Name())
				printProblems(stdout, err)
				failed = true
				continue
			}
			from := "no config file, completed from the model"
			if filepath.Dir(m.File) == dir {
				from = filepath.Base(m.File)
			}
			fmt.Fprintf(stdout, "  %s: SUCCESS (%s; versions %v; %s)\n", e.Name(), from, versions, describeModel(m))
			for _, w := range m.Warnings {
				fmt.Fprintf(stdout, "    WARNING: %s\n", w)
			}
		}
		if n == 0 {
			fmt.Fprintln(stdout, "  no model folders")
		}
	}
	if failed {
		return errCheckFailed
	}
	return nil
}

// describeModel is the one line of what a checked model serves as.
func describeModel(m *configs.Model) string {
	device := m.Execution.Provider
	if m.Execution.Auto && device == configs.ProviderCPU {
		device = "auto (cpu here; the GPU on a server with one)"
	}
	s := fmt.Sprintf("max_batch_size %d, %d inputs, %d outputs, %s", m.MaxBatchSize, len(m.Inputs), len(m.Outputs), device)
	if m.SLO.LatencyMS > 0 {
		s += fmt.Sprintf(", %s %gms", m.SLO.Class, m.SLO.LatencyMS)
	}
	return s
}

// printProblems prints each line of err (errors.Join puts one problem on a
// line) indented under its heading, which says it failed: the words the
// server puts before a bad config's problems are left out.
func printProblems(w io.Writer, err error) {
	for _, line := range strings.Split(err.Error(), "\n") {
		line = strings.Replace(line, models.ErrBadConfig.Error()+": ", "", 1)
		fmt.Fprintf(w, "    %s\n", line)
	}
}
