package configs

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// addSeeds adds every file matching the patterns to the seed corpus.
func addSeeds(f *testing.F, patterns ...string) {
	for _, p := range patterns {
		files, err := filepath.Glob(p)
		if err != nil {
			f.Fatal(err)
		}
		for _, file := range files {
			data, err := os.ReadFile(file)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(data)
		}
	}
}

func FuzzParseModel(f *testing.F) {
	addSeeds(f, "testdata/models/*.yaml", "testdata/repo/*/config.y*ml", "examples/model.yaml")
	f.Add([]byte("name: m\na: &a [*a]\n"))
	f.Add([]byte("name: m\ninputs: [{name: x, shape: [-1, 1.5, x]}, ~, 3]\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := ParseModel("m.yaml", data)
		if err != nil {
			if m != nil {
				t.Fatal("config returned with an error")
			}
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error does not wrap ErrInvalid: %v", err)
			}
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("ParseModel accepted a config that does not validate: %v", err)
		}
		_ = m.SelectVersions([]int64{1, 2, 3})
		_ = m.LatencyTarget()
	})
}

func FuzzParseServer(f *testing.F) {
	addSeeds(f, "testdata/*.yaml", "examples/server.yaml", "default.yaml")
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := ParseServer("s.yaml", data)
		if err != nil {
			if s != nil {
				t.Fatal("config returned with an error")
			}
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error does not wrap ErrInvalid: %v", err)
			}
			return
		}
		if err := s.Validate(); err != nil {
			t.Fatalf("ParseServer accepted a config that does not validate: %v", err)
		}
	})
}
