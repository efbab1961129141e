package configs

import (
	"reflect"
	"strings"
)

// Changed lists the keys (as Keys names them, in file order) whose values
// differ between s and other: what a config reload would change.
func (s *Server) Changed(other *Server) []string {
	a, b := reflect.ValueOf(s).Elem(), reflect.ValueOf(other).Elem()
	var out []string
	for _, key := range serverKeys() {
		if !sameValue(valueAt(a, key), valueAt(b, key)) {
			out = append(out, key)
		}
	}
	return out
}

// valueAt is the field of a Server value at a dotted key.
func valueAt(v reflect.Value, key string) reflect.Value {
	for name := range strings.SplitSeq(key, ".") {
		f, _ := fieldByTag(v.Type(), name)
		v = v.FieldByIndex(f.Index)
	}
	return v
}

// sameValue compares two settings; an empty list equals a missing one.
func sameValue(a, b reflect.Value) bool {
	if a.Kind() == reflect.Slice && a.Len() == 0 && b.Len() == 0 {
		return true
	}
	return reflect.DeepEqual(a.Interface(), b.Interface())
}
