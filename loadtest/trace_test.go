package loadtest

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// traceRealFile is the production trace the project ships (see
// scenarios/traces/README.md for its source and licence), relative to the
// package as go test runs it.
const traceRealFile = "scenarios/traces/azure-llm-2023-code.csv"

func TestParseTrace(t *testing.T) {
	ms := time.Millisecond
	tests := []struct {
		name      string
		in        string
		column    string
		want      []time.Duration
		reordered int
	}{
		{
			name: "date and time, fractions of any length",
			in:   "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04,1,2\n2023-11-16 18:17:04.5,3,4\n2023-11-16 18:17:05.123456789,5,6\n",
			want: []time.Duration{0, 20040 * time.Microsecond, 520040 * time.Microsecond, 1143496789},
		},
		{
			name: "date and time across midnight, CRLF",
			in:   "TIMESTAMP\r\n2023-12-31 23:59:59.5\r\n2024-01-01 00:00:00.25\r\n",
			want: []time.Duration{0, 750 * ms},
		},
		{
			name: "RFC 3339",
			in:   "time\n2024-03-01T10:00:00Z\n2024-03-01T10:00:01.25Z\n2024-03-01T12:00:02+02:00\n",
			want: []time.Duration{0, 1250 * ms, 2 * time.Second},
		},
		{
			name: "relative seconds",
			in:   "t\n0\n0.5\n.75\n2.000000001\n3.\n",
			want: []time.Duration{0, 500 * ms, 750 * ms, 2*time.Second + 1, 3 * time.Second},
		},
		{
			name: "Unix seconds, exact to the nanosecond",
			in:   "unix_time\n1700000000.123456789\n1700000001.1\n1700000001.1000000019\n",
			want: []time.Duration{0, 976543211, 976543212},
		},
		{
			name: "negative relative seconds",
			in:   "t\n-1.5\n-0.5\n+1\n",
			want: []time.Duration{0, time.Second, 2500 * ms},
		},
		{
			name:   "column by name, any case",
			in:     "id,Arrival,TIMESTAMP\n7,100,2.5\n8,50,3\n",
			column: "timestamp",
			want:   []time.Duration{0, 500 * ms},
		},
		{
			name:   "column by name, not the one with time",
			in:     "time_ms,sent\n9,20\n1,21.5\n",
			column: "Sent",
			want:   []time.Duration{0, 1500 * ms},
		},
		{
			name: "default: the first column with time in its header",
			in:   "id,size,Created_Time,x\n1,9,10,a\n2,9,11.5,b\n",
			want: []time.Duration{0, 1500 * ms},
		},
		{
			name: "default: the first column when none says time",
			in:   "at,size\n4,100\n5,200\n",
			want: []time.Duration{0, time.Second},
		},
		{
			name: "blank lines, a byte-order mark, spaces and quotes",
			in:   "\uFEFFTIMESTAMP, n\n\n 1, 2\n\n\n\"2.5\", 3\n\n",
			want: []time.Duration{0, 1500 * ms},
		},
		{
			name: "ragged rows past the timestamp",
			in:   "time,a,b\n1\n2,x\n3,x,y,z\n",
			want: []time.Duration{0, time.Second, 2 * time.Second},
		},
		{
			name:      "out of order rows are sorted and counted",
			in:        "time\n3\n1\n2\n2\n5\n4\n",
			want:      []time.Duration{0, time.Second, time.Second, 2 * time.Second, 3 * time.Second, 4 * time.Second},
			reordered: 2,
		},
		{
			name: "one arrival",
			in:   "time\n42\n",
			want: []time.Duration{0},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr, err := ParseTrace(strings.NewReader(tt.in), tt.column)
			if err != nil {
				t.Fatalf("ParseTrace: %v", err)
			}
			if !slices.Equal(tr.Offsets, tt.want) {
				t.Errorf("Offsets = %v, want %v", tr.Offsets, tt.want)
			}
			if want := tt.want[len(tt.want)-1]; tr.Span != want {
				t.Errorf("Span = %v, want %v", tr.Span, want)
			}
			if tr.Reordered != tt.reordered {
				t.Errorf("Reordered = %d, want %d", tr.Reordered, tt.reordered)
			}
		})
	}
}

func TestParseTraceErrors(t *testing.T) {
	tests := []struct {
		name   string
		in     string
		column string
		want   []string // substrings of the error
	}{
		{"empty file", "", "", []string{"empty"}},
		{"only blank lines", "\n\n\n", "", []string{"empty"}},
		{"header only", "TIMESTAMP,ContextTokens\n", "", []string{"a header and no arrivals"}},
		{"header and blank lines", "time\n\n\n", "", []string{"a header and no arrivals"}},
		{"no header", "1.5\n2.5\n", "", []string{"line 1", `"1.5" is a timestamp, not a header`}},
		{"unknown column", "a,b\n1,2\n", "time", []string{`no column "time"`, `["a" "b"]`}},
		{"bad timestamp", "time\n1.5\n2.5\nsoon\n4\n", "", []string{"line 4", `"soon"`}},
		{"bad timestamp after blank lines", "x,time\n0,1\n\n\n0,2x\n", "", []string{"line 5", `"2x"`}},
		{"bad first timestamp", "time\nyesterday\n", "", []string{"line 2", `"yesterday"`, "not decimal seconds"}},
		{"formats mixed", "time\n1.5\n2023-11-16 18:17:03\n", "", []string{"line 3", `"2023-11-16 18:17:03"`, "decimal seconds"}},
		{"date with a bad day", "TIMESTAMP\n2023-11-16 18:17:03.1\n2023-11-31 18:17:04.2\n", "", []string{"line 3", `"2023-11-31 18:17:04.2"`}},
		{"empty timestamp", "a,time\n1,2\n3,\n", "", []string{"line 3", `""`}},
		{"row too short", "a,time\n1,2\n3\n", "", []string{"line 3", "no column 2"}},
		{"seconds out of range", "t\n99999999999999999999\n", "", []string{"line 2"}},
		{"broken quoting", "time\n\"1\n", "", []string{"line"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr, err := ParseTrace(strings.NewReader(tt.in), tt.column)
			if err == nil {
				t.Fatalf("ParseTrace = %v, want an error", tr.Offsets)
			}
			if !errors.Is(err, errBadTrace) {
				t.Errorf("error %v does not wrap errBadTrace", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestLoadTrace(t *testing.T) {
	path := filepath.Join(t.TempDir(), "trace.csv")
	if err := os.WriteFile(path, []byte("time\n1\n3\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tr, err := LoadTrace(path, "")
	if err != nil || !slices.Equal(tr.Offsets, []time.Duration{0, 2 * time.Second}) {
		t.Fatalf("LoadTrace = %v, %v", tr, err)
	}
	if err := os.WriteFile(path, []byte("time\nx\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadTrace(path, ""); err == nil || !strings.Contains(err.Error(), path+": ") || !errors.Is(err, errBadTrace) {
		t.Errorf("LoadTrace of a bad file: %v, want the path and errBadTrace", err)
	}
	if _, err := LoadTrace(filepath.Join(t.TempDir(), "missing.csv"), ""); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("LoadTrace of a missing file: %v, want os.ErrNotExist", err)
	}
}

// TestLoadTraceReal reads the Azure trace: its first and last timestamps
// are 2023-11-16 18:17:03.9799600 and 19:14:19.9280160.
func TestLoadTraceReal(t *testing.T) {
	tr, err := LoadTrace(traceRealFile, "")
	if err != nil {
		t.Fatal(err)
	}
	// The file has 8,819 rows after its header; the last has no newline.
	if len(tr.Offsets) != 8819 {
		t.Errorf("%d arrivals, want 8819", len(tr.Offsets))
	}
	if want := 57*time.Minute + 15*time.Second + 948056*time.Microsecond; tr.Span != want {
		t.Errorf("Span = %v, want %v", tr.Span, want)
	}
	if tr.Reordered != 0 || !slices.IsSorted(tr.Offsets) {
		t.Errorf("Reordered = %d; the file is in order", tr.Reordered)
	}
	if named, err := LoadTrace(traceRealFile, "timestamp"); err != nil || !slices.Equal(named.Offsets, tr.Offsets) {
		t.Errorf("by column name: %v", err)
	}

	// Played once at its own pace, the trace is its own offsets.
	if got := tr.Arrivals(TraceOptions{}, time.Hour, 1); !slices.Equal(got, tr.Offsets) {
		t.Errorf("played as is: %d arrivals, differ from the trace's %d", len(got), len(tr.Offsets))
	}
	// A diurnal day made from it: each arrival at t is kept with
	// probability p(t) = Rate(t)/Peak, so the count kept has mean Σp and
	// variance Σp(1-p) given the trace, whose bursts need not follow Mean.
	day := Diurnal{Period: 20 * time.Minute, Min: 1, Max: 10, PeakAt: 0.5}
	got := tr.Arrivals(TraceOptions{Modulate: day}, tr.Span+1, 1)
	var mean, variance float64
	for _, o := range tr.Offsets {
		p := day.Rate(o) / day.Peak()
		mean += p
		variance += p * (1 - p)
	}
	if dev := math.Abs(float64(len(got)) - mean); dev > 4.5*math.Sqrt(variance) {
		t.Errorf("modulated: kept %d of %d, want %.0f ± %.0f", len(got), len(tr.Offsets), mean, 4.5*math.Sqrt(variance))
	}
}

func TestTraceOptionsValidate(t *testing.T) {
	tests := []struct {
		name string
		o    TraceOptions
		want string // substring of the error; "" for valid
	}{
		{"zero", TraceOptions{}, ""},
		{"all set", TraceOptions{TimeScale: 10, RateScale: 2.5, Start: time.Minute, Loop: true, Modulate: Constant{RPS: 1}}, ""},
		{"negative time scale", TraceOptions{TimeScale: -2}, "TimeScale -2 must be finite and >= 0"},
		{"infinite time scale", TraceOptions{TimeScale: math.Inf(1)}, "TimeScale +Inf"},
		{"NaN rate scale", TraceOptions{RateScale: math.NaN()}, "RateScale NaN"},
		{"negative rate scale", TraceOptions{RateScale: -0.5}, "RateScale -0.5"},
		{"negative start", TraceOptions{Start: -time.Second}, "Start -1s is negative"},
		{"invalid modulate", TraceOptions{Modulate: Diurnal{Max: 3}}, "Modulate: invalid schedule: diurnal: Period 0s"},
		{"zero modulate", TraceOptions{Modulate: Constant{}}, "would drop every arrival"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.o.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil || !errors.Is(err, errBadTraceOptions) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate() = %v, want errBadTraceOptions containing %q", err, tt.want)
			}
		})
	}

	t.Run("Arrivals panics", func(t *testing.T) {
		defer func() {
			if recover() == nil {
				t.Error("Arrivals with invalid options did not panic")
			}
		}()
		tr := &Trace{Offsets: []time.Duration{0, time.Second}, Span: time.Second}
		tr.Arrivals(TraceOptions{RateScale: -1}, time.Minute, 1)
	})
}

// traceTestTrace is a synthetic trace: Poisson arrivals at rate over d,
// moved to start at 0.
func traceTestTrace(t *testing.T, rate float64, d time.Duration) *Trace {
	t.Helper()
	offs := Arrivals(Process{Kind: "poisson"}, Constant{RPS: rate}, d, 11)
	if len(offs) < 2 {
		t.Fatal("no trace")
	}
	first := offs[0]
	for i := range offs {
		offs[i] -= first
	}
	return &Trace{Offsets: offs, Span: offs[len(offs)-1]}
}

func TestTraceArrivals(t *testing.T) {
	tr := traceTestTrace(t, 100, time.Minute)
	n := len(tr.Offsets)
	long := 10 * time.Minute

	t.Run("as is", func(t *testing.T) {
		for _, o := range []TraceOptions{{}, {TimeScale: 1, RateScale: 1}} {
			if got := tr.Arrivals(o, long, 1); !slices.Equal(got, tr.Offsets) {
				t.Errorf("%+v: the arrivals differ from the trace", o)
			}
		}
		got := tr.Arrivals(TraceOptions{}, 30*time.Second, 1)
		if want := arrivalCount(tr.Offsets, 0, 30*time.Second); len(got) != want || got[len(got)-1] >= 30*time.Second {
			t.Errorf("cut at 30s: %d arrivals, want %d", len(got), want)
		}
	})

	t.Run("time scale", func(t *testing.T) {
		for _, scale := range []float64{2, 10, 0.5} {
			got := tr.Arrivals(TraceOptions{TimeScale: scale}, long, 1)
			if len(got) != n {
				t.Fatalf("x%v: %d arrivals, want %d", scale, len(got), n)
			}
			wantSpan := time.Duration(math.Round(float64(tr.Span) / scale))
			if last := got[len(got)-1]; last != wantSpan {
				t.Errorf("x%v: last arrival at %v, want %v", scale, last, wantSpan)
			}
			for i, o := range tr.Offsets {
				if want := time.Duration(math.Round(float64(o) / scale)); got[i] != want {
					t.Fatalf("x%v: arrival %d at %v, want %v", scale, i, got[i], want)
				}
			}
		}
	})

	t.Run("rate scale below 1", func(t *testing.T) {
		const p = 0.5
		got := tr.Arrivals(TraceOptions{RateScale: p}, long, 1)
		sd := math.Sqrt(float64(n) * p * (1 - p))
		if dev := math.Abs(float64(len(got)) - p*float64(n)); dev > 4*sd {
			t.Errorf("kept %d of %d, want %.0f ± %.0f", len(got), n, p*float64(n), 4*sd)
		}
		for _, o := range got {
			if _, found := slices.BinarySearch(tr.Offsets, o); !found {
				t.Fatalf("arrival at %v is not in the trace", o)
			}
		}
	})

	t.Run("rate scale above 1", func(t *testing.T) {
		const scale = 2.5
		got := tr.Arrivals(TraceOptions{RateScale: scale}, long, 1)
		arrivalCheckOrder(t, got, long)
		// 2 copies each, and a third for a Binomial(n, 0.5) of them.
		sd := math.Sqrt(float64(n) * 0.25)
		if dev := math.Abs(float64(len(got)) - scale*float64(n)); dev > 4*sd {
			t.Errorf("%d arrivals from %d, want %.0f ± %.0f", len(got), n, scale*float64(n), 4*sd)
		}
		// Every arrival of the trace is kept, with its copies after it and
		// before the next one.
		for i, o := range tr.Offsets {
			end := long
			if i+1 < n {
				end = tr.Offsets[i+1]
			}
			if c := arrivalCount(got, o, end); c != 2 && c != 3 {
				t.Fatalf("arrival %d at %v: %d copies before the next, want 2 or 3", i, o, c)
			}
			if _, found := slices.BinarySearch(got, o); !found {
				t.Fatalf("arrival %d at %v is missing", i, o)
			}
		}
		if len(slices.Compact(slices.Clone(got))) != len(got) {
			t.Error("copies landed on the same instant")
		}
		if slices.Equal(got, tr.Arrivals(TraceOptions{RateScale: scale}, long, 2)) {
			t.Error("different seeds gave the same copies")
		}
		if !slices.Equal(got, tr.Arrivals(TraceOptions{RateScale: scale}, long, 1)) {
			t.Error("the same seed gave different copies")
		}
	})

	t.Run("start", func(t *testing.T) {
		start := 20 * time.Second
		got := tr.Arrivals(TraceOptions{Start: start}, long, 1)
		i := arrivalCount(tr.Offsets, 0, start)
		if len(got) != n-i || got[0] != tr.Offsets[i]-start || got[len(got)-1] != tr.Span-start {
			t.Errorf("%d arrivals from %v, want %d from %v", len(got), got[0], n-i, tr.Offsets[i]-start)
		}
		if got := tr.Arrivals(TraceOptions{Start: tr.Span + 1}, long, 1); len(got) != 0 {
			t.Errorf("start past the end: %d arrivals", len(got))
		}
		// Start counts in the scaled trace.
		got = tr.Arrivals(TraceOptions{Start: start / 2, TimeScale: 2}, long, 1)
		if len(got) != n-i || (got[0]-(tr.Offsets[i]-start)/2).Abs() > 1 {
			t.Errorf("scaled: %d arrivals from %v, want %d from %v", len(got), got[0], n-i, (tr.Offsets[i]-start)/2)
		}
	})

	t.Run("loop", func(t *testing.T) {
		period := tr.Span + tr.Span/time.Duration(n-1)
		d := 3*period + period/2
		got := tr.Arrivals(TraceOptions{Loop: true}, d, 1)
		arrivalCheckOrder(t, got, d)
		if want := 3*n + arrivalCount(tr.Offsets, 0, period/2); len(got) != want {
			t.Fatalf("%d arrivals, want %d", len(got), want)
		}
		for k := range 4 {
			if o := got[k*n]; o != time.Duration(k)*period {
				t.Errorf("repetition %d starts at %v, want %v", k, o, time.Duration(k)*period)
			}
		}
		if last := got[len(got)-1]; d-last > time.Second {
			t.Errorf("last arrival at %v, the run ends at %v", last, d)
		}
		// Without Loop the trace ends with itself.
		if got := tr.Arrivals(TraceOptions{}, d, 1); len(got) != n {
			t.Errorf("without Loop: %d arrivals, want %d", len(got), n)
		}
		// Loop from a start in the third repetition.
		start := 2*period + 10*time.Second
		got = tr.Arrivals(TraceOptions{Loop: true, Start: start}, period, 1)
		i := arrivalCount(tr.Offsets, 0, 10*time.Second)
		if len(got) != n || got[0] != tr.Offsets[i]-10*time.Second || got[n-i] != tr.Offsets[0]+period-10*time.Second {
			t.Errorf("loop from %v: %d arrivals, first %v", start, len(got), got[0])
		}
		// A trace without length plays once.
		point := &Trace{Offsets: []time.Duration{0, 0}}
		if got := point.Arrivals(TraceOptions{Loop: true}, time.Minute, 1); len(got) != 2 {
			t.Errorf("a zero-span trace looped: %d arrivals, want 2", len(got))
		}
	})

	t.Run("empty", func(t *testing.T) {
		if got := (&Trace{}).Arrivals(TraceOptions{Loop: true}, time.Minute, 1); got != nil {
			t.Errorf("empty trace: %v", got)
		}
		if got := tr.Arrivals(TraceOptions{}, 0, 1); got != nil {
			t.Errorf("zero duration: %d arrivals", len(got))
		}
	})
}

// TestTraceModulate shapes a steady synthetic trace with a diurnal curve.
// Each arrival at t survives with probability p(t) = Rate(t)/Peak, so given
// the trace the count kept in any window has mean Σp and variance Σp(1-p).
// Each of 40 windows must be within 4.5 standard deviations, the windows
// together must pass a chi-square test, and the fraction kept overall must
// be Mean/Peak to within the spread of the trace and the thinning.
func TestTraceModulate(t *testing.T) {
	tr := traceTestTrace(t, 400, 100*time.Second)
	n := float64(len(tr.Offsets))
	d := tr.Span + 1
	for _, day := range []Schedule{
		Diurnal{Period: 50 * time.Second, Min: 0, Max: 10, PeakAt: 0.2},
		Diurnal{Period: 100 * time.Second, Min: 1, Max: 4, PeakAt: 0.7, Hourly: scheduleTestHourly},
		Steps{{0, 2}, {30 * time.Second, 8}, {60 * time.Second, 0}, {75 * time.Second, 4}},
	} {
		t.Run(day.String(), func(t *testing.T) {
			got := tr.Arrivals(TraceOptions{Modulate: day}, d, 5)
			arrivalCheckOrder(t, got, d)
			frac := Mean(day, d) / day.Peak()
			if tol := 4 * math.Sqrt(0.5/n); math.Abs(float64(len(got))/n-frac) > tol {
				t.Errorf("kept %.4f of the arrivals, want Mean/Peak %.4f ± %.4f", float64(len(got))/n, frac, tol)
			}
			const windows = 40
			w := d / windows
			var chi2 float64
			used := 0 // windows where thinning is random
			for k := range windows {
				a, b := time.Duration(k)*w, time.Duration(k+1)*w
				if k == windows-1 {
					b = d
				}
				var mean, variance float64
				lo, hi := arrivalCount(tr.Offsets, 0, a), arrivalCount(tr.Offsets, 0, b)
				for _, o := range tr.Offsets[lo:hi] {
					p := day.Rate(o) / day.Peak()
					mean += p
					variance += p * (1 - p)
				}
				kept := float64(arrivalCount(got, a, b))
				if variance == 0 {
					if kept != mean {
						t.Errorf("[%v, %v): kept %v, want exactly %v", a, b, kept, mean)
					}
					continue
				}
				z := (kept - mean) / math.Sqrt(variance)
				if math.Abs(z) > 4.5 {
					t.Errorf("[%v, %v): kept %v, want %.1f ± %.1f", a, b, kept, mean, 4.5*math.Sqrt(variance))
				}
				chi2 += z * z
				used++
			}
			if u := float64(used); math.Abs(chi2-u) > 5*math.Sqrt(2*u) {
				t.Errorf("chi-square %.1f over %d windows, want %d ± %.1f", chi2, used, used, 5*math.Sqrt(2*u))
			}
		})
	}
}
