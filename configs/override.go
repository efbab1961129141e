package configs

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"

	"gopkg.in/yaml.v3"
)

// EnvPrefix starts the name of every environment variable ApplyEnv reads.
const EnvPrefix = "SLOSERVE_"

// envAliases are extra environment variable names for keys, for scripts
// that already set them.
var envAliases = map[string]string{
	"SLOSERVE_ONNXRUNTIME_LIBRARY": "runtime.onnxruntime_library",
}

// Keys lists the dotted keys of every server setting, in file order, for
// Set, ApplyEnv and --help.
func Keys() []string { return slices.Clone(serverKeys()) }

var serverKeys = sync.OnceValue(func() []string {
	var keys []string
	var walk func(t reflect.Type, prefix string)
	walk = func(t reflect.Type, prefix string) {
		for i := range t.NumField() {
			f := t.Field(i)
			name, ok := yamlName(f)
			if !ok {
				continue
			}
			key := joinPath(prefix, name)
			if isLeaf(f.Type) {
				keys = append(keys, key)
			} else {
				walk(f.Type, key)
			}
		}
	}
	walk(reflect.TypeFor[Server](), "")
	return keys
})

func isLeaf(t reflect.Type) bool {
	return t.Kind() != reflect.Struct || reflect.PointerTo(t).Implements(unmarshalerType)
}

// EnvVar is the environment variable ApplyEnv reads for key:
// "limits.max_request_bytes" is SLOSERVE_LIMITS_MAX_REQUEST_BYTES.
func EnvVar(key string) string {
	return EnvPrefix + strings.ToUpper(strings.ReplaceAll(key, ".", "_"))
}

// Set sets the setting at a dotted key such as "listen.http" or
// "limits.max_request_bytes". The value is read as YAML would read it
// ("64MiB", "5s"); strings are taken as they are, and lists
// (repositories, startup_models) are comma-separated.
func (s *Server) Set(key, value string) error {
	return s.set(key, value, "override")
}

func (s *Server) set(key, value, origin string) error {
	if !slices.Contains(serverKeys(), key) {
		return fmt.Errorf("%w %q", ErrUnknownKey, key)
	}
	f := reflect.ValueOf(s).Elem()
	for name := range strings.SplitSeq(key, ".") {
		sf, _ := fieldByTag(f.Type(), name)
		f = f.FieldByIndex(sf.Index)
	}
	v, err := parseValue(key, value, f.Type())
	if err != nil {
		return err
	}
	f.Set(v)
	if s.origin == nil {
		s.origin = map[string]string{}
	}
	s.origin[key] = origin
	return nil
}

var stringsType = reflect.TypeFor[[]string]()

// parseValue reads value as a t, the way the YAML decoder would.
func parseValue(key, value string, t reflect.Type) (reflect.Value, error) {
	bad := func(format string, args ...any) (reflect.Value, error) {
		return reflect.Value{}, &FieldError{Path: key, Msg: fmt.Sprintf(format, args...)}
	}
	switch {
	case t.Kind() == reflect.String:
		return reflect.ValueOf(value).Convert(t), nil
	case t == stringsType:
		list := []string{}
		for item := range strings.SplitSeq(value, ",") {
			if item = strings.TrimSpace(item); item != "" {
				list = append(list, item)
			}
		}
		return reflect.ValueOf(list), nil
	}
	var doc yaml.Node
	if err := yaml.Unmarshal([]byte(value), &doc); err != nil {
		return bad("invalid value %q", value)
	}
	if len(doc.Content) != 1 || doc.Content[0].Kind != yaml.ScalarNode || doc.Content[0].ShortTag() == "!!null" {
		return bad("want a single value, got %q", value)
	}
	n := doc.Content[0]
	out := reflect.New(t)
	if err := n.Decode(out.Interface()); err != nil {
		var te *yaml.TypeError
		if errors.As(err, &te) && len(te.Errors) > 0 {
			return bad("%s", translate(te.Errors[0], newIndex(&doc)).Msg)
		}
		return bad("invalid value %q: %v", value, err)
	}
	var ints problems
	checkIntegers(n, t, key, &ints)
	if len(ints) > 0 {
		return bad("%s", ints[0].Msg)
	}
	return out.Elem(), nil
}

// ApplyEnv applies every environment variable (in os.Environ form) named
// EnvVar(key) for a key in Keys, plus the alias SLOSERVE_ONNXRUNTIME_LIBRARY
// for runtime.onnxruntime_library (the canonical name wins when both are
// set). Other variables are ignored. Call Validate afterwards.
func (s *Server) ApplyEnv(environ []string) error {
	byName := map[string]string{}
	for _, key := range serverKeys() {
		byName[EnvVar(key)] = key
	}
	type setting struct{ name, key, value string }
	var aliased, direct []setting
	for _, kv := range environ {
		name, value, ok := strings.Cut(kv, "=")
		if !ok || !strings.HasPrefix(name, EnvPrefix) {
			continue
		}
		if key, ok := byName[name]; ok {
			direct = append(direct, setting{name, key, value})
		} else if key, ok := envAliases[name]; ok {
			aliased = append(aliased, setting{name, key, value})
		}
	}
	var errs []error
	for _, e := range append(aliased, direct...) {
		if err := s.set(e.key, e.value, e.name); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", e.name, err))
		}
	}
	return errors.Join(errs...)
}
