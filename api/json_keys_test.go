package api

import (
	"strings"
	"testing"
)

func TestDuplicateJSONKey(t *testing.T) {
	for _, c := range []struct {
		name, json, want string
	}{
		{"none", `{"a":1,"b":{"a":2},"c":[{"a":3},{"a":4}]}`, ""},
		{"value equal to a key", `{"a":"a","b":["a","a"],"c":{"a":"b"}}`, ""},
		{"strings with syntax", `{"a":"{\"a\":1,","b":"}],[{","c":"\\"}`, ""},
		{"commas in arrays of strings", `{"a":["x","a","b"],"b":1}`, ""},
		{"empty objects", `{"a":{},"b":[{},{}],"c":{}}`, ""},
		{"top level", `{"a":1,"b":2,"a":3}`, "a"},
		{"nested", `{"a":{"x":1,"y":{"z":1},"x":2}}`, "x"},
		{"in an array", `{"a":[{"x":1},{"x":1,"x":2}]}`, "x"},
		{"after a nested object", `{"x":{"y":1},"x":2}`, "x"},
		{"case", `{"Id":1,"iD":2}`, "iD"},
		{"escaped", `{"a\u0062":1,"ab":2}`, "ab"},
		{"empty key", `{"":1,"":2}`, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			key, found := duplicateJSONKey([]byte(c.json))
			wantFound := c.want != "" || c.name == "empty key"
			if found != wantFound || key != c.want {
				t.Errorf("duplicateJSONKey(%s) = %q, %v; want %q, %v", c.json, key, found, c.want, wantFound)
			}
		})
	}
	// Many keys in one object stay linear.
	var b strings.Builder
	b.WriteString(`{"p":{`)
	for i := range 200000 {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(`"k`)
		b.WriteString(strings.Repeat("x", i%7))
		b.WriteString(string(rune('a' + i%26)))
		b.WriteString(`":1`)
	}
	b.WriteString(`}}`)
	if _, found := duplicateJSONKey([]byte(b.String())); !found {
		t.Error("no duplicate found among 200000 keys of 182 distinct names")
	}
}

// BenchmarkDuplicateJSONKey: the check's cost on a JSON request of 1024
// rows of 8 FP32 values, next to BenchmarkDecodeRESTInfer/json/rows=1024.
func BenchmarkDuplicateJSONKey(b *testing.B) {
	vals := make([]string, 1024*8)
	for i := range vals {
		vals[i] = "0.123456"
	}
	body := []byte(`{"id":"r","inputs":[{"name":"x","datatype":"FP32","shape":[1024,8],"data":[` +
		strings.Join(vals, ",") + `]}],"outputs":[{"name":"y"}]}`)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, found := duplicateJSONKey(body); found {
			b.Fatal("duplicate found")
		}
	}
}
