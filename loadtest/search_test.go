package loadtest

import (
	"errors"
	"testing"
)

// The search against a server whose capacity is known: probes pass up to
// it and fail above it.
func TestSearchScale(t *testing.T) {
	cases := []struct {
		name     string
		capacity float64
		so       SearchOptions
		want     float64 // 0: nothing passes
		maxTries int
	}{
		{"doubling then bisecting", 13.3, SearchOptions{Start: 1, Max: 1024, Precision: 0.05}, 13.3, 12},
		{"start fails: halving", 0.3, SearchOptions{Start: 1, Max: 1024, Precision: 0.05}, 0.3, 12},
		{"capacity above max", 5000, SearchOptions{Start: 1, Max: 64, Precision: 0.05}, 64, 8},
		{"nothing passes", 0.0001, SearchOptions{Start: 1, Max: 64, Precision: 0.05}, 0, 12},
		{"exact power of two", 8, SearchOptions{Start: 1, Max: 1024, Precision: 0.01}, 8, 14},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tries := 0
			got, err := searchScale(c.so, func(s float64) (bool, error) {
				tries++
				return s <= c.capacity, nil
			})
			if err != nil {
				t.Fatal(err)
			}
			switch {
			case c.want == 0 && got != 0:
				t.Errorf("scale %v, want 0", got)
			case c.want != 0 && (got > c.want || got < c.want/(1+c.so.Precision)):
				t.Errorf("scale %v, want within %.0f%% below %v", got, 100*c.so.Precision, c.want)
			}
			if tries > c.maxTries {
				t.Errorf("%d probes, want at most %d", tries, c.maxTries)
			}
		})
	}
	t.Run("probe error", func(t *testing.T) {
		boom := errors.New("server gone")
		n := 0
		got, err := searchScale(SearchOptions{Start: 1, Max: 64, Precision: 0.05}, func(s float64) (bool, error) {
			if n++; n == 3 {
				return false, boom
			}
			return true, nil
		})
		if !errors.Is(err, boom) || got != 2 {
			t.Errorf("got %v, %v; want the last passing scale 2 and the error", got, err)
		}
	})
}
