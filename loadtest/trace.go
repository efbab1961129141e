package loadtest

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
)

var (
	// errBadTrace is wrapped by every error ParseTrace returns for a file
	// it cannot read as a trace.
	errBadTrace = errors.New("invalid trace")
	// errBadTraceOptions is wrapped by every error TraceOptions.Validate
	// returns.
	errBadTraceOptions = errors.New("invalid trace options")
)

// traceStream is the PCG stream of Trace.Arrivals (see arrivalStream).
const traceStream = 0x74726163_65706c61 // "traceplay"

// Trace is a recorded sequence of arrivals.
type Trace struct {
	// Offsets are the arrivals' times from the first arrival, ascending; the
	// first is 0. ParseTrace sorts them if the file is not in order, and
	// counts how often it was not in Reordered.
	Offsets []time.Duration
	// Span is the trace's length: the last offset.
	Span time.Duration
	// Reordered is how many rows of the file came earlier than the row
	// before them. Logs merged from several writers are often slightly out
	// of order; a large count suggests the wrong column.
	Reordered int
}

// The timestamp formats a trace may use; the first row decides, and every
// row must use the same one.
type traceTimeFormat int

const (
	traceSeconds  traceTimeFormat = iota + 1 // decimal seconds: 12.345
	traceDateTime                            // 2006-01-02 15:04:05.9999999, UTC
	traceRFC3339                             // 2006-01-02T15:04:05.999999999Z07:00
)

func (f traceTimeFormat) String() string {
	switch f {
	case traceSeconds:
		return "decimal seconds"
	case traceDateTime:
		return `"2006-01-02 15:04:05.999"`
	case traceRFC3339:
		return "RFC 3339"
	}
	return "unknown"
}

// traceDateTimeLayout parses "2006-01-02 15:04:05" with or without a
// fraction of a second: time.Parse accepts a fraction after the seconds
// even when the layout has none.
const traceDateTimeLayout = "2006-01-02 15:04:05"

// ParseTrace reads a CSV trace with a header row and one arrival per row.
//
// column is the header of the timestamp column, matched case-insensitively;
// "" picks the first column whose header contains "time" in any case, or
// else the first column. A timestamp is "2006-01-02 15:04:05" with an
// optional fraction of up to 9 digits (read as UTC), RFC 3339 with an
// optional fraction, or decimal seconds ("12.345", Unix or relative); the
// first row decides which, and the others must match it. Blank lines are
// skipped. The offsets are sorted (see Trace.Reordered).
//
// A file without rows, with a header only, or with a header that is itself a
// timestamp (a file without a header) is an error; so is a row whose
// timestamp cannot be read, and the error names its line and value.
func ParseTrace(r io.Reader, column string) (*Trace, error) {
	cr := csv.NewReader(r)
	cr.FieldsPerRecord = -1 // rows may be ragged past the timestamp
	cr.TrimLeadingSpace = true
	cr.ReuseRecord = true

	header, err := cr.Read()
	if errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: the file is empty", errBadTrace)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errBadTrace, err)
	}
	header = slices.Clone(header)
	header[0] = strings.TrimPrefix(header[0], "\uFEFF") // a byte-order mark
	col, err := traceColumn(header, column)
	if err != nil {
		return nil, err
	}
	if _, ok := traceDetect(strings.TrimSpace(header[col])); ok {
		return nil, fmt.Errorf("%w: line 1: %q is a timestamp, not a header; the first row must name the columns",
			errBadTrace, header[col])
	}

	var (
		stamps []int64 // nanoseconds since the Unix epoch, or since 0 for relative seconds
		format traceTimeFormat
	)
	for {
		rec, err := cr.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %w", errBadTrace, err)
		}
		line, _ := cr.FieldPos(0)
		if col >= len(rec) {
			return nil, fmt.Errorf("%w: line %d: %d fields, no column %d (%q)", errBadTrace, line, len(rec), col+1, header[col])
		}
		line, _ = cr.FieldPos(col)
		v := strings.TrimSpace(rec[col])
		if format == 0 {
			f, ok := traceDetect(v)
			if !ok {
				return nil, fmt.Errorf("%w: line %d: timestamp %q is not decimal seconds, %s or RFC 3339",
					errBadTrace, line, v, traceDateTime)
			}
			format = f
		}
		ns, err := traceParseTime(v, format)
		if err != nil {
			return nil, fmt.Errorf("%w: line %d: timestamp %q: %v", errBadTrace, line, v, err)
		}
		stamps = append(stamps, ns)
	}
	if len(stamps) == 0 {
		return nil, fmt.Errorf("%w: a header and no arrivals", errBadTrace)
	}

	t := &Trace{}
	for i := 1; i < len(stamps); i++ {
		if stamps[i] < stamps[i-1] {
			t.Reordered++
		}
	}
	if t.Reordered > 0 {
		slices.Sort(stamps)
	}
	t.Offsets = make([]time.Duration, len(stamps))
	for i, ns := range stamps {
		t.Offsets[i] = time.Duration(ns - stamps[0])
	}
	t.Span = t.Offsets[len(t.Offsets)-1]
	return t, nil
}

// LoadTrace reads the trace in the file at path; see ParseTrace.
func LoadTrace(path, column string) (*Trace, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	t, err := ParseTrace(f, column)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return t, nil
}

// traceColumn is the index of the timestamp column.
func traceColumn(header []string, column string) (int, error) {
	if column != "" {
		for i, h := range header {
			if strings.EqualFold(strings.TrimSpace(h), strings.TrimSpace(column)) {
				return i, nil
			}
		}
		return 0, fmt.Errorf("%w: no column %q; the header has %q", errBadTrace, column, header)
	}
	for i, h := range header {
		if strings.Contains(strings.ToLower(h), "time") {
			return i, nil
		}
	}
	return 0, nil
}

// traceDetect says which format s is in.
func traceDetect(s string) (traceTimeFormat, bool) {
	for _, f := range []traceTimeFormat{traceSeconds, traceDateTime, traceRFC3339} {
		if _, err := traceParseTime(s, f); err == nil {
			return f, true
		}
	}
	return 0, false
}

// traceParseTime reads s in format f as nanoseconds since the Unix epoch
// (since 0 for relative seconds).
func traceParseTime(s string, f traceTimeFormat) (int64, error) {
	var (
		t   time.Time
		err error
	)
	switch f {
	case traceSeconds:
		return traceParseSeconds(s)
	case traceDateTime:
		t, err = time.Parse(traceDateTimeLayout, s)
	case traceRFC3339:
		t, err = time.Parse(time.RFC3339Nano, s)
	default:
		return 0, fmt.Errorf("unknown format %d", f)
	}
	if err != nil {
		return 0, fmt.Errorf("not in the file's format, %s", f)
	}
	return t.UnixNano(), nil
}

// traceParseSeconds reads decimal seconds, [+-]digits[.digits], exactly to
// the nanosecond (digits past the ninth are dropped), where float64 would
// lose a quarter of a microsecond on today's Unix times.
func traceParseSeconds(s string) (int64, error) {
	errNotSeconds := fmt.Errorf("not in the file's format, %s", traceSeconds)
	neg := false
	if s != "" && (s[0] == '-' || s[0] == '+') {
		neg = s[0] == '-'
		s = s[1:]
	}
	whole, frac, _ := strings.Cut(s, ".")
	if whole == "" && frac == "" {
		return 0, errNotSeconds
	}
	for _, part := range []string{whole, frac} {
		for _, c := range part {
			if c < '0' || c > '9' {
				return 0, errNotSeconds
			}
		}
	}
	var sec int64
	if whole != "" {
		var err error
		sec, err = strconv.ParseInt(whole, 10, 64)
		if err != nil || sec > math.MaxInt64/1_000_000_000-1 {
			return 0, fmt.Errorf("out of range")
		}
	}
	var ns int64
	for i := range 9 {
		ns *= 10
		if i < len(frac) {
			ns += int64(frac[i] - '0')
		}
	}
	v := sec*1e9 + ns
	if neg {
		v = -v
	}
	return v, nil
}

// TraceOptions say how to play a trace.
type TraceOptions struct {
	// TimeScale speeds the trace up: 10 plays it 10 times faster, every gap
	// divided by 10. 0 means 1.
	TimeScale float64
	// RateScale multiplies the number of arrivals. Below 1 each arrival is
	// kept with probability RateScale; above 1 each is sent
	// floor(RateScale) times and once more with probability equal to the
	// fraction (2.5: 2 or 3 times, each half the time). The first copy
	// keeps the arrival's time; the others fall uniformly at random between
	// it and the next arrival (after the last one, within a mean gap), so
	// copies do not land on one instant and the trace's bursts keep their
	// length. 0 means 1.
	RateScale float64
	// Start skips this much of the scaled trace: the arrival at Start is
	// sent at offset 0.
	Start time.Duration
	// Loop repeats the trace until the run ends; otherwise the arrivals end
	// with the trace. The trace repeats every Span plus one mean gap
	// (Span/(n-1) for n arrivals), so the seam is an ordinary gap. A trace
	// whose Span is 0 plays once.
	Loop bool
	// Modulate, if set, keeps each arrival at offset t with probability
	// Modulate.Rate(t)/Modulate.Peak(): a bursty trace shaped into a diurnal
	// day, say. It applies after the other options, at the arrivals' offsets
	// in the run.
	Modulate Schedule
}

// Validate reports negative or non-finite scales, a negative Start, and a
// Modulate schedule that is invalid or zero everywhere.
func (o TraceOptions) Validate() error {
	if !(o.TimeScale >= 0) || math.IsInf(o.TimeScale, 0) {
		return fmt.Errorf("%w: TimeScale %v must be finite and >= 0 (0 means 1)", errBadTraceOptions, o.TimeScale)
	}
	if !(o.RateScale >= 0) || math.IsInf(o.RateScale, 0) {
		return fmt.Errorf("%w: RateScale %v must be finite and >= 0 (0 means 1)", errBadTraceOptions, o.RateScale)
	}
	if o.Start < 0 {
		return fmt.Errorf("%w: Start %v is negative", errBadTraceOptions, o.Start)
	}
	if o.Modulate != nil {
		if v, ok := o.Modulate.(scheduleValidator); ok {
			if err := v.Validate(); err != nil {
				return fmt.Errorf("%w: Modulate: %w", errBadTraceOptions, err)
			}
		}
		if !(o.Modulate.Peak() > 0) {
			return fmt.Errorf("%w: Modulate %s has peak %v; it would drop every arrival", errBadTraceOptions, o.Modulate, o.Modulate.Peak())
		}
	}
	return nil
}

// Arrivals returns the trace's send offsets in [0, d), ascending, played
// under opts. The same seed gives the same offsets. It returns nil for an
// empty trace or d <= 0, and panics if opts is invalid (see
// TraceOptions.Validate).
func (t *Trace) Arrivals(opts TraceOptions, d time.Duration, seed uint64) []time.Duration {
	if err := opts.Validate(); err != nil {
		panic("loadtest.Trace.Arrivals: " + err.Error())
	}
	if t == nil || len(t.Offsets) == 0 || d <= 0 {
		return nil
	}
	timeScale, rateScale := opts.TimeScale, opts.RateScale
	if timeScale == 0 {
		timeScale = 1
	}
	if rateScale == 0 {
		rateScale = 1
	}

	offs := make([]time.Duration, len(t.Offsets))
	for i, o := range t.Offsets {
		offs[i] = time.Duration(math.Round(float64(o) / timeScale))
	}
	slices.Sort(offs) // a no-op for a parsed trace
	span := max(time.Duration(math.Round(float64(t.Span)/timeScale)), offs[len(offs)-1])
	var meanGap time.Duration
	if len(offs) > 1 {
		meanGap = span / time.Duration(len(offs)-1)
	}
	pl := tracePlayer{offs: offs, start: opts.Start}
	if opts.Loop && span > 0 {
		pl.period = span + meanGap
	}
	pl.seek()

	rng := rand.New(rand.NewPCG(seed, traceStream))
	var mod Schedule
	var peak float64
	if opts.Modulate != nil {
		mod, peak = schedulePrepared(opts.Modulate), opts.Modulate.Peak()
	}
	whole, frac := math.Modf(rateScale)
	copied := false
	var out []time.Duration

	cur, ok := pl.next()
	for ok && cur < d {
		nxt, more := pl.next()
		gap := meanGap
		if more {
			gap = nxt - cur
		}
		n := int(whole)
		if frac > 0 && rng.Float64() < frac {
			n++
		}
		copied = copied || n > 1
		for c := range n {
			at := cur
			if c > 0 && gap > 1 {
				at = cur + 1 + time.Duration(rng.Int64N(int64(gap-1))) // in (cur, cur+gap)
			}
			if at >= d {
				continue
			}
			if mod != nil && rng.Float64()*peak >= mod.Rate(at) {
				continue
			}
			out = append(out, at)
		}
		cur, ok = nxt, more
	}
	if copied {
		slices.Sort(out)
	}
	return out
}

// tracePlayer yields a trace's offsets in run time: shifted back by start
// and, when period > 0, repeated every period.
type tracePlayer struct {
	offs   []time.Duration // ascending
	period time.Duration   // 0: play once
	start  time.Duration
	loop   int64 // the repetition being played
	i      int   // the next offset within it
}

// seek moves to the first offset at or after start.
func (p *tracePlayer) seek() {
	rest := p.start
	if p.period > 0 {
		p.loop = int64(p.start / p.period)
		rest = p.start - time.Duration(p.loop)*p.period
	}
	p.i = sort.Search(len(p.offs), func(i int) bool { return p.offs[i] >= rest })
}

// next is the following offset in run time; false when the trace has ended.
func (p *tracePlayer) next() (time.Duration, bool) {
	if p.i == len(p.offs) {
		if p.period <= 0 {
			return 0, false
		}
		p.loop++
		p.i = 0
	}
	t := time.Duration(p.loop)*p.period + p.offs[p.i] - p.start
	p.i++
	return t, true
}
