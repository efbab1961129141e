package configs

import (
	"errors"
	"fmt"
	"math"
	"math/big"
	"reflect"
	"regexp"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

// ByteSize is a number of bytes. In YAML it is a non-negative integer or a
// string with a unit: decimal kB, MB, GB, TB, PB (powers of 1000) or binary
// KiB, MiB, GiB, TiB, PiB (powers of 1024); units are case-insensitive and
// "1.5GiB" is fine as long as the result is a whole number of bytes.
type ByteSize int64

// Binary byte-size units.
const (
	KiB ByteSize = 1 << (10 * (iota + 1))
	MiB
	GiB
	TiB
	PiB
)

var byteSizeTypeName = reflect.TypeFor[ByteSize]().String()

var (
	byteSizeRE = regexp.MustCompile(`^([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*([A-Za-z]*)$`)
	byteUnits  = map[string]int64{
		"": 1, "b": 1,
		"k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
		"t": 1e12, "tb": 1e12, "p": 1e15, "pb": 1e15,
		"ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30, "gib": 1 << 30,
		"ti": 1 << 40, "tib": 1 << 40, "pi": 1 << 50, "pib": 1 << 50,
	}
)

// ParseByteSize parses "1024", "512MiB", "64MB", "1.5GiB" and the like.
func ParseByteSize(s string) (ByteSize, error) {
	b, err := parseByteSize(s)
	if err != nil {
		return 0, fmt.Errorf("invalid byte size %q: %w", s, err)
	}
	return b, nil
}

func parseByteSize(s string) (ByteSize, error) {
	t := strings.TrimSpace(s)
	switch {
	case t == "":
		return 0, errors.New("empty")
	case strings.HasPrefix(t, "-"):
		return 0, errors.New("must not be negative")
	}
	m := byteSizeRE.FindStringSubmatch(t)
	if m == nil {
		return 0, errors.New("not a number with an optional unit")
	}
	mult, ok := byteUnits[strings.ToLower(m[2])]
	if !ok {
		return 0, fmt.Errorf("unknown unit %q (want B, kB, MB, GB, TB, PB, KiB, MiB, GiB, TiB or PiB)", m[2])
	}
	r, ok := new(big.Rat).SetString(m[1])
	if !ok {
		return 0, errors.New("not a number")
	}
	r.Mul(r, new(big.Rat).SetInt64(mult))
	if !r.IsInt() {
		return 0, errors.New("not a whole number of bytes")
	}
	if !r.Num().IsInt64() {
		return 0, errors.New("too large")
	}
	return ByteSize(r.Num().Int64()), nil
}

// UnmarshalYAML accepts an integer or a string with a unit.
func (b *ByteSize) UnmarshalYAML(n *yaml.Node) error {
	fail := func(reason string) error {
		return &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d: cannot unmarshal %s `%s` into %s: %s",
			n.Line, n.ShortTag(), n.Value, byteSizeTypeName, reason)}}
	}
	if n.Kind != yaml.ScalarNode {
		return &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d: cannot unmarshal %s into %s", n.Line, n.ShortTag(), byteSizeTypeName)}}
	}
	switch n.ShortTag() {
	case "!!int":
		var v int64
		if err := n.Decode(&v); err != nil {
			return fail("too large")
		}
		if v < 0 {
			return fail("must not be negative")
		}
		*b = ByteSize(v)
	case "!!float":
		var f float64
		switch err := n.Decode(&f); {
		case err != nil || math.IsNaN(f) || math.IsInf(f, 0):
			return fail("not a byte size")
		case f < 0:
			return fail("must not be negative")
		case f != math.Trunc(f):
			return fail("not a whole number of bytes")
		case f >= math.MaxInt64:
			return fail("too large")
		}
		*b = ByteSize(f)
	case "!!str":
		v, err := parseByteSize(n.Value)
		if err != nil {
			return fail(err.Error())
		}
		*b = v
	default:
		return fail("not a byte size")
	}
	return nil
}

// MarshalYAML writes whole binary units as a string ("64MiB") and anything
// else as an integer, so the result reads back to the same value.
func (b ByteSize) MarshalYAML() (any, error) {
	if s := b.String(); !isDigits(s) {
		return s, nil
	}
	return int64(b), nil
}

// String formats b in the largest binary unit that divides it exactly
// ("64MiB"), or as a plain number of bytes.
func (b ByteSize) String() string {
	if b > 0 {
		for _, u := range []struct {
			size ByteSize
			name string
		}{{PiB, "PiB"}, {TiB, "TiB"}, {GiB, "GiB"}, {MiB, "MiB"}, {KiB, "KiB"}} {
			if b%u.size == 0 {
				return strconv.FormatInt(int64(b/u.size), 10) + u.name
			}
		}
	}
	return strconv.FormatInt(int64(b), 10)
}

func isDigits(s string) bool {
	return strings.TrimLeft(s, "-0123456789") == ""
}
