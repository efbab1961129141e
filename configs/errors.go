// Package configs holds the server and model configuration: the types, their
// defaults, strict YAML decoding (unknown fields are errors) and validation.
// A model's config may also come from a Triton config.pbtxt (triton.go),
// mapped onto the same Model field by field, unsupported fields named.
// Every problem is reported as a *FieldError that names the file and the
// dotted YAML path of the field, and all problems in a file are reported
// together (errors.Join), not just the first.
//
// It owns what a valid configuration is, the mapping between a Model and
// Triton's ModelConfig message (whose wire format it takes from
// api/inference, which holds no logic), and the files that ship with it:
// the embedded default.yaml, the example model config, the Prometheus rules
// and the Grafana dashboard. It must not act on a configuration: it reads
// the files a config names (certificates, tokens) to validate them, but it
// starts nothing, opens no listener and keeps no state between calls.
package configs

import (
	"cmp"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

var (
	// ErrInvalid is wrapped by every problem found in a config file or an
	// override, so callers can tell a bad config from a missing file.
	ErrInvalid = errors.New("invalid config")
	// ErrUnknownKey is returned by Server.Set for a key that names no field.
	ErrUnknownKey = errors.New("unknown config key")
)

// FieldError is one problem in a config.
type FieldError struct {
	File string // the file as given to the loader; "" for overrides
	Path string // dotted YAML path such as "slo.latency_ms" or "inputs[0].shape[1]"; "" for the whole file
	Line int    // 1-based line in File; 0 when unknown
	Msg  string

	// scope is the path whose validation problems this decode problem
	// makes unreliable (the field did not decode, or a list lost an element).
	scope    string
	hasScope bool
}

// Error formats the problem as "file: path: message (line n)".
func (e *FieldError) Error() string {
	var b strings.Builder
	if e.File != "" {
		b.WriteString(e.File)
		b.WriteString(": ")
	}
	if e.Path != "" {
		b.WriteString(e.Path)
		b.WriteString(": ")
	}
	b.WriteString(e.Msg)
	if e.Line > 0 {
		fmt.Fprintf(&b, " (line %d)", e.Line)
	}
	return b.String()
}

// Unwrap makes every FieldError match ErrInvalid.
func (e *FieldError) Unwrap() error { return ErrInvalid }

// problems collects FieldErrors during validation.
type problems []*FieldError

func (p *problems) add(path, format string, args ...any) {
	*p = append(*p, &FieldError{Path: path, Msg: fmt.Sprintf(format, args...)})
}

// oneOf reports got unless it is one of allowed.
func (p *problems) oneOf(path, got string, allowed ...string) {
	if !slices.Contains(allowed, got) {
		p.add(path, "must be one of %s; got %q", strings.Join(allowed, ", "), got)
	}
}

func (p problems) has(path string) bool {
	return slices.ContainsFunc(p, func(e *FieldError) bool { return e.Path == path })
}

// join turns the problems into one error, nil when there are none.
func (p problems) join() error {
	if len(p) == 0 {
		return nil
	}
	errs := make([]error, len(p))
	for i, e := range p {
		errs[i] = e
	}
	return errors.Join(errs...)
}

// finish merges decode and validation problems for one file: it drops
// validation problems that a decode problem makes unreliable, fills in the
// file and line numbers, and sorts by line.
func finish(file string, idx *nodeIndex, decoded, validated problems) problems {
	out := slices.Clone(decoded)
	for _, v := range validated {
		if !suppressed(v.Path, decoded) {
			out = append(out, v)
		}
	}
	for _, e := range out {
		e.File = file
		if e.Line == 0 {
			e.Line = idx.line(e.Path)
		}
	}
	slices.SortStableFunc(out, func(a, b *FieldError) int {
		return cmp.Compare(sortLine(a.Line), sortLine(b.Line))
	})
	return out
}

func sortLine(l int) int {
	if l == 0 {
		return int(^uint(0) >> 1)
	}
	return l
}

func suppressed(path string, decoded problems) bool {
	for _, d := range decoded {
		if !d.hasScope {
			continue
		}
		s := d.scope
		if s == "" || path == s || strings.HasPrefix(path, s+".") || strings.HasPrefix(path, s+"[") {
			return true
		}
	}
	return false
}

// The messages yaml.v3 puts in a TypeError, and the ones ByteSize copies.
var (
	lineRE         = regexp.MustCompile(`(?s)^line (\d+): (.*)$`)
	unknownFieldRE = regexp.MustCompile(`(?s)^field (.*) not found in type \S+$`)
	duplicateRE    = regexp.MustCompile(`(?s)^(?:mapping key (".*") already defined at line (\d+)|field (.*) already set in type \S+)$`)
	cannotRE       = regexp.MustCompile("(?s)^cannot unmarshal (\\S+)(?: `(.*)`)? into (\\S+?)(?:: (.*))?$")
	syntaxRE       = regexp.MustCompile(`(?s)^yaml: line (\d+): (.*)$`)
)

// translate turns one yaml.v3 type-error message into a FieldError with the
// path of the node it is about, found through idx by line and value.
func translate(msg string, idx *nodeIndex) *FieldError {
	fe := &FieldError{Msg: msg}
	m := lineRE.FindStringSubmatch(msg)
	if m == nil {
		fe.hasScope = true // unknown trouble: distrust everything
		return fe
	}
	fe.Line, _ = strconv.Atoi(m[1])
	rest := m[2]

	if sm := unknownFieldRE.FindStringSubmatch(rest); sm != nil {
		if e := idx.keyAt(fe.Line, sm[1]); e != nil {
			fe.Path, fe.Msg = e.path, "unknown field"
		} else {
			fe.Msg = fmt.Sprintf("unknown field %q", sm[1])
		}
		return fe
	}

	if sm := duplicateRE.FindStringSubmatch(rest); sm != nil {
		key, first := sm[3], ""
		if sm[1] != "" {
			key, _ = strconv.Unquote(sm[1])
			first = fmt.Sprintf(" (first at line %s)", sm[2])
		}
		fe.Msg = "duplicate key" + first
		fe.hasScope = true
		if e := idx.keyAt(fe.Line, key); e != nil {
			fe.Path = e.path
			// yaml.v3 drops the whole mapping that holds a duplicate key.
			fe.scope = listScope(parentPath(e.path))
		} else {
			fe.Msg = fmt.Sprintf("duplicate key %q%s", key, first)
		}
		return fe
	}

	if sm := cannotRE.FindStringSubmatch(rest); sm != nil {
		tag, value, typ, reason := sm[1], sm[2], sm[3], sm[4]
		fe.hasScope = true
		if e := idx.valueAt(fe.Line, tag, value); e != nil {
			fe.Path = e.path
			fe.scope = listScope(e.path)
			value = e.node.Value
		}
		fe.Msg = fmt.Sprintf("want %s, got %s", describeType(typ), describeValue(tag, value))
		if reason != "" {
			fe.Msg += ": " + reason
		}
		return fe
	}
	fe.Msg = rest
	fe.hasScope = true
	return fe
}

// parentPath strips the last ".key" from a path.
func parentPath(path string) string {
	if i := strings.LastIndexByte(path, '.'); i >= 0 {
		return path[:i]
	}
	return ""
}

// listScope returns the list that holds path when path is a list element
// (yaml.v3 drops elements that fail, so the list's indexes shift), else path.
func listScope(path string) string {
	if strings.HasSuffix(path, "]") {
		if i := strings.LastIndexByte(path, '['); i >= 0 {
			return path[:i]
		}
	}
	return path
}

// describeType names a Go type the way a config author thinks of it.
func describeType(typ string) string {
	typ = strings.TrimLeft(typ, "*")
	switch {
	case typ == "time.Duration":
		return `a duration such as "500ms" or "2s"`
	case typ == byteSizeTypeName:
		return `a byte size such as 1024, "64MiB" or "1GiB"`
	case strings.HasPrefix(typ, "[]"):
		return "a list"
	case strings.HasPrefix(typ, "map["), strings.HasPrefix(typ, "configs."):
		return "a mapping"
	case strings.HasPrefix(typ, "uint"):
		return "a non-negative integer"
	case strings.HasPrefix(typ, "int"):
		return "an integer"
	case strings.HasPrefix(typ, "float"):
		return "a number"
	case typ == "string":
		return "a string"
	case typ == "bool":
		return "true or false"
	}
	return "a value of type " + typ
}

func describeValue(tag, value string) string {
	switch tag {
	case "!!map":
		return "a mapping"
	case "!!seq":
		return "a list"
	case "!!null":
		return "null"
	case "!!str", "":
		return strconv.Quote(value)
	}
	return value
}

// syntaxError turns a yaml.v3 parse error into a FieldError.
func syntaxError(err error, data []byte) *FieldError {
	fe := &FieldError{hasScope: true}
	if m := syntaxRE.FindStringSubmatch(err.Error()); m != nil {
		fe.Line, _ = strconv.Atoi(m[1])
		fe.Msg = "invalid YAML: " + m[2]
		fe.Line = syntaxErrorLine(data, fe.Line)
	} else {
		fe.Msg = "invalid YAML: " + strings.TrimPrefix(err.Error(), "yaml: ")
	}
	return fe
}

// syntaxErrorLine finds the line of a syntax error that yaml.v3 reported at
// line. For an error of its parser (an unclosed bracket, a key where a
// list item belongs) yaml.v3 names the line before the one where the
// construct around the problem starts, not the problem's own; for an
// error of its scanner, the problem's line. Either way the problem is at
// or after line, on the first line at which the document, cut there,
// stops being YAML: found by bisection, since a longer cut of a
// document that failed fails too, but for the rare construct that spans
// the cut (a quoted string over several lines), where the answer is the
// line it starts on.
func syntaxErrorLine(data []byte, line int) int {
	ends := []int{} // ends[i]: the offset just past line i+1
	for i, b := range data {
		if b == '\n' {
			ends = append(ends, i+1)
		}
	}
	if len(data) > 0 && data[len(data)-1] != '\n' {
		ends = append(ends, len(data))
	}
	fails := func(n int) bool { // the first n lines are not YAML
		var doc yaml.Node
		err := yaml.Unmarshal(data[:ends[n-1]], &doc)
		return err != nil
	}
	lo, hi := max(line, 1), len(ends)
	if lo > hi || !fails(hi) {
		return line
	}
	for lo < hi {
		mid := lo + (hi-lo)/2
		if fails(mid) {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	return lo
}
