package predictor

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// Profile is a model's fitted curve with the points it was fitted to: what
// Cache keeps so that a restart does not profile again.
type Profile struct {
	Key     string
	Points  []Point
	Curve   Curve
	MAPE    float64 // of Curve on Points
	Created time.Time
}

// NewProfile fits points and returns the profile to cache under key.
func NewProfile(key string, points []Point, created time.Time) (Profile, error) {
	c, err := Fit(points)
	if err != nil {
		return Profile{}, err
	}
	return Profile{Key: key, Points: points, Curve: c, MAPE: MAPE(c, points), Created: created}, nil
}

// Cache keeps profiles on disk, one JSON file per key under Dir.
type Cache struct{ Dir string }

// ErrBadKey is returned for a key that is not a plain file name.
var ErrBadKey = errors.New("predictor: invalid profile key")

func (c Cache) path(key string) (string, error) {
	if !safeName(key) {
		return "", fmt.Errorf("%w %q", ErrBadKey, key)
	}
	return filepath.Join(c.Dir, key+".json"), nil
}

// safeName reports whether key can be a file name on any system: letters,
// digits, '-', '_' and '.', not leading with '.', at most 128 bytes.
func safeName(key string) bool {
	if key == "" || len(key) > 128 || key[0] == '.' {
		return false
	}
	for _, r := range key {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
			return false
		}
	}
	return true
}

// Load reads the profile stored under key. A missing file is (zero, false,
// nil). A file that cannot be decoded, or that holds another key or an
// unusable curve, is an error; callers treat that like a miss and profile
// again (Store then replaces the file).
func (c Cache) Load(key string) (Profile, bool, error) {
	path, err := c.path(key)
	if err != nil {
		return Profile{}, false, err
	}
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return Profile{}, false, nil
	}
	if err != nil {
		return Profile{}, false, fmt.Errorf("predictor: reading profile: %w", err)
	}
	var p Profile
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		return Profile{}, false, fmt.Errorf("predictor: decoding profile %s: %w", path, err)
	}
	if p.Key != key {
		return Profile{}, false, fmt.Errorf("predictor: profile %s holds key %q", path, p.Key)
	}
	if !p.Curve.valid() {
		return Profile{}, false, fmt.Errorf("predictor: profile %s holds an unusable curve %+v", path, p.Curve)
	}
	return p, true, nil
}

// Store writes p under p.Key. The file is written to a temporary name in
// Dir, synced and renamed into place, so a reader sees the old profile or
// the new one, never a torn file.
func (c Cache) Store(p Profile) (err error) {
	path, err := c.path(p.Key)
	if err != nil {
		return err
	}
	data, err := json.MarshalIndent(p, "", "  ")
	if err != nil {
		return fmt.Errorf("predictor: encoding profile %s: %w", p.Key, err)
	}
	if err := os.MkdirAll(c.Dir, 0o755); err != nil {
		return fmt.Errorf("predictor: profile cache: %w", err)
	}
	f, err := os.CreateTemp(c.Dir, "."+p.Key+".*.tmp")
	if err != nil {
		return fmt.Errorf("predictor: profile cache: %w", err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if _, err := f.Write(append(data, '\n')); err != nil {
		return fmt.Errorf("predictor: writing profile: %w", err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("predictor: writing profile: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("predictor: writing profile: %w", err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("predictor: writing profile: %w", err)
	}
	return nil
}

// Key identifies a profile: the SHA-256 of the model file's bytes, the
// machine (see MachineID) and extra strings such as the execution provider,
// thread settings, input shapes and ONNX Runtime version, in order. The
// result is 64 hex digits, safe as a file name.
func Key(modelFile string, machine string, extra ...string) (string, error) {
	f, err := os.Open(modelFile)
	if err != nil {
		return "", fmt.Errorf("predictor: profile key: %w", err)
	}
	defer f.Close()
	fh := sha256.New()
	if _, err := io.Copy(fh, f); err != nil {
		return "", fmt.Errorf("predictor: profile key: hashing %s: %w", modelFile, err)
	}
	h := sha256.New()
	// v2: profiles hold each point's peak memory; a v1 profile, without
	// it, is measured again rather than leave memory shares unsized.
	// v3: points hold their row size and curves are in size; a v2
	// profile is measured again at every profile shape.
	// v4: curves hold the largest work they were fitted on (MaxWork);
	// a v3 curve would extrapolate its square past it.
	// v5: a point is the median of windows of back-to-back runs (each
	// the mean over at least 50 ms), not of single runs, and points far
	// above the fit are measured again; a v4 profile of a short batch
	// under a CPU quota held either of two speeds.
	// v6: windows of at least 200 ms; a v5 point of a batch under a
	// CPU quota was up to 7% off by the quota's phase in its window.
	// v7: a point's windows are taken in rounds over its batch's shapes,
	// moments apart, and a point never run is warmed for a window; in a
	// v6 profile the shapes listed last were measured seconds after the
	// others (a machine slowing down meanwhile read as their size's
	// cost), and a large point's first runs were in its first window.
	h.Write([]byte("sloserve-profile-v7\x00"))
	h.Write(fh.Sum(nil))
	writeField(h, machine)
	for _, e := range extra {
		writeField(h, e)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// writeField writes a length-prefixed string, so that ("ab", "c") and
// ("a", "bc") hash differently.
func writeField(h hash.Hash, s string) {
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(s)))
	h.Write(n[:])
	h.Write([]byte(s))
}

// MachineID describes this machine for profile keys: the CPU model name from
// /proc/cpuinfo, the number of CPUs the process may use and GOARCH. It is
// stable across restarts as long as the hardware and CPU affinity are.
func MachineID() string { return MachineIDWithGPU("") }

// MachineIDWithGPU is MachineID with the name of the GPU the profile is
// for; an empty name is the CPU-only MachineID.
func MachineIDWithGPU(gpu string) string {
	cpuinfo, _ := os.ReadFile("/proc/cpuinfo")
	return machineID(cpuinfo, runtime.NumCPU(), runtime.GOARCH, gpu)
}

func machineID(cpuinfo []byte, ncpu int, arch, gpu string) string {
	model := "unknown"
	// x86 says "model name"; arm kernels say "Hardware", "Model" or
	// "CPU part", depending on the version.
	for _, field := range []string{"model name", "Hardware", "Model", "CPU part"} {
		if v := cpuField(cpuinfo, field); v != "" {
			model = v
			break
		}
	}
	id := "cpu=" + model + ";cpus=" + strconv.Itoa(ncpu) + ";arch=" + arch
	if gpu != "" {
		id += ";gpu=" + gpu
	}
	return id
}

// cpuField returns the value of the first "name : value" line in cpuinfo.
func cpuField(cpuinfo []byte, name string) string {
	sc := bufio.NewScanner(bytes.NewReader(cpuinfo))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == name {
			return strings.Join(strings.Fields(v), " ")
		}
	}
	return ""
}
