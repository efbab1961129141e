package configs

import (
	"reflect"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

// profile.shapes takes one set of shapes (a mapping) or a list of them;
// both read to the same type, and each set is validated, named by its
// index when there are several.
func TestProfileShapesForms(t *testing.T) {
	head := "name: m\nmax_batch_size: 4\ninputs:\n  - {name: x, datatype: FP32, shape: [-1, 3, -1, -1]}\n"
	one, err := ParseModel("m.yaml", []byte(head+"profile:\n  shapes: {x: [1, 3, 256, 256]}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if want := (ProfileShapes{{"x": {1, 3, 256, 256}}}); !reflect.DeepEqual(one.Profile.Shapes, want) {
		t.Errorf("one set: %v, want %v", one.Profile.Shapes, want)
	}
	many, err := ParseModel("m.yaml", []byte(head+"profile:\n  shapes:\n    - {x: [1, 3, 256, 256]}\n    - {x: [1, 3, 640, 640]}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if want := (ProfileShapes{{"x": {1, 3, 256, 256}}, {"x": {1, 3, 640, 640}}}); !reflect.DeepEqual(many.Profile.Shapes, want) {
		t.Errorf("a list: %v, want %v", many.Profile.Shapes, want)
	}
	// Written back: one set as a mapping, several as a list.
	for _, m := range []*Model{one, many} {
		out, err := yaml.Marshal(m.Profile)
		if err != nil {
			t.Fatal(err)
		}
		var back ModelProfile
		if err := yaml.Unmarshal(out, &back); err != nil || !reflect.DeepEqual(back.Shapes, m.Profile.Shapes) {
			t.Errorf("round trip of %v: %s -> %v, %v", m.Profile.Shapes, out, back.Shapes, err)
		}
	}
	for body, want := range map[string]string{
		"    - {x: [1, 3, 256, 256]}\n    - {x: [1, 3, 0, 640]}\n": "profile.shapes[1].x: dimensions must be between 1 and 1048576, got [1 3 0 640]",
		"    - {x: [1, 3, 256, 256]}\n    - {y: [1, 3, 64, 64]}\n": `profile.shapes[1].y: no input named "y"`,
		"    - {x: [1, 3, 256, 256]}\n    - {}\n":                  "profile.shapes[1]: must name at least one input",
		"    just a string\n":                                      "profile.shapes must be a mapping of input names to shapes, or a list of them",
		"    - {x: [1, 3, 2.5, 64]}\n":                             `profile.shapes: dimensions must be integers, got "2.5"`,
	} {
		_, err := ParseModel("m.yaml", []byte(head+"profile:\n  shapes:\n"+body))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("shapes\n%s: error %v, want it to contain %q", body, err, want)
		}
	}
}
