package configs

import (
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

func TestParseByteSize(t *testing.T) {
	tests := []struct {
		in      string
		want    ByteSize
		wantErr string
	}{
		{in: "0", want: 0},
		{in: "1024", want: 1024},
		{in: "1B", want: 1},
		{in: "512MiB", want: 512 << 20},
		{in: "512 MiB", want: 512 << 20},
		{in: " 2GiB ", want: 2 << 30},
		{in: "1gib", want: 1 << 30},
		{in: "1Gi", want: 1 << 30},
		{in: "64KiB", want: 64 << 10},
		{in: "3TiB", want: 3 << 40},
		{in: "1PiB", want: 1 << 50},
		{in: "64MB", want: 64e6},
		{in: "64mb", want: 64e6},
		{in: "1kB", want: 1000},
		{in: "1KB", want: 1000},
		{in: "2G", want: 2e9},
		{in: "1.5GiB", want: 3 << 29},
		{in: ".5KiB", want: 512},
		{in: "1.5KB", want: 1500},
		{in: "8388607TiB", want: 8388607 << 40},
		{in: "", wantErr: "empty"},
		{in: "  ", wantErr: "empty"},
		{in: "-1", wantErr: "must not be negative"},
		{in: "-1MiB", wantErr: "must not be negative"},
		{in: "1.5", wantErr: "not a whole number of bytes"},
		{in: "1.1KiB", wantErr: "not a whole number of bytes"},
		{in: "12XB", wantErr: `unknown unit "XB"`},
		{in: "5 gigs", wantErr: `unknown unit "gigs"`},
		{in: "MiB", wantErr: "not a number"},
		{in: "1e3", wantErr: "not a number"},
		{in: "1,024", wantErr: "not a number"},
		{in: "0x400", wantErr: "not a number"},
		{in: "1.", wantErr: "not a number"},
		{in: "8388608TiB", wantErr: "too large"},
		{in: "99999999999999999999", wantErr: "too large"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParseByteSize(tt.in)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("ParseByteSize(%q) = %d, %v; want error %q", tt.in, got, err, tt.wantErr)
				}
				if !strings.Contains(err.Error(), `invalid byte size "`+tt.in+`"`) {
					t.Errorf("error %q does not quote the input", err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("ParseByteSize(%q) = %d, %v; want %d", tt.in, got, err, tt.want)
			}
		})
	}
}

func TestByteSizeYAML(t *testing.T) {
	tests := []struct {
		in      string
		want    ByteSize
		wantErr string
	}{
		{in: "1024", want: 1024},
		{in: "0x400", want: 1024},
		{in: `"1024"`, want: 1024},
		{in: "64MiB", want: 64 << 20},
		{in: "1.5GiB", want: 3 << 29},
		{in: "2.0", want: 2},
		{in: "1e3", want: 1000},
		{in: "-1.0", wantErr: "must not be negative"},
		{in: ".inf", wantErr: "not a byte size"},
		{in: "1e30", wantErr: "too large"},
		{in: "-5", wantErr: "must not be negative"},
		{in: "2.5", wantErr: "not a whole number"},
		{in: "true", wantErr: "not a byte size"},
		{in: "99999999999999999999", wantErr: "too large"},
		{in: "[1]", wantErr: "cannot unmarshal !!seq into configs.ByteSize"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			var got struct {
				B ByteSize `yaml:"b"`
			}
			err := yaml.Unmarshal([]byte("b: "+tt.in), &got)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("got %d, %v; want error %q", got.B, err, tt.wantErr)
				}
				return
			}
			if err != nil || got.B != tt.want {
				t.Fatalf("got %d, %v; want %d", got.B, err, tt.want)
			}
		})
	}
}

func TestByteSizeString(t *testing.T) {
	for b, want := range map[ByteSize]string{
		0: "0", 1: "1", 1000: "1000", 1024: "1KiB", 1536: "1536", 64 * MiB: "64MiB",
		3 * GiB: "3GiB", 2 * TiB: "2TiB", PiB: "1PiB", 1025 * MiB: "1025MiB", -1024: "-1024",
	} {
		if got := b.String(); got != want {
			t.Errorf("ByteSize(%d).String() = %q, want %q", int64(b), got, want)
		}
		if b < 0 {
			continue
		}
		if back, err := ParseByteSize(want); err != nil || back != b {
			t.Errorf("ParseByteSize(%q) = %d, %v; want %d", want, back, err, b)
		}
	}
}

func FuzzParseByteSize(f *testing.F) {
	for _, s := range []string{"0", "1024", "512MiB", "1.5GiB", "64MB", "-1", "1e3", ".5k"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		b, err := ParseByteSize(s)
		if err != nil {
			return
		}
		if b < 0 {
			t.Fatalf("ParseByteSize(%q) = %d < 0", s, b)
		}
		if back, err := ParseByteSize(b.String()); err != nil || back != b {
			t.Fatalf("ParseByteSize(%q) = %d; its String %q reads back as %d, %v", s, b, b.String(), back, err)
		}
	})
}
