package configs

import (
	"errors"
	"strings"
	"testing"
)

// A syntax error names the line the problem is on, where yaml.v3 alone
// names the line before the construct around it for its parser's errors.
func TestSyntaxErrorLine(t *testing.T) {
	tests := []struct {
		name string
		doc  string
		line int
	}{
		{"unclosed flow sequence", "max_batch_size: 4\ninstances: 1\nexecution: [1, 2\nslo: {latency_ms: 100}\n", 3},
		{"key among list items", "inputs:\n  - name: x\n    datatype: FP32\n  shape: [1]\n", 4},
		{"unclosed flow mapping", "max_batch_size: 4\n\nslo: {latency_ms: 100\nresources: {}\n", 3},
		{"mapping in a scalar", "max_batch_size: 4\ninstances: 1\n  execution: 2\n", 3},
		{"tab indentation", "max_batch_size: 4\nslo:\n\tlatency_ms: 100\n", 3},
		{"unterminated quote", "max_batch_size: 4\nslo:\n  latency_ms: 100\n  class: \"latency-critical\nresources: {}\n", 4},
		{"bad line after a quoted string over two lines", "description: 'one\n  two'\nmax_batch_size: 4\n  x: 1\n", 4},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseModel("config.yaml", []byte(tc.doc))
			var fe *FieldError
			if !errors.As(err, &fe) || !strings.Contains(fe.Msg, "invalid YAML") {
				t.Fatalf("error %v, want a syntax error", err)
			}
			if fe.Line != tc.line {
				t.Errorf("line %d (%s), want %d", fe.Line, fe.Msg, tc.line)
			}
		})
	}
}
