package api

// The REST request's structure in one pass, without encoding/json.
//
// encoding/json checked the syntax of a whole request with a state machine
// that calls a function per byte, and then copied each data array into a
// json.RawMessage; for 2,400 FP32 values that was over half of the decode
// (profiled). parseRESTFast reads the shape nearly every client sends, in
// one pass that checks the JSON grammar itself and leaves each data array
// where it is in the body, into the same restRequestJSON encoding/json
// fills. It gives up on anything else, and decodeRESTInferMem then decodes
// with encoding/json as before, so the answers to unusual and broken
// requests (their errors and messages) do not change. It gives up on:
//   - a key it does not know, or one spelled in other case (encoding/json
//     matches those without regard to case), or a known key twice;
//   - an object anywhere inside a value (the duplicate key check would have
//     to look into it), and nesting deeper than maxFastDepth;
//   - a name, datatype or id string with an escape, a control character or
//     invalid UTF-8 (encoding/json decodes those; kept as they are here);
//   - a null, and a shape dimension that is not a plain integer of at most
//     18 digits;
//   - anything that is not valid JSON: then encoding/json says what is wrong.
//
// Values it keeps raw (data, parameters) are checked against the grammar
// but not decoded, as json.RawMessage keeps them: the same bytes.

import (
	"bytes"
	"encoding/json"
	"unicode/utf8"
)

// maxFastDepth is how deeply arrays may nest in a value parseRESTFast
// reads.
const maxFastDepth = 32

// maxFastParams is the most parameters of one object parseRESTFast reads;
// their duplicates are looked for pairwise.
const maxFastParams = 16

// fastJSON is a position in a JSON text being parsed.
type fastJSON struct {
	b []byte
	i int
}

// parseRESTFast parses body into rj when body is in the shape described
// above, and reports whether it did; rj's raw values share memory with body.
// When it reports false, rj is to be thrown away.
func parseRESTFast(body []byte, rj *restRequestJSON) bool {
	p := fastJSON{b: body}
	if !p.byte('{') {
		return false
	}
	var seenID, seenParams, seenInputs, seenOutputs bool
	if !p.members(func(key []byte) bool {
		switch string(key) {
		case "id":
			if seenID {
				return false
			}
			seenID = true
			s, ok := p.plainString()
			if !ok {
				return false
			}
			id := string(s)
			rj.ID = &id
		case "parameters":
			if seenParams {
				return false
			}
			seenParams = true
			var ok bool
			rj.Parameters, ok = p.params()
			return ok
		case "inputs":
			if seenInputs {
				return false
			}
			seenInputs = true
			rj.Inputs = []restInputJSON{}
			return p.array(func() bool {
				rj.Inputs = append(rj.Inputs, restInputJSON{})
				return p.input(&rj.Inputs[len(rj.Inputs)-1])
			})
		case "outputs":
			if seenOutputs {
				return false
			}
			seenOutputs = true
			rj.Outputs = []restOutputJSON{}
			return p.array(func() bool {
				rj.Outputs = append(rj.Outputs, restOutputJSON{})
				return p.output(&rj.Outputs[len(rj.Outputs)-1])
			})
		default:
			return false
		}
		return true
	}) {
		return false
	}
	p.space()
	return p.i == len(p.b)
}

// stringOnce reads a plain string into *dst; a second one (a key given
// twice) is left to encoding/json's path, which names it.
func (p *fastJSON) stringOnce(dst **string) bool {
	if *dst != nil {
		return false
	}
	s, ok := p.plainString()
	if !ok {
		return false
	}
	v := string(s)
	*dst = &v
	return true
}

// input parses one entry of "inputs".
func (p *fastJSON) input(ij *restInputJSON) bool {
	if !p.byte('{') {
		return false
	}
	var seenShape, seenParams, seenData bool
	return p.members(func(key []byte) bool {
		switch string(key) {
		case "name":
			return p.stringOnce(&ij.Name)
		case "datatype":
			return p.stringOnce(&ij.DataType)
		case "shape":
			if seenShape {
				return false
			}
			seenShape = true
			ij.Shape = []int64{}
			return p.array(func() bool {
				d, ok := p.integer()
				ij.Shape = append(ij.Shape, d)
				return ok
			})
		case "parameters":
			if seenParams {
				return false
			}
			seenParams = true
			var ok bool
			ij.Parameters, ok = p.params()
			return ok
		case "data":
			if seenData {
				return false
			}
			seenData = true
			v, ok := p.value(0)
			ij.Data = v
			return ok
		default:
			return false
		}
	})
}

// output parses one entry of "outputs".
func (p *fastJSON) output(oj *restOutputJSON) bool {
	if !p.byte('{') {
		return false
	}
	var seenParams bool
	return p.members(func(key []byte) bool {
		switch string(key) {
		case "name":
			return p.stringOnce(&oj.Name)
		case "parameters":
			if seenParams {
				return false
			}
			seenParams = true
			var ok bool
			oj.Parameters, ok = p.params()
			return ok
		default:
			return false
		}
	})
}

// params parses a parameters object into raw values. Keys must be plain
// strings, distinct without regard to case (as duplicateJSONKey requires).
func (p *fastJSON) params() (map[string]json.RawMessage, bool) {
	if !p.byte('{') {
		return nil, false
	}
	params := make(map[string]json.RawMessage, 2)
	var keysBuf [maxFastParams][]byte
	keys := keysBuf[:0]
	ok := p.members(func(key []byte) bool {
		if len(keys) == maxFastParams {
			return false
		}
		for _, k := range keys {
			if bytes.EqualFold(k, key) {
				return false
			}
		}
		keys = append(keys, key)
		v, ok := p.value(0)
		params[string(key)] = v
		return ok
	})
	return params, ok
}

// members parses the members of an object whose '{' has been read, up to
// and including its '}'. member is called with each key, the position after
// its ':', and reads the value; it returns false to give up.
func (p *fastJSON) members(member func(key []byte) bool) bool {
	p.space()
	if p.i < len(p.b) && p.b[p.i] == '}' {
		p.i++
		return true
	}
	for {
		key, ok := p.plainString()
		if !ok || !p.byte(':') || !member(key) {
			return false
		}
		p.space()
		if p.i >= len(p.b) {
			return false
		}
		switch p.b[p.i] {
		case ',':
			p.i++
		case '}':
			p.i++
			return true
		default:
			return false
		}
	}
}

// array parses an array, calling elem at each element's start to read it.
// A null is not an array here.
func (p *fastJSON) array(elem func() bool) bool {
	if !p.byte('[') {
		return false
	}
	p.space()
	if p.i < len(p.b) && p.b[p.i] == ']' {
		p.i++
		return true
	}
	for {
		if !elem() {
			return false
		}
		p.space()
		if p.i >= len(p.b) {
			return false
		}
		switch p.b[p.i] {
		case ',':
			p.i++
		case ']':
			p.i++
			return true
		default:
			return false
		}
	}
}

// space skips JSON whitespace.
func (p *fastJSON) space() {
	for p.i < len(p.b) {
		switch p.b[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

// byte skips whitespace and reads c.
func (p *fastJSON) byte(c byte) bool {
	p.space()
	if p.i < len(p.b) && p.b[p.i] == c {
		p.i++
		return true
	}
	return false
}

// plainString reads a string without escapes or control characters, in
// valid UTF-8, and returns its bytes without the quotes: what encoding/json
// would decode it to.
func (p *fastJSON) plainString() ([]byte, bool) {
	if !p.byte('"') {
		return nil, false
	}
	start := p.i
	ascii := true
	for p.i < len(p.b) {
		c := p.b[p.i]
		switch {
		case c == '"':
			s := p.b[start:p.i]
			p.i++
			return s, ascii || utf8.Valid(s)
		case c == '\\' || c < 0x20:
			return nil, false
		case c >= utf8.RuneSelf:
			ascii = false
		}
		p.i++
	}
	return nil, false
}

// integer reads a JSON integer of at most 18 digits (no fraction, no
// exponent).
func (p *fastJSON) integer() (int64, bool) {
	p.space()
	neg := p.i < len(p.b) && p.b[p.i] == '-'
	if neg {
		p.i++
	}
	start := p.i
	var v int64
	for p.i < len(p.b) && p.b[p.i] >= '0' && p.b[p.i] <= '9' {
		v = v*10 + int64(p.b[p.i]-'0')
		p.i++
	}
	n := p.i - start
	switch {
	case n == 0 || n > 18, n > 1 && p.b[start] == '0':
		return 0, false
	case p.i < len(p.b) && (p.b[p.i] == '.' || p.b[p.i] == 'e' || p.b[p.i] == 'E'):
		return 0, false
	}
	if neg {
		v = -v
	}
	return v, true
}

// value reads a string, number, true, false or array of those (depth
// arrays deep already) and returns its bytes. Objects and null give up.
func (p *fastJSON) value(depth int) ([]byte, bool) {
	p.space()
	if p.i >= len(p.b) {
		return nil, false
	}
	start := p.i
	var ok bool
	switch c := p.b[p.i]; {
	case c == '[':
		if depth == maxFastDepth {
			return nil, false
		}
		if p.flatNumbers() {
			return p.b[start:p.i], true
		}
		ok = p.array(func() bool {
			_, ok := p.value(depth + 1)
			return ok
		})
	case c == '"':
		ok = p.rawString()
	case c == '-' || c >= '0' && c <= '9':
		ok = p.number()
	case c == 't':
		ok = p.word("true")
	case c == 'f':
		ok = p.word("false")
	}
	return p.b[start:p.i], ok
}

// flatNumbers reads an array of numbers only, the shape of nearly every
// data array, in one loop, as array and value would read it; it reports
// false, with p where it was, for anything else, which they then read.
func (p *fastJSON) flatNumbers() bool {
	start := p.i
	p.i++ // the '['
	p.space()
	if p.i < len(p.b) && p.b[p.i] == ']' {
		p.i++
		return true
	}
	for {
		p.space()
		if p.i >= len(p.b) || p.b[p.i] != '-' && (p.b[p.i] < '0' || p.b[p.i] > '9') || !p.number() {
			p.i = start
			return false
		}
		p.space()
		if p.i >= len(p.b) {
			p.i = start
			return false
		}
		switch p.b[p.i] {
		case ',':
			p.i++
		case ']':
			p.i++
			return true
		default:
			p.i = start
			return false
		}
	}
}

// word reads the literal w.
func (p *fastJSON) word(w string) bool {
	if bytes.HasPrefix(p.b[p.i:], []byte(w)) {
		p.i += len(w)
		return true
	}
	return false
}

// rawString checks the grammar of a string: escapes are valid, there are no
// control characters. Its bytes are not decoded.
func (p *fastJSON) rawString() bool {
	p.i++ // the quote
	for p.i < len(p.b) {
		switch c := p.b[p.i]; {
		case c == '"':
			p.i++
			return true
		case c < 0x20:
			return false
		case c == '\\':
			if p.i+1 >= len(p.b) {
				return false
			}
			switch p.b[p.i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				p.i += 2
			case 'u':
				if _, ok := jsonHex4(p.b[p.i:]); !ok {
					return false
				}
				p.i += 6
			default:
				return false
			}
		default:
			p.i++
		}
	}
	return false
}

// number checks the grammar of a JSON number:
// -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func (p *fastJSON) number() bool {
	b := p.b
	i := p.i
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	default:
		return false
	}
	if i < len(b) && b[i] == '.' {
		i++
		d := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == d {
			return false
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		d := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == d {
			return false
		}
	}
	p.i = i
	return true
}
