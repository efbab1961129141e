package api

import (
	"bytes"
	"encoding/json"
)

// duplicateJSONKey returns a key that appears twice in one object of the
// JSON text b, which encoding/json has already accepted (it would keep the
// last value silently). Keys are compared after their escapes are decoded
// and without regard to case, as encoding/json matches them to struct
// fields: {"id":"a","ID":"b"} sets one field twice. The walk is one pass
// over the bytes; it keeps the keys of the open objects only.
func duplicateJSONKey(b []byte) (key string, found bool) {
	// The keys of the open objects, innermost last; each frame is an open
	// object or array. Requests have a few small objects, so the keys are
	// compared in place, without allocating; an object with many keys
	// gets a set, so a hostile one stays linear.
	type frame struct {
		obj   bool
		start int                 // its first key in keys
		set   map[string]struct{} // lower-cased keys, once it has many
	}
	const maxScan = 32
	var (
		stackBuf [8]frame
		keysBuf  [32][]byte
	)
	stack, keys := stackBuf[:0], keysBuf[:0]
	expectKey := false
	for i := 0; i < len(b); {
		switch b[i] {
		case '{', '[':
			stack = append(stack, frame{obj: b[i] == '{', start: len(keys)})
			expectKey = b[i] == '{'
			i++
		case '}', ']':
			if n := len(stack); n > 0 {
				keys = keys[:stack[n-1].start]
				stack = stack[:n-1]
			}
			expectKey = false
			i++
		case ',':
			expectKey = len(stack) > 0 && stack[len(stack)-1].obj
			i++
		case '"':
			end := jsonStringEnd(b, i)
			if expectKey && len(stack) > 0 {
				f := &stack[len(stack)-1]
				k := jsonKey(b[i:end])
				if f.set == nil {
					for _, prev := range keys[f.start:] {
						if bytes.EqualFold(prev, k) {
							return string(k), true
						}
					}
					keys = append(keys, k)
					if len(keys)-f.start > maxScan {
						f.set = make(map[string]struct{}, 2*maxScan)
						for _, prev := range keys[f.start:] {
							f.set[string(bytes.ToLower(prev))] = struct{}{}
						}
					}
				} else {
					fold := string(bytes.ToLower(k))
					if _, dup := f.set[fold]; dup {
						return string(k), true
					}
					f.set[fold] = struct{}{}
				}
				expectKey = false
			}
			i = end
		default:
			// Numbers, literals and white space, the bulk of a data array,
			// where commas do not matter either.
			stop := &jsonStructural
			if n := len(stack); n > 0 && !stack[n-1].obj {
				stop = &jsonStructuralInArray
			}
			for i++; i < len(b) && !stop[b[i]]; i++ {
			}
		}
	}
	return "", false
}

// jsonStructural marks the bytes duplicateJSONKey stops at.
var (
	jsonStructural        = [256]bool{'{': true, '}': true, '[': true, ']': true, ',': true, '"': true}
	jsonStructuralInArray = [256]bool{'{': true, '}': true, '[': true, ']': true, '"': true}
)

// jsonStringEnd returns the index just past the string that starts with
// the quote at b[start].
func jsonStringEnd(b []byte, start int) int {
	i := start + 1
	for i < len(b) {
		switch b[i] {
		case '\\':
			i += 2
		case '"':
			return i + 1
		default:
			i++
		}
	}
	return len(b)
}

// jsonKey decodes a quoted key; without escapes it is a slice of quoted.
func jsonKey(quoted []byte) []byte {
	if bytes.IndexByte(quoted, '\\') < 0 && len(quoted) >= 2 {
		return quoted[1 : len(quoted)-1]
	}
	var s string
	if json.Unmarshal(quoted, &s) != nil {
		return quoted
	}
	return []byte(s)
}
