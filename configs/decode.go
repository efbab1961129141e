package configs

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"reflect"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// decodeStrict decodes data over out, a pointer to a struct that already
// holds the defaults, with unknown fields as errors. It also returns an index
// of the document's nodes by path, used to name fields in messages. ok is
// false when data is not YAML at all and out was left alone.
func decodeStrict(data []byte, out any) (idx *nodeIndex, errs problems, ok bool) {
	// Parse once into nodes for paths and lines, and to refuse extra
	// documents; then decode strictly with yaml's own decoder.
	var doc yaml.Node
	nodes := yaml.NewDecoder(bytes.NewReader(data))
	if err := nodes.Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
		return nil, problems{syntaxError(err, data)}, false
	}
	idx = newIndex(&doc)
	var extra yaml.Node
	if err := nodes.Decode(&extra); !errors.Is(err, io.EOF) {
		fe := &FieldError{Msg: "must hold a single YAML document", Line: extra.Line, hasScope: true}
		if err != nil {
			fe = syntaxError(err, data)
		}
		return idx, problems{fe}, false
	}

	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(out); err != nil && !errors.Is(err, io.EOF) {
		var te *yaml.TypeError
		if !errors.As(err, &te) {
			fe := syntaxError(err, data)
			return idx, problems{fe}, false
		}
		for _, msg := range te.Errors {
			errs = append(errs, translate(msg, idx))
		}
	}
	if root := idx.root; root != nil {
		checkIntegers(root, reflect.TypeOf(out).Elem(), "", &errs)
	}
	return idx, errs, true
}

var (
	durationType    = reflect.TypeFor[time.Duration]()
	unmarshalerType = reflect.TypeFor[yaml.Unmarshaler]()
)

// checkIntegers reports fractional numbers given for integer fields, which
// yaml.v3 would silently truncate (instances: 1.5 becomes 1).
func checkIntegers(n *yaml.Node, t reflect.Type, path string, errs *problems) {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == durationType || reflect.PointerTo(t).Implements(unmarshalerType) {
		return
	}
	switch n.Kind {
	case yaml.MappingNode:
		if t.Kind() != reflect.Struct {
			return
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			key := n.Content[i].Value
			if f, ok := fieldByTag(t, key); ok {
				checkIntegers(n.Content[i+1], f.Type, joinPath(path, key), errs)
			}
		}
	case yaml.SequenceNode:
		if t.Kind() != reflect.Slice {
			return
		}
		for i, c := range n.Content {
			checkIntegers(c, t.Elem(), fmt.Sprintf("%s[%d]", path, i), errs)
		}
	case yaml.ScalarNode:
		switch t.Kind() {
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
			reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		default:
			return
		}
		var f float64
		if n.ShortTag() == "!!float" && n.Decode(&f) == nil && f != math.Trunc(f) {
			*errs = append(*errs, &FieldError{
				Path: path, Line: n.Line, Msg: "want an integer, got " + n.Value,
				scope: path, hasScope: true,
			})
		}
	}
}

// fieldByTag finds the struct field whose yaml name is name.
func fieldByTag(t reflect.Type, name string) (reflect.StructField, bool) {
	for i := range t.NumField() {
		f := t.Field(i)
		if n, ok := yamlName(f); ok && n == name {
			return f, true
		}
	}
	return reflect.StructField{}, false
}

// yamlName is the key a field has in YAML; ok is false for fields YAML skips.
func yamlName(f reflect.StructField) (string, bool) {
	if !f.IsExported() {
		return "", false
	}
	tag, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
	switch tag {
	case "-":
		return "", false
	case "":
		return strings.ToLower(f.Name), true
	}
	return tag, true
}

func joinPath(parent, key string) string {
	if parent == "" {
		return key
	}
	return parent + "." + key
}

// nodeIndex finds the nodes of a parsed document by path and by line.
type nodeIndex struct {
	root    *yaml.Node
	entries []indexEntry
	values  map[string]*yaml.Node
	keys    map[string]*yaml.Node
}

type indexEntry struct {
	node  *yaml.Node
	path  string
	isKey bool
}

func newIndex(doc *yaml.Node) *nodeIndex {
	idx := &nodeIndex{values: map[string]*yaml.Node{}, keys: map[string]*yaml.Node{}}
	if doc.Kind == yaml.DocumentNode && len(doc.Content) == 1 {
		idx.root = doc.Content[0]
		idx.walk(idx.root, "")
	}
	return idx
}

// walk records n and its children. Aliases are not followed, so a document
// built to expand exponentially stays cheap to index.
func (x *nodeIndex) walk(n *yaml.Node, path string) {
	x.entries = append(x.entries, indexEntry{node: n, path: path})
	if _, seen := x.values[path]; !seen {
		x.values[path] = n
	}
	switch n.Kind {
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			p := joinPath(path, k.Value)
			x.entries = append(x.entries, indexEntry{node: k, path: p, isKey: true})
			if _, seen := x.keys[p]; !seen {
				x.keys[p] = k
			}
			x.walk(v, p)
		}
	case yaml.SequenceNode:
		for i, c := range n.Content {
			x.walk(c, fmt.Sprintf("%s[%d]", path, i))
		}
	}
}

// value returns the node at path, nil if the document has none.
func (x *nodeIndex) value(path string) *yaml.Node {
	if x == nil {
		return nil
	}
	return x.values[path]
}

// given reports whether the document sets path to something other than null.
func (x *nodeIndex) given(path string) bool {
	n := x.value(path)
	return n != nil && !(n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null")
}

// line is where path appears in the document (its key's line), or else
// where its nearest given parent does; 0 if none does.
func (x *nodeIndex) line(path string) int {
	if x == nil {
		return 0
	}
	for path != "" {
		if k := x.keys[path]; k != nil {
			return k.Line
		}
		if v := x.values[path]; v != nil {
			return v.Line
		}
		if i := strings.LastIndexAny(path, ".["); i >= 0 {
			path = path[:i]
		} else {
			path = ""
		}
	}
	return 0
}

// keyAt finds the mapping key named name on line.
func (x *nodeIndex) keyAt(line int, name string) *indexEntry {
	if x == nil {
		return nil
	}
	for i := range x.entries {
		e := &x.entries[i]
		if e.isKey && e.node.Line == line && e.node.Value == name {
			return e
		}
	}
	return nil
}

// valueAt finds the value node on line that best matches a yaml.v3 message:
// its tag and (possibly truncated, "abcdefg...") value.
func (x *nodeIndex) valueAt(line int, tag, value string) *indexEntry {
	if x == nil {
		return nil
	}
	var best *indexEntry
	bestScore := -1
	for i := range x.entries {
		e := &x.entries[i]
		if e.isKey || e.node.Line != line {
			continue
		}
		score := 0
		if e.node.ShortTag() == tag || e.node.Tag == tag {
			score += 2
		}
		if e.node.Value == value || (strings.HasSuffix(value, "...") && strings.HasPrefix(e.node.Value, strings.TrimSuffix(value, "..."))) {
			score++
		}
		if score > bestScore {
			best, bestScore = e, score
		}
	}
	return best
}
