package configs

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
)

// ModelFile is the file a version folder must hold.
const ModelFile = "model.onnx"

// SelectVersions applies the version policy to the versions found on disk
// and returns the ones to serve, sorted ascending. A zero policy is the
// default, the latest version.
func (m *Model) SelectVersions(available []int64) []int64 {
	vs := slices.Clone(available)
	slices.Sort(vs)
	vs = slices.Compact(vs)
	vp := m.VersionPolicy
	switch {
	case vp.All != nil:
		return vs
	case vp.Specific != nil:
		return slices.DeleteFunc(vs, func(v int64) bool { return !slices.Contains(vp.Specific.Versions, v) })
	}
	n := 1
	if vp.Latest != nil {
		n = max(vp.Latest.NumVersions, 0)
	}
	return vs[max(len(vs)-n, 0):]
}

// ListVersions returns the versions in a model folder, sorted ascending: the
// subfolders named by a positive integer (written without leading zeros)
// that hold model.onnx.
func ListVersions(dir string) ([]int64, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	versions := []int64{}
	for _, e := range entries {
		v, err := strconv.ParseInt(e.Name(), 10, 64)
		if err != nil || v < 1 || strconv.FormatInt(v, 10) != e.Name() {
			continue
		}
		if !e.IsDir() && e.Type()&fs.ModeSymlink == 0 {
			continue
		}
		fi, err := os.Stat(filepath.Join(dir, e.Name(), ModelFile))
		switch {
		case errors.Is(err, fs.ErrNotExist):
			continue
		case err != nil:
			// A symlink to a file gives ENOTDIR; anything else is real trouble.
			if st, serr := os.Stat(filepath.Join(dir, e.Name())); serr == nil && !st.IsDir() {
				continue
			}
			return nil, err
		case !fi.Mode().IsRegular():
			continue
		}
		versions = append(versions, v)
	}
	slices.Sort(versions)
	return versions, nil
}
